"""Rate windows: X pickups in any Y seconds, at the window's edge too, across reloads.

The scheduler keeps the pickup times of each counter entry (a row of
sluice.scheduler.limits_grouped for counters over the same fields).  These
tests hold it to the semantics of a log per entry: no window of Y seconds
holds more than X pickups of an entry, one more goes as soon as a window
allows it (at the window's edge too), counts are shared by counters over
other fields exactly as the deliveries are, and a reload keeps what the old
windows hold.
"""

from __future__ import annotations

import itertools
import random
from collections import defaultdict
from collections.abc import Sequence

import pytest

from sluice.model import Delivered, Reply
from sluice.scheduler import (
    Command,
    DeliveryFinished,
    DeliveryJob,
    JobsQueued,
    PolicyReloaded,
    Route,
    Scheduler,
    Settings,
    StartDelivery,
    parse_policy,
)
from sluice.scheduler.limits_grouped import GroupedLimits
from sluice.scheduler.scheduler import Scheduler as CoreScheduler

pytestmark = pytest.mark.unit

OK = Delivered(Reply(250, "2.0.0", "ok"))
_ids = itertools.count(1)


def job(route: Route) -> DeliveryJob:
    i = next(_ids)
    spid = f"R{i:07X}"
    return DeliveryJob(f"rjob{i}", spid, (f"{spid}-0",), route)


def starts(commands: Sequence[Command]) -> list[StartDelivery]:
    return [c for c in commands if isinstance(c, StartDelivery)]


def done(sched: Scheduler, sent: Sequence[StartDelivery], now: float) -> list[StartDelivery]:
    events = [DeliveryFinished(s.job.ref, ((s.qids[0], OK),)) for s in sent]
    return starts(sched.handle_all(events, now))


def sched_for(policy: object) -> CoreScheduler:
    return CoreScheduler(Settings(max_deliveries=100_000, maxmemoryqueue=100_000,
                                  initial_destination_concurrency=1000,
                                  default_destination_concurrency_limit=1000),
                         parse_policy(policy))


def test_a_rate_lets_x_through_per_window_and_one_more_at_the_edge() -> None:
    # 4/10: the fourth pickup fills the window.
    sched = sched_for([{"fields": ["recipientdomain"], "rate": "4/10"}])
    route = Route("example.com")
    first = starts(sched.handle(JobsQueued(tuple(job(route) for _ in range(2))), 0))
    assert len(first) == 2
    assert [v.rate_used for v in sched.counters()] == [2]
    more = starts(sched.handle(JobsQueued(tuple(job(route) for _ in range(9))), 3))
    assert len(more) == 2
    assert sched.next_wakeup() == 10  # the pickups at 0 leave the window (0, 10] then
    assert done(sched, first + more, 9.999) == []
    assert len(starts(sched.tick(10))) == 2
    assert sched.next_wakeup() == 13
    assert starts(sched.tick(12.5)) == []
    assert len(starts(sched.tick(13))) == 2


def test_an_entry_shared_by_two_sub_queues_counts_the_pickups_of_both() -> None:
    sched = sched_for([{"fields": ["tenantid"], "rate": "5/10"},
                       {"fields": ["recipientdomain"], "rate": "1000/10"}])
    a = Route("a.example", tenantid="t1")
    b = Route("b.example", tenantid="t1")
    assert len(starts(sched.handle(JobsQueued(tuple(job(a) for _ in range(2))), 0))) == 2
    # b shares the tenant's entry, which has a's two pickups.
    assert len(starts(sched.handle(JobsQueued(tuple(job(b) for _ in range(9))), 1))) == 3
    used = {(v.counter, v.key[0][1]): v.rate_used for v in sched.counters()}
    assert used == {("tenantid", "t1"): 5, ("recipientdomain", "a.example"): 2,
                    ("recipientdomain", "b.example"): 3}
    assert sched.next_wakeup() == 10
    assert len(starts(sched.tick(10))) == 2  # a's two left the window
    assert len(starts(sched.tick(11))) == 3


def test_a_reload_keeps_the_window_of_an_unchanged_counter() -> None:
    policy = [{"id": "t", "fields": ["tenantid"], "rate": "6/60"}]
    sched = sched_for(policy)
    route = Route("example.com", tenantid="t1")
    sent = starts(sched.handle(JobsQueued(tuple(job(route) for _ in range(2))), 0))
    assert len(sent) == 2
    sched.handle(PolicyReloaded(parse_policy(policy)), 1)
    assert [v.rate_used for v in sched.counters()] == [2]
    assert len(starts(sched.handle(JobsQueued(tuple(job(route) for _ in range(9))), 2))) == 4
    assert sched.next_wakeup() == 60


