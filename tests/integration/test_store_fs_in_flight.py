"""The fs flavour finds the files of entries in flight where it put them.

The queue manager's marks and outcomes name entries it claimed.  A batch
used to list active/ and delivering/ whole to find their files (up to
``maxmemoryqueue`` names, in every batch: two thirds of the committer's
CPU end to end).  The store now notes where its own batches put each
message's files in those directories and reads those; a file another
process moved is found by listing, as before.
"""

from __future__ import annotations

from pathlib import Path

import pytest

import sluice.store._fs_batch as fs_batch
from sluice.model import QueueState, Reply, Submission
from sluice.store import Transition
from tests.integration.stores import spy_dirs
from tests.integration.test_store_fs import open_fs

pytestmark = pytest.mark.integration

T0 = 1_800_000_000.0
S = QueueState


def test_marks_and_outcomes_list_no_directory_in_flight(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    store = open_fs(tmp_path)
    try:
        for i in range(30):
            store.submit(Submission("a@example.org", (f"r{i}@d{i % 3}.example",
                                                      f"s{i}@d{i % 3}.example")), b"x", T0)
        claimed = store.claim(40, T0, 0)
        assert len(claimed) == 40
        listed = spy_dirs(monkeypatch, fs_batch, "listdir")
        marks = [Transition(e.qid, S.DELIVERING, expect=(S.ACTIVE,)) for e in claimed]
        assert store.apply(marks, durable=False) == {e.qid for e in claimed}
        outcomes = [Transition(e.qid, None) if k % 2 else
                    Transition(e.qid, S.DEFERRED, next_attempt_at=T0 + 60,
                               reply=Reply(451, "4.0.0 later"), attempted=True)
                    for k, e in enumerate(claimed)]
        assert store.apply(outcomes) == {e.qid for e in claimed}
        assert "active" not in listed and "delivering" not in listed
        counts = store.count()
        assert (counts[S.DEFERRED], counts[S.ACTIVE], counts[S.DELIVERING]) == (20, 0, 0)
        assert counts[S.INCOMING] == 20
    finally:
        store.close()


def test_a_file_another_process_moved_is_found_by_listing(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    ours = open_fs(tmp_path)
    theirs = open_fs(tmp_path)  # another store on the same tree, as another process
    try:
        ours.submit(Submission("a@example.org", ("r@d.example", "s@d.example")), b"x", T0)
        claimed = ours.claim(2, T0, 0)
        assert len(claimed) == 2
        # The other one marks and then splits them: neither path we noted holds them now.
        assert theirs.apply([Transition(claimed[0].qid, S.DELIVERING, expect=(S.ACTIVE,))],
                            durable=False) == {claimed[0].qid}
        listed = spy_dirs(monkeypatch, fs_batch, "listdir")
        got = ours.apply([Transition(e.qid, None, expect=(S.ACTIVE, S.DELIVERING))
                          for e in claimed])
        assert got == {e.qid for e in claimed}
        assert "active" in listed  # the note was wrong: looked for by listing
        assert ours.count().recipients == 0
        assert list((ours.root / "delivering").iterdir()) == []
        assert list((ours.root / "active").iterdir()) == []
    finally:
        theirs.close()
        ours.close()
