"""Kill to close: how long after SIGKILL the peer of a process's socket sees it close.

A process killed with SIGKILL closes its files only after the kernel has
freed its memory (do_exit: the address space goes before the file table),
so a next hop that answers meanwhile answers a sender that is gone: the
"no reply" window of bench/harsh_kill.py.  This runs a child that holds a
loopback connection, optionally with some threads and some megabytes of
touched memory, kills it and waits for EOF, --rounds times per shape.

With --fsync-mb N the child instead writes N MB to a file in --dir and is
killed 5 ms into its fsync of it: a thread in an fsync cannot die before
the fsync returns (uninterruptible sleep), and its process's sockets stay
open until then.  (It writes N MB per round: keep it small.)

    .venv/bin/python bench/kill_close.py [--rounds 15] [--megabytes 0,40,80]
                                         [--threads 1,8] [--fsync-mb 0,8 --dir /tmp]
"""

from __future__ import annotations

import argparse
import contextlib
import os
import signal
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

CHILD = r"""
import socket, sys, threading, time
port, threads, mb = map(int, sys.argv[1:4])
blob = bytearray(mb << 20)
for i in range(0, len(blob), 4096):
    blob[i] = 1
for _ in range(threads - 1):
    threading.Thread(target=time.sleep, args=(3600,), daemon=True).start()
s = socket.create_connection(("127.0.0.1", port))
s.sendall(b"r")
time.sleep(3600)
"""

FSYNC_CHILD = r"""
import os, socket, sys, time
port, mb, path = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
s = socket.create_connection(("127.0.0.1", port))
fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
chunk = os.urandom(1 << 20)
for _ in range(mb):
    os.write(fd, chunk)
s.sendall(b"r")
os.fsync(fd)
time.sleep(3600)
"""


def _kill_after_ready(script: str, args: list[str], pause_s: float) -> float:
    """Start ``script`` with its listener's port, wait for its ready byte and
    ``pause_s``, SIGKILL it: the seconds until its connection reads EOF."""
    with socket.socket() as srv:
        srv.bind(("127.0.0.1", 0))
        srv.listen()
        child = subprocess.Popen([sys.executable, "-c", script, str(srv.getsockname()[1]),
                                  *args])
        conn, _ = srv.accept()
        with conn:
            conn.recv(1)  # the child is ready
            time.sleep(pause_s)
            started = time.perf_counter()
            os.kill(child.pid, signal.SIGKILL)
            conn.recv(1)  # EOF
            took = time.perf_counter() - started
        child.wait()
    return took


def kill_to_eof(threads: int, megabytes: int) -> float:
    # Ready: memory touched, threads started.
    return _kill_after_ready(CHILD, [str(threads), str(megabytes)], 0.1)


def kill_in_fsync(megabytes: int, where: str) -> float:
    path = os.path.join(where, f"kill-close-{os.getpid()}.data")
    try:
        # Ready: the data is written; the fsync begins.
        return _kill_after_ready(FSYNC_CHILD, [str(megabytes), path], 0.005)
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument("--megabytes", default="0,40,80")
    ap.add_argument("--threads", default="1,8")
    ap.add_argument("--fsync-mb", default="", help="killed in an fsync of this many MB")
    ap.add_argument("--dir", default="/tmp", help="where --fsync-mb writes")
    args = ap.parse_args()
    print(f"load {Path('/proc/loadavg').read_text().split()[:3]}")
    if args.fsync_mb:
        for mb in map(int, args.fsync_mb.split(",")):
            took = sorted(kill_in_fsync(mb, args.dir) for _ in range(args.rounds))
            print(f"  killed 5 ms into an fsync of {mb:3d} MB: SIGKILL to EOF median "
                  f"{statistics.median(took) * 1000:.1f} ms, mean "
                  f"{statistics.mean(took) * 1000:.1f} ms, max {took[-1] * 1000:.1f} ms")
        return 0
    for threads in map(int, args.threads.split(",")):
        for mb in map(int, args.megabytes.split(",")):
            took = sorted(kill_to_eof(threads, mb) for _ in range(args.rounds))
            print(f"  {threads:2d} threads, {mb:3d} MB touched: SIGKILL to EOF median "
                  f"{statistics.median(took) * 1000:.1f} ms, mean "
                  f"{statistics.mean(took) * 1000:.1f} ms, max {took[-1] * 1000:.1f} ms")
    print(f"load {Path('/proc/loadavg').read_text().split()[:3]}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
