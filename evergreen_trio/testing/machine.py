"""A hypothesis state machine that plays a client against any Evergreen server offering ECHO
(or any action, given as an :class:`~evergreen_trio.testing.model.ActionUnderTest`).

Each step is one session: a valid one (every DAG round-trips through the action exactly, however it
is split, reordered, retried and interleaved), a replay of an earlier valid one in a new
session (ids belong to a session; nothing crosses sessions), or an invalid one (it must abort,
and the next session must be served). ``machine_for`` binds it to a server and returns a
``RuleBasedStateMachine`` subclass for ``run_state_machine_as_test`` or a ``TestCase``.
"""

from __future__ import annotations

from collections.abc import Callable

from hypothesis.stateful import Bundle, RuleBasedStateMachine, rule

from evergreen_trio.dag.limits import SessionLimits
from evergreen_trio.testing.checks import check_abort, check_still_serving, check_valid
from evergreen_trio.testing.model import ECHO, ActionUnderTest, Plan, Violation
from evergreen_trio.testing.strategies import (
    DEFAULT_DELIVERY,
    DEFAULT_SHAPE,
    SPEC_VIOLATIONS,
    DagShape,
    Delivery,
    invalid_sessions,
    sessions,
)
from evergreen_trio.testing.wire import SyncClient


def play_session(
    client: SyncClient,
    plan: Plan,
    *,
    strict_codes: bool = False,
    full_metadata: bool = False,
    failures: list[tuple[str, str]] | None = None,
    after_session: Callable[[], None] | None = None,
) -> None:
    """Play one session and check it: a valid plan round-trips, an invalid one aborts and the
    next session is served. A failure is appended to ``failures`` before it is raised."""
    try:
        outcome = client.run(plan.messages())
        if plan.violation is None:
            check_valid(plan, outcome, full_metadata=full_metadata)
        else:
            check_abort(plan, outcome, strict_codes=strict_codes)
            check_still_serving(client, plan.action)
        if after_session is not None:
            after_session()
    except AssertionError as error:
        if failures is not None:
            failures.append((repr(plan), str(error)))
        raise


def machine_for(
    client: SyncClient,
    *,
    limits: SessionLimits | None = None,
    strict_codes: bool = False,
    full_metadata: bool = False,
    shape: DagShape = DEFAULT_SHAPE,
    delivery: Delivery = DEFAULT_DELIVERY,
    after_session: Callable[[], None] | None = None,
    failures: list[tuple[str, str]] | None = None,
    action: ActionUnderTest = ECHO,
) -> type[RuleBasedStateMachine]:
    """A state machine class playing sessions of ``action`` calls (ECHO unless given) through ``client``.

    With the server's ``limits``, over-limit sessions join the invalid ones (they must end
    RESOURCE_EXHAUSTED under ``strict_codes``). ``after_session`` runs after every session,
    for checks that need the server's insides (open sessions back to zero, say). Each failing
    session is appended to ``failures`` as (the plan, what went wrong), the last one shrunk.
    """
    violations = (*SPEC_VIOLATIONS, Violation.OVER_LIMIT) if limits is not None else SPEC_VIOLATIONS

    def play(plan: Plan) -> None:
        play_session(
            client, plan, strict_codes=strict_codes, full_metadata=full_metadata, failures=failures,
            after_session=after_session,
        )

    class SessionMachine(RuleBasedStateMachine):
        played = Bundle("played")

        @rule(target=played, plan=sessions(shape, delivery, action))
        def valid_session(self, plan: Plan) -> Plan:
            play(plan)
            return plan

        @rule(plan=played)
        def replay_in_new_session(self, plan: Plan) -> None:
            play(plan)

        @rule(plan=invalid_sessions(violations, limits=limits, shape=shape, delivery=delivery, action=action))
        def invalid_session(self, plan: Plan) -> None:
            play(plan)

    return SessionMachine


__all__ = [
    "machine_for",
    "play_session",
]
