"""Retry math: when a deferred recipient is tried again, and when it expires.

SUMMARY
    RetryPolicy.from_config(cfg.queue); policy.next_attempt_at(...);
    policy.is_expired(...).  Pure: the caller passes ``now``.

STRATEGIES
    Schedule (Mailismus, the default).  ``retry_delays`` "30m | 2h | 4h":
    after the first failure wait 30 minutes, after the second 2 hours, then
    4 hours; the last value repeats until the message expires.

    Exponential backoff (Postfix).  After the first failure wait
    ``minimal_backoff``; after each later one wait as long as the message is
    old, so that the time between attempts doubles, clamped to
    [minimal_backoff, maximal_backoff].

    Granularity (Mailismus).  The next attempt time is rounded *up* to a
    multiple of ``retry_granularity`` on the epoch grid, so that deferred
    entries cluster on few distinct times (for the filesystem flavour: few
    ``deferred/<time>/`` directories).  The granularity never exceeds half
    the first delay; config.py reduces it silently, and so does this module
    for a policy built by hand, so that rounding can at most add half a
    delay.

    Expiry.  An entry older than ``retry_maxtime`` (``retry_maxtime_reports``
    for NDRs) when it fails again, or when the periodic sweep finds it
    deferred, bounces.  A retry that would fall beyond the deadline is still
    made at the deadline rather than skipped, so every message gets a last
    attempt at its expiry time.

SEE ALSO
    seeds/000 (Mailismus 4.3.1-4.3.2), seeds/003 (Postfix exponential backoff)
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Protocol

__all__ = ["RetryPolicy"]


class _QueueSettings(Protocol):
    @property
    def retry_delays(self) -> tuple[float, ...]: ...
    @property
    def retry_granularity(self) -> float: ...
    @property
    def retry_maxtime(self) -> float: ...
    @property
    def retry_maxtime_reports(self) -> float: ...
    @property
    def retry_mode(self) -> str: ...
    @property
    def minimal_backoff(self) -> float: ...
    @property
    def maximal_backoff(self) -> float: ...


@dataclass(frozen=True, slots=True)
class RetryPolicy:
    """When to try a deferred recipient again, and when to give it up.

    ``mode`` is "schedule" (``delays_s``) or "exponential" (between
    ``minimal_backoff_s`` and ``maximal_backoff_s``); the module header
    describes both, the granularity and the expiry.
    """
    delays_s: tuple[float, ...] = (1800.0, 7200.0, 14400.0)
    granularity_s: float = 900.0
    maxtime_s: float = 72 * 3600.0
    maxtime_reports_s: float = 24 * 3600.0
    mode: str = "schedule"
    minimal_backoff_s: float = 300.0
    maximal_backoff_s: float = 4000.0

    def __post_init__(self) -> None:
        if not self.delays_s or any(d <= 0 for d in self.delays_s):
            raise ValueError("retry delays must be a non-empty list of positive durations")
        if self.mode not in ("schedule", "exponential"):
            raise ValueError(f"unknown retry mode {self.mode!r}")
        if self.granularity_s < 0:
            raise ValueError("granularity must not be negative")
        if self.minimal_backoff_s <= 0 or self.maximal_backoff_s < self.minimal_backoff_s:
            raise ValueError("need 0 < minimal_backoff <= maximal_backoff")
        first = self.delays_s[0] if self.mode == "schedule" else self.minimal_backoff_s
        if self.granularity_s > first / 2:
            object.__setattr__(self, "granularity_s", first / 2)

    @classmethod
    def from_config(cls, queue: _QueueSettings) -> RetryPolicy:
        """The policy the queue section of a configuration describes."""
        return cls(
            delays_s=tuple(queue.retry_delays),
            granularity_s=queue.retry_granularity,
            maxtime_s=queue.retry_maxtime,
            maxtime_reports_s=queue.retry_maxtime_reports,
            mode=queue.retry_mode,
            minimal_backoff_s=queue.minimal_backoff,
            maximal_backoff_s=queue.maximal_backoff,
        )

    def delay_s(self, failures: int, age_s: float) -> float:
        """Wait after the ``failures``-th failed attempt (1 = the first)."""
        if failures < 1:
            raise ValueError("failures counts from 1")
        if self.mode == "schedule":
            return self.delays_s[min(failures, len(self.delays_s)) - 1]
        if failures == 1:
            return self.minimal_backoff_s
        return min(max(age_s, self.minimal_backoff_s), self.maximal_backoff_s)

    def round_up(self, at: float) -> float:
        """``at`` rounded up to the granularity grid (no change at 0)."""
        g = self.granularity_s
        if g < 0.001:  # no rounding below a millisecond (and no overflow)
            return at
        # Less a hair for float error in the quotient (relative to it, so that
        # a time a few microseconds past a grid line is never rounded down).
        q = at / g
        return math.ceil(q - 1e-12 * max(1.0, q)) * g

    def maxtime_for(self, is_report: bool) -> float:
        """How long a message may stay queued: shorter for reports."""
        return self.maxtime_reports_s if is_report else self.maxtime_s

    def expires_at(self, arrival_at: float, is_report: bool) -> float:
        """When a message that arrived at ``arrival_at`` is given up."""
        return arrival_at + self.maxtime_for(is_report)

    def is_expired(self, now: float, arrival_at: float, is_report: bool) -> bool:
        """Whether a message that arrived at ``arrival_at`` is given up at ``now``."""
        return now >= self.expires_at(arrival_at, is_report)

    def next_attempt_at(
        self, now: float, failures: int, arrival_at: float, is_report: bool = False
    ) -> float | None:
        """When to try again after a failure at ``now``; None = expired, bounce.

        The result never lies past the expiry time: the last attempt is
        made at the deadline (rounded down to "now" if that has passed).
        """
        if self.is_expired(now, arrival_at, is_report):
            return None
        age = max(0.0, now - arrival_at)
        at = self.round_up(now + self.delay_s(failures, age))
        return min(at, self.expires_at(arrival_at, is_report))
