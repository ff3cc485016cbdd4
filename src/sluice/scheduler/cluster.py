"""ClusterLimits: the limits seam when several nodes share the policy's limits.

SUMMARY
    Scheduler(settings, policy, limits=ClusterLimits())
    -> commands AcquireGrants / ReturnGrants for the runtime (which asks Redis)
    <- events GrantsChanged, ClusterModeChanged

DESCRIPTION
    Every counter with ``scope: cluster`` (the default) holds its thresholds
    across all nodes for the same key.  The counts live in the cluster's
    shared store (Redis), which this pure module never touches: a node
    starts a delivery only against capacity granted to it ahead of time,
    and asks for more when it needs it.  The local rules still apply (each
    node also counts its own deliveries, as GroupedLimits does), so a
    cluster limit is never looser than a node's.

    concurrency   leases: a node holds ``slots`` of an entry, each a lease
                  with a TTL that the runtime renews; a delivery needs a
                  leased slot nobody on this node uses.  A slot unused for
                  ``idle_s`` is given back (ReturnGrants), so that a node
                  keeps no more than it can use soon.
    rate, connectinterval
                  dated slots: the cluster hands out pickup times spaced at
                  least Y/X apart (GCRA) across every node; a node may use
                  one from its time until ``use_within_s`` after it, and
                  drops it otherwise.  Any Y-second window then holds at
                  most X + 1 pickups in the whole cluster.

STRATEGIES
    Ask for what waits.  When an entry's grant holds a pickup, the entry is
    the blocker the sub-queue parks on (as for a local limit) and a request
    is noted: slots for what is in flight plus one, pickups for the
    sub-queues waiting on it.  One AcquireGrants per step carries every
    request, so the runtime makes one round trip per batch.  A request
    already asked for is not asked again until its answer or its retry time.
    Dates come in batches: a grant that used every date it had asks for
    twice as many next time (at most a quarter of the rate's count, and
    64), one that let a date go stale for half as many, so a busy entry
    costs a round trip per batch, not per pickup.

    Fall back to a share.  When the shared store is unreachable
    (ClusterModeChanged(shared=False, nodes, rank)), every cluster limit L
    becomes this node's share of it: L // nodes, plus one for the first
    L % nodes ranks, so that the shares add up to L and each node gets at
    least one where L allows.  A rate or an interval starts nothing for one
    window after the switch (no window then mixes the store's pickups with
    the shares'), and for ``transition_s`` (the leases' TTL) a node keeps no
    more concurrency than the leases it held.  Coming back
    (ClusterModeChanged(shared=True, transition_s)), a node keeps to its
    share and pauses rates one window more for ``transition_s``, while the
    other nodes may not have noticed yet.  Grants are forgotten; when the store is back
    the node asks again, first for the slots of what it has in flight.  When
    the come-back ends, leases beyond that share (granted while this node
    was back alone, before the store counted the others' deliveries in
    flight) go back, and the node asks the store for its share again; this
    happens in the step that ends it, whatever event that step brings,
    before any pickup sees the store's grants alone.

    Hand over before sharing.  The step that comes back sends one
    AcquireGrants carrying the leases of every delivery in flight (an
    empty one if there are none), so that the store counts them before
    any other node is granted leases against them.  The runtime tells the
    other nodes that this one shares again only once that request is
    answered (sluice.cluster.agent): until then their come-backs go on.

    Alone in the fall-back.  A node may lose the store while the others
    still reach it (a partition, a reply too late): it is told so
    (``others_shared``).  Their pickups are then unknown here, so it starts
    no rate-limited pickup at all, keeps to the leases it held while they
    live, and after that starts no new delivery under a cluster
    concurrency, until the others fall back too (then a window's pause, and
    the shares) or the store answers again.  Delayed mail, never a limit
    exceeded.

INVARIANTS
    slots is what the store counts for this node once every command sent
    is carried: an answer to a request sent before leases went back
    counts them given back (Grant.answered_slots).
    used <= slots for every grant while shared; a dated slot is used at most
    once, never before its time nor after its time + use_within_s.

LIMITATIONS
    A delivery that started during a fall-back holds no lease; when the
    shared store returns, the node asks for leases for its deliveries in
    flight first, and starts nothing new for the entry until it holds them.

SEE ALSO
    sluice.scheduler.limits (the seam), sluice.scheduler.limits_grouped,
    docs/cluster.md
"""

from __future__ import annotations

from dataclasses import replace

