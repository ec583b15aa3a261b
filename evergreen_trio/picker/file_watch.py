"""The Trio shell of ``file-discovery``: read the endpoints file, and with ``watchFile: true`` poll it
(:mod:`evergreen_trio.picker.file_discovery` parses it)."""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence

import trio

from evergreen_trio.picker.config import Endpoint, PoolConfig
from evergreen_trio.picker.errors import PickerError
from evergreen_trio.picker.file_discovery import (
    MAX_FILE_SIZE,
    EndpointsFileError,
    FileDiscovery,
    FileEndpoint,
    parse_endpoints_file,
    to_endpoints,
)
from evergreen_trio.picker.runtime import Discovery

logger = logging.getLogger("evergreen_trio.picker.file_discovery")
POLL_INTERVAL = 1.0  # seconds between two reads of a watched file


def discovery_for(params: FileDiscovery, pool: PoolConfig) -> Discovery:
    """The runtime's Discovery for a ``file-discovery`` plugin (the pool gives each endpoint's engine)."""

    async def run(on_endpoints: Callable[[Sequence[Endpoint]], None]) -> None:
        await file_discovery(params.path, params.watch_file, pool, on_endpoints)

    return run


def read_endpoints_file(path: str) -> tuple[list[FileEndpoint], list[str]]:
    """:func:`parse_endpoints_file` of the file at ``path`` (read up to one byte past the cap)."""
    try:
        with open(path, "rb") as fh:
            data = fh.read(MAX_FILE_SIZE + 1)
    except OSError as exc:
        raise EndpointsFileError(f"reading {path}: {exc.strerror or exc}") from None
    try:
        return parse_endpoints_file(data)
    except EndpointsFileError as exc:
        raise EndpointsFileError(f"{path}: {exc}") from None


async def file_discovery(path: str, watch: bool, pool: PoolConfig,
                         on_endpoints: Callable[[Sequence[Endpoint]], None], *,
                         interval: float = POLL_INTERVAL) -> None:
    """Load ``path`` (any error, a skipped entry included, is fatal as in the reference), then with
    ``watch`` re-read it every ``interval`` seconds and report each changed set; a failed reload
    keeps the last set and logs one line, a reload with bad entries applies the good ones."""
    try:
        entries, errors = read_endpoints_file(path)
    except EndpointsFileError as exc:
        raise PickerError(f"file-discovery: initial load failed: {exc}") from None
    if errors:
        raise PickerError(f"file-discovery: initial load failed: {path}: {'; '.join(errors)}")
    current = to_endpoints(entries, pool)
    on_endpoints(current)
    if not watch:
        await trio.sleep_forever()
    logger.info("file-discovery: watching %s for changes", path)
    last = _snapshot(path)
    while True:
        await trio.sleep(interval)
        seen = _snapshot(path)
        if seen == last:
            continue
        last = seen
        try:
            entries, errors = read_endpoints_file(path)
        except EndpointsFileError as exc:
            logger.error("file-discovery: failed to reload endpoints file, keeping %d endpoints: %s",
                         len(current), exc)
            continue
        if errors:
            logger.error("file-discovery: failed to reload endpoints file: %s", "; ".join(errors))
        endpoints = to_endpoints(entries, pool)
        if endpoints != current:
            current = endpoints
            logger.info("file-discovery: endpoints file changed, %d endpoints", len(current))
            on_endpoints(current)


def _snapshot(path: str) -> bytes | None:
    """The file's content (None when unreadable): a change of it is what a reload follows."""
    try:
        with open(path, "rb") as fh:
            return fh.read(MAX_FILE_SIZE + 1)
    except OSError:
        return None


