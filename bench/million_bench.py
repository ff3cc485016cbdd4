#!/usr/bin/env python3
"""A million queued recipients: `serve` memory, qcount, qlist, restart after SIGKILL.

    nice -n 10 .venv/bin/python bench/million_bench.py --store sqlite|fs|kv|postgres
        [--sizes 10000,100000,1000000] [--rcpts 10] [--dir /var/tmp/x] [--keep]

For one store flavour, the queue is filled (through the store's own
submit API, 500 submissions in flight, as `serve`'s receivers would have
written it) to each size in turn -- the same directory grows from one
size to the next -- with messages of ``--rcpts`` recipients in 50 domains
d0..d49.example.  Then, at each size:

1. `sluice serve` starts on it with every domain routed to a loopback
   "blackhole": a listener that accepts connections and never says a
   word, so the deliveries hang in the greeting (timeout 300 s) and the
   queue stays at its size, the active queue full (``maxmemoryqueue``).
   Once the RSS of serve's processes has settled (its sum moved less than
   2 % over 5 s), it is reported with the main process's alone.
2. `sluice qcount` and `sluice qlist` run against the queue while serve
   runs: wall and CPU time of qcount; qlist's time to its first line and
   to its end, its CPU time and its line count.
3. serve's process group is killed with SIGKILL, and serve is started
   again on the same queue with d0.example and new.example routed to a
   loopback sink (sluice.sink).  From the moment it is started: the time
   until an SMTP client gets 250 for a new message to new.example
   (retried every 0.1 s), until the first queued message (d0.example)
   reaches the sink, and until the new message does.

One line of figures per flavour and size, with the machine's load
(/proc/loadavg) at the start and end of the measurement.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import resource
import shutil
import signal
import smtplib
import socket
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import yaml

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "src"))

from procfs import proc_stats  # noqa: E402

from sluice.config import load_config  # noqa: E402
from sluice.model import Submission  # noqa: E402
from sluice.sink import Sink  # noqa: E402
from sluice.store import Store, open_store  # noqa: E402

SLUICE = str(Path(sys.executable).parent / "sluice")
DOMAINS = 50
MAXMEMORYQUEUE = 10000
GIVE_UP_S = 60.0


def loadavg() -> str:
    return " ".join(Path("/proc/loadavg").read_text().split()[:3])


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class Blackhole:
    """Accepts connections on loopback and holds them without a word."""

    def __init__(self) -> None:
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(4096)
        self.port = int(self.sock.getsockname()[1])
        self.held: list[socket.socket] = []
        self._thread = threading.Thread(target=self._accept, daemon=True)
        self._thread.start()

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            self.held.append(conn)

    def drop(self) -> None:
        """Close what it holds (after a serve is gone)."""
        held, self.held = self.held, []
        for conn in held:
            conn.close()


def write_config(base: Path, flavour: str, port: int, routes: dict[str, str],
                 pg_dsn: str | None) -> Path:
    queue: dict[str, Any] = {"store": flavour, "path": str(base / "queue"),
                             "spool": {"rootpath": str(base / "spool")},
                             "maxmemoryqueue": MAXMEMORYQUEUE}
    if pg_dsn:
        queue["postgres"] = {"dsn": pg_dsn}
    data = {
        "node": {"hostname": "mx.sluice.test", "id": "million"},
        "queue": queue,
        "accounting": {"path": str(base / "log")},
        "smtpd": {"listen": [f"127.0.0.1:{port}"]},
        "api": {"enabled": False},
        "delivery": {"transport": routes},
    }
    path = base / "sluice.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


def queued(store: Store) -> int:
    return store.count().recipients


def fill(store: Store, target: int, rcpts: int) -> float:
    """Submit messages of ``rcpts`` recipients until ``target`` are queued; seconds."""
    have = queued(store)
    body = b"Subject: fill\r\nFrom: fill@example.org\r\n\r\n" + b"y" * 1000 + b"\r\n"
    window: list[Future[Any]] = []
    t0 = time.monotonic()
    last = t0
    i = have // rcpts
    while have < target:
        recipients = tuple(f"user{i}.{k}@d{(i + k) % DOMAINS}.example" for k in range(rcpts))
        window.append(store.submit_future(
            Submission("fill@example.org", recipients, tenantid=f"t{i % 7}"), body, time.time()))
        have += rcpts
        i += 1
        if len(window) >= 500:
            for f in window:
                f.result()
            window.clear()
        if time.monotonic() - last > 10:
            last = time.monotonic()
            print(f"  filled {have}/{target} ({have / max(1, target) * 100:.0f} %)", flush=True)
    for f in window:
        f.result()
    return time.monotonic() - t0


def tree_rss_kb(pid: int) -> tuple[int, int]:
    """VmRSS (KB) of ``pid`` and of it with every descendant."""
    children: dict[int, list[int]] = {}
    for child, fields in proc_stats():
        children.setdefault(int(fields[1]), []).append(child)

    def rss(p: int) -> int:
        try:
            for line in Path(f"/proc/{p}/status").read_text().splitlines():
                if line.startswith("VmRSS:"):
                    return int(line.split()[1])
        except OSError:
            pass
        return 0

    total, todo = 0, [pid]
    while todo:
        p = todo.pop()
        total += rss(p)
        todo.extend(children.get(p, []))
    return rss(pid), total


def start_serve(config: Path, log: Path) -> subprocess.Popen[bytes]:
    return subprocess.Popen([SLUICE, "-c", str(config), "serve"], cwd=config.parent,
                            stdout=log.open("ab"), stderr=subprocess.STDOUT,
                            start_new_session=True)


def kill(proc: subprocess.Popen[bytes]) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()


def settle(proc: subprocess.Popen[bytes], cap_s: float = 180.0) -> tuple[int, int, float]:
    """Wait until the RSS of serve's processes settles; (main KB, all KB, seconds)."""
    t0 = time.monotonic()
    samples: list[int] = []
    main = total = 0
    while time.monotonic() - t0 < cap_s:
        if proc.poll() is not None:
            raise SystemExit(f"serve exited with {proc.returncode}")
        main, total = tree_rss_kb(proc.pid)
        samples.append(total)
        last = samples[-6:]
        if len(samples) >= 15 and max(last) - min(last) < 0.02 * max(last):
            break
        time.sleep(1.0)
    return main, total, time.monotonic() - t0


