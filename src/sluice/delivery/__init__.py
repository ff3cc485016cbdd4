"""Delivery: routing, the SMTP/LMTP client with connection reuse, and the hooks around them.

SUMMARY
    router = Router.from_config(config)
    agent = DeliveryAgent.from_config(config)
    planner = Planner(router, Hooks.from_config(config))

    plan = await planner.plan(entries)                  # pre-hook, routing, grouping
    result = await agent.deliver(DeliveryRequest(job.route, job.entries,
                                                 opener, localip))
    queue.record(await planner.finish(result))          # post-hook, then the store

DESCRIPTION
    sluice.delivery.router     NextHop by transport map or DNS (MX, A/AAAA)
    sluice.delivery.agent      one message to one next hop, sessions reused
    sluice.delivery.request    what the agent takes and gives back
    sluice.delivery.pool       idle sessions kept for the next message
    sluice.delivery.client     the SMTP/LMTP protocol on asyncio (pipelined)
    sluice.delivery.replies    the server's replies, parsed as they arrive
    sluice.delivery.encoder    CRLF, dot-stuffing and the final dot, streamed
    sluice.delivery.plan       the hooks and grouping around routing/delivery
    sluice.delivery.transport  transport(5) map syntax

SEE ALSO
    docs/delivery.md
"""

from sluice.delivery.agent import (
    AgentStats,
    DeliveryAgent,
    DeliveryRequest,
    DeliveryResult,
    outcome_of,
)
from sluice.delivery.encoder import DataEncoder, encode_stream
from sluice.delivery.plan import Job, Plan, Planner, Settled
from sluice.delivery.router import Host, NextHop, Router
from sluice.delivery.transport import TransportEntry, TransportMap, TransportMapError

__all__ = [
    "AgentStats",
    "DataEncoder",
    "DeliveryAgent",
    "DeliveryRequest",
    "DeliveryResult",
    "Host",
    "Job",
    "NextHop",
    "Plan",
    "Planner",
    "Router",
    "Settled",
    "TransportEntry",
    "TransportMap",
    "TransportMapError",
    "encode_stream",
    "outcome_of",
]
