"""The fs flavour's own promises: Mailismus's layout, claims across processes,
journal replay after a crash at the worst moment, content links, a full disk.

The shared contract (tests/integration/test_store_contract.py) runs against
this flavour too; these tests look at the files themselves.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

import pytest

import sluice.store._fs_batch as fs_batch
import sluice.store._fs_reading as fs_reading
from sluice.model import QueueEntry, QueueState, Reply, Selector, Submission
from sluice.store import Accepted, Action, Transition
from sluice.store._fs_files import Control, Name
from sluice.store._refill import TenantWeights
from sluice.store.fs import FsStore
from tests.conftest import ROOT, subprocess_env
from tests.integration.stores import flavour_config, open_flavour, run_diskfull, spy_dirs

pytestmark = pytest.mark.integration

T0 = 1_800_000_000.0  # on the 15-minute grid
S = QueueState


def open_fs(tmp: Path, **queue: object) -> FsStore:
    store = open_flavour("fs", tmp, queue=dict(queue))
    assert isinstance(store, FsStore)
    return store


def tree(store: FsStore, *, buckets: bool = False) -> dict[str, list[str]]:
    """Control file names per directory, relative to the queue root.

    incoming/<bucket>/ counts as incoming/ unless ``buckets``.
    """
    out: dict[str, list[str]] = {}
    for path in sorted(store.root.rglob("*.mmq")):
        rel = str(path.parent.relative_to(store.root))
        if not buckets and rel.startswith("incoming/"):
            rel = "incoming"
        out.setdefault(rel, []).append(path.name)
    return out


def test_control_files_per_message_and_domain_named_by_spid_and_domain(tmp_path: Path
                                                                       ) -> None:
    store = open_fs(tmp_path)
    try:
        acc = store.submit(Submission("alice@example.org",
                                      ("a@one.example", "b@two.example", "c@ONE.example"),
                                      priority=1), b"Subject: x\r\n\r\nbody\r\n", T0)
        names = tree(store, buckets=True)
        # incoming/ is split by priority and arrival: the SPID's leading digits.
        bucket = f"incoming/p1-{acc.spid[:8]}"
        assert names == {bucket: [f"{acc.spid}-0+2p1@one.example.mmq",
                                  f"{acc.spid}-1+1p1@two.example.mmq"]}
        doc = json.loads((store.root / bucket / names[bucket][0]).read_text())
        assert [r[:2] for r in doc["rcpts"]] == [[0, "a@one.example"], [2, "c@ONE.example"]]
        assert doc["sender"] == "alice@example.org" and doc["domain"] == "one.example"
        # Each control file holds one hard link to the content.
        spool = store.spool
        assert os.stat(spool.path(acc.spid)).st_nlink == 3
        assert sorted(p.name for p in spool.directory(acc.spid).glob(f"{acc.spid}-*.ref")) == [
            f"{acc.spid}-0.ref", f"{acc.spid}-1.ref"]
        # qcount answers from names alone.
        assert store.count().by_state[S.INCOMING] == 3 and store.count().messages == 1
        assert store.count(Selector(domain="one.example")).recipients == 2
    finally:
        store.close()


def one_recipient_messages(store: FsStore, n: int) -> list[Accepted]:
    """``n`` messages to x0@d.example ... queued at T0."""
    return [store.submit(Submission("a@example.org", (f"x{i}@d.example",)), b"body", T0)
            for i in range(n)]


def deferred_messages(store: FsStore, due: list[float]) -> list[QueueEntry]:
    """One one-recipient message per ``due`` time, queued at T0, claimed and deferred to it.

    The claimed entries, in the order the messages were queued.
    """
    accs = one_recipient_messages(store, len(due))
    claimed = {e.spid: e for e in store.claim(len(due), T0, len(due))}
    store.apply([Transition(claimed[a.spid].qid, S.DEFERRED, next_attempt_at=at, attempted=True)
                 for a, at in zip(accs, due, strict=True)], wait=True)
    return [claimed[a.spid] for a in accs]


def spy_loads(monkeypatch: pytest.MonkeyPatch, name: Callable[[str], str] = str) -> list[str]:
    """What Batch.load is called on (through ``name``), as the calls come."""
    loads: list[str] = []
    real = fs_batch.Batch.load

    def load(self: fs_batch.Batch, path: str) -> Control | None:
        loads.append(name(path))
        return real(self, path)

    monkeypatch.setattr(fs_batch.Batch, "load", load)
    return loads


def test_recovered_entries_go_to_a_directory_already_due(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    store = open_fs(tmp_path)  # retry_granularity 15m
    try:
        accs = one_recipient_messages(store, 3)
        assert len(store.claim(10, T0, 10)) == 3
        now = T0 + 1000  # between two grid lines
        assert store.recover(now) == 3
        # The grid line before now: not the one after it, whose files every
        # refill would read for their exact times until it came.
        assert tree(store) == {
            f"deferred/{int(T0 + 900)}": sorted(f"{a.spid}-0+1p0@d.example.mmq" for a in accs)}
        loads = spy_loads(monkeypatch)
        store.tenant_weights = TenantWeights(fair=False)
        claimed = store.claim(10, now, 10)
        assert sorted(e.spid for e in claimed) == sorted(a.spid for a in accs)
        assert all(e.next_attempt_at <= now for e in claimed)
        assert len(loads) == 3  # each file once, to move it: none for its due time
    finally:
        store.close()


def test_a_refill_reads_a_file_in_the_due_window_once_until_it_changes(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    store = open_fs(tmp_path)  # retry_granularity 15m
    try:
        # All four in deferred/T0+900; due at T0+100, +200, +300 and +400.
        accs = deferred_messages(store, [T0 + 100 * (i + 1) for i in range(4)])
        assert list(tree(store)) == [f"deferred/{int(T0 + 900)}"]
        loads = spy_loads(monkeypatch, lambda path: path.rsplit("/", 1)[1].split("-")[0])
        store.tenant_weights = TenantWeights(fair=False)
        assert store.claim(10, T0 + 50, 10) == []  # none due: each read for its time
        assert sorted(loads) == sorted(a.spid for a in accs)
        loads.clear()
        assert store.claim(10, T0 + 60, 10) == []
        assert loads == []  # known by their stamps: none read again
        reads: list[str] = []
        real_read = fs_reading.read_control

        def read_control(root: Path, rel: str) -> Control | None:
            reads.append(rel)
            return real_read(root, rel)

        monkeypatch.setattr(fs_reading, "read_control", read_control)
        assert store.due_at() == T0 + 100
        assert reads == []  # the refill's memo serves due_at() too
        # The first one's time changes (a new file under the same name):
        # due_at() reads it, once, and the refill after it does not.
        store.apply([Transition(accs[0].qid, S.DEFERRED, next_attempt_at=T0 + 500)], wait=True)
        [first] = [store.get(accs[0].qid)]
        assert first is not None and first.next_attempt_at == T0 + 500
        reads.clear()
        assert store.due_at() == T0 + 200 and store.due_at() == T0 + 200
        assert [r.rsplit("/", 1)[1].split("-")[0] for r in reads] == [accs[0].spid]
        loads.clear()
        got = store.claim(10, T0 + 300, 10)
        assert [e.spid for e in got] == [accs[1].spid, accs[2].spid]
        assert accs[0].spid not in loads and accs[3].spid not in loads
        # Once its directory's time has come, a refill takes the rest by name.
        assert store.claim(10, T0 + 900, 10) and store.due_at() is None
    finally:
        store.close()


def test_a_claim_chooses_from_the_deferred_backlog_without_holding_the_committer(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import sluice.store._fs_refill as fs_refill

    store = open_fs(tmp_path)  # retry_granularity 15m
    try:
        accs = deferred_messages(store, [T0 + 100] * 3)
        real = fs_refill.Refilling._due_candidates
        during: list[str] = []

        def scan(self: FsStore, *args: object, **kw: object) -> object:
            found = real(self, *args, **kw)  # type: ignore[arg-type]
            # While the claim has its choice, a submission and a delete
            # commit: the committer is not waiting on this pass.
            box: list[object] = []
            worker = threading.Thread(target=lambda: box.append((
                store.submit(Submission("b@example.org", ("y@e.example",)), b"body", T0),
                store.modify(Selector(qids=(accs[0].spid,)), Action.DELETE, T0 + 1000))))
            worker.start()
            worker.join(timeout=10)
            during.append("committed" if box else "held up")
            return found

        monkeypatch.setattr(fs_refill.Refilling, "_due_candidates", scan)
        got = store.claim(10, T0 + 1000, 10)
        assert during == ["committed"]
        # The deleted one was chosen, then found gone and skipped; the new
        # submission comes first (incoming is chosen inside the batch).
        assert [e.spid for e in got if e.state is S.ACTIVE] == [
            got[0].spid, accs[1].spid, accs[2].spid]
        assert got[0].recipient == "y@e.example"
    finally:
        store.close()


def test_oldest_lists_a_directory_again_only_once_it_changed(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import sluice.store._fs_oldest as fs_oldest
    from sluice.spool import new_spid, spid_time

    store = open_fs(tmp_path)
    try:
        accs = [store.submit(Submission("a@example.org", (f"x{i}@d.example",),
                                        spid=new_spid(int((T0 + i) * 1000)), hold=i < 2),
                             b"body", T0 + i) for i in range(4)]
        listed: list[str] = []
        real = fs_oldest.scandir

        def scandir(path: Path) -> object:
            listed.append(str(path.relative_to(store.root)))
            return real(path)

        monkeypatch.setattr(fs_oldest, "scandir", scandir)
        want = {S.HOLD: T0, S.INCOMING: T0 + 2}
        assert store.oldest() == pytest.approx(want)
        assert "hold" in listed
        # Just changed: listed each time, as a change in the same clock tick
        # as the listing would not change the stamp.
        listed.clear()
        assert store.oldest() == pytest.approx(want) and "hold" in listed
        # Settled (last changed 10 s ago): listed once, then known.
        for d in [*store.root.iterdir(), *(store.root / "incoming").iterdir()]:
            if d.is_dir():
                os.utime(d, ns=(time.time_ns() - 10**10,) * 2)
        assert store.oldest() == pytest.approx(want)
        listed.clear()
        assert store.oldest() == pytest.approx(want) and listed == []
        # A change (the oldest held message goes) is seen at once.
        store.modify(Selector(qids=(accs[0].spid,)), Action.DELETE, T0 + 10)
        assert store.oldest() == pytest.approx({S.HOLD: spid_time(accs[1].spid),
                                                S.INCOMING: T0 + 2})
        assert listed == ["hold"]
    finally:
        store.close()


def test_deferred_directories_are_named_by_the_rounded_due_time(tmp_path: Path) -> None:
    store = open_fs(tmp_path)  # retry_granularity 15m
    try:
        acc = store.submit(Submission("a@example.org", ("x@d.example", "y@d.example")),
                           b"body", T0)
        e0, e1 = store.claim(10, T0, 10)
        reply = Reply(451, "4.7.1", "later")
        store.apply([Transition(e0.qid, S.DEFERRED, next_attempt_at=T0 + 100, reply=reply,
                                attempted=True),
                     Transition(e1.qid, S.DEFERRED, next_attempt_at=T0 + 2000, reply=reply,
                                attempted=True)])
        assert tree(store) == {
            f"deferred/{int(T0 + 900)}": [f"{acc.spid}-0+1p0@d.example.mmq"],
            f"deferred/{int(T0 + 2700)}": [f"{acc.spid}-1+1p0@d.example.mmq"],
        }
        assert store.due_at() == T0 + 100
        assert store.claim(10, T0 + 99, 10) == []  # in the directory's window, not due yet
        assert [e.qid for e in store.claim(10, T0 + 100, 10)] == [e0.qid]
        # The directory emptied by the claim is gone.
        assert not (store.root / "deferred" / str(int(T0 + 900))).exists()
    finally:
        store.close()


def test_recipients_that_part_ways_split_the_file_and_content_waits_for_the_last(
        tmp_path: Path) -> None:
    store = open_fs(tmp_path)
    try:
        acc = store.submit(Submission("a@example.org", ("x@d.example", "y@d.example",
                                                        "z@d.example")), b"body", T0)
        claimed = store.claim(2, T0, 10)  # the limit splits the file
        assert [e.idx for e in claimed] == [0, 1]
        assert tree(store) == {"active": [f"{acc.spid}-0+2p0@d.example.mmq"],
                               "incoming": [f"{acc.spid}-2+1p0@d.example.mmq"]}
        store.apply([Transition(claimed[0].qid, None, reply=Reply(250, "2.0.0", "ok"))])
        assert tree(store) == {"active": [f"{acc.spid}-1+1p0@d.example.mmq"],
                               "incoming": [f"{acc.spid}-2+1p0@d.example.mmq"]}
        assert store.spool.exists(acc.spid)
        store.modify(Selector(qids=(acc.spid,)), Action.DELETE, T0)
        assert tree(store) == {}
        # The links go with the commit; the content a moment later, on the spool's thread.
        assert list(store.spool.directory(acc.spid).glob(f"{acc.spid}-*.ref")) == []
        deadline = time.monotonic() + 5
        while store.spool.exists(acc.spid) and time.monotonic() < deadline:
            time.sleep(0.01)
        assert not store.spool.exists(acc.spid)
        assert list((store.root / "journal").iterdir()) == []
        assert list((store.root / "tmp").iterdir()) == []
    finally:
        store.close()


_CLAIMER = """
import json, sys, time
from sluice.config import load_config
from sluice.store import open_store
store = open_store(load_config(sys.argv[1]))
print("ready", flush=True)
sys.stdin.readline()  # both start together: one must not claim all before the other is up
got = []
idle = 0
while idle < 3:
    batch = store.claim(7, time.time() + 10, 10)
    got += [e.qid for e in batch]
    idle = 0 if batch else idle + 1
