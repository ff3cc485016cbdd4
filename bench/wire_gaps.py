#!/usr/bin/env python3
"""Where a relay's connections wait: the gaps between SMTP packets on loopback.

    .venv/bin/python bench/wire_gaps.py [--port 2526] [--seconds 1]   (root: a raw socket)
    .venv/bin/python bench/wire_gaps.py --read FILE                   (a capture kept with --keep)

Captures, for ``--seconds``, every TCP segment with data to or from
``--port`` on the loopback interface (an AF_PACKET socket bound to lo),
then prints, per kind of step, how long a connection went between two
packets: from the next hop's reply to the client's next command, from the
client's command to the reply.  Run it against the sink while a bench
(bench/e2e.py) drives a relay through it: a long gap from a 354 to the
content is the relay waiting before it sends the message, one from a
final 250 to the next MAIL the relay settling the last one and starting
the next.  A packet is named by its first bytes (``250 2.0.0``, ``MAIL
FROM``, ``Received:``), which is what smtp-sink and Sluice send.

Only loopback is read, and only segments of the one port.  The capture
costs CPU on a busy machine (a Python loop per packet): it slows what it
measures a little, so compare gaps, not rates, and take them in the same
way each time.
"""

from __future__ import annotations

import argparse
import collections
import itertools
import socket
import statistics
import struct
import sys
import time
from collections.abc import Iterable, Sequence

Packet = tuple[float, int, int, bytes]  # time, source port, destination port, first bytes


def capture(port: int, seconds: float) -> list[Packet]:
    """TCP segments with data to or from ``port`` on lo, for ``seconds``."""
    s = socket.socket(socket.AF_PACKET, socket.SOCK_RAW, socket.ntohs(0x0003))
    s.bind(("lo", 0))
    s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 64 << 20)
    s.settimeout(0.1)
    out: list[Packet] = []
    end = time.monotonic() + seconds
    try:
        while time.monotonic() < end:
            try:
                pkt, addr = s.recvfrom(65535)
            except TimeoutError:
                continue
            if addr[2] == socket.PACKET_OUTGOING:
                continue  # lo hands every packet over twice
            at = time.monotonic()
            if pkt[12:14] != b"\x08\x00" or pkt[23] != 6:  # IPv4, TCP
                continue
            tcp = 14 + (pkt[14] & 15) * 4
            sport, dport = struct.unpack("!HH", pkt[tcp:tcp + 4])
            if port not in (sport, dport):
                continue
            payload = pkt[tcp + (pkt[tcp + 12] >> 4) * 4:]
            if payload:
                out.append((at, sport, dport, payload[:12]))
    finally:
        s.close()
    return out


def _kind(first: bytes) -> str:
    """A packet's step: its first word, and the code's class for a reply."""
    text = first.decode("ascii", "replace")
    if text[:3].isdigit():
        return text[:9].strip()  # "250 2.0.0", "354 End d", "250 2.1.0"
    return text.split(" ", 1)[0].split(":", 1)[0].strip().upper() or "?"


def gaps(packets: Iterable[Packet], port: int) -> dict[tuple[str, str], list[float]]:
    """Per (step, next step) of one connection, the gaps between them in ms."""
    conns: dict[int, list[tuple[float, str]]] = collections.defaultdict(list)
    for at, sport, dport, first in packets:
        server = sport == port
        conns[dport if server else sport].append((at, ("S:" if server else "C:")
                                                  + _kind(first)))
    out: dict[tuple[str, str], list[float]] = collections.defaultdict(list)
    for seq in conns.values():
        seq.sort()
        for (t1, k1), (t2, k2) in itertools.pairwise(seq):
            out[(k1, k2)].append((t2 - t1) * 1000.0)
    return out


def table(found: dict[tuple[str, str], list[float]], least: int = 20) -> list[str]:
    """Lines of the gaps seen at least ``least`` times, the largest total first."""
    lines = [f"{'from':>14} -> {'to':<14} {'n':>6} {'median ms':>10} {'p90 ms':>8} "
             f"{'total ms':>9}"]
    for (a, b), v in sorted(found.items(), key=lambda kv: -sum(kv[1])):
        if len(v) < least:
            continue
        p90 = sorted(v)[int(len(v) * 0.9)]
        lines.append(f"{a:>14} -> {b:<14} {len(v):>6} {statistics.median(v):>10.3f} "
                     f"{p90:>8.3f} {sum(v):>9.1f}")
    return lines


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n", 1)[0])
    ap.add_argument("--port", type=int, default=2526, help="the next hop's port (the sink's)")
    ap.add_argument("--seconds", type=float, default=1.0)
    ap.add_argument("--keep", help="also write the packets to this file")
    ap.add_argument("--read", help="analyse a file written by --keep instead of capturing")
    args = ap.parse_args(argv)
    if args.read:
        packets = []
        with open(args.read) as f:
            for line in f:
                at, sport, dport, first = line.rstrip("\n").split(" ", 3)
                packets.append((float(at), int(sport), int(dport), bytes.fromhex(first)))
    else:
        packets = capture(args.port, args.seconds)
        if args.keep:
            with open(args.keep, "w") as f:
                for at, sport, dport, first in packets:
                    f.write(f"{at:.6f} {sport} {dport} {first.hex()}\n")
    found = gaps(packets, args.port)
    print(f"{len(packets)} packets, {len({p[2] if p[1] == args.port else p[1] for p in packets})}"
          " connections")
    print("\n".join(table(found)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
