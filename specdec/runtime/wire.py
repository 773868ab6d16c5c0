"""Protobuf <-> core conversions: sampling parameters and probability matrices.

Arrays travel as raw little-endian bytes (numpy `tobytes`/`frombuffer`), never
as repeated floats. Distributions are exact either way: dense float32, or CSR
(only the non-zero entries) when top-k/top-p/min-p/greedy leave few of them.
"""
from __future__ import annotations

import numpy as np
import torch

from specdec.core.sampling import SamplingParams
from specdec.runtime.errors import InvalidArgument
from specdec.v1 import common_pb2

_F32 = np.dtype("<f4")
_I32 = np.dtype("<i4")


def sampling_from_proto(msg: common_pb2.SamplingParams | None) -> SamplingParams:
    """Validated core parameters; an unset message means greedy, unset top_p means 1."""
    if msg is None:
        return SamplingParams()
    params = SamplingParams(
        temperature=float(msg.temperature),
        top_k=int(msg.top_k),
        top_p=float(msg.top_p) if msg.HasField("top_p") else 1.0,
        min_p=float(msg.min_p),
    )
    try:
        params.validate()
    except ValueError as exc:
        raise InvalidArgument(str(exc)) from None
    return params


def sampling_to_proto(params: SamplingParams) -> common_pb2.SamplingParams:
    msg = common_pb2.SamplingParams(
        temperature=params.temperature, top_k=params.top_k, min_p=params.min_p
    )
    if params.top_p != 1.0:
        msg.top_p = params.top_p
    return msg


def encode_probs(probs: torch.Tensor) -> common_pb2.Distributions:  # probs: [n, vocab]
    """Exact wire form of `probs`: dense float32 or CSR, whichever is smaller."""
    if probs.dim() != 2:
        raise ValueError(f"probs must be [rows, vocab], got shape {tuple(probs.shape)}")
    array = probs.detach().to("cpu", torch.float32).contiguous().numpy()
    rows, vocab = array.shape
    msg = common_pb2.Distributions(rows=rows, vocab_size=vocab)
    nonzero = np.count_nonzero(array)
    if 8 * nonzero + 4 * (rows + 1) < 4 * rows * vocab:
        row_idx, ids = np.nonzero(array)  # row-major order: CSR-ready
        offsets = np.zeros(rows + 1, dtype=_I32)
        np.cumsum(np.bincount(row_idx, minlength=rows), out=offsets[1:])
        msg.row_offsets = offsets.tobytes()
        msg.ids = ids.astype(_I32).tobytes()
        msg.values = array[row_idx, ids].astype(_F32).tobytes()
    else:
        msg.dense = array.astype(_F32, copy=False).tobytes()
    return msg


def decode_probs(
    msg: common_pb2.Distributions, device: str | torch.device = "cpu"
) -> torch.Tensor:  # [rows, vocab] float32
    """Inverse of `encode_probs`; malformed payloads raise InvalidArgument."""
    rows, vocab = int(msg.rows), int(msg.vocab_size)
    if msg.dense:
        if len(msg.dense) != 4 * rows * vocab:
            raise InvalidArgument(
                f"probs.dense has {len(msg.dense)} bytes, expected {4 * rows * vocab}"
            )
        array = np.frombuffer(msg.dense, dtype=_F32).reshape(rows, vocab)
        return torch.from_numpy(array.astype(np.float32)).to(device)
    offsets = np.frombuffer(msg.row_offsets, dtype=_I32)
    ids = np.frombuffer(msg.ids, dtype=_I32)
    values = np.frombuffer(msg.values, dtype=_F32)
    if rows == 0 and not msg.row_offsets:
        return torch.zeros((0, vocab), dtype=torch.float32, device=device)
    if len(offsets) != rows + 1 or offsets[0] != 0 or np.any(np.diff(offsets) < 0):
        raise InvalidArgument("probs.row_offsets must hold rows + 1 non-decreasing int32 from 0")
    if len(ids) != offsets[-1] or len(values) != offsets[-1]:
        raise InvalidArgument("probs.ids and probs.values must hold row_offsets[-1] entries")
    if len(ids) and (ids.min() < 0 or ids.max() >= vocab):
        raise InvalidArgument(f"probs.ids must be in [0, {vocab})")
    array = np.zeros((rows, vocab), dtype=np.float32)
    array[np.repeat(np.arange(rows), np.diff(offsets)), ids] = values
    return torch.from_numpy(array).to(device)



