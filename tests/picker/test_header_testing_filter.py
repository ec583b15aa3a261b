"""header-based-testing-filter (llm-d-router's scheduling/test/filter/request_header_based_filter.go)."""

from __future__ import annotations

import json

import pytest
from hypothesis import given
from hypothesis import strategies as st
from test_processor import request_body, request_headers
from test_session_affinity import HEAD, _exchange, _picker

from evergreen_trio.picker.config import parse_config
from evergreen_trio.picker.errors import ConfigError
from evergreen_trio.picker.plugins import PLUGIN_TYPES, Category
from evergreen_trio.picker.testing_filter import select, split_host_port

# The reference's cases: (header, endpoints as (ip, port)) -> the endpoints kept, in order.
CASES = [
    (None, [("10.0.0.1", "3000")], []),
    ("10.0.0.99", [("10.0.0.1", "3000")], []),
    ("10.0.0.1", [("10.0.0.1", "3002")], [0]),
    ("10.0.0.1:3002", [("10.0.0.1", "3000"), ("10.0.0.1", "3002"), ("10.0.0.2", "3002")], [1]),
    ("10.0.0.1:9999", [("10.0.0.1", "3002")], []),
    ("10.0.0.3:3004, 10.0.0.2, 10.0.0.3", [("10.0.0.1", "3000"), ("10.0.0.2", "3002"), ("10.0.0.3", "3004")], [2, 1]),
    ("[fd00::1]:3002", [("fd00::1", "3002"), ("fd00::2", "3002")], [0]),
    ("fd00::2", [("fd00::1", "3002"), ("fd00::2", "3004")], [1]),
    # and edges of the same code
    ("  ", [("10.0.0.1", "3000")], []),
    (" , 10.0.0.1 ,", [("10.0.0.1", "3000")], [0]),
    ("10.0.0.1", [("10.0.0.1", "3000"), ("10.0.0.1", "3002")], [1]),  # a bare IP: that host's last endpoint
    ("10.0.0.1:3000, 10.0.0.1:3002", [("10.0.0.1", "3000"), ("10.0.0.1", "3002")], [0]),  # one per host
    ("[fd00::1]", [("fd00::1", "3002")], [0]),
    ("10.0.0.1:", [("10.0.0.1", "3002")], [0]),  # an empty port selects by IP
]


@pytest.mark.parametrize(("header", "endpoints", "kept"), CASES)
def test_the_reference_cases(header: str | None, endpoints: list[tuple[str, str]], kept: list[int]) -> None:
    assert select(header or "", endpoints) == kept


@pytest.mark.parametrize(("item", "split"), [
    ("1.2.3.4:80", ("1.2.3.4", "80")), ("1.2.3.4", None), ("[::1]:80", ("::1", "80")), ("::1", None),
    ("[::1]", None), ("[::1]x:80", None), ("[::1]::80", None), ("a:b:c", None), ("a]:80", None),
    ("[a[b]:80", None), ("host:", ("host", "")), (":80", ("", "80")),
])
def test_split_host_port_as_go(item: str, split: tuple[str, str] | None) -> None:
    assert split_host_port(item) == split


HOSTS = st.sampled_from(["10.0.0.1", "10.0.0.2", "fd00::1"])
PORTS = st.sampled_from(["3000", "3002"])


@given(st.lists(st.tuples(HOSTS, PORTS), unique=True, max_size=6),
       st.lists(st.one_of(HOSTS, st.tuples(HOSTS, PORTS).map(lambda hp: f"[{hp[0]}]:{hp[1]}")), max_size=6))
def test_kept_endpoints_are_distinct_hosts_the_header_names(endpoints: list[tuple[str, str]], items: list[str]) -> None:
    kept = select(",".join(items), endpoints)
    hosts = [endpoints[i][0] for i in kept]
    assert len(set(hosts)) == len(hosts)
    assert all(any(h in item for item in items) for h in hosts)


def test_the_type_is_a_filter_without_parameters() -> None:
    assert PLUGIN_TYPES["header-based-testing-filter"].category is Category.FILTER
    with pytest.raises(ConfigError) as caught:
        parse_config(HEAD + "plugins:\n- {type: header-based-testing-filter, parameters: {x: 1}}\n", cluster_pool="p")
    assert caught.value.field == "EndpointPickerConfig.plugins[0].parameters.x"


PLUGINS = """plugins:
- {type: queue-scorer}
- {type: header-based-testing-filter, name: pick-by-header}
schedulingProfiles:
- {name: default, plugins: [{pluginRef: pick-by-header}, {pluginRef: queue-scorer}]}
"""


def test_the_header_chooses_the_candidates_through_the_stream() -> None:
    picker = _picker(PLUGINS)
    assert _exchange(picker, [("test-epp-endpoint-selection", "10.0.0.3")])[0] == "10.0.0.3:8000"
    # Of those named, the scorer still prefers the shorter queue (10.0.0.2's 4 against 10.0.0.3's 8).
    assert _exchange(picker, [("test-epp-endpoint-selection", "10.0.0.3:8000, 10.0.0.2")])[0] == "10.0.0.2:8000"


def test_no_header_keeps_none_and_the_request_is_refused() -> None:
    stream = _picker(PLUGINS).new_stream()
    stream.on_message(request_headers())
    (reply,) = stream.on_message(request_body(json.dumps({"model": "m", "prompt": "hi"}).encode()))
    assert reply.immediate_response.status.code == 429
