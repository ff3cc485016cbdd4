"""What the scheduler shows: its views and explanations, built on request.

SUMMARY
    stats(sched), subqueues(sched), counters(sched, now),
    suspensions(sched, now), destination(dest, now), explain(sched, qid, now)
    -- called by the Scheduler's methods of the same names.

DESCRIPTION
    Read-only pictures of the parts (sluice.scheduler.views) for the API,
    /metrics and `sluice why`.  They cost O(size of what they show) and are
    never on the pickup path.  This module reads the Scheduler's parts
    directly: it is the scheduler's own window, kept apart so that the
    coordinator stays short.

SEE ALSO
    sluice.scheduler.views, sluice.scheduler.explanation
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from sluice.scheduler.destinations import Destination
from sluice.scheduler.explanation import Explanation, Reason, Waiting, format_at
from sluice.scheduler.limits import NEVER, Entry, EntryState
from sluice.scheduler.lines import Blocker
from sluice.scheduler.subqueues import Flight, SubQueue
from sluice.scheduler.suspensions import Suspended
from sluice.scheduler.views import (
    CounterView,
    DestinationView,
    QueueStats,
    SubQueueView,
    SuspensionView,
    TenantView,
)

if TYPE_CHECKING:
    from sluice.scheduler.scheduler import Scheduler

__all__ = ["counters", "destination", "explain", "stats", "subqueues", "suspensions",
           "tenants"]


def stats(sched: Scheduler) -> QueueStats:
    """The scheduler's memory and work in numbers."""
    active = sched._active
    queues = list(sched._queues)
    return QueueStats(
        memory_used=active.memory_used,
        maxmemoryqueue=sched.settings.maxmemoryqueue,
        claim_pending=active.claim_pending,
        routing=active.routing,
        queued_entries=active.queued,
        queued_jobs=sum(sq.live for sq in queues),
        inflight_entries=active.inflight,
        inflight_jobs=len(sched._flights),
        max_deliveries=sched.settings.max_deliveries,
        subqueues=sum(1 for sq in queues if sq.live),
        parked_subqueues=sum(1 for sq in queues if sq.parked_on),
        counter_entries=sched._limits.count(),
        destinations=len(sched._dests),
        pickups=sched.pickups,
    )


def subqueues(sched: Scheduler) -> list[SubQueueView]:
    """Every sub-queue with jobs, and what holds it if it is parked."""
    return [SubQueueView(route=sq.route, priority=sq.priority, jobs=sq.live,
                         entries=sq.entries(), parked=bool(sq.parked_on),
                         held_by=tuple(_blocker_text(sched, b) for b in sq.parked_on))
            for sq in sched._queues if sq.live]


def tenants(sched: Scheduler) -> list[TenantView]:
    """Every tenant's share, and its jobs, entries, deliveries and pickups now."""
    shares = sched._shares
    queued: dict[str, list[int]] = {}  # jobs, entries, parked sub-queues
    for sq in sched._queues:
        if sq.live:
            q = queued.setdefault(sq.tenant, [0, 0, 0])
            q[0] += sq.live
            q[1] += sq.entries()
            q[2] += bool(sq.parked_on)
    names = sorted({*queued, *sched._tenant_inflight, *sched._tenant_pickups})
    out = []
    for t in names:
        jobs, entries, parked = queued.get(t, (0, 0, 0))
        out.append(TenantView(t, shares.weight(t), shares.min_shares.get(t, 0.0), jobs, entries,
                              parked, sched._tenant_inflight.get(t, 0),
                              sched._tenant_pickups.get(t, 0)))
    return out


def counters(sched: Scheduler, now: float) -> list[CounterView]:
    """Counter entries with a threshold, against it.

    The sub-queues parked on an entry count as waiting on it while it is
    exceeded.
    """
    out = []
    for st in sched._limits.states(now):
        entry, th = st.entry, st.thresholds
        if th.is_empty:
            continue
        interval = th.connectinterval_s or None
        out.append(CounterView(
            counter=entry.counter.id, key=entry.fields, inflight=st.inflight,
            concurrency=th.concurrency, rate=str(th.rate) if th.rate else None,
            rate_used=st.rate_used, connectinterval_s=interval,
            next_connect_at=(st.last_at + interval
                             if interval is not None and st.last_at > -NEVER else None),
            exceeded=st.held is not None,
            waiting_subqueues=entry.waiting() if st.held is not None else 0,
            condition=st.condition.id if st.condition is not None else None,
        ))
    return out


