"""AVP codec against the reference package (``avp`` 0.6.2), measured in the same run.

Cases: a 4096-d float16 and a 4096-d float32 hidden state, and a KV cache of 32 layers x 8 heads x
128 dims x 2048 tokens float16 (256 MiB), each uncompressed and with zstd; plus the peak memory of
decoding the KV cache (tracemalloc, as a multiple of the message size). Both sides get the same
tensor bytes and metadata, and both verify the CRC32 on decode. Ratios are reference / ours.
"""

from __future__ import annotations

import gc
import statistics
import tracemalloc
from collections.abc import Callable
from functools import partial
from typing import Any

import avp as reference
import numpy as np

from benchmarks._harness import Row, print_table, timed, write_results
from evergreen_trio.avp import (
    AVPDecoder,
    AVPLimits,
    AVPMetadata,
    DataType,
    PayloadType,
    avp_fragments,
    decode,
    encode,
    encode_buffers,
    pack_kv,
)

REFERENCE = f"avp {reference.__version__}"
LEVELS = {"fast": reference.CompressionLevel.FAST, "balanced": reference.CompressionLevel.BALANCED}
BIG_LIMITS = AVPLimits(max_payload_bytes=1 << 30)
COMMON = {
    "session_id": "0f8e4c2a9b7d4e1f8a3c6b5d2e9f0a1b",
    "source_agent_id": "agent-a",
    "target_agent_id": "agent-b",
    "model_id": "meta-llama/Llama-3.1-8B",
    "hidden_dim": 4096,
    "num_layers": 32,
}



def _pair(case: str, ours: Callable[[], object], theirs: Callable[[], object], calls: int, runs: int) -> Row:
    """Median seconds per call of each side; the runs alternate so load on the machine hits both alike."""
    ours(), theirs()
    measure_ours, measure_theirs = partial(timed, ours, calls), partial(timed, theirs, calls)
    samples = [(measure_ours(), measure_theirs()) for _ in range(runs)]
    mine = statistics.median(sample[0] for sample in samples)
    peer = statistics.median(sample[1] for sample in samples)
    unit, scale = ("us", 1e6) if mine < 1e-3 else ("ms", 1e3)
    return Row(
        case, mine * scale, unit, peer=f"{REFERENCE} {peer * scale:,.4g} {unit}", ratio=peer / mine,
        extra={"reference": peer * scale},
    )


def _reference_metadata(metadata: AVPMetadata) -> Any:
    return reference.AVPMetadata(
        **COMMON,
        payload_type=reference.PayloadType(int(metadata.payload_type)),
        dtype=reference.DataType(int(metadata.dtype)),
        tensor_shape=metadata.tensor_shape,
    )


def _hidden_rows(dtype: DataType, np_dtype: str, runs: int, calls: int) -> list[Row]:
    array = np.random.default_rng(1).standard_normal((1, 4096), dtype=np.float32).astype(np_dtype)
    raw = array.tobytes()
    metadata = AVPMetadata(**COMMON, dtype=dtype, tensor_shape=(1, 4096))  # type: ignore[arg-type]
    theirs_meta = _reference_metadata(metadata)
    label = f"hidden 4096 {np_dtype}"
    rows = []
    for compression in (None, "balanced"):
        level = LEVELS[compression] if compression else reference.CompressionLevel.NONE
        message = encode(raw, metadata, compression=compression)  # type: ignore[arg-type]
        assert message == reference.encode(raw, theirs_meta, level)
        suffix = f" zstd-{level.value}" if compression else ""
        rows.append(_pair(
            f"{label}{suffix} encode", lambda c=compression: encode(raw, metadata, compression=c),
            lambda lv=level: reference.encode(raw, theirs_meta, lv), calls, runs,
        ))
        if compression is None:
            rows.append(_pair(
                f"{label} encode_buffers (scatter-gather)", lambda: encode_buffers(raw, metadata),
                lambda: reference.encode(raw, theirs_meta), calls, runs,
            ))
        rows.append(_pair(
            f"{label}{suffix} decode", lambda m=message: decode(m), lambda m=message: reference.decode(m), calls, runs
        ))
    return rows


def _peak(fn: Callable[[], object]) -> int:
    gc.collect()
    tracemalloc.start()
    try:
        tracemalloc.reset_peak()
        result = fn()
        peak = tracemalloc.get_traced_memory()[1]
        del result
    finally:
        tracemalloc.stop()
    return peak


def _incremental(message: bytes, piece: int) -> Any:
    decoder = AVPDecoder(limits=BIG_LIMITS)
    for fragment in avp_fragments(message, piece):
        decoder.feed(fragment)
    return decoder.close()


def _kv_rows(layers: int, runs: int) -> list[Row]:
    rng = np.random.default_rng(2)
    shape = (1, 8, 2048, 128)
    kv = [
        (rng.standard_normal(shape, dtype=np.float32).astype(np.float16),
         rng.standard_normal(shape, dtype=np.float32).astype(np.float16))
        for _ in range(layers)
    ]
    parts = pack_kv(kv)
    raw = b"".join(part if isinstance(part, bytes) else part.tobytes() for part in parts)
    metadata = AVPMetadata(**COMMON, payload_type=PayloadType.KV_CACHE, dtype=DataType.FLOAT16)  # type: ignore[arg-type]
    theirs_meta = _reference_metadata(metadata)
    label = f"KV {layers}x8x128x2048 f16 ({len(raw) / 2**20:.0f} MiB)"
    rows = []
    for compression in (None, "fast"):
        level = LEVELS[compression] if compression else reference.CompressionLevel.NONE
        suffix = f" zstd-{level.value}" if compression else ""
        message = encode(raw, metadata, compression=compression)  # type: ignore[arg-type]
        theirs = lambda lv=level: reference.encode(raw, theirs_meta, lv)  # noqa: E731
        rows.append(_pair(f"{label}{suffix} encode", lambda c=compression: encode(raw, metadata, compression=c),
                          theirs, 1, runs))
        if compression is None:
            rows.append(_pair(f"{label} encode_buffers from layers (scatter-gather)",
                              lambda: encode_buffers(parts, metadata), theirs, 1, runs))
        rows.append(_pair(f"{label}{suffix} decode", lambda m=message: decode(m, limits=BIG_LIMITS),
                          lambda m=message: reference.decode(m), 1, runs))
        if compression is None:
            rows.append(_pair(f"{label} incremental decode, 1 MiB pieces", lambda m=message: _incremental(m, 1 << 20),
                              lambda m=message: reference.decode(m), 1, runs))
        for name, fn in (
            ("ours", lambda m=message: decode(m, limits=BIG_LIMITS)),
            *([("ours incremental", lambda m=message: _incremental(m, 1 << 20))] if compression is None else []),
            ("reference", lambda m=message: reference.decode(m)),
        ):
            peak = _peak(fn)
            rows.append(Row(f"{label}{suffix} decode peak memory, {name}", peak / 2**20, "MiB",
                            peer=f"message {len(message) / 2**20:.1f} MiB", ratio=peak / len(message)))
        del message
    return rows


def run(quick: bool = False) -> None:
    runs = 3 if quick else 7
    calls = 200 if quick else 2000
    rows = _hidden_rows(DataType.FLOAT16, "float16", runs, calls)
    rows += _hidden_rows(DataType.FLOAT32, "float32", runs, calls)
    rows += _kv_rows(4 if quick else 32, 3 if quick else 5)
    print_table("AVP codec vs the reference (ratio = reference time / ours; memory: peak / message size)", rows)
    path = write_results("avp", rows, reference=REFERENCE, quick=quick)
    print(f"\nwrote {path}")
