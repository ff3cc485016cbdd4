"""Helper processes forked only while this process is alone; the committer started by a write."""

from __future__ import annotations

import subprocess
import sys
import threading
from pathlib import Path

import pytest

from sluice._workers import worker_context
from sluice.store import StorageError
from sluice.store._commit import GroupCommitter

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[2]


def test_a_process_with_another_thread_spawns() -> None:
    stop = threading.Event()
    other = threading.Thread(target=stop.wait, name="another")
    other.start()
    try:
        assert worker_context().get_start_method() == "spawn"
    finally:
        stop.set()
        other.join()


def test_a_process_alone_forks() -> None:
    # A fresh interpreter: the test runner's own threads would make it spawn.
    code = ("from sluice._workers import worker_context; "
            "print(worker_context().get_start_method())")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True, timeout=60, cwd=ROOT)
    assert out.stdout.strip() == "fork"


def committer_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name == "test-commit"]


def test_the_committer_thread_starts_with_the_first_write() -> None:
    batches: list[int] = []

    def commit(ops: list) -> None:  # type: ignore[type-arg]
        batches.append(len(ops))
        for op in ops:
            op.future.set_result(op.work(None))

    idle = GroupCommitter(commit, name="test-commit")
    assert committer_threads() == []
    idle.close()  # never started: nothing to stop
    with pytest.raises(StorageError, match="closed"):
        idle.submit(lambda _: 1)  # and none starts for a write after the close
    assert committer_threads() == []

    writing = GroupCommitter(commit, name="test-commit")
    assert committer_threads() == []
    assert writing.call(lambda _: 42) == 42
    assert len(committer_threads()) == 1 and batches == [1]
    writing.close()
    assert committer_threads() == []
