from specdec.v1 import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class Proposer(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    PROPOSER_UNSPECIFIED: _ClassVar[Proposer]
    PROPOSER_DRAFT: _ClassVar[Proposer]
    PROPOSER_LOOKUP: _ClassVar[Proposer]
    PROPOSER_GUESS: _ClassVar[Proposer]
    PROPOSER_NONE: _ClassVar[Proposer]
    PROPOSER_COMBINED: _ClassVar[Proposer]

class Speculation(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    SPECULATION_UNSPECIFIED: _ClassVar[Speculation]
    SPECULATION_SEQUENTIAL: _ClassVar[Speculation]
    SPECULATION_PARALLEL: _ClassVar[Speculation]
PROPOSER_UNSPECIFIED: Proposer
PROPOSER_DRAFT: Proposer
PROPOSER_LOOKUP: Proposer
PROPOSER_GUESS: Proposer
PROPOSER_NONE: Proposer
PROPOSER_COMBINED: Proposer
SPECULATION_UNSPECIFIED: Speculation
SPECULATION_SEQUENTIAL: Speculation
SPECULATION_PARALLEL: Speculation

class ChatMessage(_message.Message):
    __slots__ = ("role", "content", "tool_calls", "tool_call_id", "name")
    ROLE_FIELD_NUMBER: _ClassVar[int]
    CONTENT_FIELD_NUMBER: _ClassVar[int]
    TOOL_CALLS_FIELD_NUMBER: _ClassVar[int]
    TOOL_CALL_ID_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    role: str
    content: str
    tool_calls: str
    tool_call_id: str
    name: str
    def __init__(self, role: _Optional[str] = ..., content: _Optional[str] = ..., tool_calls: _Optional[str] = ..., tool_call_id: _Optional[str] = ..., name: _Optional[str] = ...) -> None: ...

class GenerateRequest(_message.Message):
    __slots__ = ("prompt", "messages", "max_new_tokens", "sampling", "seed", "stop", "proposer", "k", "guess", "session_id", "strict", "keep_session", "resume_from", "speculation", "round_tokens", "max_target_passes", "constraint", "logprobs", "top_logprobs", "prediction", "n", "ignore_eos", "delivered", "min_tokens", "stop_token_ids", "keep_special_tokens", "include_stop_str_in_output", "tools", "proposer_name")
    PROMPT_FIELD_NUMBER: _ClassVar[int]
    MESSAGES_FIELD_NUMBER: _ClassVar[int]
    MAX_NEW_TOKENS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    STOP_FIELD_NUMBER: _ClassVar[int]
    PROPOSER_FIELD_NUMBER: _ClassVar[int]
    K_FIELD_NUMBER: _ClassVar[int]
    GUESS_FIELD_NUMBER: _ClassVar[int]
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    STRICT_FIELD_NUMBER: _ClassVar[int]
    KEEP_SESSION_FIELD_NUMBER: _ClassVar[int]
    RESUME_FROM_FIELD_NUMBER: _ClassVar[int]
    SPECULATION_FIELD_NUMBER: _ClassVar[int]
    ROUND_TOKENS_FIELD_NUMBER: _ClassVar[int]
    MAX_TARGET_PASSES_FIELD_NUMBER: _ClassVar[int]
    CONSTRAINT_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    TOP_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    PREDICTION_FIELD_NUMBER: _ClassVar[int]
    N_FIELD_NUMBER: _ClassVar[int]
    IGNORE_EOS_FIELD_NUMBER: _ClassVar[int]
    DELIVERED_FIELD_NUMBER: _ClassVar[int]
    MIN_TOKENS_FIELD_NUMBER: _ClassVar[int]
    STOP_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    KEEP_SPECIAL_TOKENS_FIELD_NUMBER: _ClassVar[int]
    INCLUDE_STOP_STR_IN_OUTPUT_FIELD_NUMBER: _ClassVar[int]
    TOOLS_FIELD_NUMBER: _ClassVar[int]
    PROPOSER_NAME_FIELD_NUMBER: _ClassVar[int]
    prompt: str
    messages: _containers.RepeatedCompositeFieldContainer[ChatMessage]
    max_new_tokens: int
    sampling: _common_pb2.SamplingParams
    seed: int
    stop: _containers.RepeatedScalarFieldContainer[str]
    proposer: Proposer
    k: int
    guess: str
    session_id: str
    strict: bool
    keep_session: bool
    resume_from: int
    speculation: Speculation
    round_tokens: bool
    max_target_passes: int
    constraint: Constraint
    logprobs: bool
    top_logprobs: int
    prediction: str
    n: int
    ignore_eos: bool
    delivered: _containers.RepeatedCompositeFieldContainer[Delivered]
    min_tokens: int
    stop_token_ids: _containers.RepeatedScalarFieldContainer[int]
    keep_special_tokens: bool
    include_stop_str_in_output: bool
    tools: str
    proposer_name: str
    def __init__(self, prompt: _Optional[str] = ..., messages: _Optional[_Iterable[_Union[ChatMessage, _Mapping]]] = ..., max_new_tokens: _Optional[int] = ..., sampling: _Optional[_Union[_common_pb2.SamplingParams, _Mapping]] = ..., seed: _Optional[int] = ..., stop: _Optional[_Iterable[str]] = ..., proposer: _Optional[_Union[Proposer, str]] = ..., k: _Optional[int] = ..., guess: _Optional[str] = ..., session_id: _Optional[str] = ..., strict: _Optional[bool] = ..., keep_session: _Optional[bool] = ..., resume_from: _Optional[int] = ..., speculation: _Optional[_Union[Speculation, str]] = ..., round_tokens: _Optional[bool] = ..., max_target_passes: _Optional[int] = ..., constraint: _Optional[_Union[Constraint, _Mapping]] = ..., logprobs: _Optional[bool] = ..., top_logprobs: _Optional[int] = ..., prediction: _Optional[str] = ..., n: _Optional[int] = ..., ignore_eos: _Optional[bool] = ..., delivered: _Optional[_Iterable[_Union[Delivered, _Mapping]]] = ..., min_tokens: _Optional[int] = ..., stop_token_ids: _Optional[_Iterable[int]] = ..., keep_special_tokens: _Optional[bool] = ..., include_stop_str_in_output: _Optional[bool] = ..., tools: _Optional[str] = ..., proposer_name: _Optional[str] = ...) -> None: ...

class Delivered(_message.Message):
    __slots__ = ("index", "token_ids", "finished")
    INDEX_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    FINISHED_FIELD_NUMBER: _ClassVar[int]
    index: int
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    finished: bool
    def __init__(self, index: _Optional[int] = ..., token_ids: _Optional[_Iterable[int]] = ..., finished: _Optional[bool] = ...) -> None: ...

class Constraint(_message.Message):
    __slots__ = ("json_schema", "json_object", "regex", "lark")
    JSON_SCHEMA_FIELD_NUMBER: _ClassVar[int]
    JSON_OBJECT_FIELD_NUMBER: _ClassVar[int]
    REGEX_FIELD_NUMBER: _ClassVar[int]
    LARK_FIELD_NUMBER: _ClassVar[int]
    json_schema: str
    json_object: bool
    regex: str
    lark: str
    def __init__(self, json_schema: _Optional[str] = ..., json_object: _Optional[bool] = ..., regex: _Optional[str] = ..., lark: _Optional[str] = ...) -> None: ...

class TokenLogprob(_message.Message):
    __slots__ = ("token_id", "logprob", "top_ids", "top_logprobs", "token_bytes", "top_bytes")
    TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    LOGPROB_FIELD_NUMBER: _ClassVar[int]
    TOP_IDS_FIELD_NUMBER: _ClassVar[int]
    TOP_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    TOKEN_BYTES_FIELD_NUMBER: _ClassVar[int]
    TOP_BYTES_FIELD_NUMBER: _ClassVar[int]
    token_id: int
    logprob: float
    top_ids: _containers.RepeatedScalarFieldContainer[int]
    top_logprobs: _containers.RepeatedScalarFieldContainer[float]
    token_bytes: bytes
    top_bytes: _containers.RepeatedScalarFieldContainer[bytes]
    def __init__(self, token_id: _Optional[int] = ..., logprob: _Optional[float] = ..., top_ids: _Optional[_Iterable[int]] = ..., top_logprobs: _Optional[_Iterable[float]] = ..., token_bytes: _Optional[bytes] = ..., top_bytes: _Optional[_Iterable[bytes]] = ...) -> None: ...

class Chunk(_message.Message):
    __slots__ = ("text", "token_ids", "start_index", "session_id", "round", "logprobs", "index")
    TEXT_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    START_INDEX_FIELD_NUMBER: _ClassVar[int]
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    ROUND_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    INDEX_FIELD_NUMBER: _ClassVar[int]
    text: str
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    start_index: int
    session_id: str
    round: RoundTokens
    logprobs: _containers.RepeatedCompositeFieldContainer[TokenLogprob]
    index: int
    def __init__(self, text: _Optional[str] = ..., token_ids: _Optional[_Iterable[int]] = ..., start_index: _Optional[int] = ..., session_id: _Optional[str] = ..., round: _Optional[_Union[RoundTokens, _Mapping]] = ..., logprobs: _Optional[_Iterable[_Union[TokenLogprob, _Mapping]]] = ..., index: _Optional[int] = ...) -> None: ...

class RoundTokens(_message.Message):
    __slots__ = ("round", "source", "drafted_ids", "drafted_texts", "accepted", "extra_kind", "token_texts")
    ROUND_FIELD_NUMBER: _ClassVar[int]
    SOURCE_FIELD_NUMBER: _ClassVar[int]
    DRAFTED_IDS_FIELD_NUMBER: _ClassVar[int]
    DRAFTED_TEXTS_FIELD_NUMBER: _ClassVar[int]
    ACCEPTED_FIELD_NUMBER: _ClassVar[int]
    EXTRA_KIND_FIELD_NUMBER: _ClassVar[int]
    TOKEN_TEXTS_FIELD_NUMBER: _ClassVar[int]
    round: int
    source: str
    drafted_ids: _containers.RepeatedScalarFieldContainer[int]
    drafted_texts: _containers.RepeatedScalarFieldContainer[str]
    accepted: int
    extra_kind: str
    token_texts: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, round: _Optional[int] = ..., source: _Optional[str] = ..., drafted_ids: _Optional[_Iterable[int]] = ..., drafted_texts: _Optional[_Iterable[str]] = ..., accepted: _Optional[int] = ..., extra_kind: _Optional[str] = ..., token_texts: _Optional[_Iterable[str]] = ...) -> None: ...

class Stats(_message.Message):
    __slots__ = ("session_id", "finish_reason", "proposer", "fallback_reason", "prompt_tokens", "reused_prompt_tokens", "new_tokens", "target_passes", "draft_calls", "drafted_tokens", "accepted_tokens", "acceptance_rate", "accepted_per_round", "acceptance_by_position", "cache_misses", "ttft_ms", "total_ms", "draft_ms", "target_ms", "network_ms", "orchestrator_ms", "redis_ms", "bytes_sent", "bytes_received", "seed", "target_replica", "draft_replica", "overhead_p50_ms", "drafted_per_round", "serialize_ms", "rounds", "pre_draft_hits", "pre_draft_misses", "draft_hidden_ms", "deadline_misses", "accepted_prediction_tokens", "rejected_prediction_tokens", "index", "feature_bytes", "accepted_by_rank")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    PROPOSER_FIELD_NUMBER: _ClassVar[int]
    FALLBACK_REASON_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    REUSED_PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    NEW_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TARGET_PASSES_FIELD_NUMBER: _ClassVar[int]
    DRAFT_CALLS_FIELD_NUMBER: _ClassVar[int]
    DRAFTED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    ACCEPTED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    ACCEPTANCE_RATE_FIELD_NUMBER: _ClassVar[int]
    ACCEPTED_PER_ROUND_FIELD_NUMBER: _ClassVar[int]
    ACCEPTANCE_BY_POSITION_FIELD_NUMBER: _ClassVar[int]
    CACHE_MISSES_FIELD_NUMBER: _ClassVar[int]
    TTFT_MS_FIELD_NUMBER: _ClassVar[int]
    TOTAL_MS_FIELD_NUMBER: _ClassVar[int]
    DRAFT_MS_FIELD_NUMBER: _ClassVar[int]
    TARGET_MS_FIELD_NUMBER: _ClassVar[int]
    NETWORK_MS_FIELD_NUMBER: _ClassVar[int]
    ORCHESTRATOR_MS_FIELD_NUMBER: _ClassVar[int]
    REDIS_MS_FIELD_NUMBER: _ClassVar[int]
    BYTES_SENT_FIELD_NUMBER: _ClassVar[int]
    BYTES_RECEIVED_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    TARGET_REPLICA_FIELD_NUMBER: _ClassVar[int]
    DRAFT_REPLICA_FIELD_NUMBER: _ClassVar[int]
    OVERHEAD_P50_MS_FIELD_NUMBER: _ClassVar[int]
    DRAFTED_PER_ROUND_FIELD_NUMBER: _ClassVar[int]
    SERIALIZE_MS_FIELD_NUMBER: _ClassVar[int]
    ROUNDS_FIELD_NUMBER: _ClassVar[int]
    PRE_DRAFT_HITS_FIELD_NUMBER: _ClassVar[int]
    PRE_DRAFT_MISSES_FIELD_NUMBER: _ClassVar[int]
    DRAFT_HIDDEN_MS_FIELD_NUMBER: _ClassVar[int]
    DEADLINE_MISSES_FIELD_NUMBER: _ClassVar[int]
    ACCEPTED_PREDICTION_TOKENS_FIELD_NUMBER: _ClassVar[int]
    REJECTED_PREDICTION_TOKENS_FIELD_NUMBER: _ClassVar[int]
    INDEX_FIELD_NUMBER: _ClassVar[int]
    FEATURE_BYTES_FIELD_NUMBER: _ClassVar[int]
    ACCEPTED_BY_RANK_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    finish_reason: str
    proposer: str
    fallback_reason: str
    prompt_tokens: int
    reused_prompt_tokens: int
    new_tokens: int
    target_passes: int
    draft_calls: int
    drafted_tokens: int
    accepted_tokens: int
    acceptance_rate: float
    accepted_per_round: _containers.RepeatedScalarFieldContainer[int]
    acceptance_by_position: _containers.RepeatedScalarFieldContainer[float]
    cache_misses: int
    ttft_ms: float
    total_ms: float
    draft_ms: float
    target_ms: float
    network_ms: float
    orchestrator_ms: float
    redis_ms: float
    bytes_sent: int
    bytes_received: int
    seed: int
    target_replica: str
    draft_replica: str
    overhead_p50_ms: float
    drafted_per_round: _containers.RepeatedScalarFieldContainer[int]
    serialize_ms: float
    rounds: _containers.RepeatedCompositeFieldContainer[Round]
    pre_draft_hits: int
    pre_draft_misses: int
    draft_hidden_ms: float
    deadline_misses: int
    accepted_prediction_tokens: int
    rejected_prediction_tokens: int
    index: int
    feature_bytes: int
    accepted_by_rank: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, session_id: _Optional[str] = ..., finish_reason: _Optional[str] = ..., proposer: _Optional[str] = ..., fallback_reason: _Optional[str] = ..., prompt_tokens: _Optional[int] = ..., reused_prompt_tokens: _Optional[int] = ..., new_tokens: _Optional[int] = ..., target_passes: _Optional[int] = ..., draft_calls: _Optional[int] = ..., drafted_tokens: _Optional[int] = ..., accepted_tokens: _Optional[int] = ..., acceptance_rate: _Optional[float] = ..., accepted_per_round: _Optional[_Iterable[int]] = ..., acceptance_by_position: _Optional[_Iterable[float]] = ..., cache_misses: _Optional[int] = ..., ttft_ms: _Optional[float] = ..., total_ms: _Optional[float] = ..., draft_ms: _Optional[float] = ..., target_ms: _Optional[float] = ..., network_ms: _Optional[float] = ..., orchestrator_ms: _Optional[float] = ..., redis_ms: _Optional[float] = ..., bytes_sent: _Optional[int] = ..., bytes_received: _Optional[int] = ..., seed: _Optional[int] = ..., target_replica: _Optional[str] = ..., draft_replica: _Optional[str] = ..., overhead_p50_ms: _Optional[float] = ..., drafted_per_round: _Optional[_Iterable[int]] = ..., serialize_ms: _Optional[float] = ..., rounds: _Optional[_Iterable[_Union[Round, _Mapping]]] = ..., pre_draft_hits: _Optional[int] = ..., pre_draft_misses: _Optional[int] = ..., draft_hidden_ms: _Optional[float] = ..., deadline_misses: _Optional[int] = ..., accepted_prediction_tokens: _Optional[int] = ..., rejected_prediction_tokens: _Optional[int] = ..., index: _Optional[int] = ..., feature_bytes: _Optional[int] = ..., accepted_by_rank: _Optional[_Iterable[int]] = ...) -> None: ...

