"""Benchmark of `sluice sendout`: a generated recipient list through Spark, into Sluice.

Usage:
    .venv/bin/python bench/sendout_bench.py [--n 1000000] [--inject [--no-drain]]
        [--workdir /tmp/sluice-sendout-bench] [--master local[*]] [--keep]

What it does:
  1. writes a CSV list of N recipients (email, first, code) over 2,000
     domains, with the dirt a real list has: 1 % invalid addresses, 1 %
     duplicates (the same address in other case), 0.5 % on the
     suppression list, 0.5 % without the first name the template needs.
     Writing the list is timed apart and not counted;
  2. runs `sluice sendout` on it with a template that personalises the
     subject, a text and an HTML part and a List-Unsubscribe header.
     Without --inject it is a dry run (clean and personalise, send
     nothing: every good row ends "ready"); with --inject a real
     `sluice serve` (the default SQLite queue, fsync on, the API on loopback)
     takes the mail over the injection API and delivers it to an SMTP
     sink on loopback while the sendout runs;
  3. prints the time, rows per second and the outcome counts read from
     outcomes.parquet, and the machine's load before and after.  With
     --inject it also waits until the sink has every queued message and
     prints when that was (not with --no-drain).

The outcome counts are checked against what was generated: the run fails
if a row is missing or a dirty row got the wrong status.
"""

from __future__ import annotations

import argparse
import csv
import os
import random
import shutil
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "src"))
sys.path.insert(0, str(ROOT))

from tests.integration.serving import free_port, start_serve_with, write_serve_config  # noqa: E402

from sluice.sink import Sink  # noqa: E402
from sluice.suppression import (  # noqa: E402
    SuppressionEntry,
    SuppressionReason,
    write_suppression_list,
)

SLUICE = str(ROOT / ".venv" / "bin" / "sluice")
TOKEN = "sendout-bench-token-0123456789"
TEMPLATE = """\
from: Shop <news@shop.example>
subject: "Hello {{ first }}, your code {{ code }}"
text: |
  Dear {{ first }}, your code is {{ code }}.
  See you soon.
html: |
  <html><body><p>Dear {{ first }},</p><p>your code is <b>{{ code }}</b>.</p></body></html>
headers:
  List-Unsubscribe: "<mailto:unsub@shop.example?subject={{ email }}>"
"""


def write_list(path: Path, n: int, seed: int = 7) -> tuple[Counter[str], list[str]]:
    """The list, and what sendout must make of it (status -> rows); suppressed addresses."""
    rnd = random.Random(seed)
    expect: Counter[str] = Counter()
    suppressed: list[str] = []
    with path.open("w", newline="") as fh:
        out = csv.writer(fh)
        out.writerow(["email", "first", "code"])
        last_good = ""
        for i in range(n):
            domain = f"d{rnd.randrange(2000)}.example"
            address, first = f"user{i}@{domain}", f"U{i}"
            roll = rnd.random()
            if roll < 0.01:
                address, status = f"user{i} at {domain}", "invalid"
            elif roll < 0.02 and last_good:  # an earlier good row's address, in capitals
                address, status = last_good.upper(), "duplicate"
            elif roll < 0.025:
                suppressed.append(address)
                status = "suppressed"
            elif roll < 0.03:
                first, status = "", "invalid"
            else:
                status, last_good = "good", address
            out.writerow([address, first, str(100000 + i)])
            expect[status] += 1
    return expect, suppressed


def loadavg() -> str:
    return "/".join(f"{x:.1f}" for x in os.getloadavg())


def run(args: argparse.Namespace) -> int:
    work = Path(args.workdir)
    if work.exists():
        shutil.rmtree(work)
    work.mkdir(parents=True)
    started = time.monotonic()
    expect, suppressed = write_list(work / "list.csv", args.n)
    listed = work / "suppression.jsonl"
    write_suppression_list(listed, [SuppressionEntry(a, SuppressionReason.HARD, last_at=1.7e9)
                                    for a in suppressed], generated_at=1.7e9)
    (work / "template.yaml").write_text(TEMPLATE)
    print(f"list n={args.n:,} seconds={time.monotonic() - started:.1f} {dict(expect)} "
          "(not counted)", flush=True)

    sink = Sink()
    sink_port = sink.start_in_thread()
    api_port, smtp_port = free_port(), free_port()
    config = write_serve_config(
        work, smtp_port,
        api={"enabled": True, "listen": f"127.0.0.1:{api_port}", "tokens": {"bench": TOKEN}},
        delivery={"transport": {"*": f"smtp:[127.0.0.1]:{sink_port}"}},
        suppression={"path": str(listed)},
        analytics={"master": args.master})
    serving = start_serve_with(config, work, smtp_port) if args.inject else None
    try:
        cmd = [SLUICE, "-c", str(config), "sendout", "-i", str(work / "list.csv"),
               "-t", str(work / "template.yaml"), "--job", "bench", "--tenant", "bench",
               "--sender", "bounces@shop.example", "-o", str(work / "out"),
               "--token", TOKEN, "--no-progress"]
        if not args.inject:
            cmd.append("--dry-run")
        print(f"sendout {'inject' if args.inject else 'dry-run'} load_before={loadavg()}",
              flush=True)
        t0 = time.monotonic()
        done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
        took = time.monotonic() - t0
        if done.returncode != 0:
            print(done.stdout[-3000:], done.stderr[-3000:], sep="\n")
            return 1
        statuses = outcome_counts(work / "out" / "outcomes.parquet")
        print(f"sendout seconds={took:.1f} rows_per_s={args.n / took:,.0f} "
              f"outcomes={dict(statuses)} load_after={loadavg()}", flush=True)
        sent = "queued" if args.inject else "ready"
        want = {sent: expect["good"], "invalid": expect["invalid"],
                "duplicate": expect["duplicate"], "suppressed": expect["suppressed"]}
        if dict(statuses) != want:
            print(f"outcomes differ from the list: want {want}")
            return 1
        if serving is not None and args.drain:
            while sink.snapshot().total_delivered < expect["good"]:
                if serving.proc.poll() is not None:
                    print("sluice serve ended:\n" + "\n".join(serving.output[-20:]))
                    return 1
                time.sleep(1.0)
            print(f"delivered all {expect['good']:,} at the sink "
                  f"{time.monotonic() - t0:.1f} s after the sendout began", flush=True)
    finally:
        if serving is not None:
            serving.stop()
        sink.stop_thread()
        if not args.keep:
            shutil.rmtree(work, ignore_errors=True)
    return 0


def outcome_counts(path: Path) -> Counter[str]:
    import duckdb

    rows = duckdb.sql(f"SELECT status, count(*) FROM read_parquet('{path}/**/*.parquet') "
                      "GROUP BY status").fetchall()
    return Counter({str(s): int(n) for s, n in rows})


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n", type=int, default=1_000_000)
    parser.add_argument("--inject", action="store_true",
                        help="inject into a real sluice serve (else a dry run)")
    parser.add_argument("--workdir", default="/tmp/sluice-sendout-bench")
    parser.add_argument("--master", default="local[*]")
    parser.add_argument("--keep", action="store_true", help="keep the work directory")
    parser.add_argument("--no-drain", dest="drain", action="store_false",
                        help="with --inject: stop once the sendout ends, without waiting "
                             "for the sink to have every message")
    return run(parser.parse_args())


if __name__ == "__main__":
    raise SystemExit(main())
