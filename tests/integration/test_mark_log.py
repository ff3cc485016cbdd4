"""The mark log in a running queue manager: the line is the mark; the store marks to cover a file.

A real Server (receivers, queue manager, SQLite store) delivering to a real
sink on loopback.  While the mark log keeps a step's line, the store gets no
"delivering" mark for its attempts at all: the message goes once the line
is written.  When the log retires a full file, the attempts it names that
are still under way (a slow next hop here) get the store's mark in one
operation, tried again while the store refuses it, and only then is the
file emptied (sluice.runtime.deliveries, Deliveries._cover).
"""

from __future__ import annotations

import asyncio
import smtplib
import sqlite3
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest

from sluice import marks as marks_mod
from sluice.marks import mark_paths, read_marks
from sluice.model import QueueState
from sluice.runtime.parts import Backoff, Health
from sluice.runtime.serve import Server
from sluice.sink import Behaviour, Sink
from sluice.store import StorageError, Transition
from sluice.store.sqlite import SqliteStore
from tests.conftest import make_config
from tests.integration.serving import free_port, run_in_process, wait_until

pytestmark = pytest.mark.integration


def _send(host: str, port: int, rcpt: str) -> None:
    with smtplib.SMTP(host, port, local_hostname="client.test", timeout=10) as c:
        c.sendmail("a@sender.example", [rcpt], b"Subject: t\r\n\r\nbody\r\n")


def _server(tmp_path: Path, sink_port: int) -> Server:
    cfg = make_config(tmp_path, queue={"store": "sqlite"},
                      smtpd={"listen": [f"127.0.0.1:{free_port()}"], "processes": 1},
                      delivery={"transport": {"*": f"smtp:[127.0.0.1]:{sink_port}"}},
                      api={"enabled": False})  # no fixed port for tests side by side
    return Server(cfg, poll_s=0.05, health=Health(backoff=Backoff(first_s=0.01, max_s=0.05)))


def _spy_marks(monkeypatch: pytest.MonkeyPatch, refuse: int = 0,
               watch: Path | None = None) -> list[tuple[list[str], int]]:
    """Every store "delivering" mark tried: its queue ids and the size of ``watch`` then.

    The first ``refuse`` tries fail.
    """
    real = SqliteStore.apply_future
    tried: list[tuple[list[str], int]] = []

    def apply_future(self: SqliteStore, transitions: Sequence[Transition], **kw: Any) -> Any:
        if any(t.state is QueueState.DELIVERING for t in transitions):
            size = watch.stat().st_size if watch is not None and watch.exists() else -1
            tried.append(([t.qid for t in transitions], size))
            if len(tried) <= refuse:
                raise StorageError("injected: the store refuses the mark")
        return real(self, transitions, **kw)

    monkeypatch.setattr(SqliteStore, "apply_future", apply_future)
    return tried


def _queued(tmp_path: Path) -> int:
    with sqlite3.connect(tmp_path / "queue" / "queue.db") as conn:
        n: int = conn.execute("SELECT COUNT(*) FROM queue").fetchone()[0]
    return n


def test_deliveries_go_on_the_line_alone_and_the_store_gets_no_mark(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    tried = _spy_marks(monkeypatch)
    sink = Sink(keep=True)
    srv = _server(tmp_path, sink.start_in_thread())
    lines: set[str] = set()

    async def body() -> None:
        for n in range(3):
            await asyncio.to_thread(_send, *srv.addresses[0], f"b{n}@rcpt.example")
        await asyncio.to_thread(wait_until, lambda: len(sink.messages) >= 3, 20)
        lines.update(read_marks(mark_paths(tmp_path / "queue", "test-node")))

    run_in_process(srv, sink, body)
    assert len(sink.messages) == 3
    assert tried == []  # no store mark: the lines were the marks
    assert len(lines) == 3 and all(m.endswith("/0") for m in lines)


def test_a_retired_file_s_attempts_under_way_get_the_store_s_mark_before_it_is_emptied(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # Two lines fill a file: the third goes to the other and retires the first.
    monkeypatch.setattr(marks_mod, "ROTATE_AT", 30)
    files = mark_paths(tmp_path / "queue", "test-node")
    tried = _spy_marks(monkeypatch, refuse=2, watch=files[0])
    sink = Sink({"slow.example": Behaviour("slow", seconds=2.0)}, keep=True)
    srv = _server(tmp_path, sink.start_in_thread())
    seen: dict[str, Any] = {}

    async def body() -> None:
        addr = srv.addresses[0]
        # The first line: an attempt that ends, its outcome in the store.
        await asyncio.to_thread(_send, *addr, "b@done.example")
        await asyncio.to_thread(wait_until, lambda: len(sink.messages) == 1, 10)
        await asyncio.to_thread(wait_until, lambda: _queued(tmp_path) == 0, 10)
        # The second: an attempt under way (the next hop is slow) ...
        await asyncio.to_thread(_send, *addr, "b@slow.example")
        await asyncio.to_thread(wait_until, lambda: len(read_marks(files[:1])) == 2, 10)
        seen["file0"] = read_marks(files[:1])
        # ... when the third line retires the file.
        await asyncio.to_thread(_send, *addr, "b@fast.example")
        await asyncio.to_thread(wait_until, lambda: len(tried) >= 3, 10)
        await asyncio.to_thread(wait_until, lambda: files[0].stat().st_size == 0, 10)
        seen["file1"] = read_marks(files[1:])
        seen["slow_delivered_before_cover"] = any(
            m.recipients == ("b@slow.example",) for m in sink.messages)
        await asyncio.to_thread(wait_until, lambda: len(sink.messages) >= 3, 20)

    run_in_process(srv, sink, body)
    assert len(sink.messages) == 3
    by_rcpt = {m.recipients[0]: m for m in sink.messages}
    assert set(by_rcpt) == {"b@done.example", "b@slow.example", "b@fast.example"}
    assert len(seen["file0"]) == 2
    # One cover: the attempt still under way alone (the ended one's outcome
    # was in the store), refused twice and tried until in, the file still
    # holding its lines at every try; emptied after that, while the slow
    # delivery was still under way.
    qids = [q for q, _ in tried]
    assert len(tried) == 3 and len({tuple(q) for q in qids}) == 1, tried
    (slow_qid,) = qids[0]
    assert f"{slow_qid}/0" in seen["file0"]
    assert all(size > 0 for _, size in tried), tried
    assert not seen["slow_delivered_before_cover"]
    assert len(seen["file1"]) == 1 and not seen["file1"] & seen["file0"]
