"""Config loading: the issue's YAML example, Kubernetes manifests, and one clear error per bad field."""

from __future__ import annotations

import contextlib
from pathlib import Path

import pytest
import yaml
from hypothesis import given
from hypothesis import strategies as st

from evergreen_trio.picker.config import DestinationMode, TargetModel, load_config, parse_config
from evergreen_trio.picker.errors import ConfigError

EXAMPLE = """
pool:
  name: demo
  endpoints:                # static endpoints: no Kubernetes needed
    - address: 127.0.0.1:8001
      engine: vllm          # vllm | sglang | trtllm
  refreshMetricsInterval: 50ms
  metricsStalenessThreshold: 2s
models:
  - name: food-review       # the client's model name
    criticality: Standard   # Critical | Standard | Sheddable
    targetModels: [{name: food-review-v1, weight: 90}, {name: food-review-v2, weight: 10}]
scheduler:
  weights: {queue: 2, kv-cache: 2, prefix-cache: 3, lora-affinity: 0}
"""

MANIFESTS = """
apiVersion: inference.networking.k8s.io/v1
kind: InferencePool
metadata: {name: vllm-llama3-8b-instruct}
spec:
  targetPorts: [{number: 8000}]
  selector: {matchLabels: {app: vllm-llama3-8b-instruct}}
  endpointPickerRef: {name: vllm-llama3-8b-instruct-epp, port: {number: 9002}}
---
apiVersion: inference.networking.x-k8s.io/v1alpha2
kind: InferenceModel
metadata: {name: food-review}
spec:
  modelName: food-review
  criticality: Critical
  poolRef: {name: vllm-llama3-8b-instruct}
  targetModels: [{name: food-review-1, weight: 100}]
---
apiVersion: inference.networking.x-k8s.io/v1alpha2
kind: InferenceModel
metadata: {name: elsewhere}
spec: {modelName: elsewhere, poolRef: {name: another-pool}}
---
apiVersion: inference.networking.x-k8s.io/v1alpha2
kind: InferenceObjective
metadata: {name: batch}
spec: {priority: -5, poolRef: {name: vllm-llama3-8b-instruct}}
---
pool:
  endpoints: [10.0.0.1, 10.0.0.2:8001, {address: "[::1]", engine: sglang}]
extProc: {destinationMode: list, maxEndpointsInList: 4}
"""


def test_issue_example(tmp_path: Path) -> None:
    path = tmp_path / "picker.yaml"
    path.write_text(EXAMPLE)
    config = load_config(path)
    assert config.pool.name == "demo"
    assert [e.address for e in config.pool.endpoints] == ["127.0.0.1:8001"]
    assert config.pool.refresh_interval_s == pytest.approx(0.05)
    assert config.pool.staleness_threshold_s == 2.0
    model = config.model("food-review")
    assert model is not None and model.priority == 0 and not model.sheddable
    assert model.target_models == (TargetModel("food-review-v1", 90), TargetModel("food-review-v2", 10))
    assert (config.scheduler.queue, config.scheduler.kv_cache, config.scheduler.prefix_cache) == (2, 2, 3)


def test_kubernetes_manifests_with_static_endpoints() -> None:
    config = parse_config(MANIFESTS)
    assert config.pool.name == "vllm-llama3-8b-instruct"
    assert [e.address for e in config.pool.endpoints] == ["10.0.0.1:8000", "10.0.0.2:8001", "[::1]:8000"]
    assert config.pool.endpoints[2].engine == "sglang"
    assert [m.name for m in config.models] == ["food-review"]
    assert config.models[0].priority == 1
    assert config.objectives == {"batch": -5}
    assert config.ext_proc.destination_mode is DestinationMode.LIST
    assert config.ext_proc.max_endpoints_in_list == 4


