"""qlist's lines on every flavour: the SQL flavours' and fs's rows, kv's entries.

The SQL flavours and fs hand out plain rows (ListsRows) that the one
formatter (sluice.listing) turns into lines; kv goes through entries(),
and so does fs for a selection its file names do not answer.  Both
must give what the qlist format says, written out here the plain way:
csv.writer over each entry's fields.
"""

from __future__ import annotations

import csv
import gc
import io
import re
from concurrent.futures import ProcessPoolExecutor
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest

from sluice import listing
from sluice.listing import QLIST_FIELDS, listing_rows, qlist_blocks, write_qlist
from sluice.model import QueueEntry, QueueState, Reply, Selector, Submission
from sluice.store import Action, ListsInPieces, ListsRows, StorageError, Store, Transition
from sluice.store import _fs_reading as fs_reading
from sluice.store import _sql as sql
from sluice.store._fs_files import parse_name
from tests.integration.stores import open_flavour

pytestmark = pytest.mark.integration

T0 = 1_800_000_000.0


def at(t: float) -> str:
    return datetime.fromtimestamp(t, UTC).strftime("%Y-%m-%d %H:%M:%S")


def expected(entries: list[QueueEntry]) -> str:
    """The qlist lines of ``entries`` as the format defines them."""
    out = io.StringIO()
    writer = csv.writer(out, delimiter=";", lineterminator="\n")
    writer.writerow(QLIST_FIELDS)
    for e in entries:
        writer.writerow([
            e.qid, e.spid, e.state.value, e.sender or "<>", e.recipient, e.domain,
            at(e.arrival_at), at(e.next_attempt_at), str(e.attempts), str(e.priority),
            e.tenantid, e.jobid, e.transportid, ",".join(e.localip),
            e.last_reply.describe() if e.last_reply else "", str(e.size),
            "yes" if e.is_report else "no"])
    return out.getvalue()


def fill(store: Store) -> dict[str, str]:
    """A queue with every kind of field qlist shows; the SPIDs by name."""
    odd = store.submit(Submission("a@example.org", ("p@example.net", "ünï@exämple.net"),
                                  tenantid="t;1", jobid='j"1', transportid="tr",
                                  localip=("192.0.2.1", "192.0.2.2"), priority=1),
                       b"odd", T0 + 0.5)
    report = store.submit(Submission("", ("e@example.net",), is_report=True), b"report",
                          T0 + 0.9999997)
    tried = store.submit(Submission("c@example.org", ("o@example.net", "q@example.net",
                                                      "r@example.org")), b"x" * 300, T0 + 1.25)
    held = store.submit(Submission("h@example.org", ("h@example.org",), hold=True), b"h", T0 + 2)
    for i in range(4):
        store.submit(Submission(f"s{i}@example.org", (f"u{i}@example.net", f"v{i}@example.com")),
                     b"plain", T0 + 3 + i * 0.4)
    replies = {0: Reply(451, "4.3.0", 'busy; try "later"\nplease', "mx.example.net", T0 + 2),
               1: Reply(421, "", "busy", "", None)}
    for e in store.claim(20, T0 + 2, 0):
        if e.spid == tried.spid and e.idx in replies:
            store.apply([Transition(e.qid, QueueState.DEFERRED, next_attempt_at=T0 + 60.9,
                                    reply=replies[e.idx], attempted=True)])
        else:
            store.apply([Transition(e.qid, QueueState.INCOMING, expect=(QueueState.ACTIVE,))])
    return {"odd": odd.spid, "report": report.spid, "tried": tried.spid, "held": held.spid}


def test_qlist_lines_of_every_flavour_are_the_format_s(
        store: Store, flavour: str, monkeypatch: pytest.MonkeyPatch) -> None:
    # Pages and chunks of three rows, a time cache of two: the lines must
    # not depend on where a page ends or on what the cache still holds.
    monkeypatch.setattr(sql, "PAGE", 3)
    monkeypatch.setattr(listing, "CHUNK", 3)
    monkeypatch.setattr(listing, "_TIMES_MAX", 2)
    monkeypatch.setattr(fs_reading, "LIST_PAGE", 2)  # messages a chunk
    spids = fill(store)
    # The SQL flavours and fs list plain rows; kv its entries.
    assert isinstance(store, ListsRows) is (flavour != "kv")
    chunks = list(listing_rows(store, Selector()))
    assert sum(map(len, chunks)) == 15 and all(chunks)
    assert len(chunks) == (4 if flavour == "fs" else 5)  # 8 messages by 2; 15 rows by 3
    held = store.entries(Selector(qids=(spids["held"],)))
    assert [e.state for e in held] == [QueueState.HOLD]
    for selector, limit in [
        (Selector(), None), (Selector(), 4), (Selector(), 1),
        (Selector(states=(QueueState.DEFERRED,)), None),
        (Selector(states=(QueueState.HOLD, QueueState.INCOMING)), None),
        (Selector(domain="example.net"), 5), (Selector(sender=""), None),
        (Selector(recipient="O@example.net"), None), (Selector(tenantid="t;1"), None),
        (Selector(jobid='j"1'), None), (Selector(transportid="tr"), None),
        (Selector(qids=(spids["tried"], spids["report"] + "-0")), None),
        (Selector(domain="nowhere.example"), None),
    ]:
        want = expected(list(store.entries(selector, limit=limit)))
        got = "".join(qlist_blocks(listing_rows(store, selector, limit)))
        assert got == want, (selector, limit)
    everything = "".join(qlist_blocks(listing_rows(store, Selector())))
    # What the rows carry: the quoted fields, a report, the reply with its host.
    assert everything.count("\n") == 1 + 15 + 1  # a reply text has a line break
    assert '"t;1";"j""1";tr;192.0.2.1,192.0.2.2;' in everything
    assert ';<>;e@example.net;example.net;2027-01-15 08:00:01;' in everything
    assert ('"host mx.example.net said: 451 4.3.0 busy; try ""later""\nplease"'
            in everything)
    assert ";421 busy;300;no\n" in everything


