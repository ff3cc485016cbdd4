"""``sluice bench``: the balanced workload on every store flavour, on this machine's disk.

SUMMARY
    sluice bench [--store all|sqlite|fs|postgres|kv] [--messages N]
                 [--submitters K] [--recipients R] [--size BYTES]
                 [--defer-percent P] [--dir PATH] [--json]

DESCRIPTION
    Mailismus leaves the choice of queue flavour to the operator and
    advises "users are recommended to employ their own benchmarks" over a
    balanced work load that includes deferring and removing messages.
    This command is that benchmark.  For each flavour, on a fresh queue in
    a temporary directory (under --dir, by default /var/tmp: the disk the
    queue would live on, not a RAM disk), it runs five phases:

    submit   K threads submit N messages of R recipients (one domain per
             message, so the fs flavour aggregates them), each durable on
             return -- the accept path.
    defer    the queue manager claims everything in refills of 500, marks
             it delivering, and defers P percent of the messages (4xx).
    retry    half an hour later the deferred mail is due: it is claimed
             again from the deferred area.
    deliver  every message but one tenant's is delivered (2xx): entries go,
             and content goes with each message's last entry.
    delete   the operator deletes the remaining tenant's mail by selector.

    Each phase reports operations per second (messages for submit,
    recipients for the others); submit also reports its 99th-percentile
    latency; "bytes/msg" is the disk the queue grew by per message after
    the submit phase (files and directories; for postgres, the tables with
    their indexes and TOAST, not the WAL).

    The postgres flavour uses $SLUICE_PG_DSN (in a schema of its own,
    dropped afterwards) or starts a throwaway server under --dir with the
    machine's PostgreSQL binaries; without either it is skipped.

    A progress bar runs on standard error; the table (or --json) goes to
    standard output.  Figures depend on the disk and its neighbours: run
    it on the machine that will hold the queue, and compare runs made back
    to back.

SEE ALSO
    docs/storage.md (figures and the choice of default), bench/store_bench.py.
"""

from __future__ import annotations

import argparse
import base64
import json
import os
import shutil
import tempfile
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from sluice.cli import CommandError
from sluice.config import config_from_dict
from sluice.model import QueueEntry, QueueState, Reply, Selector, Submission
from sluice.store import Action, StorageError, Store, Transition, open_store

__all__ = ["FLAVOURS", "PHASES", "BenchResult", "register", "run_flavour"]

FLAVOURS = ("sqlite", "fs", "postgres", "kv")
PHASES = ("submit", "defer", "retry", "deliver", "delete")

#: Entries claimed per refill, as a queue manager would.
REFILL = 500
#: The tenant whose mail the operator deletes at the end (10 % of messages).
DELETED_TENANT = "t0"
TENANTS = 10
RETRY_DELAY_S = 1800.0


@dataclass(slots=True)
class BenchResult:
    """One flavour's figures."""

    store: str
    messages: int
    recipients: int
    ops_per_s: dict[str, float] = field(default_factory=dict)
    ops: dict[str, int] = field(default_factory=dict)
    submit_p99_ms: float = 0.0
    bytes_per_message: float = 0.0
    skipped: str | None = None


# --------------------------------------------------------------------------
# Where each flavour lives


@dataclass(slots=True)
class _Target:
    store: Store
    measure: Callable[[], int]
    cleanup: Callable[[], None]


def _dir_bytes(*paths: Path) -> int:
    total = 0
    for root in paths:
        for dirpath, dirnames, filenames in os.walk(root):
            for name in (*dirnames, *filenames):
                try:
                    total += os.lstat(os.path.join(dirpath, name)).st_blocks * 512
                except FileNotFoundError:
                    continue
    return total


class _Postgres:
    """A database for the postgres flavour: $SLUICE_PG_DSN or a throwaway server."""

    def __init__(self, base: Path) -> None:
        self.base = base
        self.server: Any = None
        self.dsn: str | None = os.environ.get("SLUICE_PG_DSN") or None

    def start(self) -> str:
        if self.dsn is None:
            from sluice.store._pgserver import PgServer, PgServerError

            try:
                self.server = PgServer.start(self.base)
            except PgServerError as exc:
                raise StorageError(str(exc)) from exc
            self.dsn = self.server.dsn
        return self.dsn

    def stop(self) -> None:
        if self.server is not None:
            self.server.stop()
            self.server = None


