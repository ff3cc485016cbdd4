#!/usr/bin/env python3
"""The price of sharing limits: one node with local limits, one with Redis, three with Redis.

    .venv/bin/python bench/cluster_bench.py [--runs 5] [--n 3000] [--sessions 20]
                                            [--decisions 2000]

Each run starts the nodes fresh (`sluice serve`, queue on a throwaway
PostgreSQL -- a new database per run -- and, where named, limits in a
throwaway Redis) and injects N x 1 KB messages with Postfix's smtp-source
(N/k to each of the k nodes, `sessions` sessions in all), all for one
recipient domain whose policy is `concurrency: 20` (for the whole cluster
where shared) and a rate high enough never to hold (`100000/1`, but asked
of Redis like any rate).  The nodes relay to a sink in this process.
Throughput is end to end: first connection of the injection to the last
message at the sink.  CPU per message is the CPU time of every process of
every node (receivers included), from /proc, divided by N.

    local1   one node, limits its own (no cluster.redis)
    local1-nojournal  the same with queue.success_journal false (the
             success journal's price or gain on PostgreSQL's default)
    redis1   one node, limits in Redis
    redis3   three nodes, limits in Redis, on the same 2-core machine

Runs are interleaved (local1, redis1, redis3, local1, ...) and the medians
of each are printed with /proc/loadavg at each run's start.  Then the cost
of one shared-limit decision: `decisions` calls of SharedLimits.acquire
against the same Redis with a batch of 1 and of 64 requests (concurrency
and rate), median and 90th percentile in microseconds; and the scheduler's
own cost of the cluster seam, from the same synthetic pickups as
bench/scheduler_bench.py is not measured here (see docs/benchmarks.md).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psycopg
import yaml
from procfs import proc_stats

from sluice._loopback import free_port
from sluice.cluster._redisserver import RedisServer
from sluice.cluster.shared_limits import SharedLimits
from sluice.scheduler import AcquireGrants, GrantRequest, Rate
from sluice.sink import Sink
from sluice.store._pgserver import PgServer

SLUICE = str(Path(sys.executable).parent / "sluice")
SMTP_SOURCE = shutil.which("smtp-source") or "/usr/sbin/smtp-source"
POLICY = "- fields: [recipientdomain]\n  concurrency: 20\n  rate: 100000/1\n"
DOMAIN = "bench.example"
CLK = os.sysconf("SC_CLK_TCK")


def loadavg() -> str:
    return Path("/proc/loadavg").read_text().split()[0]


def cpu_of_groups(pgids: set[int]) -> float:
    """CPU seconds (user + system) of every live process in these process groups."""
    total = 0
    for _pid, fields in proc_stats():
        if int(fields[2]) in pgids:  # pgrp
            total += int(fields[11]) + int(fields[12])  # utime, stime
    return total / CLK


def start_node(work: Path, name: str, dsn: str, redis_url: str | None, sink_port: int,
               journal: object = "auto") -> tuple[subprocess.Popen[bytes], int]:
    home = work / name
    home.mkdir()
    (home / "policy.yaml").write_text(POLICY)
    port = free_port()
    data: dict[str, object] = {
        "node": {"id": name, "hostname": f"{name}.bench.test"},
        "queue": {"path": str(home / "queue"), "store": "postgres", "postgres": {"dsn": dsn},
                  "success_journal": journal},
        "accounting": {"path": str(home / "log")},
        "smtpd": {"listen": [f"127.0.0.1:{port}"], "processes": 1},
        "scheduler": {"policy": str(home / "policy.yaml")},
        "delivery": {"transport": {"*": f"smtp:[127.0.0.1]:{sink_port}"}},
        "api": {"enabled": False},
    }
    if redis_url:
        data["cluster"] = {"redis": redis_url}
    (home / "sluice.yaml").write_text(yaml.safe_dump(data))
    proc = subprocess.Popen([SLUICE, "-c", str(home / "sluice.yaml"), "serve",
                             "--log-level", "warning"], stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, start_new_session=True)
    assert proc.stdout is not None
    line = proc.stdout.readline().decode()
    if "serving SMTP" not in line:
        raise RuntimeError(f"node {name} did not start: {line}{proc.stdout.read().decode()}")
    return proc, port


def one_run(kind: str, n: int, sessions: int, pg: PgServer, redis: RedisServer, run: int
            ) -> dict[str, float]:
    nodes = 3 if kind == "redis3" else 1
    db = f"bench_{kind.replace('-', '_')}_{run}"
    with psycopg.connect(pg.dsn, autocommit=True) as conn:
        conn.execute(f"DROP DATABASE IF EXISTS {db}")
        conn.execute(f"CREATE DATABASE {db}")
    dsn = pg.dsn.replace("dbname=postgres", f"dbname={db}")
    sink = Sink()
    sink_port = sink.start_in_thread()
    work = Path(tempfile.mkdtemp(prefix="sluice-cluster-bench-"))
    procs: list[subprocess.Popen[bytes]] = []
    try:
        ports = []
        for i in range(nodes):
            proc, port = start_node(work, f"n{i}", dsn,
                                    None if kind.startswith("local1") else redis.url, sink_port,
                                    journal=False if kind == "local1-nojournal" else "auto")
            procs.append(proc)
            ports.append(port)
        pgids = {p.pid for p in procs}
        load = loadavg()
        cpu0 = cpu_of_groups(pgids)
        t0 = time.monotonic()
        share = [n // nodes + (1 if i < n % nodes else 0) for i in range(nodes)]
        per = max(1, sessions // nodes)
        sources = [subprocess.Popen([SMTP_SOURCE, "-s", str(per), "-m", str(share[i]),
                                     "-l", "1024", "-f", "bench@sender.example",
                                     "-t", f"rcpt@{DOMAIN}", f"127.0.0.1:{ports[i]}"],
                                    stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
                   for i in range(nodes)]
        for s in sources:
            s.wait(600)
        accepted_s = time.monotonic() - t0
        deadline = time.monotonic() + 600
        while sink.snapshot().total_delivered < n and time.monotonic() < deadline:
            time.sleep(0.02)
        elapsed = time.monotonic() - t0
        delivered = sink.snapshot().total_delivered
        cpu = cpu_of_groups(pgids) - cpu0
        if delivered < n:
            raise RuntimeError(f"{kind}: only {delivered} of {n} delivered in 600 s")
        return {"msg_s": n / elapsed, "accept_s": n / accepted_s,
                "cpu_ms": 1000 * cpu / n, "load": float(load),
                "peak": float(sink.snapshot().peak_by_domain.get(DOMAIN, 0))}
    finally:
        for p in procs:
            p.send_signal(signal.SIGTERM)
        for p in procs:
            try:
                p.wait(60)
            except subprocess.TimeoutExpired:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait()
            if p.stdout:
                p.stdout.close()
        sink.stop_thread()
        shutil.rmtree(work, ignore_errors=True)


async def decision_cost(url: str, batch: int, count: int) -> tuple[float, float]:
    shared = SharedLimits(url, "bench-decisions")
    reqs = tuple(GrantRequest(f"dec\x1fd{i}.example", 20, Rate(100000, 1.0), None, 1, 1, 0)
                 for i in range(batch))
    cmd = AcquireGrants(reqs)
    times = []
    try:
        for _ in range(50):
            await shared.acquire(cmd, time.time)
        for _ in range(count):
            t = time.perf_counter()
            await shared.acquire(cmd, time.time)
            times.append((time.perf_counter() - t) * 1e6)
    finally:
        await shared.close()
    times.sort()
    return statistics.median(times), times[int(len(times) * 0.9)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--n", type=int, default=3000)
    ap.add_argument("--sessions", type=int, default=20)
    ap.add_argument("--decisions", type=int, default=2000)
    ap.add_argument("--kinds", default="local1,redis1,redis3")
    args = ap.parse_args()
    kinds = args.kinds.split(",")
    pg = PgServer.start()
    redis = RedisServer.start()
    results: dict[str, list[dict[str, float]]] = {k: [] for k in kinds}
    try:
        for run in range(args.runs):
            order = kinds if run % 2 == 0 else list(reversed(kinds))
            for kind in order:
                r = one_run(kind, args.n, args.sessions, pg, redis, run)
                results[kind].append(r)
                print(f"run {run} {kind}: {r['msg_s']:.0f} msg/s end to end, "
                      f"{r['accept_s']:.0f} accepted/s, {r['cpu_ms']:.2f} ms CPU/msg, "
                      f"peak {r['peak']:.0f} connections (limit 20), load {r['load']}",
                      flush=True)
        print(f"\nmedians of {args.runs} runs, {args.n} x 1 KB, {args.sessions} sessions, "
              f"postgres queue, 2-core machine:")
        base = statistics.median(r["msg_s"] for r in results[kinds[0]])
        for kind in kinds:
            rs = results[kind]
            msg = statistics.median(r["msg_s"] for r in rs)
            print(f"  {kind:16s} {msg:7.0f} msg/s ({msg / base:.2f}x {kinds[0]}), "
                  f"{statistics.median(r['cpu_ms'] for r in rs):.2f} ms CPU/msg, "
                  f"peak {max(r['peak'] for r in rs):.0f}, "
                  f"load {statistics.median(r['load'] for r in rs):.2f}")
        for batch in (1, 64):
            med, p90 = asyncio.run(decision_cost(redis.url, batch, args.decisions))
            print(f"shared-limit decision, batch of {batch}: median {med:.0f} us, "
                  f"p90 {p90:.0f} us per round trip ({med / batch:.1f} us per request)")
    finally:
        redis.stop()
        pg.stop()


if __name__ == "__main__":
    main()
