"""Plain-data renderings of queue entries, counts and qshape.

SUMMARY
    entry_json(entry), counts_json(counts), totals_line(counts),
    shape_table(shape, top) -- shared by the CLI (``--json``, qlist, qshape),
    the REST API and the demo, so every surface shows the queue the same way.
"""

from __future__ import annotations

from typing import Any

from sluice.model import QueueEntry, QueueState
from sluice.queue import QSHAPE_EDGES_MIN
from sluice.store import Counts

__all__ = ["counts_json", "entry_json", "shape_table", "totals_line"]


def entry_json(e: QueueEntry) -> dict[str, Any]:
    """One recipient entry as JSON-ready data."""
    return {
        "qid": e.qid, "spid": e.spid, "state": e.state.value, "sender": e.sender,
        "recipient": e.recipient, "domain": e.domain, "arrival_at": e.arrival_at,
        "next_attempt_at": e.next_attempt_at, "attempts": e.attempts, "priority": e.priority,
        "tenantid": e.tenantid, "jobid": e.jobid, "transportid": e.transportid,
        "localip": list(e.localip),
        "last_reply": None if e.last_reply is None else {
            "code": e.last_reply.code, "enhanced": e.last_reply.enhanced,
            "text": e.last_reply.text},
        "size": e.size, "dsn": e.is_report, "smtputf8": e.smtputf8,
    }


def counts_json(c: Counts) -> dict[str, Any]:
    """Queue counts as JSON: messages, recipients, and recipients by state."""
    return {"messages": c.messages, "recipients": c.recipients,
            "by_state": {s.value: c[s] for s in QueueState}}


def totals_line(c: Counts) -> str:
    """The closing line of qlist (Mailismus): all, and new (incoming)."""
    return (f"Total: {c.messages} messages, {c.recipients} recipients; "
            f"new/incoming: {c[QueueState.INCOMING]}")


def shape_table(shape: dict[str, list[int]], top: int = 0) -> list[list[str]]:
    """Rows of the qshape table, TOTAL first, then domains by size."""
    width = len(QSHAPE_EDGES_MIN) + 1
    total = [0] * width
    for counts in shape.values():
        total = [a + b for a, b in zip(total, counts, strict=True)]
    domains = sorted(shape.items(), key=lambda kv: (-sum(kv[1]), kv[0]))
    if top:
        domains = domains[:top]
    header = ["", "T"] + [str(m) for m in QSHAPE_EDGES_MIN] + [f"{QSHAPE_EDGES_MIN[-1]}+"]
    rows = [header, ["TOTAL", str(sum(total))] + [str(n) for n in total]]
    for domain, counts in domains:
        rows.append([domain or "<none>", str(sum(counts))] + [str(n) for n in counts])
    return rows
