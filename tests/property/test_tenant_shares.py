"""Tenants share a contended limit by weight, and get their minimum share (hypothesis).

A destination's window is the limit tenants compete for; each tenant has one
or several sub-queues (jobs) full of mail, and deliveries finish in a random
order.  Checked with our own bookkeeping, not the scheduler's:

- the window is never exceeded, and FIFO holds in every sub-queue;
- while every tenant has mail waiting, any run of consecutive pickups gives
  each tenant its weight's share of them, within one round of turns,
  however many sub-queues each tenant has (deficit round robin);
- a tenant with a min_share holds at least that share of the window once
  as many deliveries as its share have finished since it began to wait,
  whatever its weight;
- nobody starves: the queue drains.
"""

from __future__ import annotations

import itertools
import math
from collections import defaultdict

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from sluice.model import Delivered, Reply
from sluice.scheduler import (
    DeliveryFinished,
    DeliveryJob,
    JobsQueued,
    Route,
    Scheduler,
    Settings,
    StartDelivery,
)
from sluice.scheduler.tenants import Shares

pytestmark = pytest.mark.property

OK = Delivered(Reply(250, "2.0.0", "ok"))


def run(weights: dict[str, int], subqueues: dict[str, int], window: int, per_sq: int,
        order: list[int], min_shares: dict[str, float] | None = None
        ) -> tuple[list[str], list[dict[str, int]], list[set[str]]]:
    """Queue everything at once, then finish one delivery at a time (which
    one: ``order``).  Returns the tenant of each pickup, the in-flight count
    per tenant after each step, and who had mail waiting then."""
    shares = Shares({t: float(w) for t, w in weights.items()}, 1.0, min_shares or {})
    sched = Scheduler(Settings(max_deliveries=1000, maxmemoryqueue=100_000,
                               initial_destination_concurrency=window,
                               default_destination_concurrency_limit=window, shares=shares))
    ids = itertools.count()
    jobs = []
    fifo: dict[tuple[str, int], list[str]] = defaultdict(list)
    for tenant, n in subqueues.items():
        for k in range(n):
            route = Route("d.example", tenantid=tenant, jobid=f"{tenant}{k}")
            for _ in range(per_sq):
                i = next(ids)
                ref = f"{i:08X}"
                jobs.append(DeliveryJob(ref, ref, (f"{ref}-0",), route))
                fifo[(tenant, k)].append(ref)
    # Interleave the tenants' jobs in arrival order.
    jobs.sort(key=lambda j: (j.route.jobid[-1:], j.ref))
    inflight: list[StartDelivery] = []
    picked: list[str] = []
    held: list[dict[str, int]] = []
    waiting_log: list[set[str]] = []
    waiting: dict[str, int] = {t: n * per_sq for t, n in subqueues.items()}

    def take(commands: list[object]) -> None:
        for c in commands:
            if isinstance(c, StartDelivery):
                route = c.job.route
                line = fifo[(route.tenantid, int(route.jobid[len(route.tenantid):]))]
                assert line[0] == c.job.ref, "FIFO broken inside a sub-queue"
                line.pop(0)
                inflight.append(c)
                picked.append(route.tenantid)
                waiting[route.tenantid] -= 1
        assert len(inflight) <= window, "the destination's window was exceeded"
        counts: dict[str, int] = defaultdict(int)
        for c in inflight:
            counts[c.job.route.tenantid] += 1
        held.append(dict(counts))
        waiting_log.append({t for t, n in waiting.items() if n})

    take(sched.handle(JobsQueued(tuple(jobs)), 0.0))
    step = 0
    now = 0.0
    while inflight:
        k = order[step % len(order)] % len(inflight) if order else 0
        step += 1
        now += 0.01
        done = inflight.pop(k)
        take(sched.handle(DeliveryFinished(done.job.ref, ((done.qids[0], OK),)), now))
    assert not any(waiting.values()), "mail starved: the queue did not drain"
    return picked, held, waiting_log


tenants = st.sampled_from([("a", "b"), ("a", "b", "c")])


