from specdec.v1 import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class ScoreRequest(_message.Message):
    __slots__ = ("session_id", "cache_position", "prefix_hash", "tokens", "k", "sampling", "output_mode", "allowed", "logprobs", "features", "seed", "tenant", "parents", "feature_layers")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    CACHE_POSITION_FIELD_NUMBER: _ClassVar[int]
    PREFIX_HASH_FIELD_NUMBER: _ClassVar[int]
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    K_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    OUTPUT_MODE_FIELD_NUMBER: _ClassVar[int]
    ALLOWED_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    FEATURES_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    TENANT_FIELD_NUMBER: _ClassVar[int]
    PARENTS_FIELD_NUMBER: _ClassVar[int]
    FEATURE_LAYERS_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    cache_position: int
    prefix_hash: int
    tokens: _containers.RepeatedScalarFieldContainer[int]
    k: int
    sampling: _common_pb2.SamplingParams
    output_mode: _common_pb2.OutputMode
    allowed: _common_pb2.TokenMasks
    logprobs: int
    features: _common_pb2.FeatureEncoding
    seed: int
    tenant: str
    parents: _containers.RepeatedScalarFieldContainer[int]
    feature_layers: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, session_id: _Optional[str] = ..., cache_position: _Optional[int] = ..., prefix_hash: _Optional[int] = ..., tokens: _Optional[_Iterable[int]] = ..., k: _Optional[int] = ..., sampling: _Optional[_Union[_common_pb2.SamplingParams, _Mapping]] = ..., output_mode: _Optional[_Union[_common_pb2.OutputMode, str]] = ..., allowed: _Optional[_Union[_common_pb2.TokenMasks, _Mapping]] = ..., logprobs: _Optional[int] = ..., features: _Optional[_Union[_common_pb2.FeatureEncoding, str]] = ..., seed: _Optional[int] = ..., tenant: _Optional[str] = ..., parents: _Optional[_Iterable[int]] = ..., feature_layers: _Optional[_Iterable[int]] = ...) -> None: ...

class ScoreResponse(_message.Message):
    __slots__ = ("argmax_ids", "probs", "cache_length", "timing", "logprobs", "features", "sampled_ids", "tree")
    ARGMAX_IDS_FIELD_NUMBER: _ClassVar[int]
    PROBS_FIELD_NUMBER: _ClassVar[int]
    CACHE_LENGTH_FIELD_NUMBER: _ClassVar[int]
    TIMING_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    FEATURES_FIELD_NUMBER: _ClassVar[int]
    SAMPLED_IDS_FIELD_NUMBER: _ClassVar[int]
    TREE_FIELD_NUMBER: _ClassVar[int]
    argmax_ids: _containers.RepeatedScalarFieldContainer[int]
    probs: _common_pb2.Distributions
    cache_length: int
    timing: _common_pb2.ServerTiming
    logprobs: _common_pb2.Logprobs
    features: _common_pb2.Features
    sampled_ids: _containers.RepeatedScalarFieldContainer[int]
    tree: bool
    def __init__(self, argmax_ids: _Optional[_Iterable[int]] = ..., probs: _Optional[_Union[_common_pb2.Distributions, _Mapping]] = ..., cache_length: _Optional[int] = ..., timing: _Optional[_Union[_common_pb2.ServerTiming, _Mapping]] = ..., logprobs: _Optional[_Union[_common_pb2.Logprobs, _Mapping]] = ..., features: _Optional[_Union[_common_pb2.Features, _Mapping]] = ..., sampled_ids: _Optional[_Iterable[int]] = ..., tree: _Optional[bool] = ...) -> None: ...

class ProposeRequest(_message.Message):
    __slots__ = ("session_id", "cache_position", "prefix_hash", "tokens", "k", "sampling", "output_mode", "seed", "p_min", "features", "tenant", "tree_nodes", "tree_width")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    CACHE_POSITION_FIELD_NUMBER: _ClassVar[int]
    PREFIX_HASH_FIELD_NUMBER: _ClassVar[int]
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    K_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    OUTPUT_MODE_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    P_MIN_FIELD_NUMBER: _ClassVar[int]
    FEATURES_FIELD_NUMBER: _ClassVar[int]
    TENANT_FIELD_NUMBER: _ClassVar[int]
    TREE_NODES_FIELD_NUMBER: _ClassVar[int]
    TREE_WIDTH_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    cache_position: int
    prefix_hash: int
    tokens: _containers.RepeatedScalarFieldContainer[int]
    k: int
    sampling: _common_pb2.SamplingParams
    output_mode: _common_pb2.OutputMode
    seed: int
    p_min: float
    features: _common_pb2.Features
    tenant: str
    tree_nodes: int
    tree_width: int
    def __init__(self, session_id: _Optional[str] = ..., cache_position: _Optional[int] = ..., prefix_hash: _Optional[int] = ..., tokens: _Optional[_Iterable[int]] = ..., k: _Optional[int] = ..., sampling: _Optional[_Union[_common_pb2.SamplingParams, _Mapping]] = ..., output_mode: _Optional[_Union[_common_pb2.OutputMode, str]] = ..., seed: _Optional[int] = ..., p_min: _Optional[float] = ..., features: _Optional[_Union[_common_pb2.Features, _Mapping]] = ..., tenant: _Optional[str] = ..., tree_nodes: _Optional[int] = ..., tree_width: _Optional[int] = ...) -> None: ...