def test_qlist_is_written_in_blocks_of_bytes_as_the_stream_would_encode_it(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(sql, "PAGE", 3)
    store = open_flavour("sqlite", tmp_path)
    try:
        fill(store)
        store.modify(Selector(recipient="p@example.net"), Action.HOLD, T0 + 5)
        want = expected(list(store.entries(Selector())))
        for encoding, errors in (("utf-8", "strict"), ("ascii", "backslashreplace")):
            raw = io.BytesIO()
            out = io.TextIOWrapper(raw, encoding=encoding, errors=errors)
            out.write("before\n")
            write_qlist(out, store, Selector())
            out.write("after\n")
            out.flush()
            assert gc.isenabled()  # paused while listing only
            assert raw.getvalue() == f"before\n{want}after\n".encode(encoding, errors)
        text = io.StringIO()  # no binary buffer: the text itself
        write_qlist(text, store, Selector())
        assert text.getvalue() == want
    finally:
        store.close()


def test_fs_rows_name_a_broken_control_file_and_skip_one_that_went(tmp_path: Path) -> None:
    store = open_flavour("fs", tmp_path)
    try:
        fill(store)
        files = sorted((tmp_path / "queue").rglob("*.mmq"))
        gone = parse_name(files[0].name)
        assert gone is not None and len(files) > 2
        files[0].unlink()  # delivered while the listing walked: left out
        rows = [r for chunk in store.list_rows(Selector()) for r in chunk]
        assert len(rows) == 15 - gone.n
        assert rows == [r for chunk in listing.entry_rows(store.entries(Selector()))
                        for r in chunk]
        whole = files[1].read_bytes()
        for broken in (b"{not json", whole[:-5], whole + b"{}\n"):
            files[1].write_bytes(broken)
            with pytest.raises(StorageError, match=re.escape(str(files[1]))):
                list(store.list_rows(Selector()))
        files[1].write_bytes(whole)
        assert [r for chunk in store.list_rows(Selector()) for r in chunk] == rows
    finally:
        store.close()


def test_fs_qlist_in_pieces_read_by_other_processes_is_the_same_text(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # A page a message and a pool from the second page on, so that this
    # small queue goes through the worker processes as a million would.
    monkeypatch.setattr(fs_reading, "LIST_PAGE", 1)
    monkeypatch.setattr(listing, "PIECES_ALONE", 2)
    pools: list[int] = []

    class Pool(ProcessPoolExecutor):
        def submit(self, *args: Any, **kwargs: Any) -> Any:
            pools.append(id(self))
            return super().submit(*args, **kwargs)

    monkeypatch.setattr(listing, "ProcessPoolExecutor", Pool)
    store = open_flavour("fs", tmp_path)
    try:
        fill(store)
        assert isinstance(store, ListsInPieces)
        for selector in (Selector(), Selector(states=(QueueState.HOLD, QueueState.INCOMING)),
                         Selector(domain="example.net")):
            want = expected(list(store.entries(selector)))
            raw = io.BytesIO()
            out = io.TextIOWrapper(raw, encoding="ascii", errors="backslashreplace")
            out.write("before\n")
            pools.clear()
            write_qlist(out, store, selector, jobs=2)
            out.write("after\n")
            out.flush()
            assert raw.getvalue() == f"before\n{want}after\n".encode("ascii", "backslashreplace")
            assert len(set(pools)) == 1 and len(pools) == len({e.spid for e in
                                                                 store.entries(selector)})
        # One process, a limit, or a selection the names do not answer: no pool.
        pools.clear()
        for kwargs, selector in (({"jobs": 1}, Selector()), ({"jobs": 2, "limit": 3}, Selector()),
                                 ({"jobs": 2}, Selector(sender="c@example.org"))):
            text = io.TextIOWrapper(io.BytesIO(), encoding="utf-8")
            write_qlist(text, store, selector, **kwargs)
        assert pools == []
        # A broken file is named by the worker that read it, and nothing after it is written.
        files = sorted((tmp_path / "queue").rglob("*.mmq"))
        files[-1].write_bytes(b"{not json")
        raw = io.BytesIO()
        with pytest.raises(StorageError, match=re.escape(str(files[-1]))):
            write_qlist(io.TextIOWrapper(raw, encoding="utf-8"), store, Selector(), jobs=2)
        assert pools
    finally:
        store.close()


@pytest.mark.parametrize(("cpus", "jobs"), [(1, 2), (2, 4), (3, 6), (4, 8), (6, 8), (16, 16)])
def test_a_listing_shares_its_pieces_among_two_processes_a_cpu_up_to_eight(
        monkeypatch: pytest.MonkeyPatch, cpus: int, jobs: int) -> None:
    monkeypatch.setattr(listing.os, "sched_getaffinity", lambda pid: set(range(cpus)))
    assert listing.listing_jobs() == jobs
