"""Redis over TLS (rediss://, TLS settings in the URL query) with a password from the environment;
errors name neither the URL nor the password."""
from __future__ import annotations

import asyncio
import shutil
import subprocess

import pytest

from specdec.runtime import procs
from specdec.runtime.store import StoreUnavailable, connect, SessionStore
from tests.security.conftest import wait_listening

PASSWORD = "a-redis-password-for-the-test"


@pytest.fixture(scope="module")
def tls_redis(pki, tmp_path_factory):
    if shutil.which("redis-server") is None:
        pytest.skip("redis-server is not installed")
    port = procs.free_port()
    folder = tmp_path_factory.mktemp("redis-tls")
    proc = subprocess.Popen(
        ["redis-server", "--port", "0", "--tls-port", str(port), "--bind", "127.0.0.1",
         "--tls-cert-file", str(pki.server_cert), "--tls-key-file", str(pki.server_key),
         "--tls-ca-cert-file", str(pki.ca), "--tls-auth-clients", "no", "--requirepass", PASSWORD,
         "--save", "", "--appendonly", "no", "--dir", str(folder)],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    wait_listening(port, proc)
    yield port
    proc.terminate()
    proc.wait(timeout=10)


def test_rediss_with_a_password_from_the_environment(tls_redis, pki, monkeypatch) -> None:
    url = f"rediss://127.0.0.1:{tls_redis}/0?ssl_ca_certs={pki.ca}"

    async def ping(url: str) -> None:
        client = connect(url)
        try:
            await SessionStore(client, url=url, prefix="t:").ping()
        finally:
            await client.aclose()

    with pytest.raises(StoreUnavailable):  # no password
        asyncio.run(ping(url))
    monkeypatch.setenv("SPECDEC_REDIS_PASSWORD", PASSWORD)
    asyncio.run(ping(url))
    # Plaintext to the TLS port fails, and the error text has neither URL nor password.
    leaky = f"redis://:{PASSWORD}@127.0.0.1:{tls_redis}/0"
    with pytest.raises(StoreUnavailable) as err:
        asyncio.run(ping(leaky))
    assert PASSWORD not in str(err.value) and "127.0.0.1" not in str(err.value)
    assert PASSWORD not in err.value.detail and "***" in err.value.detail
