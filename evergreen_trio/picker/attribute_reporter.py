"""``request-attribute-reporter`` as llm-d-router's (``requestcontrol/requestattributereporter``),
sans-IO: a CEL expression over the response's token usage, returned to Envoy as dynamic metadata.

A plugin declares exactly one attribute: ``key.name`` (required) in ``key.namespace`` (default
``envoy.lb``), an ``expression`` (required) and an optional ``condition``, CEL over one variable,
``usage``, a ``google.protobuf.Struct``. Both are compiled and type-checked when the config loads
(with cel-expr-python, the CEL team's C++ runtime, as cel-go checks them in the reference).

``usage`` is the reference's ``Usage`` as JSON: ``prompt_tokens``, ``completion_tokens`` and
``total_tokens`` always (0 when the response reported none), ``prompt_tokens_details.cached_tokens``
when reported; Struct numbers are doubles in CEL, so ``usage.prompt_tokens + 1`` fails at run time
(no ``double + int``) where ``usage.prompt_tokens + 1.0`` or ``int(usage.prompt_tokens) + 1`` work.

When the response ends, a condition that is not ``true`` reports nothing; else the expression's
int, or its double truncated toward zero, is the attribute's number, unless it is 0 or -1 (the
reference skips both: -1 is its error value). An evaluation error, a result that is no int or
double, a double outside int64 and a count outside int64 report nothing and log a warning: the
first of each kind per plugin, the rest at debug level (the reference logs each).
"""

from __future__ import annotations

import functools
import logging
import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from evergreen_trio.picker.checks import sequence
from evergreen_trio.picker.errors import ConfigError
from evergreen_trio.picker.plugins import Category, Params, Plugin, PluginType, register
from evergreen_trio.picker.usage import Usage

log = logging.getLogger(__name__)

REQUEST_ATTRIBUTE_REPORTER = "request-attribute-reporter"
DEFAULT_NAMESPACE = "envoy.lb"
CEL_PACKAGE = "cel-expr-python"
_INT64 = 2**63


def _cel_module(where: str) -> Any:
    """cel-expr-python's ``cel`` module; ConfigError naming the package when it is not installed."""
    try:
        from cel_expr_python import cel
    except ImportError:
        raise ConfigError(where, f"the {CEL_PACKAGE} package (pip install 'evergreen-trio[picker]')",
                          f"{REQUEST_ATTRIBUTE_REPORTER} without it (missing: cel_expr_python)") from None
    return cel


@functools.cache
def _environment(cel: Any) -> Any:
    """The CEL environment: one variable, ``usage``, a google.protobuf.Struct."""
    return cel.NewEnv(variables={"usage": cel.Type("google.protobuf.Struct")})


def _compile(source: str, where: str) -> Any:
    """``source`` parsed and type-checked; ConfigError with the checker's errors on one line."""
    try:
        return _environment(_cel_module(where)).compile(source)
    except RuntimeError as exc:
        lines = [line.strip().removeprefix("INVALID_ARGUMENT: ") for line in str(exc).splitlines()]
        errors = [line.removesuffix(" [INVALID_ARGUMENT]") for line in lines if line.startswith("ERROR:")]
        detail = "; ".join(errors) or lines[0]
        detail = detail if len(detail) <= 300 else detail[:297] + "..."
        raise ConfigError(where, f"a CEL expression that compiles ({detail})", source) from None


@dataclass(frozen=True)
class ReporterParams:
    """One attribute: its metadata ``namespace`` and ``name``, the CEL ``expression`` and the
    optional ``condition`` ("" for none), with their compiled programs."""

    namespace: str
    name: str
    expression: str
    condition: str = ""
    programs: tuple[Any, Any] = field(default=(None, None), repr=False, compare=False)


def _reporter(params: Params) -> ReporterParams:
    where = params.where("attributes")
    listed = sequence(params.raw.get("attributes") or [], where)
    if len(listed) != 1:
        raise ConfigError(where, "exactly one attribute", f"{len(listed)} attributes")
    attribute = Params(listed[0], f"{where}[0]", "attributes", ("key", "expression", "condition"))
    key = attribute.section("key", ("namespace", "name"))
    name = key.text("name", "")
    if not name:
        raise ConfigError(key.where("name"), "a non-empty metadata key name", name)
    namespace = key.text("namespace", "") or DEFAULT_NAMESPACE
    expression = attribute.text("expression", "")
    if not expression:
        raise ConfigError(attribute.where("expression"), "a CEL expression", expression)
    condition = attribute.text("condition", "")
    programs = (_compile(expression, attribute.where("expression")),
                _compile(condition, attribute.where("condition")) if condition else None)
    return ReporterParams(namespace, name, expression, condition, programs)


