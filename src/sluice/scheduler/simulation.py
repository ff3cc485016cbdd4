"""A policy simulator: the real scheduler on a simulated clock and network.

SUMMARY
    scenario = parse_scenario(data, source)
    report = Simulation(scenario).run()

DESCRIPTION
    A discrete-event simulation, with no sleeping and no I/O: simulated
    traffic arrives per tenant and job into a simulated store; the store
    answers the scheduler's Refill as the real stores do (quota_deferred,
    tenants by weight; sluice.scheduler.simulated_store);
    the scheduler (sluice.scheduler.Scheduler, unchanged) picks deliveries;
    simulated destinations answer after a latency, and may throttle (421
    after N per minute, or beyond N connections), greylist (451 until the
    message is retried after a delay), fail at random, or be dead for
    periods (the connection fails).  Temporary failures are retried with
    sluice.retry's rules, as the real queue does.  Operators can act
    during a run (suspend, lift).

    The report gives, per destination and per tenant: throughput, peak
    concurrency against its limit, queue wait (arrival to the pickup that
    delivered it) at p50/p95/p99, and time to drain (from the start of
    the run until its last message left the queue).

STRATEGIES
    Time moves in ticks of ``resolution_s``; everything due in one tick is
    handed to the scheduler in one handle_all() call, which keeps a
    million messages within seconds.  Arrivals are generated per tick,
    not per message.  A seeded generator makes every run repeatable.

LIMITATIONS
    One recipient per message.  Latency is uniform around its mean.  The
    destination's per-minute counter is a fixed minute, not a sliding
    window.  Wait times are measured at tick resolution.

SEE ALSO
    `sluice simulate SCENARIO.yaml`, examples/scenarios/, docs/scheduler.md
"""

from __future__ import annotations

import gc
import heapq
import math
import random
from array import array
from bisect import bisect_left
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from sluice.model import Delivered, Outcome, PermFail, Reply, TempFail
from sluice.scheduler.events import (
    Command,
    DeferJob,
    DeliveryFinished,
    DeliveryJob,
    EntriesClaimed,
    Event,
    JobsQueued,
    MailArrived,
    Refill,
    Route,
    StartDelivery,
    SuspensionAdded,
    SuspensionRemoved,
)
from sluice.scheduler.policy import (
    Suspension,
)
from sluice.scheduler.scenario import (
    DestinationSpec,
    FlowSpec,
    OperatorAction,
    Scenario,
    ScenarioError,
    parse_scenario,
)
from sluice.scheduler.scheduler import Scheduler
from sluice.scheduler.simulated_store import SimStore

__all__ = [
    "DestinationSpec",
    "FlowSpec",
    "GroupReport",
    "OperatorAction",
    "Scenario",
    "ScenarioError",
    "Simulation",
    "SimulationReport",
    "parse_scenario",
]


# --------------------------------------------------------------------------
# The report.


@dataclass(frozen=True, slots=True)
class GroupReport:
    """Figures for one destination or tenant."""

    name: str
    messages: int
    delivered: int
    bounced: int
    deferrals: int
    throughput_per_s: float
    peak_concurrency: int
    limit: int | None
    wait_p50_s: float | None
    wait_p95_s: float | None
    wait_p99_s: float | None
    drain_s: float | None

    def to_data(self) -> dict[str, Any]:
        """The group's figures as plain data."""
        return {name: getattr(self, name) for name in GroupReport.__dataclass_fields__}


@dataclass(frozen=True, slots=True)
class SimulationReport:
    """What a simulation measured: outcomes, deferrals, and figures per destination and tenant."""
    name: str
    messages: int
    delivered: int
    bounced: int
    deferrals: int
    cache_deferrals: int
    pickups: int
    handle_calls: int
    simulated_s: float
    drained: bool
    remaining: int
    peak_memory: int
    maxmemoryqueue: int
    peak_inflight: int
    max_deliveries: int
    destinations: tuple[GroupReport, ...]
    tenants: tuple[GroupReport, ...]

    def to_data(self) -> dict[str, Any]:
        """The report as plain data, its destinations and tenants included."""
        out: dict[str, Any] = {name: getattr(self, name)
                               for name in SimulationReport.__dataclass_fields__}
        out["destinations"] = [d.to_data() for d in self.destinations]
        out["tenants"] = [t.to_data() for t in self.tenants]
        return out


