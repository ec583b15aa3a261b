"""Hypothesis strategies and helpers shared by the AVP tests."""

from __future__ import annotations

from typing import Any

import numpy as np
from hypothesis import strategies as st

from evergreen_trio.avp import AVPMetadata, CommunicationMode, DataType, PayloadType, pack_kv
from evergreen_trio.avp.dtypes import NUMPY_DTYPES

UINT32 = st.integers(0, 2**32 - 1)
TEXT = st.text(max_size=24)
KV_DTYPES = (DataType.FLOAT32, DataType.FLOAT16, DataType.BFLOAT16)
COMPRESSIONS = st.sampled_from([None, "fast", "balanced"])


def random_array(shape: tuple[int, ...], dtype: DataType, seed: int = 0) -> np.ndarray[Any, Any]:
    rng = np.random.default_rng(seed)
    if dtype is DataType.INT8:
        return rng.integers(-128, 128, size=shape, dtype=np.int8)
    return rng.standard_normal(shape, dtype=np.float32).astype(NUMPY_DTYPES[dtype])


def kv_layers(layers: int, heads: int, seq: int, dim: int, dtype: DataType, seed: int = 0) -> list[tuple[Any, Any]]:
    shape = (1, heads, seq, dim)
    return [
        (random_array(shape, dtype, seed + 2 * i), random_array(shape, dtype, seed + 2 * i + 1)) for i in range(layers)
    ]


@st.composite
def metadata_fields(draw: st.DrawFn) -> dict[str, Any]:
    """Every metadata field except payload_type, dtype, tensor_shape (the payload decides them)."""
    return {
        "session_id": draw(TEXT),
        "source_agent_id": draw(TEXT),
        "target_agent_id": draw(TEXT),
        "model_id": draw(TEXT),
        "hidden_dim": draw(UINT32),
        "num_layers": draw(UINT32),
        "mode": draw(st.sampled_from(CommunicationMode)),
        "avp_map_id": draw(TEXT),
        "extra": draw(st.dictionaries(TEXT, TEXT, max_size=4)),
    }


@st.composite
def messages(draw: st.DrawFn) -> tuple[AVPMetadata, Any, np.ndarray[Any, Any]]:
    """(metadata, payload to encode, the array that payload holds) for any payload type, dtype and shape."""
    fields = draw(metadata_fields())
    payload_type = draw(st.sampled_from(PayloadType))
    seed = draw(st.integers(0, 2**16))
    if payload_type is PayloadType.KV_CACHE:
        dtype = draw(st.sampled_from(KV_DTYPES))
        dims = draw(st.tuples(*(st.integers(0, 3) for _ in range(4))))
        layers = kv_layers(max(dims[0], 1), *dims[1:], dtype, seed)
        block = np.stack([np.stack([k[0], v[0]]) for k, v in layers])
        metadata = AVPMetadata(payload_type=payload_type, dtype=dtype, **fields)
        return metadata, pack_kv(layers), block
    dtype = draw(st.sampled_from(DataType))
    shape = draw(st.lists(st.integers(0, 6), min_size=0, max_size=4).map(tuple))
    array = random_array(shape, dtype, seed)
    with_shape = draw(st.booleans()) and len(shape) > 0
    metadata = AVPMetadata(payload_type=payload_type, dtype=dtype, tensor_shape=shape if with_shape else (), **fields)
    return metadata, array, array if with_shape else array.reshape(-1)
