#!/usr/bin/env python3
"""A refill from a deferred backlog on the filesystem store: what one claim costs.

    .venv/bin/python bench/fs_deferred_refill.py [--n 50000] [--limit 1000]
        [--runs 5] [--dir /var/tmp]

A destination that was down for hours leaves its mail in one or two
deferred directories, all due at once when it comes back.  This fills an
fs queue with ``--n`` one-recipient messages, defers them all to one due
time, and then times ``claim(limit)`` with the refill shared among
tenants (the default, ``scheduler.tenants.fair``) and without (every entry
alike), interleaved, ``--runs`` times each; after each claim the entries go
back to the same deferred directory.  Prints the median and the extremes
of each, their ratio, the peak memory of the process, and the machine's
load.

While each claim runs, another thread submits messages one after another
(held, so that no claim takes them) and times each: a submission waits
for the committer, so this shows how long a claim holds up the mail being
accepted.  Printed as the median and the longest submission that
overlapped a claim.  ``--alone``: no submissions, the claim's own time.

``--window``: the files are due 300 s after the claims instead, in the
directory whose window holds the claims' time, so no file is due and
each claim must know every file's exact due time: the cost of a refill
during a deferral wave.
"""

from __future__ import annotations

import argparse
import resource
import shutil
import statistics
import sys
import tempfile
import threading
import time
from concurrent.futures import Future
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "src"))
sys.path.insert(0, str(ROOT))

from tests.integration.stores import open_flavour  # noqa: E402

from sluice.model import QueueState, Submission  # noqa: E402
from sluice.store import Transition  # noqa: E402
from sluice.store._refill import EQUAL, TenantWeights  # noqa: E402

T0 = 1_700_000_000.0
BODY = b"Subject: backlog\r\n\r\n" + b"x" * 1000 + b"\r\n"


def loadavg() -> str:
    return " ".join(Path("/proc/loadavg").read_text().split()[:3])


def submit_meanwhile(store: Any, stop: threading.Event, waits: list[float]) -> None:
    """Submit held messages one after another until ``stop``; each one's time into ``waits``."""
    i = 0
    while True:
        started = time.perf_counter()
        store.submit(Submission("b@example.org", (f"w{i}@e.example",), hold=True), BODY, T0)
        waits.append(time.perf_counter() - started)
        i += 1
        if stop.is_set():
            return


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    ap.add_argument("--n", type=int, default=50_000)
    ap.add_argument("--limit", type=int, default=1000)
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--dir", default="/var/tmp")
    ap.add_argument("--alone", action="store_true",
                    help="no submissions during the claims")
    ap.add_argument("--window", action="store_true",
                    help="nothing due: every file in the directory due next")
    args = ap.parse_args()

    work = Path(tempfile.mkdtemp(prefix="fs-deferred-", dir=args.dir))
    store: Any = open_flavour("fs", work)
    print(f"fs deferred refill: {args.n} files {'due next' if args.window else 'due'}, "
          f"claim({args.limit}); load {loadavg()}", flush=True)
    t0 = time.monotonic()
    window: list[Future[Any]] = []
    for i in range(args.n):
        window.append(store.submit_future(
            Submission("a@example.org", (f"u{i}@d{i % 50}.example",), tenantid=f"t{i % 7}"),
            BODY, T0))
        if len(window) >= 500:
            for f in window:
                f.result()
            window.clear()
    for f in window:
        f.result()
    # Claims run at T0 + 1000: due before it, or in the window after it.
    due = T0 + 1300 if args.window else T0 + 100

    def defer(entries: list[Any]) -> None:
        store.apply([Transition(e.qid, QueueState.DEFERRED, next_attempt_at=due,
                                attempted=True) for e in entries])

    while claimed := store.claim(10_000, T0, 0):
        defer(claimed)
    print(f"  filled and deferred in {time.monotonic() - t0:.0f} s", flush=True)

    modes = {"fair": EQUAL, "plain": TenantWeights(fair=False)}
    times: dict[str, list[float]] = {m: [] for m in modes}
    waits: dict[str, list[float]] = {m: [] for m in modes}
    for _ in range(args.runs):
        for mode, weights in modes.items():
            store.tenant_weights = weights
            stop = threading.Event()
            submitter = threading.Thread(target=submit_meanwhile,
                                         args=(store, stop, waits[mode]))
            if not args.alone:
                submitter.start()
            started = time.perf_counter()
            claimed = store.claim(args.limit, T0 + 1000, args.limit)
            times[mode].append(time.perf_counter() - started)
            stop.set()
            if not args.alone:
                submitter.join()
            assert len(claimed) == (0 if args.window else args.limit), len(claimed)
            defer(claimed)
    store.close()
    for mode, ts in times.items():
        meanwhile = "" if args.alone else (
            f"; a submission meanwhile: median {statistics.median(waits[mode]) * 1000:.0f} ms, "
            f"longest {max(waits[mode]) * 1000:.0f} ms ({len(waits[mode])} in all)")
        print(f"  {mode:5}: claim median {statistics.median(ts) * 1000:.0f} ms "
              f"(min {min(ts) * 1000:.0f}, max {max(ts) * 1000:.0f}){meanwhile}")
    ratio = statistics.median(times["fair"]) / statistics.median(times["plain"])
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    print(f"  fair/plain {ratio:.2f}; peak RSS {peak:.0f} MB; load {loadavg()}")
    shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