@settings(max_examples=60, deadline=None)
@given(names=tenants, data=st.data(), window=st.integers(1, 5),
       order=st.lists(st.integers(0, 50), min_size=1, max_size=30))
def test_backlogged_tenants_get_their_weights_share_within_one_round(
        names: tuple[str, ...], data: st.DataObject, window: int, order: list[int]) -> None:
    weights = {t: data.draw(st.integers(1, 3), label=f"weight {t}") for t in names}
    subqueues = {t: data.draw(st.integers(1, 4), label=f"sub-queues {t}") for t in names}
    picked, _, waiting = run(weights, subqueues, window, per_sq=12, order=order)
    total = sum(weights.values())
    slack = max(weights.values()) + 1  # one round of turns
    # The pickups made while every tenant still had mail waiting (after the
    # first window's worth, which the ring hands out before anyone waits).
    busy = [i for i in range(window, len(picked)) if waiting[i] == set(names)]
    if not busy:
        return
    seq = picked[window:busy[-1] + 1]
    for start in range(len(seq)):
        counts: dict[str, int] = defaultdict(int)
        for n, tenant in enumerate(seq[start:], start=1):
            counts[tenant] += 1
            for t in names:
                fair = n * weights[t] / total
                assert counts[t] >= math.floor(fair) - slack, (
                    f"{t} got {counts[t]} of {n} pickups, its share is {fair:.1f}")


@settings(max_examples=60, deadline=None)
@given(window=st.integers(2, 10), share=st.sampled_from([0.2, 0.3, 0.5]),
       others=st.integers(1, 6), order=st.lists(st.integers(0, 50), min_size=1, max_size=30))
def test_a_min_share_is_held_while_its_tenant_waits(
        window: int, share: float, others: int, order: list[int]) -> None:
    # "small" has the least weight and one sub-queue against many of "big",
    # and arrives last: its min_share still gives it its slots.
    picked, held, waiting = run({"big": 3, "small": 1}, {"big": others, "small": 1}, window,
                                per_sq=25, order=order, min_shares={"small": share})
    reserved = math.ceil(share * window)
    for finishes, step in enumerate(range(1, len(held)), start=1):
        if "small" not in waiting[step]:
            break
        if finishes >= reserved:
            assert held[step].get("small", 0) >= reserved, (
                f"after {finishes} finishes small holds {held[step].get('small', 0)} "
                f"of its {reserved}")
    assert "small" in picked


def test_a_tenant_with_many_sub_queues_does_not_crowd_out_one_with_a_single_one() -> None:
    picked, _, _ = run({"many": 1, "one": 1}, {"many": 50, "one": 1}, window=4, per_sq=20,
                       order=[0])
    first = picked[4:34]  # while "one" still has mail (20 jobs)
    assert abs(first.count("many") - first.count("one")) <= 2


def test_without_fairness_sub_queues_take_turns_whatever_their_tenant() -> None:
    # fair: false is plain round robin over sub-queues: fifty of one tenant
    # against one of another give the first about fifty turns to one.
    shares = Shares(fair=False)
    sched = Scheduler(Settings(max_deliveries=1000, initial_destination_concurrency=4,
                               default_destination_concurrency_limit=4, shares=shares))
    jobs = [DeliveryJob(f"m{k}-{i}", f"m{k}-{i}", (f"m{k}-{i}-0",),
                        Route("d.example", tenantid="many", jobid=f"j{k}"))
            for i in range(4) for k in range(50)]
    jobs += [DeliveryJob(f"o{i}", f"o{i}", (f"o{i}-0",), Route("d.example", tenantid="one"))
             for i in range(20)]
    inflight = [c for c in sched.handle(JobsQueued(tuple(jobs)), 0) if isinstance(c, StartDelivery)]
    picked = []
    for step in range(40):
        done = inflight.pop(0)
        new = [c for c in sched.handle(DeliveryFinished(done.job.ref, ((done.qids[0], OK),)),
                                       step + 1.0) if isinstance(c, StartDelivery)]
        inflight += new
        picked += [c.job.route.tenantid for c in new]
    assert picked.count("one") <= 2
