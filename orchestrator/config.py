"""What the loop is given besides the request: the process's `LoopConfig`, built once at start-up.

Everything the loop talks to (the session store, the router and through it
the model-service clients) comes in the config, so tests drive the real loop
with in-memory fakes.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol

from orchestrator.fleet.routing import Router
from orchestrator.policy.capacity import TargetAdmission
from orchestrator.policy.costs import CostBook
from orchestrator.proposers.features import RelayCache
from orchestrator.proposers.bridge import TextBridge
from orchestrator.proposers.registry import Homes
from orchestrator.common.kinds import COMBINED
from orchestrator.common.grammar import Grammars
from specdec.core.sampling import SamplingParams
from specdec.runtime.store import SessionRecord
from specdec.core.bounds import MAX_K


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
    model_name: str = ""  # the target's (ModelInfo.model_name): the served model's id
    max_k: int = MAX_K  # largest k both services accept
    target_max_k: int = MAX_K  # largest k the target scores in one pass (bounds a Check guess)
    default_k: int = 5
    adaptive_k: bool = False  # k = 0 in a request: pick k per round for goodput (loop._adaptive_k)
    costs: CostBook = field(default_factory=CostBook)  # per-replica forward costs, from every call
    # New streams' target places, by measured capacity (orchestrator.policy.capacity); None: the default
    # policy over `costs`.
    admission: TargetAdmission | None = None
    default_proposer: str = COMBINED
    parallel: bool = False  # requests that do not say: parallel speculation (orchestrator.proposers.parallel)
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
    # "coupled" or "rejection" for all (TurnRequest.coupled; docs/api.md).
    sampler: str = "auto"
    # Token trees (orchestrator.policy.drafting): turns that may branch draft a tree of at most
    # tree_nodes tokens, tree_width candidates per node; 0 = chains only.
    tree_nodes: int = 0
    tree_width: int = 0

    @property
    def draft_mode(self) -> str:
        """How drafts reach the target: "shared-vocabulary" or "text" (re-encoded across tokenizers)."""
        return "text" if self.bridge is not None else "shared-vocabulary"

    def couples(self, params: SamplingParams, seed: int) -> bool:
        """Whether a sampled request with this seed (0 = none given) uses the coupled sampler."""
        if params.greedy:
            return False
        return self.sampler == "coupled" or (self.sampler == "auto" and seed != 0)
    vocab_size: int = 0  # the target's (ModelInfo.vocab_size): the width of grammar masks
    grammars: Grammars | None = None  # built from the tokenizer when None
    # A draft with another tokenizer (--draft-tokenizer): the two tokenizers, which translate its drafts
    # (orchestrator.proposers.translated.TextBridge); None = the draft shares the target's vocabulary.
    bridge: TextBridge | None = None
    # Feature drafts: multi-turn sessions' feature relays between turns (orchestrator.proposers.features).
    relays: RelayCache = field(default_factory=RelayCache)
    # Each proposer kind's long-lived part, made on first use (orchestrator.proposers.registry):
    # the built-in kinds and installed plugins'.
    homes: Homes = field(default_factory=Homes)
    # Suffix decoding (orchestrator.proposers.suffix): token budget of its cache across requests.
    suffix_cache_tokens: int = 200_000

    def __post_init__(self) -> None:
        if self.admission is None:
            self.admission = TargetAdmission(costs=self.costs)
        if self.grammars is None:
            self.grammars = Grammars(self.tokenizer, self.vocab_size, self.eos_ids)
