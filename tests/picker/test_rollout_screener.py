"""``disaggregatedset-rollout-screener``: llm-d-router's config, plugin and metrics tests, invariants
of the revision shares, the scheduler screening candidates, and bad parameters through the command."""

from __future__ import annotations

import math
import random
from collections import Counter
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st
from picker_cli import run_cli
from prometheus_client import CollectorRegistry

from evergreen_trio.picker.config import parse_config
from evergreen_trio.picker.engine_metrics import EndpointMetrics
from evergreen_trio.picker.errors import ConfigError, RequestError
from evergreen_trio.picker.plugins import ALPHA_TYPES, PLUGIN_TYPES
from evergreen_trio.picker.rollout import (
    POD_EXTRACTOR,
    ROLLOUT_SCREENER,
    RolloutCollector,
    RolloutParams,
    RolloutScreener,
    dominant_role,
    parse_label_selector,
    pick_revision,
    revision_shares,
    sum_weight,
)
from evergreen_trio.picker.scheduler import PickRequest, PoolSnapshot, Scheduler

HEAD = "apiVersion: llm-d.ai/v1alpha1\nkind: EndpointPickerConfig\n"
P = "EndpointPickerConfig.plugins[0].parameters"
REV, ROLE = "disaggregatedset.x-k8s.io/revision", "disaggregatedset.x-k8s.io/role"
NAME = "disaggregatedset.x-k8s.io/name"
VALID = ("scope: {labelSelector: 'disaggregatedset.x-k8s.io/name=my-set'}, "
         "headerSelectors: [{name: revision, headerName: X-Disagg-Revision, labelKey: " + REV + ", mode: strict}], "
         "revisionGating: {mode: %s, requireRoles: {values: [prefill, decode]}}")


def params(parameters: str = VALID % "sum") -> RolloutParams:
    config = parse_config(HEAD + f"plugins:\n- {{type: {ROLLOUT_SCREENER}, name: s, parameters: {{{parameters}}}}}\n",
                          cluster_pool="p")
    assert config.epp is not None
    result = config.epp.plugins["s"].params
    assert isinstance(result, RolloutParams)
    return result


def ready_pod(name: str, revision: str, role: str, *, ready: bool = True, scope: str = "my-set") -> dict[str, Any]:
    return {"metadata": {"name": name, "namespace": "default", "labels": {REV: revision, ROLE: role, NAME: scope}},
            "status": {"phase": "Running", "conditions": [{"type": "Ready", "status": "True" if ready else "False"}]}}


def seeded(mode: str, counts: dict[str, dict[str, int]]) -> RolloutScreener:
    screener = RolloutScreener(params(VALID % mode), "test-screener")
    for revision, roles in counts.items():
        for role, count in roles.items():
            for i in range(count):
                screener.apply("ADDED", ready_pod(f"{revision}-{role}-{i}", revision, role))
    return screener


def labels(candidate: dict[str, str]) -> dict[str, str]:
    return candidate


def pool(v1: int, v2: int) -> list[dict[str, str]]:
    return [{REV: "v1", ROLE: "prefill"}] * v1 + [{REV: "v2", ROLE: "prefill"}] * v2


# -- config_test.go ------------------------------------------------------------------------------


def test_valid_config_and_defaults() -> None:
    got = params()
    assert got.mode == "sum" and got.require_roles == ("prefill", "decode")
    assert (got.revision_label, got.role_label) == (REV, ROLE)
    (selector,) = got.selectors
    assert (selector.header, selector.strict) == ("x-disagg-revision", True)  # lower-cased at parse time
    assert params("scope: {labelSelector: a=b}, revisionGating: {mode: disabled}").gating is False


