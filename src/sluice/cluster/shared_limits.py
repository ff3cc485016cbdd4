"""The cluster's shared limits in Redis: concurrency leases and GCRA pickup dates.

SUMMARY
    shared = SharedLimits.from_config(config)      (or SharedLimits(url, node_id))
    await shared.heartbeat()                        renew this node and its leases
    answer = await shared.acquire(AcquireGrants(...), now)   -> GrantsChanged
    await shared.give_back(ReturnGrants(...))
    await shared.nodes() -> list of live node ids (sorted)
    await shared.reconnect()                        after an outage: Redis may be a new one

DESCRIPTION
    The scheduler's ClusterLimits asks for capacity with AcquireGrants and
    gives leases back with ReturnGrants (sluice.scheduler.cluster); this
    module answers them from Redis, one Lua script call per command, so a
    batch of requests costs one round trip and every decision is atomic
    across nodes.  Keys (all under ``prefix``, default ``sluice:``):

        node:<id>          exists while the node lives (PX lease_ttl, renewed
                           by heartbeat()); leases of a node whose key is gone
                           are dropped by the next acquire that sees them
        nodes              sorted set: node id -> last heartbeat (ms)
        lease:<key>        hash: node id -> concurrency leases held
        ask:<key>          hash: node id -> when it last asked (ms)
        gcra:<key>         the theoretical arrival time (ms) of the entry

STRATEGIES
    Fair shares.  The nodes that asked for an entry within ``want_window``
    share its concurrency: L // n each, one more for the first L % n of
    them in id order.  A node is granted up to its share of what is free,
    and never less than it holds (only the node gives leases back, after
    its deliveries end, so no answer races a delivery); its share comes
    with the answer,
    and it gives back what it holds above it as its deliveries end.  A node
    granted less than it asked asks again after ``retry`` (it stays among
    the wanting nodes by doing so).

    GCRA for rate and connectinterval.  Pickups are handed out at dates
    spaced Y/X apart (the larger of that and the interval) from the
    entry's theoretical arrival time, never more than ``horizon`` ahead;
    the node uses each within ``use_within`` of its date (half the
    spacing), so any window of Y seconds holds at most X + 1 pickups of
    the whole cluster.  ``use_within`` is never under 5 ms (a node's step
    takes about that): above 100 pickups a second per entry the bound
    loosens by one pickup per spacing in 5 ms (0.5 % at 1,000/s).  Dates
    travel in Redis's clock, so the nodes' clocks need not agree; a node
    reads them on its own clock through the offset measured in the quickest
    of its last round trips (Redis's time against the middle of the trip,
    as NTP does), so that a late answer does not move them; the other half
    of the spacing absorbs what error is left.

    Say when Redis forgot us.  Every script first checks this node's key.
    If it is gone while Redis should know the node (it answered since the
    last reconnect()), Redis restarted empty, or the node was silent for
    a lease: the leases this node holds, and the deliveries they cover,
    are no longer counted there.  The call then raises RedisForgot (after
    renewing the key), which the agent takes as an outage: it falls back
    and comes back through the transition that hands over the deliveries
    in flight first.  So a restart quicker than any command noticed is not
    missed.

    Connections made to an old Redis are not reused.  redis-py 8.1.0 with
    RESP3 (its default) hands out a pooled connection that the server
    closed while it sat idle, when maintenance notifications are "auto"
    (redis-py issue 4252): the first command after a Redis restart then
    fails with "Connection closed by server", a spurious second outage.
    Maintenance notifications (a Redis Enterprise feature) are turned off
    here, which restores the pool's check; and reconnect() closes every
    idle pooled connection as well, whatever the client version does.

LIMITATIONS
    One Redis (a primary, with replicas for failover if wanted), not Redis
    Cluster: the scripts touch keys they compute.  A date a node does not
    use is lost to everyone (the rate is then a little lower, never higher).

SEE ALSO
    sluice.scheduler.cluster, sluice.cluster.agent, docs/cluster.md
"""

from __future__ import annotations

import os
import ssl
from collections import deque
from collections.abc import Callable
from typing import Any

import redis.asyncio as aioredis
from redis.exceptions import RedisError
from redis.maint_notifications import MaintNotificationsConfig

