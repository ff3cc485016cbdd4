"""`sluice cluster status`: the nodes, their heartbeats and claims, Redis and PostgreSQL.

Reads what the nodes write (sluice_nodes in the postgres queue; the node
keys and leases in Redis) without joining the cluster: the command sends no
heartbeat and takes no lease.
"""

from __future__ import annotations

import argparse
import asyncio
import json
from typing import Any

from sluice.cli import CommandError, load
from sluice.cluster.report import cluster_report
from sluice.cluster.shared_limits import SharedLimits


def register(sub: Any) -> None:
    """Add `sluice cluster` to the command line."""
    p = sub.add_parser("cluster", help="the nodes sharing this queue and these limits")
    csub = p.add_subparsers(dest="cluster_command", metavar="ACTION")
    csub.required = True
    status = csub.add_parser("status", help="nodes, heartbeat ages, claims in flight, "
                                            "shared counters, Redis and PostgreSQL")
    status.add_argument("--json", action="store_true", help="one JSON document")
    status.set_defaults(func=cmd_status)


def cmd_status(args: argparse.Namespace) -> int:
    """`sluice cluster status`: nodes, their claims, shared counters, Redis and PostgreSQL."""
    config = load(args)
    if config.queue.store != "postgres" and SharedLimits.from_config(config) is None:
        raise CommandError(f"{config.source}: not a cluster: neither cluster.redis nor a "
                           "postgres queue is configured", 2)
    data = asyncio.run(cluster_report(config))
    if args.json:
        print(json.dumps(data, indent=2, sort_keys=True))
        return 0
    pg, rd = data["postgres"], data["redis"]
    print(f"PostgreSQL: {_reach(pg)}    Redis: {_reach(rd)}")
    rows = [("node", "limits", "heartbeat", "redis beat", "claims", "up")]
    for name, n in sorted(data["nodes"].items()):
        beat = n.get("heartbeat_age_s")
        rows.append((name + (" (this config)" if name == data["node"] else ""),
                     n.get("limits", "-") if n.get("alive", True) else "dead",
                     "-" if beat is None else f"{beat:.1f} s ago",
                     "-" if "redis_heartbeat_age_s" not in n
                     else f"{n['redis_heartbeat_age_s']:.1f} s ago",
                     str(n.get("claims", "-")),
                     "-" if "up_s" not in n else f"{n['up_s']:.0f} s"))
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    for r in rows:
        print("  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip())
    leases = data["leases"]
    if leases:
        print(f"shared counters in use: {len(leases)}")
        for key, by_node in sorted(leases.items())[:20]:
            held = ", ".join(f"{n}={c}" for n, c in sorted(by_node.items()))
            print(f"  {key.replace(chr(31), ' ')}: {held}")
    return 0


def _reach(part: dict[str, Any] | None) -> str:
    if part is None:
        return "not configured"
    if part.get("reachable"):
        return "reachable"
    return "UNREACHABLE" + (f" ({part['error']})" if part.get("error") else "")
