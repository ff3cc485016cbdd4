"""This node's part in a cluster: shared limits, heartbeats, and taking over dead nodes.

SUMMARY
    agent = ClusterAgent(config, queue, shared, post=manager.post, clock=...)
    agent.execute(AcquireGrants | ReturnGrants)     from the queue manager's loop
    await agent.run(stop)                           its tasks, until stop is set
    agent.status() -> ClusterStatus                 for metrics, the API, the CLI

DESCRIPTION
    The scheduler's ClusterLimits says what it needs of the cluster's
    limits as commands; this agent carries them to Redis (SharedLimits) one
    after another, in order, and posts the answers back as GrantsChanged.
    Beside that it keeps a heartbeat in Redis (which keeps this node's
    leases alive) and, when the queue is the shared PostgreSQL one, in
    ``sluice_nodes``; and it looks for nodes whose heartbeat is older than
    ``cluster.node_lease`` and returns their claims to the queue.

STRATEGIES
    Fall back, then come back.  The first Redis error (a timeout, a refused
    connection, or RedisForgot: Redis restarted empty without our noticing
    an outage) switches the scheduler to its fall-back shares
    (ClusterModeChanged(shared=False, live nodes, rank, lease_ttl)); the
    change is logged once and counted, and the Redis client is told
    (SharedLimits.reconnect: the next Redis may be a new one, and the idle
    connections to the old one are closed, so that the first commands
    after the come-back do not fail on them and fall back a second time).
    While fallen back the agent tries Redis every second, and the first
    heartbeat that succeeds switches the scheduler back
    (ClusterModeChanged(shared=True)).  The live nodes are PostgreSQL's
    when the queue is there (it does not depend on Redis), else the last
    list Redis gave.

    One command at a time.  A ReturnGrants is carried before the
    AcquireGrants that follows it: the store's answer counts on what this
    node holds.

    Hand over, then say so.  Back from a fall-back, the node tells
    PostgreSQL it shares again only once its first AcquireGrants is
    answered: that one carries the leases of its deliveries in flight
    (ClusterLimits sends it, empty if there are none).  Before, another
    node could end its come-back on our word and be granted leases that
    Redis, restarted empty, did not yet know were in use here.

INVARIANTS
    Every AcquireGrants is answered (GrantsChanged) or overtaken by a
    ClusterModeChanged; no error of a background task vanishes: the task
    group stops the node with it.

SEE ALSO
    sluice.cluster.shared_limits, sluice.scheduler.cluster,
    sluice.store._pg_nodes, docs/cluster.md
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import socket
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

from redis.exceptions import RedisError, ResponseError

from sluice.accounting import EventKind, make_event
from sluice.cluster import one_line, wait_stop
from sluice.cluster.shared_limits import SharedLimits
from sluice.cluster.shared_state import SHARED_EVENTS, SharedState, encode
from sluice.config import Config
from sluice.model import QueueEntry
from sluice.queue import Queue
from sluice.scheduler.events import (
    AcquireGrants,
    ClusterModeChanged,
    Command,
    Event,
    MailArrived,
    ReturnGrants,
)
from sluice.scheduler.policy import Policy

__all__ = ["ClusterAgent", "ClusterStatus", "NodeStore"]

log = logging.getLogger("sluice.cluster")

_REDIS_ERRORS = (RedisError, OSError, asyncio.TimeoutError)

#: How often a node that fell back tries Redis again; twice this (plus a
#: timeout) is how long a node that came back keeps to its share.
RETRY_S = 1.0
COMEBACK_S = 2 * RETRY_S


@runtime_checkable
class NodeStore(Protocol):
    """A store that knows the cluster's nodes (the postgres flavour)."""

    node_id: str

    def heartbeat(self, host: str, started_at: float, now: float, limits: str = ...
                  ) -> None:
        """Say this node is alive at ``now``, with its host, start time and limits mode."""
        ...

    def nodes(self) -> list[Any]:
        """The nodes the store knows, with their last heartbeat and claimed entries."""
        ...

    def take_over(self, dead: str, now: float, older_than: float) -> list[QueueEntry]:
        """Return a dead node's claims to the queue if its heartbeat is still old.

        Old: before ``older_than``.  Returns the entries given back (as they
        are now); none when another node is taking them or ``dead`` has sent
        a heartbeat since.
        """
        ...


@dataclass
class ClusterStatus:
    """What the agent knows, for /metrics, the API and ``sluice cluster status``."""

    node: str
    shared: bool = True  # limits held in Redis (False: fallen back to shares)
    redis_reachable: bool = True
    postgres_reachable: bool | None = None  # None: the queue is not on PostgreSQL
    live_nodes: list[str] = field(default_factory=list)
    fallbacks: int = 0
    takeovers: int = 0
    entries_taken_over: int = 0
    grant_round_trips: int = 0
    grant_seconds: float = 0.0  # their total time


