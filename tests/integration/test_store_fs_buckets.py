"""The fs flavour's incoming buckets: refills and listings that read the first ones only.

incoming/ was one directory: with a million queued every refill read a
million names, and sharing a refill out by tenant (the default) kept them
all.  It is split by priority, arrival (the SPID's leading digits) and
tenant; these tests look at which buckets a refill or a listing reads,
and at a queue of the flat layout moved into buckets.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from sluice.model import QueueState, Selector, Submission
from tests.integration.stores import spy_dirs
from tests.integration.test_store_fs import T0, open_fs, tree

pytestmark = pytest.mark.integration

S = QueueState


def test_a_refill_lists_the_oldest_incoming_buckets_only(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # incoming/ was one directory: every refill read all of its names, about
    # 10 s with a million queued.  It is split by priority and arrival (the
    # SPID's leading digits), so a refill lists the first buckets only.
    import sluice.store._fs_batch as fs_batch

    store = open_fs(tmp_path)
    try:
        spids = [f"{t:08X}{k:08X}" for t in (0x10, 0x11, 0x12) for k in range(3)]
        for spid in spids:
            store.submit(Submission("a@example.org", ("x@d.example",), spid=spid), b"x", T0)
        urgent = store.submit(Submission("a@example.org", ("u@d.example",), priority=1,
                                         spid="00000013" + "0" * 8), b"u", T0)
        assert sorted(tree(store, buckets=True)) == [
            "incoming/p0-00000010", "incoming/p0-00000011", "incoming/p0-00000012",
            "incoming/p1-00000013"]
        read = spy_dirs(monkeypatch, fs_batch, "scandir")
        # High priority first, then the oldest: two buckets give the four.
        assert [e.spid for e in store.claim(4, T0, 0)] == [urgent.spid, *spids[:3]]
        assert read == ["p1-00000013", "p0-00000010"]
        read.clear()
        assert [e.spid for e in store.claim(4, T0, 0)] == spids[3:7]
        assert read == ["p0-00000011", "p0-00000012"]
        # Emptied buckets of the past are removed.
        assert sorted(tree(store, buckets=True)) == ["active", "incoming/p0-00000012"]
        assert sorted(os.listdir(store.root / "incoming")) == ["p0-00000012"]
    finally:
        store.close()


def test_a_flat_incoming_of_layout_1_is_moved_into_buckets_at_open(tmp_path: Path) -> None:
    # Queues written before the buckets keep every incoming file in
    # incoming/ itself: the first open moves them, and nothing is lost.
    store = open_fs(tmp_path)
    try:
        accs = [store.submit(Submission("a@example.org", (f"r{i}@d{i % 2}.example", "z@z.example"),
                                        priority=i % 2), b"x", T0) for i in range(5)]
        deferred = store.submit(Submission("a@example.org", ("w@d.example",), delay_s=60),
                                b"w", T0)
        before = tree(store)
    finally:
        store.close()
    root = tmp_path / "queue"
    for path in list((root / "incoming").glob("*/*.mmq")):
        path.rename(root / "incoming" / path.name)
    for bucket in list((root / "incoming").iterdir()):
        if bucket.is_dir():
            bucket.rmdir()
    (root / "layout.json").write_text(json.dumps({"layout": 1, "granularity_s": 900.0}))
    store = open_fs(tmp_path)
    try:
        assert json.loads((root / "layout.json").read_text())["layout"] == 2
        assert not list((root / "incoming").glob("*.mmq"))
        assert tree(store) == before
        assert {b.split("/")[1] for b in tree(store, buckets=True) if b.startswith("incoming/")
                } == {f"p{i % 2}-{a.spid[:8]}" for i, a in enumerate(accs)}
        assert store.count().by_state[S.INCOMING] == 10
        claimed = store.claim(20, T0, 0)
        assert {e.qid for e in claimed} == {q for a in accs for q in a.qids}
        assert [e.spid for e in store.entries(Selector(states=(S.DEFERRED,)))] == [
            deferred.spid]
    finally:
        store.close()


def test_a_fair_refill_takes_each_tenant_s_first_buckets_without_reading_a_file(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # Sharing a refill out by tenant needed every incoming file's tenant:
    # the whole of incoming/ listed and a file of each message read.  The
    # tenant is in the bucket's name, so each tenant's first buckets do.
    import sluice.store._fs_batch as fs_batch
    import sluice.store._fs_refill as fs_refill
    import sluice.store.fs as fs

    store = open_fs(tmp_path)
    try:
        subs = [("00000010", "big"), ("00000011", "big"), ("00000012", "big"),
                ("00000013", "a/b"), ("00000014", "")]
        accs = {t: [] for _, t in subs}  # type: dict[str, list[str]]
        for prefix, tenant in subs:
            for k in range(2):
                accs[tenant].append(store.submit(Submission(
                    "a@example.org", ("x@d.example",), tenantid=tenant,
                    spid=f"{prefix}{k:08X}"), b"x", T0).spid)
        assert "incoming/p0-00000013-a%2Fb" in tree(store, buckets=True)
        read = spy_dirs(monkeypatch, fs_batch, "scandir")
        monkeypatch.setattr(fs.Batch, "load", lambda *a: pytest.fail("read a file"))
        monkeypatch.setattr(store, "_tenants", fs.TenantMemo())
        real_pick = fs_refill.fair_pick
        lines: list[dict[str, list[str]]] = []
        monkeypatch.setattr(fs_refill, "fair_pick", lambda by, w, n: (lines.append(by),
                                                                       real_pick(by, w, n))[1])
        monkeypatch.setattr(fs.FsStore, "claim", lambda self, *a: self._call(
            lambda view: self._fair_slots(
                view, view.first_incoming(2, lambda p: (-p.priority, 0, p.spid, p.idx0, p.n),
                                          by_tenant=True), 2, self.tenant_weights)))
        picked = store.claim(2, T0, 0)
        assert sorted(read) == ["p0-00000010-big", "p0-00000013-a%2Fb", "p0-00000014"]
        assert {t: [p.split("/")[2][:16] for p in paths] for t, paths in lines[0].items()} == {
            "big": accs["big"][:2], "a/b": accs["a/b"], "": accs[""]}
        assert len(picked) == 2
    finally:
        store.close()


def test_a_listing_reads_incoming_buckets_as_it_reaches_them(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # entries() (qlist, the console) listed every name in the tree before its
    # first entry: 24 s to qlist's first line with a million queued.  The
    # buckets are in SPID order, so the walk lists them as it gets there.
    import sluice.store._fs_reading as fs_reading

    store = open_fs(tmp_path)
    try:
        spids = [f"{t:08X}{k:08X}" for t in (0x20, 0x21, 0x22) for k in range(2)]
        for i, spid in enumerate(spids):
            store.submit(Submission("a@example.org", ("x@d.example", "y@e.example"), spid=spid,
                                    priority=i % 2, tenantid=f"t{i % 3}"), b"x", T0)
        store.submit(Submission("a@example.org", ("later@d.example",), delay_s=60,
                                spid="00000021" + "F" * 8), b"y", T0)
        listed = spy_dirs(monkeypatch, fs_reading, "listdir")
        monkeypatch.setattr(fs_reading, "LIST_PAGE", 1)  # 200 messages a page
        walk = store.entries(Selector())
        assert next(walk).qid == f"{spids[0]}-0"
        assert not [d for d in listed if d.startswith(("p0-00000021", "p0-00000022",
                                                       "p1-00000021", "p1-00000022"))]
        rest = [e.qid for e in walk]
        assert rest == [f"{spids[0]}-1", *(f"{s}-{i}" for s in spids[1:4] for i in (0, 1)),
                        "00000021FFFFFFFF-0", *(f"{s}-{i}" for s in spids[4:] for i in (0, 1))]
        # A page after a cursor starts at its bucket.
        listed.clear()
        assert [e.qid for e in store.entries(Selector(), after=f"{spids[4]}-0")] == [
            f"{spids[4]}-1", f"{spids[5]}-0", f"{spids[5]}-1"]
        assert not [d for d in listed if "00000020" in d or "00000021" in d]
    finally:
        store.close()
