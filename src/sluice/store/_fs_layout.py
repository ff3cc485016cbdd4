"""The filesystem flavour's layout: which directory a control file lives in.

SUMMARY
    Layout, a part of FsStore: dir_for(ctrl) and due_dir(next_at) name a
    control file's directory; _check_layout() reads layout.json at open,
    moves a flat incoming/ into buckets and re-files the deferred tree
    when the granularity changed.

DESCRIPTION
    A state has its own directory, except deferred and incoming: a
    deferred file lives in ``deferred/<T>``, T its due time rounded up by
    the retry granularity, so that deferred mail clusters in few
    directories and a refill reads the directories with T <= now by name
    alone; an incoming file in ``incoming/<bucket>`` by priority, arrival
    and tenant (sluice.store._fs_buckets), so a refill lists the first
    buckets only.  ``layout.json`` records the layout version and the
    granularity the tree was filed by.

STRATEGIES
    Re-file rather than refuse.  Opening the queue with another
    ``retry_granularity`` than the tree was filed by moves every deferred
    file to the directory of the new granularity (under the queue's lock,
    directories fsynced) before anything else runs; an unknown layout
    version is refused with the file's name.  A tree of layout 1 (a flat
    incoming/) is moved into buckets at its first open the same way.

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
from sluice.store._fs_buckets import bucket_of
from sluice.store._fs_files import (
    LAYOUT_VERSION,
    STATE_DIRS,
    Control,
    listdir,
    parse_name,
    read_control,
    scandir,
)


class Layout:
    """Where FsStore files its control files (a mixin: FsStore sets the attributes)."""

    root: Path
    granularity_s: float
    _policy: RetryPolicy

    if TYPE_CHECKING:  # Committing's, through FsStore
        def _write_small(self, path: Path, text: str) -> None: ...
        def _moved_outside_batches(self) -> None: ...

    def dir_for(self, ctrl: Control) -> str:
        """The directory of a control file.

        ``deferred/<T>`` by due time, ``incoming/<bucket>`` by priority,
        arrival and tenant (sluice.store._fs_buckets), else the state's own.
        """
        if ctrl.state is QueueState.DEFERRED:
            return f"deferred/{self.due_dir(ctrl.next_at)}"
        if ctrl.state is QueueState.INCOMING:
            return f"incoming/{bucket_of(ctrl.spid, ctrl.priority, ctrl.meta.tenantid)}"
        return STATE_DIRS[ctrl.state]

    def due_dir(self, next_at: float) -> int:
        """The deferred/<T> directory for a due time: rounded up, whole seconds."""
        return max(0, math.ceil(self._policy.round_up(next_at) - 1e-6))

    def due_now(self, now: float) -> float:
        """A due time for mail to try again at once: the grid line at or before ``now``.

        Its directory is then wholly due (T <= now), so a refill takes its
        files by name.  ``now`` itself would land in the directory due up to
        one granularity later, whose files every refill reads for their
        exact due times until then: recovery's 10,000 entries, a million
        queued behind them, made a restart deliver 13 s after its recovery.
        """
        g = self.granularity_s
        return now if g < 0.001 else math.floor(now / g) * g

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
        version = None if layout is None else layout.get("layout")
        if version not in (None, 1, LAYOUT_VERSION):
            raise StorageError(f"{path}: unknown layout {version!r}")
        if version != LAYOUT_VERSION:
            # Layout 1 (or a tree older than layout.json) kept incoming/ flat.
            self._bucket_incoming()
        if layout is not None and layout.get("granularity_s") != self.granularity_s:
            self._refile_deferred()
        if version != LAYOUT_VERSION or layout.get("granularity_s") != self.granularity_s:
            self._write_small(path, json.dumps({"layout": LAYOUT_VERSION,
                                                "granularity_s": self.granularity_s}))

    def _bucket_incoming(self) -> None:
        """Layout 1 to 2: move the control files of a flat incoming/ into their buckets.

        Renames under the queue's lock, the buckets fsynced before
        layout.json says 2; a crash midway leaves files in both places,
        and the next open moves the rest.  One file of each message is read for its tenant.
        """
        incoming = self.root / "incoming"
        made: set[str] = set()
        tenants: dict[str, str] = {}  # one file read per message: its files share the tenant
        for name in scandir(incoming):
            parsed = parse_name.__wrapped__(name)  # a million names: not through the cache
            if parsed is None:
                continue
            tenant = tenants.get(parsed.spid)
            if tenant is None:
                ctrl = read_control(self.root, f"incoming/{name}")
                if ctrl is None:
                    continue
                tenant = tenants[parsed.spid] = ctrl.meta.tenantid
            bucket = bucket_of(parsed.spid, parsed.priority, tenant)
            if bucket not in made:
                (incoming / bucket).mkdir(exist_ok=True)
                made.add(bucket)
            os.rename(incoming / name, incoming / bucket / name)
        if made:
            fsync_paths([str(incoming / b) for b in made] + [str(incoming)])
            self._moved_outside_batches()

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
        self._moved_outside_batches()
        for d in listdir(self.root / "deferred"):
            with contextlib.suppress(OSError):
                os.rmdir(self.root / "deferred" / d)