class Round(_message.Message):
    __slots__ = ("k", "drafted", "accepted", "committed", "total_ms", "draft_ms", "target_ms", "serialize_ms", "network_ms", "orchestrator_ms", "redis_ms", "redis_write_ms", "bytes_sent", "bytes_received", "cache_misses", "pre_drafted", "pre_draft_discarded", "draft_hidden_ms", "source", "deadline_misses", "feature_bytes", "tree", "accepted_ranks")
    K_FIELD_NUMBER: _ClassVar[int]
    DRAFTED_FIELD_NUMBER: _ClassVar[int]
    ACCEPTED_FIELD_NUMBER: _ClassVar[int]
    COMMITTED_FIELD_NUMBER: _ClassVar[int]
    TOTAL_MS_FIELD_NUMBER: _ClassVar[int]
    DRAFT_MS_FIELD_NUMBER: _ClassVar[int]
    TARGET_MS_FIELD_NUMBER: _ClassVar[int]
    SERIALIZE_MS_FIELD_NUMBER: _ClassVar[int]
    NETWORK_MS_FIELD_NUMBER: _ClassVar[int]
    ORCHESTRATOR_MS_FIELD_NUMBER: _ClassVar[int]
    REDIS_MS_FIELD_NUMBER: _ClassVar[int]
    REDIS_WRITE_MS_FIELD_NUMBER: _ClassVar[int]
    BYTES_SENT_FIELD_NUMBER: _ClassVar[int]
    BYTES_RECEIVED_FIELD_NUMBER: _ClassVar[int]
    CACHE_MISSES_FIELD_NUMBER: _ClassVar[int]
    PRE_DRAFTED_FIELD_NUMBER: _ClassVar[int]
    PRE_DRAFT_DISCARDED_FIELD_NUMBER: _ClassVar[int]
    DRAFT_HIDDEN_MS_FIELD_NUMBER: _ClassVar[int]
    SOURCE_FIELD_NUMBER: _ClassVar[int]
    DEADLINE_MISSES_FIELD_NUMBER: _ClassVar[int]
    FEATURE_BYTES_FIELD_NUMBER: _ClassVar[int]
    TREE_FIELD_NUMBER: _ClassVar[int]
    ACCEPTED_RANKS_FIELD_NUMBER: _ClassVar[int]
    k: int
    drafted: int
    accepted: int
    committed: int
    total_ms: float
    draft_ms: float
    target_ms: float
    serialize_ms: float
    network_ms: float
    orchestrator_ms: float
    redis_ms: float
    redis_write_ms: float
    bytes_sent: int
    bytes_received: int
    cache_misses: int
    pre_drafted: bool
    pre_draft_discarded: bool
    draft_hidden_ms: float
    source: str
    deadline_misses: int
    feature_bytes: int
    tree: bool
    accepted_ranks: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, k: _Optional[int] = ..., drafted: _Optional[int] = ..., accepted: _Optional[int] = ..., committed: _Optional[int] = ..., total_ms: _Optional[float] = ..., draft_ms: _Optional[float] = ..., target_ms: _Optional[float] = ..., serialize_ms: _Optional[float] = ..., network_ms: _Optional[float] = ..., orchestrator_ms: _Optional[float] = ..., redis_ms: _Optional[float] = ..., redis_write_ms: _Optional[float] = ..., bytes_sent: _Optional[int] = ..., bytes_received: _Optional[int] = ..., cache_misses: _Optional[int] = ..., pre_drafted: _Optional[bool] = ..., pre_draft_discarded: _Optional[bool] = ..., draft_hidden_ms: _Optional[float] = ..., source: _Optional[str] = ..., deadline_misses: _Optional[int] = ..., feature_bytes: _Optional[int] = ..., tree: _Optional[bool] = ..., accepted_ranks: _Optional[_Iterable[int]] = ...) -> None: ...

