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

Prints per round: the milliseconds from the SIGKILL to each process's last
thread exiting (receivers and the resource tracker first, the manager
last), and to the manager's first and last FIN; then the medians.
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
              ) -> tuple[list[float], float, float]:
    """(each process's last thread exiting, first FIN, last FIN), ms after the SIGKILL."""
    serve.start()
    for i in range(4):
        with smtplib.SMTP("127.0.0.1", port, timeout=10) as client:
            client.sendmail("a@x.example", [f"r{n}-{i}@d.example"], b"Subject: x\r\n\r\nx\r\n")
    time.sleep(1.0)  # the four are at the sink, which answers after 3 s
    assert serve.proc is not None
    manager = serve.proc.pid
    tracing(True)
    time.sleep(0.05)
    os.killpg(manager, signal.SIGKILL)
    serve.proc.wait()
    serve.proc = None
    time.sleep(0.1)
    tracing(False)
    start = None
    dead: list[float] = []
    fins: list[float] = []
    for line in (TRACING / "trace").read_text().splitlines():
        m = LINE.match(line)
        if not m:
            continue
        comm, pid, _cpu, ts_s, ev, rest = m.groups()
        ts = float(ts_s)
        if ev == "signal_generate" and "sig=9 " in rest and start is None:
            start = ts
        if start is None:
            continue
        at = (ts - start) * 1000
        if ev == "sched_process_exit" and "group_dead=true" in rest:
            dead.append(at)
        elif ev == "inet_sock_set_state" and rest.endswith("newstate=TCP_FIN_WAIT1"):
            fins.append(at)
        if verbose and ev != "signal_generate":
            print(f"    {at:7.2f} ms {comm}-{pid} {ev} {rest.split(' saddr=')[0][:80]}")
    return dead, min(fins, default=float("nan")), max(fins, default=float("nan"))


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
    serve = harsh_kill.Serve(config, work / "points.log")
    print(f"kill teardown: store {args.store}, {args.rounds} rounds; load "
          f"{harsh_kill.loadavg()}")
    lasts, firsts, ends = [], [], []
    try:
        for n in range(args.rounds):
            dead, first, last = one_round(serve, port, n, args.v)
            print(f"  round {n + 1}: last threads exit at "
                  + ", ".join(f"{d:.2f}" for d in dead)
                  + f" ms; manager's FIN {first:.2f}-{last:.2f} ms")
            if dead:
                lasts.append(dead[-1])
            firsts.append(first)
            ends.append(last)
    finally:
        if serve.proc is not None:
            serve.kill()
        sink.stop_thread()
    print(f"  medians: the last process begins to exit {statistics.median(lasts):.2f} ms, "
          f"first FIN {statistics.median(firsts):.2f} ms, last FIN "
          f"{statistics.median(ends):.2f} ms after the SIGKILL; load {harsh_kill.loadavg()}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
