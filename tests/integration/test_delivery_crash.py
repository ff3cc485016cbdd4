"""A crash at each step of a delivery: what reaches the next hop, and what the log says.

`sluice serve` is started with SLUICE_FAULT naming one point of a delivery
(sluice.faults); it queues one message, delivers it to a loopback sink and
kills itself with SIGKILL at that point.  It is started again on the same
queue, without the fault, and drains.  Then, per point:

    before_data   the sink never saw the message before the crash: once
    after_dot     the sink may have taken it, no reply was read: once or
                  twice, and twice only with the "may be a duplicate" note
    after_reply   the sink took it, the outcome was not committed: twice,
                  and the accounting log says "in flight at crash, may be
                  a duplicate"
    after_journal the success was synced to the success journal, maybe not
                  committed: exactly once, recorded as delivered at the
                  restart (sluice.journal; kept by every store here)
    after_commit  the outcome was committed: exactly once
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import smtplib
import sqlite3
import subprocess
from pathlib import Path

import pytest

from sluice.config import load_config
from sluice.faults import POINTS
from sluice.journal import journal_paths
from sluice.marks import mark_paths, read_marks
from sluice.sink import Sink
from sluice.store import open_store
from tests.integration.pg import dsn_for
from tests.integration.serving import (
    Serving,
    free_port,
    start_serve_with,
    wait_until,
    write_serve_config,
)

pytestmark = [pytest.mark.integration]

RCPT = "someone@dest.example"
NOTE = "in flight at crash, may be a duplicate"


def _send(port: int) -> None:
    c = smtplib.SMTP("127.0.0.1", port, local_hostname="client.test", timeout=10)
    try:
        c.sendmail("sender@src.example", [RCPT],
                   b"Subject: crash point\r\nX-Test-Id: 1\r\n\r\nthe body\r\n")
        # The fault may strike before our QUIT (a busy machine): the
        # receiver then answers 421, shutting down; the 250 is what counts.
        with contextlib.suppress(smtplib.SMTPException, OSError):
            c.quit()
    finally:
        c.close()


def _accounting(log_dir: Path) -> list[dict[str, object]]:
    return [json.loads(line) for path in sorted(log_dir.glob("sluice-acct-*.jsonl"))
            for line in path.read_text().splitlines() if line.strip()]


def _copies(sink: Sink) -> int:
    return sum(1 for m in list(sink.messages) if RCPT in m.recipients)


def _died(srv: Serving) -> int | None:
    """Wait for the fault to kill the manager; then end its receivers too.

    None if the manager was still running after 30 s (it is killed then).
    """
    try:
        code: int | None = srv.proc.wait(30)
    except subprocess.TimeoutExpired:
        code = None
    with contextlib.suppress(ProcessLookupError):
        os.killpg(srv.proc.pid, signal.SIGKILL)
    if srv.proc.stdout:
        srv.proc.stdout.close()
    return code


def _killed_at(point: str, tmp_path: Path, queue: dict[str, object], sink: Sink,
               sink_port: int, monkeypatch: pytest.MonkeyPatch) -> tuple[Path, int]:
    """serve on ``queue`` killed by the fault at ``point`` with one message: its config, port.

    Returns once the sink has seen the killed connection close: a message
    whose final dot it had is counted (or not) by then, for good.
    """
    if queue["store"] == "postgres":
        queue["postgres"] = {"dsn": dsn_for(tmp_path)}
    port = free_port()
    config = write_serve_config(tmp_path, port, queue=queue,
                                delivery={"transport": {"*": f"smtp:[127.0.0.1]:{sink_port}"}})
    monkeypatch.setenv("SLUICE_FAULT", point)
    srv = start_serve_with(config, tmp_path, port)
    try:
        _send(port)
    finally:
        code = _died(srv)
    monkeypatch.delenv("SLUICE_FAULT")
    assert code == -signal.SIGKILL, "the fault point was not reached"
    # A CI run read the copies before the sink had handled the final dot
    # it already held (after_dot: 0, then 2 after the restart).
    assert wait_until(lambda: sink.snapshot().current_connections == 0, 30)
    return config, port


@pytest.mark.parametrize("store", ["sqlite", "postgres", "kv"])
@pytest.mark.parametrize("point", POINTS)
def test_crash_at_a_point_of_delivery(point: str, store: str, tmp_path: Path,
                                      monkeypatch: pytest.MonkeyPatch) -> None:
    # PostgreSQL: the queue other nodes may share; the note is for this node's
    # attempts only, found by the claim's owner.  kv: outcomes synced on their
    # own, claims and marks not synced (sluice.store._kv_db).
    queue: dict[str, object] = {"store": store}
    if point == "after_journal":  # the journal's default is PostgreSQL's alone
        queue["success_journal"] = True
    sink = Sink(keep=True)
    sport = sink.start_in_thread()
    try:
        config, port = _killed_at(point, tmp_path, queue, sink, sport, monkeypatch)
        before = _copies(sink)
        srv = start_serve_with(config, tmp_path, port)
        try:
            if store == "kv":  # one process at a time: counted once serve has stopped
                assert wait_until(lambda: _copies(sink) >= 1 and any(
                    e["event"] == "delivered" for e in _accounting(tmp_path / "log")), 60)
            else:
                assert wait_until(lambda: srv.recipients_left() == 0 and _copies(sink) >= 1, 60)
        finally:
            assert srv.stop() == 0
        assert srv.recipients_left() == 0
        after = _copies(sink)
        events = [e for e in _accounting(tmp_path / "log") if e["recipient"] == RCPT]
        noted = [e for e in events if e["event"] == "recovered" and e["response"] == NOTE]
        delivered = [e for e in events if e["event"] == "delivered"]
        assert len(delivered) == 1, events
    finally:
        sink.stop_thread()

    match point:
        case "before_data":
            assert (before, after) == (0, 1)
        case "after_dot":
            assert before in (0, 1)
            assert after == before + 1
            if after == 2:
                assert noted, events
        case "after_reply":
            assert (before, after) == (1, 2)
            assert len(noted) == 1, events
        case "after_journal" | "after_commit":
            assert (before, after) == (1, 1)
            assert not noted, events
            # The reply and the connection's facts (kept by the journal for the replay:
            # the store has a journaled success only after the journal's sync).
            assert (delivered[0]["code"], delivered[0]["remoteip"]) == (250, "127.0.0.1"), \
                delivered


@pytest.mark.parametrize("journal", ["on", "off"])
@pytest.mark.parametrize("store", ["sqlite", "postgres"])
def test_a_restart_records_the_successes_the_journal_kept(
        store: str, journal: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Killed after the reply; the journal says the sink took it: not sent again.

    The line is written by the test, as the journal's thread would have
    synced it, with the reply and facts of the test's choosing.  A journal
    left by a run that kept one is replayed by a run that does not, and
    then removed.
    """
    queue: dict[str, object] = {"store": store, "success_journal": journal == "on"}
    sink = Sink(keep=True)
    sport = sink.start_in_thread()
    try:
        config, port = _killed_at("after_reply", tmp_path, queue, sink, sport, monkeypatch)
        assert _copies(sink) == 1
        (qid,) = {e["qid"] for e in _accounting(tmp_path / "log") if e["recipient"] == RCPT}
        store = open_store(load_config(config))
        try:
            entry = store.get(qid)
        finally:
            store.close()
        assert entry is not None
        paths = journal_paths(tmp_path / "queue", "test-node")
        paths[1].write_text(json.dumps({"q": qid, "a": entry.arrival_at,
                                        "r": [250, "2.0.0", "kept by the journal"],
                                        "l": None, "m": "sink.test", "i": "127.0.0.1",
                                        "d": 0.25}) + "\n")

        srv = start_serve_with(config, tmp_path, port)
        try:
            assert wait_until(lambda: srv.recipients_left() == 0, 60)
        finally:
            assert srv.stop() == 0
        assert _copies(sink) == 1
        if journal == "on":
            assert [p.stat().st_size for p in paths] == [0, 0]
        else:
            assert not any(p.exists() for p in paths)
    finally:
        sink.stop_thread()
    events = [e for e in _accounting(tmp_path / "log") if e["recipient"] == RCPT]
    assert [e["event"] for e in events] == ["received", "delivered"], events
    assert (events[1]["response"], events[1]["remotemx"], events[1]["duration_s"]) == \
        ("kept by the journal", "sink.test", 0.25)


