"""``k8s-notification-source`` and ``endpoint-notification-source`` (llm-d-router Beta): their
parameters, the sans-IO sources' events and bounds, the one watch loop against the stand-in API
server through lightkube (a custom resource, a core kind lightkube knows, an outage, a 410), and
the command's bad input."""

from __future__ import annotations

import logging
from collections.abc import Sequence
from functools import partial
from pathlib import Path
from typing import Any

import pytest
import trio
from hypothesis import given
from hypothesis import strategies as st
from kube_fakes import NAMESPACE, KubeApiServer, eventually, write_kubeconfig
from picker_cli import run_cli

from evergreen_trio.picker.config import Endpoint, parse_config
from evergreen_trio.picker.errors import ConfigError
from evergreen_trio.picker.k8s import ClusterAccess
from evergreen_trio.picker.k8s.notification_watch import resource_for, watch_notification_sources
from evergreen_trio.picker.notifications import (
    ADDED,
    DELETED,
    ENDPOINT_NOTIFICATION_SOURCE,
    GVK,
    K8S_NOTIFICATION_SOURCE,
    MAX_OBJECT_BYTES,
    MODIFIED,
    EndpointNotifications,
    NotificationSource,
    endpoint_notifications,
    notification_sources,
    plural_of,
)
from evergreen_trio.picker.plugins import ALPHA_TYPES, PLUGIN_TYPES, Category
from evergreen_trio.picker.runtime import run_picker

HEAD = "apiVersion: llm-d.ai/v1alpha1\nkind: EndpointPickerConfig\n"
P = "EndpointPickerConfig.plugins[0].parameters"
WIDGETS = "apis/example.com/v1/widgets"
SERVICES = "api/v1/services"


def declared(entry: str) -> Any:
    config = parse_config(HEAD + f"plugins:\n- {entry}\n- {{type: queue-scorer}}\n", cluster_pool="p")
    assert config.epp is not None
    return config.epp.plugins


def widget(name: str, size: int = 1, **labels: str) -> dict[str, Any]:
    return {"apiVersion": "example.com/v1", "kind": "Widget",
            "metadata": {"name": name, "namespace": NAMESPACE, "labels": labels}, "spec": {"size": size}}


# -- parameters ---------------------------------------------------------------------------------


def test_the_factory_reads_the_gvk_and_both_types_are_registered_beta_sources() -> None:
    plugins = declared(f"{{type: {K8S_NOTIFICATION_SOURCE}, parameters: {{group: '', version: v1, kind: Pod}}}}")
    (source,) = notification_sources(plugins)
    assert (source.name, source.gvk) == (K8S_NOTIFICATION_SOURCE, GVK("", "v1", "Pod"))
    assert str(GVK("apps", "v1", "Deployment")) == "apps/v1, Kind=Deployment" and source.gvk.api_version == "v1"
    (endpoints,) = endpoint_notifications(declared(f"{{type: {ENDPOINT_NOTIFICATION_SOURCE}, name: e}}"))
    assert endpoints.name == "e"
    for kind in (K8S_NOTIFICATION_SOURCE, ENDPOINT_NOTIFICATION_SOURCE):
        assert kind not in ALPHA_TYPES
        assert PLUGIN_TYPES[kind].category is Category.DATA_SOURCE


@pytest.mark.parametrize(("parameters", "field"), [
    ("", "version"),  # required, as the reference's factory
    ("{kind: Pod}", "version"),
    ("{version: v1}", "kind"),
    ("{version: v1, kind: ''}", "kind"),
    ("{version: '../../secrets', kind: Pod}", "version"),
    ("{version: v1, kind: 'Pod/x'}", "kind"),
    ("{group: 'a..b', version: v1, kind: Pod}", "group"),
    ("{group: Example.COM, version: v1, kind: Pod}", "group"),
    ("{version: v1, kind: Pod, plural: pods}", "plural"),
])
def test_bad_parameters_name_the_field(parameters: str, field: str) -> None:
    with pytest.raises(ConfigError) as caught:
        declared(f"{{type: {K8S_NOTIFICATION_SOURCE}, parameters: {parameters or '{}'}}}")
    assert caught.value.field == f"{P}.{field}"


def test_the_endpoint_source_takes_no_parameter() -> None:
    with pytest.raises(ConfigError) as caught:
        declared(f"{{type: {ENDPOINT_NOTIFICATION_SOURCE}, parameters: {{kind: Pod}}}}")
    assert caught.value.field == f"{P}.kind"


def test_a_bad_parameter_is_one_line_and_exit_2_from_the_command() -> None:
    text = HEAD + f"plugins:\n- {{type: {K8S_NOTIFICATION_SOURCE}, parameters: {{version: v1}}}}\n"
    result = run_cli(["--pool-name", "p", "--config-text", text])
    assert result.returncode == 2, result.stderr
    (line,) = result.stderr.strip().splitlines()
    assert f"{P}.kind: expected" in line, line