class GenerateResponse(_message.Message):
    __slots__ = ("chunk", "stats")
    CHUNK_FIELD_NUMBER: _ClassVar[int]
    STATS_FIELD_NUMBER: _ClassVar[int]
    chunk: Chunk
    stats: Stats
    def __init__(self, chunk: _Optional[_Union[Chunk, _Mapping]] = ..., stats: _Optional[_Union[Stats, _Mapping]] = ...) -> None: ...

class GenerateManyRequest(_message.Message):
    __slots__ = ("id", "request", "cancel")
    ID_FIELD_NUMBER: _ClassVar[int]
    REQUEST_FIELD_NUMBER: _ClassVar[int]
    CANCEL_FIELD_NUMBER: _ClassVar[int]
    id: int
    request: GenerateRequest
    cancel: bool
    def __init__(self, id: _Optional[int] = ..., request: _Optional[_Union[GenerateRequest, _Mapping]] = ..., cancel: _Optional[bool] = ...) -> None: ...

class TaggedResponse(_message.Message):
    __slots__ = ("id", "response", "code", "message", "end", "retry_after_s", "request_id")
    ID_FIELD_NUMBER: _ClassVar[int]
    RESPONSE_FIELD_NUMBER: _ClassVar[int]
    CODE_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    END_FIELD_NUMBER: _ClassVar[int]
    RETRY_AFTER_S_FIELD_NUMBER: _ClassVar[int]
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    id: int
    response: GenerateResponse
    code: int
    message: str
    end: bool
    retry_after_s: int
    request_id: str
    def __init__(self, id: _Optional[int] = ..., response: _Optional[_Union[GenerateResponse, _Mapping]] = ..., code: _Optional[int] = ..., message: _Optional[str] = ..., end: _Optional[bool] = ..., retry_after_s: _Optional[int] = ..., request_id: _Optional[str] = ...) -> None: ...