from sluice.scheduler import limits
from sluice.scheduler.cluster_grants import NEVER as _NEVER
from sluice.scheduler.cluster_grants import Fallback, Grant
from sluice.scheduler.events import (
    AcquireGrants,
    ClockTicked,
    ClusterModeChanged,
    Command,
    Event,
    GrantRequest,
    GrantsChanged,
    ReturnGrants,
)
from sluice.scheduler.limits import Entry
from sluice.scheduler.limits_grouped import GroupedLimits, _Binding, _Entry, _Row
from sluice.scheduler.policy import Policy, Thresholds

__all__ = ["ClusterLimits", "cluster_key"]

MAX_BATCH = 64


def cluster_key(entry: Entry) -> str:
    """The name of a counter entry in the shared store: counter id and key."""
    return "\x1f".join((entry.counter.id, *entry.key))


class ClusterLimits(GroupedLimits):
    """GroupedLimits whose cluster-scoped entries also need a grant."""

    def __init__(self, idle_s: float = 5.0, lookahead: int = 0, refresh_s: float = 1.0
                 ) -> None:
        super().__init__()
        self.idle_s = idle_s
        self.refresh_s = refresh_s  # how often held leases ask for the node's share
        self.lookahead = lookahead  # slots asked for beyond the next pickup
        self.grants: dict[str, Grant] = {}
        self.fallback: Fallback | None = None
        self.comeback: Fallback | None = None  # left lately, others maybe not yet
        self.cluster: frozenset[str] = frozenset()  # counter ids with scope: cluster
        self.returning: list[tuple[str, int]] = []  # leases to give back at the next step
        self.hand_over = False  # just back: the next outbox asks, if only for nothing

    def load(self, policy: Policy, now: float) -> None:
        """Limits.load, noting the cluster-scoped counters; every grant asks again."""
        super().load(policy, now)
        self.cluster = frozenset(c.id for c in policy.counters if c.scope == "cluster")
        for grant in self.grants.values():
            grant.asked = False  # thresholds may have changed: ask again as needed
            grant.entry = None  # the old blockers are void; bound again on use

    # ----------------------------------------------------------- pickups

    def _cluster_entries(self, binding: _Binding) -> list[tuple[_Row, int]]:
        out = []
        rows = binding.rows
        for t, slot in binding.order:
            row = rows[t]
            member = row.table.members[slot]
            if member.counter.id in self.cluster and not row.prof.ths[slot].is_empty:
                out.append((row, slot))
        return out

    def _grant(self, row: _Row, slot: int) -> Grant:
        entry = row.entry(slot)
        key = cluster_key(entry)
        grant = self.grants.get(key)
        if grant is None:
            grant = self.grants[key] = Grant(entry)
        elif grant.entry is not entry:
            grant.entry = entry
        return grant

    def _fallen_back(self, fallback: Fallback, th: Thresholds, grant: Grant,
                     now: float) -> Thresholds:
        """The thresholds this node keeps alone: its share, with two restrictions.

        During the transition, no more concurrency than the leases it held;
        after it, while others still take from the store, nothing new at all.
        """
        mine = fallback.thresholds(th)
        if mine.concurrency is not None:
            if now < fallback.until:
                mine = replace(mine, concurrency=min(mine.concurrency, grant.switch_slots))
            elif fallback.others_shared:
                mine = replace(mine, concurrency=0)
        return mine

    def _comeback(self, now: float) -> Fallback | None:
        """The fall-back just left, while the other nodes may still be in it.

        None once that is over: its end first trims the grants, so that no
        step sees the store's grants alone before they are trimmed.
        """
        cb = self.comeback
        if cb is None or now < cb.until:
            return cb
        self._end_comeback()
        return None

    def _end_comeback(self) -> None:
        """Every node is back (or the transition is over): grants alone."""
        cb, self.comeback = self.comeback, None
        assert cb is not None
        for key, grant in self.grants.items():
            self._trim_after_comeback(key, grant, cb)

    def _lacks(self, row: _Row, slot: int, now: float) -> bool:
        """Whether the entry's grant (or, fallen back, its share) holds a pickup."""
        th = row.prof.ths[slot]
        grant = self._grant(row, slot)
        if self.fallback is not None:
            if self.fallback.paused_until(th) > now:
                return True
            return limits.held(self._fallen_back(self.fallback, th, grant, now), row.inflight,
                               row.times, row.last_at, now) is not None
        cb = self._comeback(now)
        if cb is not None and (cb.paused_until(th) > now or limits.held(
                cb.thresholds(th), row.inflight, row.times, row.last_at, now) is not None):
            return True  # the store's grant and our share both, while others may be on theirs
        entry = row.entry(slot)
        short = False
        if th.concurrency is not None and grant.room() <= 0:
            grant.want_slots = max(grant.want_slots, grant.used + 1 + self.lookahead)
            short = True
        if th.rate is not None or th.connectinterval_s:
            self._drop_stale(grant, now)
            if not grant.slot_ats or grant.slot_ats[0] > now:
                grant.want_pickups = max(grant.want_pickups, 1 + entry.waiting())
                short = True
        return short

    @staticmethod
    def _batch_cap(th: Thresholds) -> int:
        """The most dates to ask for at once: a quarter of a rate's count, at most MAX_BATCH.

        The other nodes get theirs too.
        """
        if th.rate is None:
            return 1
        return max(1, min(MAX_BATCH, th.rate.count // 4))

    @staticmethod
    def _drop_stale(grant: Grant, now: float) -> None:
        ats = grant.slot_ats
        dropped = False
        while ats and ats[0] + grant.use_within_s < now:
            ats.popleft()
            dropped = True
        if dropped:  # asked for more than it could use: ask for fewer
            grant.batch = max(1, grant.batch // 2)

    def holder(self, binding: _Binding, now: float) -> Entry | None:
        """Limits.holder; a cluster entry also holds the pickup while it lacks a grant."""
        entry = super().holder(binding, now)
        if entry is not None or not self.cluster:
            return entry
        for row, slot in self._cluster_entries(binding):
            if self._lacks(row, slot, now):
                return row.entry(slot)
        return None

    def record(self, binding: _Binding, now: float) -> None:
        """Limits.record, also counting the lease used and the pickup date spent."""
        super().record(binding, now)
        if not self.cluster:
            return
        for row, slot in self._cluster_entries(binding):
            th = row.prof.ths[slot]
            grant = self._grant(row, slot)
            if th.concurrency is not None:
                grant.used += 1  # counted in a fall-back too: its leases are asked for later
                if grant.used >= grant.slots:
                    grant.idle_at = _NEVER
            if self.fallback is None and (th.rate is not None or th.connectinterval_s):
                grant.slot_ats.popleft()

    def release(self, binding: _Binding, now: float) -> list[Entry]:
        """Limits.release, also freeing the lease and giving back what is above the share."""
        waited = super().release(binding, now)
        if not self.cluster:
            return waited
        for row, slot in self._cluster_entries(binding):
            if row.prof.ths[slot].concurrency is None:
                continue
            grant = self._grant(row, slot)
            if grant.used:
                grant.used -= 1
                self._give_back_above_share(grant)
                if grant.slots > grant.used and grant.idle_at == _NEVER:
                    grant.idle_at = now
        return waited

    def _trim_after_comeback(self, key: str, grant: Grant, cb: Fallback) -> None:
        """Give back the leases above this node's part once every node is back.

        Leases asked for while this node was back alone may hold more than its
        part now that the others are back too (the store counts their
        deliveries in flight as leases, even beyond the limit): keep no more
        than what is in use or the share it kept meanwhile, give the rest back,
        and ask again for the store's share.
        """
        limit = None
        if grant.entry is not None:
            parts = self._cluster_parts(grant.entry)
            if parts is not None:
                limit = parts[1].concurrency
        keep = grant.used if limit is None else max(grant.used, cb.share(limit))
        if grant.slots > keep:
            grant.give_back(key, grant.slots - keep, self.returning)
            grant.share = None
            grant.asked = False

    def _give_back_above_share(self, grant: Grant) -> None:
        """Return at once the leases above the node's share that nothing uses."""
        if grant.share is None or self.fallback is not None:
            return
        keep = max(grant.share, grant.used)
        if grant.slots > keep and grant.entry is not None:
            grant.give_back(cluster_key(grant.entry), grant.slots - keep, self.returning)

    def _cluster_parts(self, entry: Entry) -> tuple[_Row, Thresholds, Grant] | None:
        """The row, thresholds and grant of a cluster entry (None: not one)."""
        if entry.counter.id not in self.cluster:
            return None
        assert isinstance(entry, _Entry)
        row, th = self._parts(entry)
        if th.is_empty:
            return None
        return row, th, self._grant(row, entry.slot)

    def free(self, entry: Entry, now: float) -> int:
        """Limits.free, no more than the grant (or, fallen back, the node's share) allows."""
        room = super().free(entry, now)
        parts = self._cluster_parts(entry)
        if room <= 0 or parts is None:
            return room
        row, th, grant = parts
        if self.fallback is not None:
            if self.fallback.paused_until(th) > now:
                return 0
            return min(room, limits.free(self._fallen_back(self.fallback, th, grant, now),
                                         row.inflight, row.times, row.last_at, now))
        cb = self._comeback(now)  # first: its end may trim the grant
        if th.concurrency is not None:
            room = min(room, grant.room())
        if cb is not None:
            if cb.paused_until(th) > now:
                return 0
            room = min(room, limits.free(cb.thresholds(th), row.inflight, row.times,
                                         row.last_at, now))
        if th.rate is not None or th.connectinterval_s:
            self._drop_stale(grant, now)
            room = min(room, sum(1 for at in grant.slot_ats if at <= now))
        return max(room, 0)

    def next_slot_at(self, entry: Entry, now: float) -> float | None:
        """Limits.next_slot_at, also waiting for a granted date, a retry or a pause.

        None when only an answer or a freed slot can say.
        """
        at = super().next_slot_at(entry, now)
        parts = self._cluster_parts(entry)
        if parts is None:
            return at
        row, th, grant = parts
        if self.fallback is not None:
            mine = limits.slot_at(self._fallen_back(self.fallback, th, grant, now),
                                  row.inflight, row.times, row.last_at, now)
            paused = self.fallback.paused_until(th)
            if paused == _NEVER:
                mine = None  # until the others fall back too (an event says)
            elif paused > now:
                mine = paused if mine is None else max(mine, paused)
        elif (cb := self._comeback(now)) is not None and (
                cb.paused_until(th) > now or limits.slot_at(
                    cb.thresholds(th), row.inflight, row.times, row.last_at, now) is not None):
            mine = max(cb.paused_until(th), limits.slot_at(
                cb.thresholds(th), row.inflight, row.times, row.last_at, now) or now)
        elif grant.slot_ats and grant.slot_ats[0] > now:
            mine = grant.slot_ats[0]
        elif grant.retry_at is not None and grant.retry_at > now:
            mine = grant.retry_at
        else:
            mine = None  # an answer or a freed slot will say
        if at is None or mine is None:
            return mine if at is None else at
        return max(at, mine)

    # ------------------------------------------------------------ events

    def handle(self, event: Event, now: float) -> list[Entry]:
        """Take grants from the store, and switch between shared limits and shares.

        Handles GrantsChanged, ClusterModeChanged and the ClockTicked that ends
        a transition or a come-back; returns the entries that may have room now.
        """
        match event:
            case GrantsChanged(grants=grants):
                freed: list[Entry] = []
                for g in grants:
                    grant = self.grants.get(g.key)
                    if grant is None:  # not asked for here: give any lease back
                        if g.slots:
                            self.returning.append((g.key, g.slots))
                        continue
                    grant.asked = False
                    grant.answered_at = now
                    # In flight keeps its lease.
                    grant.slots = max(grant.answered_slots(g.slots), grant.used)
                    grant.share = g.share
                    self._give_back_above_share(grant)
                    grant.slot_ats.extend(sorted(g.slot_ats))
                    grant.use_within_s = g.use_within_s
                    grant.retry_at = g.retry_at
                    if grant.slots > grant.used and grant.idle_at == _NEVER:
                        grant.idle_at = now
                    if grant.entry is not None:
                        freed.append(grant.entry)
                return freed
            case ClusterModeChanged(shared=False, nodes=nodes, rank=rank,
                                    others_shared=others) if self.fallback is not None:
                # Still fallen back: the live nodes changed, or the others
                # fell back too (their last pickups from the store are a
                # window old from now on).
                fb = self.fallback
                since = now if fb.others_shared and not others else fb.since
                self.fallback = replace(fb, nodes=max(1, nodes), rank=rank, since=since,
                                        others_shared=others)
                return [g.entry for g in self.grants.values() if g.entry is not None]
            case ClusterModeChanged(shared=shared, nodes=nodes, rank=rank,
                                    transition_s=transition_s, others_shared=others):
                # Coming back, the others may still keep their shares for a
                # while: keep to ours (and pause rates one window) meanwhile.
                # Shared again while shared: the others are back too, the
                # come-back ends after transition_s (0: now).
                if shared and self.fallback is None:
                    if self.comeback is not None:
                        self.comeback = replace(self.comeback, until=now + transition_s)
                        self._comeback(now)  # ended now: trimmed before any use
                    return [g.entry for g in self.grants.values() if g.entry is not None]
                self.comeback = (replace(self.fallback, until=now + transition_s, since=now)
                                 if shared and self.fallback is not None else None)
                self.hand_over = self.comeback is not None
                self.fallback = (None if shared else
                                 Fallback(max(1, nodes), rank, now + transition_s, now,
                                           others))
                self.returning.clear()  # the store forgets them (their TTL) or never heard
                for grant in self.grants.values():
                    grant.switch_slots = grant.slots if self.fallback else 0
                    grant.share = None
                    grant.asked = False
                    grant.slot_ats.clear()
                    grant.retry_at = None
                    grant.slots = 0  # leases are asked for again, in flight first
                    grant.sent.clear()  # unanswered requests: dropped by the runtime
                    grant.want_slots = grant.used
                    grant.idle_at = _NEVER
                return [g.entry for g in self.grants.values() if g.entry is not None]
            case ClockTicked() if self.fallback is not None and self.fallback.until <= now \
                    and self.fallback.until > 0:
                self.fallback = replace(self.fallback, until=0.0)  # transition over: shares
                return [g.entry for g in self.grants.values() if g.entry is not None]
            case ClockTicked() if self.comeback is not None and self.comeback.until <= now:
                self._end_comeback()
                return [g.entry for g in self.grants.values() if g.entry is not None]
        return []

    def outbox(self, now: float) -> list[Command]:
        """The grant requests and lease returns to send after a step; none while fallen back."""
        if self.fallback is not None:
            return []
        hand_over, self.hand_over = self.hand_over, False
        if not (self.grants or self.returning):
            return [AcquireGrants(())] if hand_over else []
        requests = []
        returns = self.returning
        self.returning = []
        for key, grant in self.grants.items():
            entry = grant.entry
            if entry is None:  # not used since a reload: only its idle leases matter
                if grant.slots > grant.used and grant.idle_at + self.idle_s <= now:
                    grant.give_back(key, grant.slots - grant.used, returns)
                    grant.idle_at = _NEVER
                continue
            _, th = self._parts(entry)
            waiting = entry.waiting()
            if waiting:  # parked sub-queues visit nothing: ask on their behalf
                if th.concurrency is not None and grant.used + waiting > grant.slots:
                    grant.want_slots = max(grant.want_slots, grant.used + waiting)
                if th.rate is not None or th.connectinterval_s:
                    self._drop_stale(grant, now)
                    if len(grant.slot_ats) < waiting:
                        grant.want_pickups = max(grant.want_pickups, waiting)
            wants = grant.want_slots > grant.slots or grant.want_pickups > 0
            # Held leases, spare or busy: ask again now and then to learn our
            # share (others may want some now), and give back what is above
            # it as deliveries end.  A node busy on every lease it was granted
            # alone would otherwise keep them all while another waits.
            stale = (th.concurrency is not None and grant.slots > 0
                     and grant.answered_at + self.refresh_s <= now)
            if (not waiting and grant.slots > grant.used
                    and grant.idle_at + self.idle_s <= now):
                grant.give_back(key, grant.slots - grant.used, returns)
                grant.idle_at = _NEVER
            elif (wants or stale) and not grant.asked and (
                    grant.retry_at is None or grant.retry_at <= now or stale):
                pickups = grant.want_pickups
                if pickups:
                    if not grant.slot_ats:  # used every date it had: ask for more at once
                        grant.batch = min(self._batch_cap(th), grant.batch * 2)
                    pickups = max(pickups, grant.batch)
                requests.append(GrantRequest(
                    key, th.concurrency, th.rate, th.connectinterval_s or None,
                    max(grant.want_slots, grant.used), pickups, grant.used))
                grant.asked = True
                grant.sent.append(grant.returned)
                grant.want_slots = grant.want_pickups = 0
        out: list[Command] = []
        if returns:  # first: a request counts on the leases the store holds for us
            out.append(ReturnGrants(tuple(returns)))
        if requests or hand_over:
            out.append(AcquireGrants(tuple(requests)))
        return out

    def wakeup(self) -> float | None:
        """When a transition or come-back ends, idle leases go back, or a grant may be asked for."""
        times = []
        if self.fallback is not None and self.fallback.until > 0:
            times.append(self.fallback.until)  # the transition's end frees room
        if self.comeback is not None:
            times.append(self.comeback.until)
        for g in self.grants.values():
            if g.slots > g.used and g.idle_at < _NEVER:
                times.append(g.idle_at + self.idle_s)  # an idle lease to give back
            if g.slots > 0 and g.entry is not None and not g.asked:
                times.append(g.answered_at + self.refresh_s)  # our share to learn
            if g.retry_at is not None and g.entry is not None and g.entry.waiting():
                times.append(g.retry_at)  # ask again on behalf of waiters
        return min(times, default=None)