# --------------------------------------------------------------------------
# The engine.


class _Msg:
    __slots__ = ("arrival_at", "attempts", "dest", "first_try_at", "flow", "qid", "started_at")

    def __init__(self, qid: str, flow: int, dest: int, arrival_at: float) -> None:
        self.qid = qid
        self.flow = flow
        self.dest = dest
        self.arrival_at = arrival_at
        self.attempts = 0
        self.first_try_at = -1.0
        self.started_at = 0.0


class _Group:
    __slots__ = ("bounced", "deferrals", "delivered", "first_at", "inflight", "last_at", "limit",
                 "messages", "name", "peak", "waits")

    def __init__(self, name: str) -> None:
        self.name = name
        self.messages = 0
        self.delivered = 0
        self.bounced = 0
        self.deferrals = 0
        self.inflight = 0
        self.peak = 0
        self.first_at = math.inf
        self.last_at = -math.inf
        self.limit: int | None = None
        self.waits = array("d")

    def report(self) -> GroupReport:
        waits = sorted(self.waits)

        def pct(p: float) -> float | None:
            if not waits:
                return None
            return waits[min(len(waits) - 1, max(0, math.ceil(p * len(waits)) - 1))]

        done = self.delivered + self.bounced
        span = self.last_at - self.first_at if done else 0.0
        return GroupReport(
            name=self.name, messages=self.messages, delivered=self.delivered,
            bounced=self.bounced, deferrals=self.deferrals,
            throughput_per_s=(self.delivered / span) if span > 0 else float(self.delivered),
            peak_concurrency=self.peak, limit=self.limit,
            wait_p50_s=pct(0.50), wait_p95_s=pct(0.95), wait_p99_s=pct(0.99),
            drain_s=self.last_at if done == self.messages and done else None,
        )


_OK = Delivered(Reply(250, "2.0.0", "ok"))
_GREY = TempFail(Reply(451, "4.7.1", "greylisted, try again later"))
_THROTTLED = TempFail(Reply(421, "4.7.0", "too many messages this minute, slow down"))
_TOO_MANY = TempFail(Reply(421, "4.7.0", "too many connections"))
_REFUSED = TempFail(Reply(421, "4.4.1", "connection refused"))
_TEMP = TempFail(Reply(450, "4.2.0", "mailbox busy"))
_PERM = PermFail(Reply(550, "5.1.1", "no such user"))

# Heap item kinds.
_ARRIVE = 0
_DONE = 1
_ACT = 2


class _Dest:
    __slots__ = ("dead", "group", "inflight", "minute", "minute_count", "spec")

    def __init__(self, spec: DestinationSpec, group: _Group) -> None:
        self.spec = spec
        self.group = group
        self.inflight = 0
        self.minute = -1
        self.minute_count = 0
        self.dead = spec.dead


