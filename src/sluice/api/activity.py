"""What happened in the last hour, in memory: the web page's charts and destination table.

SUMMARY
    activity = Activity()
    activity.record(name, event, now)     one counted accounting event
    activity.sample_queue(now, counts)    the queue's size (every 10 s)
    activity.series(now, step_s)          accepted/delivered/deferred/bounced per second
    activity.queue_series(now)            the queue's size over the hour
    activity.top_reasons(now, n)          the commonest deferral replies
    activity.destination(domain, now)     5-minute and 1-hour counts, the last reply

DESCRIPTION
    The metrics follower (sluice.api.metrics) already reads every line the
    node appends to the accounting log; each counted event is handed here
    too, stamped with the time of the poll that read it (at most a second
    late).  Nothing is read back from disk: after a restart the charts
    start empty, like the Prometheus counters.

STRATEGIES
    Rings, not lists.  Counts per second live in a ring of HOUR_S slots,
    each stamped with the second it holds; a slot whose stamp is old is
    zero, so nothing needs sweeping and memory never grows.  Per
    destination and per deferral reason the counts are per minute, which
    is what the 5-minute and 1-hour columns need, kept only for minutes
    that had events (at most 60).

    Bounded tables.  At most MAX_DESTINATIONS destinations and MAX_REASONS
    reasons are followed, each table kept in the order last seen; when
    full, the one seen longest ago goes (O(1): no search).  A
    reason is the reply with what changes from message to message (queue
    ids, numbers, addresses) masked, so one server's "try again in 37
    seconds" is one reason and not a thousand.

LIMITATIONS
    Destinations are keyed by the recipient domain of the accounting line;
    mail routed through a relay shows under its recipients' domains here
    and under the relay in the scheduler's view.

SEE ALSO
    sluice.api.metrics, sluice.api.console (what the routes answer), docs/operations.md
"""

from __future__ import annotations

import re
from collections import OrderedDict
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

__all__ = ["HOUR_S", "KINDS", "Activity", "DestinationActivity", "reason_of"]

#: What is counted, in the order of every series.
KINDS = ("accepted", "delivered", "deferred", "bounced")

HOUR_S = 3600
MINUTES = 60
QUEUE_STEP_S = 10
MAX_DESTINATIONS = 10_000
MAX_REASONS = 2_000

_MASKS = (
    (re.compile(r"<[^>]*>"), "<…>"),
    (re.compile(r"\b[\w.+-]+@[\w.-]+\b"), "…@…"),
    (re.compile(r"\b[0-9A-Fa-f]{8,}\b"), "…"),
    (re.compile(r"\d+"), "#"),
)


def reason_of(event: Mapping[str, Any]) -> str:
    """The key of the top reasons: a deferral's reply with what varies between messages masked.

    At most 160 characters.
    """
    code = event.get("code")
    enhanced = event.get("enhanced")
    text = str(event.get("response") or "").strip()
    for pattern, mask in _MASKS:
        text = pattern.sub(mask, text)
    head = " ".join(str(x) for x in (code, enhanced) if x not in (None, ""))
    out = f"{head} {text}".strip() if head else text
    return out[:160] or "(no reply)"