def test_a_reload_that_lengthens_a_window_carries_the_old_windows_pickups() -> None:
    # Documented: a kept entry keeps the pickups its old window holds; a
    # longer window counts those, not older ones.
    sched = sched_for([{"id": "t", "fields": ["tenantid"], "rate": "50/1"}])
    route = Route("example.com", tenantid="t1")
    sent = starts(sched.handle(JobsQueued(tuple(job(route) for _ in range(3))), 0))
    done(sched, sent, 0)
    sent = starts(sched.handle(JobsQueued(tuple(job(route) for _ in range(2))), 5))
    sched.handle(PolicyReloaded(parse_policy([{"id": "t", "fields": ["tenantid"],
                                              "rate": "4/60"}])), 5.5)
    assert [v.rate_used for v in sched.counters()] == [2]  # those at 5, not those at 0
    assert len(starts(sched.handle(JobsQueued(tuple(job(route) for _ in range(9))), 6))) == 2


def test_an_entry_keeps_only_the_pickup_times_of_its_window() -> None:
    sched = sched_for([{"fields": ["recipientdomain"], "rate": "100000/2", "concurrency": 10}])
    route = Route("example.com")
    now = 0.0
    sent = starts(sched.handle(JobsQueued(tuple(job(route) for _ in range(5000))), now))
    for _ in range(400):
        now += 0.05
        sent = done(sched, sent, now)
        assert len(sent) == 10
    limits = sched._limits
    assert isinstance(limits, GroupedLimits)
    (table,) = limits.tables
    (row,) = table.rows.values()
    assert len(row.times) <= 10 * (2 / 0.05 + 1)  # one window's pickups, not 4000


@pytest.mark.parametrize("seed", range(12))
def test_random_traffic_never_exceeds_a_rate_and_never_idles(seed: int) -> None:
    """Against a log per entry: after every call, no entry has more than X
    pickups in any Y-second window, and every sub-queue with mail is held
    by an entry whose window is full (capacity is never the limit here)."""
    rnd = random.Random(seed)
    per = rnd.choice([1.0, 2.5, 10.0])
    counters: list[dict[str, object]] = [
        {"id": "tenant", "fields": ["tenantid"], "rate": f"{rnd.choice([4, 30, 400])}/{per}"},
        {"id": "domain", "fields": ["recipientdomain"], "rate": f"{rnd.choice([3, 50])}/{per}"},
        {"id": "all", "rate": f"{rnd.choice([20, 10_000])}/{per}"},
    ]
    if rnd.random() < 0.5:  # mixed windows in one group
        counters.append({"id": "burst", "fields": ["tenantid"], "rate": f"2/{per / 5}"})
    policy = parse_policy(counters)
    sched = CoreScheduler(Settings(max_deliveries=100_000, maxmemoryqueue=100_000,
                                   initial_destination_concurrency=1000,
                                   default_destination_concurrency_limit=1000), policy)
    routes = [Route(f"d{i}.example", tenantid=f"t{i % 3}") for i in range(8)]
    picks: dict[tuple[str, str], list[float]] = defaultdict(list)
    queued: dict[Route, int] = defaultdict(int)
    inflight: list[StartDelivery] = []
    now = 0.0

    def key(counter: str, route: Route) -> str:
        return {"tenant": route.tenantid, "burst": route.tenantid,
                "domain": route.recipientdomain, "all": ""}[counter]

    def take(sent: Sequence[StartDelivery]) -> None:
        for s in sent:
            queued[s.job.route] -= 1
            for c in policy.counters:
                picks[(c.id, key(c.id, s.job.route))].append(now)
        inflight.extend(sent)

    def full(route: Route) -> bool:
        for c in policy.counters:
            rate = c.default.rate
            assert rate is not None
            times = picks[(c.id, key(c.id, route))]
            if sum(1 for t in times if t + rate.per_s > now) >= rate.count:
                return True
        return False

    for _ in range(150):
        step = rnd.random()
        if step < 0.35:
            new = [job(rnd.choice(routes)) for _ in range(rnd.randint(1, 30))]
            for j in new:
                queued[j.route] += 1
            take(starts(sched.handle(JobsQueued(tuple(new)), now)))
        elif step < 0.6 and inflight:
            rnd.shuffle(inflight)
            k = rnd.randint(1, len(inflight))
            finished, inflight[:] = inflight[:k], inflight[k:]
            take(done(sched, finished, now))
        else:
            # Often exactly to a window's edge, where a pickup leaves it.
            wake = sched.next_wakeup()
            now = wake if wake is not None and rnd.random() < 0.5 else \
                now + rnd.choice([0.0, per / 4, per / 2, per])
            take(starts(sched.tick(now)))
        for c in policy.counters:
            rate = c.default.rate
            assert rate is not None
            for (cid, k), times in picks.items():
                if cid == c.id:
                    for a, b in zip(times, times[rate.count:], strict=False):
                        # As the scheduler adds (see limits.slot_at): a + Y is
                        # when a leaves the window.
                        assert a + rate.per_s <= b, f"{cid} {k}: {rate} exceeded"
        for route, n in queued.items():
            if n:
                assert full(route), f"{route.recipientdomain} could go at {now} but waits"
        views = {(v.counter, v.key[0][1] if v.key else ""): v.rate_used
                 for v in sched.counters()}
        for (cid, k), times in picks.items():
            rate = policy.counter(cid).default.rate
            assert rate is not None
            assert views.get((cid, k), 0) == sum(1 for t in times if t + rate.per_s > now)
