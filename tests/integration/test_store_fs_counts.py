"""The fs flavour's totals and its check after a restart.

qcount read every name in the tree (26 s with a million queued), and
recover() reconciled every content link with every control file under
the queue's lock (10.9 s in which no receiver could commit).  The
committer now keeps the totals in ``counts``, and the reconciliation is a
check that lists the tree while the queue works.  These tests hold the
totals to what a listing of the tree says, through every kind of batch,
crashes and a check that lists while batches change the tree.
"""

from __future__ import annotations

import functools
import json
import os
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest

from sluice.model import QueueState, Reply, Selector, Submission, format_qid
from sluice.spool import new_spid
from sluice.store import Action, Counts, StorageError, Transition
from sluice.store._fs_check import Listing
from sluice.store._fs_counts import Tally
from sluice.store.fs import FsStore
from tests.conftest import ROOT, subprocess_env
from tests.integration.stores import flavour_config, open_flavour
from tests.integration.test_store_fs import _CRASHER

pytestmark = pytest.mark.integration

T0 = 1_800_000_000.0
S = QueueState
EVERY_STATE = Selector(states=tuple(QueueState))  # counted from the names


def open_fs(tmp: Path) -> FsStore:
    store = open_flavour("fs", tmp)
    assert isinstance(store, FsStore)
    return store


def listed(store: FsStore) -> Counts:
    """The totals by reading the tree."""
    return store.count(EVERY_STATE)


def from_file(store: FsStore, monkeypatch: pytest.MonkeyPatch) -> Counts:
    """count() of the whole queue, failing if it lists a directory."""
    import sluice.store._fs_reading as reading

    def no(*_: Any) -> Any:
        raise AssertionError("count() listed the tree")

    with monkeypatch.context() as m:
        m.setattr(reading, "tally_names", no)
        m.setattr(reading, "listdir", no)
        return store.count()


def links_match(store: FsStore) -> None:
    """Every control file has its content link, and nothing else does."""
    want: dict[str, set[int]] = {}
    for path in store.root.rglob("*.mmq"):
        if path.relative_to(store.root).parts[0] == "tmp":
            continue
        spid, rest = path.name.split("-", 1)
        want.setdefault(spid, set()).add(int(rest.split("+")[0]))
    have: dict[str, set[int]] = {}
    for ref in store.spool.root.rglob("*.ref"):
        spid, idx0 = ref.name[:-4].split("-")
        have.setdefault(spid, set()).add(int(idx0))
    assert have == want
    for spid, idx0s in want.items():
        assert os.stat(store.spool.path(spid)).st_nlink == 1 + len(idx0s)


def busy_day(store: FsStore, now: float, k: int = 0) -> None:
    """Some of every kind of batch."""
    accs = [store.submit(Submission("a@example.org", tuple(
        f"r{i}.{j}@d{(i + j) % 3}.example" for j in range(3)), priority=i % 2,
        tenantid=f"t{i % 2}"), b"x", now) for i in range(6)]
    store.submit(Submission("b@example.org", ("later@d.example",), delay_s=60), b"y", now)
    claimed = store.claim(8, now, 0)
    store.apply([Transition(claimed[0].qid, None),  # delivered
                 Transition(claimed[1].qid, S.DEFERRED, next_attempt_at=now + 30,
                            reply=Reply(451, "4.0.0 later"), attempted=True),
                 Transition(claimed[2].qid, S.BOUNCE, reply=Reply(550, "5.0.0 no")),
                 Transition(claimed[3].qid, S.DELIVERING)])
    store.modify(Selector(qids=(accs[4].spid,)), Action.HOLD, now)
    store.modify(Selector(qids=(accs[5].qids[1],)), Action.DELETE, now)
    store.modify(Selector(qids=(accs[4].qids[0],)), Action.RELEASE, now)
    store.modify(Selector(qids=(accs[3].spid,)), Action.PRIORITY, now, priority=1)
    store.claim_bounces(10, now, 60)


