"""RestartPolicy: exponential backoff from 1 s to 60 s, a restart budget per window, a reset after a healthy while
(driven by a fake clock: the times are passed in); a restart's label is its FailureReason's name."""

from __future__ import annotations

import pytest
from ringserve import _core
from ringserve.frontend.deployment import restart_label
from ringserve.frontend.restart_policy import RestartPolicy


def test_backoff_doubles_from_one_second_up_to_sixty() -> None:
    policy = RestartPolicy(max_restarts=100, window_s=10_000.0)
    now, delays = 0.0, []
    for _ in range(9):
        delay = policy.failed(now, served_s=1.0)
        assert delay is not None
        delays.append(delay)
        now += delay + 1.0
    assert delays == [1.0, 2.0, 4.0, 8.0, 16.0, 32.0, 60.0, 60.0, 60.0]


def test_serving_for_a_healthy_while_resets_the_backoff() -> None:
    policy = RestartPolicy(max_restarts=100, window_s=10_000.0)
    assert [policy.failed(t, 0.0) for t in (0.0, 10.0, 20.0)] == [1.0, 2.0, 4.0]
    assert policy.failed(30.0, served_s=59.0) == 8.0  # not long enough
    assert policy.failed(200.0, served_s=60.0) == 1.0
    assert policy.failed(210.0, served_s=5.0) == 2.0


def test_budget_is_counted_within_the_window() -> None:
    policy = RestartPolicy(max_restarts=3, window_s=100.0, healthy_reset_s=1e9)
    assert policy.failed(0.0, 0.0) == 1.0  # restart at t=1
    assert policy.failed(10.0, 0.0) == 2.0  # at t=12
    assert policy.failed(20.0, 0.0) == 4.0  # at t=24
    assert policy.restarts_in_window == 3
    assert policy.failed(30.0, 0.0) is None  # a fourth within 100 s: give up
    assert policy.failed(100.5, 0.0) is None  # the restart at t=1 is still within 100 s
    # Once the oldest restarts leave the window, the budget is back.
    delay = policy.failed(101.5, 0.0)
    assert delay == 8.0 and policy.restarts_in_window == 3


def test_zero_restarts_never_restarts() -> None:
    assert RestartPolicy(max_restarts=0, window_s=60.0).failed(0.0, 0.0) is None


@pytest.mark.parametrize(("kwargs", "flag"), [({"max_restarts": -1, "window_s": 60.0}, "--max-restarts"),
                                              ({"max_restarts": 1, "window_s": 0.0}, "--restart-window")])
def test_bad_settings_name_the_flag(kwargs: dict[str, float], flag: str) -> None:
    with pytest.raises(ValueError, match=flag):
        RestartPolicy(**kwargs)  # type: ignore[arg-type]


def test_restart_labels_are_the_failure_reasons_in_lower_case() -> None:
    labels = {restart_label(reason) for reason in _core.FailureReason.__members__.values()}
    assert labels == {"engine_failed", "worker_died", "step_timeout", "load_failed", "engine_died"}
    assert restart_label(_core.FailureReason.STEP_TIMEOUT) == "step_timeout"