class GenerateManyResponse(_message.Message):
    __slots__ = ("events",)
    EVENTS_FIELD_NUMBER: _ClassVar[int]
    events: _containers.RepeatedCompositeFieldContainer[TaggedResponse]
    def __init__(self, events: _Optional[_Iterable[_Union[TaggedResponse, _Mapping]]] = ...) -> None: ...

class CheckRequest(_message.Message):
    __slots__ = ("prompt", "messages", "guess")
    PROMPT_FIELD_NUMBER: _ClassVar[int]
    MESSAGES_FIELD_NUMBER: _ClassVar[int]
    GUESS_FIELD_NUMBER: _ClassVar[int]
    prompt: str
    messages: _containers.RepeatedCompositeFieldContainer[ChatMessage]
    guess: str
    def __init__(self, prompt: _Optional[str] = ..., messages: _Optional[_Iterable[_Union[ChatMessage, _Mapping]]] = ..., guess: _Optional[str] = ...) -> None: ...

class TokenPrediction(_message.Message):
    __slots__ = ("position", "guess_id", "guess_text", "predicted_id", "predicted_text", "guess_prob", "predicted_prob")
    POSITION_FIELD_NUMBER: _ClassVar[int]
    GUESS_ID_FIELD_NUMBER: _ClassVar[int]
    GUESS_TEXT_FIELD_NUMBER: _ClassVar[int]
    PREDICTED_ID_FIELD_NUMBER: _ClassVar[int]
    PREDICTED_TEXT_FIELD_NUMBER: _ClassVar[int]
    GUESS_PROB_FIELD_NUMBER: _ClassVar[int]
    PREDICTED_PROB_FIELD_NUMBER: _ClassVar[int]
    position: int
    guess_id: int
    guess_text: str
    predicted_id: int
    predicted_text: str
    guess_prob: float
    predicted_prob: float
    def __init__(self, position: _Optional[int] = ..., guess_id: _Optional[int] = ..., guess_text: _Optional[str] = ..., predicted_id: _Optional[int] = ..., predicted_text: _Optional[str] = ..., guess_prob: _Optional[float] = ..., predicted_prob: _Optional[float] = ...) -> None: ...