def untrust(store: FsStore) -> None:
    """Totals a crash left untrusted (same sequence number, ok false)."""
    store._counts.store(Tally(seq=store._counts.load().seq))


def test_the_committer_keeps_the_totals_so_qcount_lists_nothing(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    store = open_fs(tmp_path)
    try:
        assert from_file(store, monkeypatch) == listed(store)
        busy_day(store, T0)
        counts = from_file(store, monkeypatch)
        assert counts == listed(store)
        assert counts.messages == 7 and counts.recipients == 17
        assert counts[S.HOLD] == 2 and counts[S.BOUNCE] == 1 and counts[S.DELIVERING] == 1
        # Every message's recipients gone: so is the message.
        spids = {e.spid for e in store.entries(Selector())}
        store.modify(Selector(qids=tuple(sorted(spids)[:2])), Action.DELETE, T0)
        assert from_file(store, monkeypatch) == listed(store)
        assert from_file(store, monkeypatch).messages == 5
        assert store.recover(T0 + 5) > 0
        assert store.wait_check(30)
        busy_day(store, T0 + 10)
        assert from_file(store, monkeypatch) == listed(store)
    finally:
        store.close()
    # Another process (here: another store on the same tree) sees them too.
    store = open_fs(tmp_path)
    try:
        assert from_file(store, monkeypatch) == listed(store)
    finally:
        store.close()


def test_a_batch_cut_short_leaves_the_totals_untrusted_until_the_check(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    cfg = flavour_config("fs", tmp_path)
    path = tmp_path / "sluice.yaml"
    path.write_text(json.dumps(cfg.to_dict(readable=True)))
    store = open_fs(tmp_path)
    busy_day(store, T0)
    store.close()
    proc = subprocess.run([sys.executable, "-c", _CRASHER, str(path)], cwd=ROOT,
                          env=subprocess_env(), capture_output=True, text=True, timeout=60)
    assert proc.returncode == 9, proc.stderr
    assert json.loads((tmp_path / "queue" / "counts").read_bytes())["ok"] is False
    store = open_fs(tmp_path)  # the journal is replayed
    try:
        # Not trusted: counted from the names, and right.
        assert store._counts.trusted() is None
        assert store.count() == listed(store)
        assert listed(store).messages == 8
        store.recover(time.time())
        assert store.wait_check(30)
        assert from_file(store, monkeypatch) == listed(store)
        links_match(store)
    finally:
        store.close()


def test_totals_of_another_boot_are_not_trusted(tmp_path: Path,
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    # counts is not synced: after a crash of the machine it may be stale.
    store = open_fs(tmp_path)
    try:
        busy_day(store, T0)
        good = from_file(store, monkeypatch)
        raw = json.loads((store.root / "counts").read_bytes())
        raw["boot"] = "another boot"
        (store.root / "counts").write_text(json.dumps(raw))
        assert store._counts.trusted() is None
        assert store.count() == good  # from the names
        store.recover(T0)
        assert store.wait_check(30)
        assert from_file(store, monkeypatch) == listed(store)
        assert from_file(store, monkeypatch).recipients == good.recipients
    finally:
        store.close()


def test_the_check_lists_the_tree_while_batches_change_it(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import sluice.store._fs_check as fs_check

    store = open_fs(tmp_path)
    try:
        busy_day(store, T0)
        # A crash's leftovers: a link without its control file, a control
        # file without its link, content nothing links to, stale totals.
        acc = store.submit(Submission("c@example.org", ("o@d.example",)), b"z", T0)
        os.link(store.spool.path(acc.spid), store.spool.directory(acc.spid) / f"{acc.spid}-7.ref")
        kept = next(e for e in store.entries(Selector(states=(S.DEFERRED,))))
        os.unlink(store.spool.directory(kept.spid) / f"{kept.spid}-{kept.idx}.ref")
        orphan = store.spool.write(b"orphan")
        os.utime(store.spool.path(orphan.spid), (time.time() - 7200, time.time() - 7200))
        untrust(store)
        # Between the directories it lists, batches of every kind change the tree.
        real_state_of = fs_check.state_of
        listed_dirs: list[str] = []

        def state_of(rel_dir: str) -> QueueState:
            listed_dirs.append(rel_dir)
            if len(listed_dirs) in (2, 5):
                busy_day(store, T0 + len(listed_dirs))
            return real_state_of(rel_dir)

        monkeypatch.setattr(fs_check, "state_of", state_of)
        store.recover(T0 + 1)
        assert store.wait_check(30)
        monkeypatch.setattr(fs_check, "state_of", real_state_of)
        assert len(listed_dirs) > 5
        assert from_file(store, monkeypatch) == listed(store)
        assert not store.spool.path(orphan.spid).exists()
        links_match(store)
    finally:
        store.close()


def test_recover_returns_before_the_check_and_mail_commits_while_it_lists(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # recover() reconciled every content link under the queue's lock: with
    # a million queued, no receiver could commit (answer 250) for 10.9 s.
    import sluice.store._fs_check as fs_check

    store = open_fs(tmp_path)
    try:
        busy_day(store, T0)
        gate, listing = threading.Event(), threading.Event()
        real_state_of = fs_check.state_of

        def state_of(rel_dir: str) -> QueueState:
            listing.set()
            assert gate.wait(30)
            return real_state_of(rel_dir)

        monkeypatch.setattr(fs_check, "state_of", state_of)
        store.recover(T0 + 1)
        assert listing.wait(30)
        acc = store.submit(Submission("n@example.org", ("n@new.example",)), b"n", T0 + 2)
        assert acc.qids[0] in {e.qid for e in store.claim(100, T0 + 2, 0)}
        assert not store.wait_check(0.01)  # still listing
        gate.set()
        assert store.wait_check(30)
        assert from_file(store, monkeypatch) == listed(store)
        links_match(store)
    finally:
        gate.set()
        store.close()


def test_a_batch_of_another_process_during_the_check_makes_it_list_again(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import sluice.store._fs_check as fs_check

    store = open_fs(tmp_path)
    other = open_fs(tmp_path)  # its own lock: another process as far as flock goes
    try:
        busy_day(store, T0)
        untrust(store)
        starts: list[int] = []
        real_start = FsStore._watch_start

        def watch_start(self: FsStore, view: Any) -> Any:
            starts.append(1)
            return real_start(self, view)

        real_state_of = fs_check.state_of
        done: list[int] = []

        def state_of(rel_dir: str) -> QueueState:
            if not done:
                done.append(1)
                other.submit(Submission("o@example.org", ("o@d.example",)), b"o", T0)
            return real_state_of(rel_dir)

        monkeypatch.setattr(FsStore, "_watch_start", watch_start)
        monkeypatch.setattr(fs_check, "state_of", state_of)
        store.recover(T0 + 1)
        assert store.wait_check(30)
        assert len(starts) == 2
        assert from_file(store, monkeypatch) == listed(store)
    finally:
        other.close()
        store.close()


def test_count_waits_for_this_process_s_check_rather_than_listing_the_tree(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # After a restart serve's duties ask for the totals at once: a listing
    # of its own (4 s for a million) beside the check's would count twice.
    import sluice.store._fs_check as fs_check

    store = open_fs(tmp_path)
    try:
        busy_day(store, T0)
        untrust(store)
        gate = threading.Event()
        real_state_of = fs_check.state_of
        monkeypatch.setattr(fs_check, "state_of",
                            lambda rel_dir: (gate.wait(30), real_state_of(rel_dir))[1])
        store.recover(T0 + 1)
        got: list[Counts] = []
        counter = threading.Thread(target=lambda: got.append(from_file(store, monkeypatch)))
        counter.start()
        counter.join(0.2)
        assert counter.is_alive()  # waiting for the check
        gate.set()
        counter.join(30)
        assert got == [listed(store)]
    finally:
        gate.set()
        store.close()


def stale_totals_of_another_boot(store: FsStore) -> None:
    """``counts`` as a power cut may leave it: ok, of another boot, and wrong."""
    raw = json.loads((store.root / "counts").read_bytes())
    raw.update(boot="another boot", messages=raw["messages"] + 5)
    raw[str(S.INCOMING)] += 9
    (store.root / "counts").write_text(json.dumps(raw))


def test_a_batch_after_a_reboot_does_not_make_stale_totals_trusted(
        tmp_path: Path) -> None:
    # store() stamped this boot on whatever it wrote: the first batch after
    # a reboot turned the stale totals (not counted by it) into trusted ones.
    store = open_fs(tmp_path)
    try:
        busy_day(store, T0)
        stale_totals_of_another_boot(store)
        store.submit(Submission("n@example.org", ("n@d.example",)), b"n", T0)
        assert store._counts.trusted() is None
        assert store.count() == listed(store)
    finally:
        store.close()


def test_a_journal_replayed_after_a_reboot_does_not_make_stale_totals_trusted(
        tmp_path: Path) -> None:
    store = open_fs(tmp_path)
    try:
        busy_day(store, T0)
        stale_totals_of_another_boot(store)
        (store.root / "journal" / "1.0.jnl").write_text("END\n")  # a batch's, done
        store._call(lambda view: None)  # the next writer replays it
        assert not (store.root / "journal" / "1.0.jnl").exists()
        assert store._counts.trusted() is None
        assert store.count() == listed(store)
    finally:
        store.close()


@contextmanager
def one_batch(store: FsStore) -> Iterator[None]:
    """What the block queues without waiting is committed as one batch."""
    entered, gate = threading.Event(), threading.Event()
    held = store._op(lambda view: (entered.set(), gate.wait(30)))
    assert entered.wait(30)  # the committer is in the batch before
    try:
        yield
    finally:
        gate.set()
        held.result(30)


def test_a_message_submitted_and_removed_in_one_batch_is_no_message(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # The batch counted the submission (+1) but, no control file of it ever
    # reaching the disk, never a message gone: the totals said one message
    # too many, and its content stayed in the spool with nothing linking it.
    store = open_fs(tmp_path)
    try:
        busy_day(store, T0)
        spid = new_spid()
        with one_batch(store):
            sub = store.submit_future(Submission("g@example.org", ("g@d.example",), spid=spid),
                                      b"gone at once", T0)
            gone = store.apply_future([Transition(format_qid(spid, 0), None)])
            kept = store.submit_future(Submission("k@example.org", ("k@d.example",)), b"k", T0)
        assert sub.result(30).spid == spid and kept.result(30)
        assert gone.result(30) == {format_qid(spid, 0)}
        assert from_file(store, monkeypatch) == listed(store)
        store.spool.close()  # its deletions done
        assert not store.spool.path(spid).exists()
    finally:
        store.close()


def test_a_batch_that_fails_before_its_commit_point_leaves_no_link_behind(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # A batch links the content of the control files it creates before it
    # syncs; one that failed there (an I/O error) kept those links and the
    # totals trusted.  The extra link then kept the content alive when the
    # message's last control file went: one message too many, for good.
    store = open_fs(tmp_path)
    try:
        acc = store.submit(Submission("s@example.org", ("a@d.example", "b@d.example")), b"s", T0)
        before = from_file(store, monkeypatch)
        with one_batch(store):
            # Split the message's one control file (a new file, a new link) ...
            split = store.apply_future([Transition(acc.qids[1], S.DEFERRED,
                                                   next_attempt_at=T0 + 60)])
            # ... in a batch whose sync fails: a submitter's temporary file is gone.
            sub = store.submit_future(Submission("f@example.org", ("f@d.example",)), b"f", T0)
            for tmp in (store.root / "tmp").iterdir():
                tmp.unlink()
        for fut in (split, sub):
            with pytest.raises(StorageError):
                fut.result(30)
        links_match(store)
        assert store.count() == listed(store) == before
        store.modify(Selector(qids=(acc.spid,)), Action.DELETE, T0)
        assert store.count() == listed(store)
        store.spool.close()
        assert not store.spool.path(acc.spid).exists()
    finally:
        store.close()


_CLAIMER = """
import os, sys, time
from sluice.config import load_config
from sluice.store import open_store
import sluice.store.fs as fs
real_rename = os.rename
def die_after_a_rename(src, dst):
    real_rename(src, dst)
    os._exit(9)  # killed while the claim's files go into place
fs.os.rename = die_after_a_rename
store = open_store(load_config(sys.argv[1]))
store.claim(100, time.time(), 0)
"""


def test_a_process_killed_mid_batch_while_another_checks_makes_it_list_again(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # A batch raised the sequence number only once in place: killed midway
    # (a claim is renames and no journal, so nothing replays it) it left
    # the number as it was, and a check listing meanwhile in another
    # process stored its listing, a file short, as trusted totals.
    import sluice.store._fs_check as fs_check

    cfg = flavour_config("fs", tmp_path)
    path = tmp_path / "sluice.yaml"
    path.write_text(json.dumps(cfg.to_dict(readable=True)))
    store = open_fs(tmp_path)
    try:
        busy_day(store, T0)
        real_state_of = fs_check.state_of
        killed: list[int] = []

        def state_of(rel_dir: str) -> QueueState:
            # active/ is listed; the other process claims from incoming/ into it.
            if rel_dir.startswith("incoming/") and not killed:
                proc = subprocess.run([sys.executable, "-c", _CLAIMER, str(path)], cwd=ROOT,
                                      env=subprocess_env(), capture_output=True, text=True,
                                      timeout=60)
                killed.append(proc.returncode)
            return real_state_of(rel_dir)

        monkeypatch.setattr(fs_check, "state_of", state_of)
        store.recover(T0 + 1)
        assert store.wait_check(60)
        monkeypatch.setattr(fs_check, "state_of", real_state_of)
        assert killed == [9]
        assert store.count() == listed(store)
    finally:
        store.close()


def test_a_failed_batch_the_check_s_start_shared_does_not_end_the_check(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # The check's first step is an operation of the committer, and a batch
    # fails as a whole (here: another operation's sync).  The check gave up
    # until the next start and left its Watch installed, so every later
    # batch of the process went on recording into it.
    store = open_fs(tmp_path)
    try:
        busy_day(store, T0)
        untrust(store)
        queued = threading.Semaphore(0)
        real_op = store._op

        def op(*args: Any, **kwargs: Any) -> Any:
            fut = real_op(*args, **kwargs)
            queued.release()
            return fut

        with one_batch(store):
            monkeypatch.setattr(store, "_op", op)
            sub = store.submit_future(Submission("f@example.org", ("f@d.example",)), b"f", T0)
            for tmp in (store.root / "tmp").iterdir():
                tmp.unlink()  # the batch's sync fails
            assert queued.acquire(timeout=30)
            store.start_check()
            assert queued.acquire(timeout=30)  # its first step is in the same batch
        assert store.wait_check(30)
        with pytest.raises(StorageError):
            sub.result(30)
        assert store._watch is None
        assert from_file(store, monkeypatch) == listed(store)
    finally:
        store.close()


def test_a_journal_whose_sync_failed_is_not_replayed_after_the_batch_failed(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # A batch whose journal failed to sync removed its temporary files and
    # reported failure, but left the journal, END and all: the next writer
    # replayed it, skipping the creations (no temporary file) and doing
    # the removals.  The recipients of a split file were gone.
    import sluice.store._fs_commit as fs_commit

    store = open_fs(tmp_path)
    try:
        acc = store.submit(Submission("s@example.org", ("a@d.example", "b@d.example")), b"s", T0)
        real_fsync = fs_commit.fsync_paths

        def fsync_paths(paths: Any, *args: Any, **kwargs: Any) -> None:
            if any(str(p).endswith(".jnl") for p in paths):
                raise OSError(5, "Input/output error")
            real_fsync(paths, *args, **kwargs)

        monkeypatch.setattr(fs_commit, "fsync_paths", fsync_paths)
        with pytest.raises(StorageError):  # a split: two files for one, journalled
            store.apply([Transition(acc.qids[1], S.DEFERRED, next_attempt_at=T0 + 60)])
        monkeypatch.setattr(fs_commit, "fsync_paths", real_fsync)
        store._call(lambda view: None)  # the next writer replays what journal there is
        assert [e.qid for e in store.entries(Selector())] == list(acc.qids)
        assert [e.state for e in store.entries(Selector())] == [S.INCOMING] * 2
        assert store.count() == listed(store)
        links_match(store)
    finally:
        store.close()


def test_totals_that_cannot_be_stored_after_a_batch_are_logged(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    # Once a batch is in place a failed write of its totals only leaves them
    # untrusted, but it vanished: qcount listed the tree from then on, and
    # nothing said why.
    store = open_fs(tmp_path)
    try:
        counts = store.root / "counts"

        def break_counts() -> None:  # after the renames, before the totals
            counts.unlink()
            counts.mkdir()

        with one_batch(store):
            sub = store.submit_future(Submission("n@example.org", ("n@d.example",)), b"n", T0)
            hook = store._op(lambda view: view.after.append(break_counts))
        assert sub.result(30) and hook.result(30) is None
        assert any(r.levelname == "WARNING" and str(counts) in r.getMessage()
                   for r in caplog.records)
        counts.rmdir()
        assert store.count() == listed(store)
    finally:
        store.close()


def test_the_check_settles_what_needs_fixing_before_the_committer_s_step() -> None:
    # Sums of 1 << first index per message: control files, links, content.
    found = Listing()
    found.controls.update({"A": 0b11, "B": 0b01, "C": 0b01, "D": 0b10})
    found.links.update({"A": 0b11, "B": 0b11, "C": 0b00, "E": 0b01})
    found.content.update({"A", "B", "C", "D", "F"})
    found.settle()
    # A is right; B has a link too many; C and D lack links (D's content
    # is there too); E is a link without a file; F content without either.
    assert found.suspects == {"B", "C", "D", "E", "F"}
    assert found.messages == 4


def test_the_committer_s_step_fixes_messages_a_batch_changed_while_the_check_listed(
        tmp_path: Path) -> None:
    store = open_flavour("fs", tmp_path)
    try:
        assert isinstance(store, FsStore)
        kept = store.submit(Submission("s@example.org", ("a@example.net",)), b"x", T0)
        found = store._list_tree(store._call(store._watch_start))
        assert found is not None
        found.settle()
        assert not found.suspects and found.messages == 1
        # While the listing waits for the committer: one message goes, two come.
        store.apply([Transition(format_qid(kept.spid, 0), None)])
        new = [store.submit(Submission("s@example.org", (f"{u}@example.net",)), b"y", T0 + 1)
               for u in ("b", "c")]
        assert store._call(functools.partial(store._watch_end, store._watch, found))
        # The totals the check stored (no batch came after it).
        tally = store._counts.trusted()
        assert tally is not None and tally.messages == 2
        assert tally.by_state == {**dict.fromkeys(QueueState, 0), QueueState.INCOMING: 2}
        assert [e.spid for e in store.entries(Selector())] == [m.spid for m in new]
    finally:
        store.close()
