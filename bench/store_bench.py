#!/usr/bin/env python3
"""Queue core benchmark: durable submissions, refill cycles, listing at 1M recipients.

    .venv/bin/python bench/store_bench.py [--store sqlite|fs|postgres|kv] [--seconds 5]
        [--million-messages 100000 --million-rcpts 10] [--dir /var/tmp/x]

Prints, for the chosen store flavour:
  * durable submissions/s with 1, 20 and 100 concurrent submitters, at 1 KB
    and 100 KB (each submission returns only after content and meta are
    fsynced: group commit);
  * refill + complete cycles/s (claim a batch into the active queue, then
    record it delivered -- content removed);
  * with 1M queued recipients: `sluice qlist` wall time and peak RSS,
    `sluice qcount` wall time, and a claim of 1,000 from the full queue.

The postgres flavour uses $SLUICE_PG_DSN (a schema of its own per queue) or
starts a throwaway server with the machine's PostgreSQL binaries.

Numbers are from this machine's disk at this moment: the disk is shared and
noisy (about +-15 %), so compare runs made back to back.
"""

from __future__ import annotations

import argparse
import os
import resource
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "src"))

from sluice.config import config_from_dict  # noqa: E402
from sluice.model import Selector, Submission  # noqa: E402
from sluice.store import Store, Transition, open_store  # noqa: E402
from sluice.store._pgserver import PgServer  # noqa: E402


class Postgres:
    """The postgres flavour's database: $SLUICE_PG_DSN, or a throwaway server
    (initdb + pg_ctl on loopback, as the tests do).  One schema per queue."""

    def __init__(self) -> None:
        self.server: PgServer | None = None
        self.dsn = os.environ.pop("SLUICE_PG_DSN", None)  # each queue gets its own schema
        self.schemas: list[str] = []

    def dsn_for(self, base: Path) -> str:
        import psycopg
        from psycopg.conninfo import make_conninfo

        if self.dsn is None:
            self.server = PgServer.start()
            self.dsn = self.server.dsn
        schema = "sluice_bench_" + base.name.replace("-", "_")
        with psycopg.connect(self.dsn, autocommit=True) as conn:
            conn.execute(f'DROP SCHEMA IF EXISTS "{schema}" CASCADE')
            conn.execute(f'CREATE SCHEMA "{schema}"')
        self.schemas.append(schema)
        return make_conninfo(self.dsn, options=f"-c search_path={schema}")

    def close(self) -> None:
        if self.server is not None:
            self.server.stop()
            return
        if self.dsn is not None and self.schemas:
            import psycopg

            with psycopg.connect(self.dsn, autocommit=True) as conn:
                for schema in self.schemas:
                    conn.execute(f'DROP SCHEMA IF EXISTS "{schema}" CASCADE')


PG = Postgres()


def make_config(base: Path, flavour: str) -> dict[str, object]:
    queue: dict[str, object] = {"store": flavour, "path": str(base / "queue"),
                                "spool": {"rootpath": str(base / "spool")}}
    if flavour == "postgres":
        queue["postgres"] = {"dsn": PG.dsn_for(base)}
    return {
        "node": {"hostname": "bench.sluice.test", "id": "bench"},
        "queue": queue,
        "accounting": {"path": str(base / "log")},
    }


def open_fresh(base: Path, flavour: str) -> Store:
    if base.exists():
        shutil.rmtree(base)
    base.mkdir(parents=True)
    cfg = make_config(base, flavour)
    (base / "sluice.yaml").write_text(yaml.safe_dump(cfg))
    return open_store(config_from_dict(cfg, base_dir=base))


def submissions(store: Store, threads: int, size: int, seconds: float) -> tuple[float, int]:
    body = b"Subject: bench\r\n\r\n" + b"x" * (size - 20) + b"\r\n"
    stop = time.monotonic() + seconds
    counts = [0] * threads
    sub = Submission("bench@example.org", ("r@example.net",))

    def worker(k: int) -> None:
        n = 0
        while time.monotonic() < stop:
            store.submit(sub, body, time.time())
            n += 1
        counts[k] = n

    t0 = time.monotonic()
    ts = [threading.Thread(target=worker, args=(k,)) for k in range(threads)]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    elapsed = time.monotonic() - t0
    return sum(counts) / elapsed, sum(counts)


def refill_cycles(store: Store, n: int, batch: int) -> float:
    futs = [store.submit_future(Submission("b@example.org", ("r@example.net",)), b"x" * 1024,
                                time.time()) for _ in range(n)]
    for f in futs:
        f.result()
    t0 = time.monotonic()
    done = 0
    while done < n:
        claimed = store.claim(batch, time.time(), 10)
        if not claimed:
            break
        store.apply([Transition(e.qid, None) for e in claimed])
        done += len(claimed)
    return done / (time.monotonic() - t0)


