"""`evergreen-trio conformance HOST:PORT`: the protocol's rules, checked against any server offering ECHO.

Each rule is a hypothesis property played over the wire with a grpcio client; a rule that
fails is reported with its shrunk counterexample (the smallest session that still breaks it).
The specification names no status codes, so any non-OK status counts as an abort unless
``--strict-codes`` asks for ours. Server-specific limits are out of scope. From Python,
:func:`run_conformance` checks the same rules through any action with a reference function
(:class:`~evergreen_trio.testing.model.ActionUnderTest`).
"""

from __future__ import annotations

from evergreen_trio._extras import require_extra

require_extra("testing", __name__)

import argparse
import logging
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import TextIO

from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st
from hypothesis.reporting import with_reporter
from hypothesis.stateful import run_state_machine_as_test

from evergreen_trio._cli import UsageError, seconds
from evergreen_trio.client import parse_target
from evergreen_trio.testing.checks import check_valid, probe_plan
from evergreen_trio.testing.machine import machine_for, play_session
from evergreen_trio.testing.model import ECHO, ActionUnderTest, InnerSpec, Plan, Violation, depth
from evergreen_trio.testing.strategies import DEFAULT_SHAPE, Delivery, invalid_sessions, sessions
from evergreen_trio.testing.wire import SyncClient, parse_header

MAX_TIMEOUT_S = 86_400.0
"""The longest ``--timeout``: a day (a wait past ``threading.TIMEOUT_MAX``, 292 years, raises OverflowError)."""

_PLAIN = Delivery(reorder=False, split=False, duplicates=False, max_calls=1, reuse_outputs=False)


def _reuses(plan: Plan) -> bool:
    outputs = {out for call in plan.calls for out in call.outputs}
    return any(outputs.intersection(call.inputs) for call in plan.calls) or any(
        isinstance(node, InnerSpec) and outputs.intersection(node.children) for node in plan.nodes.values()
    )


def _deep(plan: Plan) -> bool:
    model = plan.model()
    return any(depth(model, inp) >= 8 for call in plan.calls for inp in call.inputs)


def _shared(plan: Plan) -> bool:
    """Several actions, or a node named as a child more than once."""
    children = [c for node in plan.nodes.values() if isinstance(node, InnerSpec) for c in node.children]
    return len(plan.calls) > 1 or len(children) > len(set(children))


@dataclass(frozen=True)
class Rule:
    """One rule of the protocol: its name, what the specification says, and the sessions that test it."""

    name: str
    text: str
    plans: st.SearchStrategy[Plan] | None
    """None: the stateful machine (every rule at once, session after session)."""


def rules_for(action: ActionUnderTest = ECHO) -> tuple[Rule, ...]:
    """Every rule, its sessions calling ``action`` and judged by its reference function."""
    name = action.name
    return (
        Rule("round-trip", f"a DAG sent in order round-trips through {name}: flattened order, mimetypes, bytes",
             sessions(delivery=_PLAIN, action=action)),
        Rule("fragment-splitting", "leaf bytes and child lists split over many seqs concatenate in seq order",
             sessions(delivery=replace(_PLAIN, split=True), action=action)),
        Rule("any-order", "fragments of one node and of different nodes may arrive in any order; "
             "a node may name children not yet received; actions may come before or after their inputs",
             sessions(delivery=replace(_PLAIN, split=True, reorder=True), action=action)),
        Rule("retries-ignored", "a repeated (id, seq) is ignored silently, never an error",
             sessions(delivery=replace(_PLAIN, split=True, reorder=True, duplicates=True,
                                       divergent_duplicates=False), action=action)),
        Rule("first-fragment-wins", "of fragments with the same (id, seq), the first received is accepted",
             sessions(delivery=replace(_PLAIN, split=True, duplicates=True, divergent_duplicates=True),
                      action=action)),
        Rule("shared-nodes", "a node may be the child of several nodes and the input of several actions; "
             "flattening repeats it wherever it appears",
             sessions(delivery=Delivery(divergent_duplicates=False, reuse_outputs=False), action=action)
             .filter(_shared)),
        Rule("output-reuse", "outputs of earlier actions are inputs later without being sent again",
             sessions(delivery=Delivery(divergent_duplicates=False), action=action).filter(_reuses)),
        Rule("deep-chains", "deep nesting (8 to 16 levels here) flattens depth-first",
             sessions(replace(DEFAULT_SHAPE, max_inner=0), replace(_PLAIN, split=True, reorder=True),
                      action=action).filter(_deep)),
        *(
            Rule(f"abort-{violation.label.replace(' ', '-')}", f"a session with a {violation.label} is aborted, "
                 "and the server serves the next session", invalid_sessions([violation], action=action))
            for violation in (
                Violation.CYCLE,
                Violation.SEQ_PAST_FINAL,
                Violation.CHANGED_METADATA,
                Violation.LEAF_AND_INNER,
                Violation.REUSED_OUTPUT_ID,
            )
        ),
        Rule("stateful", "all of the above, session after session on one connection, with replays of "
             "earlier sessions (ids belong to their session)", None),
    )