def run_cli(config: Path, *args: str, limit_s: float = 0.0
            ) -> tuple[float, float, int, float]:
    """(seconds to the first line, seconds to the end, lines, CPU seconds) of one
    sluice command; stopped after ``limit_s`` (0: never), its lines so far."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    t0 = time.monotonic()
    proc = subprocess.Popen([SLUICE, "-c", str(config), *args], stdout=subprocess.PIPE,
                            cwd=config.parent)
    assert proc.stdout is not None
    timer = threading.Timer(limit_s, proc.kill) if limit_s else None
    if timer is not None:
        timer.start()
    first = -1.0
    lines = 0
    for _ in proc.stdout:
        if first < 0:
            first = time.monotonic() - t0
        lines += 1
    if timer is not None:
        timer.cancel()
    if proc.wait() != 0 and not (limit_s and proc.returncode == -signal.SIGKILL):
        raise SystemExit(f"sluice {' '.join(args)} failed: {proc.returncode}")
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    return first, time.monotonic() - t0, lines, cpu


def send_new(port: int) -> bool:
    """One message to new.example; whether it got 250."""
    try:
        with smtplib.SMTP("127.0.0.1", port, timeout=5) as smtp:
            smtp.sendmail("probe@example.org", ["probe@new.example"],
                          b"Subject: probe\r\nFrom: probe@example.org\r\n\r\nprobe\r\n")
        return True
    except (OSError, smtplib.SMTPException):
        return False


def restart(base: Path, flavour: str, port: int, hole: Blackhole, sink: Sink, sink_port: int,
            pg_dsn: str | None) -> tuple[float, float, float]:
    """Start serve again; seconds to 250 for a new message, to the first queued
    message at the sink, to the new message at the sink (-1: not within GIVE_UP_S)."""
    routes = {"*": f"smtp:[127.0.0.1]:{hole.port}",
              "d0.example": f"smtp:[127.0.0.1]:{sink_port}",
              "new.example": f"smtp:[127.0.0.1]:{sink_port}"}
    config = write_config(base, flavour, port, routes, pg_dsn)
    before = len(sink.messages)
    t0 = time.monotonic()
    proc = start_serve(config, base / "serve.log")
    accepted = first_queued = first_new = -1.0
    try:
        while time.monotonic() - t0 < GIVE_UP_S:
            if proc.poll() is not None:
                raise SystemExit(f"serve exited with {proc.returncode} (see {base}/serve.log)")
            if accepted < 0 and send_new(port):
                accepted = time.monotonic() - t0
            for msg in sink.messages[before:]:
                now = time.monotonic() - t0
                if first_queued < 0 and any(r.endswith("@d0.example") for r in msg.recipients):
                    first_queued = now
                if first_new < 0 and "probe@new.example" in msg.recipients:
                    first_new = now
            if accepted >= 0 and first_queued >= 0 and first_new >= 0:
                break
            time.sleep(0.1)
    finally:
        kill(proc)
        hole.drop()
    return accepted, first_queued, first_new


def measure(base: Path, flavour: str, n: int, hole: Blackhole, sink: Sink, sink_port: int,
            pg_dsn: str | None, qlist_limit_s: float) -> str:
    load0 = loadavg()
    port = free_port()
    config = write_config(base, flavour, port, {"*": f"smtp:[127.0.0.1]:{hole.port}"}, pg_dsn)
    proc = start_serve(config, base / "serve.log")
    try:
        main_kb, all_kb, settle_s = settle(proc)
        _, qcount_s, _, qcount_cpu = run_cli(config, "qcount")
        qlist_first, qlist_s, lines, qlist_cpu = run_cli(config, "qlist",
                                                         limit_s=qlist_limit_s)
    finally:
        kill(proc)
        hole.drop()
    accept_s, queued_s, new_s = restart(base, flavour, port, hole, sink, sink_port, pg_dsn)
    return (f"{flavour} N={n}: rss main {main_kb / 1024:.0f} MB, all {all_kb / 1024:.0f} MB "
            f"(maxmemoryqueue {MAXMEMORYQUEUE}, settled in {settle_s:.0f} s); "
            f"qcount {qcount_s:.2f} s ({qcount_cpu:.2f} s CPU); qlist first line "
            f"{qlist_first:.2f} s, all {qlist_s:.1f} s ({qlist_cpu:.1f} s CPU, {lines} lines); "
            f"after SIGKILL: 250 in {accept_s:.1f} s, "
            f"first queued delivered in {queued_s:.1f} s, new delivered in {new_s:.1f} s; "
            f"load {load0} -> {loadavg()}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--store", default="sqlite")
    ap.add_argument("--sizes", default="10000,100000,1000000")
    ap.add_argument("--rcpts", type=int, default=10)
    ap.add_argument("--dir", default=None, help="work directory (default: a temp dir on /var/tmp)")
    ap.add_argument("--keep", action="store_true", help="keep the work directory")
    ap.add_argument("--only-fill", action="store_true")
    ap.add_argument("--no-fill", action="store_true", help="measure the queue as it is")
    ap.add_argument("--qlist-limit", type=float, default=0.0,
                    help="stop qlist after this many seconds and count its lines so far")
    args = ap.parse_args()
    base = Path(args.dir or tempfile.mkdtemp(prefix=f"sluice-million-{args.store}-",
                                            dir="/var/tmp"))
    base.mkdir(parents=True, exist_ok=True)
    base.chmod(0o755)
    pg_dsn = None
    pg = None
    if args.store == "postgres":
        from store_bench import PG  # the same throwaway server or $SLUICE_PG_DSN

        pg = PG
        pg_dsn = pg.dsn_for(base)
    print(f"store={args.store} dir={base} cpus={os.cpu_count()} load {loadavg()}", flush=True)
    hole = Blackhole()
    sink = Sink(keep=True)
    sink_port = sink.start_in_thread()
    try:
        for n in (int(s) for s in args.sizes.split(",")):
            if not args.no_fill:
                config = write_config(base, args.store, free_port(),
                                      {"*": f"smtp:[127.0.0.1]:{hole.port}"}, pg_dsn)
                store = open_store(load_config(config))
                try:
                    fill_s = fill(store, n, args.rcpts)
                    print(f"  fill to {queued(store)}: {fill_s:.0f} s", flush=True)
                finally:
                    store.close()
            if args.only_fill:
                continue
            print(measure(base, args.store, n, hole, sink, sink_port, pg_dsn,
                          args.qlist_limit), flush=True)
    finally:
        sink.stop_thread()
        if pg is not None:
            pg.close()
        if not args.keep:
            shutil.rmtree(base, ignore_errors=True)


if __name__ == "__main__":
    main()
