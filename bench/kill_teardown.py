"""Kill teardown: where the time from SIGKILL to a killed serve's sockets closing goes.

A duplicate of the "no reply" kind (bench/harsh_kill.py) needs the next
hop to answer between the SIGKILL and the moment the killed queue
manager's connections close.  This starts `sluice serve` (SQLite unless
--store) with four deliveries waiting at a sink that answers after 3 s,
kills its process group with SIGKILL, and reads the kernel's tracepoints
around the kill (tracefs, so it needs root): when each process's last
thread began to exit (sched_process_exit with group_dead), and when the
manager's TCP connections went to FIN_WAIT1, which is when the next hop
sees them close.  --rounds times.

    sudo .venv/bin/python bench/kill_teardown.py [--store sqlite] [--rounds 6] [-v]

Prints per round: the milliseconds from the SIGKILL to the manager's last
thread beginning to exit, and to its first and last FIN; then the medians.
With -v every traced event of the group, named by its process (the
receiver and the resource tracker die beside the manager, on the same two
cores).  The sink answering the deliveries is a thread of this process,
idle while it waits: the times are the kernel's, not the sink's.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import re
import signal
import smtplib
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import harsh_kill

from sluice.sink import Behaviour, Sink

TRACING = Path("/sys/kernel/tracing")
EVENTS = ("signal/signal_generate", "sched/sched_process_exit", "sock/inet_sock_set_state")
LINE = re.compile(r"\s*(.+?)-(\d+)\s+\[(\d+)\].*?\s([\d.]+): (\w+): (.*)")


def tracefs() -> bool:
    if not (TRACING / "events").exists():
        with contextlib.suppress(OSError):
            subprocess.run(["mount", "-t", "tracefs", "nodev", str(TRACING)], check=True,
                           capture_output=True)
    return (TRACING / "events").exists()


def tracing(on: bool) -> None:
    if on:
        (TRACING / "trace").write_text("")
        (TRACING / "buffer_size_kb").write_text("8192")
    for ev in EVENTS:
        (TRACING / "events" / ev / "enable").write_text("1" if on else "0")
    (TRACING / "tracing_on").write_text("1" if on else "0")


def one_round(serve: harsh_kill.Serve, port: int, n: int, verbose: bool
              ) -> tuple[float, float, float]:
    """(the manager's last thread exiting, its first FIN, its last FIN), ms after the SIGKILL.

    Only the serve group's processes count: their exits, and the FINs
    their threads sent (a thread's pid is its own; ``group`` maps it to
    its process through /proc before the kill).
    """
    serve.start()
    for i in range(4):
        with smtplib.SMTP("127.0.0.1", port, timeout=10) as client:
            client.sendmail("a@x.example", [f"r{n}-{i}@d.example"], b"Subject: x\r\n\r\nx\r\n")
    time.sleep(1.0)  # the four are at the sink, which answers after 3 s
    assert serve.proc is not None
    manager = serve.proc.pid
    group = threads_of_group(manager)
    try:
        tracing(True)
        time.sleep(0.05)
        os.killpg(manager, signal.SIGKILL)
        serve.proc.wait()
        serve.proc = None
        time.sleep(0.1)
    finally:
        tracing(False)
    start = None
    last_thread = first_fin = last_fin = float("nan")
    for line in (TRACING / "trace").read_text().splitlines():
        m = LINE.match(line)
        if not m:
            continue
        comm, tid_s, _cpu, ts_s, ev, rest = m.groups()
        ts, tid = float(ts_s), int(tid_s)
        if ev == "signal_generate" and "sig=9 " in rest and start is None:
            start = ts
        if start is None or tid not in group:
            continue
        at = (ts - start) * 1000
        if ev == "sched_process_exit" and "group_dead=true" in rest and group[tid] == manager:
            last_thread = at
        elif (ev == "inet_sock_set_state" and rest.endswith("newstate=TCP_FIN_WAIT1")
              and group[tid] == manager):
            if first_fin != first_fin:  # NaN: the first one
                first_fin = at
            last_fin = at
        if verbose and ev != "signal_generate":
            who = "manager" if group[tid] == manager else f"process {group[tid]}"
            print(f"    {at:7.2f} ms {comm}-{tid} ({who}) {ev} {rest.split(' saddr=')[0][:80]}")
    return last_thread, first_fin, last_fin


def threads_of_group(leader: int) -> dict[int, int]:
    """Every thread of the process group led by ``leader``: thread id -> process id."""
    out: dict[int, int] = {}
    pids = subprocess.run(["pgrep", "-g", str(leader)], capture_output=True, text=True).stdout
    for pid in map(int, pids.split()):
        with contextlib.suppress(OSError):
            for task in Path(f"/proc/{pid}/task").iterdir():
                out[int(task.name)] = pid
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    ap.add_argument("--store", default="sqlite", choices=("sqlite", "fs", "kv", "postgres"))
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("-v", action="store_true", help="print every traced event")
    args = ap.parse_args()
    if os.geteuid() != 0 or not tracefs():
        print("kill_teardown: needs root and tracefs (/sys/kernel/tracing)")
        return 2
    sink = Sink(default=Behaviour("slow", seconds=3.0))
    sink_port = sink.start_in_thread()
    work = Path(tempfile.mkdtemp(prefix="kill-teardown-"))
    port = harsh_kill.free_port()
    config = harsh_kill.write_config(work, port, sink_port, 4, args.store)
    serve = harsh_kill.Serve(config)
    print(f"kill teardown: store {args.store}, {args.rounds} rounds; load "
          f"{harsh_kill.loadavg()}")
    lasts: list[float] = []
    firsts: list[float] = []
    ends: list[float] = []
    try:
        for n in range(args.rounds):
            last, first, end = one_round(serve, port, n, args.v)
            print(f"  round {n + 1}: the manager's last thread exits at {last:.2f} ms, its "
                  f"FINs at {first:.2f}-{end:.2f} ms")
            for into, value in ((lasts, last), (firsts, first), (ends, end)):
                if value == value:
                    into.append(value)
    finally:
        if serve.proc is not None:
            serve.kill()
        sink.stop_thread()
    if not firsts:
        print("  no FIN of the manager was traced")
        return 1
    print(f"  medians: the manager's last thread exits {statistics.median(lasts):.2f} ms, "
          f"first FIN {statistics.median(firsts):.2f} ms, last FIN "
          f"{statistics.median(ends):.2f} ms after the SIGKILL; load {harsh_kill.loadavg()}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
