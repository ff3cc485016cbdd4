#!/usr/bin/env python3
"""The console's message search at a million recipients: a page from the start and deep in.

    .venv/bin/python bench/console_paging_bench.py [--store sqlite|kv|postgres|fs]
        [--messages 100000 --rcpts 10] [--dir /var/tmp/x] [--keep]

Fills a fresh store with ``messages`` x ``rcpts`` recipients (store_bench's
fill: recipient i of every message is user<i>@d<i % 50>.example, tenants
t0..t6), then times one page of 50 as GET /api/v1/queue/entries reads it
(Store.entries(selector, after=cursor, limit=51)) for several selectors, on
the first page and after a cursor 90 % of the way through the queue.  The
deep page is what keyset paging is for: with OFFSET it would cost the rows
skipped.  On SQLite the same page is also read with LIMIT/OFFSET, the peer,
interleaved with the keyset read.  The recipients of d3 (1 in 50) are put on
hold first, so that a state other than incoming is spread over the queue.
Medians of 7, in milliseconds; the machine's load is printed beside each
line, and the oldest entry per state (Store.oldest) is timed at the end.
"""

from __future__ import annotations

import argparse
import itertools
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "src"))
sys.path.insert(0, str(ROOT / "bench"))

from store_bench import fill, open_fresh  # noqa: E402

from sluice.model import QueueState, Selector  # noqa: E402
from sluice.store import Action, Store  # noqa: E402

PAGE = 50
RUNS = 7


def load() -> str:
    return Path("/proc/loadavg").read_text().split()[0]


def page_ms(store: Store, selector: Selector, after: str | None) -> float:
    t0 = time.perf_counter()
    got = list(itertools.islice(store.entries(selector, after=after, limit=PAGE + 1),
                                PAGE + 1))
    elapsed = (time.perf_counter() - t0) * 1000
    assert got, "the page is empty"
    return elapsed


def offset_ms(db: Path, where: str, params: list[object], offset: int) -> float:
    import sqlite3

    conn = sqlite3.connect(f"file:{db}?mode=ro", uri=True)
    try:
        t0 = time.perf_counter()
        rows = conn.execute(f"SELECT * FROM queue WHERE {where} ORDER BY spid, idx "
                            f"LIMIT {PAGE + 1} OFFSET {offset}", params).fetchall()
        elapsed = (time.perf_counter() - t0) * 1000
    finally:
        conn.close()
    assert rows, "the OFFSET page is empty"
    return elapsed


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--store", default="sqlite", choices=["sqlite", "kv", "postgres", "fs"])
    ap.add_argument("--messages", type=int, default=100_000)
    ap.add_argument("--rcpts", type=int, default=10)
    ap.add_argument("--dir")
    ap.add_argument("--keep", action="store_true", help="keep the filled store")
    args = ap.parse_args()
    base = Path(args.dir or tempfile.mkdtemp(prefix="sluice-console-", dir="/var/tmp"))
    total = args.messages * args.rcpts
    print(f"store={args.store} recipients={total} dir={base}", flush=True)
    store = open_fresh(base / "q", args.store)
    t0 = time.monotonic()
    fill(store, args.messages, args.rcpts)
    print(f"filled in {time.monotonic() - t0:.0f} s (load {load()})", flush=True)
    # A state other than incoming, spread over the whole queue: d3's recipients held.
    t0 = time.monotonic()
    store.modify(Selector(domain="d3.example"), Action.HOLD, time.time())
    print(f"held d3 in {time.monotonic() - t0:.1f} s", flush=True)

    cases = [
        ("everything", Selector(), ("1 = 1", [])),
        ("domain d7 (1 in 50)", Selector(domain="d7.example"), ("domain = ?", ["d7.example"])),
        ("tenant t3 (1 in 7)", Selector(tenantid="t3"), ("tenantid = ?", ["t3"])),
        ("recipient user3@d3", Selector(recipient="user3@d3.example"),
         ("recipient = ?", ["user3@d3.example"])),
        ("state incoming", Selector(states=(QueueState.INCOMING,)),
         ("state = ?", ["incoming"])),
        ("state hold (1 in 50)", Selector(states=(QueueState.HOLD,)), ("state = ?", ["hold"])),
        ("tenant t3 + state hold", Selector(tenantid="t3", states=(QueueState.HOLD,)),
         ("tenantid = ? AND state = ?", ["t3", "hold"])),
    ]
    db = next(iter((base / "q").rglob("queue.db")), base / "q" / "queue.db")
    for name, selector, sql in cases:
        # The cursor 90 % of the way through this selection.
        n = sum(1 for _ in store.entries(selector))
        cursor = None
        skip = None
        target = int(n * 0.9)
        for i, e in enumerate(store.entries(selector)):
            if i == target:
                cursor, skip = e.qid, i + 1
                break
        first, deep, off = [], [], []
        for _ in range(RUNS):
            first.append(page_ms(store, selector, None))
            deep.append(page_ms(store, selector, cursor))
            if args.store == "sqlite" and sql is not None and db.exists() and skip:
                off.append(offset_ms(db, sql[0], sql[1], skip))
        line = (f"{name:24s} {n:>8d} selected  first page {statistics.median(first):8.2f} ms"
                f"  page at 90% {statistics.median(deep):8.2f} ms")
        if off:
            o = statistics.median(off)
            line += f"  OFFSET peer {o:8.2f} ms (x{o / statistics.median(deep):.1f})"
        print(f"{line}  load {load()}", flush=True)
    times = []
    for _ in range(RUNS if hasattr(store, "oldest") else 0):  # older code has none
        t0 = time.perf_counter()
        oldest = store.oldest()
        times.append((time.perf_counter() - t0) * 1000)
    if times:
        print(f"oldest per state ({len(oldest)} states) {statistics.median(times):8.2f} ms"
              f"  load {load()}", flush=True)
    store.close()
    if not args.keep:
        shutil.rmtree(base, ignore_errors=True)


if __name__ == "__main__":
    main()
