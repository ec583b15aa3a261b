"""Sphinx configuration: the guides in docs/*.md (MyST) and the API reference from docstrings (autodoc).

Build with ``make docs`` (warnings are errors); the site lands in build/docs/html.
"""

from __future__ import annotations

import sys
from importlib.metadata import version as _version
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # document this checkout even where it is not installed

project = "evergreen-trio"
release = _version("evergreen-trio")
extensions = ["sphinx.ext.autodoc", "myst_parser"]
source_suffix = {".md": "markdown", ".rst": "restructuredtext"}
myst_heading_anchors = 4  # the guides link to each other's sections (file.md#slug)
autodoc_member_order = "bysource"
autodoc_typehints = "description"
autodoc_default_options = {"members": True, "show-inheritance": True}
html_theme = "alabaster"
html_title = f"evergreen-trio {release}"

# A reference that resolves nowhere fails the build (with -W), so a renamed or undocumented name of
# ours is caught. What cannot resolve offline is listed here, narrowly.
nitpicky = True
nitpick_ignore_regex = [
    # The standard library: the build is offline, so there is no intersphinx inventory to link into.
    (r"py:.*", r"(collections\.abc|typing|enum|ssl|pathlib|os|subprocess|random|socket|signal|logging"
               r"|argparse|asyncio|json|io|types|concurrent\.futures|multiprocessing|ipaddress|dataclasses"
               r"|contextlib|datetime|re|weakref|selectors)\.\w+(\.\w+)?"),
    # Third-party packages, offline for the same reason.
    (r"py:.*", r"(trio|trio_asyncio|pyarrow|numpy|hypothesis|google\.protobuf|lightkube|httpx|h11|h2"
               r"|prometheus_client|grpclib|grpc|cryptography|cupy|ucxx|envoy|xds|udpa|validate|opentelemetry)(\.\w+)+"),
    # The generated evergreen.v2 protobuf messages (evergreen_trio/_proto, built by protoc, no docstrings):
    # their fields are the wire format, documented in proto/evergreen/v2/*.proto and the spec.
    (r"py:class", r"evergreen\.v2\.evergreen_pb2\.\w+"),
]
nitpick_ignore = [
    # Constructor arguments of classes the library builds and users never construct (ClientSession,
    # from connect(); ChunkReader, from reading a node): Sphinx records a class's constructor hints as
    # unevaluated strings, so they cannot be resolved, and they are internal plumbing.
    ("py:class", "MessageStream"),
    ("py:class", "Outbound"),
    ("py:class", "SessionOptions"),
    ("py:class", "_Walk"),
    ("py:class", "ChunkMetadata"),  # the generated evergreen.v2 message, as above
    ("py:class", "CollectorRegistry"),  # prometheus_client's, in SessionMetrics's constructor
    ("py:class", "SpanExporter"),  # OpenTelemetry's, in Tracing's constructor
    ("py:class", "Resource"),
    # The picker's per-endpoint counter cell behind a Ticket (built by InflightLoad, never by users).
    ("py:class", "_Counter"),
    ("py:class", "_EndpointCounter"),
    # How an IpcClient opens its connection (connect() and connect_device() build it, never users).
    ("py:class", "OpenConnection"),
    # The candidate type RolloutScreener.screen is generic over (the scheduler's EndpointState).
    ("py:class", "evergreen_trio.picker.rollout.T"),
]

# The picker's runtime names the `tracing` extra's Tracing only under TYPE_CHECKING (it must not import
# OpenTelemetry without --tracing): bound here, so autodoc resolves run_picker's hints.
import evergreen_trio.picker.runtime as _runtime  # noqa: E402
from evergreen_trio.picker.tracing import Tracing as _Tracing  # noqa: E402

_runtime.Tracing = _Tracing  # type: ignore[attr-defined]