def test_plural_guess_and_lightkube_models() -> None:
    assert [plural_of(k) for k in ("Widget", "Policy", "Status")] == ["widgets", "policies", "statuses"]
    endpoints = resource_for(GVK("", "v1", "Endpoints"))
    assert endpoints._api_info.plural == "endpoints"  # lightkube's model, not the guess
    assert resource_for(GVK("example.com", "v1", "Widget"))._api_info.plural == "widgets"


# -- the sans-IO sources ------------------------------------------------------------------------


def recorder() -> tuple[list[tuple[str, str]], Any]:
    seen: list[tuple[str, str]] = []
    return seen, lambda kind, obj: seen.append((kind, obj["metadata"]["name"]))


def test_events_pass_through_to_every_extractor() -> None:
    source = NotificationSource("s", GVK("example.com", "v1", "Widget"))
    seen, extractor = recorder()
    other, second = recorder()
    source.extractors += [extractor, second]
    a = {**widget("a"), "metadata": {**widget("a")["metadata"], "resourceVersion": "1"}}
    source.replace([a, widget("b")])
    source.apply(MODIFIED, {**a, "metadata": {**a["metadata"], "resourceVersion": "2"}})
    source.apply(MODIFIED, {**a, "metadata": {**a["metadata"], "resourceVersion": "2"}})  # nothing new
    source.apply("BOOKMARK", a)
    source.replace([widget("b"), widget("c")])  # a relist: a is gone, c is new
    source.apply(DELETED, widget("c"))
    source.apply(DELETED, widget("never-seen"))
    assert seen == other == [(ADDED, "a"), (ADDED, "b"), (MODIFIED, "a"), (DELETED, "a"), (MODIFIED, "b"),
                             (ADDED, "c"), (DELETED, "c")]
    assert set(source.versions) == {(NAMESPACE, "b")} and source.events == 7


def test_malformed_and_oversized_objects_are_dropped_and_counted() -> None:
    source = NotificationSource("s", GVK("example.com", "v1", "Widget"))
    seen, extractor = recorder()
    source.extractors.append(extractor)
    source.apply(ADDED, {"metadata": {"name": 7}})
    source.apply(ADDED, {"kind": "Widget"})
    source.apply(ADDED, {**widget("huge"), "spec": {"blob": "x" * MAX_OBJECT_BYTES}})
    source.replace([{"metadata": "nope"}, widget("ok")])
    assert seen == [(ADDED, "ok")] and source.dropped == 4