register(REQUEST_ATTRIBUTE_REPORTER, PluginType(Category.RESPONSE_PROCESSOR, ("attributes",), _reporter))


def usage_variable(usage: Usage) -> dict[str, Any] | None:
    """``usage`` as the reference's ``Usage`` marshalled to a Struct (numbers as doubles), or None
    when a count does not fit an int64 (the reference's Go ints cannot hold it)."""
    prompt, completion, cached = usage.prompt_tokens or 0, usage.completion_tokens or 0, usage.cached_tokens
    total = usage.total
    if max(prompt, completion, total, cached or 0) >= _INT64:
        return None
    doc: dict[str, Any] = {"prompt_tokens": float(prompt), "completion_tokens": float(completion),
                           "total_tokens": float(total)}
    if cached is not None:
        doc["prompt_tokens_details"] = {"cached_tokens": float(cached)}
    return doc


class AttributeReporter:
    """One declared ``request-attribute-reporter``: evaluates its attribute, logs what it skips."""

    def __init__(self, name: str, params: ReporterParams) -> None:
        self.name = name
        self.params = params
        self._warned: set[str] = set()

    def value(self, usage: Mapping[str, Any] | None) -> float | None:
        """The number to report for the response's ``usage`` (:func:`usage_variable`), or None."""
        if usage is None:
            self._skip("count-out-of-range", "a usage count does not fit an int64")
            return None
        expression, condition = self.params.programs
        if condition is not None:
            met = self._eval(condition, usage, "condition")
            if met is None:
                return None
            if met != ("BOOL", True):
                log.debug("picker.attribute_condition_not_met plugin=%s", self.name)
                return None
        evaluated = self._eval(expression, usage, "expression")
        if evaluated is None:
            return None
        kind, result = evaluated
        if kind == "DOUBLE" and isinstance(result, float):
            if not (math.isfinite(result) and -_INT64 <= result < _INT64):
                self._skip("result-out-of-range", f"the expression gave {result}, outside int64")
                return None
            result = int(result)  # toward zero, as Go's int64(float64)
        elif kind != "INT" or not isinstance(result, int):
            self._skip("not-a-number", f"the expression gave a {kind}, not an int or double")
            return None
        return float(result) if result not in (0, -1) else None

    def _eval(self, program: Any, usage: Mapping[str, Any], what: str) -> tuple[str, object] | None:
        """(CEL type name, value) of ``program`` over ``usage``, or None after logging its error."""
        try:
            result = program.eval(data={"usage": usage})
            kind, value = result.type().name(), result.value()
        except Exception as exc:  # the C++ runtime's errors reach Python as several types
            kind, value = "ERROR", f"{type(exc).__name__}: {exc}"
        if kind == "ERROR":
            self._skip(f"{what}-error", f"{what} failed: {value}")
            return None
        return kind, value

    def _skip(self, reason: str, detail: str) -> None:
        """Log why nothing is reported: a warning the first time per reason, then at debug level."""
        level = logging.DEBUG if reason in self._warned else logging.WARNING
        self._warned.add(reason)
        log.log(level, "picker.attribute_not_reported plugin=%s reason=%s: %s", self.name, reason, detail)


def attribute_reporters(plugins: Iterable[Plugin]) -> tuple[AttributeReporter, ...]:
    """The declared ``request-attribute-reporter`` plugins, in declaration order."""
    return tuple(AttributeReporter(p.name, p.params) for p in plugins if isinstance(p.params, ReporterParams))


def report(reporters: Iterable[AttributeReporter], usage: Usage) -> dict[str, dict[str, float]]:
    """namespace -> name -> number: what the reporters return for a response's ``usage`` (a
    later plugin's key replaces an earlier one's)."""
    variable = usage_variable(usage)
    reported: dict[str, dict[str, float]] = {}
    for reporter in reporters:
        value = reporter.value(variable)
        if value is not None:
            reported.setdefault(reporter.params.namespace, {})[reporter.params.name] = value
    return reported
