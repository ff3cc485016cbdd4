"""Operator changes reach the other nodes through PostgreSQL (a real server)."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from sluice.cluster.shared_state import SharedState, encode
from sluice.scheduler import (
    ConditionAdded,
    ConditionRemoved,
    Event,
    PolicyReloaded,
    SuspensionAdded,
    SuspensionRemoved,
    parse_policy,
)
from sluice.scheduler.policy_parse import parse_suspension
from sluice.store.postgres import PgStore
from tests.integration.pg import dsn_for

pytestmark = pytest.mark.integration

POLICY = parse_policy([{"id": "dom", "fields": ["recipientdomain"], "concurrency": 5}])


def test_changes_reach_the_other_node_and_a_newcomer_finds_them(tmp_path: Path) -> None:
    dsn = dsn_for(tmp_path)
    PgStore(dsn, node_id="a").close()  # the queue's tables, the cluster's with them
    a, b = SharedState(dsn, "a"), SharedState(dsn, "b")
    seen: list[Event] = []
    cond = parse_policy([{"id": "dom", "fields": ["recipientdomain"],
                          "if": {"id": "slow", "recipientdomain": "x.example",
                                 "concurrency": 1}}]).counters[0].conditions[0]
    changes: list[Event] = [
        SuspensionAdded(parse_suspension({"id": "s1", "recipientdomain": "x.example",
                                          "reason": "incident"})),
        ConditionAdded("dom", cond, 0),
        SuspensionAdded(parse_suspension({"id": "s2", "tenantid": "acme"})),
        SuspensionRemoved("s2"),
    ]

    async def go() -> None:
        stop = asyncio.Event()
        follower = asyncio.create_task(b.follow(seen.append, stop))
        await asyncio.wait_for(b.following.wait(), 30)
        for event in changes:
            await asyncio.to_thread(a.publish, *encode(event, POLICY))
        for _ in range(100):
            if len(seen) >= len(changes):
                break
            await asyncio.sleep(0.05)
        stop.set()
        await follower

    asyncio.run(go())
    assert seen == changes  # in order, each once, none of b's own
    # A node that starts later finds the live state: s1 and the condition
    # (s2 was added and removed: nothing of it).
    assert follow_until(dsn, "c") == changes[:2]
    # Installing a policy removes the conditions added at run time, for all.
    a.publish(*encode(PolicyReloaded(POLICY), POLICY))
    last = follow_until(dsn, "d")
    assert [type(e) for e in last] == [SuspensionAdded, PolicyReloaded]
    assert ConditionRemoved not in [type(e) for e in last]


def follow_until(dsn: str, node: str) -> list[Event]:
    """What a node that starts now applies when it first catches up."""
    got: list[Event] = []

    async def run() -> None:
        stop = asyncio.Event()
        state = SharedState(dsn, node)
        task = asyncio.create_task(state.follow(got.append, stop))
        await asyncio.wait_for(state.following.wait(), 30)
        stop.set()
        await task

    asyncio.run(run())
    return got
