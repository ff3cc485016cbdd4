#!/usr/bin/env python3
"""Scheduler benchmark: pickups per second against the number of sub-queues.

    .venv/bin/python bench/scheduler_bench.py [--entries 1000000] [--pickups 200000]
        [--counters 100] [--subqueues 1,1000,100000] [--batch 100]

For each sub-queue count N, the scheduler holds ``--entries`` queued
recipients (one job each) spread evenly over N sub-queues (one recipient
domain each) under a policy of ``--counters`` counters that all apply to
every delivery, and half of the N sub-queues are suspended by hand (one
suspension per domain).  The timed part is the steady state of a running
queue manager: batches of deliveries finish (DeliveryFinished), and the
scheduler starts as many new ones (StartDelivery) in the same call.  It
prints pickups/s per N, and as its last line

    pickups_per_s_1=A pickups_per_s_100k=B ratio=B/A

The goal is ratio >= 0.67: the cost of a pickup must not grow with the
number of sub-queues, suspended ones included.  CPU-bound and
single-threaded; the machine is shared and noisy (about +-15 %), so compare
runs made back to back.
"""

from __future__ import annotations

import argparse
import gc
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "src"))

from sluice.model import Delivered, Reply  # noqa: E402
from sluice.scheduler import (  # noqa: E402
    DeliveryFinished,
    DeliveryJob,
    JobsQueued,
    Route,
    Scheduler,
    Settings,
    StartDelivery,
    Suspension,
    SuspensionAdded,
    parse_policy,
)

FIELD_SETS = [
    ["localip"], ["tenantid"], ["jobid"], ["transportid"], ["recipientdomain"], ["remotemx"],
    ["localip", "recipientdomain"], ["localip", "remotemx"], ["tenantid", "recipientdomain"],
    ["tenantid", "jobid"], ["transportid", "localip"], ["remoteip"], ["localip", "remoteip"],
    ["tenantid", "localip"], ["jobid", "recipientdomain"], ["grouping"],
]

OK = Delivered(Reply(250, "2.0.0", "ok"))
INFLIGHT = 1000
MAX_DELIVERIES = 1_000_000


def policy_data(counters: int, inflight: int) -> list[dict[str, object]]:
    """``counters`` counters over varied fields, all applying to every delivery.

    The first is a global concurrency of ``inflight``: it holds the queue
    manager at about that many deliveries in flight, whatever the number of
    sub-queues, so that every run is the same steady state (sub-queues wait
    for a slot, and each finished delivery lets the next one go).  The
    others are concurrencies just below it, or rates that are never
    reached: thresholds the scheduler must check on every pickup.  Each
    also has a condition for a value
    nobody has, and some roll MXs up into groups, as Halon's gsuite example
    does.
    """
    out: list[dict[str, object]] = [{"id": "global", "concurrency": inflight}]
    for i in range(1, counters):
        fields: list[object] = list(FIELD_SETS[i % len(FIELD_SETS)])
        if i % 7 == 3:
            fields = [f for f in fields if f != "remotemx"]
            fields.append({"remotemx": {"g": ["*.google.com", "/^mx[0-9]+\\.goog$/"]}})
        counter: dict[str, object] = {"id": f"c{i}", "fields": fields}
        name = next(f if isinstance(f, str) else next(iter(f)) for f in fields)
        counter["if"] = {name: f"nobody-{i}", "concurrency": 1}
        if i % 3 == 0:
            counter["rate"] = f"{100 * MAX_DELIVERIES}/1"
        else:
            counter["concurrency"] = inflight - 1
        out.append(counter)
    return out


