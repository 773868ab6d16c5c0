from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class OutputMode(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    OUTPUT_MODE_UNSPECIFIED: _ClassVar[OutputMode]
    OUTPUT_MODE_TOKENS: _ClassVar[OutputMode]
    OUTPUT_MODE_PROBS: _ClassVar[OutputMode]
    OUTPUT_MODE_COUPLED: _ClassVar[OutputMode]

class FeatureEncoding(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    FEATURE_ENCODING_NONE: _ClassVar[FeatureEncoding]
    FEATURE_ENCODING_FLOAT16: _ClassVar[FeatureEncoding]
    FEATURE_ENCODING_FLOAT32: _ClassVar[FeatureEncoding]
    FEATURE_ENCODING_BFLOAT16: _ClassVar[FeatureEncoding]
OUTPUT_MODE_UNSPECIFIED: OutputMode
OUTPUT_MODE_TOKENS: OutputMode
OUTPUT_MODE_PROBS: OutputMode
OUTPUT_MODE_COUPLED: OutputMode
FEATURE_ENCODING_NONE: FeatureEncoding
FEATURE_ENCODING_FLOAT16: FeatureEncoding
FEATURE_ENCODING_FLOAT32: FeatureEncoding
FEATURE_ENCODING_BFLOAT16: FeatureEncoding

class SamplingParams(_message.Message):
    __slots__ = ("temperature", "top_k", "top_p", "min_p")
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    TOP_K_FIELD_NUMBER: _ClassVar[int]
    TOP_P_FIELD_NUMBER: _ClassVar[int]
    MIN_P_FIELD_NUMBER: _ClassVar[int]
    temperature: float
    top_k: int
    top_p: float
    min_p: float
    def __init__(self, temperature: _Optional[float] = ..., top_k: _Optional[int] = ..., top_p: _Optional[float] = ..., min_p: _Optional[float] = ...) -> None: ...

class Distributions(_message.Message):
    __slots__ = ("rows", "vocab_size", "dense", "row_offsets", "ids", "values")
    ROWS_FIELD_NUMBER: _ClassVar[int]
    VOCAB_SIZE_FIELD_NUMBER: _ClassVar[int]
    DENSE_FIELD_NUMBER: _ClassVar[int]
    ROW_OFFSETS_FIELD_NUMBER: _ClassVar[int]
    IDS_FIELD_NUMBER: _ClassVar[int]
    VALUES_FIELD_NUMBER: _ClassVar[int]
    rows: int
    vocab_size: int
    dense: bytes
    row_offsets: bytes
    ids: bytes
    values: bytes
    def __init__(self, rows: _Optional[int] = ..., vocab_size: _Optional[int] = ..., dense: _Optional[bytes] = ..., row_offsets: _Optional[bytes] = ..., ids: _Optional[bytes] = ..., values: _Optional[bytes] = ...) -> None: ...

class TokenMasks(_message.Message):
    __slots__ = ("rows", "bits")
    ROWS_FIELD_NUMBER: _ClassVar[int]
    BITS_FIELD_NUMBER: _ClassVar[int]
    rows: int
    bits: bytes
    def __init__(self, rows: _Optional[int] = ..., bits: _Optional[bytes] = ...) -> None: ...

class Logprobs(_message.Message):
    __slots__ = ("drafted", "argmax", "top_n", "top_ids", "top_logprobs", "sampled")
    DRAFTED_FIELD_NUMBER: _ClassVar[int]
    ARGMAX_FIELD_NUMBER: _ClassVar[int]
    TOP_N_FIELD_NUMBER: _ClassVar[int]
    TOP_IDS_FIELD_NUMBER: _ClassVar[int]
    TOP_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    SAMPLED_FIELD_NUMBER: _ClassVar[int]
    drafted: _containers.RepeatedScalarFieldContainer[float]
    argmax: _containers.RepeatedScalarFieldContainer[float]
    top_n: int
    top_ids: _containers.RepeatedScalarFieldContainer[int]
    top_logprobs: _containers.RepeatedScalarFieldContainer[float]
    sampled: _containers.RepeatedScalarFieldContainer[float]
    def __init__(self, drafted: _Optional[_Iterable[float]] = ..., argmax: _Optional[_Iterable[float]] = ..., top_n: _Optional[int] = ..., top_ids: _Optional[_Iterable[int]] = ..., top_logprobs: _Optional[_Iterable[float]] = ..., sampled: _Optional[_Iterable[float]] = ...) -> None: ...

class ServerTiming(_message.Message):
    __slots__ = ("queue_ms", "forward_ms", "total_ms", "batch_rows", "batch_tokens", "forwards")
    QUEUE_MS_FIELD_NUMBER: _ClassVar[int]
    FORWARD_MS_FIELD_NUMBER: _ClassVar[int]
    TOTAL_MS_FIELD_NUMBER: _ClassVar[int]
    BATCH_ROWS_FIELD_NUMBER: _ClassVar[int]
    BATCH_TOKENS_FIELD_NUMBER: _ClassVar[int]
    FORWARDS_FIELD_NUMBER: _ClassVar[int]
    queue_ms: float
    forward_ms: float
    total_ms: float
    batch_rows: int
    batch_tokens: int
    forwards: int
    def __init__(self, queue_ms: _Optional[float] = ..., forward_ms: _Optional[float] = ..., total_ms: _Optional[float] = ..., batch_rows: _Optional[int] = ..., batch_tokens: _Optional[int] = ..., forwards: _Optional[int] = ...) -> None: ...

class ReleaseRequest(_message.Message):
    __slots__ = ("session_id",)
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    def __init__(self, session_id: _Optional[str] = ...) -> None: ...

class ReleaseResponse(_message.Message):
    __slots__ = ("released",)
    RELEASED_FIELD_NUMBER: _ClassVar[int]
    released: bool
    def __init__(self, released: _Optional[bool] = ...) -> None: ...

class GetInfoRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ModelInfo(_message.Message):
    __slots__ = ("model_name", "role", "vocab_size", "tokenizer_fingerprint", "eos_token_ids", "context_length", "device", "dtype", "parameter_count", "max_k", "replica_id", "max_request_tokens", "max_batch", "feature_dim", "feature_kind", "num_layers")
    MODEL_NAME_FIELD_NUMBER: _ClassVar[int]
    ROLE_FIELD_NUMBER: _ClassVar[int]
    VOCAB_SIZE_FIELD_NUMBER: _ClassVar[int]
    TOKENIZER_FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    EOS_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    CONTEXT_LENGTH_FIELD_NUMBER: _ClassVar[int]
    DEVICE_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    PARAMETER_COUNT_FIELD_NUMBER: _ClassVar[int]
    MAX_K_FIELD_NUMBER: _ClassVar[int]
    REPLICA_ID_FIELD_NUMBER: _ClassVar[int]
    MAX_REQUEST_TOKENS_FIELD_NUMBER: _ClassVar[int]
    MAX_BATCH_FIELD_NUMBER: _ClassVar[int]
    FEATURE_DIM_FIELD_NUMBER: _ClassVar[int]
    FEATURE_KIND_FIELD_NUMBER: _ClassVar[int]
    NUM_LAYERS_FIELD_NUMBER: _ClassVar[int]
    model_name: str
    role: str
    vocab_size: int
    tokenizer_fingerprint: str
    eos_token_ids: _containers.RepeatedScalarFieldContainer[int]
    context_length: int
    device: str
    dtype: str
    parameter_count: int
    max_k: int
    replica_id: str
    max_request_tokens: int
    max_batch: int
    feature_dim: int
    feature_kind: str
    num_layers: int
    def __init__(self, model_name: _Optional[str] = ..., role: _Optional[str] = ..., vocab_size: _Optional[int] = ..., tokenizer_fingerprint: _Optional[str] = ..., eos_token_ids: _Optional[_Iterable[int]] = ..., context_length: _Optional[int] = ..., device: _Optional[str] = ..., dtype: _Optional[str] = ..., parameter_count: _Optional[int] = ..., max_k: _Optional[int] = ..., replica_id: _Optional[str] = ..., max_request_tokens: _Optional[int] = ..., max_batch: _Optional[int] = ..., feature_dim: _Optional[int] = ..., feature_kind: _Optional[str] = ..., num_layers: _Optional[int] = ...) -> None: ...

class Features(_message.Message):
    __slots__ = ("first_position", "rows", "dim", "encoding", "data")
    FIRST_POSITION_FIELD_NUMBER: _ClassVar[int]
    ROWS_FIELD_NUMBER: _ClassVar[int]
    DIM_FIELD_NUMBER: _ClassVar[int]
    ENCODING_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    first_position: int
    rows: int
    dim: int
    encoding: FeatureEncoding
    data: bytes
    def __init__(self, first_position: _Optional[int] = ..., rows: _Optional[int] = ..., dim: _Optional[int] = ..., encoding: _Optional[_Union[FeatureEncoding, str]] = ..., data: _Optional[bytes] = ...) -> None: ...
