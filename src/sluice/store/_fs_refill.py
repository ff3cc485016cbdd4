"""The filesystem flavour's refill: which incoming and due deferred files a claim takes.

SUMMARY
    Refilling, a part of FsStore: claim(limit, now, quota_deferred).

DESCRIPTION
    A claim takes files in refill order -- priority, then due time (0 for
    incoming mail), then SPID -- from the first incoming buckets and the
    deferred directories that are due, shares them among tenants by weight
    (sluice.store._refill) and moves them to active/ in one batch of the
    committer.  A file holding more recipients than the claim has room
    for is split.

STRATEGIES
    The first ``limit`` files, not the backlog.  Every file holds at least
    one recipient, so the first ``limit`` files (of each tenant, when
    tenants share) are all a claim can need.  Directories are read as
    streams keeping only those: a claim's memory follows its limit and the
    tenants, not the queue.

    Due by name, except in the window.  A directory with T <= now is due
    by its name; the one whose window holds now needs each file's exact
    time, read once per file version (sluice.store._fs_due).

    "Nothing" without the lock.  A queue manager polls often; an empty
    queue is answered from directory listings alone.

    The backlog outside the batch.  The due deferred files are chosen
    before the claim enters the committer, with no lock held: the pass
    over every due name is the long part of a claim (seconds at 100,000),
    and the committer would hold every submission and outcome behind it.
    Inside the batch, each chosen file is read again; one gone or changed
    since is skipped or taken as it now is.  Incoming is chosen inside:
    its buckets are read only as far as the claim needs.  Two processes
    sharing a queue may choose the same files; the second to commit takes
    fewer than it chose, and its queue manager refills again after its
    refill interval.

SEE ALSO
    sluice.store.fs (the store), sluice.store._fs_batch (the batch's view
    of a directory), sluice.store._refill (shares and quotas)
"""

from __future__ import annotations

import functools
import heapq
import itertools
from collections import Counter
from collections.abc import Callable, Iterable
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from sluice.model import QueueEntry, QueueState
from sluice.store._fs_batch import Batch
from sluice.store._fs_buckets import bucket_tenant, sorted_buckets
from sluice.store._fs_due import DueTimes
from sluice.store._fs_files import SUFFIX, Control, Name, listdir, parse_name, scandir
from sluice.store._refill import (
    EQUAL,
    Candidate,
    TenantMemo,
    TenantWeights,
    fair_pick,
    firsts_by_group,
    interleave,
    split_quota,
)

__all__ = ["Refilling"]


def _due_key(t: int, parsed: Name) -> tuple[Any, ...]:
    """A file's place in a refill: priority, due time (0: incoming), SPID, recipients."""
    return (-parsed.priority, t, parsed.spid, parsed.idx0, parsed.n)


