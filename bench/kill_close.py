"""Kill to close: how long after SIGKILL the peer of a process's socket sees it close.

A process killed with SIGKILL closes its files only after the kernel has
freed its memory (do_exit: the address space goes before the file table),
so a next hop that answers meanwhile answers a sender that is gone: the
"no reply" window of bench/harsh_kill.py.  This runs a child that holds a
loopback connection, optionally with some threads and some megabytes of
touched memory, kills it and waits for EOF, --rounds times per shape.

    .venv/bin/python bench/kill_close.py [--rounds 15] [--megabytes 0,40,80]
                                         [--threads 1,8]
"""

from __future__ import annotations

import argparse
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


def kill_to_eof(threads: int, megabytes: int) -> float:
    with socket.socket() as srv:
        srv.bind(("127.0.0.1", 0))
        srv.listen()
        child = subprocess.Popen([sys.executable, "-c", CHILD, str(srv.getsockname()[1]),
                                  str(threads), str(megabytes)])
        conn, _ = srv.accept()
        with conn:
            conn.recv(1)  # the child is ready: memory touched, threads started
            time.sleep(0.1)
            started = time.perf_counter()
            os.kill(child.pid, signal.SIGKILL)
            conn.recv(1)  # EOF
            took = time.perf_counter() - started
        child.wait()
    return took


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument("--megabytes", default="0,40,80")
    ap.add_argument("--threads", default="1,8")
    args = ap.parse_args()
    print(f"load {Path('/proc/loadavg').read_text().split()[:3]}")
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