def test_the_object_count_is_bounded(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("evergreen_trio.picker.notifications.MAX_OBJECTS", 3)
    source = NotificationSource("s", GVK("example.com", "v1", "Widget"))
    source.replace([widget(f"w{i}") for i in range(5)])
    assert len(source.versions) == 3 and source.dropped == 2
    source.apply(ADDED, widget("w9"))
    assert len(source.versions) == 3 and source.dropped == 3
    source.apply(DELETED, widget("w0"))
    source.apply(ADDED, widget("w9"))
    assert (NAMESPACE, "w9") in source.versions and len(source.versions) == 3


def test_endpoint_lifecycle_events() -> None:
    source = EndpointNotifications("e")
    seen: list[tuple[str, str]] = []
    source.extractors.append(lambda kind, endpoint: seen.append((kind, endpoint.address)))
    a, b = Endpoint("10.0.0.1", 8000), Endpoint("10.0.0.2", 8000)
    source.update([a, b])
    source.update([a, b])  # nothing changed
    relabelled = Endpoint("10.0.0.1", 8000, labels=(("role", "decode"),))
    source.update([relabelled])
    assert seen == [(ADDED, a.address), (ADDED, b.address), (DELETED, b.address), (MODIFIED, a.address)]


names = st.sampled_from([f"w{i}" for i in range(6)])
steps = st.lists(st.one_of(
    st.tuples(st.sampled_from([ADDED, MODIFIED, DELETED]), names, st.integers(0, 3)),
    st.lists(st.tuples(names, st.integers(0, 3)), max_size=6)), max_size=20)


@given(steps)
def test_the_extractors_replay_to_what_the_source_holds(script: list[Any]) -> None:
    source = NotificationSource("s", GVK("example.com", "v1", "Widget"))
    replayed: dict[str, str] = {}

    def extractor(kind: str, obj: Any) -> None:
        name = obj["metadata"]["name"]
        if kind == DELETED:
            assert name in replayed
            del replayed[name]
        else:
            assert (kind == ADDED) == (name not in replayed)
            replayed[name] = obj["metadata"].get("resourceVersion", "")

    source.extractors.append(extractor)

    def versioned(name: str, version: int) -> dict[str, Any]:
        obj = widget(name)
        obj["metadata"]["resourceVersion"] = str(version)
        return obj

    for step in script:
        if isinstance(step, tuple):
            source.apply(step[0], versioned(step[1], step[2]))
        else:
            source.replace([versioned(name, version) for name, version in step])
    assert replayed == {name: version for (_, name), version in source.versions.items()}


# -- the watch, against the stand-in API server -------------------------------------------------


async def test_a_source_follows_a_custom_resource_through_an_outage(nursery: trio.Nursery, tmp_path: Path) -> None:
    api = KubeApiServer(bookmark_interval_s=0.2)
    await nursery.start(api.serve)
    api.put(WIDGETS, widget("a"))
    api.put(WIDGETS, {**widget("elsewhere"), "metadata": {"name": "elsewhere", "namespace": "other"}})
    source = NotificationSource("widgets", GVK("example.com", "v1", "Widget"))
    seen, extractor = recorder()
    source.extractors.append(extractor)
    services = NotificationSource("services", GVK("", "v1", "Service"))
    api.put(SERVICES, {"apiVersion": "v1", "kind": "Service",
                       "metadata": {"name": "svc", "namespace": NAMESPACE}, "spec": {"ports": [{"port": 80}]}})
    access = ClusterAccess.load(str(write_kubeconfig(tmp_path, api.port)))
    nursery.start_soon(lambda: watch_notification_sources(access, NAMESPACE, [source, services], max_backoff_s=0.3))
    await eventually(lambda: seen == [(ADDED, "a")] and set(services.versions) == {(NAMESPACE, "svc")})
    api.put(WIDGETS, widget("b"))
    api.put(WIDGETS, widget("a", size=2))
    await eventually(lambda: seen == [(ADDED, "a"), (ADDED, "b"), (MODIFIED, "a")])
    api.stop()  # away: what it knew stays; back: relisted, the change made meanwhile told
    await trio.sleep(0.5)
    assert set(source.versions) == {(NAMESPACE, "a"), (NAMESPACE, "b")}
    api.delete(WIDGETS, NAMESPACE, "b")
    await api.start()
    await eventually(lambda: seen[-1] == (DELETED, "b"))
    api.compact()  # the next watch from an old version gets 410 Gone: a relist, nothing lost
    api.put(WIDGETS, widget("c"))
    await eventually(lambda: seen[-1] == (ADDED, "c"))
    assert all(f"/namespaces/{NAMESPACE}/" in r for r in api.requests if "widgets" in r), api.requests


# -- the runtime --------------------------------------------------------------------------------

BOTH = f"""---
{HEAD}plugins:
- {{type: {K8S_NOTIFICATION_SOURCE}, name: widgets, parameters: {{group: example.com, version: v1, kind: Widget}}}}
- {{type: {ENDPOINT_NOTIFICATION_SOURCE}, name: lifecycle}}
- {{type: queue-scorer}}
"""


async def test_the_picker_feeds_both_sources(nursery: trio.Nursery, caplog: pytest.LogCaptureFixture) -> None:
    config = parse_config("pool: {name: n, endpoints: ['127.0.0.1:1']}\n" + BOTH)
    given: list[list[NotificationSource]] = []
    sets: list[Any] = []

    async def notifications(sources: Sequence[NotificationSource]) -> None:
        given.append(list(sources))

    async def discovery(on_endpoints: Any) -> None:
        sets.append(on_endpoints)
        await trio.sleep_forever()

    with caplog.at_level(logging.INFO):
        await nursery.start(partial(run_picker, config, grpc_port=0, health_port=0, metrics_port=0,
                                    discovery=discovery, notifications=notifications))
        await eventually(lambda: bool(given and sets))
        sets[0]([Endpoint("10.0.0.1", 8000), Endpoint("10.0.0.2", 8000)])
        sets[0]([Endpoint("10.0.0.2", 8000, labels=(("a", "b"),))])
    assert [(s.name, s.gvk) for s in given[0]] == [("widgets", GVK("example.com", "v1", "Widget"))]
    lines = [r.getMessage() for r in caplog.records if "endpoint_notifications" in r.getMessage()]
    assert lines == ["picker.endpoint_notifications source=lifecycle added=2 modified=0 deleted=0",
                     "picker.endpoint_notifications source=lifecycle added=0 modified=1 deleted=1"]


async def test_without_a_cluster_a_k8s_source_is_a_warning(nursery: trio.Nursery,
                                                           caplog: pytest.LogCaptureFixture) -> None:
    config = parse_config("pool: {name: n, endpoints: ['127.0.0.1:1']}\n" + BOTH)
    with caplog.at_level(logging.INFO):
        await nursery.start(partial(run_picker, config, grpc_port=0, health_port=0, metrics_port=0))
    messages = [r.getMessage() for r in caplog.records]
    assert any("notifications_without_cluster" in m and "sources=widgets" in m for m in messages), messages
    assert "picker.endpoint_notifications source=lifecycle added=1 modified=0 deleted=0" in messages
