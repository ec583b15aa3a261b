"""Every protocol's limits are validated one way: a bad one is a ConfigurationError naming ``Class.field``."""

from __future__ import annotations

import pytest

from evergreen_trio import ConfigurationError, SessionLimits
from evergreen_trio._asgi import HttpServerLimits
from evergreen_trio._grpc.server_wire import WireLimits
from evergreen_trio.avp import AVPLimits
from evergreen_trio.ipc import IpcLimits
from evergreen_trio.limits import check_limits

LIMIT_CLASSES = [SessionLimits, IpcLimits, AVPLimits, WireLimits, HttpServerLimits]


@pytest.mark.parametrize("cls", LIMIT_CLASSES, ids=lambda c: c.__name__)
def test_the_defaults_are_valid(cls: type) -> None:
    cls()


@pytest.mark.parametrize("cls", LIMIT_CLASSES, ids=lambda c: c.__name__)
@pytest.mark.parametrize("bad", [-1, "10", True, None])
def test_a_bad_value_names_class_and_field(cls: type, bad: object) -> None:
    field = next(iter(cls.__dataclass_fields__))
    with pytest.raises(ConfigurationError, match=rf"^{cls.__name__}\.{field}: expected") as info:
        cls(**{field: bad})
    assert isinstance(info.value, ValueError)


@pytest.mark.parametrize(
    ("limits", "message"),
    [
        (lambda: SessionLimits(max_nodes=0), r"SessionLimits\.max_nodes: expected an int >= 1, got 0"),
        (lambda: AVPLimits(max_payload_bytes=1 << 32), r"AVPLimits\.max_payload_bytes: expected at most 4294967295"),
        (lambda: WireLimits(window_bytes=1 << 31), r"WireLimits\.window_bytes: expected at most 2147483647"),
        (lambda: IpcLimits(connect_timeout_s=-1.0), r"IpcLimits\.connect_timeout_s: expected a number > 0"),
    ],
)
def test_each_class_keeps_its_own_bounds(limits: object, message: str) -> None:
    with pytest.raises(ConfigurationError, match=message):
        limits()  # type: ignore[operator]


def test_zero_is_allowed_where_the_minimum_says_so() -> None:
    assert AVPLimits(max_extra_entries=0).max_extra_entries == 0


def test_optional_fields_may_be_none() -> None:
    from dataclasses import dataclass

    @dataclass(frozen=True)
    class Caps:
        most: int | None = None
        timeout_s: float = 1.5

        def __post_init__(self) -> None:
            check_limits(self)

    assert Caps().most is None
    with pytest.raises(ConfigurationError, match=r"Caps\.timeout_s"):
        Caps(timeout_s=0)