class ProposeResponse(_message.Message):
    __slots__ = ("tokens", "probs", "cache_length", "timing", "parents", "held")
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    PROBS_FIELD_NUMBER: _ClassVar[int]
    CACHE_LENGTH_FIELD_NUMBER: _ClassVar[int]
    TIMING_FIELD_NUMBER: _ClassVar[int]
    PARENTS_FIELD_NUMBER: _ClassVar[int]
    HELD_FIELD_NUMBER: _ClassVar[int]
    tokens: _containers.RepeatedScalarFieldContainer[int]
    probs: _common_pb2.Distributions
    cache_length: int
    timing: _common_pb2.ServerTiming
    parents: _containers.RepeatedScalarFieldContainer[int]
    held: _containers.RepeatedScalarFieldContainer[bool]
    def __init__(self, tokens: _Optional[_Iterable[int]] = ..., probs: _Optional[_Union[_common_pb2.Distributions, _Mapping]] = ..., cache_length: _Optional[int] = ..., timing: _Optional[_Union[_common_pb2.ServerTiming, _Mapping]] = ..., parents: _Optional[_Iterable[int]] = ..., held: _Optional[_Iterable[bool]] = ...) -> None: ...

class ItemStatus(_message.Message):
    __slots__ = ("code", "message")
    CODE_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    code: int
    message: str
    def __init__(self, code: _Optional[int] = ..., message: _Optional[str] = ...) -> None: ...

class ScoreBatchRequest(_message.Message):
    __slots__ = ("items", "batch_id")
    ITEMS_FIELD_NUMBER: _ClassVar[int]
    BATCH_ID_FIELD_NUMBER: _ClassVar[int]
    items: _containers.RepeatedCompositeFieldContainer[ScoreRequest]
    batch_id: int
    def __init__(self, items: _Optional[_Iterable[_Union[ScoreRequest, _Mapping]]] = ..., batch_id: _Optional[int] = ...) -> None: ...

class ScoreBatchResponse(_message.Message):
    __slots__ = ("items", "status", "batch_id")
    ITEMS_FIELD_NUMBER: _ClassVar[int]
    STATUS_FIELD_NUMBER: _ClassVar[int]
    BATCH_ID_FIELD_NUMBER: _ClassVar[int]
    items: _containers.RepeatedCompositeFieldContainer[ScoreResponse]
    status: _containers.RepeatedCompositeFieldContainer[ItemStatus]
    batch_id: int
    def __init__(self, items: _Optional[_Iterable[_Union[ScoreResponse, _Mapping]]] = ..., status: _Optional[_Iterable[_Union[ItemStatus, _Mapping]]] = ..., batch_id: _Optional[int] = ...) -> None: ...

class ProposeBatchRequest(_message.Message):
    __slots__ = ("items", "batch_id")
    ITEMS_FIELD_NUMBER: _ClassVar[int]
    BATCH_ID_FIELD_NUMBER: _ClassVar[int]
    items: _containers.RepeatedCompositeFieldContainer[ProposeRequest]
    batch_id: int
    def __init__(self, items: _Optional[_Iterable[_Union[ProposeRequest, _Mapping]]] = ..., batch_id: _Optional[int] = ...) -> None: ...

class ProposeBatchResponse(_message.Message):
    __slots__ = ("items", "status", "batch_id")
    ITEMS_FIELD_NUMBER: _ClassVar[int]
    STATUS_FIELD_NUMBER: _ClassVar[int]
    BATCH_ID_FIELD_NUMBER: _ClassVar[int]
    items: _containers.RepeatedCompositeFieldContainer[ProposeResponse]
    status: _containers.RepeatedCompositeFieldContainer[ItemStatus]
    batch_id: int
    def __init__(self, items: _Optional[_Iterable[_Union[ProposeResponse, _Mapping]]] = ..., status: _Optional[_Iterable[_Union[ItemStatus, _Mapping]]] = ..., batch_id: _Optional[int] = ...) -> None: ...

class ForkRequest(_message.Message):
    __slots__ = ("session_id", "new_session_id", "length", "prefix_hash", "tenant")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    NEW_SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    LENGTH_FIELD_NUMBER: _ClassVar[int]
    PREFIX_HASH_FIELD_NUMBER: _ClassVar[int]
    TENANT_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    new_session_id: str
    length: int
    prefix_hash: int
    tenant: str
    def __init__(self, session_id: _Optional[str] = ..., new_session_id: _Optional[str] = ..., length: _Optional[int] = ..., prefix_hash: _Optional[int] = ..., tenant: _Optional[str] = ...) -> None: ...

class ForkResponse(_message.Message):
    __slots__ = ("cache_length",)
    CACHE_LENGTH_FIELD_NUMBER: _ClassVar[int]
    cache_length: int
    def __init__(self, cache_length: _Optional[int] = ...) -> None: ...
