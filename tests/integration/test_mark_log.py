"""The mark log in a running queue manager: deliveries go before the store has the mark.

A real Server (receivers, queue manager, SQLite store) delivering to a real
sink on loopback; the store's "delivering" mark is refused (at least twice,
and until the message has reached the sink: SqliteStore.apply_future
raises), as a store that is briefly failing would refuse it.  The message
must reach the sink anyway -- the mark log's line is what a restart would
read -- and the mark must be tried again until the store has it
(sluice.runtime.deliveries, Deliveries._mark).
"""

from __future__ import annotations

import asyncio
import smtplib
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest

from sluice.marks import mark_paths, read_marks
from sluice.model import QueueState
from sluice.runtime.parts import Backoff, Health
from sluice.runtime.serve import Server
from sluice.sink import Sink
from sluice.store import StorageError, Transition
from sluice.store.sqlite import SqliteStore
from tests.conftest import make_config
from tests.integration.serving import free_port, run_in_process, wait_until

pytestmark = pytest.mark.integration


def _send(host: str, port: int) -> None:
    with smtplib.SMTP(host, port, local_hostname="client.test", timeout=10) as c:
        c.sendmail("a@sender.example", ["b@rcpt.example"], b"Subject: t\r\n\r\nbody\r\n")


def test_a_failing_store_mark_is_retried_and_does_not_hold_the_delivery(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    sink = Sink(keep=True)
    sink_port = sink.start_in_thread()
    real = SqliteStore.apply_future
    marks: list[int] = []  # messages the sink had at each try of the store's mark

    def apply_future(self: SqliteStore, transitions: Sequence[Transition], **kw: Any) -> Any:
        if any(t.state is QueueState.DELIVERING for t in transitions):
            marks.append(len(sink.messages))
            # refused until the sink has the message, and at least twice
            if len(marks) <= 2 or not sink.messages:
                raise StorageError("injected: the store refuses the mark")
        return real(self, transitions, **kw)

    monkeypatch.setattr(SqliteStore, "apply_future", apply_future)
    cfg = make_config(tmp_path, queue={"store": "sqlite"},
                      smtpd={"listen": [f"127.0.0.1:{free_port()}"], "processes": 1},
                      delivery={"transport": {"*": f"smtp:[127.0.0.1]:{sink_port}"}},
                      api={"enabled": False})  # no fixed port for tests side by side
    srv = Server(cfg, poll_s=0.05, health=Health(backoff=Backoff(first_s=0.01, max_s=0.05)))
    seen: list[str] = []

    async def body() -> None:
        await asyncio.to_thread(_send, *srv.addresses[0])
        await asyncio.to_thread(
            wait_until, lambda: len(marks) >= 3 and len(sink.messages) >= 1, 20)
        # the line was written before the content went, and is still there
        seen.extend(read_marks(mark_paths(tmp_path / "queue", "test-node")))

    run_in_process(srv, sink, body)
    assert len(sink.messages) == 1
    # the message went while the store refused its mark, which was tried
    # again until the store took it (once the sink had the message)
    assert marks[0] == 0 and marks[-1] == 1 and len(marks) >= 3, marks
    assert len(seen) == 1 and seen[0].endswith("/0")
