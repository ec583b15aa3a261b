"""RefusalEpisodes: one warning and one info line per episode of refusals at a connection cap."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from evergreen_trio._refusals import QUIET_S, RefusalEpisodes


def test_an_admission_between_refusals_does_not_end_the_episode() -> None:
    episodes = RefusalEpisodes()
    assert episodes.refuse(0.0)
    assert episodes.admit(0.1) == 0  # a slot freed mid-flood
    assert not episodes.refuse(0.2)
    assert episodes.admit(0.2 + QUIET_S) == 2
    assert episodes.refuse(10 * QUIET_S)  # a new episode


def test_admissions_without_refusals_log_nothing() -> None:
    episodes = RefusalEpisodes()
    assert [episodes.admit(t) for t in (0.0, QUIET_S, 100.0)] == [0, 0, 0]


@given(st.lists(st.tuples(st.booleans(), st.floats(0.0, 2 * QUIET_S)), max_size=200))
def test_warnings_are_bounded_by_quiet_periods_and_every_refusal_is_reported_once(
        events: list[tuple[bool, float]]) -> None:
    episodes, now, warnings, ended, reported, refusals = RefusalEpisodes(), 0.0, 0, 0, 0, 0
    for refused, step in events:
        now += step
        if refused:
            refusals += 1
            warnings += episodes.refuse(now)
        elif count := episodes.admit(now):
            ended += 1
            reported += count
    assert warnings <= 1 + now / QUIET_S + 1e-9  # however the cap flickers
    assert ended == warnings - (episodes.refused > 0)  # each warning has its info line once the episode ends
    assert reported + episodes.refused == refusals