class CheckResponse(_message.Message):
    __slots__ = ("accepted", "first_mismatch", "accepted_text", "target_text_at_mismatch", "positions", "next_id", "next_text")
    ACCEPTED_FIELD_NUMBER: _ClassVar[int]
    FIRST_MISMATCH_FIELD_NUMBER: _ClassVar[int]
    ACCEPTED_TEXT_FIELD_NUMBER: _ClassVar[int]
    TARGET_TEXT_AT_MISMATCH_FIELD_NUMBER: _ClassVar[int]
    POSITIONS_FIELD_NUMBER: _ClassVar[int]
    NEXT_ID_FIELD_NUMBER: _ClassVar[int]
    NEXT_TEXT_FIELD_NUMBER: _ClassVar[int]
    accepted: int
    first_mismatch: int
    accepted_text: str
    target_text_at_mismatch: str
    positions: _containers.RepeatedCompositeFieldContainer[TokenPrediction]
    next_id: int
    next_text: str
    def __init__(self, accepted: _Optional[int] = ..., first_mismatch: _Optional[int] = ..., accepted_text: _Optional[str] = ..., target_text_at_mismatch: _Optional[str] = ..., positions: _Optional[_Iterable[_Union[TokenPrediction, _Mapping]]] = ..., next_id: _Optional[int] = ..., next_text: _Optional[str] = ...) -> None: ...

