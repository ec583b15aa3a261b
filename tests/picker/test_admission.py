"""Admission and ``probabilistic-admitter``, sans-IO: llm-d-router's own test cases, the shedding
rate over seeded draws, the director's order and answer (500, ``request cannot be admitted``)
through the scheduler and the ext_proc stream, and the parameters in an EndpointPickerConfig."""

from __future__ import annotations

import json
import math
import random
from collections.abc import Callable, Sequence
from pathlib import Path

import pytest
from envoy.service.ext_proc.v3 import external_processor_pb2 as ep
from hypothesis import given, settings
from hypothesis import strategies as st
from test_processor import make_picker, request_body, request_headers, status

from evergreen_trio.picker.admission import Admitter, ProbabilisticAdmitter, admit
from evergreen_trio.picker.config import load_config, parse_config
from evergreen_trio.picker.engine_metrics import EndpointMetrics
from evergreen_trio.picker.errors import ConfigError, RequestError
from evergreen_trio.picker.plugins import PLUGIN_TYPES, Category
from evergreen_trio.picker.processor import Picker
from evergreen_trio.picker.scheduler import PickRequest, PoolSnapshot, Scheduler

HEAD = "---\napiVersion: llm-d.ai/v1alpha1\nkind: EndpointPickerConfig\n"
P = "EndpointPickerConfig.plugins[0].parameters"
DEFAULT = ProbabilisticAdmitter()
SHEDDABLE = -1


def _draws(value: float) -> Callable[[], float]:
    return lambda: value


def _no_draw() -> float:
    raise AssertionError("a decision that needs no draw drew one")


def _pods(*loads: tuple[float, float]) -> list[EndpointMetrics | None]:
    return [EndpointMetrics(waiting=waiting, kv_usage=kv) for waiting, kv in loads]


# -- llm-d-router's cases (plugin_test.go) ------------------------------------------------------


def test_protected_tiers_are_always_admitted() -> None:
    for priority in (0, 100):
        assert DEFAULT.denial(priority, _pods((100, 0)), _no_draw) is None


def test_sheddable_rejected_at_high_saturation_admitted_at_zero() -> None:
    assert DEFAULT.denial(SHEDDABLE, _pods((100, 0)), _draws(0.0)) is not None  # saturation 20
    assert DEFAULT.denial(SHEDDABLE, _pods((0, 0)), _draws(0.0)) is None  # 0 < 0 is false


def test_never_scraped_counts_saturated_and_no_pods_admit() -> None:
    assert DEFAULT.saturation([None]) == 1.0
    assert DEFAULT.denial(SHEDDABLE, [None], _draws(0.0)) is not None
    assert DEFAULT.denial(SHEDDABLE, [], _no_draw) is None


def test_saturation_is_the_mean_over_pods() -> None:
    pods = _pods((10, 0), (0, 0))  # max(10/5, 0) = 2 and 0: mean 1
    assert DEFAULT.saturation(pods) == 1.0
    assert DEFAULT.denial(SHEDDABLE, pods, _draws(0.0)) is not None
    assert DEFAULT.saturation(_pods((1, 0.6))) == 0.6 / 0.8  # max(1/5, 0.6/0.8)


def test_quintic_curve() -> None:
    saturation = 0.272 / 0.8  # 0.34: 0.34^5 x 300 > 1
    assert DEFAULT.probability(saturation) == 1.0
    assert DEFAULT.denial(SHEDDABLE, _pods((0, 0.272)), _draws(0.999)) is not None
    assert DEFAULT.probability(0.2) == pytest.approx(0.096)
    assert DEFAULT.probability(0.15) == pytest.approx(0.0228, abs=1e-4)  # the README's ~2.3%


def test_probabilistic_shedding_follows_the_draw() -> None:
    pods = _pods((0, 0.16))  # saturation 0.2: p ~ 0.096
    assert DEFAULT.denial(SHEDDABLE, pods, _draws(0.9)) is None
    assert DEFAULT.denial(SHEDDABLE, pods, _draws(0.0)) is not None


