"""SharedLimits against a real Redis: leases, fair shares, dead nodes, GCRA dates."""

from __future__ import annotations

import asyncio
import itertools
import time

import pytest
import redis

from sluice.cluster._redisserver import RedisServer
from sluice.cluster.shared_limits import RedisForgot, SharedLimits
from sluice.scheduler import AcquireGrants, GrantRequest, Rate, ReturnGrants
from tests.integration.redis_srv import redis_server

__all__ = ["redis_server"]

pytestmark = pytest.mark.integration


def conc(key: str, limit: int, slots: int, in_use: int = 0) -> AcquireGrants:
    return AcquireGrants((GrantRequest(key, limit, None, None, slots, 0, in_use),))


def run(coro):  # type: ignore[no-untyped-def]
    return asyncio.run(coro)


def test_nodes_share_a_concurrency_and_dead_nodes_free_theirs(redis_server: RedisServer
                                                              ) -> None:
    async def go() -> None:
        a = SharedLimits(redis_server.url, "a")
        b = SharedLimits(redis_server.url, "b")
        try:
            (g,) = (await a.acquire(conc("k", 4, 4), lambda: 100.0)).grants
            assert (g.slots, g.share) == (4, 4)  # alone: all of it
            (g,) = (await b.acquire(conc("k", 4, 4), lambda: 100.0)).grants
            assert g.slots == 0 and g.share == 2 and g.retry_at is not None  # a holds 4
            (g,) = (await a.acquire(conc("k", 4, 4, in_use=4), lambda: 100.0)).grants
            assert (g.slots, g.share) == (4, 2)  # kept (in use), but its share is 2 now
            await a.give_back(ReturnGrants((("k", 2),)))
            (g,) = (await b.acquire(conc("k", 4, 4), lambda: 100.0)).grants
            assert g.slots == 2
            assert await a.in_use() == {"k": {"a": 2, "b": 2}}
            # a dies: its node key expires (deleted here, as its TTL would) ...
            raw = redis.Redis.from_url(redis_server.url)
            raw.delete("sluice:node:a")
            raw.close()
            (g,) = (await b.acquire(conc("k", 4, 4), lambda: 100.0)).grants
            assert g.slots == 2  # ... b's share is still 2 while a asked lately,
            assert await b.in_use() == {"k": {"b": 2}}  # but a's leases are gone
            assert "b" in await b.heartbeat()
        finally:
            await a.close()
            await b.close()
    run(go())


def test_pickup_dates_are_spaced_across_nodes(redis_server: RedisServer) -> None:
    async def go() -> None:
        a = SharedLimits(redis_server.url, "a", horizon_s=1.0)
        b = SharedLimits(redis_server.url, "b", horizon_s=1.0)
        req = AcquireGrants((GrantRequest("r", None, Rate(10, 1.0), None, 0, 6),))
        try:
            # Each node reads the dates on its own clock (here the same one), to
            # within the round trip.
            (ga,) = (await a.acquire(req, time.time)).grants
            (gb,) = (await b.acquire(req, time.time)).grants
            dates = sorted(ga.slot_ats + gb.slot_ats)
            # 10/s: 0.1 s apart, within a second ahead: 11 dates at most for both
            assert 10 <= len(dates) <= 11
            assert all(y - x >= 0.09 for x, y in itertools.pairwise(dates))
            assert ga.slot_ats[0] < gb.slot_ats[0]
            assert 0 < ga.use_within_s <= 0.05  # used within less than the spacing
            assert gb.retry_at is not None  # b got fewer than it asked for
        finally:
            await a.close()
            await b.close()
    run(go())


def test_an_unreachable_redis_raises_a_connection_error(redis_server: RedisServer) -> None:
    async def go() -> None:
        a = SharedLimits(redis_server.url, "a", timeout_s=0.5)
        try:
            assert await a.heartbeat() == ["a"]
            redis_server.kill()
            with pytest.raises((redis.ConnectionError, redis.TimeoutError, OSError)):
                await a.acquire(conc("k", 1, 1), lambda: 0.0)
            assert not await a.ping()
            await a.reconnect()  # the agent fell back
            redis_server.run()
            assert await a.heartbeat() == ["a"]  # back, empty: the node renews itself
        finally:
            await a.close()
    run(go())


def test_after_a_redis_restart_the_first_calls_meet_the_new_redis(redis_server: RedisServer
                                                                 ) -> None:
    # Two nodes deliver under a limit of 3 (a: 2, b: 1), each with two pooled
    # connections idle when Redis restarts empty.  No call fails on a
    # connection made to the old Redis; a node that did not notice the
    # restart hears once that Redis forgot it; the leases come back for the
    # deliveries in flight, and no more than the limit in all.
    def clock() -> float:
        return 100.0

    async def both(node: SharedLimits, in_use: int) -> int:
        _, answer = await asyncio.gather(node.heartbeat(),
                                         node.acquire(conc("k", 3, in_use, in_use), clock))
        return answer.grants[0].slots

    async def go() -> None:
        a = SharedLimits(redis_server.url, "a")
        b = SharedLimits(redis_server.url, "b")
        try:
            assert (await both(a, 2), await both(b, 1)) == (2, 1)
            await asyncio.to_thread(redis_server.restart)  # the nodes' loop runs meanwhile
            with pytest.raises(RedisForgot):  # not "Connection closed by server"
                await a.acquire(conc("k", 3, 2, 2), clock)
            await b.reconnect()  # b noticed the outage (its agent fell back): no error
            assert await b.heartbeat() == ["a", "b"]
            for _ in range(5):
                assert (await both(a, 2), await both(b, 1)) == (2, 1)
            assert await a.in_use() == {"k": {"a": 2, "b": 1}}
        finally:
            await a.close()
            await b.close()
    run(go())


def test_a_new_node_is_not_forgotten_when_its_first_answers_cross(redis_server: RedisServer
                                                                  ) -> None:
    # A node's heartbeat and its first request go out together (two tasks of
    # its agent).  Redis runs the heartbeat first, before any script has
    # set the node's key, and its answer comes back after the request's: the
    # node never was known to this Redis when it sent it, so that is no
    # "Redis forgot us" (in CI it made a starting node fall back at once).
    def clock() -> float:
        return 100.0

    async def go() -> None:
        a = SharedLimits(redis_server.url, "fresh")
        answered = asyncio.Event()
        script = a._heartbeat

        async def late_heartbeat(args: list[str]) -> list[object]:
            out: list[object] = await script(args=args)  # run now, answered later
            await answered.wait()
            return out

        a._heartbeat = late_heartbeat  # type: ignore[assignment]

        async def request() -> int:
            await asyncio.sleep(0.05)  # after the heartbeat ran
            answer = await a.acquire(conc("k", 3, 1), clock)
            answered.set()
            return answer.grants[0].slots

        try:
            live, slots = await asyncio.gather(a.heartbeat(), request())
            assert live == ["fresh"] and slots == 1
        finally:
            await a.close()
    run(go())
