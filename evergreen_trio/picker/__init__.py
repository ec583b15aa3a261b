"""The Endpoint Picker: an Envoy ext_proc server routing LLM requests by live model-server state.

Public entry points: :func:`run_picker` (the Trio runtime), :func:`gateway_config` and
:func:`write_gateway_config` (the Envoy bootstrap), :func:`run_envoy` (a real Envoy as a Trio
task), :func:`load_config` / :func:`parse_config` (YAML and Kubernetes manifests).
"""

from evergreen_trio.picker.config import PickerConfig, load_config, parse_config
from evergreen_trio.picker.envoy_config import gateway_config, write_gateway_config
from evergreen_trio.picker.envoy_process import find_envoy, run_envoy
from evergreen_trio.picker.errors import ConfigError, EnvoyError, PickerError
from evergreen_trio.picker.runtime import PickerPorts, run_picker

__all__ = [
    "ConfigError",
    "EnvoyError",
    "PickerConfig",
    "PickerError",
    "PickerPorts",
    "find_envoy",
    "gateway_config",
    "load_config",
    "parse_config",
    "run_envoy",
    "run_picker",
    "write_gateway_config",
]