class _MinuteRing:
    """Counts per minute over the last hour, per kind.

    Only minutes with events take room (most destinations see few).
    """

    __slots__ = ("kinds", "minutes")

    def __init__(self, kinds: int) -> None:
        self.kinds = kinds
        self.minutes: dict[int, list[int]] = {}

    def add(self, now: float, kind: int) -> None:
        minute = int(now // 60)
        counts = self.minutes.get(minute)
        if counts is None:
            if len(self.minutes) >= MINUTES:  # forget what is an hour old
                for old in [m for m in self.minutes if m <= minute - MINUTES]:
                    del self.minutes[old]
            counts = self.minutes[minute] = [0] * self.kinds
        counts[kind] += 1

    def total(self, now: float, minutes: int) -> list[int]:
        current = int(now // 60)
        out = [0] * self.kinds
        for minute, counts in self.minutes.items():
            if 0 <= current - minute < minutes:
                out = [a + b for a, b in zip(out, counts, strict=True)]
        return out


@dataclass(slots=True)
class DestinationActivity:
    """One destination's recent outcomes and its last reply."""

    ring: _MinuteRing = field(default_factory=lambda: _MinuteRing(3))
    last_at: float = 0.0
    last_event: str = ""
    last_reply: str = ""
    last_host: str = ""


class Activity:
    """The last hour of the node's mail, by second, destination and deferral reason."""

    def __init__(self) -> None:
        self._stamps = [-1] * HOUR_S
        self._counts = [[0, 0, 0, 0] for _ in range(HOUR_S)]
        self._queue: list[tuple[float, int, dict[str, int]] | None] = \
            [None] * (HOUR_S // QUEUE_STEP_S)
        self._queue_last: int = -1
        # Both in the order last seen (oldest first): the first goes when full.
        self._reasons: OrderedDict[str, _MinuteRing] = OrderedDict()
        self.destinations: OrderedDict[str, DestinationActivity] = OrderedDict()

    # -- recording ---------------------------------------------------------------------

    def record(self, name: str, event: Mapping[str, Any], now: float) -> None:
        """Count one event (``name`` is one of KINDS) read at ``now``."""
        kind = KINDS.index(name)
        second = int(now)
        slot = second % HOUR_S
        if self._stamps[slot] != second:
            self._stamps[slot] = second
            self._counts[slot] = [0, 0, 0, 0]
        self._counts[slot][kind] += 1
        if name == "accepted":
            return
        domain = str(event.get("domain") or "")
        if domain:
            self._destination(domain, name, event, now)
        if name == "deferred":
            reason = reason_of(event)
            ring = self._reasons.get(reason)
            if ring is None:
                if len(self._reasons) >= MAX_REASONS:
                    self._reasons.popitem(last=False)
                ring = self._reasons[reason] = _MinuteRing(1)
            else:
                self._reasons.move_to_end(reason)
            ring.add(now, 0)

    def _destination(self, domain: str, name: str, event: Mapping[str, Any],
                     now: float) -> None:
        dest = self.destinations.get(domain)
        if dest is None:
            if len(self.destinations) >= MAX_DESTINATIONS:
                self.destinations.popitem(last=False)
            dest = self.destinations[domain] = DestinationActivity()
        else:
            self.destinations.move_to_end(domain)
        dest.ring.add(now, KINDS.index(name) - 1)
        dest.last_at = now
        dest.last_event = name
        code = event.get("code")
        text = str(event.get("response") or "")
        dest.last_reply = f"{code} {text}".strip() if code is not None else text
        dest.last_host = str(event.get("remotemx") or event.get("remoteip") or "")

    def sample_queue(self, now: float, recipients: int, by_state: Mapping[str, int]) -> None:
        """The queue's size at ``now``; one sample per QUEUE_STEP_S is kept."""
        step = int(now // QUEUE_STEP_S)
        if step == self._queue_last:
            return
        self._queue_last = step
        self._queue[step % len(self._queue)] = (now, recipients, dict(by_state))

    def queue_due(self, now: float) -> bool:
        """Whether a queue sample for ``now``'s step is still missing."""
        return int(now // QUEUE_STEP_S) != self._queue_last

    # -- reading -----------------------------------------------------------------------

    def series(self, now: float, step_s: int, window_s: int = HOUR_S
               ) -> list[tuple[float, float, float, float, float]]:
        """Per step: (start of the step, accepted, delivered, deferred, bounced per second).

        Oldest first, for the whole seconds of the last ``window_s`` before
        ``now``.
        """
        if step_s < 1 or window_s < step_s or window_s > HOUR_S:
            raise ValueError("step_s must be >= 1 and window_s from step_s to one hour")
        end = int(now)  # the current second is still filling: not shown
        start = end - window_s
        start -= start % step_s
        out = []
        for t0 in range(start, end, step_s):
            sums = [0, 0, 0, 0]
            for second in range(t0, min(t0 + step_s, end)):
                slot = second % HOUR_S
                if self._stamps[slot] == second:
                    c = self._counts[slot]
                    sums = [sums[0] + c[0], sums[1] + c[1], sums[2] + c[2], sums[3] + c[3]]
            span = min(t0 + step_s, end) - t0
            out.append((float(t0), *(s / span for s in sums)))
        return out  # type: ignore[return-value]

    def queue_series(self, now: float) -> list[tuple[float, int, dict[str, int]]]:
        """The queue's size, oldest first, over the last hour."""
        return sorted((s for s in self._queue if s is not None and now - s[0] <= HOUR_S),
                      key=lambda s: s[0])

    def top_reasons(self, now: float, n: int, minutes: int = MINUTES) -> list[tuple[str, int]]:
        """The ``n`` commonest deferral reasons of the last ``minutes``."""
        totals = [(reason, ring.total(now, minutes)[0]) for reason, ring in self._reasons.items()]
        totals = [t for t in totals if t[1] > 0]
        totals.sort(key=lambda t: (-t[1], t[0]))
        return totals[:n]

    def destination_counts(self, domain: str, now: float, minutes: int) -> list[int]:
        """Delivered, deferred, bounced of ``domain`` in the last ``minutes``."""
        dest = self.destinations.get(domain)
        return [0, 0, 0] if dest is None else dest.ring.total(now, minutes)