def suspensions(sched: Scheduler, now: float) -> list[SuspensionView]:
    """Suspensions in force: those by hand, and counter entries over a threshold."""
    out = []
    for blocker in sched._susps:
        s = blocker.suspension
        out.append(SuspensionView(
            id=s.id, fields=s.fields, automatic=False, expires_at=s.expires_at, tag=s.tag,
            reason=s.reason, waiting_subqueues=blocker.waiting(), from_file=blocker.from_file))
    for st in sched._limits.states(now):
        if st.held is None:
            continue
        entry = st.entry
        out.append(SuspensionView(
            id=f"{entry.counter.id}:{','.join(entry.key)}", fields=entry.fields,
            automatic=True, expires_at=st.free_at, tag=str(st.held),
            reason=entry_text(st, st.held), waiting_subqueues=entry.waiting()))
    return out


def destination(d: Destination, now: float) -> DestinationView:
    """One destination's slow start and status cache."""
    return DestinationView(
        destination=d.name, window=min(d.window, float(d.cap)), limit=d.cap,
        inflight=d.inflight, dead=d.dead_until > now,
        dead_until_at=d.dead_until if d.dead_until > now else None,
        failed_cohorts=d.fail_cohorts, queued_jobs=sum(sq.live for sq in d.subqueues))


def entry_text(st: EntryState, kind: Waiting) -> str:
    """One sentence: which entry holds, and by what."""
    entry, th, cond = st.entry, st.thresholds, st.condition
    keys = ", ".join(f"{n}={v or '(default)'}" for n, v in entry.fields) or "all mail"
    why = f" (condition {cond.id or 'if ' + str(dict(cond.match))})" if cond is not None else ""
    if cond is not None and cond.reason:
        why = f" (condition {cond.id}: {cond.reason})"
    name = f"counter {entry.counter.id} [{keys}]{why}"
    if kind is Waiting.CONCURRENCY:
        return f"{name}: {st.inflight} in flight, concurrency {th.concurrency}"
    if kind is Waiting.RATE and th.rate is not None:
        return (f"{name}: {st.rate_used} pickups in the last {th.rate.per_s:g}s, "
                f"rate {th.rate}")
    return f"{name}: connectinterval {th.connectinterval_s or 0:g}s since the last pickup"


def _blocker_text(sched: Scheduler, blocker: Blocker) -> str:
    if isinstance(blocker, Entry):
        st = sched._limits.state(blocker, sched.now)
        return entry_text(st, st.held or Waiting.CONCURRENCY)
    if isinstance(blocker, Suspended):
        return f"suspension {blocker.suspension.id}"
    if isinstance(blocker, Destination):
        return f"destination {blocker.name}: concurrency window {blocker.limit} full"
    return repr(blocker)


def _shares(sched: Scheduler, sq: SubQueue) -> list[Reason]:
    """Where ``sq`` waits in line with other tenants.

    They take turns by weight, and those below their minimum share of a
    destination go first.
    """
    shares = sched._shares
    out = []
    for blocker in sq.parked_on:
        line = blocker.waiters[sq.priority] if blocker.waiters is not None else None
        others = [t for t in line.tenants() if t != sq.tenant] if line is not None else []
        if not others:
            continue
        name = _blocker_name(blocker)
        turns = ", ".join(f"{t or '(none)'} {shares.weight(t):g}" for t in [sq.tenant, *others])
        text = f"tenant {sq.tenant or '(none)'} takes turns at {name} with {len(others)} " \
               f"other tenant(s), by weight ({turns})"
        if isinstance(blocker, Destination):
            short = [t for t in others
                     if shares.reserved(t, blocker.limit) > blocker.by_tenant.get(t, 0)]
            if short:
                text += "; freed slots go first to " + ", ".join(
                    f"{t} (below its min_share of {shares.min_shares[t]:.0%})" for t in short)
        out.append(Reason(Waiting.TENANT_SHARE, text))
    return out