def test_denial_reason_is_the_reference_error_text() -> None:
    reason = DEFAULT.denial(SHEDDABLE, _pods((5, 0.8)), _draws(0.0))
    assert reason == "inference error: ResourceExhausted - probabilistic-admitter: rejected, saturation=1.000 prob=1.00"
    reason = DEFAULT.denial(SHEDDABLE, _pods((0, 0.16)), _draws(0.05))
    assert reason == ("inference error: ResourceExhausted - probabilistic-admitter: rejected, "
                      "saturation=0.200 prob=0.10")


def test_go_float_edges() -> None:
    # Infinite load: Go prints +Inf; an overflowing power is +Inf, not an error.
    reason = DEFAULT.denial(SHEDDABLE, _pods((0, math.inf)), _draws(0.5))
    assert reason is not None and "saturation=+Inf prob=1.00" in reason
    assert DEFAULT.probability(1e100) == 1.0
    # NaN load: the probability is NaN and no draw is below it.
    assert DEFAULT.denial(SHEDDABLE, _pods((0, math.nan)), _draws(0.0)) is None
    assert math.isnan(DEFAULT.saturation(_pods((math.nan, 0), (0, 0))))
    # A negative base to a fractional power is NaN in Go, where Python raises.
    assert ProbabilisticAdmitter(power=2.5).denial(SHEDDABLE, _pods((-5, 0)), _draws(0.0)) is None


# -- the shedding rate over many seeded draws ---------------------------------------------------


@settings(max_examples=25, deadline=None)
@given(st.floats(0.05, 0.4), st.integers(0, 2**32 - 1))
def test_rejection_rate_follows_the_probability(kv: float, seed: int) -> None:
    rng = random.Random(seed)
    pods = _pods((0, kv))
    expected = DEFAULT.probability(kv / 0.8)
    trials = 4000
    rejected = sum(DEFAULT.denial(SHEDDABLE, pods, rng.random) is not None for _ in range(trials))
    tolerance = 5 * math.sqrt(expected * (1 - expected) / trials) + 1e-9
    assert abs(rejected / trials - expected) <= tolerance


# -- the admission step ---------------------------------------------------------------------------


class _Fixed:
    def __init__(self, reason: str | None, seen: list[str]) -> None:
        self.reason, self.seen = reason, seen

    def denial(self, priority: int, metrics: Sequence[EndpointMetrics | None],
               draw: Callable[[], float]) -> str | None:
        self.seen.append(self.reason or "admit")
        return self.reason


def test_the_first_denial_answers_500() -> None:
    seen: list[str] = []
    admitters: list[Admitter] = [_Fixed(None, seen), _Fixed("no", seen), _Fixed("never asked", seen)]
    with pytest.raises(RequestError) as caught:
        admit(admitters, 0, [], _no_draw)
    assert (caught.value.status, caught.value.message) == (500, "request cannot be admitted: no")
    assert seen == ["admit", "no"]
    admit(admitters[:1], 0, [], _no_draw)


POOL = "pool: {endpoints: ['10.0.0.1:8000', '10.0.0.2:8000']}\n"
ADMITTER = """plugins:
- {type: probabilistic-admitter, parameters: {queueDepthThreshold: 10}}
- {type: queue-scorer}
"""


def _scheduler(plugins: str, metrics: EndpointMetrics, rng: random.Random, legacy_queue: int = 1000) -> Scheduler:
    """A scheduler whose legacy shedding saturates at ``legacy_queue`` waiting requests."""
    config = parse_config(POOL + HEAD + plugins + f"saturationDetector: {{queueDepthThreshold: {legacy_queue}}}\n")
    snapshot = PoolSnapshot(config.pool.endpoints, 2.0, lambda: 0.0)
    for endpoint in config.pool.endpoints:
        snapshot.update(endpoint.address, metrics)
    return Scheduler(config, snapshot, rng)