class PredictRequest(_message.Message):
    __slots__ = ("text", "top_k", "sampling", "distributions")
    TEXT_FIELD_NUMBER: _ClassVar[int]
    TOP_K_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    DISTRIBUTIONS_FIELD_NUMBER: _ClassVar[int]
    text: str
    top_k: int
    sampling: _common_pb2.SamplingParams
    distributions: bool
    def __init__(self, text: _Optional[str] = ..., top_k: _Optional[int] = ..., sampling: _Optional[_Union[_common_pb2.SamplingParams, _Mapping]] = ..., distributions: _Optional[bool] = ...) -> None: ...

class Candidate(_message.Message):
    __slots__ = ("id", "text", "prob")
    ID_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    PROB_FIELD_NUMBER: _ClassVar[int]
    id: int
    text: str
    prob: float
    def __init__(self, id: _Optional[int] = ..., text: _Optional[str] = ..., prob: _Optional[float] = ...) -> None: ...

class PredictedToken(_message.Message):
    __slots__ = ("id", "text", "predicted", "prob")
    ID_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    PREDICTED_FIELD_NUMBER: _ClassVar[int]
    PROB_FIELD_NUMBER: _ClassVar[int]
    id: int
    text: str
    predicted: _containers.RepeatedCompositeFieldContainer[Candidate]
    prob: float
    def __init__(self, id: _Optional[int] = ..., text: _Optional[str] = ..., predicted: _Optional[_Iterable[_Union[Candidate, _Mapping]]] = ..., prob: _Optional[float] = ...) -> None: ...