def _open(flavour: str, work: Path, pg: _Postgres) -> _Target:
    base = work / flavour
    base.mkdir(parents=True, exist_ok=True)
    queue: dict[str, Any] = {"store": flavour, "path": str(base / "queue"),
                             "spool": {"rootpath": str(base / "spool")}}
    schema = None
    if flavour == "postgres":
        import psycopg
        from psycopg.conninfo import make_conninfo

        server_dsn = pg.start()
        schema = f"sluice_bench_{uuid.uuid4().hex[:12]}"
        with psycopg.connect(server_dsn, autocommit=True) as conn:
            conn.execute(f'CREATE SCHEMA "{schema}"')
        dsn = make_conninfo(server_dsn, options=f"-c search_path={schema}")
        queue["postgres"] = {"dsn": dsn}
    cfg = config_from_dict({"node": {"hostname": "bench.sluice.test", "id": "bench"},
                            "queue": queue, "accounting": {"path": str(base / "log")}},
                           source="<sluice bench>", base_dir=base)
    saved = os.environ.pop("SLUICE_PG_DSN", None)  # the schema's DSN, not the shared one
    try:
        store = open_store(cfg)
    finally:
        if saved is not None:
            os.environ["SLUICE_PG_DSN"] = saved

    def measure() -> int:
        if schema is None:
            return _dir_bytes(base / "queue", base / "spool")
        import psycopg

        with psycopg.connect(queue["postgres"]["dsn"]) as conn:
            row = conn.execute(
                "SELECT coalesce(sum(pg_total_relation_size(c.oid)), 0) FROM pg_class c "
                "JOIN pg_namespace n ON n.oid = c.relnamespace "
                "WHERE n.nspname = current_schema() AND c.relkind = 'r'").fetchone()
        return int(row[0]) if row else 0

    def cleanup() -> None:
        if schema is not None and pg.dsn is not None:
            import psycopg

            with psycopg.connect(pg.dsn, autocommit=True) as conn:
                conn.execute(f'DROP SCHEMA IF EXISTS "{schema}" CASCADE')
        shutil.rmtree(base, ignore_errors=True)

    return _Target(store, measure, cleanup)


# --------------------------------------------------------------------------
# The workload


class _Progress:
    """A rich progress bar on standard error (or nothing)."""

    def __init__(self, enabled: bool) -> None:
        self.enabled = enabled
        self._progress: Any = None

    def __enter__(self) -> _Progress:
        if self.enabled:
            from rich.console import Console
            from rich.progress import (
                BarColumn,
                MofNCompleteColumn,
                Progress,
                TextColumn,
                TimeElapsedColumn,
            )

            self._progress = Progress(
                TextColumn("{task.description:<18}"), BarColumn(), MofNCompleteColumn(),
                TimeElapsedColumn(), console=Console(stderr=True), transient=False)
            self._progress.start()
        return self

    def __exit__(self, *exc: object) -> None:
        if self._progress is not None:
            self._progress.stop()

    @contextmanager
    def task(self, name: str, total: int) -> Iterator[Callable[[int], None]]:
        if self._progress is None:
            yield lambda n: None
            return
        task = self._progress.add_task(name, total=total)
        lock = threading.Lock()

        def advance(n: int) -> None:
            with lock:
                self._progress.advance(task, n)

        try:
            yield advance
        finally:
            self._progress.update(task, completed=total)


def _message(i: int, recipients: int) -> Submission:
    domain = f"d{i % 50}.example"
    return Submission(sender=f"bench{i % 7}@example.org",
                      recipients=tuple(f"u{i}.{j}@{domain}" for j in range(recipients)),
                      tenantid=f"t{i % TENANTS}", jobid="bench")


