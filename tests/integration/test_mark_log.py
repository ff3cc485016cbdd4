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


def _spy_marks(monkeypatch: pytest.MonkeyPatch, refuse: int = 0) -> list[list[str]]:
    """The queue ids of every store "delivering" mark tried; the first ``refuse`` fail."""
    real = SqliteStore.apply_future
    tried: list[list[str]] = []

    def apply_future(self: SqliteStore, transitions: Sequence[Transition], **kw: Any) -> Any:
        if any(t.state is QueueState.DELIVERING for t in transitions):
            tried.append([t.qid for t in transitions])
            if len(tried) <= refuse:
                raise StorageError("injected: the store refuses the mark")
        return real(self, transitions, **kw)

    monkeypatch.setattr(SqliteStore, "apply_future", apply_future)
    return tried


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
    monkeypatch.setattr(marks_mod, "ROTATE_AT", 1)  # every line retires the file before
    tried = _spy_marks(monkeypatch, refuse=2)
    sink = Sink({"slow.example": Behaviour("slow", seconds=2.0)}, keep=True)
    srv = _server(tmp_path, sink.start_in_thread())
    files = mark_paths(tmp_path / "queue", "test-node")
    seen: dict[str, Any] = {}

    async def body() -> None:
        # The slow one's attempt is under way (its line in file 0) when the
        # fast one's line goes to file 1 and retires file 0.
        await asyncio.to_thread(_send, *srv.addresses[0], "b@slow.example")
        await asyncio.to_thread(wait_until, lambda: bool(read_marks(files[:1])), 10)
        seen["slow"] = read_marks(files[:1])
        await asyncio.to_thread(_send, *srv.addresses[0], "b@fast.example")
        await asyncio.to_thread(wait_until, lambda: len(tried) >= 3, 10)
        await asyncio.to_thread(wait_until, lambda: files[0].stat().st_size == 0, 10)
        seen["fast"] = read_marks(files[1:])
        seen["slow_delivered_before_cover"] = any(
            m.recipients == ("b@slow.example",) for m in sink.messages)
        await asyncio.to_thread(wait_until, lambda: len(sink.messages) >= 2, 20)

    run_in_process(srv, sink, body)
    assert len(sink.messages) == 2
    (slow_mark,) = seen["slow"]
    slow_qid = slow_mark.split("/")[0]
    # one cover, the slow attempt alone, refused twice and tried until in;
    # the file was emptied only after that, while the slow one was under way
    assert len(tried) == 3 and all(t == [slow_qid] for t in tried), tried
    assert not seen["slow_delivered_before_cover"]
    assert len(seen["fast"]) == 1 and slow_mark not in seen["fast"]
