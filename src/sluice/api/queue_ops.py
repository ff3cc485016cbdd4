"""The API's operations on the queue: listing, counts, qshape, a message, why, actions.

SUMMARY
    ops = control.queue_ops
    reads:    await ops.entries(selector, after, limit) -> EntryPage; counts,
              shape, entry, message, why
    changes:  await ops.act(who, action, selector, ...) -> ActionResult

DESCRIPTION
    Reads page through the store in queue-id order (a cursor, never the
    whole queue).  Why an entry waits comes from the running scheduler
    when the entry is in its memory, else from the store.

    Queue actions go to sluice.queue.Queue.act (which writes the
    accounting log and the store's change feed); the queue manager is
    then told at once (Manager.apply_changes) instead of finding out at
    its next change-feed poll, and a bounce queues its NDRs at once.
    Every action that changed something is recorded in the audit history
    (final: not reversible).

INVARIANTS
    A selector that is empty changes nothing unless the caller says ``all``.

SEE ALSO
    sluice.api.control, sluice.queue, docs/api.md
"""

from __future__ import annotations

import itertools
import logging
from typing import TYPE_CHECKING

from pydantic import ValidationError

from sluice.api.audit import MAX_QIDS
from sluice.api.errors import ApiError
from sluice.api.history import message_history, spid_arrival_at
from sluice.api.models import (
    ActionResult,
    Counts,
    EntryModel,
    EntryPage,
    ExplanationModel,
    HistoryEvent,
    MessageModel,
    ShapeModel,
    ShapeRow,
    WhyResponse,
)
from sluice.model import QueueEntry, QueueState, Selector
from sluice.queue import QSHAPE_EDGES_MIN
from sluice.render import counts_json, entry_json, shape_table
from sluice.scheduler import Explanation, explain_stored
from sluice.store import Action, narrow

if TYPE_CHECKING:
    from sluice.api.control import Control

__all__ = ["MAX_RECIPIENTS", "QueueOps"]

log = logging.getLogger("sluice.api")

#: Recipients of one message read for its view.
MAX_RECIPIENTS = 10_000


def entry_model(entry: QueueEntry) -> EntryModel:
    return EntryModel.model_validate(entry_json(entry))


def explanation_model(expl: Explanation, source: str, now: float) -> ExplanationModel:
    return ExplanationModel.model_validate(expl.data(source, now))


