"""llm-d-router's ``local-syncer`` and ``dataLayer.crossReplicaSyncerPluginRef``, read (no I/O).

The reference's cross-replica syncer carries each replica's in-flight load
(``inflight-load-producer``'s ``CrossReplicaState``) to the others, published every
``crossReplicaSyncInterval`` (200 ms by default); ``local-syncer`` is its in-memory, single-replica
one: what a replica reads back is its own last published value. This picker reads its in-flight
load live, which is what one replica's aggregate is (without the publishing interval's lag), so a
config naming a ``local-syncer`` loads and runs as without it. The reference's checks are kept: the
reference must name a declared plugin that is a syncer, the interval must be a duration.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping

from evergreen_trio.picker.errors import ConfigError
from evergreen_trio.picker.plugins import Category, Plugin, PluginType, register

log = logging.getLogger(__name__)

LOCAL_SYNCER = "local-syncer"
SYNCER_REF, SYNC_INTERVAL = "crossReplicaSyncerPluginRef", "crossReplicaSyncInterval"


def read_syncer(layer: Mapping[str, object], path: str, plugins: Mapping[str, Plugin]) -> Plugin | None:
    """The syncer ``dataLayer`` (at ``path``) names, if any, its sync interval checked;
    ConfigError for a name that is not a declared syncer, as the reference's loader fails."""
    from evergreen_trio.picker.config import parse_duration  # config imports the plugin registry

    interval = layer.get(SYNC_INTERVAL)
    if interval is not None:
        if not isinstance(interval, str):
            raise ConfigError(f"{path}.{SYNC_INTERVAL}", "a duration like '200ms'", interval)
        parse_duration(interval, f"{path}.{SYNC_INTERVAL}")
    name = layer.get(SYNCER_REF)
    if name is None or name == "":
        return None
    plugin = plugins.get(name) if isinstance(name, str) else None
    if plugin is None or plugin.category is not Category.SYNCER:
        got = f"{name} (a {plugin.category.value})" if plugin is not None else name
        raise ConfigError(f"{path}.{SYNCER_REF}", f"a declared cross-replica syncer plugin ({LOCAL_SYNCER})", got)
    log.info("picker.cross_replica_syncer plugin=%s (one replica: its in-flight load is read locally)", plugin.name)
    return plugin


register(LOCAL_SYNCER, PluginType(Category.SYNCER))