class PredictResponse(_message.Message):
    __slots__ = ("tokens", "next", "target_next", "draft_next", "target_passes", "draft_calls")
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    NEXT_FIELD_NUMBER: _ClassVar[int]
    TARGET_NEXT_FIELD_NUMBER: _ClassVar[int]
    DRAFT_NEXT_FIELD_NUMBER: _ClassVar[int]
    TARGET_PASSES_FIELD_NUMBER: _ClassVar[int]
    DRAFT_CALLS_FIELD_NUMBER: _ClassVar[int]
    tokens: _containers.RepeatedCompositeFieldContainer[PredictedToken]
    next: _containers.RepeatedCompositeFieldContainer[Candidate]
    target_next: _common_pb2.Distributions
    draft_next: _common_pb2.Distributions
    target_passes: int
    draft_calls: int
    def __init__(self, tokens: _Optional[_Iterable[_Union[PredictedToken, _Mapping]]] = ..., next: _Optional[_Iterable[_Union[Candidate, _Mapping]]] = ..., target_next: _Optional[_Union[_common_pb2.Distributions, _Mapping]] = ..., draft_next: _Optional[_Union[_common_pb2.Distributions, _Mapping]] = ..., target_passes: _Optional[int] = ..., draft_calls: _Optional[int] = ...) -> None: ...

