"""One RPC's cost as the orchestrator sees it (`Call`): what the cost book, the tallies and the
rounds' figures read."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Call:
    """Cost of one RPC (or of a chunked request's RPCs, summed) as seen from the orchestrator."""

    rpc_ms: float  # client-side: serialize + wire + server + deserialize
    server_ms: float  # the service's own total_ms
    bytes_sent: int
    bytes_received: int
    serialize_ms: float = 0.0  # encoding the request + decoding the response, here
    # The service's forward and its batch (ServerTiming; rows/tokens 0 from a service that
    # does not batch), and the tokens this call sent: the goodput k's cost inputs.
    forward_ms: float = 0.0
    batch_rows: int = 0
    batch_tokens: int = 0
    tokens: int = 0
    forwards: int = 0  # forward passes forward_ms sums (0: a service that does not say)
    calls: int = 1  # > 1: a chunked request's calls, summed

    @property
    def network_ms(self) -> float:
        """Wire, gRPC and the service's own (de)serialization (outside its timer)."""
        return max(0.0, self.rpc_ms - self.server_ms - self.serialize_ms)

    def __add__(self, other: Call) -> Call:
        return Call(self.rpc_ms + other.rpc_ms, self.server_ms + other.server_ms,
                    self.bytes_sent + other.bytes_sent, self.bytes_received + other.bytes_received,
                    self.serialize_ms + other.serialize_ms, self.forward_ms + other.forward_ms,
                    max(self.batch_rows, other.batch_rows), max(self.batch_tokens, other.batch_tokens),
                    self.tokens + other.tokens, self.forwards + other.forwards, self.calls + other.calls)
