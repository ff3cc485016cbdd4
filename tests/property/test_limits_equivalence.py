"""The two implementations of the limits seam decide alike (hypothesis).

Two schedulers, one with ReferenceLimits (the policy evaluated afresh at
every question) and one with GroupedLimits (compiled, cached, counted in
rows), are driven through the same random events: jobs queued for routes
with source IP pools, MX groups and tenants; deliveries finishing, some
with failed connections; time passing, often exactly to the next
wake-up; suspensions added (with expiries) and lifted; policies reloaded;
conditions added at run time with expiries and removed, among them
conditions on patterns that pool the hosts they match into one entry
(also on one of two counters over the same field); operators taking
entries away.  After every step both must have given the same commands
and the same next wake-up, and must explain every queued recipient alike.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from sluice.model import Delivered, Reply, TempFail
from sluice.scheduler import (
    Command,
    Condition,
    ConditionAdded,
    ConditionRemoved,
    DeliveryFinished,
    DeliveryJob,
    EntriesModified,
    Event,
    GroupedLimits,
    JobsQueued,
    PolicyReloaded,
    Rate,
    ReferenceLimits,
    Route,
    Scheduler,
    Settings,
    StartDelivery,
    Suspension,
    SuspensionAdded,
    SuspensionRemoved,
    Thresholds,
    parse_policy,
)

pytestmark = pytest.mark.property

OK = Delivered(Reply(250, "2.0.0", "ok"))
FAIL = TempFail(Reply(421, "4.4.1", "connection refused"))
IP1, IP2 = "192.0.2.1", "192.0.2.2"

GOOGLE = {"google": ["*.google.com"]}
POLICIES = [
    [{"id": "ip", "fields": ["localip"], "concurrency": 3}],
    [{"id": "ipdom", "fields": ["localip", "recipientdomain"],
      "if": {"recipientdomain": "a.example", "concurrency": 1}, "concurrency": 2},
     {"id": "all", "concurrency": 5}],
    [{"id": "mx", "fields": [{"remotemx": GOOGLE}],
      "if": {"remotemx": "#google", "rate": "3/10"}, "concurrency": 2},
     {"id": "mx2", "fields": [{"remotemx": GOOGLE}], "rate": "5/4", "connectinterval": 0.5}],
    [{"id": "dom", "fields": ["recipientdomain"], "rate": "2/5", "connectinterval": 1},
     {"id": "tenant", "fields": ["tenantid"], "concurrency": 2},
     {"id": "tenant2", "fields": ["tenantid"], "rate": "4/20"}],
    [{"id": "iptenant", "fields": ["localip", "tenantid"], "concurrency": 1, "rate": "4/20"},
     {"id": "dom", "fields": ["recipientdomain"], "rate": "3/5"}],
    [{"id": "dom", "fields": ["recipientdomain"], "rate": "3/30", "concurrency": 3},
     {"id": "tenant", "fields": ["tenantid"], "connectinterval": 2}],
    [{"id": "mxa", "fields": ["remotemx"], "concurrency": 2},
     {"id": "mxb", "fields": ["remotemx"], "rate": "3/5"},
     {"id": "ipmx", "fields": ["localip", "remotemx"],
      "if": {"remotemx": "*.google.com", "concurrency": 1}, "concurrency": 3}],
]

DOMAINS = [("a.example", "mx.a.example"), ("b.example", "mx.b.example"),
           ("gmail.com", "alt1.gmail-smtp-in.l.google.com"),
           ("googlemail.com", "aspmx.l.google.com")]
POOLS = [(), (IP1,), (IP2,), (IP1, IP2)]
SUSPENSIONS = [
    (("localip", IP1),),
    (("localip", IP2), ("recipientdomain", "gmail.com")),
    (("recipientdomain", "b.example"),),
    (("tenantid", "t2"), ("recipientdomain", "a.example")),
]
CONDITIONS = [
    (("recipientdomain", "gmail.com"), Thresholds(concurrency=1, rate=Rate(1, 5))),
    (("tenantid", "t1"), Thresholds(rate=Rate(2, 10))),
    (("localip", IP1), Thresholds(concurrency=1)),
    (("remotemx", "#google"), Thresholds(connectinterval_s=3)),
    (("remotemx", "*.google.com"), Thresholds(concurrency=1, rate=Rate(2, 5))),
    (("remotemx", "/\\.example$/"), Thresholds(rate=Rate(1, 4))),
    (("recipientdomain", "*.example"), Thresholds(concurrency=2)),
    (("tenantid", "t*"), Thresholds(rate=Rate(3, 10), connectinterval_s=1)),
]

routes = st.builds(
    lambda d, pool, tenant, p: (Route(d[0], tenantid=tenant, localip=pool, remotemx=d[1]), p),
    st.sampled_from(DOMAINS), st.sampled_from(POOLS), st.sampled_from(["t1", "t2"]),
    st.integers(0, 1))


class Twins(RuleBasedStateMachine):
    """Two schedulers that must never disagree."""

    def __init__(self) -> None:
        super().__init__()
        self.now = 0.0
        self.ids = itertools.count(1)
        self.ref = Scheduler(limits=ReferenceLimits())
        self.fast = Scheduler(limits=GroupedLimits())
        self.inflight: dict[str, StartDelivery] = {}
        self.queued: set[str] = set()
        self.conditions: list[tuple[str, str]] = []
        self.suspensions: set[str] = set()

    @initialize(policy=st.sampled_from(POLICIES), initial=st.integers(1, 3),
                capacity=st.integers(2, 8))
    def start(self, policy: list[dict[str, object]], initial: int, capacity: int) -> None:
        s = Settings(max_deliveries=capacity, initial_destination_concurrency=initial,
                     default_destination_concurrency_limit=4, dead_destination_ttl_s=30,
                     destination_cache_size=2, maxmemoryqueue=40)
        self.ref = Scheduler(s, parse_policy(policy), limits=ReferenceLimits())
        self.fast = Scheduler(s, parse_policy(policy), limits=GroupedLimits())

    def both(self, events: Sequence[Event]) -> None:
        a = self.ref.handle_all(events, self.now)
        b = self.fast.handle_all(events, self.now)
        assert a == b, f"the implementations disagree:\n{a}\n{b}"
        self.apply(a)

    def apply(self, commands: Sequence[Command]) -> None:
        for cmd in commands:
            if isinstance(cmd, StartDelivery):
                self.inflight[cmd.job.ref] = cmd
                self.queued.difference_update(cmd.qids)
            elif hasattr(cmd, "qids"):
                self.queued.difference_update(cmd.qids)  # deferred: gone from memory

    @rule(route=routes, n=st.integers(1, 4), rcpts=st.integers(1, 2))
    def queue_jobs(self, route: tuple[Route, int], n: int, rcpts: int) -> None:
        jobs = []
        for _ in range(n):
            i = next(self.ids)
            spid = f"{i:08X}"
            qids = tuple(f"{spid}-{k}" for k in range(rcpts))
            self.queued.update(qids)
            jobs.append(DeliveryJob(f"j{i}", spid, qids, route[0], route[1]))
        self.both([JobsQueued(tuple(jobs))])

    @precondition(lambda self: self.inflight)
    @rule(data=st.data(), failed=st.booleans(), batch=st.integers(1, 3))
    def finish(self, data: st.DataObject, failed: bool, batch: int) -> None:
        refs = data.draw(st.lists(st.sampled_from(sorted(self.inflight)), min_size=1,
                                  max_size=batch, unique=True))
        events = []
        for ref in refs:
            cmd = self.inflight.pop(ref)
            outcome = FAIL if failed else OK
            events.append(DeliveryFinished(ref, tuple((q, outcome) for q in cmd.qids),
                                           connection_failed=failed, localip=cmd.localip))
        self.both(events)

    @rule(dt=st.sampled_from([0.0, 0.5, 1.0, 2.5, 5.0, 11.0]), to_wakeup=st.booleans())
    def advance(self, dt: float, to_wakeup: bool) -> None:
        wake = self.ref.next_wakeup()
        assert wake == self.fast.next_wakeup()
        if to_wakeup and wake is not None and wake > self.now:
            self.now = wake
        else:
            self.now += dt
        a, b = self.ref.tick(self.now), self.fast.tick(self.now)
        assert a == b, f"the implementations disagree:\n{a}\n{b}"
        self.apply(a)

    @rule(fields=st.sampled_from(SUSPENSIONS), ttl=st.sampled_from([None, 3.0, 20.0]))
    def suspend(self, fields: tuple[tuple[str, str], ...], ttl: float | None) -> None:
        susp = Suspension(fields, expires_at=None if ttl is None else self.now + ttl)
        self.suspensions.add(susp.id)
        self.both([SuspensionAdded(susp)])

    @precondition(lambda self: self.suspensions)
    @rule(data=st.data())
    def lift(self, data: st.DataObject) -> None:
        sid = data.draw(st.sampled_from(sorted(self.suspensions)))
        self.suspensions.discard(sid)
        self.both([SuspensionRemoved(sid)])

    @rule(policy=st.sampled_from(POLICIES))
    def reload(self, policy: list[dict[str, object]]) -> None:
        self.conditions = []
        self.both([PolicyReloaded(parse_policy(policy))])

    @rule(data=st.data(), ttl=st.sampled_from([None, 4.0, 15.0]), position=st.integers(0, 1))
    def add_condition(self, data: st.DataObject, ttl: float | None, position: int) -> None:
        counters = self.ref.policy.counters
        (name, value), th = data.draw(st.sampled_from(CONDITIONS))
        fitting = [c for c in counters if name in c.field_names]
        if not fitting:
            return
        counter = data.draw(st.sampled_from(fitting))
        cid = f"r{next(self.ids)}"
        cond = Condition(((name, value),), th, cid, None if ttl is None else self.now + ttl)
        self.conditions.append((counter.id, cid))
        self.both([ConditionAdded(counter.id, cond, position)])

    @precondition(lambda self: self.conditions)
    @rule(data=st.data())
    def remove_condition(self, data: st.DataObject) -> None:
        counter_id, cid = data.draw(st.sampled_from(self.conditions))
        self.conditions.remove((counter_id, cid))
        self.both([ConditionRemoved(counter_id, cid)])

    @precondition(lambda self: self.queued)
    @rule(data=st.data())
    def operator_takes(self, data: st.DataObject) -> None:
        qid = data.draw(st.sampled_from(sorted(self.queued)))
        self.queued.discard(qid)
        self.both([EntriesModified((qid,))])

    @invariant()
    def they_explain_alike(self) -> None:
        assert self.ref.next_wakeup() == self.fast.next_wakeup()
        for qid in sorted(self.queued)[:6]:
            assert self.ref.explain(qid) == self.fast.explain(qid)
        assert self.ref.stats().queued_jobs == self.fast.stats().queued_jobs


TestLimitsEquivalence = Twins.TestCase
TestLimitsEquivalence.settings = settings(
    max_examples=80, stateful_step_count=40, deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
)