RULES: tuple[Rule, ...] = rules_for(ECHO)
"""The rules for ECHO, as ``evergreen-trio conformance`` checks them."""


@dataclass(frozen=True)
class RuleResult:
    """One rule's verdict: whether it holds, else the shrunk counterexample and what went wrong."""

    rule: Rule
    holds: bool
    counterexample: str = ""
    error: str = ""


def check_rule(
    client: SyncClient,
    rule: Rule,
    *,
    examples: int,
    strict_codes: bool = False,
    derandomize: bool = False,
    action: ActionUnderTest = ECHO,
) -> RuleResult:
    """Run one rule's property; on failure keep hypothesis's shrunk counterexample."""
    config = settings(
        max_examples=examples,
        deadline=None,
        database=None,
        derandomize=derandomize,
        suppress_health_check=list(HealthCheck),
        phases=[Phase.generate, Phase.shrink],
        report_multiple_bugs=False,
        print_blob=False,
    )
    failures: list[tuple[str, str]] = []
    reported: list[str] = []

    machine = machine_for(client, strict_codes=strict_codes, failures=failures, action=action)
    test: Callable[[], None]
    if rule.plans is None:

        def test() -> None:
            run_state_machine_as_test(machine, settings=settings(config, stateful_step_count=10))
    else:
        def play(plan: Plan) -> None:
            play_session(client, plan, strict_codes=strict_codes, failures=failures)

        test = config(given(rule.plans)(play))
    try:
        with with_reporter(lambda value: reported.append(str(value))):
            test()
    except Exception as error:
        steps = "\n".join(line for line in reported if line.strip())
        if failures:
            plan, message = failures[-1]
            return RuleResult(rule, False, f"{steps}\n{plan}" if rule.plans is None else plan, message)
        return RuleResult(rule, False, steps, f"{type(error).__name__}: {error}")
    return RuleResult(rule, True)


