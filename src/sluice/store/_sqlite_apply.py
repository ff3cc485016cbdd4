"""The sqlite flavour's statements for Store.apply: transitions grouped, keys OR'ed.

SUMMARY
    grouped(transitions, node) -> [(statement, values, keys)];
    keys_where(keys) -> (where, values, qid of each key); transition_sql(t, node);
    KEYS_PER_STATEMENT.

DESCRIPTION
    The queue manager's batches hold one outcome (or "delivering" mark) of
    each of many messages.  Transitions with the same statement and values
    run as one statement over all their keys, whatever message they belong
    to; each statement ends in ``RETURNING spid, idx`` so the caller learns
    which applied.

STRATEGIES
    Keys by primary key.  One ``spid = ? AND idx IN (...)`` term per
    message, OR'ed: SQLite looks each up by the primary key (a row-value
    IN list made it scan an index instead), and the expected state is
    written ``+state`` so that SQLite never prefers the state index, which
    would read every active entry (10,000 in a busy queue manager).

    Grouping reorders, so it is only done when no entry appears twice; then
    each transition is its own statement, in order.

SEE ALSO
    sluice.store.sqlite (SqliteStore.apply_future)
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from sluice.model import IN_FLIGHT_STATES, parse_qid
from sluice.store import Transition
from sluice.store._sql import reply_columns

__all__ = ["KEYS_PER_STATEMENT", "grouped", "keys_where", "transition_sql"]

Key = tuple[str, int, str]  # spid, idx, qid


def grouped(transitions: Sequence[Transition], node: str
            ) -> list[tuple[str, tuple[Any, ...], list[Key]]]:
    """The statements that apply ``transitions``, each with its values and keys (module doc)."""
    keyed: list[tuple[str, tuple[Any, ...], str, int, str]] = []
    for t in transitions:
        spid, idx = parse_qid(t.qid)
        if idx is None:
            raise ValueError(f"a transition needs a full queue id, not {t.qid!r}")
        keyed.append((*transition_sql(t, node), spid, idx, t.qid))
    if len({(k[2], k[3]) for k in keyed}) < len(keyed):
        return [(st, params, [(spid, idx, qid)]) for st, params, spid, idx, qid in keyed]
    groups: dict[tuple[str, tuple[Any, ...]], list[Key]] = {}
    for statement, params, spid, idx, qid in keyed:
        groups.setdefault((statement, params), []).append((spid, idx, qid))
    return [(*key, keys) for key, keys in groups.items()]


#: Entries per grouped statement: one OR term each at most, far
#: below SQLite's limits on variables and expression depth.
KEYS_PER_STATEMENT = 200


def keys_where(keys: Sequence[Key]
                ) -> tuple[str, list[Any], dict[tuple[str, int], str]]:
    """A WHERE clause for these (spid, idx, qid) keys, its values, and the qid of each key.

    One ``spid = ? AND idx IN (...)`` term per message, OR'ed: SQLite looks
    each term up by the primary key (a row-value IN list made it scan an
    index instead).
    """
    by_spid: dict[str, list[int]] = {}
    qids: dict[tuple[str, int], str] = {}
    for spid, idx, qid in keys:
        by_spid.setdefault(spid, []).append(idx)
        qids[spid, idx] = qid
    terms: list[str] = []
    values: list[Any] = []
    for spid, idxs in by_spid.items():
        terms.append(f"(spid = ? AND idx IN ({','.join('?' * len(idxs))}))")
        values += (spid, *idxs)
    return " OR ".join(terms), values, qids


def transition_sql(t: Transition, node: str) -> tuple[str, tuple[Any, ...]]:
    """The statement that applies ``t`` up to its key condition, and its values.

    The statement ends inside its WHERE clause; the caller adds the keys
    (keys_where()).
    """
    cond = "WHERE 1"
    cparams: list[Any] = []
    if t.expect:
        # "+state": never look entries up by state here (thousands are
        # active), always by the keys the caller adds.
        cond = f"WHERE +state IN ({','.join('?' * len(t.expect))})"
        cparams.extend(str(s) for s in t.expect)
    if t.state is None:
        return f"DELETE FROM queue {cond}", tuple(cparams)
    sets = ["state = ?"]
    params: list[Any] = [str(t.state)]
    if t.next_attempt_at is not None:
        sets.append("next_attempt_at = ?")
        params.append(t.next_attempt_at)
    if t.reply is not None:
        sets += ["last_code = ?", "last_enhanced = ?", "last_text = ?",
                 "last_mta = ?", "last_attempt_at = ?"]
        params += reply_columns(t.reply)
    if t.attempted:
        sets.append("attempts = attempts + 1")
    sets.append("owner = ?")
    params.append(node if t.state in IN_FLIGHT_STATES else None)
    return f"UPDATE queue SET {', '.join(sets)} {cond}", (*params, *cparams)