@pytest.mark.parametrize(("parameters", "field"), [
    ("revisionGating: {mode: disabled}", "scope.labelSelector"),
    ("scope: {labelSelector: 'a in b'}, revisionGating: {mode: disabled}", "scope.labelSelector"),
    ("scope: {labelSelector: '=b'}, revisionGating: {mode: disabled}", "scope.labelSelector"),
    ("scope: {labelSelector: a=b}", "revisionGating"),
    ("scope: {labelSelector: a=b}, revisionGating: {mode: fancy}", "revisionGating.mode"),
    ("scope: {labelSelector: a=b}, revisionGating: {mode: sum}", "revisionGating.requireRoles"),
    ("scope: {labelSelector: a=b}, revisionGating: {mode: max-role, requireRoles: {values: []}}",
     "revisionGating.requireRoles.values"),
    ("scope: {labelSelector: a=b}, revisionGating: {mode: sum, requireRoles: {values: [p, p]}}",
     "revisionGating.requireRoles.values[1]"),
    ("scope: {labelSelector: a=b}, revisionGating: {mode: sum, requireRoles: {values: ['']}}",
     "revisionGating.requireRoles.values[0]"),
    ("scope: {labelSelector: a=b}, revisionGating: {mode: disabled}, headerSelectors: [{headerName: h, labelKey: l, "
     "mode: strict}]", "headerSelectors[0].name"),
    ("scope: {labelSelector: a=b}, revisionGating: {mode: disabled}, headerSelectors: [{name: n, labelKey: l, "
     "mode: strict}]", "headerSelectors[0].headerName"),
    ("scope: {labelSelector: a=b}, revisionGating: {mode: disabled}, headerSelectors: [{name: n, headerName: h, "
     "mode: strict}]", "headerSelectors[0].labelKey"),
    ("scope: {labelSelector: a=b}, revisionGating: {mode: disabled}, headerSelectors: [{name: n, headerName: h, "
     "labelKey: l, mode: soft}]", "headerSelectors[0].mode"),
    ("scope: {labelSelector: a=b}, revisionGating: {mode: disabled}, headerSelectors: [{name: n, headerName: h, "
     "labelKey: l, mode: strict}, {name: n, headerName: g, labelKey: l, mode: prefer}]", "headerSelectors[1].name"),
    ("scope: {labelSelector: a=b}, revisionGating: {mode: disabled}, headerSelectors: [{name: n, headerName: h, "
     "labelKey: l, mode: strict}, {name: m, headerName: H, labelKey: l, mode: prefer}]",
     "headerSelectors[1].headerName"),  # duplicates compare lower-cased
    ("scope: {labelSelector: a=b}, revisionGating: {mode: disabled}, headerSelectors: [{name: n, headerName: h, "
     "labelKey: l, mode: strict, extra: 1}]", "headerSelectors[0].extra"),  # unknown fields are refused
])
def test_bad_config_names_the_field(parameters: str, field: str) -> None:
    with pytest.raises(ConfigError) as caught:
        params(parameters)
    assert caught.value.field == f"{P}.{field}"


def test_parameters_are_required() -> None:
    with pytest.raises(ConfigError) as caught:
        parse_config(HEAD + f"plugins:\n- {{type: {ROLLOUT_SCREENER}}}\n", cluster_pool="p")
    assert caught.value.field == P


@pytest.mark.parametrize(("text", "kept", "dropped"), [
    ("a=b", {"a": "b"}, {"a": "c"}),
    ("a==b", {"a": "b"}, {}),
    ("a!=b", {}, {"a": "b"}),
    ("a in (b, c),d", {"a": "c", "d": ""}, {"a": "c"}),
    ("a notin (b,c), !d", {"a": "x"}, {"a": "x", "d": "y"}),
    ("example.com/tier=gold", {"example.com/tier": "gold"}, {"tier": "gold"}),
])
def test_label_selectors_as_kubernetes_reads_them(text: str, kept: dict[str, str], dropped: dict[str, str]) -> None:
    selector = parse_label_selector(text, "s")
    assert selector.keeps(kept) and not selector.keeps(dropped)


# -- plugin_test.go -------------------------------------------------------------------------------


def test_pod_notifications_track_only_ready_pods_in_scope() -> None:
    screener = RolloutScreener(params())
    for pod in (ready_pod("p1", "v1", "prefill"), ready_pod("p2", "v2", "decode", scope="other"),
                ready_pod("p3", "v1", "decode", ready=False)):
        screener.apply("ADDED", pod)
    assert screener.role_counts == {"v1": {"prefill": 1}}
    screener.apply("DELETED", ready_pod("p1", "v1", "prefill"))
    assert screener.role_counts == {}