@pytest.mark.parametrize(("text", "field"), [
    ("pool: {endpoints: []}", "pool.endpoints"),
    ("pool: {endpoints: [{address: 'localhost:80'}]}", "pool.endpoints[0].address"),
    ("pool: {endpoints: [{address: '127.0.0.1'}]}", "pool.endpoints[0].address"),
    ("pool: {endpoints: [{address: '127.0.0.1:99999'}]}", "pool.endpoints[0].address"),
    ("pool: {endpoints: [{address: '127.0.0.1:\u00b2'}]}", "pool.endpoints[0].address"),
    ("pool: {endpoints: [{address: '127.0.0.1:1', engine: tgi}]}", "pool.endpoints[0].engine"),
    ("pool: {endpoints: ['127.0.0.1:1', '127.0.0.1:1']}", "pool.endpoints[1].address"),
    ("pool: {endpoints: ['127.0.0.1:1'], refreshMetricsInterval: soon}", "pool.refreshMetricsInterval"),
    ("pool: {endpoints: ['127.0.0.1:1'], colour: red}", "pool.colour"),
    ("pool: {endpoints: ['127.0.0.1:1']}\nmodels: [{name: m, criticality: Urgent}]", "models[0].criticality"),
    ("pool: {endpoints: ['127.0.0.1:1']}\nmodels: [{name: m, criticality: [Critical]}]", "models[0].criticality"),
    ("pool: {endpoints: ['127.0.0.1:1']}\nobjectives: [{name: o, criticality: {a: 1}}]", "objectives[0].criticality"),
    ("pool: {endpoints: ['127.0.0.1:1']}\nmodels: [{name: m, targetModels: [{name: t, weight: -1}]}]",
     "models[0].targetModels[0].weight"),
    ("pool: {endpoints: ['127.0.0.1:1']}\nmodels: [{name: m}, {name: m}]", "models[1].name"),
    ("pool: {endpoints: ['127.0.0.1:1']}\n"
     "scheduler: {weights: {queue: 0, kv-cache: 0, prefix-cache: 0, active-request: 0}}",
     "scheduler.weights"),
    ("pool: {endpoints: ['127.0.0.1:1']}\nscheduler: {weights: {latency: 1}}", "scheduler.weights.latency"),
    ("pool: {endpoints: ['127.0.0.1:1']}\nscheduler: {weights: {queue: .nan}}", "scheduler.weights.queue"),
    ("pool: {endpoints: ['127.0.0.1:1']}\nscheduler: {weights: {token-load: .inf}}", "scheduler.weights.token-load"),
    ("pool: {endpoints: ['127.0.0.1:1'], refreshMetricsInterval: .inf}", "pool.refreshMetricsInterval"),
    (f"pool: {{endpoints: ['127.0.0.1:1'], scrapeTimeout: {10**400}}}", "pool.scrapeTimeout"),
    ("pool: {endpoints: ['127.0.0.1:1']}\nextProc: {streamedChunkBytes: 70000}", "extProc.streamedChunkBytes"),
    ("pool: {endpoints: ['127.0.0.1:1']}\nextProc: {destinationMode: random}", "extProc.destinationMode"),
    ("pool: {endpoints: ['127.0.0.1:1']}\nextProc: {observeResponses: sometimes}", "extProc.observeResponses"),
    ("models: []", "pool"),
    ("pool: [", "1:8"),
    ("kind: Gateway\nmetadata: {name: g}\nspec: {}", "document[0].kind"),
])
def test_bad_config_names_the_field(text: str, field: str) -> None:
    with pytest.raises(ConfigError) as info:
        parse_config(text)
    assert info.value.field == field
    assert str(info.value).startswith(field)


def test_missing_file_is_a_config_error(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="readable"):
        load_config(tmp_path / "absent.yaml")


_scalars = st.one_of(st.none(), st.booleans(), st.integers(), st.floats(allow_nan=False), st.text(max_size=20))
_values = st.recursive(
    _scalars,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=15), inner, max_size=4),
    max_leaves=20,
)


@pytest.mark.fuzz
@given(st.text(max_size=400))
def test_fuzz_config_text_only_raises_config_error(text: str) -> None:
    with contextlib.suppress(ConfigError):
        parse_config(text)


@pytest.mark.fuzz
@given(st.dictionaries(st.sampled_from(["pool", "models", "objectives", "scheduler", "extProc", "kind"]),
                       _values, max_size=5))
def test_fuzz_config_documents_only_raise_config_error(document: dict[str, object]) -> None:
    with contextlib.suppress(ConfigError):
        parse_config(yaml.safe_dump(document))


@pytest.mark.fuzz
@given(st.fixed_dictionaries({"endpoints": st.lists(_values | st.just("127.0.0.1:80"), max_size=3)},
                             optional={"refreshMetricsInterval": _values, "name": _values}),
       st.lists(st.dictionaries(st.sampled_from(["name", "criticality", "priority", "targetModels"]), _values),
                max_size=3))
def test_fuzz_pool_and_models_only_raise_config_error(pool: dict[str, object], models: list[object]) -> None:
    with contextlib.suppress(ConfigError):
        parse_config(yaml.safe_dump({"pool": pool, "models": models}))
