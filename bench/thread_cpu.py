"""Where Sluice's CPU goes, thread by thread: one e2e run, CPU per message of each thread.

    .venv/bin/python bench/thread_cpu.py [--configs base] [--n 20000] [--runs 3]
                                         [--mta sluice|floor|floorsql|floor2p]

    Any of bench/e2e.py's configs; the many-destinations ones (many,
    many1) run in a private network namespace, as there.

STRATEGY
    The same Sluice, configuration and driver as bench/e2e.py (smtp-source
    -> sluice serve -> smtp-sink through the shared harness), but instead of
    a profile, the kernel's own accounting: utime and stime of every thread
    of serve and its receiving processes (/proc/PID/task/TID/stat) just
    before the driver starts and just after it ends, with the voluntary and
    involuntary context switches (/proc/PID/task/TID/status).  That is CPU
    time (its split into user and system sampled per clock tick), where
    py-spy's --gil samples are wall time of whoever holds the GIL: a
    thread the scheduler preempts while it holds the GIL is charged to the
    line it stood on (a socket write, most often, as the write wakes the
    peer), which made a send look like a third of the receiver's work.

    Threads are named by process (manager, receiver N) and by creation
    order; the main thread runs the event loop.  Which thread is the store's
    committer and which its WAL syncer is not in the name: a py-spy
    profile's thread roots hint at it, but --gil undercounts the committer,
    whose SQLite work runs without the GIL; moving work known to run on one
    of them (the received lines run on the syncer) and seeing which thread's
    CPU moves settles it (docs/benchmarks.md).  Runs whose threads differ
    are said to differ (the medians would mix threads).  The table prints
    the median of each column for every thread that used 1 µs a message or
    more; "all" adds those medians up.  Each run line also gives the
    driver's own figures: the CPU of smtp-source, smtp-sink and interrupts a
    message, how busy the CPUs were, serve's CPU as the driver counts it (to
    check the threads' sum against) and whether other processes used CPU
    meanwhile.

    Per run: e2e msg/s, the MTA's CPU per message in all, and per thread
    user and system µs per message and context switches per message.  With
    --runs above 1, the medians per thread.  Each run also prints the load
    and the machine's pace: the best of five timings of a fixed piece of
    pure Python (a sum over a million ints).  On these virtual machines the
    same code has taken 20-50 % more CPU twenty minutes later, with nothing
    else running; the pace says when that happened, and figures of two
    versions are only compared at the same pace, interleaved.  The driver
    waits --quiet-wait seconds (default 5) for an idle machine first.

    --mta floor2p (or floor, floorsql) measures bench/relay_floor.py
    instead, as bench/e2e.py --floor runs it: the first process, which
    claims and sends, is named "manager" as Sluice's is, the one that
    receives "receiver 1", so that the two tables line up thread by thread.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import time
from pathlib import Path

import e2e
from procfs import stat_fields

TICK = os.sysconf("SC_CLK_TCK")


def pace_ms() -> float:
    """The machine's pace now: the best of five sums over a million ints, in ms."""
    best = float("inf")
    for _ in range(5):
        t0 = time.perf_counter()
        sum(range(1_000_000))
        best = min(best, time.perf_counter() - t0)
    return 1e3 * best


def threads_of(pids: list[int]) -> dict[tuple[int, int], tuple[int, int, int, int]]:
    """(pid, tid) -> (utime, stime, voluntary, involuntary switches) of every live thread."""
    out = {}
    for pid in pids:
        try:
            tids = sorted(int(t) for t in os.listdir(f"/proc/{pid}/task"))
        except FileNotFoundError:
            continue
        for tid in tids:
            try:
                fields = stat_fields(f"/proc/{pid}/task/{tid}/stat")
                status = Path(f"/proc/{pid}/task/{tid}/status").read_text()
            except OSError:
                continue
            switches = {k: int(v) for k, _, v in (line.partition(":\t")
                                                  for line in status.splitlines())
                        if k in ("voluntary_ctxt_switches", "nonvoluntary_ctxt_switches")}
            out[(pid, tid)] = (int(fields[11]), int(fields[12]),
                               switches["voluntary_ctxt_switches"],
                               switches["nonvoluntary_ctxt_switches"])
    return out


def labels(serve: int, keys: list[tuple[int, int]]) -> dict[tuple[int, int], str]:
    """A name per thread: its process's role and its place among the process's threads."""
    roles: dict[int, str] = {}
    seen: dict[int, int] = {}  # threads named so far, per process
    out: dict[tuple[int, int], str] = {}
    for pid, tid in sorted(keys):
        if pid not in roles:
            roles[pid] = "manager" if pid == serve else f"receiver {len(roles)}"
        n = seen[pid] = seen.get(pid, -1) + 1
        out[(pid, tid)] = f"{roles[pid]} {'loop' if tid == pid else f'thread {n}'}"
    return out


def cmdline(pid: int) -> str:
    """A process's command line; empty once it has gone."""
    try:
        return Path(f"/proc/{pid}/cmdline").read_text(errors="replace")
    except OSError:
        return ""