from sluice.config import Config
from sluice.scheduler.events import AcquireGrants, Grant, GrantsChanged, ReturnGrants

__all__ = ["ENV_PASSWORD", "ENV_URL", "RedisForgot", "SharedLimits"]

ENV_URL = "SLUICE_REDIS_URL"  # also read by sluice.cluster.enabled
ENV_PASSWORD = "SLUICE_REDIS_PASSWORD"

# KEYS: none (the keys are computed; see LIMITATIONS).
# ARGV: prefix, node, lease_ttl_ms, want_window_ms, horizon_ms, retry_ms, max_use_within_ms,
#       min_use_within_ms,
#       then per request: key, concurrency (-1: none), spacing_ms (0: none), slots, pickups,
#       in_use.
# (spacing_ms may have a fraction: 1000/30 is not 33.)
# Returns whether the node's key was there (1/0), Redis's now (microseconds), then per
# request: slots, share (-1: none), retry_ms (-1: none), use_within_us, n, then n dates as
# microseconds from Redis's now.
_ACQUIRE = """
local p, node = ARGV[1], ARGV[2]
local ttl, window, horizon = tonumber(ARGV[3]), tonumber(ARGV[4]), tonumber(ARGV[5])
local retry_ms, max_within = tonumber(ARGV[6]), tonumber(ARGV[7])
local min_within = tonumber(ARGV[8])
-- Requests begin after the eight arguments above.
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local known = redis.call('EXISTS', p .. 'node:' .. node)
redis.call('SET', p .. 'node:' .. node, now, 'PX', ttl)
redis.call('ZADD', p .. 'nodes', now, node)
local out = {known, tonumber(t[1]) * 1000000 + tonumber(t[2])}
local i = 9
while i <= #ARGV do
  local key, conc, spacing = ARGV[i], tonumber(ARGV[i + 1]), tonumber(ARGV[i + 2])
  local want, pickups, in_use = tonumber(ARGV[i + 3]), tonumber(ARGV[i + 4]), tonumber(ARGV[i + 5])
  i = i + 6
  local slots, share, retry, within = 0, -1, -1, 0
  if conc >= 0 then
    local lk, ak = p .. 'lease:' .. key, p .. 'ask:' .. key
    local held = redis.call('HGETALL', lk)
    local others, mine = 0, 0
    for j = 1, #held, 2 do
      local who = held[j]
      if who == node then
        mine = tonumber(held[j + 1])
      else
        if redis.call('EXISTS', p .. 'node:' .. who) == 1 then
          others = others + tonumber(held[j + 1])
        else
          redis.call('HDEL', lk, who)
        end
      end
    end
    redis.call('HSET', ak, node, now)
    local asks = redis.call('HGETALL', ak)
    local wanting = {}
    for j = 1, #asks, 2 do
      if tonumber(asks[j + 1]) > now - window then
        table.insert(wanting, asks[j])
      else
        redis.call('HDEL', ak, asks[j])
      end
    end
    table.sort(wanting)
    local rank = 0
    for j = 1, #wanting do if wanting[j] == node then rank = j - 1 end end
    local n = #wanting
    share = math.floor(conc / n)
    if rank < conc % n then share = share + 1 end
    -- Never less than the node holds: it gives leases back itself, in order.
    slots = math.max(mine, in_use, math.min(want, share, conc - others))
    if slots > 0 then redis.call('HSET', lk, node, slots) else redis.call('HDEL', lk, node) end
    redis.call('PEXPIRE', lk, ttl * 4)
    redis.call('PEXPIRE', ak, ttl * 4)
    if slots < want then retry = retry_ms end
  end
  local dates = {}
  if spacing > 0 and pickups > 0 then
    local gk = p .. 'gcra:' .. key
    local tat = tonumber(redis.call('GET', gk) or '0')
    if tat < now then tat = now end
    for _ = 1, pickups do
      if tat > now + horizon then break end
      table.insert(dates, math.floor(tat * 1000))  -- microseconds, Redis's clock
      tat = tat + spacing
    end
    redis.call('SET', gk, tat, 'PX', math.ceil(math.max(ttl, tat - now + ttl)))
    if #dates == 0 then
      retry = math.ceil(tat - horizon - now)
    elseif #dates < pickups and retry < 0 then
      retry = math.ceil(tat - horizon - now)
    end
    within = math.floor(math.max(min_within, math.min(max_within, spacing * 0.5)) * 1000)
  end
  table.insert(out, slots)
  table.insert(out, share)
  table.insert(out, retry)
  table.insert(out, within)
  table.insert(out, #dates)
  for _, d in ipairs(dates) do table.insert(out, d) end
end
return out
"""