def fill(store: Store, messages: int, rcpts: int) -> None:
    """Queue ``messages`` messages of ``rcpts`` recipients each, fast (many in flight)."""
    recipients = tuple(f"user{i}@d{i % 50}.example" for i in range(rcpts))
    body = b"Subject: fill\r\n\r\n" + b"y" * 1000 + b"\r\n"
    window: list[object] = []
    t0 = time.monotonic()
    last = t0
    for i in range(messages):
        window.append(store.submit_future(
            Submission("fill@example.org", recipients, tenantid=f"t{i % 7}"), body, time.time()))
        if len(window) >= 500:
            for f in window:
                f.result()  # type: ignore[attr-defined]
            window.clear()
        if time.monotonic() - last > 5:
            last = time.monotonic()
            print(f"  filled {i + 1}/{messages} messages ({(i + 1) / (last - t0):.0f}/s)",
                  flush=True)
    for f in window:
        f.result()  # type: ignore[attr-defined]


def timed_cli(config_path: Path, *args: str) -> tuple[float, int]:
    """Wall time and peak RSS (KB) of one `sluice` command, output discarded."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss
    t0 = time.monotonic()
    subprocess.run([sys.executable, "-m", "sluice", "-c", str(config_path), *args],
                   stdout=subprocess.DEVNULL, check=True, cwd=ROOT,
                   env={**os.environ, "PYTHONPATH": str(ROOT / "src")})
    elapsed = time.monotonic() - t0
    rss = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss
    return elapsed, max(rss, before)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--store", default="sqlite")
    ap.add_argument("--seconds", type=float, default=5.0)
    ap.add_argument("--million-messages", type=int, default=100_000)
    ap.add_argument("--million-rcpts", type=int, default=10)
    ap.add_argument("--dir", default=None, help="work directory (default: a temp dir on /var/tmp)")
    ap.add_argument("--skip-million", action="store_true")
    args = ap.parse_args()
    base = Path(args.dir or tempfile.mkdtemp(prefix="sluice-bench-", dir="/var/tmp"))
    base.chmod(0o755)  # a throwaway PostgreSQL server's user must reach it
    print(f"store={args.store} dir={base} cpus={os.cpu_count()}")

    results: dict[str, float] = {}
    for size in (1024, 100 * 1024):
        for threads in (1, 20, 100):
            store = open_fresh(base / "sub", args.store)
            rate, n = submissions(store, threads, size, args.seconds)
            store.close()
            key = f"submit_{size // 1024}k_c{threads}"
            results[key] = rate
            print(f"{key}: {rate:8.0f} durable submissions/s ({n} in {args.seconds:.0f} s)",
                  flush=True)

    store = open_fresh(base / "cycle", args.store)
    for batch in (100, 1000):
        rate = refill_cycles(store, 20_000, batch)
        results[f"refill_complete_b{batch}"] = rate
        print(f"refill_complete_b{batch}: {rate:8.0f} recipients/s (claim {batch}, then "
              "delivered)", flush=True)
    store.close()

    if not args.skip_million:
        total = args.million_messages * args.million_rcpts
        print(f"filling {args.million_messages} messages x {args.million_rcpts} recipients "
              f"= {total} recipients ...", flush=True)
        big = base / "million"
        store = open_fresh(big, args.store)
        t0 = time.monotonic()
        fill(store, args.million_messages, args.million_rcpts)
        fill_s = time.monotonic() - t0
        print(f"fill: {total / fill_s:.0f} recipients/s, {args.million_messages / fill_s:.0f} "
              "messages/s", flush=True)
        t0 = time.monotonic()
        store.count()
        count_api_ms = (time.monotonic() - t0) * 1000
        t0 = time.monotonic()
        n = sum(1 for _ in store.entries(Selector(domain="d7.example"), limit=None))
        sel_s = time.monotonic() - t0
        t0 = time.monotonic()
        claimed = store.claim(1000, time.time(), 10)
        claim_ms = (time.monotonic() - t0) * 1000
        store.apply([Transition(e.qid, None) for e in claimed])
        store.close()
        cfg_path = big / "sluice.yaml"  # written by open_fresh, with the same schema
        qlist_s, qlist_rss = timed_cli(cfg_path, "qlist")
        qcount_s, _ = timed_cli(cfg_path, "qcount")
        print(f"qlist_1M: {qlist_s:.1f} s wall, peak RSS {qlist_rss / 1024:.0f} MB "
              f"({total} recipients)")
        print(f"qcount_1M: {qcount_s * 1000:.0f} ms wall as a command "
              f"(count() in-process {count_api_ms:.1f} ms)")
        print(f"select_domain_1M: {sel_s * 1000:.0f} ms for {n} entries of one domain")
        print(f"claim_1000_at_1M: {claim_ms:.1f} ms")
        results.update(qlist_1m_s=qlist_s, qlist_1m_rss_mb=qlist_rss / 1024)

    PG.close()
    shutil.rmtree(base, ignore_errors=True)
    print(" ".join(f"{k}={v:.1f}" for k, v in results.items()))


if __name__ == "__main__":
    main()
