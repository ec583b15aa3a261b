"""header-profile-handler (llm-d-router's scheduling/profilehandler/headerprofile)."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st
from test_session_affinity import HEAD, _exchange, _picker

from evergreen_trio.picker.config import parse_config
from evergreen_trio.picker.errors import ConfigError, RequestError
from evergreen_trio.picker.headerprofile import HeaderProfileHandler

PROFILES = ("encode", "prefill", "decode")
HANDLER = HeaderProfileHandler()


@pytest.mark.parametrize(("headers", "profiles", "chosen"), [
    ({"epp-profile": "encode"}, PROFILES, "encode"),
    ({}, PROFILES, "decode"),
    ({"epp-profile": "  encode  "}, PROFILES, "encode"),
    ({"epp-profile": "   "}, PROFILES, "decode"),
    ({}, ("decode",), "decode"),
    ({"epp-profile": "nope"}, ("decode",), "decode"),
    ({"epp-profile": "prefill"}, ("only",), "only"),
])
def test_the_reference_cases(headers: dict[str, str], profiles: tuple[str, ...], chosen: str) -> None:
    assert HANDLER.choose(headers, profiles) == chosen


@pytest.mark.parametrize(("handler", "headers"), [
    (HANDLER, {"epp-profile": "unknown"}),
    (HANDLER, {"epp-profile": "Encode"}),  # matched verbatim
    (HeaderProfileHandler(default_profile="prefill"), {}),  # a default no profile has
])
def test_a_name_without_a_profile_runs_none(handler: HeaderProfileHandler, headers: dict[str, str]) -> None:
    with pytest.raises(RequestError) as caught:
        handler.choose(headers, ("encode", "decode"))
    assert caught.value.status == 429


@given(st.dictionaries(st.sampled_from(["epp-profile", "x"]), st.text(" abdecop")),
       st.lists(st.sampled_from(["a", "decode", "encode", " encode"]), min_size=1, unique=True))
def test_the_choice_is_a_profile_or_a_refusal(headers: dict[str, str], profiles: list[str]) -> None:
    try:
        chosen = HANDLER.choose(headers, profiles)
    except RequestError:
        assert len(profiles) > 1
    else:
        assert chosen in profiles


@pytest.mark.parametrize(("parameters", "handler"), [
    ("", HeaderProfileHandler("epp-profile", "decode")),
    ("{headerName: x-profile}", HeaderProfileHandler("x-profile", "decode")),
    ("{headerName: '  X-Custom-Profile  '}", HeaderProfileHandler("x-custom-profile", "decode")),
    ("{headerName: '   '}", HeaderProfileHandler("epp-profile", "decode")),
    ("{defaultProfile: prefill}", HeaderProfileHandler("epp-profile", "prefill")),
    ("{defaultProfile: '   '}", HeaderProfileHandler("epp-profile", "decode")),
    ("{defaultProfile: ' Prefill '}", HeaderProfileHandler("epp-profile", "Prefill")),
])
def test_parameters_from_a_config(parameters: str, handler: HeaderProfileHandler) -> None:
    suffix = f", parameters: {parameters}" if parameters else ""
    text = HEAD + f"""plugins:
- {{type: header-profile-handler{suffix}}}
- {{type: queue-scorer}}
schedulingProfiles:
- {{name: a, plugins: [{{pluginRef: queue-scorer}}]}}
- {{name: b, plugins: [{{pluginRef: queue-scorer}}]}}
"""
    assert parse_config(text, cluster_pool="p").scheduler.handler == handler


@pytest.mark.parametrize(("parameters", "field"), [
    ("{headerName: [x]}", "headerName"), ("{defaultProfile: 5}", "defaultProfile"), ("{header: x}", "header")])
def test_bad_parameters_name_the_field(parameters: str, field: str) -> None:
    text = HEAD + f"plugins:\n- {{type: header-profile-handler, parameters: {parameters}}}\n"
    with pytest.raises(ConfigError) as caught:
        parse_config(text, cluster_pool="p")
    assert caught.value.field == f"EndpointPickerConfig.plugins[0].parameters.{field}", caught.value


PLUGINS = """plugins:
- {type: header-profile-handler, parameters: {headerName: X-Stage}}
- {type: queue-scorer}
- {type: kv-cache-utilization-scorer}
- {type: header-based-testing-filter, name: only}
schedulingProfiles:
- {name: decode, plugins: [{pluginRef: queue-scorer}]}
- {name: pinned, plugins: [{pluginRef: only}, {pluginRef: queue-scorer}]}
"""


def test_the_header_chooses_the_profile_through_the_stream() -> None:
    picker = _picker(PLUGINS)
    assert _exchange(picker, [])[0] == "10.0.0.1:8000"  # decode: the shortest queue
    assert _exchange(picker, [("x-stage", "pinned"), ("test-epp-endpoint-selection", "10.0.0.3")])[0] == \
        "10.0.0.3:8000"
    assert not picker.config.scheduler.uses_prefix  # no P/D: prompts are not hashed for it


def test_a_profile_nobody_configured_is_refused_through_the_stream() -> None:
    picker = _picker(PLUGINS)
    with pytest.raises(RequestError) as caught:
        picker.route("/v1/completions", {"x-stage": "prefill"}, b'{"model": "m", "prompt": "hi"}', None)
    assert caught.value.status == 429
