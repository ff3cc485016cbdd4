"""How a running queue manager reads the contents it delivers (SQLite).

A real Server (receiver, queue manager, SQLite store) delivering to a real
sink on loopback.  A small content (inline in the database) is read ahead
with the other starts of its loop step; a content over the store's
ahead_max (64 KiB inline) is never asked of the database: it is opened
from its spool file (ReadsContentsAhead.open_large,
sluice.runtime.deliveries).  The store's reads are watched by wrapping
SqliteStore's methods, which are looked up when the manager starts.
"""

from __future__ import annotations

import asyncio
import json
import smtplib
from collections.abc import Sequence
from pathlib import Path
from typing import IO, Any

import pytest

from sluice.runtime.serve import Server
from sluice.sink import Sink
from sluice.store.sqlite import SqliteStore
from tests.conftest import make_config
from tests.integration.serving import free_port, run_in_process, wait_until

pytestmark = pytest.mark.integration

SMALL = b"Subject: small\r\n\r\na few bytes\r\n"
BIG = b"Subject: big\r\n\r\n" + (b"y" * 78 + b"\r\n") * 1000  # 80 KB


def _send(host: str, port: int, rcpt: str, body: bytes) -> None:
    with smtplib.SMTP(host, port, local_hostname="client.test", timeout=10) as c:
        c.sendmail("a@sender.example", [rcpt], body)


def test_a_big_content_is_opened_from_its_file_and_a_small_one_read_ahead(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    sink = Sink(keep=True)
    sink_port = sink.start_in_thread()
    asked_ahead: list[str] = []
    opened_large: list[str] = []
    opened: list[str] = []
    real_ahead, real_large = SqliteStore.inline_contents, SqliteStore.open_large
    real_open = SqliteStore.open_content

    def inline_contents(self: SqliteStore, spids: Sequence[str]) -> dict[str, bytes]:
        asked_ahead.extend(spids)
        return real_ahead(self, spids)

    def open_large(self: SqliteStore, spid: str) -> IO[bytes]:
        opened_large.append(spid)
        return real_large(self, spid)

    def open_content(self: SqliteStore, spid: str) -> Any:
        opened.append(spid)
        return real_open(self, spid)

    monkeypatch.setattr(SqliteStore, "inline_contents", inline_contents)
    monkeypatch.setattr(SqliteStore, "open_large", open_large)
    monkeypatch.setattr(SqliteStore, "open_content", open_content)
    cfg = make_config(tmp_path, queue={"store": "sqlite"},
                      smtpd={"listen": [f"127.0.0.1:{free_port()}"], "processes": 1},
                      delivery={"transport": {"*": f"smtp:[127.0.0.1]:{sink_port}"}},
                      api={"enabled": False})  # no fixed port for tests side by side
    srv = Server(cfg, poll_s=0.05)
    spids: dict[str, str] = {}

    async def body() -> None:
        host, port = srv.addresses[0]
        await asyncio.to_thread(_send, host, port, "big@rcpt.example", BIG)
        await asyncio.to_thread(_send, host, port, "small@rcpt.example", SMALL)
        await asyncio.to_thread(wait_until, lambda: len(sink.messages) >= 2, 20)

    run_in_process(srv, sink, body)
    got = {m.recipients[0]: m.data for m in sink.messages}
    assert got["big@rcpt.example"].endswith(BIG)
    assert got["small@rcpt.example"].endswith(SMALL)
    for path in (tmp_path / "log").iterdir():
        for line in path.read_text().splitlines():
            event = json.loads(line)
            if event["event"] == "delivered":
                spids[event["recipient"].split("@")[0]] = event["spid"]
    big, small = spids["big"], spids["small"]
    # the big one: opened from its file, never asked of the database
    assert opened_large == [big]
    assert big not in asked_ahead and big not in opened
    # the small one: read ahead, nothing opened
    assert small in asked_ahead and small not in opened and small not in opened_large
