"""The Endpoint Picker: an Envoy ext_proc server routing LLM requests by live model-server state.

Public entry points: :func:`run_picker` (the Trio runtime, stopped gracefully with a
:class:`PickerDrain`), :func:`gateway_config` and
:func:`write_gateway_config` (the Envoy bootstrap), :func:`run_envoy` (a real Envoy as a Trio
task), :func:`load_config` / :func:`parse_config` (YAML and Kubernetes manifests).
"""

from evergreen_trio._extras import require_extra

require_extra("picker", __name__)

from evergreen_trio.picker.config import Endpoint, PickerConfig, PoolConfig, load_config, parse_config
from evergreen_trio.picker.engine_metrics import parse_engine_metrics
from evergreen_trio.picker.envoy_config import gateway_config, write_gateway_config
from evergreen_trio.picker.envoy_process import find_envoy, run_envoy
from evergreen_trio.picker.errors import ConfigError, EnvoyError, MetricsError, PickerError
from evergreen_trio.picker.processor import Picker
from evergreen_trio.picker.runtime import PickerDrain, PickerPorts, run_picker
from evergreen_trio.picker.scheduler import PoolSnapshot

__all__ = [
    "ConfigError",
    "Endpoint",
    "EnvoyError",
    "MetricsError",
    "Picker",
    "PickerConfig",
    "PickerDrain",
    "PickerError",
    "PickerPorts",
    "PoolConfig",
    "PoolSnapshot",
    "find_envoy",
    "gateway_config",
    "load_config",
    "parse_config",
    "parse_engine_metrics",
    "run_envoy",
    "run_picker",
    "write_gateway_config",
]
