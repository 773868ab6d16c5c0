"""What the loop is given: one validated request (`TurnRequest`) and the process's `LoopConfig`.

Everything the loop talks to (the session store, the router and through it
the model-service clients) comes in the config, so tests drive the real loop
with in-memory fakes.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from orchestrator.common.kinds import DRAFT
from orchestrator.common.grammar import CompiledGrammar, Constraint
from specdec.core.predicted_output import PredictionIndex
from specdec.core.sampling import SamplingParams
from specdec.runtime.wire import sampling_to_proto
from specdec.v1 import common_pb2


@dataclass(frozen=True)
class TurnRequest:
    """A validated generation request, in token ids."""

    prompt_ids: tuple[int, ...]
    max_new_tokens: int
    sampling: SamplingParams
    seed: int  # 0 = pick one at random (reported in the stats)
    stop: tuple[str, ...] = ()
    proposer: str = DRAFT
    k: int = 0  # 0 = the config's default (or adaptive)
    guess_ids: tuple[int, ...] = ()  # GUESS: the guess; PREDICTED_OUTPUT: the prediction
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
    # Built once per request off the event loop (orchestrator.api.bounds.prepare), shared by its
    # choices: the constraint's compiled grammar and the prediction's n-gram index.
    grammar: CompiledGrammar | None = field(default=None, compare=False, repr=False)
    prediction: PredictionIndex | None = field(default=None, compare=False, repr=False)
    # vLLM's request extensions (orchestrator.round.output, hooks.MinTokensHook).
    min_tokens: int = 0  # no end token (EOS, stop_token_ids) among the first this many
    stop_token_ids: tuple[int, ...] = ()  # end the turn like an EOS (finish "stop")
    keep_special_tokens: bool = False  # special tokens' text in the output
    include_stop_str_in_output: bool = False  # the text that ended the turn is output too


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
