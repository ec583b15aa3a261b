"""Shared test data for the IPC tests."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pyarrow as pa

from evergreen_trio.ipc.arrow import OutgoingMessage, messages_from_table


def sample_table(rows: int = 20_000) -> pa.Table:
    """Numbers, strings with nulls and a dictionary column: exercises dictionary batches."""
    return pa.table(
        {
            "x": np.arange(rows, dtype=np.float64),
            "n": pa.array([i if i % 7 else None for i in range(rows)], pa.int64()),
            "d": pa.array(["red", "green", "blue", "red"] * (rows // 4)).dictionary_encode(),
        }
    )


def sample_messages(rows: int = 20_000, chunk: int = 2_000) -> list[OutgoingMessage]:
    return messages_from_table(sample_table(rows), max_chunksize=chunk)


def memfd_mappings() -> list[str]:
    """This process's mappings of shared-memory segments (servers' and clients')."""
    return [line for line in Path("/proc/self/maps").read_text().splitlines() if "memfd:evergreen-ipc" in line]


def client_mappings() -> list[str]:
    """Shared memory mapped by clients (read-only); a server's own mappings are writable."""
    return [line for line in memfd_mappings() if " r--s " in line]
