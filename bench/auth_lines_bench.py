"""What the AUTH hash checks and long-line folding cost.

    .venv/bin/python bench/auth_lines_bench.py [--rounds 5] [--mib 64]

AUTH.  For each scheme, at the cost ``sluice auth hash`` uses, the median
time of one check (Credentials.verify), and the longest the event loop
went without running (a ticker task sleeps 1 ms at a time) while two
checks run, through Credentials.check (the thread pool, as the server
does) and inline on the loop (the peer: what the loop would lose), rounds
interleaved.

Folding.  The DATA encoder over ``--mib`` MiB of CRLF content in 64 KiB
reads, with folding off (0, the pass-through peer) and on (998), rounds
interleaved: clean short lines (what our server spools; folding on must
cost only its check) and HTML-like content with 5,000-character lines.
Prints MiB/s medians, the ratio on/off, and the machine's load.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import time
from pathlib import Path

from sluice.delivery.encoder import DataEncoder
from sluice.smtpd.credentials import HASH_SCHEMES, Credentials, hash_password


def load() -> str:
    return " ".join(Path("/proc/loadavg").read_text().split()[:3])


def check_times(rounds: int) -> None:
    print(f"AUTH check, median of {rounds}, load {load()}")
    for scheme in HASH_SCHEMES:
        creds = Credentials({"u": hash_password("correct horse", scheme)})
        times = []
        for i in range(rounds):
            t = time.perf_counter()
            creds.verify("u", "correct horse" if i % 2 else "wrong")
            times.append(time.perf_counter() - t)
        stalls: dict[bool, list[float]] = {True: [], False: []}
        for _ in range(rounds):
            for off_loop in (True, False):  # interleaved
                stalls[off_loop].append(asyncio.run(_max_stall(creds, 2, off_loop)))
        creds.close()
        print(f"  {scheme:10s} check {statistics.median(times) * 1e3:7.1f} ms   "
              f"loop stall per 2 checks: off-loop {statistics.median(stalls[True]) * 1e3:6.1f}"
              f" ms, inline {statistics.median(stalls[False]) * 1e3:6.1f} ms")


async def _max_stall(creds: Credentials, n: int, off_loop: bool) -> float:
    worst = 0.0
    done = False

    async def ticker() -> None:
        nonlocal worst
        last = time.perf_counter()
        while not done:
            await asyncio.sleep(0.001)
            now = time.perf_counter()
            worst = max(worst, now - last)
            last = now

    task = asyncio.create_task(ticker())
    await asyncio.sleep(0.005)
    if off_loop:
        await asyncio.gather(*(creds.check("u", "wrong") for _ in range(n)))
    else:  # what the check would cost the loop if it ran on it
        for _ in range(n):
            creds.verify("u", "wrong")
        await asyncio.sleep(0.001)
    done = True
    await task
    return worst


def encode_rate(content: bytes, limit: int) -> float:
    chunk = 65536
    t = time.perf_counter()
    enc = DataEncoder(limit)
    for i in range(0, len(content), chunk):
        enc.feed(content[i:i + chunk])
    enc.finish()
    return len(content) / (1 << 20) / (time.perf_counter() - t)


def folding(rounds: int, mib: int) -> None:
    size = mib << 20
    short = (b"x" * 76 + b"\r\n") * (size // 78)
    html_line = b"<td>" + b"cell " * 999 + b"</td>\r\n"  # 5,011 characters
    html = html_line * (size // len(html_line))
    print(f"DATA encoder, {mib} MiB in 64 KiB reads, median of {rounds}, load {load()}")
    for name, content in (("short CRLF lines", short), ("5,000-char lines", html)):
        rates: dict[int, list[float]] = {0: [], 998: []}
        for _ in range(rounds):
            for limit in (0, 998):  # interleaved
                rates[limit].append(encode_rate(content, limit))
        off, on = (statistics.median(rates[k]) for k in (0, 998))
        print(f"  {name:18s} off {off:8.0f} MiB/s   fold 998 {on:8.0f} MiB/s   "
              f"ratio {on / off:.2f}")
    print(f"load after: {load()}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--mib", type=int, default=64)
    args = ap.parse_args()
    check_times(args.rounds)
    folding(args.rounds, args.mib)


if __name__ == "__main__":
    main()
