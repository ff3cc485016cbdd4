#!/usr/bin/env python3
"""Driver of one many-destinations run: injector -> MTA -> one smtp-sink for 127.10.0.0/16.

    python bench/many_run.py --label sluice --mta-port 2528 --mta-pid PID
        [--n 20000] [--sessions 20] [--domains 10000] [--size 1024]
        [--queue-dir DIR ...] --workdir DIR [--quiet-wait 60]

It is the shared harness's e2e_run.py (../shared/bench, imported from where
it is: the idle wait, /proc snapshots, CPU accounting per process tree,
contamination test) with two parts changed for this mix:

  * the mail comes from bench/many_inject.py, not smtp-source: round robin
    over D domains dK.test, each routed by the MTA to its own 127.10.X.Y;
  * smtp-sink listens on 0.0.0.0:<sink-port> so that it receives for every
    next hop.  That is allowed only inside a private network namespace
    holding nothing but lo (bench/many_routes.py): the driver checks and
    refuses otherwise.

Times as in the harness: accept = go -> the injector exited with all N
accepted; e2e = go -> the sink counted N transactions.  The last line has
the harness's fields (so bench/e2e.py reads both alike) and two more:
inject_cpu_s (the injector's own CPU from the go) and load (/proc/loadavg).
Exit status non-zero on any failure.
"""

from __future__ import annotations

import argparse
import os
import resource
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import many_routes
from harness import harness_dir

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(harness_dir()))

import e2e_run as h  # noqa: E402  (the shared harness, used from where it is)


class AnySink(h.Sink):
    """The harness's smtp-sink counter, listening on every address of the namespace.

    It keeps no pid file: the harness's /tmp/e2e-sink.pid belongs to runs of
    e2e_run.py, which may go on beside this one in another namespace.
    """

    def __init__(self, port: int, workdir: str, backlog: int = 1024) -> None:
        many_routes.check_private_netns()
        self.out_path = os.path.join(workdir, "sink.out")
        self.out = open(self.out_path, "wb")  # noqa: SIM115  (closed in stop())
        cmd = ["smtp-sink", "-c", "-u", "nobody", f"0.0.0.0:{port}", str(backlog)]
        self.proc = subprocess.Popen(cmd, stdout=self.out, stderr=subprocess.STDOUT)
        self.fd = os.open(self.out_path, os.O_RDONLY)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(5)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        os.close(self.fd)
        self.out.close()


def answers(addr: str, port: int) -> bool:
    """True when a 220 greeting comes from addr:port."""
    try:
        with socket.create_connection((addr, port), timeout=5) as s:
            return s.recv(512).startswith(b"220")
    except OSError:
        return False


def loadavg() -> str:
    with open("/proc/loadavg") as f:
        return f.read().split()[0]