def _blocker_name(blocker: Blocker) -> str:
    if isinstance(blocker, Entry):
        keys = ", ".join(f"{n}={v}" for n, v in blocker.fields) or "all mail"
        return f"counter {blocker.counter.id} [{keys}]"
    if isinstance(blocker, Suspended):
        return f"suspension {blocker.suspension.id}"
    if isinstance(blocker, Destination):
        return f"destination {blocker.name}"
    return repr(blocker)


def explain(sched: Scheduler, qid: str, now: float) -> Explanation:
    """Why ``qid`` waits, and when it is expected to go.

    Every reason (not only the one its sub-queue is parked on), per source
    IP when the route has a pool.
    """
    rec = sched._qids.get(qid)
    if rec is None:
        return Explanation(qid, "unknown", (Reason(
            Waiting.UNKNOWN, "not in the active queue's memory: it is in the store "
            "(incoming, deferred, held) or being routed"),), None)
    if isinstance(rec, Flight):
        return Explanation(qid, "delivering", (Reason(
            Waiting.DELIVERING,
            f"being delivered to {rec.dest.name}, started {format_at(rec.started_at, now)}",
            localip=rec.ip),), None)
    sq = rec.sq
    route, dest = sq.route, sq.dest
    ahead = sq.ahead_of(rec)
    reasons: list[Reason] = []
    if dest.dead_until > now:
        reasons.append(Reason(
            Waiting.DESTINATION_DEAD,
            f"destination {dest.name} is marked dead until {format_at(dest.dead_until, now)}"
            ": it is deferred without a connection attempt", until_at=dest.dead_until))
        return Explanation(qid, "queued", tuple(reasons), None, ahead)
    # When each source IP can take it: now, a time (timed limits only), or
    # None (it waits for an event nobody can date).
    best: float | None = None
    undated = False
    spacing = 0.0
    susps = sched._suspended(sq)
    for i, ip in enumerate(sq.ips):
        shown_ip = ip if route.localip else None
        at_ip: float | None = now
        susp = susps[i]
        if susp is not None:
            s = susp.suspension
            extra = f" ({s.reason})" if s.reason else ""
            until = f" until {format_at(s.expires_at, now)}" if s.expires_at else ""
            reasons.append(Reason(Waiting.SUSPENDED, f"suspended by {s.id}{until}{extra}",
                                  localip=shown_ip, suspension=s.id, until_at=s.expires_at))
            at_ip = s.expires_at
        binding = sq.bindings[i] if i < len(sq.bindings) else None
        for entry in binding.entries if binding is not None else ():
            st = sched._limits.state(entry, now)
            th = st.thresholds
            if th.rate is not None and th.rate.count:
                spacing = max(spacing, th.rate.per_s / th.rate.count)
            if th.connectinterval_s:
                spacing = max(spacing, th.connectinterval_s)
            if st.held is None:
                continue
            reasons.append(Reason(
                st.held, entry_text(st, st.held), localip=shown_ip, counter=entry.counter.id,
                key=entry.fields, threshold=str(th), current=str(st.inflight),
                until_at=st.free_at))
            if st.free_at is None:
                at_ip = None
            elif at_ip is not None:
                at_ip = max(at_ip, st.free_at)
        if at_ip is None:
            undated = True
        elif best is None or at_ip < best:
            best = at_ip
    if dest.inflight >= dest.limit:
        window = min(dest.window, float(dest.cap))
        reasons.append(Reason(
            Waiting.DESTINATION_WINDOW,
            f"destination {dest.name}: {dest.inflight} in flight fill its concurrency window "
            f"of {window:.2f} (slow start; the policy allows {dest.cap})",
            current=str(dest.inflight), threshold=f"{window:.2f}"))
        best = None
    elif best is not None and best <= now:
        if len(sched._flights) >= sched.settings.max_deliveries:
            reasons.append(Reason(Waiting.CAPACITY, "the queue manager has max_deliveries "
                                  f"({sched.settings.max_deliveries}) in flight"))
            best = None
        elif ahead == 0:
            reasons.append(Reason(Waiting.READY, "nothing holds it: it goes at the next pickup"))
    reasons += _shares(sched, sq)
    if ahead:
        reasons.insert(0, Reason(Waiting.BEHIND, f"{ahead} earlier deliveries of its "
                                                 "sub-queue go first (FIFO)"))
        if best is not None:
            if spacing:
                best = max(best, now) + ahead * spacing
            elif undated:
                best = None
    return Explanation(qid, "queued", tuple(reasons), best, ahead)
