"""A condition that names a pattern holds the hosts it matches together (pure, fake clock).

Issue 17: a shaping back-off on ``remotemx: '*.google.com'`` must limit Google as a
whole, not each Google MX host to the lowered figures.  Both implementations of
the limits seam are driven alike; "sent" means a StartDelivery was issued.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Sequence

import pytest

from sluice.model import Delivered, Reply
from sluice.scheduler import (
    Command,
    Condition,
    ConditionAdded,
    ConditionRemoved,
    DeliveryFinished,
    DeliveryJob,
    GroupedLimits,
    JobsQueued,
    Rate,
    ReferenceLimits,
    Route,
    Scheduler,
    Settings,
    StartDelivery,
    Thresholds,
    parse_policy,
)

pytestmark = pytest.mark.unit

OK = Delivered(Reply(250, "2.0.0", "ok"))
IP1, IP2 = "192.0.2.1", "192.0.2.2"
GMAIL = Route("gmail.com", remotemx="alt1.gmail-smtp-in.l.google.com")
GOOGLEMAIL = Route("googlemail.com", remotemx="aspmx.l.google.com")
OTHER = Route("example.net", remotemx="mx.example.net")
_ids = itertools.count(1)

LIMITS: list[Callable[[], object]] = [ReferenceLimits, GroupedLimits]


def job(route: Route) -> DeliveryJob:
    i = next(_ids)
    spid = f"{i:08X}"
    return DeliveryJob(f"job{i}", spid, (f"{spid}-0",), route)


def starts(commands: Sequence[Command]) -> list[StartDelivery]:
    return [c for c in commands if isinstance(c, StartDelivery)]


def sched_for(make: Callable[[], object], policy: object) -> Scheduler:
    settings = Settings(max_deliveries=1000, initial_destination_concurrency=1000,
                        default_destination_concurrency_limit=1000)
    return Scheduler(settings, parse_policy(policy), limits=make())  # type: ignore[arg-type]


def finish(sched: Scheduler, start: StartDelivery, now: float) -> list[StartDelivery]:
    return starts(sched.handle(DeliveryFinished(start.job.ref, ((start.qids[0], OK),)), now))


def hosts(sent: Sequence[StartDelivery]) -> list[str]:
    return sorted(s.job.route.remotemx for s in sent)


def google(th: Thresholds, cid: str = "backoff", expires_at: float | None = None
           ) -> ConditionAdded:
    return ConditionAdded("mx", Condition((("remotemx", "*.google.com"),), th, cid, expires_at))


MX_POLICY = [{"id": "mx", "fields": ["remotemx"], "concurrency": 4}]


@pytest.mark.parametrize("make", LIMITS)
def test_concurrency_1_on_a_pattern_holds_both_hosts_together(make: Callable[[], object]
                                                              ) -> None:
    sched = sched_for(make, MX_POLICY)
    sched.handle(google(Thresholds(concurrency=1)), 0)
    sent = starts(sched.handle(JobsQueued(tuple(job(r) for r in (GMAIL, GOOGLEMAIL) * 5
                                                + (OTHER,) * 6)), 0))
    # One Google delivery for both hosts; the other MX keeps its own 4.
    assert hosts(sent) == ["alt1.gmail-smtp-in.l.google.com"] + ["mx.example.net"] * 4
    inflight = [s for s in sent if s.job.route is not OTHER]
    now = 0.0
    seen: set[str] = set()
    while inflight:
        now += 1
        assert len(inflight) == 1  # never two Google deliveries at once
        seen.add(inflight[0].job.route.remotemx)
        inflight = finish(sched, inflight.pop(), now)
    assert seen == {"alt1.gmail-smtp-in.l.google.com", "aspmx.l.google.com"}
    # The pooled entry is named by the pattern, one for the provider.
    keys = {v.key for v in sched.counters(now)}
    assert (("remotemx", "*.google.com"),) in keys
    assert (("remotemx", "aspmx.l.google.com"),) not in keys


@pytest.mark.parametrize("make", LIMITS)
def test_a_rate_on_a_pattern_holds_both_hosts_together(make: Callable[[], object]) -> None:
    sched = sched_for(make, MX_POLICY)
    sched.handle(google(Thresholds(rate=Rate(2, 1.0))), 0)
    sent = starts(sched.handle(JobsQueued(tuple(job(r) for r in (GMAIL, GOOGLEMAIL) * 4)), 0))
    assert len(sent) == 2  # 2 a second for both, not 2 for each
    assert hosts(sent) == ["alt1.gmail-smtp-in.l.google.com", "aspmx.l.google.com"]
    for s in sent:
        assert not finish(sched, s, 0.5)  # a free concurrency slot, but no rate
    assert sched.next_wakeup() == 1.0
    assert len(starts(sched.tick(1.0))) == 2
    assert not starts(sched.tick(1.5))
    assert len(starts(sched.tick(2.0))) == 2


@pytest.mark.parametrize("make", LIMITS)
def test_removal_and_expiry_give_each_host_its_own_limit_again(make: Callable[[], object]
                                                               ) -> None:
    sched = sched_for(make, MX_POLICY)
    sched.handle(google(Thresholds(concurrency=1), "gone-by-hand"), 0)
    sent = starts(sched.handle(JobsQueued(tuple(job(r) for r in (GMAIL, GOOGLEMAIL) * 6)), 0))
    assert len(sent) == 1
    # Removed: each host has the counter's 4 again (the one in flight counts in its own).
    more = starts(sched.handle(ConditionRemoved("mx", "gone-by-hand"), 1))
    assert len(more) == 7
    assert hosts(sent + more).count("aspmx.l.google.com") == 4
    # Back on, with an expiry: 8 in flight hold the provider's one slot; only when
    # the last has finished does one more go.
    sched.handle(google(Thresholds(concurrency=1), "expires", expires_at=10.0), 2)
    *first, last = sent + more
    for s in first:
        assert not finish(sched, s, 3)
    (one,) = finish(sched, last, 3)
    assert sched.next_wakeup() == 10.0
    # At the expiry each host has its own 4 again: the three left go at once.
    later = starts(sched.tick(10.0))
    assert len(later) == 3
    assert sorted(hosts([one, *later])) == ["alt1.gmail-smtp-in.l.google.com"] * 2 + [
        "aspmx.l.google.com"] * 2


@pytest.mark.parametrize("make", LIMITS)
def test_the_pattern_pools_per_value_of_the_counters_other_fields(make: Callable[[], object]
                                                                 ) -> None:
    sched = sched_for(make, [{"id": "ipmx", "fields": ["localip", "remotemx"],
                              "if": {"remotemx": "*.google.com", "concurrency": 1}}])
    routes = [Route(r.recipientdomain, remotemx=r.remotemx, localip=(ip,))
              for r in (GMAIL, GOOGLEMAIL) for ip in (IP1, IP2)]
    sent = starts(sched.handle(JobsQueued(tuple(job(r) for r in routes * 2)), 0))
    # One in flight per source IP for all of Google (a condition in the policy file pools
    # the same way as one added at run time).
    assert sorted(s.localip for s in sent) == [IP1, IP2]


def test_a_pooled_key_chooses_the_condition_that_pooled_it() -> None:
    (counter,) = parse_policy([{"fields": ["remotemx"], "if": [
        {"remotemx": "*.google.com", "concurrency": 1},
        {"remotemx": "*.com", "concurrency": 3},
        {"remotemx": "/^mx[0-9]\\.example\\.net$/", "concurrency": 2}]}]).counters
    assert counter.entry_key(("a.google.com",)) == ("*.google.com",)
    assert counter.entry_key(("mx.example.com",)) == ("*.com",)
    assert counter.entry_key(("mx7.example.net",)) == ("/^mx[0-9]\\.example\\.net$/",)
    assert counter.entry_key(("mx.example.net",)) == ("mx.example.net",)
    assert counter.thresholds_for(("*.google.com",))[0].concurrency == 1
    # "*.com" matches the text "*.google.com" as a string, but a pooled entry is
    # only ever the pattern it was pooled under.
    assert counter.thresholds_for(("*.com",))[0].concurrency == 3
    assert counter.thresholds_for(("/^mx[0-9]\\.example\\.net$/",))[0].concurrency == 2
    (general_first,) = parse_policy([{"fields": ["remotemx"], "if": [
        {"remotemx": "*.com", "concurrency": 3},
        {"remotemx": "*.google.com", "concurrency": 1}]}]).counters
    assert general_first.entry_key(("a.google.com",)) == ("*.com",)
    assert general_first.thresholds_for(("*.com",))[0].concurrency == 3


@pytest.mark.parametrize("make", LIMITS)
def test_two_counters_over_the_same_field_pool_only_where_their_conditions_say(
        make: Callable[[], object]) -> None:
    # Two counters over remotemx; only the first gets the back-off.  The second still
    # counts each host by itself (GroupedLimits must part them into two tables).
    sched = sched_for(make, [{"id": "mx", "fields": ["remotemx"], "concurrency": 10},
                             {"id": "mx2", "fields": ["remotemx"], "concurrency": 1}])
    sent = starts(sched.handle(JobsQueued(tuple(job(r) for r in (GMAIL, GOOGLEMAIL) * 3)), 0))
    assert len(sent) == 2
    sched.handle(google(Thresholds(concurrency=1)), 1)
    for s in sent:
        finish(sched, s, 2)
    views = {(v.counter, v.key) for v in sched.counters(2)}
    assert ("mx", (("remotemx", "*.google.com"),)) in views
    assert ("mx2", (("remotemx", "aspmx.l.google.com"),)) in views