# Feature drafts: hidden states as raw little-endian rows (model.proto Features).
_FEATURE_DTYPES = {
    common_pb2.FEATURE_ENCODING_FLOAT16: np.dtype("<f2"),
    common_pb2.FEATURE_ENCODING_FLOAT32: _F32,
    common_pb2.FEATURE_ENCODING_BFLOAT16: np.dtype("<u2"),  # the top half of each float32
}
FEATURE_ENCODINGS = {"float16": common_pb2.FEATURE_ENCODING_FLOAT16,
                     "float32": common_pb2.FEATURE_ENCODING_FLOAT32,
                     "bfloat16": common_pb2.FEATURE_ENCODING_BFLOAT16}


LAYERS_KIND = "layers:"  # ModelInfo.feature_kind of a draft reading target layers (an EAGLE-3 head)


def layers_feature_kind(layers: tuple[int, ...]) -> str:
    """ModelInfo.feature_kind of a draft that reads the residual streams entering these target layers."""
    return LAYERS_KIND + ",".join(str(i) for i in layers)


def parse_feature_kind(kind: str) -> tuple[int, ...]:
    """The target layers a ModelInfo.feature_kind names: () for the final normed state (or none)."""
    if not kind.startswith(LAYERS_KIND):
        return ()
    try:
        return tuple(int(i) for i in kind[len(LAYERS_KIND):].split(","))
    except ValueError:
        raise ValueError(f"feature kind {kind!r}: expected {LAYERS_KIND}A,B,C with layer ids") from None


def check_feature_encoding(encoding: int) -> int:
    if encoding not in _FEATURE_DTYPES and encoding != common_pb2.FEATURE_ENCODING_NONE:
        raise InvalidArgument(f"features: {encoding} is not a known FeatureEncoding")
    return encoding


def encode_features(hidden: torch.Tensor, encoding: int, first_position: int = 0) -> common_pb2.Features:
    """hidden [rows, dim] (any float dtype, on the CPU) -> Features in `encoding`."""
    rows, dim = hidden.shape
    values = hidden.detach().to("cpu", torch.float32).contiguous().numpy()
    if encoding == common_pb2.FEATURE_ENCODING_BFLOAT16:
        # Round to nearest even on the top 16 bits, as torch's bfloat16 does.
        data = hidden.detach().to("cpu", torch.bfloat16).contiguous().view(torch.int16).numpy().astype("<i2")
        raw = data.tobytes()
    else:
        raw = values.astype(_FEATURE_DTYPES[check_feature_encoding(encoding)], copy=False).tobytes()
    return common_pb2.Features(first_position=first_position, rows=rows, dim=dim, encoding=encoding, data=raw)


def decode_features(msg: common_pb2.Features, dim: int | None = None) -> torch.Tensor:
    """Features -> [rows, dim] float32 tensor; a malformed message is INVALID_ARGUMENT naming the field."""
    if msg.encoding not in _FEATURE_DTYPES:
        raise InvalidArgument(f"features.encoding {msg.encoding} is not a known FeatureEncoding")
    if dim is not None and msg.rows and msg.dim != dim:
        raise InvalidArgument(f"features.dim must be {dim}, got {msg.dim}")
    dtype = _FEATURE_DTYPES[msg.encoding]
    if len(msg.data) != msg.rows * msg.dim * dtype.itemsize:
        raise InvalidArgument(f"features.data must hold rows * dim * {dtype.itemsize} = "
                              f"{msg.rows * msg.dim * dtype.itemsize} bytes, got {len(msg.data)}")
    if msg.encoding == common_pb2.FEATURE_ENCODING_BFLOAT16:
        raw = np.frombuffer(msg.data, dtype="<i2").astype(np.int16)
        values = torch.from_numpy(raw.copy()).view(torch.bfloat16).float()
    else:
        values = torch.from_numpy(np.frombuffer(msg.data, dtype=dtype).astype(np.float32))
    values = values.reshape(int(msg.rows), int(msg.dim))
    if not bool(torch.isfinite(values).all()):
        raise InvalidArgument("features: values must be finite")
    return values
