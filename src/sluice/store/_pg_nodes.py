"""The nodes of a cluster in PostgreSQL: heartbeats, and taking over a dead node's claims.

SUMMARY
    ensure(conn); heartbeat(conn, node, host, started_at, now)
    nodes(conn) -> list[NodeRow]
    take_over(conn, dead, now, older_than) -> list[QueueEntry]

DESCRIPTION
    Each node of a cluster that shares a queue on PostgreSQL writes its
    heartbeat into ``sluice_nodes`` every few seconds.  A node whose
    heartbeat is older than the cluster's ``node_lease`` is dead: any
    other node returns the entries it had claimed (``owner`` = its id, in
    state active or delivering) to the queue as deferred and due now, and
    removes its row.  The row is locked (FOR UPDATE SKIP LOCKED) and its
    age checked again in the same transaction, so one node does it once,
    and a node that comes back in the meantime keeps its claims.  The same
    DDL makes ``sluice_cluster_state``, the operator changes every node
    follows (sluice.cluster.shared_state).

    A node that comes back after it was taken over finds its row gone and
    writes a new one; the deliveries it still had in flight are then also
    the queue's again, so a message can be delivered twice -- never lost.

SEE ALSO
    sluice.store.postgres, sluice.cluster.agent, docs/cluster.md
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from sluice.model import QueueEntry
from sluice.store._sql import COLUMNS, entry

__all__ = ["DDL", "NodeRow", "ensure", "heartbeat", "nodes", "take_over"]

DDL = """
CREATE TABLE IF NOT EXISTS sluice_nodes (
    id           text PRIMARY KEY,
    host         text NOT NULL DEFAULT '',
    started_at   double precision NOT NULL,
    heartbeat_at double precision NOT NULL,
    limits       text NOT NULL DEFAULT 'shared'
);
CREATE SEQUENCE IF NOT EXISTS sluice_cluster_seq;
CREATE TABLE IF NOT EXISTS sluice_cluster_state (
    key     text PRIMARY KEY,
    seq     bigint NOT NULL,
    node    text NOT NULL,
    at      timestamptz NOT NULL DEFAULT now(),
    deleted boolean NOT NULL DEFAULT false,
    body    jsonb
);
"""


@dataclass(frozen=True, slots=True)
class NodeRow:
    """A node as the database knows it, with its claims in flight."""

    id: str
    host: str
    started_at: float
    heartbeat_at: float
    claims: int
    limits: str  # "shared" (through Redis) or "fallback" (its share, alone)


def ensure(conn: Any) -> None:
    conn.execute(DDL)


def heartbeat(conn: Any, node: str, host: str, started_at: float, now: float,
              limits: str = "shared") -> None:
    conn.execute(
        "INSERT INTO sluice_nodes (id, host, started_at, heartbeat_at, limits) "
        "VALUES (%s, %s, %s, %s, %s) "
        "ON CONFLICT (id) DO UPDATE SET host = EXCLUDED.host, "
        "started_at = EXCLUDED.started_at, heartbeat_at = EXCLUDED.heartbeat_at, "
        "limits = EXCLUDED.limits",
        (node, host, started_at, now, limits))


def nodes(conn: Any) -> list[NodeRow]:
    rows = conn.execute(
        "SELECT n.id, n.host, n.started_at, n.heartbeat_at, n.limits, "
        "(SELECT count(*) FROM sluice_queue q WHERE q.owner = n.id "
        " AND q.state IN ('active', 'delivering')) "
        "FROM sluice_nodes n ORDER BY n.id").fetchall()
    return [NodeRow(r[0], r[1], float(r[2]), float(r[3]), int(r[5]), r[4]) for r in rows]


def take_over(conn: Any, dead: str, now: float, older_than: float) -> list[QueueEntry]:
    """Return ``dead``'s claims to the queue if its heartbeat is still old.

    Old: before ``older_than``.  Returns the entries given back (as they
    are now).
    """
    row = conn.execute("SELECT heartbeat_at FROM sluice_nodes WHERE id = %s "
                       "FOR UPDATE SKIP LOCKED", (dead,)).fetchone()
    if row is None or float(row[0]) >= older_than:
        return []
    returned = conn.execute(
        "UPDATE sluice_queue SET state = 'deferred', next_attempt_at = %s, owner = NULL "
        "WHERE owner = %s AND state IN ('active', 'delivering') "
        f"RETURNING {COLUMNS}", (now, dead)).fetchall()
    conn.execute("DELETE FROM sluice_nodes WHERE id = %s", (dead,))
    return [entry(r) for r in returned]
