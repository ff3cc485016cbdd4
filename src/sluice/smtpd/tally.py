"""What one SMTP connection did, written as its ``session`` accounting line when it ends.

SUMMARY
    tally = SessionTally(ip, started_at)
    tally.replied(reply)          every reply the session sends
    tally.tls_up(ssl_object) / tally.tls_failed(exc)
    tally.client(helo, auth_user) -> ClientSession   (the received lines' context)
    tally.write(queue, helo, auth_user, auth_failures)   once, at the end

STRATEGY
    The receiving processes are not the process that serves /metrics; the
    accounting log is how what they do reaches it (the ``received`` lines
    count messages and bytes accepted).  So a connection adds one line
    when it ends: who the client was, the TLS protocol and cipher it got
    (or why the handshake failed), the AUTH user and failures, and the
    replies 4xx/5xx it was sent, by code.  One line a connection, written
    on the event loop like the suppressed recipients' lines (one append).

LIMITATIONS
    Counts reach the metrics when the connection ends, not command by
    command: a long session's refusals show up at its close.

SEE ALSO
    sluice.accounting.session_event, sluice.api.metrics, docs/observability.md
"""

from __future__ import annotations

import ssl

from sluice.accounting import session_event
from sluice.model import ClientSession, Reply
from sluice.smtpd.handoff import Submitting

__all__ = ["SessionTally"]


class SessionTally:
    """The counts and TLS state of one connection; see the module doc."""

    def __init__(self, ip: str, started_at: float) -> None:
        """Start counting for client ``ip``, connected at ``started_at``."""
        self.ip = ip
        self.started_at = started_at
        self.refused: dict[str, int] = {}
        self.tls_protocol: str | None = None
        self.tls_cipher: str | None = None
        self.tls_failure: str | None = None
        self._written = False

    def replied(self, reply: Reply) -> None:
        """Count a reply the session sent, if it refuses (4xx or 5xx)."""
        if reply.code >= 400:
            key = str(reply.code)
            self.refused[key] = self.refused.get(key, 0) + 1

    def tls_up(self, ssl_object: ssl.SSLObject | ssl.SSLSocket | None) -> None:
        """Note the protocol and cipher of a handshake that succeeded."""
        if ssl_object is None:
            self.tls_protocol = "unknown"
            return
        self.tls_protocol = ssl_object.version() or "unknown"
        cipher = ssl_object.cipher()
        self.tls_cipher = cipher[0] if cipher else None

    def tls_failed(self, exc: BaseException) -> str:
        """Note why a handshake failed; returns it as one line (type: text)."""
        text = " ".join(str(exc).split()) or "the connection closed during the handshake"
        self.tls_failure = f"{type(exc).__name__}: {text}"[:200]
        return self.tls_failure

    def client(self, helo: str, auth_user: str | None) -> ClientSession:
        """The session's context as a received line carries it."""
        return ClientSession(self.ip, helo, self.tls_protocol, self.tls_cipher, auth_user)

    def write(self, queue: Submitting, helo: str, auth_user: str | None,
              auth_failures: int) -> None:
        """Append the ``session`` line (once; later calls do nothing)."""
        if self._written or queue.accounting is None:
            return
        self._written = True
        now = queue.clock()
        queue.accounting.record(
            [session_event(self.client(helo, auth_user), now, node=queue.node,
                           started_at=self.started_at, refused=self.refused,
                           auth_failures=auth_failures, tls_failure=self.tls_failure)],
            now)
