"""The delivery agent's connection cache: idle sessions kept for the next message.

SUMMARY
    pool = SessionPool(max_messages, idle_s, max_open)
    pool.add(session)            a new session counts (may close the longest idle)
    pool.take(key) -> Session | None
    pool.give(key, session)      back to the idle pool, or closed
    pool.drop(session)           closed and forgotten
    pool.close()                 QUIT every idle session; keep none after

DESCRIPTION
    Sessions are keyed by (transport, destination, source IP): a session
    is reused only for the same next hop from the same address.  A
    session that goes back to the pool is closed instead when the pool
    is closing, when it is no longer alive, or when it has carried
    ``max_messages`` transactions.  An idle session is closed (QUIT)
    after ``idle_s``.  ``sessions`` holds every open session, idle or in
    a delivery.

STRATEGIES
    LIFO within a key, so that few connections stay warm and the rest
    time out.

    Bounded connections.  When ``max_open`` sessions are open, add() first
    closes the longest-idle session of any destination (the bottom of
    each key's stack waited longest).

    Timers, not tasks.  The idle timeout is a loop timer on the session
    (``idle_handle``), cancelled when the session is taken.

INVARIANTS
    A session is in the idle pool or in one delivery, never both.

SEE ALSO
    sluice.delivery.agent (the one user), sluice.delivery.client (Session)
"""

from __future__ import annotations

import asyncio

from sluice.delivery.client import Session
from sluice.scheduler.events import Transport

__all__ = ["PoolKey", "SessionPool"]

#: (transport, destination, source IP): what a reused session must match.
PoolKey = tuple[Transport, str, str]


class SessionPool:
    """Open sessions, and the idle ones by PoolKey (see STRATEGIES above)."""

    def __init__(self, max_messages: int, idle_s: float, max_open: int) -> None:
        self.max_messages = max_messages
        self.idle_s = idle_s
        self.max_open = max_open
        self.idle: dict[PoolKey, list[Session]] = {}
        self.sessions: set[Session] = set()
        self.closing = False

    @property
    def idle_count(self) -> int:
        """Sessions waiting in the pool, of every key."""
        return sum(len(v) for v in self.idle.values())

    def take(self, key: PoolKey) -> Session | None:
        """The most recently idle live session for ``key``, or None; dead ones are dropped."""
        stack = self.idle.get(key)
        while stack:
            session = stack.pop()
            session.stop_idle_timer()
            if session.alive:
                return session
            self.drop(session)
        return None

    def add(self, session: Session) -> None:
        """Count a new session, closing the longest-idle one first when at the limit."""
        if len(self.sessions) >= self.max_open:
            self._evict_one()
        self.sessions.add(session)

    def give(self, key: PoolKey, session: Session) -> None:
        """Keep ``session`` idle for ``key``, or close it (see DESCRIPTION)."""
        if (self.closing or not session.alive or session.messages >= self.max_messages
                or self.idle_s <= 0):  # idle 0: keep none, QUIT before the caller goes on
            self.drop(session, polite=True)
            return
        self.idle.setdefault(key, []).append(session)
        loop = asyncio.get_running_loop()
        session.idle_since = loop.time()
        session.idle_handle = loop.call_later(self.idle_s, self._expire, key, session)

    def drop(self, session: Session, polite: bool = False) -> None:
        """Close ``session`` (QUIT when ``polite`` and it is usable, else abort); forget it."""
        if polite and session.usable:
            session.quit()
        else:
            session.abort()
        self.sessions.discard(session)

    def _expire(self, key: PoolKey, session: Session) -> None:
        session.idle_handle = None
        stack = self.idle.get(key)
        if stack and session in stack:
            stack.remove(session)
            if not stack:
                del self.idle[key]
        self.drop(session, polite=True)

    def _evict_one(self) -> None:
        oldest: tuple[float, PoolKey, Session] | None = None
        for key, stack in self.idle.items():  # the bottom of each stack waited longest
            if stack and (oldest is None or stack[0].idle_since < oldest[0]):
                oldest = (stack[0].idle_since, key, stack[0])
        if oldest is not None:
            _, key, session = oldest
            session.stop_idle_timer()
            self._expire(key, session)

    def close(self) -> None:
        """QUIT every idle session; sessions given back later are closed too."""
        self.closing = True
        for stack in list(self.idle.values()):
            for session in stack:
                session.stop_idle_timer()
                self.drop(session, polite=True)
        self.idle.clear()