class QueueOps:
    """Reads of and actions on the queue."""

    def __init__(self, control: Control) -> None:
        self.c = control

    # -- reads -----------------------------------------------------------------------

    async def entries(self, selector: Selector, after: str | None, limit: int) -> EntryPage:
        """GET /queue/entries: one page of the entries ``selector`` matches, after ``after``."""
        store = self.c.queue.store
        if after is not None:
            self.c.qid(after, bare_ok=True)
            after = after.strip().upper()

        def work() -> list[QueueEntry]:
            return list(itertools.islice(
                store.entries(selector, after=after, limit=limit + 1), limit + 1))

        items = await self.c.io(work)
        more = len(items) > limit
        items = items[:limit]
        return EntryPage(entries=[entry_model(e) for e in items],
                         next=items[-1].qid if more and items else None)

    async def counts(self, selector: Selector) -> Counts:
        """GET /queue/counts: the totals of the entries ``selector`` matches."""
        counts = await self.c.io(self.c.queue.store.count,
                                 None if selector.is_empty else selector)
        return Counts.model_validate(counts_json(counts))

    async def shape(self, selector: Selector, top: int) -> ShapeModel:
        """GET /queue/shape: recipients per domain by age (qshape), the ``top`` domains."""
        edges_s = [m * 60.0 for m in QSHAPE_EDGES_MIN]
        shape = await self.c.io(self.c.queue.store.shape, selector, self.c.clock(), edges_s)
        rows = shape_table(shape, top)

        def row(cells: list[str]) -> ShapeRow:
            return ShapeRow(domain=cells[0], total=int(cells[1]),
                            buckets=[int(c) for c in cells[2:]])

        return ShapeModel(buckets_min=list(QSHAPE_EDGES_MIN), header=rows[0][1:],
                          total=row(rows[1]), rows=[row(r) for r in rows[2:]],
                          domains=len(shape))

    async def entry(self, qid: str) -> EntryModel:
        """GET /queue/entries/{qid}: one entry; 404 when it is not in the queue."""
        self.c.qid(qid, bare_ok=False)
        entry = await self.c.io(self.c.queue.store.get, qid.strip().upper())
        if entry is None:
            raise ApiError(404, "not found", f"no entry {qid} in the queue "
                                             "(delivered, deleted or never queued)")
        return entry_model(entry)

    async def _recipients(self, spid: str) -> list[QueueEntry]:
        store = self.c.queue.store
        return await self.c.io(lambda: list(store.entries(Selector(qids=(spid,)),
                                                          limit=MAX_RECIPIENTS)))

    async def message(self, text: str) -> MessageModel:
        """GET /messages/{spid}: the recipients still queued and the message's accounting lines.

        404 when neither the queue nor the log knows it.
        """
        spid, _ = self.c.qid(text, bare_ok=True)
        entries = await self._recipients(spid)
        arrival = spid_arrival_at(spid)
        if arrival is None and entries:
            arrival = min(e.arrival_at for e in entries)
        # An hour of slack: another process's clock may be a little behind.
        since = None if arrival is None else arrival - 3600.0
        cfg = self.c.config
        history = await self.c.io(message_history, cfg.accounting.path, spid, since,
                                  cfg.api.history_max_bytes)
        # A line edited by hand may not have the documented types: leave it out
        # rather than answer with something the OpenAPI document does not promise.
        events = []
        for event in history.events:
            try:
                events.append(HistoryEvent.model_validate(event))
            except ValidationError:
                log.warning("accounting line of %s with unexpected values skipped", spid)
        if not entries and not events:
            raise ApiError(404, "not found", f"no message {spid} in the queue or in the "
                                             "accounting log")
        return MessageModel(spid=spid, arrival_at=arrival,
                            recipients=[entry_model(e) for e in entries], history=events,
                            history_files=history.files, history_bytes=history.bytes_scanned,
                            history_truncated=history.truncated)

    async def why(self, text: str) -> WhyResponse:
        """Why each recipient of ``text`` (a queue id or SPID) waits.

        From the scheduler's memory when it knows the entry and the entry is not
        held, else from the stored entry.
        """
        spid, idx = self.c.qid(text, bare_ok=True)
        if idx is None:
            entries = await self._recipients(spid)
        else:
            entry = await self.c.io(self.c.queue.store.get, f"{spid}-{idx}")
            entries = [entry] if entry is not None else []
        if not entries:
            raise ApiError(404, "not found", f"no entry {text} in the queue "
                                             "(delivered, deleted or never queued)")
        now = self.c.now()
        out = []
        for entry in entries:
            memory = self.c.scheduler.explain(entry.qid, now)
            # A held entry is held, whatever the memory still says of it (issue 17).
            if memory.state != "unknown" and entry.state is not QueueState.HOLD:
                out.append(explanation_model(memory, "memory", now))
            else:
                out.append(explanation_model(explain_stored(entry, now, self.c.retry), "store",
                                             now))
        return WhyResponse(explanations=out)

    # -- actions ---------------------------------------------------------------------

    async def act(self, who: str, action: Action, selector: Selector, *, all_: bool,
                  dry_run: bool, priority: int | None, reason: str) -> ActionResult:
        """POST /queue/actions: an action on the selected entries, audited; or a dry-run count."""
        if selector.is_empty and not all_:
            raise ApiError(400, "empty selector", "give queue ids or a selector (domain, "
                           "sender, tenantid, ...), or all=true for the whole queue")
        if action is Action.PRIORITY and priority is None:
            raise ApiError(422, "invalid request",
                           [{"path": "priority", "message": "action 'priority' needs "
                                                           "'priority': 0 or 1"}])
        if action is not Action.PRIORITY and priority is not None:
            raise ApiError(422, "invalid request",
                           [{"path": "priority", "message": "'priority' goes only with "
                                                           "action 'priority'"}])
        if dry_run:
            return await self._dry_run(action, selector)
        c = self.c
        touched = await c.io(c.queue.act, selector, action, priority=priority)
        qids = [e.qid for e in touched]
        if qids:
            c.manager.apply_changes(set(qids))
        if action is Action.BOUNCE and touched:
            queued = await c.io(c.queue.run_bounces)
            if queued:
                c.manager.notify_mail(queued)
        audit_id = None
        if touched:
            record = await c.audited(lambda: c.audit.queue_action(
                who, action, selector, all_=all_, reason=reason, qids=qids,
                priority=priority, now=c.clock()))
            audit_id = record.id
        return ActionResult(action=action, dry_run=False, count=len(qids),
                            qids=qids[:MAX_QIDS], qids_truncated=len(qids) > MAX_QIDS,
                            audit_id=audit_id)

    async def _dry_run(self, action: Action, selector: Selector) -> ActionResult:
        narrowed = narrow(selector, action)
        if narrowed is None:
            # None of the selected states is one this action applies to.
            return ActionResult(action=action, dry_run=True, count=0, qids=[],
                                qids_truncated=False, audit_id=None)
        store = self.c.queue.store

        def work() -> tuple[int, list[str]]:
            counts = store.count(narrowed)
            qids = [e.qid for e in store.entries(narrowed, limit=MAX_QIDS)]
            return counts.recipients, qids

        count, qids = await self.c.io(work)
        return ActionResult(action=action, dry_run=True, count=count, qids=qids,
                            qids_truncated=count > len(qids), audit_id=None)