def test_the_scheduler_admits_after_its_checks_and_before_its_profiles() -> None:
    scheduler = _scheduler(ADMITTER, EndpointMetrics(waiting=20), random.Random(1))
    assert scheduler.admitters == [ProbabilisticAdmitter(10)]
    assert scheduler.pick(PickRequest("m", 0))  # protected
    with pytest.raises(RequestError) as caught:  # saturation 2: always shed
        scheduler.pick(PickRequest("m", SHEDDABLE))
    assert caught.value.status == 500
    assert caught.value.message.startswith("request cannot be admitted: inference error: ResourceExhausted - "
                                           "probabilistic-admitter: rejected, saturation=2.000 prob=1.00")
    with pytest.raises(RequestError) as caught:  # an empty subset: 503 before the admitters
        scheduler.pick(PickRequest("m", 0, subset=frozenset()))
    assert (caught.value.status, caught.value.dropped_reason) == (503, "rejected-no-endpoints")
    with pytest.raises(RequestError) as caught:  # sheddable: the legacy admission reads no candidates as saturated
        scheduler.pick(PickRequest("m", SHEDDABLE, subset=frozenset()))
    assert (caught.value.status, caught.value.dropped_reason) == (429, "rejected-saturated")


def test_the_legacy_shedding_answers_first() -> None:
    scheduler = _scheduler(ADMITTER, EndpointMetrics(waiting=20), random.Random(1), legacy_queue=5)
    with pytest.raises(RequestError) as caught:
        scheduler.pick(PickRequest("m", SHEDDABLE))
    assert caught.value.status == 429  # as the reference's legacy admission controller, before the admitters


def test_a_seeded_scheduler_sheds_at_the_configured_rate() -> None:
    scheduler = _scheduler(ADMITTER, EndpointMetrics(waiting=2.5), random.Random(11))  # saturation 0.25
    expected = ProbabilisticAdmitter(10).probability(0.25)
    shed = 0
    for _ in range(4000):
        try:
            scheduler.pick(PickRequest("m", SHEDDABLE))
        except RequestError:
            shed += 1
    assert abs(shed / 4000 - expected) < 5 * math.sqrt(expected * (1 - expected) / 4000)


# -- through the ext_proc stream ------------------------------------------------------------------


def _stream_picker(extra: str, metrics: EndpointMetrics) -> Picker:
    return make_picker(HEAD + extra, metrics=[metrics] * 3)


def _send(picker: Picker, model: str) -> list[ep.ProcessingResponse]:
    stream = picker.new_stream()
    stream.on_message(request_headers())
    replies = list(stream.on_message(request_body(json.dumps({"model": model, "prompt": "hi"}).encode())))
    assert stream.report.error == (500 if replies[0].HasField("immediate_response") else None)
    return replies


def test_a_rejected_request_gets_the_reference_answer() -> None:
    picker = _stream_picker("plugins: [{type: probabilistic-admitter}, {type: queue-scorer}]\n"
                            "saturationDetector: {queueDepthThreshold: 1000, kvCacheUtilThreshold: 10}\n",
                            EndpointMetrics(waiting=1, kv_usage=0.8))  # saturation 1: p = 1, not shed as legacy
    replies = _send(picker, "batch")  # Sheddable
    assert status(replies) == 500
    response = replies[0].immediate_response
    error = json.loads(response.body)["error"]
    assert error == {"message": "request cannot be admitted: inference error: ResourceExhausted - "
                                "probabilistic-admitter: rejected, saturation=1.000 prob=1.00",
                     "type": "endpoint_picker", "code": 500}
    assert response.details == "endpoint_picker_500"
    assert not any(h.header.key == "x-llm-d-request-dropped-reason" for h in response.headers.set_headers)
    assert _send(picker, "plain")[0].HasField("request_headers")


