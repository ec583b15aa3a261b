"""Where Rosetta ``.avp-map`` files live, the reference's way: ``$AVP_CACHE_DIR/maps`` or ``~/.avp/maps``.

The one file-system step of the handshake (rule 4): list the map ids once, pass them to `resolve_mode`.
"""

from __future__ import annotations

import os
from pathlib import Path

MAP_SUFFIX = ".pt"


def default_map_dir() -> Path:
    """``$AVP_CACHE_DIR/maps``, else ``~/.avp/maps`` (the reference's registry directory)."""
    return Path(os.environ.get("AVP_CACHE_DIR", str(Path.home() / ".avp"))) / "maps"


def find_maps(directory: Path | None = None) -> frozenset[str]:
    """The map ids (file stems of ``<id>.pt``) in ``directory`` (default: `default_map_dir`); none if absent."""
    directory = directory or default_map_dir()
    try:
        return frozenset(p.name[: -len(MAP_SUFFIX)] for p in directory.iterdir() if p.name.endswith(MAP_SUFFIX))
    except (FileNotFoundError, NotADirectoryError):
        return frozenset()
