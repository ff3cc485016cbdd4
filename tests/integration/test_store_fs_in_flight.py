"""The fs flavour's marks and outcomes of entries in flight.

The queue manager's marks and outcomes name entries it claimed.  A batch
used to list active/ and delivering/ whole to find their files (up to
``maxmemoryqueue`` names, in every batch: two thirds of the committer's
CPU end to end).  The store now notes where its own batches put each
message's files in those directories and reads those; a file another
process moved is found by listing, as before.

The last tests hold apply() to a model of the states, with two stores on
one tree changing the same messages, several operations in one batch,
and the tree's own rules checked after every step: one file per
recipient, names that say what the file holds, a content link per file.
They found that an outcome could drop recipients still being delivered
(Batch.swap, fixed).
"""

from __future__ import annotations

import json
import os
import random
import threading
from collections import defaultdict
from pathlib import Path

import pytest

import sluice.store._fs_batch as fs_batch
from sluice.model import QueueState, Reply, Selector, Submission
from sluice.store import Action, Transition
from sluice.store._fs_files import parse_name
from sluice.store.fs import FsStore
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
        # The other one marks one of the two, which splits their file: the
        # path we noted holds neither now.
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


def test_an_outcome_keeps_the_recipients_still_being_delivered(tmp_path: Path) -> None:
    # {0, 3} marked, then {1}: delivering/ holds X-0+2 {0, 3} and X-1+1 {1}.
    # 3 delivered makes a new X-0+2 {0, 1}: the name of the file that goes.
    store = open_fs(tmp_path)
    try:
        store.submit(Submission("a@example.org", tuple(f"r{i}@d.example" for i in range(4))),
                     b"x", T0)
        q = [e.qid for e in sorted(store.claim(4, T0, 0), key=lambda e: e.idx)]
        assert store.apply([Transition(q[0], S.DELIVERING, expect=(S.ACTIVE,)),
                            Transition(q[3], S.DELIVERING, expect=(S.ACTIVE,))], durable=False)
        assert store.apply([Transition(q[1], S.DELIVERING, expect=(S.ACTIVE,))], durable=False)
        assert store.apply([Transition(q[3], None, expect=(S.ACTIVE, S.DELIVERING))]) == {q[3]}
        assert states_of(store) == {q[0]: S.DELIVERING, q[1]: S.DELIVERING, q[2]: S.ACTIVE}
        check_tree(store)
    finally:
        store.close()


def states_of(store: FsStore) -> dict[str, QueueState]:
    return {e.qid: e.state for e in store.entries(Selector())}


def check_tree(store: FsStore) -> None:
    """Each recipient in one file, each name what its file holds, a content link per file."""
    where: dict[tuple[str, int], str] = {}
    firsts: dict[str, set[int]] = defaultdict(set)
    for path in store.root.rglob("*.mmq"):
        rel = str(path.relative_to(store.root))
        if rel.split("/")[0] in ("tmp", "journal"):
            continue
        doc = json.loads(path.read_bytes())
        name = parse_name(path.name)
        idxs = [r[0] for r in doc["rcpts"]]
        assert name is not None and (name.idx0, name.n) == (idxs[0], len(idxs)), rel
        for idx in idxs:
            assert (doc["spid"], idx) not in where, (rel, where.get((doc["spid"], idx)))
            where[(doc["spid"], idx)] = rel
        firsts[doc["spid"]].add(idxs[0])
    for spid, idx0s in firsts.items():
        names = os.listdir(store.spool.directory(spid))
        links = {int(n[len(spid) + 1:-4]) for n in names
                 if n.startswith(spid + "-") and n.endswith(".ref")}
        assert links == idx0s, spid


def expected(before: dict[str, QueueState], batches: list[list[Transition]]
             ) -> tuple[dict[str, QueueState], list[set[str]]]:
    """The states after ``batches`` (applied in order) and what each applies."""
    states, applied = dict(before), []
    for transitions in batches:
        got = set()
        for t in transitions:
            if t.qid in states and not (t.expect and states[t.qid] not in t.expect):
                if t.state is None:
                    del states[t.qid]
                else:
                    states[t.qid] = t.state
                got.add(t.qid)
        applied.append(got)
    return states, applied


EXPECTS = [(), (S.ACTIVE,), (S.DELIVERING,), (S.ACTIVE, S.DELIVERING), (S.DEFERRED, S.ACTIVE)]


# Seeds 29 and 32 lost recipients before Batch.swap removed what goes before placing.
@pytest.mark.parametrize("seed", range(40))
def test_two_stores_on_one_tree_apply_what_a_model_says(tmp_path: Path, seed: int) -> None:
    rnd = random.Random(seed)
    ours, theirs = open_fs(tmp_path), open_fs(tmp_path)
    try:
        for step in range(60):
            store = rnd.choice([ours, theirs])
            r = rnd.random()
            if r < 0.2:
                rcpts = tuple(f"r{i}@d{rnd.randint(0, 1)}.example"
                              for i in range(rnd.randint(1, 5)))
                store.submit(Submission("x@example.org", rcpts), b"x", T0)
            elif r < 0.35:
                store.claim(rnd.randint(1, 6), T0 + 10_000, 0)
            elif r < 0.42:
                if queued := sorted(states_of(ours)):
                    action = rnd.choice([Action.HOLD, Action.RELEASE, Action.PRIORITY])
                    theirs.modify(Selector(qids=(rnd.choice(queued),)), action, T0,
                                  priority=1 if action is Action.PRIORITY else None)
            elif before := states_of(ours):
                qids = sorted(before)
                batches = []
                for _ in range(rnd.randint(1, 3)):
                    batch = []
                    for qid in rnd.sample(qids, rnd.randint(1, min(4, len(qids)))):
                        state = rnd.choice([S.DELIVERING, S.ACTIVE, None, S.DEFERRED])
                        batch.append(Transition(
                            qid, state, next_attempt_at=T0 + 60 if state is S.DEFERRED else None,
                            reply=Reply(451, "4.0.0 later") if rnd.random() < 0.3 else None,
                            attempted=rnd.random() < 0.3, expect=rnd.choice(EXPECTS)))
                    batches.append(batch)
                # Hold the committer so that the operations share one batch.
                gate = threading.Event()
                held = store._op(lambda view, gate=gate: gate.wait(5))
                futures = [store.apply_future(batch) for batch in batches]
                gate.set()
                held.result()
                want_states, want_applied = expected(before, batches)
                assert [f.result() for f in futures] == want_applied, step
                assert states_of(ours) == want_states, step
            check_tree(ours)
    finally:
        theirs.close()
        ours.close()
