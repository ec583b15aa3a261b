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
    DiscoveredEndpoints,
    EndpointsFileError,
    EntryCheck,
    FileDiscovery,
    FileEndpoint,
    parse_endpoints_file,
    pod_address,
    to_endpoints,
)
from evergreen_trio.picker.runtime import Discovery

logger = logging.getLogger("evergreen_trio.picker.file_discovery")
POLL_INTERVAL = 1.0  # seconds between two reads of a watched file


def discovery_for(params: FileDiscovery, pool: PoolConfig, state: DiscoveredEndpoints | None = None) -> Discovery:
    """The runtime's Discovery for a ``file-discovery`` plugin (the pool gives each endpoint's
    engine); ``state`` learns each load's identities."""

    async def run(on_endpoints: Callable[[Sequence[Endpoint]], None]) -> None:
        await file_discovery(params.path, params.watch_file, pool, on_endpoints, check=params.check, state=state)

    return run


def _read(path: str) -> bytes:
    """The file's bytes, up to one past the cap (:func:`parse_endpoints_file` refuses more)."""
    try:
        with open(path, "rb") as fh:
            return fh.read(MAX_FILE_SIZE + 1)
    except OSError as exc:
        raise EndpointsFileError(f"reading {path}: {exc.strerror or exc}") from None


def _parse(path: str, data: bytes, check: EntryCheck) -> tuple[list[FileEndpoint], list[str]]:
    try:
        return parse_endpoints_file(data, check)
    except EndpointsFileError as exc:
        raise EndpointsFileError(f"{path}: {exc}") from None


async def file_discovery(path: str, watch: bool, pool: PoolConfig,
                         on_endpoints: Callable[[Sequence[Endpoint]], None], *,
                         interval: float = POLL_INTERVAL, check: EntryCheck = pod_address,
                         state: DiscoveredEndpoints | None = None) -> None:
    """Load ``path`` (any error, a skipped entry included, is fatal as in the reference), then with
    ``watch`` re-read it every ``interval`` seconds and report each changed set; a failed reload
    keeps the last set and logs one line, a reload with bad entries applies the good ones.
    ``state`` learns the identities of each load applied."""
    state = state or DiscoveredEndpoints()
    try:
        data = _read(path)
        entries, errors = _parse(path, data, check)
    except EndpointsFileError as exc:
        raise PickerError(f"file-discovery: initial load failed: {exc}") from None
    if errors:
        raise PickerError(f"file-discovery: initial load failed: {path}: {'; '.join(errors)}")
    current = to_endpoints(entries, pool)
    state.loaded(entries)
    on_endpoints(current)
    if not watch:
        await trio.sleep_forever()
    logger.info("file-discovery: watching %s for changes", path)
    last: bytes | None = data  # the bytes the current set came from (None: the file was unreadable)
    while True:
        await trio.sleep(interval)
        try:
            data = _read(path)
        except EndpointsFileError as exc:
            if last is not None:  # once per outage
                _keeping(current, exc)
            last = None
            continue
        if data == last:
            continue
        last = data
        try:
            entries, errors = _parse(path, data, check)
        except EndpointsFileError as exc:
            _keeping(current, exc)
            continue
        if errors:
            logger.error("file-discovery: failed to reload endpoints file: %s", "; ".join(errors))
        state.loaded(entries)
        endpoints = to_endpoints(entries, pool)
        if endpoints != current:
            current = endpoints
            logger.info("file-discovery: endpoints file changed, %d endpoints", len(current))
            on_endpoints(current)


def _keeping(current: Sequence[Endpoint], exc: EndpointsFileError) -> None:
    logger.error("file-discovery: failed to reload endpoints file, keeping %d endpoints: %s", len(current), exc)