# ARGV: prefix, node, then pairs of key, count.
_RETURN = """
local p, node = ARGV[1], ARGV[2]
for i = 3, #ARGV, 2 do
  local lk = p .. 'lease:' .. ARGV[i]
  local left = redis.call('HINCRBY', lk, node, -tonumber(ARGV[i + 1]))
  if left <= 0 then redis.call('HDEL', lk, node) end
end
return 0
"""

# ARGV: prefix, node, lease_ttl_ms.  Returns whether the node's key was there (1/0), then
# the live nodes, in id order.
_HEARTBEAT = """
local p, node, ttl = ARGV[1], ARGV[2], tonumber(ARGV[3])
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local known = redis.call('EXISTS', p .. 'node:' .. node)
redis.call('SET', p .. 'node:' .. node, now, 'PX', ttl)
redis.call('ZADD', p .. 'nodes', now, node)
redis.call('ZREMRANGEBYSCORE', p .. 'nodes', '-inf', now - ttl)
local live = redis.call('ZRANGE', p .. 'nodes', 0, -1)
table.sort(live)
table.insert(live, 1, known)
return live
"""


class RedisForgot(RedisError):
    """Redis no longer knows this node (restarted empty, or the node's key expired)."""


class SharedLimits:
    """This node's client of the cluster's limits in Redis."""

    def __init__(self, url: str, node_id: str, *, password: str | None = None,
                 ca: str | None = None, lease_ttl_s: float = 30.0, prefix: str = "sluice:",
                 timeout_s: float = 2.0, want_window_s: float = 2.0, horizon_s: float = 1.0,
                 retry_s: float = 0.25, max_use_within_s: float = 0.5,
                 min_use_within_s: float = 0.005) -> None:
        self.url = url
        self.node_id = node_id
        self.prefix = prefix
        self.lease_ttl_s = lease_ttl_s
        self.timeout_s = timeout_s
        self._samples: deque[tuple[float, float]] = deque(maxlen=32)  # (delay, offset)
        self._args = [prefix, node_id, str(int(lease_ttl_s * 1000)),
                      str(int(want_window_s * 1000)), str(int(horizon_s * 1000)),
                      str(int(retry_s * 1000)), str(int(max_use_within_s * 1000)),
                      repr(min_use_within_s * 1000)]
        kwargs: dict[str, Any] = {
            "socket_timeout": timeout_s, "socket_connect_timeout": timeout_s,
            "decode_responses": True,
            # Off: with it ("auto" under RESP3) redis-py 8.1.0 reuses pooled
            # connections the server closed (see "Connections made to an old Redis").
            "maint_notifications_config": MaintNotificationsConfig(enabled=False)}
        if password:
            kwargs["password"] = password
        if url.startswith("rediss://"):
            kwargs["ssl_cert_reqs"] = ssl.CERT_REQUIRED
            if ca:
                kwargs["ssl_ca_certs"] = ca
        self.client = aioredis.Redis.from_url(url, **kwargs)
        self._acquire = self.client.register_script(_ACQUIRE)
        self._return = self.client.register_script(_RETURN)
        self._heartbeat = self.client.register_script(_HEARTBEAT)
        self._known = False  # Redis should know this node: it answered since reconnect()

    @classmethod
    def from_config(cls, config: Config) -> SharedLimits | None:
        """The shared limits the configuration names (None: not a cluster)."""
        c = config.cluster
        url = os.environ.get(ENV_URL) or c.redis
        if not url:
            return None
        password = os.environ.get(ENV_PASSWORD) or c.redis_password
        return cls(url, config.node.id, password=password, ca=c.redis_ca,
                   lease_ttl_s=c.lease_ttl)

    async def heartbeat(self) -> list[str]:
        """Renew this node (and so its leases); the live nodes in id order."""
        expected = self._known
        known, *live = await self._heartbeat(args=[*self._args[:2], self._args[2]])
        self._check_known(expected, int(known))
        return [str(n) for n in live]

    def _check_known(self, expected: bool, known: int) -> None:
        """Raise RedisForgot if this node's key was gone while Redis should have it.

        ``expected``: whether Redis should have known the node when the call
        was sent.  Not when it was answered: a heartbeat and a request sent
        together before the first answer may be answered in either order,
        and the one Redis ran first rightly found no key.
        """
        self._known = True
        if expected and not known:
            raise RedisForgot(f"Redis no longer knows node {self.node_id!r}: restarted empty, "
                              "or the node's key expired")

    async def reconnect(self) -> None:
        """Forget the old Redis after an outage; idle pooled connections close.

        Redis may be a new one, which does not know this node (no
        RedisForgot for that), and the idle pooled connections were made to
        the old one.
        """
        self._known = False
        await self.client.connection_pool.disconnect(inuse_connections=False)

    async def acquire(self, cmd: AcquireGrants, clock: Callable[[], float]) -> GrantsChanged:
        """Ask for every request of ``cmd``; the answer in this node's time.

        Times are ``clock``'s, through the measured offset of the two clocks.
        """
        args = list(self._args)
        for r in cmd.requests:
            spacing = 0.0
            if r.rate is not None:
                spacing = r.rate.per_s / r.rate.count
            if r.interval_s:
                spacing = max(spacing, r.interval_s)
            args += [r.key, str(-1 if r.concurrency is None else r.concurrency),
                     repr(spacing * 1000), str(r.slots), str(r.pickups), str(r.in_use)]
        sent, expected = clock(), self._known
        raw = [int(x) for x in await self._acquire(args=args)]
        received = clock()
        self._check_known(expected, raw[0])
        offset = self._offset(raw[1] / 1e6, sent, received)
        now = received
        grants = []
        pos = 2
        for r in cmd.requests:
            slots, share, retry, within, n = raw[pos:pos + 5]
            dates = tuple(d / 1e6 - offset for d in raw[pos + 5:pos + 5 + n])
            pos += 5 + n
            grants.append(Grant(r.key, slots, dates, within / 1e6,
                                None if retry < 0 else now + retry / 1000,
                                None if share < 0 else share))
        return GrantsChanged(tuple(grants))

    def _offset(self, redis_now: float, sent: float, received: float) -> float:
        """Redis's clock minus this node's, from the round trips with the least delay.

        Only the last few count: a stalled event loop (a late ``received``) must
        not move the dates.
        """
        self._samples.append((received - sent, redis_now - (sent + received) / 2))
        return min(self._samples)[1]

    async def give_back(self, cmd: ReturnGrants) -> None:
        """Return leases this node holds and does not use."""
        args = list(self._args[:2])
        for key, count in cmd.returns:
            args += [key, str(count)]
        await self._return(args=args)

    async def in_use(self) -> dict[str, dict[str, int]]:
        """Every entry's leases by node (for ``sluice cluster status``)."""
        out: dict[str, dict[str, int]] = {}
        start = len(self.prefix) + len("lease:")
        async for key in self.client.scan_iter(match=f"{self.prefix}lease:*", count=500):
            held = await self.client.hgetall(key)
            if held:
                out[str(key)[start:]] = {str(k): int(v) for k, v in held.items()}
        return out

    async def nodes_seen(self) -> dict[str, float]:
        """Every node's last heartbeat in Redis, as its age in seconds."""
        secs, micros = await self.client.time()
        now_ms = int(secs) * 1000 + int(micros) // 1000
        seen: list[Any] = await self.client.zrange(f"{self.prefix}nodes", 0, -1,
                                                   withscores=True)
        return {str(node): max(0.0, (now_ms - float(score)) / 1000) for node, score in seen}

    async def ping(self) -> bool:
        """Whether Redis answers."""
        try:
            return bool(await self.client.ping())
        except (aioredis.RedisError, OSError):
            return False

    async def close(self) -> None:
        """Close the connection to Redis."""
        await self.client.aclose()