class EndSessionRequest(_message.Message):
    __slots__ = ("session_id",)
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    def __init__(self, session_id: _Optional[str] = ...) -> None: ...

class EndSessionResponse(_message.Message):
    __slots__ = ("existed",)
    EXISTED_FIELD_NUMBER: _ClassVar[int]
    existed: bool
    def __init__(self, existed: _Optional[bool] = ...) -> None: ...

class GetServedModelRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ServedModel(_message.Message):
    __slots__ = ("model_name", "context_length", "tool_call_format", "max_new_tokens_limit", "draft_mode", "proposers")
    MODEL_NAME_FIELD_NUMBER: _ClassVar[int]
    CONTEXT_LENGTH_FIELD_NUMBER: _ClassVar[int]
    TOOL_CALL_FORMAT_FIELD_NUMBER: _ClassVar[int]
    MAX_NEW_TOKENS_LIMIT_FIELD_NUMBER: _ClassVar[int]
    DRAFT_MODE_FIELD_NUMBER: _ClassVar[int]
    PROPOSERS_FIELD_NUMBER: _ClassVar[int]
    model_name: str
    context_length: int
    tool_call_format: str
    max_new_tokens_limit: int
    draft_mode: str
    proposers: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, model_name: _Optional[str] = ..., context_length: _Optional[int] = ..., tool_call_format: _Optional[str] = ..., max_new_tokens_limit: _Optional[int] = ..., draft_mode: _Optional[str] = ..., proposers: _Optional[_Iterable[str]] = ...) -> None: ...

class TokenizeRequest(_message.Message):
    __slots__ = ("prompt", "messages", "tools", "add_special_tokens", "return_token_strs")
    PROMPT_FIELD_NUMBER: _ClassVar[int]
    MESSAGES_FIELD_NUMBER: _ClassVar[int]
    TOOLS_FIELD_NUMBER: _ClassVar[int]
    ADD_SPECIAL_TOKENS_FIELD_NUMBER: _ClassVar[int]
    RETURN_TOKEN_STRS_FIELD_NUMBER: _ClassVar[int]
    prompt: str
    messages: _containers.RepeatedCompositeFieldContainer[ChatMessage]
    tools: str
    add_special_tokens: bool
    return_token_strs: bool
    def __init__(self, prompt: _Optional[str] = ..., messages: _Optional[_Iterable[_Union[ChatMessage, _Mapping]]] = ..., tools: _Optional[str] = ..., add_special_tokens: _Optional[bool] = ..., return_token_strs: _Optional[bool] = ...) -> None: ...

class TokenizeResponse(_message.Message):
    __slots__ = ("token_ids", "token_strs", "context_length")
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    TOKEN_STRS_FIELD_NUMBER: _ClassVar[int]
    CONTEXT_LENGTH_FIELD_NUMBER: _ClassVar[int]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    token_strs: _containers.RepeatedScalarFieldContainer[str]
    context_length: int
    def __init__(self, token_ids: _Optional[_Iterable[int]] = ..., token_strs: _Optional[_Iterable[str]] = ..., context_length: _Optional[int] = ...) -> None: ...

class DetokenizeRequest(_message.Message):
    __slots__ = ("token_ids",)
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, token_ids: _Optional[_Iterable[int]] = ...) -> None: ...

class DetokenizeResponse(_message.Message):
    __slots__ = ("text",)
    TEXT_FIELD_NUMBER: _ClassVar[int]
    text: str
    def __init__(self, text: _Optional[str] = ...) -> None: ...
