"""The filesystem flavour's count by names, shared with other processes.

A count shared among processes must be the count of one process: every
directory's recipients in order, every SPID once, whichever process
listed it.  A process that dies leaves its pieces to the caller, a pool
that cannot start leaves it all, and a count soon done starts no process
at all (the pace is judged by a clock the tests give).
"""

from __future__ import annotations

import contextlib
import itertools
import json
import random
import subprocess
import sys
from collections.abc import Callable
from concurrent.futures import Future
from concurrent.futures.process import BrokenProcessPool
from pathlib import Path
from typing import Any

import pytest

from sluice.store import _fs_tally
from sluice.store._fs_files import count_names
from sluice.store._fs_tally import PIECE, tally

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


class Holds:
    """The read lock as a count: this process takes it once per piece it lists."""

    def __init__(self) -> None:
        self.n = 0

    @contextlib.contextmanager
    def __call__(self) -> Any:
        self.n += 1
        yield


def pieces_of(rel_dirs: list[str]) -> int:
    return len(range(0, len(rel_dirs), PIECE))


def slow_clock() -> Callable[[], float]:
    """A clock that says every piece took a second: the count shares after its first."""
    ticks = itertools.count()
    return lambda: float(next(ticks))


def still_clock() -> float:
    """A clock that says no time passes: the count never shares."""
    return 0.0


@pytest.mark.parametrize("domain", [None, "b.example"])
def test_a_count_shared_among_processes_is_the_count_of_one(tmp_path: Path,
                                                            domain: str | None) -> None:
    rel_dirs = tree(tmp_path, 20 * PIECE)
    want = one_by_one(tmp_path, rel_dirs, domain)
    assert sum(want[0]) > 0 and want[1]
    alone = tally(tmp_path, rel_dirs, domain, 1, held, slow_clock())
    assert (alone.per_dir, alone.spids, alone.elsewhere) == (*want, 0)
    for jobs in (2, 3):
        holds = Holds()
        shared = tally(tmp_path, rel_dirs, domain, jobs, holds, slow_clock())
        assert (shared.per_dir, shared.spids) == want
        # What was handed out is counted by the others (this process waits
        # for it), and each piece once: here, or there.
        assert shared.elsewhere >= 1
        assert holds.n + shared.elsewhere == pieces_of(rel_dirs)


def test_a_count_shares_only_when_the_rest_would_take_long(tmp_path: Path,
                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    rel_dirs = tree(tmp_path, 21 * PIECE - 1)  # with the missing one: 21 pieces
    pools: list[object] = []

    def no(*_: Any, **__: Any) -> Any:
        pools.append(True)
        raise NotImplementedError("counted alone")

    monkeypatch.setattr(_fs_tally, "ProcessPoolExecutor", no)
    # 10 ms a piece: at 50 ms, 16 pieces left are 0.16 s, under SHARE_ABOVE_S.
    ticks = itertools.count()
    tally(tmp_path, rel_dirs, None, 2, held, lambda: next(ticks) * 0.01)
    assert pools == []
    # 30 ms a piece: at 60 ms, 19 left are 0.57 s: it shares.
    ticks = itertools.count()
    tally(tmp_path, rel_dirs, None, 2, held, lambda: next(ticks) * 0.03)
    assert pools == [True]


def test_a_count_that_is_soon_done_starts_no_process(tmp_path: Path,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    rel_dirs = tree(tmp_path, 20 * PIECE)

    def no(*_: Any, **__: Any) -> Any:
        raise AssertionError("a process was started")

    monkeypatch.setattr(_fs_tally, "ProcessPoolExecutor", no)
    found = tally(tmp_path, rel_dirs, None, 4, held, still_clock)
    assert (found.per_dir, found.spids) == one_by_one(tmp_path, rel_dirs, None)


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
    """An executor whose every process died: each piece fails as a broken pool's does."""

    def __init__(self, *_: Any, **__: Any) -> None:
        self.submitted = 0

    def submit(self, *_: Any) -> Future[Any]:
        self.submitted += 1
        future: Future[Any] = Future()
        future.set_running_or_notify_cancel()
        future.set_exception(BrokenProcessPool("a process died"))
        return future

    def shutdown(self, **_: Any) -> None:
        pass


def test_pieces_of_a_process_that_died_are_counted_here(tmp_path: Path,
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    rel_dirs = tree(tmp_path, 20 * PIECE)
    pools: list[DeadPool] = []
    monkeypatch.setattr(_fs_tally, "ProcessPoolExecutor",
                        lambda *a, **k: pools.append(DeadPool()) or pools[-1])
    holds = Holds()
    found = tally(tmp_path, rel_dirs, None, 2, holds, slow_clock())
    assert (found.per_dir, found.spids) == one_by_one(tmp_path, rel_dirs, None)
    assert found.elsewhere == 0 and pools and pools[0].submitted >= 1
    assert holds.n == pieces_of(rel_dirs)  # each piece once, all here


@pytest.mark.parametrize("where", ["pool", "spawn"])
def test_a_count_whose_processes_cannot_start_is_counted_here(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, where: str) -> None:
    rel_dirs = tree(tmp_path, 20 * PIECE)

    class NoSpawn(DeadPool):
        tried = 0

        def submit(self, *_: Any) -> Future[Any]:
            self.tried += 1
            raise OSError("cannot spawn")

    def no_pool(*_: Any, **__: Any) -> Any:
        raise NotImplementedError("no sem_open here")

    spawns: list[NoSpawn] = []

    def no_spawn(*_: Any, **__: Any) -> NoSpawn:
        spawns.append(NoSpawn())
        return spawns[-1]

    monkeypatch.setattr(_fs_tally, "ProcessPoolExecutor", no_pool if where == "pool" else no_spawn)
    holds = Holds()
    found = tally(tmp_path, rel_dirs, None, 2, holds, slow_clock())
    assert (found.per_dir, found.spids, found.elsewhere) == (
        *one_by_one(tmp_path, rel_dirs, None), 0)
    assert holds.n == pieces_of(rel_dirs)
    if where == "spawn":
        assert spawns[0].tried == 1  # a failed spawn ends the handing out


def test_a_count_alone_in_its_process_shares_with_forked_processes(tmp_path: Path) -> None:
    # In a fresh interpreter (one thread) the other processes are forked,
    # not spawned; the count is still the count of one.
    rel_dirs = tree(tmp_path, 12 * PIECE)
    want = one_by_one(tmp_path, rel_dirs, None)
    code = f"""
import contextlib, itertools, json, sys
from pathlib import Path
from sluice import _workers
from sluice.store import _fs_tally
used = []
def context():
    ctx = _workers.worker_context()
    used.append(ctx.get_start_method())
    return ctx
_fs_tally.worker_context = context
ticks = itertools.count()
found = _fs_tally.tally(Path({str(tmp_path)!r}), {rel_dirs!r}, None, 2, contextlib.nullcontext,
                        lambda: float(next(ticks)))
print(json.dumps([found.per_dir, sorted(s.decode() for s in found.spids), found.elsewhere,
                  used]))
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True, timeout=60, cwd=Path(__file__).resolve().parents[2])
    per_dir, spids, elsewhere, used = json.loads(out.stdout)
    assert (per_dir, spids) == (want[0], sorted(s.decode() for s in want[1]))
    assert elsewhere >= 1 and used == ["fork"]
