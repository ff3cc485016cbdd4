"""The kv flavour's own promises: ZoneMTA's keys in LevelDB, every key gone
after the last recipient, one process only, leftovers swept, a full disk.

The shared contract (tests/integration/test_store_contract.py) runs against
this flavour too; these tests open the LevelDB directory itself.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import plyvel
import pytest

from sluice.model import QueueEntry, QueueState, Reply, Selector, Submission
from sluice.store import Action, StorageError, Transition
from sluice.store.kv import CHUNK_SIZE, KvStore
from tests.conftest import ROOT, subprocess_env
from tests.integration.serving import wait_until
from tests.integration.stores import flavour_config, open_flavour, run_diskfull

pytestmark = pytest.mark.integration

T0 = 1_800_000_000.0
S = QueueState


def open_kv(tmp: Path) -> KvStore:
    store = open_flavour("kv", tmp)
    assert isinstance(store, KvStore)
    return store


def keys(tmp: Path) -> dict[bytes, bytes]:
    db = plyvel.DB(str(tmp / "queue"))
    try:
        return dict(db.iterator())
    finally:
        db.close()


def test_zonemta_keys_for_content_message_and_recipients(tmp_path: Path) -> None:
    store = open_kv(tmp_path)
    body = bytes(range(256)) * 600  # 153,600 bytes: three chunks
    try:
        acc = store.submit(Submission("alice@example.org", ("b@one.example", "c@two.example"),
                                      transportid="bulk"), body, T0)
        plain = store.submit(Submission("alice@example.org", ("d@one.example",)), b"hi", T0 + 1)
    finally:
        store.close()
    kv = keys(tmp_path)
    spid = acc.spid
    chunks = [kv[f"message {spid} {n:06d}".encode()] for n in (1, 2, 3)]
    assert [len(c) for c in chunks] == [CHUNK_SIZE, CHUNK_SIZE, len(body) - 2 * CHUNK_SIZE]
    assert b"".join(chunks) == body
    assert f"message {spid} 000004".encode() not in kv
    assert float(kv[f"message {spid} #".encode()]) == T0
    meta = json.loads(kv[f"message {spid} *".encode()])
    assert meta["sender"] == "alice@example.org" and meta["rcpts"] == ["b@one.example",
                                                                       "c@two.example"]
    assert meta["size"] == len(body) and meta["chunks"] == 3
    # One delivery-zone key per recipient; the zone is the transport.
    rec = json.loads(kv[f"delivery-zone bulk {spid} b@one.example".encode()])
    assert (rec["i"], rec["s"]) == (0, "incoming")
    assert f"delivery-zone bulk {spid} c@two.example".encode() in kv
    assert f"delivery-zone default {plain.spid} d@one.example".encode() in kv
    # Iterating a zone walks its recipients from the oldest message on.
    zone = [k for k in kv if k.startswith(b"delivery-zone bulk ")]
    assert zone == sorted(zone) and len(zone) == 2
    # The extra keys that index the states.
    assert kv[f"sluice queue incoming 1 {spid} 000000".encode()] == \
        f"delivery-zone bulk {spid} b@one.example".encode()
    assert kv[b"sluice stat incoming"] == b"3" and kv[b"sluice stat messages"] == b"2"


def test_selection_by_transport_iterates_the_zone(tmp_path: Path) -> None:
    store = open_kv(tmp_path)
    try:
        a = store.submit(Submission("s@example.org", ("x@d.example",), transportid="bulk"),
                         b"1", T0)
        store.submit(Submission("s@example.org", ("y@d.example",)), b"2", T0)
        c = store.submit(Submission("s@example.org", ("z@d.example", "z@d.example"),
                                    transportid="bulk"), b"3", T0)
        assert [e.qid for e in store.entries(Selector(transportid="bulk"))] == [
            a.qids[0], *c.qids]
        # A repeated address in one envelope still gets a key of its own.
        assert {e.idx for e in store.entries(Selector(qids=(c.spid,)))} == {0, 1}
    finally:
        store.close()


def test_every_key_of_a_message_goes_after_its_last_recipient(tmp_path: Path) -> None:
    store = open_kv(tmp_path)
    try:
        acc = store.submit(Submission("a@example.org", ("x@one.example", "y@two.example")),
                           b"x" * 200_000, T0)
        e0, e1 = store.claim(10, T0, 10)
        store.apply([Transition(e0.qid, None, reply=Reply(250, "2.0.0", "ok"))])
        store.apply([Transition(e1.qid, S.DEFERRED, next_attempt_at=T0 + 60, attempted=True)])
        store.modify(Selector(qids=(acc.spid,)), Action.HOLD, T0 + 1)
        store.modify(Selector(qids=(acc.spid,)), Action.DELETE, T0 + 2)
    finally:
        store.close()
    left = [k for k in keys(tmp_path) if acc.spid.encode() in k
            and not k.startswith(b"sluice change ")]
    assert left == []
    assert keys(tmp_path)[b"sluice stat messages"] == b"0"


def test_metadata_written_before_the_smtputf8_flag_still_loads(tmp_path: Path) -> None:
    store = open_kv(tmp_path)
    try:
        flagged = store.submit(Submission("a@example.org", ("x@d.example",), smtputf8=True),
                               b"one", T0)
        old = store.submit(Submission("a@example.org", ("y@e.example",)), b"two", T0)
    finally:
        store.close()
    db = plyvel.DB(str(tmp_path / "queue"))
    try:
        assert json.loads(db.get(f"message {flagged.spid} *".encode()))["smtputf8"] is True
        key = f"message {old.spid} *".encode()
        meta = json.loads(db.get(key))
        del meta["smtputf8"]  # as an older Sluice wrote it
        db.put(key, json.dumps(meta).encode(), sync=True)
    finally:
        db.close()
    store = open_kv(tmp_path)
    try:
        got = {e.spid: e.smtputf8 for e in store.entries(Selector())}
        assert got == {flagged.spid: True, old.spid: False}
        assert {e.spid: e.smtputf8 for e in store.claim(5, T0, 10)} == got
    finally:
        store.close()


def test_a_second_process_is_refused_with_a_clear_error(tmp_path: Path) -> None:
    store = open_kv(tmp_path)
    try:
        cfg = flavour_config("kv", tmp_path)
        path = tmp_path / "sluice.yaml"
        path.write_text(json.dumps(cfg.to_dict(readable=True)))
        proc = subprocess.run(
            [sys.executable, "-c",
             "import sys\nfrom sluice.config import load_config\n"
             "from sluice.store import StorageError, open_store\n"
             "try:\n    open_store(load_config(sys.argv[1]))\n"
             "except StorageError as exc:\n    print(exc)\n    sys.exit(3)\n",
             str(path)], cwd=ROOT, env=subprocess_env(), capture_output=True, text=True,
            timeout=60)
        assert proc.returncode == 3, proc.stderr
        assert "open in another process" in proc.stdout
        assert store.shared_access is False
    finally:
        store.close()


def test_content_of_a_submission_that_never_committed_is_swept(tmp_path: Path) -> None:
    store = open_kv(tmp_path)
    store.close()
    db = plyvel.DB(str(tmp_path / "queue"))
    db.put(b"sluice pending 1A2016772261AA74", b"")  # as a crash mid-stream leaves it
    db.put(b"message 1A2016772261AA74 000001", b"half a message")
    db.close()
    store = open_kv(tmp_path)
    try:
        assert store.count().messages == 0
        store.recover(T0)
    finally:
        store.close()
    assert [k for k in keys(tmp_path) if b"1A2016772261AA74" in k] == []


def test_a_failing_content_source_leaves_no_chunks(tmp_path: Path) -> None:
    store = open_kv(tmp_path)

    def broken():  # type: ignore[no-untyped-def]
        yield b"x" * (CHUNK_SIZE * 2 + 10)
        raise ConnectionResetError("client went away")

    try:
        with pytest.raises(ConnectionResetError):
            store.submit(Submission("a@example.org", ("b@example.net",)), broken(), T0)
    finally:
        store.close()
    assert [k for k in keys(tmp_path) if k.startswith((b"message ", b"sluice pending"))] == []


def test_reading_a_missing_message_is_a_storage_error(tmp_path: Path) -> None:
    store = open_kv(tmp_path)
    try:
        with pytest.raises(StorageError):
            store.open_content("1A2016772261AA74")
    finally:
        store.close()


def test_a_full_disk_is_a_temporary_failure_and_passes() -> None:
    # LevelDB needs room to replay its log when it is reopened after the
    # error, so the operator frees more here than for the other flavours.
    found = run_diskfull("kv", size="12m", ballast_mb=8)
    assert found["other_error"] is None
    assert found["error"] and "No space left" in found["error"]
    assert found["accepted"] > 0 and found["second_ok"] is False
    assert found["all_listed"] and found["all_intact"] and found["count"] == found["accepted"]
    assert found["after_ok"], found.get("after_error")
    assert found["count_after"] == found["accepted"] - 3 + 1


def test_an_outcome_does_not_wait_for_the_content_of_new_mail_in_its_batch(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # Outcomes committed with new mail waited for its log sync first; every
    # moment an outcome is not durable is one in which a crash sends its
    # message twice (bench/harsh_kill.py --store kv counted them as "late").
    import threading

    store = open_kv(tmp_path)
    try:
        store.submit(Submission("a@example.org", ("b@example.net",)), b"first", T0)
        (entry,) = store.claim(10, T0, 10)
        gate = threading.Event()
        busy = store._op(lambda view: gate.wait(10))  # holds the committer
        new_mail = store.submit_future(Submission("c@example.org", ("d@example.net",)),
                                       b"second", T0)
        outcome = store.apply_future([Transition(entry.qid, None)])
        at_sync: list[bool] = []
        sync = store._sync_logs

        def spy() -> None:
            at_sync.append(outcome.done())
            sync()

        monkeypatch.setattr(store, "_sync_logs", spy)
        gate.set()
        busy.result(10)
        assert outcome.result(10) == {entry.qid}
        assert new_mail.result(10).spid
        # The outcome's own sync (and the busy batch's) come first; the
        # content's and the new mail's meta's, after the outcome was done.
        assert at_sync[-2:] == [True, True] and at_sync.count(False) <= 2
        assert store.count().messages == 1
    finally:
        store.close()


class SyncSpy:
    """LevelDB with its synchronous writes counted, and the store's log syncs."""

    def __init__(self, store: KvStore, monkeypatch: pytest.MonkeyPatch) -> None:
        self.syncs: list[str] = []
        self.fail: OSError | None = None
        self._db = store._db
        monkeypatch.setattr(store, "_db", self)
        sync_logs = store._sync_logs

        def spy() -> None:
            self.syncs.append("logs")
            if self.fail is not None:
                failure, self.fail = self.fail, None
                raise failure
            sync_logs()

        monkeypatch.setattr(store, "_sync_logs", spy)

    def write_batch(self, **kw: object) -> object:
        if kw.get("sync"):
            self.syncs.append("write")
        return self._db.write_batch(**kw)

    def __getattr__(self, name: str) -> object:
        return getattr(self._db, name)