def run(n_subqueues: int, entries: int, pickups: int, counters: int, batch: int) -> float:
    settings = Settings(maxmemoryqueue=entries * 2, max_deliveries=MAX_DELIVERIES,
                        initial_destination_concurrency=INFLIGHT,
                        default_destination_concurrency_limit=INFLIGHT,
                        destination_cache_size=n_subqueues + 10)
    sched = Scheduler(settings, parse_policy(policy_data(counters, INFLIGHT)))
    routes = [Route(f"d{i}.example", tenantid=f"t{i % 10}", jobid=f"j{i % 100}",
                    transportid="bulk" if i % 2 else "tx", localip=("192.0.2.1",),
                    remotemx=f"mx.d{i}.example", remoteip=f"10.0.{(i >> 8) & 255}.{i & 255}",
                    grouping=f"g{i % 50}")
                for i in range(n_subqueues)]
    suspended = n_subqueues // 2
    for route in routes[:suspended]:  # half the sub-queues, one suspension each
        sched.handle(SuspensionAdded(Suspension((("recipientdomain", route.recipientdomain),))),
                     0.0)
    jobs = []
    for k in range(entries):
        qid = f"{k:010X}-0"
        jobs.append(DeliveryJob(qid, qid[:10], (qid,), routes[k % n_subqueues]))
    commands = sched.handle(JobsQueued(tuple(jobs)), 0.0)
    del jobs
    inflight = [c for c in commands if isinstance(c, StartDelivery)]
    assert INFLIGHT - 1 <= len(inflight) <= INFLIGHT, len(inflight)
    gc.collect()
    now = 1.0
    done = 0
    started = time.process_time()
    while done < pickups:
        now += 0.001
        finished, inflight = inflight[:batch], inflight[batch:]
        events = [DeliveryFinished(s.job.ref, ((s.qids[0], OK),)) for s in finished]
        commands = sched.handle_all(events, now)
        new = [c for c in commands if isinstance(c, StartDelivery)]
        assert len(new) == len(finished), "the steady state ran dry"
        inflight.extend(new)
        done += len(new)
    elapsed = time.process_time() - started
    stats = sched.stats()
    entries, groups = per_pickup(sched)
    print(f"  sub-queues={n_subqueues:>7} (suspended {suspended:>6}, parked "
          f"{stats.parked_subqueues:>6}) counter entries={stats.counter_entries:>7} "
          f"per pickup: entries={entries} rows={groups} "
          f"pickups={done} in {elapsed:.2f}s -> {done / elapsed:,.0f} pickups/s", flush=True)
    return done / elapsed


def per_pickup(sched: Scheduler) -> tuple[int, int]:
    """The counter entries one active sub-queue checks, and the rows they
    are counted in (what a pickup actually touches)."""
    for sq in sched._queues:  # a look inside, for the report line
        if sq.live and not any(type(b).__name__ == "Suspended" for b in sq.parked_on):
            binding = sq.bindings[0]
            return len(binding.entries), len(getattr(binding, "rows", binding.entries))
    return 0, 0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--entries", type=int, default=1_000_000)
    ap.add_argument("--pickups", type=int, default=200_000)
    ap.add_argument("--counters", type=int, default=100)
    ap.add_argument("--subqueues", default="1,1000,100000")
    ap.add_argument("--batch", type=int, default=100)
    args = ap.parse_args()
    counts = [int(x) for x in args.subqueues.split(",")]
    print(f"scheduler: {args.entries} entries, {args.counters} counters, "
          f"{args.pickups} timed pickups per run, results in batches of {args.batch}")
    results = {}
    for n in counts:
        results[n] = run(n, args.entries, args.pickups, args.counters, args.batch)
        gc.collect()
    def label(n: int) -> str:
        return f"{n // 1000}k" if n >= 1000 and n % 1000 == 0 else str(n)

    first, last = results[counts[0]], results[counts[-1]]
    if len(counts) > 2:
        # With one sub-queue, it takes the free slots in a row; from a few
        # sub-queues on, round robin visits another sub-queue each time.
        # This ratio compares runs that do the same work per pickup.
        middle = results[counts[1]]
        print(f"pickups_per_s_{label(counts[1])}={middle:.0f} "
              f"ratio_{label(counts[-1])}_vs_{label(counts[1])}={last / middle:.2f}")
    print(f"pickups_per_s_{label(counts[0])}={first:.0f} "
          f"pickups_per_s_{label(counts[-1])}={last:.0f} ratio={last / first:.2f}")


if __name__ == "__main__":
    main()
