"""The filesystem flavour's layout: which directory a control file lives in.

SUMMARY
    Layout, a part of FsStore: dir_for(state, next_at) and due_dir(next_at)
    name a control file's directory; _check_layout() reads layout.json at
    open and re-files the deferred tree when the granularity changed.

DESCRIPTION
    A state has its own directory, except deferred: a deferred file lives
    in ``deferred/<T>``, T its due time rounded up by the retry
    granularity, so that deferred mail clusters in few directories and a
    refill reads the directories with T <= now by name alone.
    ``layout.json`` records the layout version and the granularity the
    tree was filed by.

STRATEGIES
    Re-file rather than refuse.  Opening the queue with another
    ``retry_granularity`` than the tree was filed by moves every deferred
    file to the directory of the new granularity (under the queue's lock,
    directories fsynced) before anything else runs; an unknown layout
    version is refused with the file's name.

SEE ALSO
    sluice.store.fs (the store), sluice.store._fs_files (names and formats)
"""

from __future__ import annotations

import contextlib
import json
import math
import os
from pathlib import Path
from typing import TYPE_CHECKING

from sluice.model import QueueState
from sluice.retry import RetryPolicy
from sluice.store import StorageError
from sluice.store._commit import fsync_paths
from sluice.store._fs_files import LAYOUT_VERSION, STATE_DIRS, listdir, read_control


class Layout:
    """Where FsStore files its control files (a mixin: FsStore sets the attributes)."""

    root: Path
    granularity_s: float
    _policy: RetryPolicy

    if TYPE_CHECKING:  # Committing's, through FsStore
        def _write_small(self, path: Path, text: str) -> None: ...

    def dir_for(self, state: QueueState, next_at: float) -> str:
        """The state directory of an entry: ``deferred/<T>`` by due time, else the state's own."""
        if state is QueueState.DEFERRED:
            return f"deferred/{self.due_dir(next_at)}"
        return STATE_DIRS[state]

    def due_dir(self, next_at: float) -> int:
        """The deferred/<T> directory for a due time: rounded up, whole seconds."""
        return max(0, math.ceil(self._policy.round_up(next_at) - 1e-6))

    @property
    def _window_s(self) -> float:
        # Files in deferred/T are due in (T - window, T].
        return self.granularity_s + 1.0

    def _check_layout(self) -> None:
        path = self.root / "layout.json"
        try:
            layout = json.loads(path.read_text())
        except FileNotFoundError:
            layout = None
        except (OSError, ValueError) as exc:
            raise StorageError(f"cannot read {path}: {exc}") from exc
        if layout is not None and layout.get("layout") != LAYOUT_VERSION:
            raise StorageError(f"{path}: unknown layout {layout.get('layout')!r}")
        if layout is not None and layout.get("granularity_s") != self.granularity_s:
            self._refile_deferred()
        if layout is None or layout.get("granularity_s") != self.granularity_s:
            self._write_small(path, json.dumps({"layout": LAYOUT_VERSION,
                                                "granularity_s": self.granularity_s}))

    def _refile_deferred(self) -> None:
        """The granularity changed: move deferred files to their new directories."""
        dirs: set[str] = set()
        for d in listdir(self.root / "deferred"):
            for name in listdir(self.root / "deferred" / d):
                ctrl = read_control(self.root, f"deferred/{d}/{name}")
                if ctrl is None:
                    continue
                target = f"deferred/{self.due_dir(ctrl.next_at)}"
                if target != f"deferred/{d}":
                    (self.root / target).mkdir(exist_ok=True)
                    os.rename(self.root / "deferred" / d / name, self.root / target / name)
                    dirs.update((str(self.root / target), str(self.root / "deferred" / d)))
        dirs.add(str(self.root / "deferred"))
        fsync_paths(dirs)
        for d in listdir(self.root / "deferred"):
            with contextlib.suppress(OSError):
                os.rmdir(self.root / "deferred" / d)