def test_pod_notifications_refresh_cached_revision_shares() -> None:
    screener = seeded("sum", {"v1": {"prefill": 2, "decode": 2}, "v2": {"prefill": 1, "decode": 1}})
    assert screener.shares == pytest.approx({"v1": 2 / 3, "v2": 1 / 3})
    screener.apply("MODIFIED", ready_pod("v1-decode-0", "v2", "decode"))  # relabelled to v2
    assert screener.shares == pytest.approx({"v1": 1 / 2, "v2": 1 / 2})
    screener.apply("MODIFIED", ready_pod("v1-decode-0", "v2", "decode", ready=False))
    assert screener.shares == pytest.approx({"v1": 3 / 5, "v2": 2 / 5})


def test_revision_sum_weight_and_coverage() -> None:
    assert sum_weight({"prefill": 2, "decode": 8}, ["prefill", "decode"]) == 10
    assert sum_weight({"decode": 8}, ["prefill", "decode"]) is None


def test_dominant_role_uses_counts_across_covered_revisions() -> None:
    covered = {"v1": {"prefill": 8, "decode": 1}, "v2": {"prefill": 2, "decode": 4}}
    assert dominant_role(covered, ["prefill", "decode"]) == dominant_role(covered, ["decode", "prefill"]) == "prefill"
    tied = {"v1": {"prefill": 8, "decode": 2}, "v2": {"prefill": 2, "decode": 8}}
    assert dominant_role(tied, ["prefill", "decode"]) == "prefill"


SHARES = [
    ("sum", {"v1": {"prefill": 2, "decode": 8}, "v2": {"prefill": 1, "decode": 2}}, 3 / 13),
    ("max-role", {"v1": {"prefill": 2, "decode": 8}, "v2": {"prefill": 1, "decode": 2}}, 2 / 10),
    ("sum", {"v1": {"prefill": 8, "decode": 8}, "v2": {"prefill": 2, "decode": 2}}, 2 / 10),
    ("max-role", {"v1": {"prefill": 8, "decode": 8}, "v2": {"prefill": 2, "decode": 2}}, 2 / 10),
    ("sum", {"v1": {"prefill": 8, "decode": 2}, "v2": {"prefill": 2, "decode": 1}}, 3 / 13),
    ("max-role", {"v1": {"prefill": 8, "decode": 2}, "v2": {"prefill": 2, "decode": 1}}, 2 / 10),
    ("max-role", {"v1": {"prefill": 8, "decode": 1}, "v2": {"prefill": 2, "decode": 4}}, 2 / 10),
    ("max-role", {"v1": {"prefill": 2, "decode": 8}, "v2": {"prefill": 1, "decode": 2}, "v3": {"prefill": 100}},
     2 / 10),
]


@pytest.mark.parametrize(("mode", "counts", "v2"), SHARES)
def test_revision_modes_cache_expected_shares(mode: str, counts: dict[str, dict[str, int]], v2: float) -> None:
    shares = seeded(mode, counts).shares
    assert math.isclose(shares["v2"], v2) and math.isclose(shares["v1"], 1 - v2)


def test_pick_weighted_revision() -> None:
    shares = {"v1": 0.75, "v2": 0.25}
    assert (pick_revision(shares, 0), pick_revision(shares, 0.9), pick_revision({}, 0.5)) == ("v1", "v2", "")


def test_pinned_uncovered_revision_fails_closed() -> None:
    screener = seeded("sum", {"v1": {"prefill": 3}, "v2": {"prefill": 1, "decode": 1}})
    assert screener.screen({"x-disagg-revision": "v1"}, pool(1, 1), labels, random.random) == []
    assert screener.no_match == {"revision": 1}


def test_single_revision_still_checks_cross_role_coverage_and_no_pods_fail_closed() -> None:
    assert seeded("sum", {"v1": {"prefill": 2}}).screen({}, pool(1, 0), labels, random.random) == []
    assert seeded("sum", {}).screen({}, pool(1, 0), labels, random.random) == []


