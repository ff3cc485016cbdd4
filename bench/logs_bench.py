"""What logging every mail event costs: AccountingLog.record with and without it.

    .venv/bin/python bench/logs_bench.py [--events 20000] [--rounds 5]

Writes the same batches of accounting events (batches of 100, as the queue
manager writes them) to a real accounting log in a temp directory, with
logging as `serve` sets it up (sluice.logs) in each mode, interleaved, and
prints the median events per second of each, the cost per event over the
baseline, and the machine's load.  Log lines go to /dev/null; the mail log
to a real file.

Modes: off (logging not set up: the CLI's case), warning (serve --log-level
warning: only failures are logged), text and json (INFO, every event), and
text+maillog.
"""

from __future__ import annotations

import argparse
import logging
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import sluice.logs as logs
from sluice.accounting import AccountingLog, EventKind, make_event
from sluice.config import LoggingConfig
from sluice.model import QueueEntry, QueueState, Reply

MODES = ("off", "warning", "text", "json", "text+maillog")


def events(n: int) -> list[dict[str, Any]]:
    out = []
    for i in range(n):
        entry = QueueEntry(spid=f"{0x19A000000000000 + i:016X}", idx=0, sender="news@shop.test",
                           recipient=f"user{i}@example{i % 50}.com", state=QueueState.INCOMING,
                           arrival_at=1.7e9, next_attempt_at=1.7e9, size=4096)
        out.append(make_event(EventKind.DELIVERED, entry, 1.7e9 + 2, attempt=1,
                              reply=Reply(250, "2.0.0", "Ok: queued as 99AA"),
                              remotemx=f"mx.example{i % 50}.com", remoteip="192.0.2.5",
                              duration_s=0.05))
    return out


def setup(mode: str, tmp: Path, sink: Any) -> None:
    root = logging.getLogger()
    for h in list(root.handlers):
        root.removeHandler(h)
    if logs._maillog is not None:
        logs._maillog.close()
    logs._maillog = None
    logs._enabled = False
    if mode == "off":
        return
    fmt = "json" if mode == "json" else "text"
    level = "warning" if mode == "warning" else "info"
    maillog = str(tmp / "mail.log") if mode.endswith("maillog") else None
    logs.setup_logging(LoggingConfig(format=fmt, level=level, maillog=maillog), stream=sink)


def run(mode: str, batch: list[list[dict[str, Any]]], tmp: Path, sink: Any) -> float:
    setup(mode, tmp, sink)
    acct = AccountingLog(tmp / mode.replace("+", "_"))
    start = time.perf_counter()
    for chunk in batch:
        acct.record(chunk, now=1.7e9)
    took = time.perf_counter() - start
    acct.close()
    return sum(len(c) for c in batch) / took


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--events", type=int, default=20000)
    ap.add_argument("--rounds", type=int, default=5)
    args = ap.parse_args()
    evs = events(args.events)
    batch = [evs[i:i + 100] for i in range(0, len(evs), 100)]
    rates: dict[str, list[float]] = {m: [] for m in MODES}
    with tempfile.TemporaryDirectory() as d, open("/dev/null", "w") as sink:
        for _ in range(args.rounds):
            for mode in MODES:  # interleaved: every round runs every mode
                rates[mode].append(run(mode, batch, Path(d), sink))
        setup("off", Path(d), sink)
    load = Path("/proc/loadavg").read_text().split()[:3]
    base = statistics.median(rates["off"])
    print(f"{args.events} delivered events in batches of 100, median of {args.rounds}; "
          f"load {' '.join(load)}")
    for mode in MODES:
        med = statistics.median(rates[mode])
        extra = (1 / med - 1 / base) * 1e6
        print(f"  {mode:13s} {med:12,.0f} events/s   {extra:+7.1f} us/event vs off")


if __name__ == "__main__":
    main()