class ClusterAgent:
    """Carries the scheduler's cluster commands to Redis and keeps this node alive."""

    def __init__(self, config: Config, queue: Queue, shared: SharedLimits, *,
                 post: Callable[[Event], None], clock: Callable[[], float] = time.time,
                 change: Callable[[Event], None] | None = None,
                 policy: Callable[[], Policy] | None = None) -> None:
        self.config = config
        self.queue = queue
        self.shared = shared
        self.post = post
        self.clock = clock
        self.node_id = config.node.id
        self.host = config.node.hostname or socket.gethostname()
        self.started_at = clock()
        self.nodes_store = queue.store if isinstance(queue.store, NodeStore) else None
        self.state = ClusterStatus(self.node_id,
                                   postgres_reachable=None if self.nodes_store is None else True)
        self._commands: asyncio.Queue[Command] = asyncio.Queue()
        self._back_at: float | None = None  # came back from the fall-back, others maybe not
        self._handed_over = True  # Redis counts this node's deliveries in flight
        self._fell_at = 0.0  # when this node last fell back
        self._others_shared = False  # told to the scheduler: others still take from Redis
        self._fallen_nodes = 0  # live nodes told to the scheduler with the fall-back
        # Operator changes to and from the other nodes (the postgres queue only).
        self.change = change
        self.policy = policy
        self.shared_state = None
        if self.nodes_store is not None and change is not None:
            dsn = os.environ.get("SLUICE_PG_DSN") or config.queue.postgres.dsn
            if dsn:
                self.shared_state = SharedState(dsn, self.node_id)
        self._outgoing: asyncio.Queue[tuple[str, dict[str, Any] | None]] = asyncio.Queue()
        self._retry = asyncio.Event()

    # -- from the queue manager -----------------------------------------------------

    def execute(self, cmd: Command) -> None:
        """Carry ``cmd`` to Redis soon (never blocks the manager's loop)."""
        if self.state.shared:
            self._commands.put_nowait(cmd)

    def status(self) -> ClusterStatus:
        """What this node knows of the cluster now (the ``sluice cluster status`` data)."""
        return self.state

    def publish(self, event: Event) -> None:
        """A change made here (an operator's, a shaping rule's): give it to the other nodes."""
        if self.shared_state is None or not isinstance(event, SHARED_EVENTS):
            return
        assert self.policy is not None
        self._outgoing.put_nowait(encode(event, self.policy()))

    # -- the tasks ------------------------------------------------------------------

    async def run(self, stop: asyncio.Event) -> None:
        """Run the agent's tasks until ``stop`` is set."""
        async with asyncio.TaskGroup() as group:
            tasks = [group.create_task(self._carry(), name="cluster-commands"),
                     group.create_task(self._beat(stop), name="cluster-heartbeat")]
            if self.nodes_store is not None:
                tasks.append(group.create_task(self._watch_nodes(stop), name="cluster-nodes"))
            if self.shared_state is not None:
                assert self.change is not None
                tasks.append(group.create_task(self.shared_state.follow(self.change, stop),
                                               name="cluster-follow"))
                tasks.append(group.create_task(self._send_changes(), name="cluster-publish"))
            await stop.wait()
            for task in tasks:
                task.cancel()
        with contextlib.suppress(Exception):
            await self.shared.close()

    async def _carry(self) -> None:
        while True:
            cmd = await self._commands.get()
            if not self.state.shared:
                continue  # overtaken by the fall-back
            started = time.perf_counter()
            try:
                if isinstance(cmd, AcquireGrants):
                    answer = await self.shared.acquire(cmd, self.clock)
                    self.post(answer)
                    self._handed_over = True  # the first after a come-back carries them
                elif isinstance(cmd, ReturnGrants):
                    await self.shared.give_back(cmd)
            except _REDIS_ERRORS as exc:
                await self._fall_back(exc)
                continue
            self.state.grant_round_trips += 1
            self.state.grant_seconds += time.perf_counter() - started

    async def _send_changes(self) -> None:
        state = self.shared_state
        assert state is not None
        while True:
            key, body = await self._outgoing.get()
            for attempt in range(5):
                try:
                    await asyncio.to_thread(state.publish, key, body)
                    break
                except Exception as exc:  # PostgreSQL down: try a few times, then say so
                    if attempt == 4:
                        log.error("cluster: change %s not given to the other nodes: %s",
                                  key, one_line(exc))
                    else:
                        await asyncio.sleep(0.5 * 2 ** attempt)

    async def _beat(self, stop: asyncio.Event) -> None:
        interval = self.config.cluster.heartbeat_interval
        while not stop.is_set():
            try:
                live = await self.shared.heartbeat()
            except _REDIS_ERRORS as exc:
                await self._fall_back(exc)
            else:
                self.state.redis_reachable = True
                if self.nodes_store is None:
                    self.state.live_nodes = live
                if not self.state.shared:
                    self._come_back()
            wait = RETRY_S if not self.state.shared else interval
            await wait_stop(stop, wait)

    async def _fall_back(self, exc: BaseException) -> None:
        self.state.redis_reachable = False
        if not self.state.shared:
            return
        self.state.shared = False
        self.state.fallbacks += 1
        while not self._commands.empty():
            self._commands.get_nowait()
        nodes = self.state.live_nodes or [self.node_id]
        rank = nodes.index(self.node_id) if self.node_id in nodes else 0
        self._fell_at = self.clock()
        # Until PostgreSQL shows the others fell back too, they may still
        # take the whole limit from Redis (_watch_nodes says when not).
        self._others_shared = self.nodes_store is not None and len(nodes) > 1
        self._fallen_nodes = len(nodes)
        if isinstance(exc, ResponseError):  # not an outage: Redis refused what we sent
            log.error("cluster limits: Redis refused a request (%s)", one_line(exc))
        log.warning("cluster limits: Redis unreachable or restarted (%s); each limit is now "
                    "this node's share of it (%d live nodes, rank %d) until Redis answers "
                    "again", one_line(exc), len(nodes), rank)
        self.post(ClusterModeChanged(False, len(nodes), rank, self.config.cluster.lease_ttl,
                                     others_shared=self._others_shared))
        with contextlib.suppress(*_REDIS_ERRORS):  # closing dead sockets: nothing to say
            await self.shared.reconnect()

    def _come_back(self) -> None:
        self.state.shared = True
        log.warning("cluster limits: Redis answers again; limits are shared across the "
                    "cluster once more")
        # The others notice within their retry (1 s) and a timeout or two.
        # With the nodes in PostgreSQL this node keeps to its share until
        # every live node says it shares again (_watch_nodes), for a lease at
        # most; without, for a few retries.
        self._back_at = self.clock()
        self._handed_over = False
        wait = (self.config.cluster.lease_ttl if self.nodes_store is not None
                else COMEBACK_S + 2 * self.shared.timeout_s)
        self.post(ClusterModeChanged(True, transition_s=wait))

    async def _watch_nodes(self, stop: asyncio.Event) -> None:
        store = self.nodes_store
        assert store is not None
        c = self.config.cluster
        while not stop.is_set():
            now = self.clock()
            try:
                # "shared" only once Redis counts our deliveries in flight: the
                # others end their come-backs on it and take leases against them.
                mode = "shared" if self.state.shared and self._handed_over else "fallback"
                await asyncio.to_thread(store.heartbeat, self.host, self.started_at, now, mode)
                rows = await asyncio.to_thread(store.nodes)
                self.state.postgres_reachable = True
                live = [r for r in rows if r.heartbeat_at >= now - c.node_lease]
                self.state.live_nodes = sorted(r.id for r in live)
                if self._back_at is not None and self.state.shared and all(
                        r.limits == "shared" and r.heartbeat_at > self._back_at for r in live):
                    self._back_at = None  # every node shares again: the come-back is over
                    self.post(ClusterModeChanged(True, transition_s=0.0))
                if not self.state.shared:
                    self._tell_others_mode(live)
                for row in rows:
                    if row.id != self.node_id and row.heartbeat_at < now - c.node_lease:
                        await self._take_over(store, row.id, row.heartbeat_at, now)
            except Exception as exc:  # the store says why; try again next beat
                if self.state.postgres_reachable:
                    log.warning("cluster: PostgreSQL heartbeat failed: %s", one_line(exc))
                self.state.postgres_reachable = False
            await wait_stop(stop, c.heartbeat_interval)

    def _tell_others_mode(self, live: list[Any]) -> None:
        """Fallen back: tell the scheduler whether other live nodes may still take from Redis.

        A node that has not said "fallback" since this one fell back may; the
        live nodes go with it, as they are now.
        """
        others = any(r.id != self.node_id and not (
            r.limits == "fallback" and r.heartbeat_at >= self._fell_at) for r in live)
        nodes = self.state.live_nodes or [self.node_id]
        if others == self._others_shared and len(nodes) == self._fallen_nodes:
            return
        if self._others_shared and not others:
            log.warning("cluster limits: every live node has fallen back; each keeps its "
                        "share of every limit")
        elif others and not self._others_shared:
            log.warning("cluster limits: other nodes still reach Redis; this node keeps to "
                        "the leases it held and starts nothing rate-limited until they "
                        "fall back too or Redis answers")
        self._others_shared = others
        self._fallen_nodes = len(nodes)
        rank = nodes.index(self.node_id) if self.node_id in nodes else 0
        self.post(ClusterModeChanged(False, len(nodes), rank, others_shared=others))

    async def _take_over(self, store: NodeStore, dead: str, beat_at: float,
                         now: float) -> None:
        entries = await asyncio.to_thread(store.take_over, dead, now,
                                          now - self.config.cluster.node_lease)
        if not entries:
            # Another live node got there first (or the dead one held nothing):
            # counted and logged by the node that returned the entries.
            log.debug("cluster: node %s silent; nothing of it left to return", dead)
            return
        self.state.takeovers += 1
        self.state.entries_taken_over += len(entries)
        log.warning("cluster: node %s silent for %.0f s; returned its %d claimed "
                    "entries to the queue", dead, now - beat_at, len(entries))
        if entries:
            acct = self.queue.accounting
            if acct is not None:
                acct.record([make_event(EventKind.RECOVERED, e, now, node=self.node_id)
                             for e in entries], now)
            self.post(MailArrived(len(entries)))