@pytest.mark.parametrize(("mode", "counts", "v2"), SHARES[:6])
def test_weighted_distribution(mode: str, counts: dict[str, dict[str, int]], v2: float) -> None:
    screener = seeded(mode, counts)
    rng = random.Random(7)
    candidates = pool(counts["v1"]["prefill"], counts["v2"]["prefill"])
    picks = Counter(screener.screen({}, candidates, labels, rng.random)[0][REV] for _ in range(10_000))
    assert abs(picks["v2"] / 10_000 - v2) < 0.03


def test_strict_selectors_with_gating_disabled() -> None:
    screener = RolloutScreener(params(VALID.replace("mode: %s, requireRoles: {values: [prefill, decode]}",
                                                    "mode: disabled")))
    candidates = [{REV: "v1"}, {REV: "v2"}]
    assert screener.screen({"x-disagg-revision": "v2"}, candidates, labels, random.random) == [{REV: "v2"}]
    assert screener.screen({"x-disagg-revision": "missing"}, candidates, labels, random.random) == []
    assert screener.screen({}, candidates, labels, random.random) == candidates
    screener.apply("ADDED", ready_pod("p", "v1", "prefill"))
    assert screener.role_counts == {}  # gating off: pods are not tracked


def test_response_header_stamps_selectors() -> None:
    for text in (VALID % "sum", VALID.replace(", requireRoles: {values: [prefill, decode]}", "") % "disabled"):
        assert RolloutScreener(params(text)).response_headers({REV: "v1", ROLE: "prefill"}) == {
            "x-disagg-revision": "v1"}


# -- metrics_test.go ------------------------------------------------------------------------------


def test_metrics_no_match_and_shares_with_removed_revisions_deleted() -> None:
    screener = seeded("sum", {"v1": {"prefill": 1, "decode": 1}, "v2": {"prefill": 1}})
    screener.screen({"x-disagg-revision": "nope"}, pool(1, 0), labels, random.random)
    registry = CollectorRegistry()
    registry.register(RolloutCollector([screener]))
    base = {"plugin_type": ROLLOUT_SCREENER, "plugin_name": "test-screener"}
    assert registry.get_sample_value("llm_d_epp_disaggregatedset_strict_header_no_match_total",
                                     {**base, "selector": "revision"}) == 1
    share = "llm_d_epp_disaggregatedset_revision_gating_share"
    assert registry.get_sample_value(share, {**base, "mode": "sum", "revision": "v1"}) == 1.0
    assert registry.get_sample_value(share, {**base, "mode": "sum", "revision": "v2"}) == 0.0  # incomplete
    screener.apply("DELETED", ready_pod("v2-prefill-0", "v2", "prefill"))
    assert registry.get_sample_value(share, {**base, "mode": "sum", "revision": "v2"}) is None


# -- invariants ---------------------------------------------------------------------------------

revisions = st.sampled_from(["a", "b", "c"])
roles = st.sampled_from(["prefill", "decode", "encode"])
events = st.lists(st.tuples(st.sampled_from(["ADDED", "MODIFIED", "DELETED", "BOOKMARK"]), st.integers(0, 8),
                            revisions, roles, st.booleans()), max_size=60)


@given(events, st.sampled_from(["sum", "max-role"]), st.floats(0, 0.999))
def test_shares_follow_the_pods_and_the_screen_keeps_one_covered_revision(
        steps: list[tuple[str, int, str, str, bool]], mode: str, draw: float) -> None:
    screener = RolloutScreener(params(VALID % mode))
    for kind, index, revision, role, ready in steps:
        screener.apply(kind, ready_pod(f"p{index}", revision, role, ready=ready))
    fresh = RolloutScreener(params(VALID % mode))
    fresh.replace([ready_pod(name, r, o) for (_, name), (r, o) in screener.pods.items()])
    assert fresh.role_counts == screener.role_counts  # incremental = listed anew
    shares = revision_shares(screener.role_counts, ("prefill", "decode"), mode)
    assert screener.shares == shares
    assert not shares or math.isclose(sum(shares.values()), 1.0)
    for revision in shares:
        assert screener.role_counts[revision].get("prefill") and screener.role_counts[revision].get("decode")
    candidates = [{REV: r, ROLE: "decode"} for r in "abc"]
    kept = screener.screen({}, candidates, labels, lambda: draw)
    assert len({c[REV] for c in kept}) <= 1 and all(shares.get(c[REV], 0) > 0 for c in kept)


