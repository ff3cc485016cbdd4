"""`sluice demo`: the whole flow on one machine, live.

SUMMARY
    run_demo(messages=1000, domains=50, ...) -> exit status

DESCRIPTION
    Starts Sluice (receivers, queue manager, delivery) on a private queue in
    a temporary directory, and a sink in the same process that plays the
    Internet: most domains accept, some greylist (the first attempt gets
    451, the retry gets through), some reject (550: the sender gets an
    NDR), a few are slow, and one is down for good (its mail stays
    deferred).  It then sends ``messages`` messages over ``domains``
    domains through SMTP, shows live what the queue and the sink see,
    and ends with the shape of what is left (qshape), a summary, and the
    Spark report over the demo's own accounting log (per-domain outcomes
    and bounce classes in the terminal, report.html in a directory it
    names; sluice.runtime.demo_report).

    Retries are seconds apart instead of hours, so the demo ends in about
    half a minute.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import random
import shutil
import socket
import tempfile
import time
from collections import Counter
from pathlib import Path

import aiosmtplib
from rich.console import Console
from rich.live import Live
from rich.table import Table

from sluice.config import Config, config_from_dict
from sluice.model import QueueState, Selector
from sluice.queue import QSHAPE_EDGES_MIN
from sluice.render import shape_table
from sluice.runtime.demo_report import spark_report
from sluice.runtime.serve import Server
from sluice.sink import Behaviour, Sink

__all__ = ["DemoPlan", "plan_domains", "run_demo"]

SENDER = "newsletter@sender.demo.example"


@dataclasses.dataclass(frozen=True)
class DemoPlan:
    """Which behaviour each demo domain gets."""

    behaviours: dict[str, Behaviour]

    def of(self, kind: str) -> list[str]:
        """The demo domains given behaviour ``kind``, sorted."""
        return sorted(d for d, b in self.behaviours.items() if b.kind == kind)


def plan_domains(n: int, rng: random.Random) -> DemoPlan:
    """``n`` domains: 70 % accept, 16 % greylist, 8 % reject, 4 % slow, 1 down."""
    if n < 5:
        raise ValueError("the demo needs at least 5 domains")
    names = [f"d{i:02d}.demo.example" for i in range(1, n + 1)]
    rng.shuffle(names)
    grey = max(1, round(n * 0.16))
    reject = max(1, round(n * 0.08))
    slow = max(1, round(n * 0.04))
    out: dict[str, Behaviour] = {}
    for i, name in enumerate(names):
        if i == 0:
            out[name] = Behaviour("tempfail")
        elif i <= grey:
            out[name] = Behaviour("greylist")
        elif i <= grey + reject:
            out[name] = Behaviour("reject")
        elif i <= grey + reject + slow:
            out[name] = Behaviour("slow", seconds=0.5)
        else:
            out[name] = Behaviour("accept")
    return DemoPlan(out)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _config(base: Path, smtp_port: int, sink_port: int) -> Config:
    return config_from_dict({
        "node": {"hostname": "mx.demo.example", "id": "demo"},
        "queue": {"path": str(base / "queue"), "spool": {"rootpath": str(base / "spool")},
                  "retry_delays": "4s | 8s", "retry_maxtime": "1h"},
        "accounting": {"path": str(base / "log")},
        "smtpd": {"listen": [f"127.0.0.1:{smtp_port}"], "processes": 1},
        "delivery": {"transport": {"*": f"smtp:[127.0.0.1]:{sink_port}"}},
        "api": {"enabled": False},
    }, source="<demo>", base_dir=base)


async def _inject(port: int, jobs: list[tuple[str, bytes]], accepted: Counter[str],
                  sessions: int = 10) -> None:
    queue: asyncio.Queue[tuple[str, bytes]] = asyncio.Queue()
    for job in jobs:
        queue.put_nowait(job)

    async def client() -> None:
        smtp = aiosmtplib.SMTP(hostname="127.0.0.1", port=port, local_hostname="demo.client",
                               start_tls=False, timeout=30)
        await smtp.connect()
        try:
            while not queue.empty():
                rcpt, data = queue.get_nowait()
                try:
                    await smtp.sendmail(SENDER, [rcpt], data)
                    accepted["ok"] += 1
                except aiosmtplib.SMTPException:
                    accepted["refused"] += 1
        finally:
            with contextlib.suppress(aiosmtplib.SMTPException):
                await smtp.quit()

    await asyncio.gather(*(client() for _ in range(sessions)))


def _table(title: str, rows: list[tuple[str, str]]) -> Table:
    t = Table(title=title, show_header=False, title_justify="left")
    t.add_column(style="bold", no_wrap=True)
    t.add_column(justify="right", no_wrap=True)
    for k, v in rows:
        t.add_row(k, v)
    return t


async def _demo(messages: int, domains: int, seed: int, console: Console,
                base: Path, timeout_s: float) -> int:
    rng = random.Random(seed)
    plan = plan_domains(domains, rng)
    sink = Sink(plan.behaviours, hostname="sink.demo.example")
    sink_port = await sink.start("127.0.0.1", 0)
    smtp_port = _free_port()
    cfg = _config(base, smtp_port, sink_port)
    server = Server(cfg, poll_s=0.05, api=False)
    console.print(f"[bold]Sluice demo[/]: state in {base}")
    console.print(f"  receiving on 127.0.0.1:{smtp_port}, delivering to a sink on "
                  f"127.0.0.1:{sink_port}")
    console.print(f"  {domains} domains: {len(plan.of('accept'))} accept, "
                  f"{len(plan.of('greylist'))} greylist, {len(plan.of('reject'))} reject, "
                  f"{len(plan.of('slow'))} slow, 1 down ({plan.of('tempfail')[0]})")
    await server.start()
    names = sorted(plan.behaviours)
    jobs = []
    for i in range(messages):
        domain = names[rng.randrange(len(names))]
        data = (f"From: Sluice demo <{SENDER}>\r\nTo: user{i}@{domain}\r\n"
                f"Subject: demo message {i}\r\nMessage-ID: <demo{i}@sender.demo.example>\r\n"
                f"\r\nHello from the Sluice demo, message {i}.\r\n").encode()
        jobs.append((f"user{i}@{domain}", data))
    want = Counter(rcpt.partition("@")[2] for rcpt, _ in jobs)
    expect_rejected = sum(want[d] for d in plan.of("reject"))
    expect_delivered = sum(n for d, n in want.items()
                           if plan.behaviours[d].kind not in ("reject", "tempfail"))
    accepted: Counter[str] = Counter()
    t0 = time.monotonic()
    injector = asyncio.ensure_future(_inject(smtp_port, jobs, accepted))
    assert server.queue is not None
    store = server.queue.store

    def view() -> Table:
        snap = sink.snapshot()
        counts = store.count()
        ndrs = snap.delivered.get("sender.demo.example", 0)
        delivered = snap.total_delivered - ndrs
        elapsed = time.monotonic() - t0
        greylisted = sum(n for (d, c), n in snap.replies.items()
                         if c == 451 and plan.behaviours.get(d, Behaviour()).kind == "greylist")
        rejected = sum(n for (_, c), n in snap.replies.items() if c == 550)
        grid = Table.grid(padding=(0, 2))
        grid.add_row(
            _table("SMTP in", [("sent", f"{accepted['ok'] + accepted['refused']}/{messages}"),
                               ("250 OK", str(accepted["ok"])),
                               ("time", f"{elapsed:4.1f} s")]),
            _table("queue", [(s.value, str(counts[s])) for s in QueueState]),
            _table("next hops", [("delivered", f"{delivered}/{expect_delivered}"),
                                 ("greylisted", str(greylisted)),
                                 ("rejected", str(rejected)),
                                 ("NDRs", f"{ndrs}/{expect_rejected}"),
                                 ("peak conns", str(snap.peak_connections))]),
        )
        return grid

    done_at = None
    with Live(view(), console=console, refresh_per_second=8, transient=False) as live:
        while time.monotonic() - t0 < timeout_s:
            await asyncio.sleep(0.25)
            live.update(view())
            snap = sink.snapshot()
            ndrs = snap.delivered.get("sender.demo.example", 0)
            if (injector.done() and snap.total_delivered - ndrs >= expect_delivered
                    and ndrs >= expect_rejected):
                done_at = time.monotonic() - t0
                live.update(view())
                break
    await injector
    shape = store.shape(Selector(), time.time(), [m * 60.0 for m in QSHAPE_EDGES_MIN])
    snap = sink.snapshot()
    counts = store.count()
    await server.stop()
    await sink.stop()

    console.print()
    console.print("[bold]qshape[/] of what is left in the queue (minutes):")
    rows = shape_table(shape)
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    for r in rows:
        console.print(" ".join(c.rjust(w) for c, w in zip(r, widths, strict=True)),
                      highlight=False)
    ndrs = snap.delivered.get("sender.demo.example", 0)
    console.print()
    if done_at is not None:
        console.print(f"[bold green]Done[/] in {done_at:.1f} s: {messages} messages accepted, "
                      f"{snap.total_delivered - ndrs} delivered (greylisted ones on their retry), "
                      f"{expect_rejected} rejected and answered with {ndrs} NDRs; "
                      f"{counts.recipients} still queued for the domain that is down.")
        return 0
    console.print(f"[bold red]Not finished[/] after {timeout_s:.0f} s: "
                  f"{snap.total_delivered - ndrs}/{expect_delivered} delivered, "
                  f"{ndrs}/{expect_rejected} NDRs.")
    return 1


def run_demo(messages: int = 1000, domains: int = 50, seed: int = 1, keep: bool = False,
             timeout_s: float = 120.0, report: bool = True) -> int:
    """Run the demo the module header describes; returns the exit status.

    ``report`` adds the Spark report when Spark is installed; ``keep``
    leaves the demo's directories in place for a look afterwards.
    """
    console = Console()
    base = Path(tempfile.mkdtemp(prefix="sluice-demo-"))
    try:
        status = asyncio.run(_demo(messages, domains, seed, console, base, timeout_s))
        if report:
            # The page outlives the demo's state: it goes to a directory of its own.
            out = Path(tempfile.mkdtemp(prefix="sluice-demo-report-"))
            if not spark_report(base / "log", out, console):
                out.rmdir()
        return status
    finally:
        if keep:
            console.print(f"state kept in {base}")
        else:
            shutil.rmtree(base, ignore_errors=True)
