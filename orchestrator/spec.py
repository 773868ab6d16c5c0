"""What the loop is given: one validated request (`GenerateSpec`) and the process's `LoopConfig`.

Everything the loop talks to (the session store, the router and through it
the model-service clients) comes in the config, so tests drive the real loop
with in-memory fakes.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol

from orchestrator.capacity import TargetAdmission
from orchestrator.costs import CostBook
from orchestrator.features import RelayCache
from orchestrator.grammar import Constraint, Grammars
from orchestrator.kinds import COMBINED, DRAFT, GUESS, KINDS, LOOKUP, NONE, PREDICTION  # noqa: F401 - re-exported
from orchestrator.routing import Router
from specdec.core.sampling import SamplingParams
from specdec.runtime.store import SessionRecord
from specdec.v1 import common_pb2
from specdec.runtime.wire import sampling_to_proto


@dataclass(frozen=True)
class GenerateSpec:
    """A validated generation request, in token ids."""

    prompt_ids: tuple[int, ...]
    max_new_tokens: int
    sampling: SamplingParams
    seed: int  # 0 = pick one at random (reported in the stats)
    stop: tuple[str, ...] = ()
    proposer: str = DRAFT
    k: int = 0  # 0 = the config's default (or adaptive)
    guess_ids: tuple[int, ...] = ()  # GUESS: the guess; PREDICTION: the prediction
    session_id: str = ""  # "" = a new session
    strict: bool = False
    tenant: str = ""  # the authenticated caller; a session is only ever visible to its own
    parallel: bool | None = None  # draft the next round during this one's verify; None = the config's
    keep_session: bool = False  # keep the record for later turns; else deleted when the stream ends
    resume_from: int = 0  # > 0: a resume; the turn continues after `delivered`
    delivered: tuple[int, ...] | None = None  # a resume: the generated tokens the client has (None: not sent)
    round_tokens: bool = False  # each chunk carries its round's drafted/accepted tokens
    max_target_passes: int = 0  # > 0: finish ("passes") after this many target passes
    ignore_eos: bool = False  # an EOS commits like any token: exactly max_new_tokens (load tests)
    constraint: Constraint | None = None  # structured output: the grammar every token follows
    logprobs: bool = False  # each chunk carries its tokens' log-probabilities
    top_logprobs: int = 0  # ... and this many alternatives each (0..20)
    index: int = 0  # the choice this turn is (GenerateRequest.n); its seed is already derived
    # Sampled by the coupled sampler (specdec.core.verify); LoopConfig.couples decides.
    coupled: bool = False


@dataclass(frozen=True)
class WireSampling:
    """A request's sampling parameters and their wire form, encoded once per request."""

    params: SamplingParams
    message: common_pb2.SamplingParams
    # OUTPUT_MODE_TOKENS when greedy (ids only), OUTPUT_MODE_COUPLED for the coupled sampler
    # (ids only: the services draw), else OUTPUT_MODE_PROBS (rejection sampling on p and q)
    output_mode: int

    @property
    def coupled(self) -> bool:
        return self.output_mode == common_pb2.OUTPUT_MODE_COUPLED

    @classmethod
    def encode(cls, params: SamplingParams, coupled: bool = False) -> WireSampling:
        if params.greedy:
            mode = common_pb2.OUTPUT_MODE_TOKENS
        else:
            mode = common_pb2.OUTPUT_MODE_COUPLED if coupled else common_pb2.OUTPUT_MODE_PROBS
        return cls(params, sampling_to_proto(params), mode)


class RecordStore(Protocol):
    """Where session records live (specdec.runtime.store.SessionStore in Redis; a dict in tests)."""

    async def load(self, session_id: str) -> SessionRecord | None: ...

    async def save(self, record: SessionRecord) -> SessionRecord: ...

    async def delete(self, session_id: str) -> bool: ...


@dataclass
class LoopConfig:
    """What the loop needs from the orchestrator process; built once at start-up."""

    store: RecordStore
    router: Router
    tokenizer: Any
    eos_ids: frozenset[int]
    context_length: int
    max_k: int = 16  # largest k both services accept
    target_max_k: int = 16  # largest k the target scores in one pass (bounds a Check guess)
    default_k: int = 5
    adaptive_k: bool = False  # k = 0 in a request: pick k per round for goodput (loop._adaptive_k)
    costs: CostBook = field(default_factory=CostBook)  # per-replica forward costs, from every call
    # New streams' target places, by measured capacity (orchestrator.capacity); None: the default
    # policy over `costs`.
    admission: TargetAdmission | None = None
    default_proposer: str = COMBINED
    parallel: bool = False  # requests that do not say: parallel speculation (orchestrator.parallel)
    max_new_tokens_limit: int = 4096
    target_wait_s: float = 10.0  # how long a round (or a new session) waits for some target replica
    redis_outage_s: float = 5.0  # a Redis outage up to this long is invisible to streams
    redis_retry_s: float = 300.0  # how long a record write is retried after its stream gave up
    # A round's state is written only if the last write was submitted this long ago (the
    # turn's last state always is): fast rounds share writes, slow ones each get theirs.
    record_interval_s: float = 0.2
    # Requests without a k draft only where drafting measured faster on the target replica.
    speculation_gate: bool = True
    # How sampled requests verify: "auto" = coupled when seeded, rejection sampling when not;
    # "coupled" or "rejection" for all (GenerateSpec.coupled; docs/api.md).
    sampler: str = "auto"

    def couples(self, params: SamplingParams, seed: int) -> bool:
        """Whether a sampled request with this seed (0 = none given) uses the coupled sampler."""
        if params.greedy:
            return False
        return self.sampler == "coupled" or (self.sampler == "auto" and seed != 0)
    vocab_size: int = 0  # the target's (ModelInfo.vocab_size): the width of grammar masks
    grammars: Grammars | None = None  # built from the tokenizer when None
    # Feature drafts: multi-turn sessions' feature relays between turns (orchestrator.features).
    relays: RelayCache = field(default_factory=RelayCache)

    def __post_init__(self) -> None:
        if self.admission is None:
            self.admission = TargetAdmission(costs=self.costs)
        if self.grammars is None:
            self.grammars = Grammars(self.tokenizer, self.vocab_size, self.eos_ids)