store.close()
print(json.dumps(got))
"""


def test_two_processes_never_claim_the_same_recipient(tmp_path: Path) -> None:
    cfg = flavour_config("fs", tmp_path)
    store = open_fs(tmp_path)
    qids: list[str] = []
    for i in range(150):
        acc = store.submit(Submission("a@example.org",
                                      (f"u{i}@d{i % 3}.example", f"v{i}@d{i % 3}.example",
                                       f"w{i}@e.example")), b"body", T0)
        qids += acc.qids
    store.close()
    path = tmp_path / "sluice.yaml"
    path.write_text(json.dumps(cfg.to_dict(readable=True)))
    procs = [subprocess.Popen([sys.executable, "-c", _CLAIMER, str(path)], cwd=ROOT,
                              env=subprocess_env(), stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, text=True)
             for _ in range(2)]
    for p in procs:
        assert p.stdout is not None and p.stdout.readline() == "ready\n"
    for p in procs:
        assert p.stdin is not None
        p.stdin.write("go\n")
        p.stdin.flush()
    results = [json.loads(p.communicate(timeout=120)[0]) for p in procs]
    assert all(p.returncode == 0 for p in procs)
    first, second = results
    assert first and second, "both processes should have claimed something"
    assert not set(first) & set(second)
    assert sorted(first + second) == sorted(qids)
    store = open_fs(tmp_path)
    try:
        assert store.count()[S.ACTIVE] == len(qids)
    finally:
        store.close()


_CRASHER = """
import os, sys, time
from sluice.config import load_config
from sluice.model import Submission
from sluice.store import open_store
import threading
import sluice.store._fs_commit as fs_commit
import sluice.store.fs as fs
real_rename = os.rename
first = threading.Lock()
def crash_after_first_rename(src, dst):
    if "tmp" in str(src):
        if not first.acquire(blocking=False):
            time.sleep(60)  # the other renames of the batch never happen
        real_rename(src, dst)
        os._exit(9)  # the process dies in the middle of putting the batch in place
    real_rename(src, dst)