def measure(a: argparse.Namespace, sink: AnySink) -> dict[str, object]:
    """One run, from the idle wait to the sink's last count (see the module doc)."""
    if not h.wait_port(a.sink_port) or sink.proc.poll() is not None:
        said = Path(sink.out_path).read_text(errors="replace")[-500:]
        raise RuntimeError(f"smtp-sink did not come up: {said}")
    far = many_routes.nexthop(a.domains)
    if not answers(far, a.sink_port):
        raise RuntimeError(f"the sink does not answer on {far}:{a.sink_port}")
    if not h.wait_port(a.mta_port):
        raise RuntimeError(f"MTA not answering 220 on 127.0.0.1:{a.mta_port}")
    if sink.count():
        raise RuntimeError(f"sink already has {sink.count()} messages")
    cmd = [sys.executable, str(HERE / "many_inject.py"), "--port", str(a.mta_port),
           "--n", str(a.n), "--sessions", str(a.sessions), "--domains", str(a.domains),
           "--size", str(a.size), "--timeout", str(a.timeout), "--wait-go"]
    h.log("inject: " + " ".join(cmd))
    inj = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                           stderr=subprocess.PIPE, text=True)
    try:
        assert inj.stdin is not None
        assert inj.stdout is not None
        assert inj.stderr is not None
        bg_busy = h.wait_quiet(a.quiet_wait, a.quiet_secs)
        load = loadavg()
        self0 = resource.getrusage(resource.RUSAGE_SELF)
        ru0 = resource.getrusage(resource.RUSAGE_CHILDREN)
        st0 = h.proc_stat_cpu()
        snap0 = h.snapshot()
        mta0 = h.tree_cpu_s(snap0, a.mta_pid)
        sink0 = sink.cpu_s()
        t0 = time.monotonic()
        inj.stdin.write("go\n")
        inj.stdin.close()
        t_acc = t_e2e = None
        last_report = t0
        while t_acc is None or t_e2e is None:
            now = time.monotonic()
            if t_acc is None and inj.poll() is not None:
                t_acc = now
                if inj.returncode != 0:
                    raise RuntimeError(f"injector failed rc={inj.returncode}: "
                                       f"{inj.stderr.read()[-2000:]}")
            if t_e2e is None and sink.count() >= a.n:
                t_e2e = now
            if a.mta_pid and not os.path.exists(f"/proc/{a.mta_pid}"):
                raise RuntimeError(f"MTA pid {a.mta_pid} died; sink={sink.count()}")
            if now - t0 > a.timeout:
                raise RuntimeError(f"timeout after {a.timeout}s: sink={sink.count()} "
                                   f"accepted_done={t_acc is not None}")
            if now - last_report > 10:
                h.log(f"progress t={now - t0:.1f}s sink={sink.count()}")
                last_report = now
            time.sleep(a.poll)
        st1 = h.proc_stat_cpu()
        snap1 = h.snapshot()
        mta1 = h.tree_cpu_s(snap1, a.mta_pid)
        ours = h.tree_pids(snap1, a.mta_pid) | h.tree_pids(snap1, os.getpid())
        ours |= {os.getpid(), os.getppid()}
        foreign = h.foreign_cpu_s(snap0, snap1, ours)
        kthr = h.kthread_cpu_s(snap0, snap1)
        sink1 = sink.cpu_s()
        ru1 = resource.getrusage(resource.RUSAGE_CHILDREN)
        self1 = resource.getrusage(resource.RUSAGE_SELF)
        inj_line = inj.stdout.read().strip().splitlines()
        inj_fields = dict(kv.split("=", 1) for kv in inj_line[-1].split()[1:]) if inj_line else {}
    finally:
        if inj.poll() is None:
            inj.kill()
            inj.wait()
    qleft = 0
    if a.queue_dir:
        deadline = time.monotonic() + 30
        while (qleft := h.count_files(a.queue_dir)) and time.monotonic() < deadline:
            time.sleep(0.1)
    time.sleep(0.3)
    final = sink.count()
    if qleft:
        raise RuntimeError(f"{qleft} files still in queue dirs after completion")
    if final != a.n:
        raise RuntimeError(f"sink received {final} transactions, expected {a.n}")
    if int(inj_fields.get("accepted", -1)) != a.n:
        raise RuntimeError(f"injector says {inj_fields.get('accepted')} accepted, not {a.n}")

    acc_s, e2e_s = t_acc - t0, t_e2e - t0
    d_total = st1[0] - st0[0]
    d_steal = st1[4] - st0[4]
    busy = 100.0 * (d_total - (st1[1] - st0[1]) - (st1[2] - st0[2]) - d_steal) / d_total
    iow = 100.0 * (st1[2] - st0[2]) / d_total
    src_cpu = (ru1.ru_utime + ru1.ru_stime) - (ru0.ru_utime + ru0.ru_stime)
    drv_cpu = (self1.ru_utime + self1.ru_stime) - (self0.ru_utime + self0.ru_stime)
    win = max(t_acc, t_e2e) - t0
    box_cpu = (d_total - (st1[1] - st0[1]) - (st1[2] - st0[2]) - d_steal) / h.CLK
    other = box_cpu - (mta1 - mta0) - src_cpu - (sink1 - sink0) - drv_cpu
    contaminated = foreign > 0.05 * win * (os.cpu_count() or 1)
    if contaminated:
        h.log("WARNING: other processes used >5% of the box during the run; "
              "this result is contaminated (foreign_cpu_s)")
    h.log(f"box CPU busy {busy:.1f}% of {os.cpu_count()} cores (iowait {iow:.1f}%, steal "
          f"{100.0 * d_steal / d_total:.1f}%) over {win:.2f}s; MTA {mta1 - mta0:.2f} cpu-s, "
          f"injector {src_cpu:.2f} cpu-s, smtp-sink {sink1 - sink0:.2f} cpu-s, driver "
          f"{drv_cpu:.2f} cpu-s, unattributed {other:.2f} cpu-s (kernel threads {kthr:.2f}), "
          f"foreign user processes {foreign:.2f} cpu-s")
    return dict(
        accept_msgs_per_s=f"{a.n / acc_s:.1f}", e2e_msgs_per_s=f"{a.n / e2e_s:.1f}",
        n=a.n, s=a.sessions, r=1, size=a.size, domains=a.domains, keepalive=1,
        accept_s=f"{acc_s:.3f}", e2e_s=f"{e2e_s:.3f}",
        cpu_busy_pct=f"{busy:.1f}", iowait_pct=f"{iow:.1f}",
        mta_cpu_s=f"{mta1 - mta0:.2f}", source_cpu_s=f"{src_cpu:.2f}",
        sink_cpu_s=f"{sink1 - sink0:.2f}", other_cpu_s=f"{other:.2f}",
        kthread_cpu_s=f"{kthr:.2f}", irq_cpu_s=f"{(st1[3] - st0[3]) / h.CLK:.2f}",
        steal_pct=f"{100.0 * d_steal / d_total:.1f}",
        foreign_cpu_s=f"{foreign:.2f}", contaminated=int(contaminated),
        pre_busy_pct=f"{bg_busy:.0f}", window_s=f"{win:.3f}", ncpu=os.cpu_count(),
        inject_cpu_s=inj_fields.get("cpu_s", "nan"), load=load,
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--label", required=True)
    ap.add_argument("--mta-port", type=int, required=True)
    ap.add_argument("--sink-port", type=int, default=2526)
    ap.add_argument("--n", type=int, default=20000)
    ap.add_argument("--sessions", type=int, default=20)
    ap.add_argument("--domains", type=int, default=10000)
    ap.add_argument("--size", type=int, default=1024)
    ap.add_argument("--mta-pid", type=int, default=0, help="root PID of the MTA")
    ap.add_argument("--queue-dir", action="append", default=[],
                    help="dir that must hold no files once done (repeatable)")
    ap.add_argument("--timeout", type=float, default=900.0)
    ap.add_argument("--workdir", required=True)
    ap.add_argument("--poll", type=float, default=0.01)
    ap.add_argument("--quiet-wait", type=float, default=300.0)
    ap.add_argument("--quiet-secs", type=int, default=5)
    a = ap.parse_args()
    os.makedirs(a.workdir, exist_ok=True)
    try:
        sink = AnySink(a.sink_port, a.workdir)
    except RuntimeError as exc:
        sys.exit(f"many_run: {exc}")
    try:
        res = measure(a, sink)
    except (RuntimeError, OSError) as exc:
        h.log(f"FAIL: {exc}")
        sys.exit(1)
    finally:
        sink.stop()
    print(a.label + " " + " ".join(f"{k}={v}" for k, v in res.items()), flush=True)


if __name__ == "__main__":
    main()
