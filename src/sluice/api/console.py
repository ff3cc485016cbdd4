"""The operator console's operations: a message's headers and body, destinations, charts.

SUMMARY
    ops = control.console
    await ops.headers(spid, who) -> MessageHeaders
    await ops.body(spid, who) -> MessageBody          (403 unless api.body_tokens)
    ops.destinations(q, state, sort, desc, limit) -> DestinationTable
    ops.charts(window_s, step_s, top) -> Charts

DESCRIPTION
    Finding a message needs nothing new: GET /api/v1/queue/entries takes
    every selector field and pages by queue id (sluice.api.queue_ops).
    This module adds what the web page shows beside it.

    A message's content is read from the store (open_content) in the
    API's threads.  Headers are read up to the blank line that ends them
    and at most MAX_HEADER_BYTES; the body only for a token named in
    api.body_tokens, at most MAX_BODY_BYTES.

    The destination table joins, per destination, the scheduler's views
    (slow-start window, in flight, dead until, the sub-queues waiting and
    what holds them), the automatic actions of shaping in force (a
    back-off and its end) and the last hour of outcomes the metrics
    follower counted (sluice.api.activity).

STRATEGIES
    One state per destination, the most telling first: dead, suspended
    (every sub-queue waiting for it parked on a suspension), back-off,
    slow start (window below its limit), normal.

SEE ALSO
    sluice.api.activity, sluice.api.console_models, docs/operations.md
"""

from __future__ import annotations

from dataclasses import dataclass, field
from email.parser import BytesHeaderParser
from email.policy import compat32
from typing import TYPE_CHECKING, Literal

from sluice.api.console_models import (
    ChartPoint,
    Charts,
    DestinationRow,
    DestinationState,
    DestinationTable,
    HeaderField,
    MessageBody,
    MessageHeaders,
    QueuePoint,
    ReasonCount,
)
from sluice.api.errors import ApiError
from sluice.model import Selector
from sluice.scheduler import DestinationView
from sluice.shaping.rules import Action as ShapingAction

if TYPE_CHECKING:
    from sluice.api.control import Control

__all__ = ["MAX_BODY_BYTES", "MAX_HEADER_BYTES", "SORT_KEYS", "ConsoleOps"]

#: The most bytes of a header section read.
MAX_HEADER_BYTES = 256 << 10
#: The most bytes of a whole message read for the body view.
MAX_BODY_BYTES = 2 << 20

SortKey = Literal["destination", "state", "queued", "inflight", "delivered_5m",
                  "deferred_5m", "bounced_5m", "delivered_1h", "deferred_1h", "bounced_1h",
                  "last_at"]
SORT_KEYS: tuple[str, ...] = SortKey.__args__  # type: ignore[attr-defined]

#: How telling each state is (the table's default order puts trouble first).
_STATE_RANK: dict[str, int] = {"dead": 0, "suspended": 1, "back-off": 2, "slow start": 3,
                               "normal": 4}


@dataclass(slots=True)
class _Waiting:
    """A destination's sub-queues in the active queue."""

    queued: int = 0
    subqueues: int = 0
    suspended: int = 0  # of them, parked on a suspension
    until_at: list[float | None] = field(default_factory=list)  # those suspensions' ends
    held_by: list[str] = field(default_factory=list)


