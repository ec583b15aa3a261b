"""The picker's request guards (sans-IO): JSON cost before parsing, rewrite targets, metric labels."""

from __future__ import annotations

import json
from unittest import mock

import pytest
from hypothesis import given
from hypothesis import strategies as st

from evergreen_trio.picker import guards
from evergreen_trio.picker.config import Endpoint, ModelConfig, PickerConfig, PoolConfig, TargetModel
from evergreen_trio.picker.errors import RequestError
from evergreen_trio.picker.guards import (
    MAX_MODEL_LABEL_CHARS,
    OTHER_MODEL,
    ModelLabels,
    check_json_cost,
    rewrite_allowed,
    utf8,
)


def outside_strings(text: str, chars: str) -> int:
    """How many of ``chars`` are outside strings, by a plain tokenizer."""
    count, i = 0, 0
    while i < len(text):
        char = text[i]
        if char == '"':
            i += 1
            while text[i] != '"':
                i += 2 if text[i] == "\\" else 1
        elif char in chars:
            count += 1
        i += 1
    return count


json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.text(alphabet=st.sampled_from('ab,[{"\\\n')),
    lambda inner: st.lists(inner, max_size=5) | st.dictionaries(st.text(alphabet="k,\"\\"), inner, max_size=5),
    max_leaves=30,
)


@given(json_values, st.integers(min_value=0, max_value=20), st.integers(min_value=0, max_value=10), st.booleans())
def test_the_cost_check_counts_outside_strings_exactly(doc: object, items: int, containers: int,
                                                       many_quotes: bool) -> None:
    body = json.dumps(doc).encode()
    text = body.decode()
    # The path for bodies with many strings (counting everywhere first) is taken at any count here.
    with mock.patch.object(guards, "_FEW_QUOTES", -1 if many_quotes else guards._FEW_QUOTES):
        if outside_strings(text, ",:[{") <= items and outside_strings(text, "[{") <= containers:
            check_json_cost(body, items, containers)
        else:
            with pytest.raises(RequestError) as info:
                check_json_cost(body, items, containers)
            assert info.value.status == 413


def test_a_long_prompt_full_of_commas_passes() -> None:
    check_json_cost(json.dumps({"model": "m", "prompt": "a, [b], {c}: " * 100_000}).encode(), 1000, 10)


def test_many_strings_are_refused_without_splitting() -> None:
    with pytest.raises(RequestError, match="more than 10 JSON items"):
        check_json_cost(json.dumps(["x"] * 50).encode(), 10, 10)


def config(*models: ModelConfig) -> PickerConfig:
    return PickerConfig(PoolConfig("pool", (Endpoint("127.0.0.1", 8000),)), models=models)


def test_rewrites_are_allowed_only_to_the_model_or_its_targets() -> None:
    model = ModelConfig("sim-model", target_models=(TargetModel("sim-lora", 1),))
    listed = config(model, ModelConfig("internal-only-adapter"))
    assert rewrite_allowed(listed, model, "sim-model")
    assert rewrite_allowed(listed, model, "sim-lora")
    assert not rewrite_allowed(listed, model, "internal-only-adapter")
    assert not rewrite_allowed(listed, None, "sim-model")
    assert rewrite_allowed(config(), None, "anything")  # no list: every name is accepted anyway


def test_a_lone_surrogate_is_a_400() -> None:
    with pytest.raises(RequestError, match="lone surrogate at character 2") as info:
        utf8("ab\ud800", "prompt")
    assert info.value.status == 400
    assert utf8("a\U0001f600", "prompt") == "a\U0001f600".encode()


def test_labels_fold_unlisted_names_when_models_are_configured() -> None:
    labels = ModelLabels.for_config(config(ModelConfig("m", target_models=(TargetModel("t", 1),))))
    assert [labels.name(n) for n in ("m", "t", "x")] == ["m", "t", OTHER_MODEL]


def test_labels_admit_a_bounded_number_of_names_then_fold() -> None:
    labels = ModelLabels(unlisted=2, pairs=3)
    assert [labels.name(n) for n in ("a", "b", "c", "a")] == ["a", "b", OTHER_MODEL, "a"]
    assert labels.name("x" * (MAX_MODEL_LABEL_CHARS + 1)) == OTHER_MODEL
    assert labels.pair("a", "b") == ("a", "b")
    assert labels.pair("b", "a") == ("b", "a")
    assert labels.pair("c", "c") == (OTHER_MODEL, OTHER_MODEL)  # the third pair
    assert labels.pair("a", "a") == (OTHER_MODEL, OTHER_MODEL)  # past the pair cap
    assert labels.pair("a", "b") == ("a", "b")  # a pair keeps its series


def test_unprintable_or_unencodable_names_are_never_labels() -> None:
    labels = ModelLabels()
    assert labels.name("a\nb") == OTHER_MODEL
    assert labels.name("a\ud800") == OTHER_MODEL