def run_conformance(
    target: str,
    *,
    examples: int = 50,
    strict_codes: bool = False,
    timeout: float = 10.0,
    derandomize: bool = False,
    only: Sequence[str] = (),
    out: TextIO | None = None,
    action: ActionUnderTest = ECHO,
    tls_ca: bytes | None = None,
    headers: Sequence[tuple[str, str]] = (),
) -> list[RuleResult]:
    """Check every rule (or those named in ``only``) against ``target`` through ``action``; print
    a report to ``out`` (stdout). ``tls_ca`` (PEM) connects with TLS; ``headers`` go with every
    session (a bearer token, say). Raises :class:`~evergreen_trio.testing.wire.UnreachableError`
    when nothing answers at ``target``."""
    out = out or sys.stdout
    rules = [r for r in rules_for(action) if not only or r.name in only]
    mode = "strict status codes" if strict_codes else "any non-OK status is an abort"
    print(f"Evergreen conformance of {target} ({action.name}): {examples} examples per rule, {mode}", file=out)
    results: list[RuleResult] = []
    with SyncClient(target, timeout=timeout, tls_ca=tls_ca, headers=headers) as client:
        client.wait_ready()
        probe = probe_plan(action)
        try:
            check_valid(probe, client.run(probe.messages()))
        except AssertionError as error:
            print(f"  the server does not serve a one-leaf {action.name} session: {error}", file=out)
            return [RuleResult(r, False, "", f"the server does not serve {action.name}") for r in rules]
        for rule in rules:
            result = check_rule(client, rule, examples=examples, strict_codes=strict_codes, derandomize=derandomize,
                                action=action)
            results.append(result)
            print(f"  {'PASS' if result.holds else 'FAIL'}  {rule.name:<28} {rule.text}", file=out, flush=True)
            if not result.holds:
                print(f"        why: {result.error}", file=out)
                print("        shrunk counterexample:", file=out)
                for line in result.counterexample.splitlines():
                    print(f"          {line}", file=out)
    failed = sum(not r.holds for r in results)
    print(f"{len(results)} rules: {len(results) - failed} hold, {failed} fail", file=out)
    return results


def register(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    parser = subparsers.add_parser(
        "conformance", help="check the Evergreen protocol's rules against a server offering ECHO"
    )
    parser.add_argument("target", metavar="HOST:PORT")
    parser.add_argument("--examples", type=int, default=50, help="sessions per rule (default 50)")
    parser.add_argument(
        "--strict-codes", action="store_true",
        help="require our status codes (INVALID_ARGUMENT for violations) instead of any non-OK status",
    )
    parser.add_argument("--timeout", type=seconds, default=10.0,
                        help=f"seconds one session may take, at most {MAX_TIMEOUT_S:g} (default 10)")
    parser.add_argument("--derandomize", action="store_true", help="the same sessions on every run")
    parser.add_argument("--rule", action="append", default=[], choices=[r.name for r in RULES],
                        help="check only this rule (repeatable)")
    parser.add_argument("--tls-ca", metavar="FILE", help="connect with TLS, trusting the CA certificates in FILE (PEM)")
    parser.add_argument("--header", action="append", default=[], metavar="'NAME: VALUE'", type=parse_header,
                        help="send this header with every session, e.g. 'authorization: Bearer T' (repeatable)")
    parser.set_defaults(run=_run)


def _run(args: argparse.Namespace) -> int:
    if args.examples < 1:
        raise UsageError(f"argument --examples: expected at least 1, got {args.examples}")
    if args.log_level != "DEBUG":  # grpcio logs a reply it cannot parse with a traceback; the report says it
        logging.getLogger("grpc._common").setLevel(logging.CRITICAL)
    if not 0 < args.timeout <= MAX_TIMEOUT_S:
        raise UsageError(f"argument --timeout: expected more than 0 and at most {MAX_TIMEOUT_S:g} s, "
                         f"got {args.timeout:g}")
    parse_target(args.target)  # no port (or a bad one) is a ConfigurationError: one line, exit 2
    tls_ca = None
    if args.tls_ca is not None:
        try:
            with open(args.tls_ca, "rb") as file:
                tls_ca = file.read()
        except OSError as error:
            raise UsageError(f"--tls-ca {args.tls_ca}: {error.strerror or error}") from None
    results = run_conformance(
        args.target, examples=args.examples, strict_codes=args.strict_codes, timeout=args.timeout,
        derandomize=args.derandomize, only=args.rule, tls_ca=tls_ca, headers=args.header,
    )
    return 0 if results and all(r.holds for r in results) else 1


__all__ = [
    "RULES",
    "Rule",
    "RuleResult",
    "check_rule",
    "rules_for",
    "run_conformance",
]