class ConsoleOps:
    """What the web console shows beyond the queue's own endpoints."""

    def __init__(self, control: Control) -> None:
        self.c = control

    # -- a message ---------------------------------------------------------------------

    def may_read_bodies(self, who: str) -> bool:
        """Whether the token named ``who`` may read message bodies (api.body_tokens)."""
        return who in self.c.config.api.body_tokens

    async def _read(self, spid: str, limit: int, *, headers_only: bool) -> tuple[bytes, bool]:
        store = self.c.queue.store

        def work() -> tuple[bytes, bool]:
            with store.open_content(spid) as stream:
                if not headers_only:
                    data = stream.read(limit + 1)
                    return data[:limit], len(data) > limit
                out = bytearray()
                while len(out) <= limit:
                    line = stream.readline(limit + 1 - len(out))
                    if not line:
                        break
                    out += line
                    if line in (b"\r\n", b"\n"):
                        return bytes(out), False
                return bytes(out[:limit]), len(out) > limit

        return await self.c.io(work)

    async def _known(self, text: str) -> str:
        """The SPID of a message still in the queue.

        404 otherwise: content goes with the last recipient.
        """
        spid, _ = self.c.qid(text, bare_ok=True)
        store = self.c.queue.store
        found = await self.c.io(lambda: next(iter(store.entries(Selector(qids=(spid,)),
                                                                limit=1)), None))
        if found is None:
            raise ApiError(404, "not found", f"no message {spid} in the queue (its content "
                                             "goes when its last recipient is done)")
        return spid

    async def headers(self, text: str, who: str) -> MessageHeaders:
        """The header of a queued message, fields unfolded, at most MAX_HEADER_BYTES read."""
        spid = await self._known(text)
        raw, truncated = await self._read(spid, MAX_HEADER_BYTES, headers_only=True)
        parsed = BytesHeaderParser(policy=compat32).parsebytes(raw)
        fields = [HeaderField(name=name, value=" ".join(str(value).split()))
                  for name, value in parsed.items()]
        return MessageHeaders(spid=spid, headers=fields, truncated=truncated,
                              body_allowed=self.may_read_bodies(who))

    async def body(self, text: str, who: str) -> MessageBody:
        """The text of a queued message, for tokens in api.body_tokens only (403 otherwise)."""
        if not self.may_read_bodies(who):
            raise ApiError(403, "forbidden", f"token {who!r} may not read message bodies "
                                             "(api.body_tokens)")
        spid = await self._known(text)
        raw, truncated = await self._read(spid, MAX_BODY_BYTES, headers_only=False)
        return MessageBody(spid=spid, text=raw.decode("utf-8", "replace"), bytes=len(raw),
                           truncated=truncated)

    # -- destinations ------------------------------------------------------------------

    def destinations(self, q: str | None, state: DestinationState | None, sort: str,
                     desc: bool, limit: int) -> DestinationTable:
        """The destinations table of the web page, filtered, sorted and cut to ``limit``."""
        c = self.c
        now = c.now()
        sched = {v.destination: v for v in c.scheduler.destinations(now)}
        waiting: dict[str, _Waiting] = {}
        suspensions = {v.id: v.expires_at for v in c.scheduler.suspensions(now)}
        for sq in c.scheduler.subqueues():
            name = sq.route.destination or sq.route.recipientdomain
            w = waiting.setdefault(name, _Waiting())
            w.queued += sq.entries
            w.subqueues += 1
            held = [h.removeprefix("suspension ") for h in sq.held_by
                    if h.startswith("suspension ")]
            if held:
                w.suspended += 1
                w.until_at.append(None if any(suspensions.get(sid) is None for sid in held)
                                  else max(suspensions[sid] or 0.0 for sid in held))
            w.held_by += [h for h in sq.held_by if h not in w.held_by]
        backoff: dict[str, float] = {}
        for fired in c.manager.shaper.active():
            if fired.action is ShapingAction.BACKOFF:
                for value in {*dict(fired.group).values(), *dict(fired.fields).values()}:
                    backoff[value] = max(backoff.get(value, 0.0), fired.until_at)
        activity = c.metrics.activity
        names = set(sched) | set(waiting) | set(activity.destinations)
        if q:
            needle = q.lower()
            names = {n for n in names if needle in n.lower()}
        rows = []
        for name in names:
            view = sched.get(name)
            w = waiting.get(name, _Waiting())
            st, until = self._state(view, w, backoff.get(name))
            if state is not None and st != state:
                continue
            d5 = activity.destination_counts(name, now, 5)
            d60 = activity.destination_counts(name, now, 60)
            last = activity.destinations.get(name)
            rows.append(DestinationRow(
                destination=name, state=st, until_at=until, queued=w.queued,
                inflight=view.inflight if view else 0,
                window=view.window if view else None, limit=view.limit if view else None,
                delivered_5m=d5[0], deferred_5m=d5[1], bounced_5m=d5[2],
                delivered_1h=d60[0], deferred_1h=d60[1], bounced_1h=d60[2],
                last_reply=last.last_reply if last else "",
                last_host=last.last_host if last else "",
                last_at=last.last_at if last else None, held_by=w.held_by[:10]))
        if sort == "state":
            rows.sort(key=lambda r: (_STATE_RANK[r.state], -r.queued, r.destination),
                      reverse=desc)
        elif sort == "destination":
            rows.sort(key=lambda r: r.destination, reverse=desc)
        else:
            rows.sort(key=lambda r: r.destination)
            rows.sort(key=lambda r: getattr(r, sort) or 0, reverse=desc)
        return DestinationTable(at=now, total=len(rows), items=rows[:limit])

    @staticmethod
    def _state(view: DestinationView | None, w: _Waiting,
               backoff_until: float | None) -> tuple[DestinationState, float | None]:
        if view is not None and view.dead:
            return "dead", view.dead_until_at
        # Suspended when every sub-queue waiting for it is (one tenant's
        # suspension does not stop a destination others still use).
        if w.subqueues and w.suspended == w.subqueues:
            ends = w.until_at
            return "suspended", None if None in ends else max(e or 0.0 for e in ends)
        if backoff_until is not None:
            return "back-off", backoff_until
        if view is not None and view.window < view.limit:
            return "slow start", None
        return "normal", None

    # -- charts ------------------------------------------------------------------------

    def charts(self, window_s: int, step_s: int, top: int) -> Charts:
        """The web page's charts: rates per second, the queue's size, the top deferral reasons."""
        activity = self.c.metrics.activity
        now = self.c.clock()
        names = ("accepted", "delivered", "deferred", "bounced")
        rates = [ChartPoint(at=p[0], **dict(zip(names, p[1:], strict=True)))
                 for p in activity.series(now, step_s, window_s)]
        queue = [QueuePoint(at=at, recipients=n, by_state=by_state)
                 for at, n, by_state in activity.queue_series(now) if now - at <= window_s]
        minutes = max(1, window_s // 60)
        reasons = [ReasonCount(reason=r, count=n)
                   for r, n in activity.top_reasons(now, top, minutes)]
        return Charts(at=now, step_s=step_s, window_s=window_s, rates=rates, queue=queue,
                      reasons=reasons)
