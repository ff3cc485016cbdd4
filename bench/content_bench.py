#!/usr/bin/env python3
"""The per-byte work on a big message's way through Sluice, without the network.

    .venv/bin/python bench/content_bench.py [--size 102400] [--repeat 7] [--n 300]

Times, in this process, the Python work that grows with a message's size:
  receive   the search for the end mark in each DATA piece (as the
            receiver's Inbox does), the pieces through the Unstuffer
            (dot-stuffing) and the MessageBuffer, as sluice.smtpd.session does
  spool     FsSpool.write of the text to a spool on /dev/shm (no fsync: the
            system calls and copies, not the disk)
  send      DataEncoder.feed over the text in READ_SIZE chunks, as the SMTP
            client does before each write
and the per-recipient address check of the receiving side (parse_path).
The text is mail-like: lines of about 80 bytes with periods, angle brackets
and quotes, CRLF line ends, no line starting with a period.  Each figure is
the minimum over --repeat rounds of --n messages, in microseconds per
message (CPU time of this process, so another program on the machine moves
it less than a wall-clock rate).  Run it in two checkouts to compare code.
"""

from __future__ import annotations

import argparse
import os
import shutil
import tempfile
import time

from sluice.delivery.client import READ_SIZE

try:  # the inbox's search (sluice._wirescan, 2026-11-30); before it, its regular expression
    from sluice._wirescan import end_mark
except ImportError:  # an older checkout, to compare with
    import re

    _END = re.compile(rb"\.\r\n")

    def end_mark(buf: bytes | bytearray, start: int) -> int:
        """The index just past the first .CRLF at or after start, or -1."""
        found = _END.search(buf, start)
        return -1 if found is None else found.end()
from sluice.delivery.encoder import DataEncoder
from sluice.smtpd.content import MessageBuffer, Unstuffer
from sluice.smtpd.envelope import parse_path
from sluice.spool.fs import FsSpool

LINE = b'The quick brown fox jumps over the lazy dog. <a href="http://x.example/">link</a>\r\n'
PIECE = 65536  # what the receiver's Inbox hands out at most (LINE_READ_MAX)


def text_of(size: int) -> bytes:
    body = (LINE * (size // len(LINE) + 1))[:size]
    return b"Subject: bench\r\n\r\n" + body[: body.rfind(b"\r\n") + 2]


def best(fn, n: int, repeat: int) -> float:
    times = []
    for _ in range(repeat):
        t = time.process_time()
        for _ in range(n):
            fn()
        times.append((time.process_time() - t) / n)
    return min(times) * 1e6


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--size", type=int, default=102400)
    ap.add_argument("--repeat", type=int, default=7)
    ap.add_argument("--n", type=int, default=300)
    a = ap.parse_args()
    text = text_of(a.size)
    raw = text + b".\r\n"
    pieces = [raw[i : i + PIECE] for i in range(0, len(raw), PIECE)]

    def receive() -> None:
        unstuff, buf = Unstuffer(), MessageBuffer(1 << 30, 0)
        for piece in pieces:
            end_mark(piece, 0)
            out, _ended = unstuff.feed(piece)
            buf.write(out)
        buf.header_block()
        buf.content(b"Received: by bench\r\n")

    root = tempfile.mkdtemp(prefix="content-bench-", dir="/dev/shm")
    spool = FsSpool(os.path.join(root, "spool"), sync_method="fsync")
    chunks = [text[i : i + PIECE] for i in range(0, len(text), PIECE)]

    def spool_write() -> None:
        f = spool.write(chunks)
        spool.discard(f)

    def send() -> None:
        enc = DataEncoder(998)
        for i in range(0, len(text), READ_SIZE):
            enc.feed(text[i : i + READ_SIZE])
        enc.finish()

    def addresses() -> None:
        for _ in range(5):
            parse_path("<someone.with.a.long.name@mail.example.com> SIZE=102400")

    try:
        figures = {"receive": best(receive, a.n, a.repeat),
                   "spool": best(spool_write, a.n, a.repeat),
                   "send": best(send, a.n, a.repeat),
                   "parse_path_x5": best(addresses, a.n * 10, a.repeat)}
    finally:
        shutil.rmtree(root, ignore_errors=True)
    with open("/proc/loadavg") as f:
        load = f.read().split()[0]
    print(" ".join(f"{k}_us={v:.1f}" for k, v in figures.items())
          + f" size={len(text)} load={load}")


if __name__ == "__main__":
    main()
