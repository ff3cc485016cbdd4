"""The kv flavour's keys and records: ZoneMTA's key scheme and Sluice's index keys.

SUMMARY
    dz_key, chunk_key, exists_key, meta_key, rcpt_index, state_key,
    aged_key, index_keys, state_prefix, stat_key (keys); dumps, entry_of,
    age_of (records).

DESCRIPTION
    The key layout is described in sluice.store.kv.  Every key is built
    here, so the layout is defined once: the recipient ("delivery-zone")
    keys, the content chunks and the message keys of ZoneMTA, and
    Sluice's own index keys under ``sluice `` (per state, per queue id,
    the counters, the change feed, content being written).

    A recipient record is a small JSON object: i (envelope index), s
    (state), n (next attempt), a (attempts), r (last reply), p (priority).

SEE ALSO
    sluice.store.kv, seeds/002 (ZoneMTA)
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any
from urllib.parse import quote

from sluice.model import QueueEntry, QueueState, Reply, recipient_domain
from sluice.store._actions import Edit

STAT_NAMES = (*(str(s) for s in QueueState), "messages")
TOP = b"\xff"


def b(text: str) -> bytes:
    return text.encode("utf-8", "surrogateescape")


def zone_of(transportid: str) -> str:
    # Zone names are one key component: no spaces.
    return quote(transportid, safe="@.-_:+=,") if transportid else "default"


def rcpt_keys(rcpts: Sequence[str]) -> list[str]:
    """The recipient part of each delivery-zone key; repeats get ' #<idx>'."""
    seen: set[str] = set()
    out = []
    for i, rcpt in enumerate(rcpts):
        out.append(rcpt if rcpt not in seen else f"{rcpt} #{i}")
        seen.add(rcpt)
    return out


def dz_key(zone: str, spid: str, rcpt_key: str) -> bytes:
    return b(f"delivery-zone {zone} {spid} {rcpt_key}")


def chunk_key(spid: str, n: int) -> bytes:
    return b(f"message {spid} {n:06d}")


def exists_key(spid: str) -> bytes:
    return b(f"message {spid} #")


def meta_key(spid: str) -> bytes:
    return b(f"message {spid} *")


def rcpt_index(spid: str, idx: int) -> bytes:
    return b(f"sluice rcpt {spid} {idx:06d}")


RCPT_PREFIX = b"sluice rcpt "
PENDING_PREFIX = b"sluice pending "
CHANGE_PREFIX = b"sluice change "


def due_key(at: float) -> str:
    return f"{min(max(at, 0.0), 9999999999.999999):017.6f}"


def state_prefix(state: QueueState, priority: int | None = None) -> bytes:
    if state in (QueueState.INCOMING, QueueState.DEFERRED) and priority is not None:
        return b(f"sluice queue {state} {1 - priority} ")
    return b(f"sluice queue {state} ")


def state_key(spid: str, idx: int, rec: dict[str, Any]) -> bytes:
    state = rec["s"]
    if state == "incoming":
        return b(f"sluice queue incoming {1 - rec['p']} {spid} {idx:06d}")
    if state == "deferred":
        return b(f"sluice queue deferred {1 - rec['p']} {due_key(rec['n'])} {spid} {idx:06d}")
    return b(f"sluice queue {state} {spid} {idx:06d}")


#: Deferred recipients by arrival time, reports ("r") apart from other
#: mail ("m") since their maxtime differs: the oldest deferred entry and
#: those past their maxtime are found without reading every deferred
#: record (the state index has them by due time).
AGED_PREFIX = b"sluice aged "

#: Present once the aged index is complete: a new queue has it, and
#: recover() builds the index of a queue written by a version without it
#: (until then, readers scan the deferred index instead).
AGED_READY_KEY = b"sluice layout aged"

#: A message's age as the aged index keys it: arrival time, report or not.
Age = tuple[float, bool]


def aged_prefix(report: bool) -> bytes:
    return AGED_PREFIX + (b"r " if report else b"m ")


def age_of(meta: dict[str, Any] | None) -> Age:
    """A message's age from its metadata (arrival 0 for none: never aged out)."""
    return (0.0, False) if meta is None else (float(meta["arrival_at"]),
                                              bool(meta["is_report"]))


def aged_key(age: Age, spid: str, idx: int) -> bytes:
    arrival, report = age
    return aged_prefix(report) + b(f"{due_key(arrival)} {spid} {idx:06d}")


def aged_parts(key: bytes) -> tuple[float, str]:
    """An aged key's arrival time and SPID."""
    _, _, _, at, spid, _ = key.decode().split(" ")
    return float(at), spid


def index_keys(spid: str, idx: int, rec: dict[str, Any], age: Age) -> tuple[bytes, ...]:
    """The index keys of one recipient record: its state's, and a deferred one's age."""
    key = state_key(spid, idx, rec)
    if rec["s"] == "deferred":
        return key, aged_key(age, spid, idx)
    return (key,)


def stat_key(name: str) -> bytes:
    return b(f"sluice stat {name}")


def dumps(value: Any) -> bytes:
    return json.dumps(value, separators=(",", ":"), ensure_ascii=False).encode()


def spid_of_rcpt_index(key: bytes) -> tuple[str, int]:
    _, _, spid, idx = key.decode().split(" ")
    return spid, int(idx)


def entry_of(spid: str, meta: dict[str, Any], rec: dict[str, Any]) -> QueueEntry:
    idx = int(rec["i"])
    reply = rec.get("r")
    rcpt = meta["rcpts"][idx]
    return QueueEntry(
        spid=spid,
        idx=idx,
        sender=meta["sender"],
        recipient=rcpt,
        state=QueueState(rec["s"]),
        arrival_at=meta["arrival_at"],
        next_attempt_at=rec["n"],
        attempts=rec["a"],
        last_reply=None if reply is None else Reply.from_record(reply),
        priority=rec["p"],
        tenantid=meta["tenantid"],
        jobid=meta["jobid"],
        transportid=meta["transportid"],
        localip=tuple(meta["localip"]),
        is_report=meta["is_report"],
        size=meta["size"],
        domain=recipient_domain(rcpt),
        # Absent from metadata written before Sluice kept the flag.
        smtputf8=meta.get("smtputf8", False),
    )



def edited(rec: dict[str, Any], edit: Edit) -> dict[str, Any]:
    """A recipient record with an operator action's edit (sluice.store._actions)."""
    new = dict(rec)
    if edit.state is not None:
        new["s"] = str(edit.state)
    if edit.next_attempt_at is not None:
        new["n"] = edit.next_attempt_at
    if edit.priority is not None:
        new["p"] = edit.priority
    if edit.last_reply is not None:
        reply = edit.last_reply
        new["r"] = reply.to_record()
    return new