class Simulation:
    """One run of a scenario; run() returns the report."""

    def __init__(self, scenario: Scenario) -> None:
        self.scenario = scenario
        self.rng = random.Random(scenario.seed)
        self.scheduler = Scheduler(scenario.settings, scenario.policy)
        self.dests = [_Dest(spec, _Group(spec.domain)) for spec in scenario.destinations]
        self.by_domain = {d.spec.domain: i for i, d in enumerate(self.dests)}
        self.tenants: dict[str, _Group] = {}
        for flow in scenario.flows:
            self.tenants.setdefault(flow.tenant, _Group(flow.tenant))
        self.flow_groups = [self.tenants[f.tenant] for f in scenario.flows]
        self.routes: dict[tuple[int, int], Route] = {}
        # Per flow: destination indexes and cumulative weights to draw from.
        self.choices: list[tuple[list[int], list[float]]] = []
        for flow in scenario.flows:
            idx = ([self.by_domain[d] for d in flow.destinations] if flow.destinations
                   else list(range(len(self.dests))))
            weights = []
            for rank, i in enumerate(idx):
                w = self.dests[i].spec.weight
                if scenario.zipf:
                    w /= (rank + 1) ** scenario.zipf
                weights.append(w)
            cum: list[float] = []
            total = 0.0
            for w in weights:
                total += w
                cum.append(total)
            self.choices.append((idx, cum))
        self.store: SimStore[_Msg] = SimStore(scenario)
        self.messages: dict[str, _Msg] = {}
        self.heap: list[tuple[int, int, int, Any]] = []
        self.seq = 0
        self.next_id = 0
        self.left = [f.messages for f in scenario.flows]
        self.delivered = 0
        self.bounced = 0
        self.deferrals = 0
        self.cache_deferrals = 0
        self.handle_calls = 0
        self.peak_memory = 0
        self.peak_inflight = 0
        self.inflight = 0
        self.ticks = 0

    # -- helpers ------------------------------------------------------------

    def _tick(self, at: float) -> int:
        return math.ceil(at / self.scenario.resolution_s - 1e-9)

    def _push(self, tick: int, kind: int, payload: Any) -> None:
        self.seq += 1
        heapq.heappush(self.heap, (tick, self.seq, kind, payload))

    def _route(self, flow_i: int, dest_i: int) -> Route:
        key = (flow_i, dest_i)
        route = self.routes.get(key)
        if route is None:
            flow = self.scenario.flows[flow_i]
            spec = self.dests[dest_i].spec
            route = Route(spec.domain, tenantid=flow.tenant, jobid=flow.jobid,
                          transportid=flow.transportid, localip=flow.localip,
                          remoteip=spec.remoteip, remotemx=spec.mx)
            self.routes[key] = route
        return route

    # -- the store ------------------------------------------------------------

    def _defer(self, msg: _Msg, now: float, reply: Reply) -> None:
        msg.attempts += 1
        at = self.scenario.retry.next_attempt_at(now, msg.attempts, msg.arrival_at)
        if at is None:
            self._bounce(msg, now)
            return
        self.deferrals += 1
        self.dests[msg.dest].group.deferrals += 1
        self.flow_groups[msg.flow].deferrals += 1
        self.seq += 1
        self.store.defer(msg.flow, at, self.seq, msg)

    def _bounce(self, msg: _Msg, now: float) -> None:
        self.bounced += 1
        del self.messages[msg.qid]
        for group in (self.dests[msg.dest].group, self.flow_groups[msg.flow]):
            group.bounced += 1
            group.last_at = max(group.last_at, now)

    def _deliver(self, msg: _Msg, now: float) -> None:
        self.delivered += 1
        del self.messages[msg.qid]
        wait = msg.started_at - msg.arrival_at
        for group in (self.dests[msg.dest].group, self.flow_groups[msg.flow]):
            group.delivered += 1
            group.last_at = max(group.last_at, now)
            group.waits.append(wait)

    # -- the network ------------------------------------------------------------

    def _attempt(self, msg: _Msg, now: float) -> tuple[float, Outcome, bool]:
        """(latency, outcome, connection_failed) of one delivery started now."""
        dest = self.dests[msg.dest]
        spec = dest.spec
        rng = self.rng
        for start, until in dest.dead:
            if start <= now < until:
                return spec.connect_timeout_s, _REFUSED, True
        latency = spec.latency_s * (1.0 + spec.jitter * (2.0 * rng.random() - 1.0))
        if spec.max_concurrency is not None and dest.inflight >= spec.max_concurrency:
            return latency * 0.2, _TOO_MANY, True
        if spec.max_per_minute is not None:
            minute = int(now // 60)
            if minute != dest.minute:
                dest.minute = minute
                dest.minute_count = 0
            if dest.minute_count >= spec.max_per_minute:
                return latency * 0.2, _THROTTLED, True
            dest.minute_count += 1
        if spec.greylist_s is not None:
            if msg.first_try_at < 0:
                msg.first_try_at = now
            if now - msg.first_try_at < spec.greylist_s:
                return latency, _GREY, False
        if spec.perm_fail_rate and rng.random() < spec.perm_fail_rate:
            return latency, _PERM, False
        if spec.temp_fail_rate and rng.random() < spec.temp_fail_rate:
            return latency, _TEMP, False
        return latency, _OK, False

    # -- the loop ---------------------------------------------------------------

    def _arrive(self, flow_i: int, tick: int) -> None:
        sc = self.scenario
        flow = sc.flows[flow_i]
        now = tick * sc.resolution_s
        n = min(self.left[flow_i], max(1, round(flow.rate_per_s * sc.arrival_tick_s)))
        self.left[flow_i] -= n
        idx, cum = self.choices[flow_i]
        total = cum[-1]
        rng = self.rng
        group = self.flow_groups[flow_i]
        group.messages += n
        group.first_at = min(group.first_at, now)
        incoming = self.store.new_mail(flow_i)
        messages = self.messages
        for _ in range(n):
            dest_i = idx[bisect_left(cum, rng.random() * total)] if len(idx) > 1 else idx[0]
            self.next_id += 1
            qid = f"{self.next_id:010X}-0"
            msg = _Msg(qid, flow_i, dest_i, now)
            messages[qid] = msg
            incoming.append(msg)
            dgroup = self.dests[dest_i].group
            dgroup.messages += 1
            if now < dgroup.first_at:
                dgroup.first_at = now
        if self.left[flow_i] > 0:
            self._push(self._tick(now + sc.arrival_tick_s), _ARRIVE, flow_i)

    def _carry_out(self, commands: list[Command], tick: int) -> Refill | None:
        sc = self.scenario
        now = tick * sc.resolution_s
        refill: Refill | None = None
        for cmd in commands:
            if isinstance(cmd, StartDelivery):
                msg = self.messages[cmd.qids[0]]
                msg.started_at = now
                latency, outcome, failed = self._attempt(msg, now)
                dest = self.dests[msg.dest]
                dest.inflight += 1
                group = dest.group
                group.inflight += 1
                if group.inflight > group.peak:
                    group.peak = group.inflight
                tgroup = self.flow_groups[msg.flow]
                tgroup.inflight += 1
                if tgroup.inflight > tgroup.peak:
                    tgroup.peak = tgroup.inflight
                self.inflight += 1
                if self.inflight > self.peak_inflight:
                    self.peak_inflight = self.inflight
                done = max(tick + 1, self._tick(now + latency))
                self._push(done, _DONE, (cmd.job.ref, msg, outcome, failed))
            elif isinstance(cmd, DeferJob):
                for qid in cmd.qids:
                    msg = self.messages[qid]
                    self.cache_deferrals += 1
                    self._defer(msg, now, cmd.reply)
            elif isinstance(cmd, Refill):
                refill = cmd
        return refill

    def _decide(self, events: list[Event], tick: int) -> None:
        sc = self.scenario
        now = tick * sc.resolution_s
        sched = self.scheduler
        self.handle_calls += 1
        refill = self._carry_out(sched.handle_all(events, now), tick)
        while refill is not None:
            claimed = self.store.claim(refill.limit, now, refill.quota_deferred)
            jobs = []
            for msg in claimed:
                jobs.append(DeliveryJob(msg.qid, msg.qid[:10], (msg.qid,),
                                        self._route(msg.flow, msg.dest),
                                        sc.flows[msg.flow].priority, msg.arrival_at))
            exhausted = len(claimed) < refill.limit
            self.handle_calls += 1
            due = self.store.due_at() if exhausted else None
            commands = sched.handle_all(
                (EntriesClaimed(len(claimed), exhausted, due), JobsQueued(tuple(jobs))), now)
            used = sched.memory_used
            if used > self.peak_memory:
                self.peak_memory = used
            refill = self._carry_out(commands, tick)

    def run(self) -> SimulationReport:
        """Run the scenario to its end and report, the cyclic garbage collector paused."""
        # The engine makes no garbage cycles worth collecting, and with a
        # million live messages each pass of the cyclic collector is costly:
        # pause it for the run (a quarter of the time on the 1M scenario).
        paused = gc.isenabled()
        gc.disable()
        try:
            return self._run()
        finally:
            if paused:
                gc.enable()

    def _run(self) -> SimulationReport:
        sc = self.scenario
        sched = self.scheduler
        for i, flow in enumerate(sc.flows):
            if flow.messages:
                self._push(self._tick(flow.start_s), _ARRIVE, i)
        for action in sc.actions:
            self._push(self._tick(action.at_s), _ACT, action)
        max_tick = self._tick(sc.max_time_s)
        heap = self.heap
        tick = 0
        while True:
            wake = sched.next_wakeup()
            next_tick = heap[0][0] if heap else None
            if wake is not None and self.messages:
                wake_tick = max(tick + 1, self._tick(wake))
                next_tick = wake_tick if next_tick is None else min(next_tick, wake_tick)
            if next_tick is None or next_tick > max_tick:
                break
            if not self.messages and not heap:
                break
            tick = next_tick
            now = tick * sc.resolution_s
            events: list[Event] = []
            arrived = False
            while heap and heap[0][0] == tick:
                _, _, kind, payload = heapq.heappop(heap)
                if kind == _DONE:
                    ref, msg, outcome, failed = payload
                    dest = self.dests[msg.dest]
                    dest.inflight -= 1
                    dest.group.inflight -= 1
                    self.flow_groups[msg.flow].inflight -= 1
                    self.inflight -= 1
                    events.append(DeliveryFinished(ref, ((msg.qid, outcome),), failed))
                    if isinstance(outcome, Delivered):
                        self._deliver(msg, now)
                    elif isinstance(outcome, PermFail):
                        self._bounce(msg, now)
                    else:
                        self._defer(msg, now, outcome.reply)
                elif kind == _ARRIVE:
                    self._arrive(payload, tick)
                    arrived = True
                else:
                    act: OperatorAction = payload
                    if act.suspend is not None:
                        susp = act.suspend
                        if act.ttl_s is not None:
                            susp = Suspension(susp.fields, susp.id, now + act.ttl_s,
                                              susp.tag, susp.reason)
                        events.append(SuspensionAdded(susp))
                    elif act.lift is not None:
                        events.append(SuspensionRemoved(act.lift))
            if arrived:
                events.append(MailArrived())
            due = self.store.due_at()
            if due is not None and due <= now:
                events.append(MailArrived())  # due deferred mail: the store has work
            self._decide(events, tick)
        self.ticks = tick
        return self._report(tick * sc.resolution_s)

    def _report(self, end: float) -> SimulationReport:
        sc = self.scenario
        views = {v.destination: v for v in self.scheduler.destinations()}
        for dest in self.dests:
            view = views.get(dest.spec.domain)
            if view is not None:
                dest.group.limit = view.limit
            elif dest.group.messages:
                dest.group.limit = self._dest_limit(dest.spec.domain)
        tenant_limits = self._tenant_limits()
        for name, group in self.tenants.items():
            group.limit = tenant_limits.get(name)
        dests = tuple(d.group.report() for d in self.dests if d.group.messages)
        return SimulationReport(
            name=sc.name, messages=sc.messages, delivered=self.delivered, bounced=self.bounced,
            deferrals=self.deferrals, cache_deferrals=self.cache_deferrals,
            pickups=self.scheduler.pickups, handle_calls=self.handle_calls, simulated_s=end,
            drained=not self.messages and all(n == 0 for n in self.left),
            remaining=len(self.messages) + sum(self.left), peak_memory=self.peak_memory,
            maxmemoryqueue=sc.settings.maxmemoryqueue, peak_inflight=self.peak_inflight,
            max_deliveries=sc.settings.max_deliveries, destinations=dests,
            tenants=tuple(g.report() for g in self.tenants.values()),
        )

    def _dest_limit(self, domain: str) -> int:
        """The window limit a destination would get (it left the scheduler's cache)."""
        probe = Scheduler(self.scenario.settings, self.scenario.policy)
        flows = [i for i, f in enumerate(self.scenario.flows)
                 if not f.destinations or domain in f.destinations]
        jobs = tuple(DeliveryJob(f"probe{i}", "0", (f"probe{i}-0",),
                                 self._route(i, self.by_domain[domain]))
                     for i in flows[:1])
        probe.handle(JobsQueued(jobs), 0.0)
        view = probe.destination(domain)
        return view.limit if view else self.scenario.settings.default_destination_concurrency_limit

    def _tenant_limits(self) -> dict[str, int]:
        """A tenant's limit: the concurrency of a counter over tenantid alone."""
        out: dict[str, int] = {}
        for counter in self.scenario.policy.counters:
            if counter.field_names != ("tenantid",):
                continue
            for name in self.tenants:
                thresholds, _ = counter.thresholds_for((name,))
                if thresholds.concurrency is not None:
                    out[name] = min(out.get(name, thresholds.concurrency),
                                    thresholds.concurrency)
        return out


def percentile(values: Sequence[float], p: float) -> float | None:
    """The p-quantile (nearest rank) of ``values``; None when empty."""
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, math.ceil(p * len(ordered)) - 1))]