def _body(size: int) -> bytes:
    """A message of about ``size`` bytes whose body compresses like real mail.

    Base64 lines, as attachments are sent: not a run of one letter.
    """
    head = b"From: bench@example.org\r\nSubject: sluice bench\r\nMIME-Version: 1.0\r\n\r\n"
    raw = base64.encodebytes(os.urandom(max(0, size - len(head)) * 3 // 4 + 3))
    return head + raw.replace(b"\n", b"\r\n")[:max(0, size - len(head))]


def _claim_all(store: Store, now: float, advance: Callable[[int], None],
               then: Callable[[list[QueueEntry]], None]) -> int:
    total = 0
    while True:
        claimed = store.claim(REFILL, now, 10)
        if not claimed:
            return total
        store.apply([Transition(e.qid, QueueState.DELIVERING, expect=(QueueState.ACTIVE,))
                     for e in claimed], wait=False)
        then(claimed)
        total += len(claimed)
        advance(len(claimed))


def run_flavour(flavour: str, target: _Target, *, messages: int, submitters: int,
                recipients: int, size: int, defer_percent: int, progress: _Progress
                ) -> BenchResult:
    """The five phases on one store; see the module doc."""
    store = target.store
    result = BenchResult(flavour, messages, messages * recipients)
    body = _body(size)
    before = target.measure()

    # submit -------------------------------------------------------------------------------
    latencies: list[float] = []
    spid_index: dict[str, int] = {}
    counter = iter(range(messages))
    lock = threading.Lock()
    errors: list[BaseException] = []
    with progress.task(f"{flavour}: submit", messages) as advance:
        def submitter() -> None:
            mine: list[float] = []
            while True:
                with lock:
                    i = next(counter, None)
                if i is None:
                    break
                t0 = time.perf_counter()
                try:
                    acc = store.submit(_message(i, recipients), body, time.time())
                except BaseException as exc:
                    errors.append(exc)
                    return
                mine.append(time.perf_counter() - t0)
                with lock:
                    spid_index[acc.spid] = i
                advance(1)
            with lock:
                latencies.extend(mine)

        started = time.perf_counter()
        threads = [threading.Thread(target=submitter) for _ in range(max(1, submitters))]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        elapsed = time.perf_counter() - started
    if errors:
        raise StorageError(f"{flavour}: submission failed: {errors[0]}")
    result.ops["submit"] = messages
    result.ops_per_s["submit"] = messages / elapsed
    latencies.sort()
    result.submit_p99_ms = latencies[min(len(latencies) - 1,
                                         int(len(latencies) * 0.99))] * 1000
    result.bytes_per_message = max(0, target.measure() - before) / messages

    now = time.time()
    # Spread evenly: message i is deferred when the running share steps up.
    deferred = {spid for spid, i in spid_index.items()
                if (i + 1) * defer_percent // 100 > i * defer_percent // 100}
    delayed = Reply(451, "4.7.1", "try again later (sluice bench)")
    in_flight: list[QueueEntry] = []

    # defer --------------------------------------------------------------------------------
    def defer_share(claimed: list[QueueEntry]) -> None:
        later = [e for e in claimed if e.spid in deferred]
        store.apply([Transition(e.qid, QueueState.DEFERRED, next_attempt_at=now
                                + RETRY_DELAY_S, reply=delayed, attempted=True,
                                expect=(QueueState.ACTIVE, QueueState.DELIVERING))
                     for e in later])
        in_flight.extend(e for e in claimed if e.spid not in deferred)

    with progress.task(f"{flavour}: defer", result.recipients) as advance:
        started = time.perf_counter()
        n = _claim_all(store, now, advance, defer_share)
        result.ops_per_s["defer"] = n / (time.perf_counter() - started)
        result.ops["defer"] = n

    # retry --------------------------------------------------------------------------------
    later_at = now + RETRY_DELAY_S + 1
    n_deferred = sum(recipients for _ in deferred)
    with progress.task(f"{flavour}: retry", n_deferred) as advance:
        started = time.perf_counter()
        n = _claim_all(store, later_at, advance, in_flight.extend)
        result.ops_per_s["retry"] = n / max(time.perf_counter() - started, 1e-9)
        result.ops["retry"] = n

    # deliver ------------------------------------------------------------------------------
    ok = Reply(250, "2.0.0", "queued (sluice bench)")
    to_deliver = [e for e in in_flight if e.tenantid != DELETED_TENANT]
    with progress.task(f"{flavour}: deliver", len(to_deliver)) as advance:
        started = time.perf_counter()
        for k in range(0, len(to_deliver), REFILL):
            part = to_deliver[k:k + REFILL]
            store.apply([Transition(e.qid, None, reply=ok) for e in part])
            advance(len(part))
        result.ops_per_s["deliver"] = len(to_deliver) / max(time.perf_counter() - started,
                                                            1e-9)
        result.ops["deliver"] = len(to_deliver)

    # delete -------------------------------------------------------------------------------
    rest = len(in_flight) - len(to_deliver)
    with progress.task(f"{flavour}: delete", rest) as advance:
        started = time.perf_counter()
        gone = store.modify(Selector(tenantid=DELETED_TENANT), Action.DELETE, later_at)
        advance(len(gone))
        result.ops_per_s["delete"] = len(gone) / max(time.perf_counter() - started, 1e-9)
        result.ops["delete"] = len(gone)

    # The workload must have gone through the queue exactly once.
    left = store.count()
    if (result.ops["defer"] != result.recipients or len(gone) != rest
            or left.recipients or left.messages):
        raise StorageError(
            f"{flavour}: the workload did not add up (claimed {result.ops['defer']} of "
            f"{result.recipients}, deleted {len(gone)} of {rest}, "
            f"{left.recipients} recipients left)")
    return result


# --------------------------------------------------------------------------
# The command


def register(sub: Any) -> None:
    """Add `sluice bench` to the command line."""
    p = sub.add_parser("bench", help="run the balanced queue workload on each store flavour")
    p.add_argument("--store", default="all", choices=("all", *FLAVOURS),
                   help="which flavour (default: all)")
    p.add_argument("--messages", type=int, default=2000, metavar="N",
                   help="messages per flavour (default 2000)")
    p.add_argument("--submitters", type=int, default=16, metavar="K",
                   help="concurrent submitters (default 16)")
    p.add_argument("--recipients", type=int, default=2, metavar="R",
                   help="recipients per message, one domain (default 2)")
    p.add_argument("--size", type=int, default=4096, metavar="BYTES",
                   help="message size (default 4096)")
    p.add_argument("--defer-percent", type=int, default=30, metavar="P",
                   help="share of messages deferred on their first attempt (default 30)")
    p.add_argument("--dir", default=None, metavar="PATH",
                   help="where the queues go (default: a temporary directory in /var/tmp)")
    p.add_argument("--json", action="store_true", help="print the figures as JSON")
    p.set_defaults(func=cmd_bench)


def _work_dir(arg: str | None) -> Path:
    if arg:
        parent: str | None = arg
        Path(arg).mkdir(parents=True, exist_ok=True)
    else:
        parent = "/var/tmp" if os.path.isdir("/var/tmp") else None
    work = Path(tempfile.mkdtemp(prefix="sluice-bench-", dir=parent))
    work.chmod(0o755)  # a throwaway PostgreSQL server's user must reach it
    return work


def cmd_bench(args: argparse.Namespace) -> int:
    if args.messages < 1 or args.submitters < 1 or args.recipients < 1:
        raise CommandError("--messages, --submitters and --recipients must be at least 1",
                           status=2)
    if not 0 <= args.defer_percent <= 100 or args.size < 64:
        raise CommandError("--defer-percent must be 0..100 and --size at least 64", status=2)
    flavours = FLAVOURS if args.store == "all" else (args.store,)
    work = _work_dir(args.dir)
    pg = _Postgres(work)
    results: list[BenchResult] = []
    try:
        with _Progress(enabled=not args.json) as progress:
            for flavour in flavours:
                try:
                    target = _open(flavour, work, pg)
                except StorageError as exc:
                    if args.store == "all":
                        results.append(BenchResult(flavour, args.messages,
                                                   args.messages * args.recipients,
                                                   skipped=str(exc)))
                        continue
                    raise CommandError(f"{flavour}: {exc}") from None
                try:
                    results.append(run_flavour(
                        flavour, target, messages=args.messages, submitters=args.submitters,
                        recipients=args.recipients, size=args.size,
                        defer_percent=args.defer_percent, progress=progress))
                except StorageError as exc:
                    raise CommandError(str(exc)) from None
                finally:
                    target.store.close()
                    target.cleanup()
    finally:
        pg.stop()
        shutil.rmtree(work, ignore_errors=True)
    if args.json:
        print(json.dumps([asdict(r) for r in results], indent=2))
    else:
        _print_table(results, args, work)
    return 0


def _print_table(results: list[BenchResult], args: argparse.Namespace, work: Path) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title=(f"sluice bench: {args.messages} messages x {args.recipients} "
                         f"recipients, {args.size} bytes, {args.submitters} submitters, "
                         f"{args.defer_percent}% deferred"))
    table.add_column("store")
    for phase in PHASES:
        table.add_column(f"{phase}/s", justify="right")
    table.add_column("submit p99", justify="right")
    table.add_column("bytes/msg", justify="right")
    for r in results:
        if r.skipped:
            table.add_row(r.store, *["-"] * len(PHASES), "-", f"skipped: {r.skipped}")
            continue
        table.add_row(r.store, *(f"{r.ops_per_s[p]:,.0f}" for p in PHASES),
                      f"{r.submit_p99_ms:.1f} ms", f"{r.bytes_per_message:,.0f}")
    console = Console()
    if not console.is_terminal:
        console = Console(width=120)  # a file or a pipe: keep the table whole
    console.print(table)
    console.print(f"(submit: messages/s, durable on return; the other phases: recipients/s; "
                  f"queues were under {work.parent})", style="dim")