def test_a_restart_notes_an_attempt_only_the_mark_log_had(tmp_path: Path,
                                                          monkeypatch: pytest.MonkeyPatch
                                                          ) -> None:
    """Killed after the reply: the store has no "delivering" mark, only the mark
    log's line says the attempt began, and that line alone gives the note.

    On a queue of one node the store gets no mark while the line is kept
    (sluice.marks), so the entry is plainly active at the kill.
    """
    sink = Sink(keep=True)
    sport = sink.start_in_thread()
    try:
        config, port = _killed_at("after_reply", tmp_path, {"store": "sqlite"}, sink, sport,
                                  monkeypatch)
        assert _copies(sink) == 1
        (qid,) = {e["qid"] for e in _accounting(tmp_path / "log") if e["recipient"] == RCPT}
        assert f"{qid}/0" in read_marks(mark_paths(tmp_path / "queue", "test-node"))
        db = sqlite3.connect(tmp_path / "queue" / "queue.db")
        try:
            states = [s for s, in db.execute("SELECT state FROM queue")]
        finally:
            db.close()
        assert states == ["active"]

        srv = start_serve_with(config, tmp_path, port)
        try:
            assert wait_until(lambda: srv.recipients_left() == 0 and _copies(sink) == 2, 60)
        finally:
            assert srv.stop() == 0
    finally:
        sink.stop_thread()
    events = [e for e in _accounting(tmp_path / "log") if e["recipient"] == RCPT]
    assert [e["event"] for e in events] == ["received", "recovered", "delivered"], events
    assert events[1]["response"] == NOTE
