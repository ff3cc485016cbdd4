"""The idempotency index on real SQLite files, and settled against a real queue."""

from __future__ import annotations

import multiprocessing
from pathlib import Path

import pytest

from sluice.config import Config
from sluice.idempotency import Claim, HitState, IdempotencyIndex
from sluice.model import Submission, format_qid
from sluice.queue import Queue
from sluice.spool import new_spid

pytestmark = pytest.mark.integration


class Clock:
    def __init__(self, at: float = 1_000_000.0) -> None:
        self.at = at

    def __call__(self) -> float:
        return self.at


def test_remember_confirm_lookup_and_expire(tmp_path: Path) -> None:
    clock = Clock()
    index = IdempotencyIndex(tmp_path / "idem.db", window_s=3600, clock=clock)
    assert index.remember("alice", [Claim("k1", "fp1", "AAAAAAAAAAAA0001-0"),
                                    Claim("k2", "fp2", "AAAAAAAAAAAA0001-1")]) == {}
    hits = index.lookup("alice", ["k1", "k2", "k3"])
    assert {k: (h.qid, h.state) for k, h in hits.items()} == {
        "k1": ("AAAAAAAAAAAA0001-0", HitState.PENDING),
        "k2": ("AAAAAAAAAAAA0001-1", HitState.PENDING)}
    # A second claim of a known key changes nothing and says what is known.
    known = index.remember("alice", [Claim("k1", "fp1", "BBBBBBBBBBBB0002-0"),
                                     Claim("k3", "fp3", "BBBBBBBBBBBB0002-1")])
    assert list(known) == ["k1"] and known["k1"].qid == "AAAAAAAAAAAA0001-0"
    index.confirm("alice", {"k1": "AAAAAAAAAAAA0009-0"})  # the store drew another SPID
    index.forget("alice", ["k2"])
    hits = index.lookup("alice", ["k1", "k2", "k3"])
    assert hits["k1"].done and hits["k1"].qid == "AAAAAAAAAAAA0009-0"
    assert "k2" not in hits and not hits["k3"].done
    assert index.lookup("bob", ["k1"]) == {}  # scopes do not meet
    # Past the window a key is forgotten, and may be claimed afresh.
    clock.at += 3601
    assert index.lookup("alice", ["k1"]) == {}
    assert index.remember("alice", [Claim("k1", "fp1", "CCCCCCCCCCCC0003-0")]) == {}
    assert index.expire() == 1  # k3; k1 was just claimed again
    assert len(index) == 1
    index.close()


def _claim(path: str, key: str, qid: str, out: multiprocessing.Queue[bool]) -> None:
    index = IdempotencyIndex(path)
    out.put(not index.remember("s", [Claim(key, "fp", qid)]))
    index.close()


def test_exactly_one_process_wins_a_key(tmp_path: Path) -> None:
    ctx = multiprocessing.get_context("spawn")
    results: multiprocessing.Queue[bool] = ctx.Queue()
    procs = [ctx.Process(target=_claim, args=(str(tmp_path / "idem.db"), "race",
                                              f"{i:016X}-0", results)) for i in range(4)]
    IdempotencyIndex(tmp_path / "idem.db").close()  # the schema exists before the race
    for p in procs:
        p.start()
    for p in procs:
        p.join(60)
    assert sorted(results.get(timeout=5) for _ in procs) == [False, False, False, True]


def test_settle_after_a_crash_confirms_what_the_queue_holds(config: Config,
                                                            tmp_path: Path) -> None:
    index = IdempotencyIndex(tmp_path / "idem.db")
    with Queue.open(config) as queue:
        # Claimed and queued, then the process died before confirming.
        spid = new_spid()
        index.remember("t", [Claim("queued", "bob@x.example news@shop.example",
                                   format_qid(spid, 0))])
        queue.submit(Submission("news@shop.example", ("bob@x.example",), spid=spid),
                     b"Subject: x\r\n\r\nx\r\n")
        # Claimed, and the process died before the submission was durable.
        index.remember("t", [Claim("lost", "ann@x.example news@shop.example",
                                   format_qid(new_spid(), 0))])
        # Claimed for a queue id that another message holds: not ours.
        index.remember("t", [Claim("other", "eve@x.example news@shop.example",
                                   format_qid(spid, 0))])

        def exists(qid: str, fingerprint: str) -> bool:
            entry = queue.store.get(qid)
            return entry is not None and \
                f"{entry.recipient} {entry.sender}".lower() == fingerprint

        assert index.settle(exists) == (1, 2)
    hits = index.lookup("t", ["queued", "lost", "other"])
    assert list(hits) == ["queued"] and hits["queued"].done
    assert hits["queued"].qid == format_qid(spid, 0)
    assert index.settle(exists) == (0, 0)
    index.close()