class Refilling:
    """FsStore's claim (a mixin: FsStore sets the attributes)."""

    root: Path
    #: Tenants' weights for sharing a refill (from_config: scheduler.tenants).
    tenant_weights: TenantWeights = EQUAL
    _tenants: TenantMemo  # SPID -> tenant
    _due_times: DueTimes  # of directories not wholly due

    if TYPE_CHECKING:  # Layout's and Committing's, through FsStore
        @property
        def _window_s(self) -> float: ...
        def _call(self, work: Callable[[Batch], Any]) -> Any: ...
        def dir_for(self, ctrl: Control) -> str: ...

    def _claimable(self, now: float) -> bool:
        if any(any(n.endswith(SUFFIX) for n in scandir(self.root / "incoming" / b))
               for b in sorted_buckets(listdir(self.root / "incoming"))):
            return True
        return any(
            d.isdigit() and int(d) - self._window_s < now
            and any(n.endswith(SUFFIX) for n in listdir(self.root / "deferred" / d))
            for d in listdir(self.root / "deferred"))

    def _due_candidates(self, view: Batch, now: float, k: int,
                        group: Callable[[Candidate], str] | None = None) -> list[Candidate]:
        """The first ``k`` due deferred files in refill order (of each ``group``, if given).

        The directories are read as streams and only the first ``k`` (of
        each group) kept: no list and sort of the whole backlog.  A claim of
        1,000 from 50,000 due files took 39 % less time that way without
        tenants (bench/fs_deferred_refill.py); shared by tenant, a group is
        a tenant and its memory is k files a tenant.
        """
        streams: list[Iterable[Candidate]] = []
        for t in view.deferred_dirs():
            if t - self._window_s >= now:
                break
            rel_dir = f"deferred/{t}"
            if t > now:  # in the directory's window: look at the exact times
                streams.append(self._due_in_window(view, rel_dir, t, now))
            else:
                streams.append(item for _, item in
                               view.keyed(rel_dir, functools.partial(_due_key, t)))
        self._due_times.forget_due(now)
        items = itertools.chain.from_iterable(streams)
        if group is not None:
            return firsts_by_group(items, k, group)
        return heapq.nsmallest(k, items)

    def _due_in_window(self, view: Batch, rel_dir: str, t: int, now: float
                       ) -> list[Candidate]:
        """The due files of a directory not wholly due yet (its times kept: _fs_due).

        20,000 files not due yet cost a refill 370 ms read each time, 145
        ms stat'ed (bench/fs_deferred_refill.py --window).
        """
        def read(name: str) -> float | None:
            ctrl = view.load(f"{rel_dir}/{name}")
            return None if ctrl is None else ctrl.next_at

        out = []
        for name, next_at in self._due_times.of(rel_dir, view.stamped(rel_dir), read):
            if next_at <= now and (parsed := parse_name(name)) is not None:
                out.append((_due_key(t, parsed), f"{rel_dir}/{name}"))
        return out

    def claim(self, limit: int, now: float, quota_deferred: int) -> list[QueueEntry]:
        """Store.claim over the incoming and due deferred directories.

        A queue manager polls often: "nothing" is answered without the lock.
        """
        if limit <= 0:
            return []
        # A queue manager polls often; answer "nothing" without the lock.
        if not self._claimable(now):
            return []

        def take(view: Batch, slots: list[str]) -> list[QueueEntry]:
            # ``slots``: one path per recipient to take, a file's in a row
            # of its own order; a file of which fewer are wanted is split.
            want = Counter(slots)
            got: dict[str, list[QueueEntry]] = {}
            for path, k in want.items():
                ctrl = view.load(path)
                if ctrl is None:
                    continue
                if len(ctrl.rcpts) <= k:
                    got[path] = view.move(ctrl, QueueState.ACTIVE).entries()
                else:
                    part = replace(ctrl, state=QueueState.ACTIVE, rcpts=ctrl.rcpts[:k])
                    view.swap([ctrl], [part, replace(ctrl, rcpts=ctrl.rcpts[k:])])
                    got[path] = part.entries()
            out: list[QueueEntry] = []
            for path in slots:
                entries = got.get(path)
                if entries:
                    out.append(entries.pop(0))
            return out

        weights = self.tenant_weights
        # Every file holds at least one recipient: the first ``limit`` files
        # (of each tenant) are all a refill can need.  The deferred backlog
        # is read here, before the batch and without a lock: a pass over
        # every due name costs seconds at 100,000 of them, and in the batch
        # it held up every submission and outcome behind it.  What changed
        # since is sorted out by take(), which reads each chosen file again.
        scan = Batch(self)
        dfr = self._due_candidates(scan, now, limit, (lambda c: weights.key(
            self._tenant_of(scan, c[0][2], c[1]))) if weights.fair else None)
        fair_dfr = self._fair_slots(scan, dfr, limit, weights)

        def work(view: Batch) -> list[QueueEntry]:
            inc = view.first_incoming(limit, functools.partial(_due_key, 0),
                                      by_tenant=weights.fair)
            fair_inc = self._fair_slots(view, inc, limit, weights)
            take_d, take_i = split_quota(limit, len(fair_inc), len(fair_dfr), quota_deferred)
            return interleave(take(view, fair_inc[:take_i]), take(view, fair_dfr[:take_d]))

        result: list[QueueEntry] = self._call(work)
        return result

    def _fair_slots(self, view: Batch, cands: list[Candidate], limit: int,
                    weights: TenantWeights) -> list[str]:
        """A refill's recipients from ``cands`` (files in order), by tenant: a path each."""
        by_tenant: dict[str, list[str]] = {}
        for key, path in cands:
            tenant = weights.key(self._tenant_of(view, key[2], path)) if weights.fair else ""
            line = by_tenant.setdefault(tenant, [])
            line += [path] * min(key[-1], limit - len(line))
        return fair_pick(by_tenant, weights, limit)

    def _tenant_of(self, view: Batch, spid: str, path: str) -> str:
        """The tenant of message ``spid``: its bucket's, or read from ``path`` once."""
        if path.startswith("incoming/"):
            tenant = bucket_tenant(path.split("/")[1])
            if tenant is not None:
                return tenant

        def read() -> str | None:
            ctrl = view.load(path)
            return ctrl.meta.tenantid if ctrl is not None else None

        return self._tenants.get(spid, read)