def one_run(name: str, n: int, sessions: int, quiet_wait: int, mta: str = "sluice"
            ) -> tuple[dict[str, str], dict[str, tuple[float, ...]]]:
    """One run: (the driver's figures, label -> (user, sys µs, switches a message))."""
    cfg = e2e.CONFIGS[name]
    serving = (e2e.serving(cfg, prefix="sluice-threads-") if mta == "sluice"
               else e2e.floor_serving(cfg, e2e.FLOOR_OPTIONS[mta]))
    with serving as (proc, work):
        time.sleep(1.0)  # the receivers' start-up is not the run's
        pids = [int(p) for p in subprocess.run(["pgrep", "-g", str(proc.pid)], text=True,
                                               capture_output=True).stdout.split()]
        pids = [p for p in pids if "resource_tracker" not in cmdline(p)]
        before = threads_of(pids)
        figures = e2e.drive(proc, work, n, sessions, cfg, quiet_wait, label=mta)
        after = threads_of(pids)
    names = labels(proc.pid, list(after))
    per: dict[str, tuple[float, ...]] = {}
    for key, (u1, s1, v1, i1) in after.items():
        u0, s0, v0, i0 = before.get(key, (0, 0, 0, 0))
        per[names[key]] = (1e6 * (u1 - u0) / TICK / n, 1e6 * (s1 - s0) / TICK / n,
                           (v1 - v0) / n, (i1 - i0) / n)
    return figures, per


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--configs", default="base", help="comma-separated, as bench/e2e.py")
    ap.add_argument("--n", type=int, default=20000)
    ap.add_argument("--sessions", type=int, default=20)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--quiet-wait", type=int, default=5,
                    help="seconds the driver waits for an idle machine before each run")
    ap.add_argument("--store", choices=("sqlite", "fs", "kv"), default="sqlite",
                    help="Sluice's queue.store, as bench/e2e.py --store")
    ap.add_argument("--mta", choices=("sluice", *e2e.FLOOR_OPTIONS), default="sluice",
                    help="Sluice, or one of bench/e2e.py's floors (bench/relay_floor.py)")
    args = ap.parse_args()
    e2e.STORE = args.store
    names = args.configs.split(",")
    for name in names:
        if name not in e2e.CONFIGS:
            raise SystemExit(f"--configs: {name!r} is not one of {', '.join(e2e.CONFIGS)}")
    if any(e2e.CONFIGS[name].get("hops") for name in names):
        # As bench/e2e.py: the many mixes' sink listens on 0.0.0.0, only ever
        # inside a private network namespace holding nothing but lo.
        try:
            e2e.many_routes.enter_private_netns()
        except (RuntimeError, OSError, subprocess.CalledProcessError) as exc:
            raise SystemExit(f"thread_cpu: {exc}") from None
        print("# in a private network namespace (interfaces: lo only), for the "
              "many-destinations configs", flush=True)
    for name in names:
        rates: list[float] = []
        runs: list[dict[str, tuple[float, ...]]] = []
        for i in range(args.runs):
            pace = pace_ms()
            figures, per = one_run(name, args.n, args.sessions, args.quiet_wait, args.mta)
            rate = float(figures["e2e_msgs_per_s"])
            rates.append(rate)
            runs.append(per)
            total = sum(u + s for u, s, _, _ in per.values())
            harness = ", ".join(f"{what} {1e6 * float(figures[key]) / args.n:.0f} µs"
                                for what, key in (("smtp-source", "source_cpu_s"),
                                                  ("smtp-sink", "sink_cpu_s"),
                                                  ("interrupts", "irq_cpu_s")))
            print(f"{name} run {i + 1}: {rate:.0f} msg/s e2e, {args.mta} {total:.0f} µs CPU a "
                  f"message by its threads ({1e6 * float(figures['mta_cpu_s']) / args.n:.0f} "
                  f"by the driver's count); {harness} a message; CPUs "
                  f"{figures['cpu_busy_pct']} % busy; contaminated={figures['contaminated']}; "
                  f"load {os.getloadavg()[0]:.2f}, pace {pace:.1f} ms", flush=True)
        if len({frozenset(per) for per in runs}) > 1:
            print("note: the runs' threads differ; a row's medians may mix threads")
        print(f"\n{name}: medians of {len(runs)} runs, n={args.n}: {statistics.median(rates):.0f} "
              "msg/s e2e\n")
        print(f"{'thread':<22} {'user µs':>8} {'sys µs':>8} {'all µs':>8} "
              f"{'vol. sw':>8} {'invol. sw':>9}   (a message)")
        every = sorted({k for per in runs for k in per})
        total = 0.0
        for label in every:
            cols = [statistics.median(per.get(label, (0.0, 0.0, 0.0, 0.0))[c] for per in runs)
                    for c in range(4)]
            if cols[0] + cols[1] < 1.0:
                continue
            total += cols[0] + cols[1]
            print(f"{label:<22} {cols[0]:8.1f} {cols[1]:8.1f} {cols[0] + cols[1]:8.1f} "
                  f"{cols[2]:8.2f} {cols[3]:9.2f}")
        print(f"{'all':<22} {'':>8} {'':>8} {total:8.1f}")


if __name__ == "__main__":
    main()
