"""The scheduler against the specification's examples, one feature at a time (pure).

Every test drives Scheduler with events and a fake clock and looks at the
commands it returns; "sent" means a StartDelivery was issued.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence

import pytest

from sluice.model import Delivered, Reply, TempFail
from sluice.scheduler import (
    ClockTicked,
    Command,
    Condition,
    ConditionAdded,
    ConditionRemoved,
    DeferJob,
    DeliveryFinished,
    DeliveryJob,
    EntriesClaimed,
    EntriesModified,
    JobsQueued,
    MailArrived,
    PolicyReloaded,
    Refill,
    Route,
    Scheduler,
    Settings,
    StartDelivery,
    Suspension,
    SuspensionAdded,
    SuspensionRemoved,
    Thresholds,
    Waiting,
    parse_policy,
    pickup,
)
from sluice.scheduler.scheduler import Scheduler as CoreScheduler
from sluice.scheduler.tenants import Shares

pytestmark = pytest.mark.unit

OK = Delivered(Reply(250, "2.0.0", "ok"))
REFUSED = TempFail(Reply(421, "4.4.1", "connection refused"))
IP1, IP2 = "192.0.2.1", "192.0.2.2"
_ids = itertools.count(1)


def job(route: Route, priority: int = 0, n: int = 1) -> DeliveryJob:
    i = next(_ids)
    spid = f"{i:08X}"
    return DeliveryJob(f"job{i}", spid, tuple(f"{spid}-{k}" for k in range(n)), route, priority)


def starts(commands: Sequence[Command]) -> list[StartDelivery]:
    return [c for c in commands if isinstance(c, StartDelivery)]


def defers(commands: Sequence[Command]) -> list[DeferJob]:
    return [c for c in commands if isinstance(c, DeferJob)]


def finish(sched: Scheduler, start: StartDelivery, now: float, failed: bool = False
           ) -> list[Command]:
    outcome = REFUSED if failed else OK
    return sched.handle(DeliveryFinished(start.job.ref, tuple((q, outcome) for q in start.qids),
                                         connection_failed=failed), now)


def sched_for(policy: object = None, **settings: object) -> Scheduler:
    base: dict[str, object] = {"max_deliveries": 100_000, "initial_destination_concurrency": 1000,
                               "default_destination_concurrency_limit": 1000}
    base.update(settings)
    return Scheduler(Settings(**base), parse_policy(policy))  # type: ignore[arg-type]


# --------------------------------------------------------------------------
# Seed 004 section 2.3.1, one example at a time.


def test_seed_localip_10000_one_jammed_ip_does_not_disturb_the_other() -> None:
    sched = sched_for([{"fields": ["localip"], "concurrency": 10000}],
                      default_destination_concurrency_limit=100_000,
                      initial_destination_concurrency=100_000)
    jammed = Route("slow.example", localip=(IP1,))
    other = Route("fast.example", localip=(IP2,))
    first = starts(sched.handle(JobsQueued(tuple(job(jammed) for _ in range(10_001))), 0))
    assert len(first) == 10_000  # the 10 001st waits: the entry for IP1 is full
    later = starts(sched.handle(JobsQueued(tuple(job(other) for _ in range(50))), 1))
    assert len(later) == 50 and {s.localip for s in later} == {IP2}
    waiting = sched.explain(f"{next(_ids) - 51:08X}-0")
    assert waiting.reasons[-1].kind is Waiting.CONCURRENCY
    # One delivery from IP1 ends: exactly one more goes.
    assert len(starts(finish(sched, first[0], 2))) == 1


def test_seed_halon_io_two_from_the_same_source_ip() -> None:
    sched = sched_for([{"fields": ["localip", "recipientdomain"],
                        "if": {"recipientdomain": "halon.io", "concurrency": 2},
                        "concurrency": 5}])
    halon = Route("halon.io", localip=(IP1,))
    halon_other_ip = Route("halon.io", localip=(IP2,))
    other = Route("example.com", localip=(IP1,))
    sent = starts(sched.handle(JobsQueued(tuple(job(halon) for _ in range(4))
                                          + tuple(job(other) for _ in range(7))
                                          + tuple(job(halon_other_ip) for _ in range(3))), 0))
    by_domain_ip: dict[tuple[str, str], int] = {}
    for s in sent:
        key = (s.job.route.recipientdomain, s.localip)
        by_domain_ip[key] = by_domain_ip.get(key, 0) + 1
    assert by_domain_ip == {("halon.io", IP1): 2, ("example.com", IP1): 5, ("halon.io", IP2): 2}
    stats = {(dict(v.key)["recipientdomain"], dict(v.key)["localip"]): v for v in sched.counters()}
    assert stats[("halon.io", IP1)].exceeded and stats[("halon.io", IP1)].concurrency == 2
    assert stats[("example.com", IP1)].concurrency == 5


GROUPS = [
    {"fields": ["localip",
                {"remotemx": {"gsuite": ["*.google.com", "*.googlemail.com", "*.smtp.goog"]}}],
     "if": {"remotemx": "#gsuite", "concurrency": 10, "rate": 50},
     "concurrency": 5, "rate": 10},
    {"fields": ["localip", {"remotemx": {"o365": ["*.protection.outlook.com"]}}, "remoteip"],
     "if": {"remotemx": "#o365", "concurrency": 10, "rate": 30}},
]


def test_seed_gsuite_group_rolls_every_google_mx_into_one_entry() -> None:
    sched = sched_for(GROUPS)
    mxs = ["aspmx.l.google.com", "alt1.aspmx.l.google.com", "mx.smtp.goog",
           "gmail-smtp-in.l.googlemail.com"]
    jobs = [job(Route(f"d{i}.example", localip=(IP1,), remotemx=mxs[i % 4]))
            for i in range(40)]
    sent = starts(sched.handle(JobsQueued(tuple(jobs)), 0))
    assert len(sent) == 10  # concurrency 10 for #gsuite from one source IP, all MXs together
    for s in sent:
        finish(sched, s, 0.5)
    # 10 went in the first second; the rate (50/s) allows 40 more in that second.
    assert sched.counters()[0].rate_used == 20


def test_seed_gsuite_rate_50_per_second() -> None:
    sched = sched_for([{"fields": [{"remotemx": {"gsuite": ["*.google.com"]}}],
                        "if": {"remotemx": "#gsuite", "rate": 50}, "rate": 10}])
    route = Route("gmail.com", remotemx="alt2.gmail-smtp-in.l.google.com")
    sent = starts(sched.handle(JobsQueued(tuple(job(route) for _ in range(120))), 0))
    assert len(sent) == 50
    assert sched.next_wakeup() == pytest.approx(1.0)
    assert starts(sched.tick(0.99)) == []
    assert len(starts(sched.tick(1.0))) == 50
    assert len(starts(sched.tick(2.0))) == 20


def test_seed_non_google_mx_falls_back_to_5_and_10_per_mx() -> None:
    sched = sched_for(GROUPS)
    a = Route("a.example", localip=(IP1,), remotemx="mx.a.example")
    b = Route("b.example", localip=(IP1,), remotemx="mx.b.example")
    sent = starts(sched.handle(JobsQueued(tuple(job(a) for _ in range(8))
                                          + tuple(job(b) for _ in range(8))), 0))
    assert sum(s.job.route is a for s in sent) == 5
    assert sum(s.job.route is b for s in sent) == 5


def test_seed_o365_counter_only_limits_outlook_mxs() -> None:
    sched = sched_for(GROUPS[1:])
    outlook = Route("contoso.com", localip=(IP1,),
                    remotemx="contoso-com.mail.protection.outlook.com", remoteip="203.0.113.7")
    other = Route("example.com", localip=(IP1,), remotemx="mx.example.com", remoteip="198.51.100.1")
    sent = starts(sched.handle(JobsQueued(tuple(job(outlook) for _ in range(40))
                                          + tuple(job(other) for _ in range(40))), 0))
    assert sum(s.job.route is outlook for s in sent) == 10
    assert sum(s.job.route is other for s in sent) == 40  # no threshold: not limited
    assert len(sched.counters()) == 1  # only the Outlook entry is tracked


def test_seed_suspension_of_customer1_to_gmail() -> None:
    sched = sched_for()
    sched.handle(SuspensionAdded(Suspension((("transportid", "customer1"),
                                             ("recipientdomain", "gmail.com")))), 0)
    held = Route("gmail.com", transportid="customer1")
    other_domain = Route("yahoo.com", transportid="customer1")
    other_transport = Route("gmail.com", transportid="customer2")
    sent = starts(sched.handle(JobsQueued((job(held), job(other_domain), job(other_transport))),
                               1))
    assert [s.job.route for s in sent] == [other_domain, other_transport]
    (view,) = sched.suspensions()
    assert view.waiting_subqueues == 1 and not view.automatic
    # Lifting it lets the held one go.
    assert [s.job.route for s in starts(sched.handle(SuspensionRemoved(view.id), 2))] == [held]


def test_seed_pool_exclusion_sends_from_the_other_source_ip() -> None:
    sched = sched_for()
    sched.handle(SuspensionAdded(Suspension((("localip", IP1),
                                             ("recipientdomain", "gmail.com")))), 0)
    pool = Route("gmail.com", localip=(IP1, IP2))
    only_ip1 = Route("gmail.com", localip=(IP1,))
    ip1_elsewhere = Route("yahoo.com", localip=(IP1,))
    jobs = [job(pool) for _ in range(6)] + [job(only_ip1), job(ip1_elsewhere)]
    sent = starts(sched.handle(JobsQueued(tuple(jobs)), 1))
    assert sorted((s.job.route.recipientdomain, s.localip) for s in sent) == \
        [("gmail.com", IP2)] * 6 + [("yahoo.com", IP1)]
    waiting = sched.explain(f"{next(_ids) - 2:08X}-0")  # the only_ip1 job
    assert [r.kind for r in waiting.reasons] == [Waiting.SUSPENDED]


def test_a_pool_spreads_pickups_over_its_source_ips() -> None:
    sched = sched_for()
    route = Route("example.com", localip=(IP1, IP2))
    sent = starts(sched.handle(JobsQueued(tuple(job(route) for _ in range(6))), 0))
    assert [s.localip for s in sent] == [IP1, IP2] * 3


def test_a_pool_keeps_sending_from_whichever_source_ip_frees() -> None:
    # Found by the state machine: after a pickup from one IP, the sub-queue
    # must still wait for the other IP too, not only for the one it used.
    sched = sched_for([{"fields": ["localip"], "concurrency": 1}])
    route = Route("example.com", localip=(IP1, IP2))
    j1, j2 = starts(sched.handle(JobsQueued(tuple(job(route) for _ in range(4))), 0))
    assert (j1.localip, j2.localip) == (IP1, IP2)
    (j3,) = starts(finish(sched, j1, 1))
    assert j3.localip == IP1
    (j4,) = starts(finish(sched, j2, 2))
    assert j4.localip == IP2


def test_a_global_counter_limits_everything() -> None:
    sched = sched_for([{"concurrency": 3}])
    sent = starts(sched.handle(JobsQueued(tuple(job(Route(f"d{i}.example")) for i in range(9))),
                               0))
    assert len(sent) == 3


def test_connectinterval_spaces_pickups() -> None:
    sched = sched_for([{"fields": ["recipientdomain"], "connectinterval": 2}])
    route = Route("example.com")
    assert len(starts(sched.handle(JobsQueued(tuple(job(route) for _ in range(3))), 10))) == 1
    assert sched.next_wakeup() == 12
    assert starts(sched.tick(11.9)) == []
    assert len(starts(sched.tick(12))) == 1
    (view,) = sched.counters()
    assert view.next_connect_at == 14


def test_rate_with_an_interval_never_exceeds_x_in_any_window() -> None:
    sched = sched_for([{"fields": ["recipientdomain"], "rate": "3/10"}])
    route = Route("example.com")
    times: list[float] = []
    now = 0.0
    for s in starts(sched.handle(JobsQueued(tuple(job(route) for _ in range(10))), now)):
        times.append(now)
        finish(sched, s, now)
    while len(times) < 10:
        wake = sched.next_wakeup()
        assert wake is not None
        now = wake
        for s in starts(sched.tick(now)):
            times.append(now)
            finish(sched, s, now)
    assert times == [0, 0, 0, 10, 10, 10, 20, 20, 20, 30]


# --------------------------------------------------------------------------
# Fairness, priority, FIFO.


def test_fifo_inside_a_sub_queue() -> None:
    sched = sched_for([{"fields": ["recipientdomain"], "concurrency": 1}])
    route = Route("example.com")
    jobs = [job(route) for _ in range(5)]
    order = []
    pending = starts(sched.handle(JobsQueued(tuple(jobs)), 0))
    t = 0.0
    while pending:
        s = pending.pop()
        order.append(s.job.ref)
        t += 1
        pending.extend(starts(finish(sched, s, t)))
    assert order == [j.ref for j in jobs]


def test_priority_one_goes_before_priority_zero() -> None:
    sched = sched_for([{"concurrency": 1}])
    route = Route("example.com")
    low = [job(route, 0) for _ in range(3)]
    high = [job(route, 1) for _ in range(3)]
    (first,) = starts(sched.handle(JobsQueued(tuple(low)), 0))
    sched.handle(JobsQueued(tuple(high)), 0)
    order = []
    s = first
    for t in range(1, 6):
        (s,) = starts(finish(sched, s, t))
        order.append(s.job.priority)
    assert order == [1, 1, 1, 0, 0]


def test_priority_one_goes_first_among_sub_queues_ready_together() -> None:
    sched = sched_for([{"concurrency": 2}])
    low = [job(Route(f"low{i}.example"), 0) for i in range(3)]
    high = [job(Route(f"high{i}.example"), 1) for i in range(2)]
    sent = starts(sched.handle(JobsQueued((*low, *high)), 0))
    assert [s.job.priority for s in sent] == [1, 1]
    (s,) = starts(finish(sched, sent[0], 1))
    assert s.job.priority == 0  # no priority-1 work left


def test_round_robin_one_slow_destination_does_not_block_others() -> None:
    sched = sched_for([{"concurrency": 4}])
    slow = Route("slow.example")
    jobs = [job(slow) for _ in range(100)] + [job(Route(f"d{i}.example")) for i in range(3)]
    sent = starts(sched.handle(JobsQueued(tuple(jobs)), 0))
    assert [s.job.route.recipientdomain for s in sent] == \
        ["slow.example", "d0.example", "d1.example", "d2.example"]


def test_a_woken_waiter_keeps_its_place_in_line() -> None:
    # Three sub-queues wait for one global slot; they must take turns in order.
    sched = sched_for([{"concurrency": 1}])
    routes = [Route(f"d{i}.example") for i in range(3)]
    (s,) = starts(sched.handle(JobsQueued(tuple(job(r) for r in routes for _ in range(3))), 0))
    order = [s.job.route.recipientdomain]
    for t in range(1, 9):
        (s,) = starts(finish(sched, s, t))
        order.append(s.job.route.recipientdomain)
    assert order == ["d0.example", "d1.example", "d2.example"] * 3


def test_a_waiter_woken_by_another_blocker_leaves_the_line_it_also_waited_in() -> None:
    # Pools wait for source IP 1 (full) and IP 2 (suspended) at once; each
    # slot of IP 1 wakes one, which goes to the back of both lines.  When
    # IP 2 comes back, the one that waited longest for it goes first.
    sched = sched_for([{"fields": ["localip"], "concurrency": 1}])
    assert isinstance(sched, CoreScheduler)
    sched.handle(SuspensionAdded(Suspension((("localip", IP2),))), 0)
    pools = [Route(f"p{i}.example", localip=(IP1, IP2)) for i in range(5)]
    (s,) = starts(sched.handle(JobsQueued(tuple(job(r) for r in pools for _ in range(30))), 0))
    assert s.job.route == pools[0]
    for t in range(1, 101):
        (s,) = starts(finish(sched, s, t))
        assert s.job.route == pools[t % 5] and s.localip == IP1
    (susp,) = sched._susps
    assert susp.waiting() == 5
    assert [v.waiting_subqueues for v in sched.suspensions() if not v.automatic] == [5]
    (s2,) = starts(sched.handle(SuspensionRemoved(f"localip={IP2}"), 101))
    assert s2.localip == IP2 and s2.job.route == pools[1]


# --------------------------------------------------------------------------
# Slow start and the destination status cache (Postfix).


def test_slow_start_begins_at_two_and_grows_while_deliveries_succeed() -> None:
    sched = sched_for(initial_destination_concurrency=2, default_destination_concurrency_limit=4)
    route = Route("example.com")
    inflight = starts(sched.handle(JobsQueued(tuple(job(route) for _ in range(40))), 0))
    assert len(inflight) == 2
    peak = 2
    t = 0.0
    while inflight:
        s = inflight.pop(0)
        t += 1
        inflight.extend(starts(finish(sched, s, t)))
        peak = max(peak, len(inflight))
    assert peak == 4  # grew up to the limit, never beyond
    view = sched.destination("example.com")
    assert view is None or view.window == 4


def test_the_window_follows_the_policy_limit_of_the_destination() -> None:
    sched = sched_for([{"fields": ["localip", "recipientdomain"], "concurrency": 3}],
                      initial_destination_concurrency=2)
    sched.handle(JobsQueued(tuple(job(Route("example.com", localip=(IP1, IP2)))
                                  for _ in range(30))), 0)
    view = sched.destination("example.com")
    assert view is not None and view.limit == 6  # 3 per source IP, two IPs


def test_failures_shrink_the_window_and_a_failed_cohort_marks_the_destination_dead() -> None:
    sched = sched_for(initial_destination_concurrency=2, dead_destination_ttl_s=300)
    route = Route("down.example")
    a, b = starts(sched.handle(JobsQueued(tuple(job(route) for _ in range(5))), 0))
    assert defers(finish(sched, a, 1, failed=True)) == []  # one failure: window 1.5
    view = sched.destination("down.example")
    assert view is not None and view.window == 1.5 and not view.dead
    deferred = defers(finish(sched, b, 2, failed=True))  # the whole cohort failed
    assert len(deferred) == 3  # every queued job, without a connection attempt
    assert all(d.reply.enhanced == "4.4.1" or d.reply.code == 421 for d in deferred)
    assert all(d.dead_until_at == 302 for d in deferred)
    # New mail for it is deferred at once while the cache entry lives...
    (late,) = defers(sched.handle(JobsQueued((job(route),)), 100))
    assert late.dead_until_at == 302
    # ...and is tried again after it expires.
    assert sched.next_wakeup() == 302
    sched.tick(302)
    assert len(starts(sched.handle(JobsQueued((job(route),)), 303))) == 1


def test_a_dead_destination_carries_the_last_reply() -> None:
    sched = sched_for(initial_destination_concurrency=1)
    route = Route("down.example")
    (a,) = starts(sched.handle(JobsQueued((job(route), job(route))), 0))
    (deferred,) = defers(finish(sched, a, 1, failed=True))
    # Same code, and a text that says the destination is dead (issue 17),
    # then the last error, so nobody takes it for a fresh attempt's answer.
    assert (deferred.reply.code, deferred.reply.enhanced) == (REFUSED.reply.code,
                                                              REFUSED.reply.enhanced)
    assert deferred.reply.text.startswith("destination ")
    assert "is dead, not tried" in deferred.reply.text
    assert deferred.reply.text.endswith(str(REFUSED.reply))
    explanation = sched.explain(a.qids[0])
    assert explanation.state == "unknown"


# --------------------------------------------------------------------------
# Refill and memory.


def test_refill_asks_for_room_and_memory_stays_bounded() -> None:
    sched = Scheduler(Settings(maxmemoryqueue=100, refill_batch=40, max_deliveries=10,
                               initial_destination_concurrency=20))
    (refill,) = sched.tick(0)
    assert refill == Refill(40, 10)
    assert sched.tick(0.5) == []  # one claim at a time
    route = Route("example.com")
    cmds = sched.handle_all([EntriesClaimed(40), JobsQueued(tuple(job(route) for _ in range(40)))],
                            1)
    assert len(starts(cmds)) == 10
    refills = [c for c in cmds if isinstance(c, Refill)]
    assert refills == [Refill(40, 10)]
    cmds = sched.handle_all([EntriesClaimed(40), JobsQueued(tuple(job(route) for _ in range(40)))],
                            2)
    (refill,) = [c for c in cmds if isinstance(c, Refill)]
    assert refill.limit == 20  # 80 held; never more than maxmemoryqueue
    cmds = sched.handle_all([EntriesClaimed(20), JobsQueued(tuple(job(route) for _ in range(20)))],
                            3)
    assert sched.memory_used == 100
    assert not [c for c in cmds if isinstance(c, Refill)]


def test_an_exhausted_store_is_asked_again_after_refill_interval_or_new_mail() -> None:
    sched = Scheduler(Settings(refill_interval_s=5))
    sched.tick(0)
    assert sched.handle(EntriesClaimed(0, exhausted=True), 1) == []
    assert sched.next_wakeup() == 6
    assert sched.tick(3) == []
    assert isinstance(sched.handle(MailArrived(), 4)[0], Refill)


def test_an_exhausted_store_with_a_due_time_waits_for_it() -> None:
    sched = Scheduler(Settings(refill_interval_s=1))
    sched.tick(0)
    sched.handle(EntriesClaimed(0, exhausted=True, next_due_at=600), 1)
    assert sched.next_wakeup() == 600


def test_claimed_entries_that_were_not_routed_free_their_room() -> None:
    sched = Scheduler(Settings(maxmemoryqueue=10, refill_batch=10))
    sched.tick(0)
    sched.handle(EntriesClaimed(10), 1)
    assert sched.memory_used == 10
    cmds = sched.handle(JobsQueued((), unrouted=10), 2)
    assert sched.memory_used == 10  # a new claim went out at once
    assert cmds == [Refill(10, 10)]


# --------------------------------------------------------------------------
# Operator changes, live.


def test_modified_entries_are_dropped_from_memory() -> None:
    sched = sched_for([{"concurrency": 1}])
    route = Route("example.com")
    first, second, third = job(route, n=2), job(route, n=2), job(route)
    (s,) = starts(sched.handle(JobsQueued((first, second, third)), 0))
    sched.handle(EntriesModified((second.qids[0], third.qids[0], "DEADBEEF-9")), 1)
    (s2,) = starts(finish(sched, s, 2))
    assert s2.job is second and s2.qids == (second.qids[1],)  # what is left of it
    assert starts(finish(sched, s2, 3)) == []  # third is gone
    assert sched.explain(third.qids[0]).state == "unknown"


def test_policy_reload_takes_effect_for_queued_mail() -> None:
    sched = sched_for([{"fields": ["recipientdomain"], "concurrency": 1}])
    route = Route("example.com")
    assert len(starts(sched.handle(JobsQueued(tuple(job(route) for _ in range(5))), 0))) == 1
    reloaded = parse_policy([{"fields": ["recipientdomain"], "concurrency": 3}])
    assert len(starts(sched.handle(PolicyReloaded(reloaded), 1))) == 2


def test_a_reload_keeps_the_rate_window_of_an_unchanged_counter() -> None:
    sched = sched_for([{"fields": ["recipientdomain"], "rate": "2/60"}])
    route = Route("example.com")
    for s in starts(sched.handle(JobsQueued(tuple(job(route) for _ in range(5))), 0)):
        finish(sched, s, 1)
    sent = starts(sched.handle(PolicyReloaded(parse_policy(
        [{"fields": ["recipientdomain"], "rate": "3/60"}])), 2))
    assert len(sent) == 1  # two already in this minute


def test_conditions_can_be_added_and_removed_at_run_time_and_expire() -> None:
    sched = sched_for([{"id": "dom", "fields": ["recipientdomain"], "concurrency": 1}])
    route = Route("example.com")
    sched.handle(JobsQueued(tuple(job(route) for _ in range(10))), 0)
    cond = Condition((("recipientdomain", "example.com"),), Thresholds(concurrency=4),
                     id="burst", expires_at=100, tag="ops", reason="backlog")
    assert len(starts(sched.handle(ConditionAdded("dom", cond), 1))) == 3
    assert sched.policy.counter("dom").conditions[0].id == "burst"
    assert sched.next_wakeup() == 100
    sched.tick(100)
    assert sched.policy.counter("dom").conditions == ()
    sched.handle(ConditionAdded("dom", Condition((("recipientdomain", "example.com"),),
                                                 Thresholds(concurrency=9))), 101)
    (added,) = sched.policy.counter("dom").conditions
    sched.handle(ConditionRemoved("dom", added.id), 102)
    assert sched.policy.counter("dom").conditions == ()
    with pytest.raises(ValueError, match="does not count"):
        sched.handle(ConditionAdded("dom", Condition((("localip", IP1),), Thresholds(1))), 103)


def test_a_suspension_expires_on_its_own() -> None:
    sched = sched_for()
    sched.handle(SuspensionAdded(Suspension((("recipientdomain", "example.com"),),
                                            expires_at=50, reason="maintenance")), 0)
    (j,) = (job(Route("example.com")),)
    assert starts(sched.handle(JobsQueued((j,)), 1)) == []
    why = sched.explain(j.qids[0], 1)
    assert why.reasons[0].kind is Waiting.SUSPENDED
    assert why.expected_at == 50
    assert "maintenance" in why.reasons[0].text
    assert sched.next_wakeup() == 50
    assert len(starts(sched.tick(50))) == 1


def test_adding_the_same_suspension_again_only_moves_its_expiry() -> None:
    sched = sched_for()
    fields = (("recipientdomain", "example.com"),)
    sched.handle(SuspensionAdded(Suspension(fields, expires_at=50, tag="a")), 0)
    sched.handle(SuspensionAdded(Suspension(fields, expires_at=80)), 1)
    (view,) = sched.suspensions()
    assert (view.expires_at, view.tag) == (80, "a")
    sched.handle(JobsQueued((job(Route("example.com")),)), 2)
    assert starts(sched.tick(50)) == []
    assert len(starts(sched.tick(80))) == 1


def test_reload_replaces_the_files_suspensions_but_keeps_run_time_ones() -> None:
    file_one = parse_policy({"suspends": [{"recipientdomain": "a.example"}]})
    sched = Scheduler(Settings(), file_one)
    sched.handle(SuspensionAdded(Suspension((("recipientdomain", "b.example"),))), 0)
    sched.handle(PolicyReloaded(parse_policy({"suspends": [{"recipientdomain": "c.example"}]})),
                 1)
    assert sorted(v.id for v in sched.suspensions()) == \
        ["recipientdomain=b.example", "recipientdomain=c.example"]


# --------------------------------------------------------------------------
# Explain.


def test_explain_names_the_counter_and_dates_a_rate_limit() -> None:
    sched = sched_for([{"fields": ["recipientdomain"], "rate": "1/60"}])
    route = Route("example.com")
    jobs = [job(route) for _ in range(3)]
    sched.handle(JobsQueued(tuple(jobs)), 0)
    why = sched.explain(jobs[2].qids[0], 10)
    kinds = [r.kind for r in why.reasons]
    assert kinds == [Waiting.BEHIND, Waiting.RATE]
    assert why.ahead == 1
    rate = why.reasons[1]
    assert rate.counter == "recipientdomain" and rate.until_at == 60
    assert "rate 1/60" in rate.text
    assert why.expected_at == 120  # its turn comes one window after the next slot
    lines = why.lines(10)
    assert lines[0].endswith("queued") and "in 1m50s" in lines[-1]


def test_explain_a_delivery_in_flight_and_an_unknown_recipient() -> None:
    sched = sched_for()
    (s,) = starts(sched.handle(JobsQueued((job(Route("example.com")),)), 0))
    assert sched.explain(s.qids[0]).state == "delivering"
    assert sched.explain("FFFFFFFF-1").reasons[0].kind is Waiting.UNKNOWN


def test_explain_a_full_queue_manager() -> None:
    sched = sched_for(max_deliveries=1)
    jobs = [job(Route(f"d{i}.example")) for i in range(2)]
    sched.handle(JobsQueued(tuple(jobs)), 0)
    why = sched.explain(jobs[1].qids[0])
    assert [r.kind for r in why.reasons] == [Waiting.CAPACITY]


# --------------------------------------------------------------------------
# Misuse, and what the views say.


def test_time_never_goes_backwards_and_the_state_is_left_alone() -> None:
    sched = sched_for()
    sched.tick(10)
    with pytest.raises(ValueError, match="backwards"):
        sched.handle(JobsQueued((job(Route("example.com")),)), 9)
    assert sched.stats().queued_jobs == 0


def test_an_unknown_delivery_result_is_refused_before_anything_changes() -> None:
    sched = sched_for()
    j = job(Route("example.com"))
    with pytest.raises(ValueError, match="no delivery"):
        sched.handle_all([JobsQueued((j,)), DeliveryFinished("nope")], 0)
    assert sched.stats().queued_jobs == 0
    sched.handle(JobsQueued((j,)), 0)
    with pytest.raises(ValueError, match="already known"):
        sched.handle(JobsQueued((j,)), 0)
    with pytest.raises(ValueError, match="queued twice"):
        sched.handle(JobsQueued((DeliveryJob("other", j.spid, j.qids, j.route),)), 0)


def test_the_result_must_name_the_source_ip_it_was_given() -> None:
    sched = sched_for()
    (s,) = starts(sched.handle(JobsQueued((job(Route("example.com", localip=(IP1,))),)), 0))
    with pytest.raises(ValueError, match="started from"):
        sched.handle(DeliveryFinished(s.job.ref, localip=IP2), 1)


def test_stats_and_subqueue_views() -> None:
    sched = sched_for([{"fields": ["recipientdomain"], "concurrency": 1}])
    sched.handle(JobsQueued(tuple(job(Route("example.com")) for _ in range(3))), 0)
    stats = sched.stats()
    assert (stats.queued_jobs, stats.inflight_jobs, stats.subqueues,
            stats.parked_subqueues) == (2, 1, 1, 1)
    (sq,) = sched.subqueues()
    assert sq.parked and sq.jobs == 2 and "example.com" in sq.held_by[0]
    assert sched.suspensions()[0].automatic
    # The policy's 1 is the destination's limit too; explain names both.
    why = sched.explain(f"{next(_ids) - 1:08X}-0")
    assert {r.kind for r in why.reasons} >= {Waiting.CONCURRENCY, Waiting.DESTINATION_WINDOW}


# --------------------------------------------------------------------------
# Flat cost: parked sub-queues are not looked at.


def test_a_pickup_does_not_visit_parked_sub_queues(monkeypatch: pytest.MonkeyPatch) -> None:
    sched = sched_for([{"fields": ["recipientdomain"], "concurrency": 1}])
    busy = [Route(f"d{i}.example") for i in range(2000)]
    sched.handle(JobsQueued(tuple(job(r) for r in busy for _ in range(2))), 0)
    sched.handle(SuspensionAdded(Suspension((("transportid", "bulk"),))), 0)
    sched.handle(JobsQueued(tuple(job(Route(f"s{i}.example", transportid="bulk"))
                                  for i in range(2000))), 0)
    (s,) = starts(sched.handle(JobsQueued((job(Route("live.example")),
                                           job(Route("live.example")))), 1))
    visits = 0
    original = pickup.visit

    def counting(self: CoreScheduler, *args: object) -> None:
        nonlocal visits
        visits += 1
        original(self, *args)  # type: ignore[arg-type]

    monkeypatch.setattr(pickup, "visit", counting)
    assert len(starts(finish(sched, s, 2))) == 1
    assert visits == 1  # 4000 parked sub-queues, one visit
    sched.handle(ClockTicked(), 3)
    assert visits == 1


# --------------------------------------------------------------------------
# Counting in groups: entries used by the same sub-queues count once.


def test_a_sub_queue_sharing_part_of_a_group_splits_it_with_its_counts() -> None:
    sched = sched_for([{"fields": ["tenantid"], "concurrency": 2},
                       {"fields": ["recipientdomain"], "concurrency": 5}])
    a = Route("a.example", tenantid="t1")
    b = Route("b.example", tenantid="t1")
    first = starts(sched.handle(JobsQueued(tuple(job(a) for _ in range(4))), 0))
    assert len(first) == 2  # the tenant's 2, counted with a.example's entry
    # b shares the tenant's entry only: both halves keep a's two in flight.
    assert starts(sched.handle(JobsQueued(tuple(job(b) for _ in range(2))), 1)) == []
    inflight = {(v.counter, v.key[0][1]): v.inflight for v in sched.counters()}
    assert inflight == {("tenantid", "t1"): 2, ("recipientdomain", "a.example"): 2,
                        ("recipientdomain", "b.example"): 0}
    # a waited first: it takes the freed slot, then b, in turn.
    (s1,) = starts(finish(sched, first[0], 2))
    assert s1.job.route == a
    (s2,) = starts(finish(sched, first[1], 3))
    assert s2.job.route == b
    inflight = {(v.counter, v.key[0][1]): v.inflight for v in sched.counters()}
    assert inflight == {("tenantid", "t1"): 2, ("recipientdomain", "a.example"): 1,
                        ("recipientdomain", "b.example"): 1}
    assert sched.stats().counter_entries == 3


def test_an_entry_held_by_another_of_its_group_is_not_exceeded() -> None:
    sched = sched_for([{"fields": ["tenantid"], "concurrency": 1},
                       {"fields": ["jobid"], "concurrency": 3}])
    route = Route("example.com", tenantid="t1", jobid="j1")
    sched.handle(JobsQueued(tuple(job(route) for _ in range(3))), 0)
    views = {v.counter: v for v in sched.counters()}
    assert views["tenantid"].exceeded and views["tenantid"].waiting_subqueues == 1
    assert not views["jobid"].exceeded and views["jobid"].waiting_subqueues == 0
    assert views["jobid"].inflight == 1
    (sq,) = sched.subqueues()
    assert sq.held_by == ("counter tenantid [tenantid=t1]: 1 in flight, concurrency 1",)


def test_a_counter_added_on_a_reload_starts_its_window_empty() -> None:
    sched = sched_for([{"id": "a", "fields": ["recipientdomain"], "rate": "2/60"}])
    route = Route("example.com")
    for s in starts(sched.handle(JobsQueued(tuple(job(route) for _ in range(9))), 0)):
        finish(sched, s, 1)
    # "a" keeps its two pickups (8 more of 10); "b", over the same field, saw none.
    sent = starts(sched.handle(PolicyReloaded(parse_policy(
        [{"id": "a", "fields": ["recipientdomain"], "rate": "10/60"},
         {"id": "b", "fields": ["recipientdomain"], "rate": "2/60"}])), 2))
    assert len(sent) == 2
    used = {v.counter: v.rate_used for v in sched.counters()}
    assert used == {"a": 4, "b": 2}


def test_a_rate_added_on_a_reload_starts_empty_whatever_shares_the_group() -> None:
    # tenantid and t2 count the same deliveries (one group); only t2 has a
    # rate and keeps pickup times.  A reload that gives tenantid a rate
    # starts its window empty, as for an entry counted on its own.
    sched = sched_for([{"fields": ["tenantid"], "concurrency": 9},
                       {"id": "t2", "fields": ["tenantid"], "rate": "6/60"}])
    route = Route("example.com", tenantid="t1")
    sent = starts(sched.handle(JobsQueued(tuple(job(route) for _ in range(9))), 0))
    assert len(sent) == 6
    for s in sent:
        finish(sched, s, 1)
    sent = starts(sched.handle(PolicyReloaded(parse_policy(
        [{"fields": ["tenantid"], "rate": "2/60"}])), 2))
    assert len(sent) == 2


# --------------------------------------------------------------------------
# Tenants: weights and minimum shares (deficit round robin).


def test_why_names_the_tenant_share_a_recipient_waits_for() -> None:
    shares = Shares({"big": 3.0}, 1.0, {"small": 0.5})
    sched = Scheduler(Settings(initial_destination_concurrency=2,
                               default_destination_concurrency_limit=2, shares=shares))
    big = Route("d.example", tenantid="big")
    small = Route("d.example", tenantid="small")
    first = starts(sched.handle(JobsQueued(tuple(job(big) for _ in range(5))), 0))
    assert [s.job.route.tenantid for s in first] == ["big", "big"]
    sched.handle(JobsQueued((job(small), job(small))), 1)
    waiting = f"{next(_ids) - 4:08X}-0"  # the third of big's jobs
    why = sched.explain(waiting)
    share = [r for r in why.reasons if r.kind is Waiting.TENANT_SHARE]
    assert share and "small (below its min_share of 50%)" in share[0].text
    # The freed slot goes to small, though big's weight is three times its own.
    (s,) = starts(finish(sched, first[0], 2))
    assert s.job.route.tenantid == "small"
    views = {v.tenant: v for v in sched.tenants()}
    assert views["small"].inflight == 1 and views["big"].pickups == 2
    assert views["big"].queued_jobs == 3 and views["big"].weight == 3.0