fs.os.rename = crash_after_first_rename
store = open_store(load_config(sys.argv[1]))
store.submit(Submission("a@example.org", ("x@one.example", "y@two.example", "z@three.example")),
             b"Subject: journal\\r\\n\\r\\nbody\\r\\n", time.time())
"""


def test_a_crash_while_a_batch_goes_into_place_is_completed_from_the_journal(
        tmp_path: Path) -> None:
    cfg = flavour_config("fs", tmp_path)
    path = tmp_path / "sluice.yaml"
    path.write_text(json.dumps(cfg.to_dict(readable=True)))
    open_fs(tmp_path).close()
    proc = subprocess.run([sys.executable, "-c", _CRASHER, str(path)], cwd=ROOT,
                          env=subprocess_env(), capture_output=True, text=True, timeout=60)
    assert proc.returncode == 9, proc.stderr
    root = tmp_path / "queue"
    # The crash left one control file of three in place, the rest in tmp/.
    assert len(list((root / "incoming").iterdir())) == 1
    assert len(list((root / "journal").iterdir())) == 1
    store = open_fs(tmp_path)  # the next writer replays the journal
    try:
        entries = list(store.entries(Selector()))
        assert [e.recipient for e in entries] == ["x@one.example", "y@two.example",
                                                  "z@three.example"]
        with store.open_content(entries[0].spid) as stream:
            assert stream.read() == b"Subject: journal\r\n\r\nbody\r\n"
        assert list((root / "journal").iterdir()) == []
        assert list((root / "tmp").iterdir()) == []
    finally:
        store.close()


def test_a_crash_before_the_journal_leaves_nothing_half_done(tmp_path: Path) -> None:
    crasher = _CRASHER.replace('os._exit(9)', 'pass').replace(
        "fs.os.rename = crash_after_first_rename",
        "real_write = fs_commit.write_file\n"
        "def die_at_journal(path, data):\n"
        "    if 'journal' in str(path): os._exit(9)\n"
        "    return real_write(path, data)\n"
        "fs_commit.write_file = die_at_journal")
    cfg = flavour_config("fs", tmp_path)
    path = tmp_path / "sluice.yaml"
    path.write_text(json.dumps(cfg.to_dict(readable=True)))
    open_fs(tmp_path).close()
    proc = subprocess.run([sys.executable, "-c", crasher, str(path)], cwd=ROOT,
                          env=subprocess_env(), capture_output=True, text=True, timeout=60)
    assert proc.returncode == 9, proc.stderr
    store = open_fs(tmp_path)
    try:
        # The journal never reached its end: no recipient of the message is queued.
        assert list(store.entries(Selector())) == []
        assert list((tmp_path / "queue" / "journal").iterdir()) == []
        # Its content and control files are orphans; the check recover()
        # starts removes them once they are old enough not to belong to a
        # submission in flight.
        for path in [*store.spool.root.rglob("*.msg"), *(tmp_path / "queue" / "tmp").iterdir()]:
            os.utime(path, (time.time() - 7200, time.time() - 7200))
        store.recover(time.time())
        assert store.wait_check(30)
        assert list(store.spool.spids()) == []
        assert list(store.spool.root.rglob("*.ref")) == []
        assert list((tmp_path / "queue" / "tmp").iterdir()) == []
    finally:
        store.close()


def test_a_new_granularity_refiles_the_deferred_tree(tmp_path: Path) -> None:
    store = open_fs(tmp_path)
    try:
        acc = store.submit(Submission("a@example.org", ("x@d.example",), delay_s=100), b"b", T0)
        assert tree(store) == {f"deferred/{int(T0 + 900)}": [f"{acc.spid}-0+1p0@d.example.mmq"]}
    finally:
        store.close()
    store = open_fs(tmp_path, retry_granularity="1m")
    try:
        assert tree(store) == {f"deferred/{int(T0 + 120)}": [f"{acc.spid}-0+1p0@d.example.mmq"]}
        assert [e.qid for e in store.claim(5, T0 + 100, 10)] == list(acc.qids)
        layout = json.loads((store.root / "layout.json").read_text())
        assert layout == {"layout": 2, "granularity_s": 60.0}
    finally:
        store.close()


def test_control_files_written_before_the_smtputf8_flag_still_load(tmp_path: Path) -> None:
    store = open_fs(tmp_path)
    try:
        flagged = store.submit(Submission("a@example.org", ("x@d.example",), smtputf8=True),
                               b"one", T0)
        old = store.submit(Submission("a@example.org", ("y@e.example",)), b"two", T0)
    finally:
        store.close()
    files = {p.name.split("-")[0]: p for p in (tmp_path / "queue" / "incoming").glob("*/*")}
    assert json.loads(files[flagged.spid].read_text())["smtputf8"] is True
    doc = json.loads(files[old.spid].read_text())
    del doc["smtputf8"]  # as an older Sluice wrote it
    files[old.spid].write_text(json.dumps(doc) + "\n")
    store = open_fs(tmp_path)
    try:
        got = {e.spid: e.smtputf8 for e in store.entries(Selector())}
        assert got == {flagged.spid: True, old.spid: False}
        assert {e.spid: e.smtputf8 for e in store.claim(5, T0, 10)} == got
    finally:
        store.close()


def test_names_parse_back() -> None:
    parsed = Name.parse("018C2F3A1B7E4D20-3+12p1@example.net.mmq")
    assert parsed == Name("018C2F3A1B7E4D20", 3, 12, 1, "example.net")
    assert Name.parse("notes.txt") is None


def test_a_full_disk_is_a_temporary_failure_and_passes() -> None:
    found = run_diskfull("fs", size="4m", ballast_mb=1)
    assert found["other_error"] is None
    assert found["error"] and "No space left" in found["error"]
    assert found["accepted"] > 0 and found["second_ok"] is False
    assert found["all_listed"] and found["all_intact"] and found["count"] == found["accepted"]
    assert found["after_ok"], found.get("after_error")
    assert found["count_after"] == found["accepted"] - 3 + 1


def test_a_submission_changed_in_its_own_batch_is_written_as_changed(tmp_path: Path) -> None:
    # Submitters write their control files before the batch; a refill that
    # splits the message in the same batch must not rename that now stale
    # file into place.
    store = open_fs(tmp_path)
    try:
        first = store.submit(Submission("a@example.org", ("w@c.example",)), b"one", T0)
        gate, holding = threading.Event(), threading.Event()

        def hold(view: object) -> None:  # keeps the committer busy meanwhile
            holding.set()
            gate.wait(10)

        store._committer.submit(hold)
        assert holding.wait(10)
        fut = store.submit_future(Submission("a@example.org", ("x@d.example", "y@d.example",
                                                               "z@d.example")), b"two", T0)
        claimed: list[str] = []
        op = threading.Thread(target=lambda: claimed.extend(
            e.qid for e in store.claim(2, T0, 0)))
        op.start()
        deadline = time.monotonic() + 10
        while store._committer._ops.qsize() < 2 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert store._committer._ops.qsize() == 2  # the next batch: both together
        gate.set()
        acc = fut.result(timeout=10)
        op.join(10)
        assert claimed == [first.qids[0], acc.qids[0]]
        assert tree(store) == {"active": [f"{first.spid}-0+1p0@c.example.mmq",
                                          f"{acc.spid}-0+1p0@d.example.mmq"],
                               "incoming": [f"{acc.spid}-1+2p0@d.example.mmq"]}
        assert [(e.qid, e.state) for e in store.entries(Selector(qids=(acc.spid,)))] == [
            (acc.qids[0], S.ACTIVE), (acc.qids[1], S.INCOMING), (acc.qids[2], S.INCOMING)]
        assert list((store.root / "tmp").iterdir()) == []
    finally:
        store.close()


def test_recovery_commits_in_pieces_so_a_new_message_waits_for_one_piece_only(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # After a crash with a full active queue, rewriting every in-flight
    # control file in one commit kept the receivers' commits (and so their
    # 250s) waiting for all of it.
    from sluice.store import _fs_recovery as fs

    monkeypatch.setattr(fs, "RECOVER_BATCH", 2)
    store = open_fs(tmp_path)
    try:
        for i in range(6):
            store.submit(Submission("a@example.org", (f"r{i}@d{i}.example",)), b"x", T0)
        assert len(store.claim(6, T0, 0)) == 6
        rewritten: list[int] = []
        seen_at_commit: list[int] = []
        real_copy = fs.copy_control

        def copy_control(ctrl: Control) -> Control:
            if not rewritten:  # recovery's first file: a message arrives now
                fut = store.submit_future(Submission("b@example.org", ("n@new.example",)),
                                          b"new", T0 + 1)
                fut.add_done_callback(lambda _: seen_at_commit.append(len(rewritten)))
            rewritten.append(1)
            return real_copy(ctrl)

        monkeypatch.setattr(fs, "copy_control", copy_control)
        assert store.recover(T0 + 2) == 6
        assert len(rewritten) >= 6
        assert seen_at_commit and seen_at_commit[0] < len(rewritten)  # before the last piece
        counts = store.count()
        assert (counts[S.DEFERRED], counts[S.INCOMING], counts[S.ACTIVE]) == (6, 1, 0)
        assert [e.state for e in store.claim(10, T0 + 2, 0)].count(S.ACTIVE) == 7
    finally:
        store.close()


def test_a_submission_does_not_list_the_directory_it_writes_into(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # Each batch listed (and parsed) all of incoming/ to place its files:
    # submissions slowed down in proportion to the queue, to 40 a second at
    # 430,000 control files.
    import sluice.store._fs_batch as fs_batch

    store = open_fs(tmp_path)
    try:
        for i in range(3):
            store.submit(Submission("a@example.org", (f"r{i}@d.example",)), b"x", T0)
        listed = spy_dirs(monkeypatch, fs_batch, "listdir")
        acc = store.submit(Submission("a@example.org", ("n@d.example", "m@e.example")), b"y",
                           T0)
        assert "incoming" not in listed
        # A refill (which lists the buckets of incoming/ and reads them as
        # streams) sees everything.
        claimed = store.claim(10, T0, 0)
        assert not [name for name in listed if name.startswith("p0-")]
        assert {e.qid for e in claimed} >= set(acc.qids) and len(claimed) == 5
    finally:
        store.close()


def test_a_refill_reads_incoming_as_a_stream_with_the_batch_s_own_changes(
        tmp_path: Path) -> None:
    # A refill held every incoming control file's parsed name at once: 684 MB
    # in `serve` with a million queued.  It keeps the ``limit`` first instead,
    # and still sees what earlier operations of its own batch did.
    store = open_fs(tmp_path)
    try:
        old = [store.submit(Submission("a@example.org", (f"r{i}@d{i}.example",)), b"x",
                            T0).qids[0] for i in range(4)]
        gate, holding = threading.Event(), threading.Event()

        def hold(view: object) -> None:
            holding.set()
            gate.wait(10)

        store._committer.submit(hold)
        assert holding.wait(10)
        # Queued behind the gate, one batch: a submission, then a refill.
        new = store.submit_future(Submission("b@example.org", ("n@new.example",)), b"y", T0)
        claimed: list[str] = []
        op = threading.Thread(target=lambda: claimed.extend(
            e.qid for e in store.claim(10, T0, 0)))
        op.start()
        deadline = time.monotonic() + 10
        while store._committer._ops.qsize() < 2 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert store._committer._ops.qsize() == 2
        gate.set()
        acc = new.result(timeout=10)
        op.join(10)
        assert claimed == [*old, acc.qids[0]]  # the batch's own file is a candidate
        store.apply([Transition(q, QueueState.INCOMING) for q in claimed[:2]])
        assert [e.qid for e in store.claim(1, T0, 0)] == [old[0]]  # the smallest first
    finally:
        store.close()