def test_under_flow_control_the_admitter_sees_the_real_priority() -> None:
    # The reference's deploy/config/probabilistic-admitter-epp-config.yaml with the gate on: the
    # detector never saturates, flow control dispatches, the admitter sheds.
    picker = _stream_picker("""featureGates: [flowControl]
plugins:
- type: probabilistic-admitter
- type: random-picker
- type: utilization-detector
  parameters: {queueDepthThreshold: 999999999, kvCacheUtilThreshold: 1.0}
flowControl:
  saturationDetector: {pluginRef: utilization-detector}
schedulingProfiles:
- {name: default, plugins: [{pluginRef: random-picker}]}
""", EndpointMetrics(waiting=0, kv_usage=0.9))
    assert picker.flow is not None
    assert status(_send(picker, "batch")) == 500
    assert _send(picker, "plain")[0].HasField("request_headers")


# -- EndpointPickerConfig -----------------------------------------------------------------------


def test_the_type_is_implemented() -> None:
    assert PLUGIN_TYPES["probabilistic-admitter"].category is Category.ADMITTER


def test_loads_from_a_file(tmp_path: Path) -> None:
    path = tmp_path / "epp.yaml"
    path.write_text(POOL + HEAD + """plugins:
- {type: probabilistic-admitter, name: shed, parameters: {queueDepthThreshold: 10, kvCacheUtilThreshold: 0.9,
   power: 3, k: 100}}
- {type: probabilistic-admitter, name: defaults}
""")
    epp = load_config(path).epp
    assert epp is not None
    plugins = epp.plugins
    assert plugins["shed"].params == ProbabilisticAdmitter(10, 0.9, 3.0, 100.0)
    assert plugins["defaults"].params == ProbabilisticAdmitter(5, 0.8, 5.0, 300.0)


def test_the_reference_example_config_loads() -> None:
    path = Path(__file__).parent / "fixtures" / "llm-d-router" / "probabilistic-admitter-epp-config.yaml"
    config = load_config(path, cluster_pool="pool")
    assert config.flow_control is None  # no flowControl gate
    scheduler = Scheduler(config, PoolSnapshot((), 2.0, lambda: 0.0))
    assert scheduler.admitters == [ProbabilisticAdmitter()]


@pytest.mark.parametrize(("parameters", "field"), [
    ("{queueDepthThreshold: 0}", f"{P}.queueDepthThreshold"),
    ("{queueDepthThreshold: -3}", f"{P}.queueDepthThreshold"),
    ("{queueDepthThreshold: 2.5}", f"{P}.queueDepthThreshold"),
    ("{queueDepthThreshold: 9223372036854775808}", f"{P}.queueDepthThreshold"),
    ("{kvCacheUtilThreshold: 0}", f"{P}.kvCacheUtilThreshold"),
    ("{kvCacheUtilThreshold: -0.1}", f"{P}.kvCacheUtilThreshold"),
    ("{kvCacheUtilThreshold: .nan}", f"{P}.kvCacheUtilThreshold"),
    ("{kvCacheUtilThreshold: high}", f"{P}.kvCacheUtilThreshold"),
    ("{power: 0}", f"{P}.power"),
    ("{power: -1}", f"{P}.power"),
    ("{power: .inf}", f"{P}.power"),
    ("{k: 0}", f"{P}.k"),
    ("{k: -1}", f"{P}.k"),
    ("{K: 300}", f"{P}.K"),
])
def test_bad_parameters_name_the_field(parameters: str, field: str) -> None:
    with pytest.raises(ConfigError) as caught:
        parse_config(HEAD + f"plugins:\n- {{type: probabilistic-admitter, parameters: {parameters}}}\n",
                     cluster_pool="p")
    assert caught.value.field == field, caught.value


def test_an_admitter_is_not_a_profile_plugin() -> None:
    with pytest.raises(ConfigError, match=r"schedulingProfiles\[0\]\.plugins\[0\]\.pluginRef"):
        parse_config(HEAD + """plugins: [{type: probabilistic-admitter}]
schedulingProfiles: [{name: default, plugins: [{pluginRef: probabilistic-admitter}]}]
""", cluster_pool="p")
