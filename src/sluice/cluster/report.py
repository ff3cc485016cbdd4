"""What a cluster looks like from one node: nodes, heartbeats, claims, leases, reachability.

SUMMARY
    data = await cluster_report(config, agent=None)

DESCRIPTION
    Reads what the nodes write -- ``sluice_nodes`` in the postgres queue,
    the node keys and leases in Redis -- without joining the cluster (no
    heartbeat, no lease).  ``sluice cluster status`` prints it; the REST
    API serves it at GET /api/v1/cluster with the running node's own view
    (``agent``: shared or fallen back, take-overs) added under ``this``.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
from typing import Any

from sluice.cluster.shared_limits import SharedLimits
from sluice.config import Config

__all__ = ["cluster_report"]


async def cluster_report(config: Config, agent: Any = None) -> dict[str, Any]:
    """The cluster as plain data (see the module doc)."""
    out: dict[str, Any] = {"node": config.node.id, "redis": None, "postgres": None,
                           "nodes": {}, "leases": {}}
    if config.queue.store == "postgres":
        store = getattr(agent, "nodes_store", None)  # the running node's: no new pool
        out["postgres"] = await asyncio.to_thread(_postgres, config, out["nodes"], store)
    shared = SharedLimits.from_config(config)
    if shared is not None:
        out["redis"] = await _redis(shared, out)
    if agent is not None:
        out["this"] = dataclasses.asdict(agent.status())
    return out


def _postgres(config: Config, nodes: dict[str, Any], running: Any = None) -> dict[str, Any]:
    from sluice.store.postgres import PgStore

    store = running
    try:
        if store is None:
            store = PgStore.from_config(config)
    except Exception as exc:  # unreachable, refused: say so
        return {"reachable": False, "error": str(exc).splitlines()[0]}
    try:
        now = time.time()
        for row in store.nodes():
            nodes.setdefault(row.id, {}).update(
                host=row.host, heartbeat_age_s=round(now - row.heartbeat_at, 1),
                alive=now - row.heartbeat_at < config.cluster.node_lease,
                claims=row.claims, limits=row.limits,
                up_s=round(now - row.started_at, 1))
    except Exception as exc:
        return {"reachable": False, "error": str(exc).splitlines()[0]}
    finally:
        if running is None:
            store.close()
    return {"reachable": True}


async def _redis(shared: SharedLimits, out: dict[str, Any]) -> dict[str, Any]:
    try:
        if not await shared.ping():
            return {"reachable": False, "url": _masked(shared.url)}
        for node, age in (await shared.nodes_seen()).items():
            out["nodes"].setdefault(node, {})["redis_heartbeat_age_s"] = round(age, 1)
        out["leases"] = await shared.in_use()
        return {"reachable": True, "url": _masked(shared.url)}
    finally:
        await shared.close()


def _masked(url: str) -> str:
    if "@" in url:
        scheme, _, rest = url.partition("://")
        return f"{scheme}://***@{rest.rpartition('@')[2]}"
    return url