@given(st.dictionaries(st.text("abc", min_size=1, max_size=2), st.floats(0.001, 1), max_size=5), st.floats(0, 0.999))
def test_a_draw_lands_on_a_revision_with_a_share(shares: dict[str, float], draw: float) -> None:
    chosen = pick_revision(shares, draw)
    assert chosen in shares if shares else chosen == ""


def test_hostile_pods_are_ignored_or_bounded() -> None:
    screener = RolloutScreener(params())
    for pod in (None, [], {"metadata": []}, {"metadata": {"name": 3}}, {"metadata": {"name": "x", "labels": "no"}},
                {**ready_pod("long", "v" * 64, "prefill")}, {"metadata": {"name": "y"}, "status": {"conditions": 5}}):
        screener.apply("ADDED", pod)
    assert screener.pods == {}


# -- the scheduler ------------------------------------------------------------------------------

A, B, C = "10.0.0.1:8000", "10.0.0.2:8000", "10.0.0.3:8000"


def test_the_scheduler_screens_before_its_profiles_and_stamps_the_response() -> None:
    pods = "\n".join(f"  - {{address: '{a}', labels: {{'{REV}': {r}, '{ROLE}': {o}}}}}"
                     for a, r, o in ((A, "v1", "prefill"), (B, "v1", "decode"), (C, "v2", "decode")))
    config = parse_config(f"pool:\n  name: t\n  endpoints:\n{pods}\n---\n{HEAD}plugins:\n"
                          f"- {{type: {ROLLOUT_SCREENER}, name: s, parameters: {{{VALID % 'sum'}}}}}\n")
    snapshot = PoolSnapshot(config.pool.endpoints, 2.0, lambda: 0.0)
    for endpoint in config.pool.endpoints:
        snapshot.update(endpoint.address, EndpointMetrics())
    scheduler = Scheduler(config, snapshot, random.Random(1))
    (screener,) = scheduler.screeners
    with pytest.raises(RequestError) as caught:
        scheduler.schedule(PickRequest("m", 0))  # no pod notification yet: fail closed
    assert (caught.value.status, caught.value.dropped_reason) == (503, "rejected-no-endpoints")
    for name, revision, role in (("a", "v1", "prefill"), ("b", "v1", "decode"), ("c", "v2", "decode")):
        screener.apply("ADDED", ready_pod(name, revision, role))
    for _ in range(20):  # v2 has no prefill pod: only v1's endpoints
        schedule = scheduler.schedule(PickRequest("m", 0), 3)
        assert set(schedule.endpoints) == {A, B} and schedule.response_headers == {"x-disagg-revision": "v1"}
    with pytest.raises(RequestError):
        scheduler.schedule(PickRequest("m", 0, headers={"x-disagg-revision": "v2"}))


# -- the registry and the command -----------------------------------------------------------------


def test_registered_as_the_reference_registers_it() -> None:
    assert ROLLOUT_SCREENER in PLUGIN_TYPES and ROLLOUT_SCREENER in ALPHA_TYPES
    # The pod extractor is the screener's own notification handler, no type a config declares (as
    # the reference, which never registers it).
    assert POD_EXTRACTOR not in PLUGIN_TYPES


@pytest.mark.parametrize(("parameters", "field"), [
    ("{scope: {labelSelector: 'a in b'}, revisionGating: {mode: disabled}}", "scope.labelSelector"),
    ("{scope: {labelSelector: a=b}, revisionGating: {mode: sum}}", "revisionGating.requireRoles"),
])
def test_a_bad_parameter_is_one_line_and_exit_2_from_the_command(parameters: str, field: str) -> None:
    text = HEAD + f"plugins:\n- {{type: {ROLLOUT_SCREENER}, parameters: {parameters}}}\n"
    result = run_cli(["--pool-name", "p", "--allow-experimental-plugins=true", "--config-text", text])
    assert result.returncode == 2, result.stderr
    (line,) = result.stderr.strip().splitlines()
    assert f"{P}.{field}: expected" in line, line
