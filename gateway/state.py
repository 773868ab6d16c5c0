"""What the routes share, once per app: the settings and the orchestrator's client and channel.

`create_app` puts one `Gateway` on `app.state.gateway`; a route reaches it with `of(request)`.
"""
from __future__ import annotations

import time
from dataclasses import dataclass

import grpc
from starlette.requests import Request

from client import AsyncClient
from gateway.guard import LOCAL_HOSTS, Credentials, TokenVerdicts
from gateway.responses.kept import RECORD_TTL_S, ResponseStore
from gateway.playground import Playground, PlaygroundSettings
from gateway.served import Served


@dataclass(frozen=True)
class Settings:
    orchestrator: str = "127.0.0.1:50050"  # several, comma-separated: orchestrators over one fleet
    spread: bool = True  # several: each new stream on the next in turn (client.AsyncClient's spread)
    multiplex: bool = True  # generations over one GenerateMany stream per orchestrator (client.multiplex)
    served_model_names: tuple[str, ...] = ()  # ids (the first the primary); () = the target's name
    default_max_tokens: int = 256        # when a request gives neither max_tokens form
    timeout_s: float = 600.0             # deadline of one Generate call
    grace_s: float = 10.0                # streams get this long to finish on SIGTERM
    tls_ca: str | None = None            # CA of the orchestrator's certificate (TLS to it)
    tls_cert: str | None = None          # client certificate for mutual TLS
    tls_key: str | None = None
    playground: PlaygroundSettings | None = PlaygroundSettings()  # None: no /playground
    max_body_bytes: int = 4 << 20        # a larger request body is a 413, refused as it is read
    body_timeout_s: float = 30.0         # a body whose next part takes longer is a 408
    max_whole_response_bytes: int = 64 << 20  # worst case of a response not streamed (gateway.generation)
    allowed_hosts: frozenset[str] | None = frozenset(LOCAL_HOSTS)  # None: any (see gateway.guard)
    responses_ttl_s: float = RECORD_TTL_S  # a stored response's record (gateway.responses.kept)
    max_stored_responses: int = 10000


class Gateway:
    """One app's shared state; `client` and `channel` exist while the app runs (its lifespan);
    `stored` holds /v1/responses' records."""

    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self.created = int(time.time())  # the model card's `created`
        self.credentials = Credentials()  # whether the orchestrator requires a token
        self.verdicts = TokenVerdicts()  # and if so, what it says of each caller's token
        self.served = Served(settings.served_model_names)  # the model ids, the target's name and context
        self.playground = Playground(settings.playground) if settings.playground is not None else None
        self.stored = ResponseStore(settings.responses_ttl_s, settings.max_stored_responses)
        self.client: AsyncClient | None = None  # Generate streams (and the channels under them)

    @property
    def channel(self) -> grpc.aio.Channel | None:
        """Health, Check, Predict, EndSession: the client's current orchestrator (the first that
        answered a stream)."""
        return self.client.channel if self.client is not None else None

    def open(self) -> None:
        s = self.settings
        self.client = AsyncClient(s.orchestrator, timeout=s.timeout_s, spread=s.spread,
                                  multiplex=s.multiplex,
                                  ca=s.tls_ca, cert=s.tls_cert, key=s.tls_key)

    async def close(self) -> None:
        await self.client.close()


def of(request: Request) -> Gateway:
    """The app's Gateway, from inside a route."""
    return request.app.state.gateway