def _claimed_one(tmp_path: Path, monkeypatch: pytest.MonkeyPatch
                 ) -> tuple[KvStore, SyncSpy, QueueEntry]:
    """A kv store with one message claimed, its syncs watched from then on."""
    store = open_kv(tmp_path)
    store.submit(Submission("a@example.org", ("b@example.net",)), b"x", T0)
    spy = SyncSpy(store, monkeypatch)
    (entry,) = store.claim(10, T0, 10)
    return store, spy, entry


def test_claims_and_marks_are_not_synced_outcomes_are(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # Three synchronous writes a delivery (claim, "delivering" mark,
    # outcome) kept kv's committer in fsync far more than SQLite's, which
    # syncs only the outcome; an outcome that arrived meanwhile waited.
    store, spy, entry = _claimed_one(tmp_path, monkeypatch)
    try:
        marked = store.apply_future(
            [Transition(entry.qid, S.DELIVERING, expect=(S.ACTIVE,))], durable=False)
        assert marked.result(10) == {entry.qid}
        assert spy.syncs == []
        assert store.apply([Transition(entry.qid, None, reply=Reply(250, "2.0.0", "ok"))]) \
            == {entry.qid}
        assert spy.syncs == ["logs"]  # every log file: the claim may sit in an older one
    finally:
        store.close()
    assert [k for k in keys(tmp_path) if k.startswith(b"delivery-zone ")] == []


def test_a_change_to_flush_soon_is_answered_first_and_synced_in_its_batch(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # queue.success_sync "write": a success is answered at its write, but
    # the log is synced in the same batch, not whenever an outcome that
    # needs it comes along (which, when mail stops, could be never).
    store, spy, entry = _claimed_one(tmp_path, monkeypatch)
    try:
        gone = store.apply_future([Transition(entry.qid, None, reply=Reply(250, "2.0.0", "ok"))],
                                  durable=False, flush_soon=True)
        assert gone.result(10) == {entry.qid}
        assert wait_until(lambda: spy.syncs == ["logs"], 10)
    finally:
        store.close()


def test_an_outcome_whose_log_sync_failed_is_not_reported_recorded(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # A recorded success must be on disk: if the sync fails, the recorder
    # hears of an error (and tries again), and the database is reopened,
    # replaying its log, before the next write.
    store = open_kv(tmp_path)
    try:
        store.submit(Submission("a@example.org", ("b@example.net",)), b"x", T0)
        (entry,) = store.claim(10, T0, 10)
        spy = SyncSpy(store, monkeypatch)
        spy.fail = OSError(5, "Input/output error")
        done = Transition(entry.qid, None, reply=Reply(250, "2.0.0", "ok"))
        with pytest.raises(StorageError, match="syncing"):
            store.apply([done])
        monkeypatch.undo()
        assert store._broken
        store.apply([done])  # reopened first; the entry may be gone already
        assert store.count().messages == 0
    finally:
        store.close()


def test_the_deferred_are_indexed_by_arrival_and_an_older_queue_gets_the_index(
        tmp_path: Path) -> None:
    """oldest() and expiry read the aged keys; a queue without them is scanned, then indexed."""
    store = open_kv(tmp_path)
    try:
        for age in (500, 3000, 100, 2000):  # deferred, due in the reverse order of arrival
            store.submit(Submission("a@x.org", (f"r{age}@y.org", f"s{age}@y.org"),
                                    delay_s=10_000 - age), b"x\r\n", T0 - age)
        store.submit(Submission("a@x.org", ("new@y.org",)), b"x\r\n", T0)  # incoming
        want_oldest = store.oldest()
        want_expired = sorted(e.qid for e in store.expired(T0 - 1000, T0 - 1000))
    finally:
        store.close()
    assert want_oldest[S.DEFERRED] == T0 - 3000
    assert len(want_expired) == 4  # the two recipients of each of the two oldest
    aged = {k: v for k, v in keys(tmp_path).items() if k.startswith(b"sluice aged ")}
    assert len(aged) == 8 and sorted(aged)[0].split(b" ")[2:4] == [b"m", b"%017.6f" % (T0 - 3000)]

    # As a version without the index left it: no aged keys, no marker.
    db = plyvel.DB(str(tmp_path / "queue"))
    for key in [*aged, b"sluice layout aged"]:
        db.delete(key)
    db.close()
    store = open_kv(tmp_path)
    try:
        assert store.oldest() == want_oldest  # by the scan
        assert sorted(e.qid for e in store.expired(T0 - 1000, T0 - 1000)) == want_expired
        store.recover(T0)  # serve's start builds the index
        assert store.oldest() == want_oldest
        assert sorted(e.qid for e in store.expired(T0 - 1000, T0 - 1000)) == want_expired
    finally:
        store.close()
    after = keys(tmp_path)
    assert {k for k in after if k.startswith(b"sluice aged ")} == set(aged)
    assert after[b"sluice layout aged"] == b"1"

    # An older version, writing to it afterwards, deferred one entry (no
    # aged key for it) and claimed another (its aged key stays): as many
    # aged keys as deferred ones, and the marker is still there; the
    # recipients differ, and recover() builds the index again.
    db = plyvel.DB(str(tmp_path / "queue"))
    db.delete(sorted(aged)[0])
    db.put(b"sluice aged m %017.6f 0000000000000000 000000" % (T0 - 9000), b"gone")
    db.close()
    store = open_kv(tmp_path)
    try:
        store.recover(T0)
        assert store.oldest() == want_oldest
    finally:
        store.close()
    assert {k for k in keys(tmp_path) if k.startswith(b"sluice aged ")} == set(aged)
