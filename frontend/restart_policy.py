"""When a dead engine replica is started again: exponential backoff, a budget of restarts per window, a reset after
a healthy while. Pure bookkeeping over times the caller passes in (a monotonic clock in seconds), so tests drive it
with a fake clock."""

from __future__ import annotations

import collections
from dataclasses import dataclass, field

DEFAULT_MAX_RESTARTS = 5  # --max-restarts
DEFAULT_RESTART_WINDOW_S = 600.0  # --restart-window
INITIAL_BACKOFF_S = 1.0
MAX_BACKOFF_S = 60.0
HEALTHY_RESET_S = 60.0  # a replica that served this long is healthy again: its next restart waits the initial delay


@dataclass
class RestartPolicy:
    """One replica's restart budget: at most `max_restarts` restarts within any `window_s` seconds.

    `failed(now, served_s)` is called each time the replica dies or fails to start again; it returns the seconds to
    wait before the next start, or None when the budget is spent (the model is then FAILED). The delay starts at
    `initial_backoff_s` and doubles up to `max_backoff_s`; it is back at the initial value once the replica has
    served `healthy_reset_s` seconds without dying.
    """

    max_restarts: int
    window_s: float
    initial_backoff_s: float = INITIAL_BACKOFF_S
    max_backoff_s: float = MAX_BACKOFF_S
    healthy_reset_s: float = HEALTHY_RESET_S
    _restarts: collections.deque[float] = field(default_factory=collections.deque, repr=False)
    _next_backoff_s: float = field(default=0.0, repr=False)

    def __post_init__(self) -> None:
        if self.max_restarts < 0:
            raise ValueError(f"--max-restarts must be >= 0 (got {self.max_restarts})")
        if not self.window_s > 0:
            raise ValueError(f"--restart-window must be > 0 seconds (got {self.window_s})")
        if not 0 < self.initial_backoff_s <= self.max_backoff_s:
            raise ValueError("the initial restart backoff must be > 0 and at most the largest one")
        self._next_backoff_s = self.initial_backoff_s

    @property
    def restarts_in_window(self) -> int:
        return len(self._restarts)

    def failed(self, now: float, served_s: float) -> float | None:
        """The replica died at `now` after serving `served_s` seconds (0 when it never became ready): the delay
        before starting it again, or None when `max_restarts` restarts already happened within the window."""
        while self._restarts and self._restarts[0] <= now - self.window_s:
            self._restarts.popleft()
        if served_s >= self.healthy_reset_s:
            self._next_backoff_s = self.initial_backoff_s
        if len(self._restarts) >= self.max_restarts:
            return None
        delay = self._next_backoff_s
        self._next_backoff_s = min(self._next_backoff_s * 2, self.max_backoff_s)
        self._restarts.append(now + delay)  # the restart happens when the delay is over
        return delay
