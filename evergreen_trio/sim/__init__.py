"""The model-server simulator: a vLLM-like OpenAI-compatible server with a performance model.

``SimConfig`` holds the knobs, ``Engine`` is the sans-IO model, ``run_sim`` serves it over HTTP.
"""

from evergreen_trio._extras import require_extra

require_extra("sim", __name__)

from evergreen_trio.sim.config import SimConfig
from evergreen_trio.sim.errors import SimConfigError, SimError, SimRequestError
from evergreen_trio.sim.model import Engine, SimRequest
from evergreen_trio.sim.server import SERVED_BY_HEADER, SimServer, run_sim

__all__ = [
    "SERVED_BY_HEADER",
    "Engine",
    "SimConfig",
    "SimConfigError",
    "SimError",
    "SimRequest",
    "SimRequestError",
    "SimServer",
    "run_sim",
]
