"""Which configured plugins dump state for ``/debug/plugins/state``, and from which of our objects.

The reference's eight ``StateDumper`` plugins are ours here: ``file-discovery`` (and the
multicluster variant) from its shell's :class:`~evergreen_trio.picker.file_discovery.DiscoveredEndpoints`,
``program-aware-fairness`` from the flow-control queue's program state, the approximate prefix
producer from the scheduler's one prefix index, ``inflight-load-producer`` from the scheduler's
in-flight counts, and ``mm-embeddings-cache-producer``, ``precise-prefix-cache-producer``,
``predicted-latency-producer`` and ``no-hit-lru-scorer`` from their plugin states. Every other
plugin gets :data:`~evergreen_trio.picker.plugin_state.UNSUPPORTED`, as in the reference.
"""

from __future__ import annotations

from functools import partial

from evergreen_trio.picker.affinity import NoHitLRU
from evergreen_trio.picker.file_discovery import DiscoveredEndpoints, FileDiscovery
from evergreen_trio.picker.flow_control.program_aware import ProgramAware, ProgramAwareParams
from evergreen_trio.picker.inflight import PRODUCER as INFLIGHT_PRODUCER
from evergreen_trio.picker.latency import PredictedLatency
from evergreen_trio.picker.mm_cache import MediaCache
from evergreen_trio.picker.plugin_state import DumpState, PluginDump
from evergreen_trio.picker.plugins import APPROX_PRODUCER, MULTICLUSTER_APPROX_PRODUCER, Plugin
from evergreen_trio.picker.precise_prefix import PrecisePrefixCache
from evergreen_trio.picker.processor import Picker


def _dump(picker: Picker, plugin: Plugin, discovery: DumpState | None) -> DumpState | None:
    scheduler, params = picker.scheduler, plugin.params
    if isinstance(params, FileDiscovery):
        running = picker.config.epp is not None and picker.config.epp.discovery == plugin
        # A declared discovery that is not dataLayer.discovery loads nothing: the empty dump.
        return discovery if running and discovery is not None else DiscoveredEndpoints().dump_state
    if isinstance(params, ProgramAwareParams):
        if picker.flow is None:  # no flow-control gate: nothing is tracked
            return partial(ProgramAware(params, 0.0).dump_state, 0.0)
        queue = picker.flow.queue
        return lambda: queue.programs[plugin.name].dump_state(queue.clock())
    if plugin.type in (APPROX_PRODUCER, MULTICLUSTER_APPROX_PRODUCER):
        return scheduler.prefix.dump_state
    if plugin.type == INFLIGHT_PRODUCER:
        return scheduler.inflight.dump_state
    state = scheduler.plugin_states.get(plugin.name)
    snapshot = scheduler.snapshot
    if isinstance(state, MediaCache):
        media = state
        return lambda: media.dump_state(snapshot.states.keys())
    if isinstance(state, PrecisePrefixCache) and not state.params.legacy:  # the legacy scorer dumps nothing
        precise = state
        return lambda: precise.dump_state(snapshot.clock())
    if isinstance(state, NoHitLRU | PredictedLatency):
        return state.dump_state
    return None


def plugin_dumps(picker: Picker, discovery: DumpState | None = None) -> list[PluginDump]:
    """Each plugin ``picker``'s config declares, with its dump; ``discovery``: the running
    ``dataLayer.discovery`` plugin's (its shell holds the state)."""
    plugins = picker.config.epp.plugins if picker.config.epp is not None else {}
    return [PluginDump(plugin.name, plugin.type, _dump(picker, plugin, discovery)) for plugin in plugins.values()]

