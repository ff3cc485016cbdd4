#!/usr/bin/env python3
"""Tenant fairness: a small tenant's queue time behind a big tenant's backlog.

    .venv/bin/python bench/tenant_bench.py [--big 200000] [--small 1000] [--jobs 100]
                                           [--concurrency 10] [--service 0.05]

Tenant A queues ``--big`` messages in ``--jobs`` campaigns (each its own job
id, so its own sub-queue) and tenant B ``--small`` messages in one, all for
one destination whose policy allows ``--concurrency`` deliveries at once;
every delivery takes ``--service`` seconds.  The scheduler runs on a
simulated clock (no store, no network: this measures the pickup order
alone), once with tenants sharing by deficit round robin at equal weights
(the default) and once with ``fair: false`` (plain round robin over
sub-queues, as before tenants had shares).  Printed: B's median and 99th
percentile queue time (arrival to the end of its delivery), and when its
last message went, in simulated seconds, with the wall time of each run.

What it does not cover: the refill from the store.  Everything is in the
active queue here; a backlog larger than maxmemoryqueue is still claimed
oldest first, whatever its tenant (see docs/scheduler.md, Tenant shares).
"""

from __future__ import annotations

import argparse
import heapq
import statistics
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
    parse_policy,
)
from sluice.scheduler.tenants import Shares  # noqa: E402

OK = Delivered(Reply(250, "2.0.0", "ok"))


def run(fair: bool, big: int, small: int, jobs: int, concurrency: int, service: float
        ) -> tuple[list[float], float]:
    policy = parse_policy([{"fields": ["recipientdomain"], "concurrency": concurrency}])
    settings = Settings(max_deliveries=100_000, maxmemoryqueue=big + small + 10,
                        initial_destination_concurrency=concurrency,
                        default_destination_concurrency_limit=concurrency,
                        shares=Shares(fair=fair))
    sched = Scheduler(settings, policy)
    queued = [DeliveryJob(f"a{i}", f"a{i}", (f"a{i}-0",),
                          Route("gmail.example", tenantid="A", jobid=f"campaign{i % jobs}"))
              for i in range(big)]
    queued += [DeliveryJob(f"b{i}", f"b{i}", (f"b{i}-0",),
                           Route("gmail.example", tenantid="B", jobid="receipts"))
               for i in range(small)]
    finishing: list[tuple[float, int, StartDelivery]] = []
    seq = 0
    b_done: list[float] = []
    now = 0.0

    def start(cmds: list[object]) -> None:
        nonlocal seq
        for c in cmds:
            if isinstance(c, StartDelivery):
                seq += 1
                heapq.heappush(finishing, (now + service, seq, c))

    start(sched.handle(JobsQueued(tuple(queued)), now))
    while finishing and len(b_done) < small:
        now, _, c = heapq.heappop(finishing)
        if c.job.route.tenantid == "B":
            b_done.append(now)
        start(sched.handle(DeliveryFinished(c.job.ref, ((c.qids[0], OK),)), now))
    return b_done, now


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--big", type=int, default=200_000)
    ap.add_argument("--small", type=int, default=1000)
    ap.add_argument("--jobs", type=int, default=100)
    ap.add_argument("--concurrency", type=int, default=10)
    ap.add_argument("--service", type=float, default=0.05)
    args = ap.parse_args()
    load = Path("/proc/loadavg").read_text().split()[0]
    print(f"A: {args.big} messages in {args.jobs} jobs; B: {args.small} in 1 job; one "
          f"destination, concurrency {args.concurrency}, {args.service * 1000:.0f} ms a "
          f"delivery (simulated clock); load {load}")
    results = {}
    for fair in (True, False):
        t0 = time.perf_counter()
        done, _ = run(fair, args.big, args.small, args.jobs, args.concurrency, args.service)
        wall = time.perf_counter() - t0
        done.sort()
        med = statistics.median(done)
        p99 = done[int(len(done) * 0.99) - 1]
        results[fair] = (med, p99, done[-1])
        label = "fair (DRR, equal weights)" if fair else "fair: false (round robin)"
        print(f"  {label:28s} B median {med:8.1f} s  p99 {p99:8.1f} s  last {done[-1]:8.1f} s"
              f"   ({len(done)} of B delivered; {wall:.1f} s wall)")
    f, u = results[True], results[False]
    print(f"B's median queue time: {u[0] / f[0]:.0f}x shorter with tenant shares; "
          f"p99 {u[1] / f[1]:.0f}x")


if __name__ == "__main__":
    main()
