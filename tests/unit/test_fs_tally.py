"""The filesystem flavour's count by names, shared with other processes.

A count shared among processes must be the count of one process: every
directory's recipients in order, every SPID once, whichever process
listed it.  A process that dies leaves its pieces to the caller, and a
small count starts no process at all.
"""

from __future__ import annotations

import contextlib
import random
from concurrent.futures import Future
from concurrent.futures.process import BrokenProcessPool
from pathlib import Path
from typing import Any

import pytest

from sluice.store import _fs_tally
from sluice.store._fs_files import count_names
from sluice.store._fs_tally import PIECE, SHARED_DIRS, tally

pytestmark = pytest.mark.unit


def tree(root: Path, dirs: int, seed: int = 7) -> list[str]:
    """``dirs`` directories of control files' names: SPIDs shared across them, strays too."""
    rnd = random.Random(seed)
    spids = [f"{rnd.getrandbits(64):016X}" for _ in range(dirs * 2)]
    rel_dirs = []
    for d in range(dirs):
        rel = f"incoming/p0-{d:08X}"
        path = root / rel
        path.mkdir(parents=True)
        for k in range(rnd.randrange(0, 12)):
            spid = rnd.choice(spids)
            n = rnd.choice([1, 1, 1, 3])
            domain = rnd.choice(["a.example", "b.example"])
            (path / f"{spid}-{k}+{n}p0@{domain}.mmq").touch()
        if d % 5 == 0:
            (path / "stray.tmp").touch()
        rel_dirs.append(rel)
    rel_dirs.append("deferred/123")  # missing: counts nothing
    return rel_dirs


def one_by_one(root: Path, rel_dirs: list[str], domain: str | None
               ) -> tuple[list[int], set[bytes]]:
    counts, spids = [], set()
    for rel in rel_dirs:
        n, of = count_names(root / rel, domain)
        counts.append(n)
        spids.update(of)
    return counts, spids


def held() -> contextlib.AbstractContextManager[object]:
    return contextlib.nullcontext()


@pytest.mark.parametrize("domain", [None, "b.example"])
def test_a_count_shared_among_processes_is_the_count_of_one(tmp_path: Path,
                                                            domain: str | None) -> None:
    rel_dirs = tree(tmp_path, SHARED_DIRS + 3 * PIECE)
    want = one_by_one(tmp_path, rel_dirs, domain)
    assert sum(want[0]) > 0 and want[1]
    assert tally(tmp_path, rel_dirs, domain, 1, held) == want
    assert tally(tmp_path, rel_dirs, domain, 2, held) == want
    assert tally(tmp_path, rel_dirs, domain, 3, held) == want


def test_this_process_lists_its_pieces_under_the_read_lock(tmp_path: Path) -> None:
    rel_dirs = tree(tmp_path, 3 * PIECE + 1)
    holds = []

    @contextlib.contextmanager
    def reading() -> Any:
        holds.append(True)
        yield

    tally(tmp_path, rel_dirs, None, 1, reading)
    assert len(holds) == 4  # 25 directories and the missing one, in pieces of 8


class DeadPool:
    """An executor whose every process died: each future fails as a broken pool's does."""

    def __init__(self, *_: Any, **__: Any) -> None:
        self.submitted = 0

    def submit(self, *_: Any) -> Future[Any]:
        self.submitted += 1
        future: Future[Any] = Future()
        future.set_running_or_notify_cancel()  # a process has it: not cancellable
        future.set_exception(BrokenProcessPool("a process died"))
        return future

    def shutdown(self, **_: Any) -> None:
        pass


def test_pieces_of_a_process_that_died_are_counted_here(tmp_path: Path,
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    rel_dirs = tree(tmp_path, SHARED_DIRS + PIECE)
    pools: list[DeadPool] = []
    monkeypatch.setattr(_fs_tally, "ProcessPoolExecutor",
                        lambda *a, **k: pools.append(DeadPool()) or pools[-1])
    assert tally(tmp_path, rel_dirs, None, 2, held) == one_by_one(tmp_path, rel_dirs, None)
    assert pools and pools[0].submitted == len(range(0, len(rel_dirs), PIECE))


def test_a_small_count_starts_no_process(tmp_path: Path,
                                         monkeypatch: pytest.MonkeyPatch) -> None:
    rel_dirs = tree(tmp_path, SHARED_DIRS - 2)  # with the missing one: one short

    def no(*_: Any, **__: Any) -> Any:
        raise AssertionError("a process was started")

    monkeypatch.setattr(_fs_tally, "ProcessPoolExecutor", no)
    assert tally(tmp_path, rel_dirs, None, 4, held) == one_by_one(tmp_path, rel_dirs, None)
