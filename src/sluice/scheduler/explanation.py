"""Why a recipient is waiting, and when it is expected to go.

SUMMARY
    Explanation, Reason, Waiting; explain_stored(entry, now, retry) for an
    entry read from the store.  Scheduler.explain(qid, now) gives the same
    shape for an entry in a running scheduler's memory.

DESCRIPTION
    An explanation lists every reason that holds a recipient, one per
    source IP it may use where they differ, and an expected send time when
    one can be known: the end of a rate window, a connect interval, a
    suspension's expiry, a retry time.  Concurrency, a suspension without
    expiry and a full queue manager wait for events nobody can date; their
    expected time is None ("when a delivery finishes").

LIMITATIONS
    The expected time is an estimate from the present state: deliveries
    ahead of the recipient in its sub-queue are assumed to take their
    turns at the tightest timed limit, and later events (a failure, an
    operator) move it.

SEE ALSO
    sluice.scheduler.scheduler, sluice.retry, `sluice why QUEUEID`
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from enum import StrEnum
from typing import Any, Protocol

from sluice.model import QueueEntry, QueueState, Reply

__all__ = ["Explanation", "Reason", "Waiting", "explain_stored", "format_at"]


class Waiting(StrEnum):
    """What a recipient is waiting for."""

    READY = "ready"  # nothing holds it: it goes at the next pickup
    BEHIND = "behind"  # earlier deliveries of its sub-queue go first (FIFO)
    CONCURRENCY = "concurrency"  # a counter entry has its threshold in flight
    RATE = "rate"  # a counter entry had X pickups in the last Y seconds
    CONNECTINTERVAL = "connectinterval"  # too soon after the entry's last pickup
    SUSPENDED = "suspended"  # a suspension matches
    DESTINATION_WINDOW = "destination-window"  # slow start: the window is full
    DESTINATION_DEAD = "destination-dead"  # the destination status cache
    CAPACITY = "capacity"  # the queue manager has its maximum in flight
    TENANT_SHARE = "tenant-share"  # other tenants take their turns (weights, min_share)
    DELIVERING = "delivering"  # a delivery attempt is under way
    INCOMING = "incoming"  # in the store, waiting for a refill
    DEFERRED = "deferred"  # in the store, waiting for its retry time
    HELD = "held"  # on hold until an operator releases it
    BOUNCE = "bounce"  # failed for good, waiting for its NDR
    ELSEWHERE = "elsewhere"  # claimed by a queue manager (ask it)
    UNKNOWN = "unknown"  # not here


@dataclass(frozen=True, slots=True)
class Reason:
    """One thing that holds a recipient.  ``text`` says it in a sentence."""

    kind: Waiting
    text: str
    localip: str | None = None
    counter: str | None = None
    key: tuple[tuple[str, str], ...] = ()
    threshold: str = ""
    current: str = ""
    suspension: str | None = None
    until_at: float | None = None


@dataclass(frozen=True, slots=True)
class Explanation:
    """Why ``qid`` waits: its state, the reasons, and the expected send time."""

    qid: str
    state: str
    reasons: tuple[Reason, ...]
    expected_at: float | None
    ahead: int = 0

    def lines(self, now: float) -> list[str]:
        """The explanation as text lines: the state, each reason, and when it is expected to go."""
        out = [f"{self.qid}: {self.state}"]
        for reason in self.reasons:
            where = f" [from {reason.localip or 'the default address'}]" \
                if reason.localip is not None else ""
            out.append(f"  - {reason.text}{where}")
        if self.expected_at is None:
            if self.state not in ("delivering", "bounce", "held", "unknown"):
                out.append("  expected: when a delivery that holds it finishes "
                           "(no time can be given)")
        elif self.expected_at <= now:
            out.append("  expected: now (at the next pickup)")
        else:
            out.append(f"  expected: {format_at(self.expected_at, now)}")
        return out

    def data(self, source: str, now: float) -> dict[str, Any]:
        """As plain data (the REST API's and `sluice why --json`'s answer)."""
        return {
            "qid": self.qid, "state": self.state, "expected_at": self.expected_at,
            "ahead": self.ahead, "source": source, "lines": self.lines(now),
            "reasons": [{"kind": str(r.kind), "text": r.text, "localip": r.localip,
                         "counter": r.counter, "key": dict(r.key), "threshold": r.threshold,
                         "current": r.current, "suspension": r.suspension,
                         "until_at": r.until_at}
                        for r in self.reasons],
        }


def format_at(at: float, now: float) -> str:
    """``at`` as "in 5m30s (at 2026-11-25 08:00:00 UTC)" relative to ``now``."""
    delta = at - now
    sign = "in " if delta >= 0 else ""
    ago = "" if delta >= 0 else " ago"
    rest = math.ceil(abs(delta))
    parts: list[str] = []
    for unit, size in (("d", 86400), ("h", 3600), ("m", 60), ("s", 1)):
        if rest >= size or (unit == "s" and not parts):
            n, rest = divmod(rest, size)
            parts.append(f"{n}{unit}")
    return f"{sign}{''.join(parts[:2])}{ago} (at {utc_date(at)})"


def utc_date(at: float) -> str:
    """POSIX seconds as "2026-11-25 08:00:00 UTC".

    Arithmetic, not datetime: the scheduler stays free of clock-reading
    modules (tests/unit/test_scheduler_purity.py).  Days to a civil date by
    H. Hinnant's algorithm (proleptic Gregorian calendar).
    """
    days, secs = divmod(int(at // 1), 86400)
    z = days + 719468
    era = (z if z >= 0 else z - 146096) // 146097
    doe = z - era * 146097
    yoe = (doe - doe // 1460 + doe // 36524 - doe // 146096) // 365
    doy = doe - (365 * yoe + yoe // 4 - yoe // 100)
    mp = (5 * doy + 2) // 153
    day = doy - (153 * mp + 2) // 5 + 1
    month = mp + 3 if mp < 10 else mp - 9
    year = yoe + era * 400 + (1 if month <= 2 else 0)
    hour, rest = divmod(secs, 3600)
    return f"{year:04d}-{month:02d}-{day:02d} {hour:02d}:{rest // 60:02d}:{rest % 60:02d} UTC"


class _Retry(Protocol):
    def expires_at(self, arrival_at: float, is_report: bool) -> float: ...


def _reply(reply: Reply | None) -> str:
    return f" after \"{reply}\"" if reply is not None else ""


def explain_stored(entry: QueueEntry, now: float, retry: _Retry | None = None) -> Explanation:
    """Explain an entry from the store (not in a scheduler's memory).

    ``retry`` (sluice.retry.RetryPolicy) adds when the entry expires.
    """
    reasons: list[Reason] = []
    expected: float | None
    expiry = ""
    if retry is not None:
        expires = retry.expires_at(entry.arrival_at, entry.is_report)
        expiry = f"; it expires {format_at(expires, now)}"
    match entry.state:
        case QueueState.HOLD:
            reasons.append(Reason(Waiting.HELD, "on hold: the queue manager ignores it until "
                                                "an operator releases it"))
            expected = None
        case QueueState.INCOMING:
            reasons.append(Reason(Waiting.INCOMING, "new mail, waiting for the next refill of "
                                                    "the active queue" + expiry))
            expected = now
        case QueueState.DEFERRED:
            due = entry.next_attempt_at
            when = "due now, waiting for the next refill" if due <= now \
                else f"deferred until {format_at(due, now)}"
            reasons.append(Reason(
                Waiting.DEFERRED,
                f"{when}{_reply(entry.last_reply)} (attempt {entry.attempts}){expiry}",
                until_at=due,
            ))
            expected = max(due, now)
        case QueueState.ACTIVE | QueueState.DELIVERING:
            what = "being delivered" if entry.state is QueueState.DELIVERING \
                else "claimed (waiting or being delivered)"
            reasons.append(Reason(Waiting.ELSEWHERE, f"{what} of a running queue manager; ask "
                                                     "it (REST API) for the pickup details"))
            expected = None
        case QueueState.BOUNCE:
            reasons.append(Reason(Waiting.BOUNCE, "failed for good" + _reply(entry.last_reply)
                                  + "; waiting for its NDR"))
            expected = None
    return Explanation(entry.qid, str(entry.state), tuple(reasons), expected)
