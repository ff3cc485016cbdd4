"""Operator changes for every node: suspensions, conditions and policy through PostgreSQL.

SUMMARY
    state = SharedState(dsn, node_id)
    state.publish(event)                 an operator change made on this node
    await state.follow(apply, stop)      apply the other nodes' changes, as they come

DESCRIPTION
    A suspension, a condition added at run time or a policy installed
    through the REST API or the CLI on one node must hold on every node;
    so must the suspensions and conditions a shaping rule adds and ends
    (both come through QueueManager.share).
    The cluster's queue is in PostgreSQL already, so the changes go there:
    one row per piece of shared state in ``sluice_cluster_state`` (key
    ``suspension:<id>``, ``condition:<counter>:<id>`` or ``policy``; the
    table is made with the queue's, sluice.store._pg_nodes), each
    write numbered from one sequence and announced with ``NOTIFY
    sluice_cluster``.  Every node LISTENs, reads the rows numbered after the
    last it saw, and applies those another node wrote.  A removal leaves a
    tombstone row, so that a node that was away sees it.

    Why PostgreSQL and not Redis pub/sub: the changes must survive what
    Redis does not keep (Redis runs without persistence here, and pub/sub
    drops what a disconnected node misses), and a node that starts or
    reconnects must find the whole state, which a table gives by reading it.

STRATEGIES
    Applied, never audited: a change from another node goes to the
    scheduler only (QueueManager.change with publish=False); the node
    that made it wrote its audit record.

    Full resync on (re)connect: a node that (re)connects reads every row
    and applies the live ones (its own too, after a restart: they are the
    cluster's state, its file is not).  Changes are idempotent: a
    suspension or condition with the same id replaces the old one.
    Installing a policy removes every condition row in the same
    transaction, since the new policy replaces them on every node.

LIMITATIONS
    Only with the postgres queue: nodes with queues of their own share
    their limits through Redis, but not operator changes.  A policy file
    changed on one node's disk is that node's; install it through the API
    (``sluice policy reload`` on the node) to give it to all.

SEE ALSO
    sluice.cluster.agent, docs/cluster.md
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Callable
from typing import Any

import psycopg

from sluice.cluster import one_line, wait_stop
from sluice.scheduler.events import (
    ConditionAdded,
    ConditionRemoved,
    Event,
    PolicyReloaded,
    SuspensionAdded,
    SuspensionRemoved,
)
from sluice.scheduler.policy import Policy
from sluice.scheduler.policy_parse import parse_policy, parse_suspension

__all__ = ["SHARED_EVENTS", "SharedState", "decode", "encode"]

log = logging.getLogger("sluice.cluster")

SHARED_EVENTS = (SuspensionAdded, SuspensionRemoved, ConditionAdded, ConditionRemoved,
                 PolicyReloaded)

CHANNEL = "sluice_cluster"


def encode(event: Event, policy: Policy) -> tuple[str, dict[str, Any] | None]:
    """The row key of an operator change and its body (None: a removal).

    ``policy`` is the running one (a condition's counter's fields).
    """
    match event:
        case SuspensionAdded(suspension=s):
            return f"suspension:{s.id}", {"suspension": s.to_data()}
        case SuspensionRemoved(suspension_id=sid):
            return f"suspension:{sid}", None
        case ConditionAdded(counter_id=cid, condition=cond, position=pos):
            counter = policy.counter(cid)
            return f"condition:{cid}:{cond.id}", {
                "counter": cid, "fields": [f.to_data() for f in counter.fields],
                "position": pos, "condition": cond.to_data()}
        case ConditionRemoved(counter_id=cid, condition_id=cond_id):
            return f"condition:{cid}:{cond_id}", None
        case PolicyReloaded(policy=p):
            return "policy", {"policy": p.to_data(), "source": p.source}
    raise TypeError(f"{type(event).__name__} is not shared")


def decode(key: str, body: dict[str, Any] | None) -> Event:
    """The operator change a row holds."""
    kind, _, rest = key.partition(":")
    if kind == "suspension":
        if body is None:
            return SuspensionRemoved(rest)
        return SuspensionAdded(parse_suspension(body["suspension"], source="cluster"))
    if kind == "condition":
        cid, _, cond_id = rest.partition(":")
        if body is None:
            return ConditionRemoved(cid, cond_id)
        counter = {"id": cid, "fields": body["fields"], "conditions": [body["condition"]]}
        parsed = parse_policy({"policies": [counter]}, source="cluster")
        return ConditionAdded(cid, parsed.counters[0].conditions[0], int(body["position"]))
    if kind == "policy" and body is not None:
        return PolicyReloaded(parse_policy(body["policy"], source=str(body.get("source")
                                                                         or "cluster")))
    raise ValueError(f"unknown shared state row {key!r}")


class SharedState:
    """This node's end of the cluster's shared operator state."""

    def __init__(self, dsn: str, node_id: str, *, connect_timeout_s: float = 5.0) -> None:
        self.dsn = dsn
        self.node_id = node_id
        self.connect_timeout_s = connect_timeout_s
        self.seen = 0  # the last sequence number applied
        self.applied = 0  # changes of other nodes applied (for status)
        self.following = asyncio.Event()  # set once listening and caught up

    def _connect(self) -> psycopg.Connection[Any]:
        return psycopg.connect(self.dsn, autocommit=True,
                               connect_timeout=max(1, int(self.connect_timeout_s)))

    def publish(self, key: str, body: dict[str, Any] | None) -> None:
        """Write one change and announce it (blocking: run it in a thread)."""
        with self._connect() as conn, conn.transaction():
            if key == "policy":  # the new policy replaces conditions added at run time
                conn.execute(
                    "UPDATE sluice_cluster_state SET deleted = true, body = NULL, node = %s, "
                    "seq = nextval('sluice_cluster_seq'), at = now() "
                    "WHERE key LIKE 'condition:%%' AND NOT deleted", (self.node_id,))
            conn.execute(
                "INSERT INTO sluice_cluster_state (key, seq, node, deleted, body) "
                "VALUES (%s, nextval('sluice_cluster_seq'), %s, %s, %s) "
                "ON CONFLICT (key) DO UPDATE SET seq = EXCLUDED.seq, node = EXCLUDED.node, "
                "deleted = EXCLUDED.deleted, body = EXCLUDED.body, at = now()",
                (key, self.node_id, body is None,
                 None if body is None else json.dumps(body)))
            conn.execute(f"NOTIFY {CHANNEL}")
            # Tombstones only need to outlive a node's absence.
            conn.execute("DELETE FROM sluice_cluster_state WHERE deleted "
                         "AND at < now() - interval '7 days'")

    async def follow(self, apply: Callable[[Event], None], stop: asyncio.Event) -> None:
        """Apply the other nodes' changes until ``stop``.

        Reconnects (with a full resync) whenever the connection is lost.
        """
        first = True
        while not stop.is_set():
            try:
                conn = await psycopg.AsyncConnection.connect(
                    self.dsn, autocommit=True,
                    connect_timeout=max(1, int(self.connect_timeout_s)))
            except psycopg.Error as exc:
                log.warning("cluster: cannot follow shared changes: %s", one_line(exc))
                await wait_stop(stop, 2.0)
                continue
            try:
                async with conn:
                    await conn.execute(f"LISTEN {CHANNEL}")
                    await self._catch_up(conn, apply, resync=True, own=first)
                    first = False
                    self.following.set()
                    while not stop.is_set():
                        async for _ in conn.notifies(timeout=1.0):
                            break
                        await self._catch_up(conn, apply, resync=False, own=False)
            except psycopg.Error as exc:
                log.warning("cluster: lost the shared changes' connection (%s); "
                            "reconnecting", one_line(exc))
                await wait_stop(stop, 1.0)

    async def _catch_up(self, conn: psycopg.AsyncConnection[Any], apply: Callable[[Event], None],
                        *, resync: bool, own: bool) -> None:
        after = 0 if resync else self.seen
        cur = await conn.execute(
            "SELECT key, seq, node, deleted, body FROM sluice_cluster_state "
            "WHERE seq > %s ORDER BY seq", (after,))
        for key, seq, node, deleted, body in await cur.fetchall():
            if seq <= self.seen and not resync:
                continue
            fresh = seq > self.seen
            self.seen = max(self.seen, seq)
            if node == self.node_id and not own:
                continue  # ours: applied when it was made
            if deleted and (not fresh or after == 0):
                continue  # an old removal: nothing of it is left to remove
            try:
                apply(decode(key, None if deleted else body))
                self.applied += 1
            except (ValueError, KeyError) as exc:
                log.warning("cluster: change %s from node %s not applied: %s", key, node,
                            one_line(exc))

