"""The receiving side's counters, from the accounting log's session and received lines.

SUMMARY
    smtpd = ReceivingCounters(registry)
    smtpd.observe(event)    each of this node's accounting events
    smtpd.flush()           once a poll: into the Prometheus counters

STRATEGY
    The receiving processes are separate from the one serving /metrics;
    what they do reaches it the way accepted messages always have: through
    the accounting log, which the metrics tail reads every second
    (sluice.api.metrics).  A ``session`` line (sluice.smtpd.tally) ends
    every SMTP connection and says what it did; a ``received`` line with a
    ``client_ip`` is a recipient accepted over SMTP.  Counted here:

    sluice_smtpd_connections_total            connections ended
    sluice_smtpd_commands_refused_total{code} replies 4xx/5xx, by code
    sluice_smtpd_auth_failures_total          failed AUTH attempts
    sluice_smtpd_tls_sessions_total           STARTTLS handshakes that worked
    sluice_smtpd_tls_failures_total           and those that failed
    sluice_smtpd_messages_accepted_total,     messages queued over SMTP and
    sluice_smtpd_message_bytes_accepted_total their bytes

    Every counter, and ``code`` for each reply Sluice's server itself
    sends, exists at zero from the start, so rate() works before the first
    event.  ``code`` is a 4xx or 5xx code or "other" (a hook's reply may
    carry any code): at most 201 series.

LIMITATIONS
    A connection is counted when it ends, with everything it did.

SEE ALSO
    sluice.smtpd.tally (the writer), sluice.accounting.session_event, docs/api.md
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from prometheus_client import CollectorRegistry, Counter

__all__ = ["SERVER_CODES", "ReceivingCounters"]

#: The refusing codes Sluice's SMTP server sends itself (present at zero).
SERVER_CODES = ("421", "451", "452", "454", "500", "501", "502", "503", "504", "535", "538",
                "550", "552", "553", "554", "555")


def code_label(code: object) -> str:
    """A reply code as a label: "400" to "599", else "other"."""
    text = str(code)
    return text if len(text) == 3 and text.isdigit() and "400" <= text <= "599" else "other"


class ReceivingCounters:
    """The sluice_smtpd_* counters; see the module doc."""

    def __init__(self, registry: CollectorRegistry) -> None:
        """Register the counters in ``registry``, at zero."""
        self.connections = Counter("sluice_smtpd_connections",
                                   "SMTP connections ended (refused at connect included)",
                                   registry=registry)
        self.refused = Counter("sluice_smtpd_commands_refused",
                               "Replies 4xx and 5xx the SMTP server sent, by code",
                               ["code"], registry=registry)
        self.auth_failures = Counter("sluice_smtpd_auth_failures", "Failed AUTH attempts",
                                     registry=registry)
        self.tls_sessions = Counter("sluice_smtpd_tls_sessions",
                                    "STARTTLS handshakes that succeeded", registry=registry)
        self.tls_failures = Counter("sluice_smtpd_tls_failures",
                                    "STARTTLS handshakes that failed", registry=registry)
        self.messages = Counter("sluice_smtpd_messages_accepted", "Messages queued over SMTP",
                                registry=registry)
        self.message_bytes = Counter("sluice_smtpd_message_bytes_accepted",
                                     "Bytes of the messages queued over SMTP",
                                     registry=registry)
        for code in SERVER_CODES:
            self.refused.labels(code)
        self._pending: dict[str, int] = {}
        self._refused: dict[str, int] = {}

    def _add(self, key: str, n: int = 1) -> None:
        self._pending[key] = self._pending.get(key, 0) + n

    def observe(self, event: Mapping[str, Any]) -> None:
        """Count one accounting event (others than session and received are ignored)."""
        kind = event.get("event")
        if kind == "received":
            # A message's recipients are numbered from 0: count it once.
            if event.get("client_ip") and str(event.get("qid", "")).endswith("-0"):
                self._add("messages")
                size = event.get("size")
                self._add("bytes", size if isinstance(size, int) else 0)
            return
        if kind != "session":
            return
        self._add("connections")
        refused = event.get("refused")
        if isinstance(refused, Mapping):
            for code, n in refused.items():
                if isinstance(n, int) and n > 0:
                    label = code_label(code)
                    self._refused[label] = self._refused.get(label, 0) + n
        failures = event.get("auth_failures")
        if isinstance(failures, int) and failures > 0:
            self._add("auth_failures", failures)
        if event.get("tls_protocol"):
            self._add("tls_sessions")
        if event.get("tls_failure"):
            self._add("tls_failures")

    def flush(self) -> None:
        """Add what observe() counted to the counters (one increment each)."""
        pending, self._pending = self._pending, {}
        refused, self._refused = self._refused, {}
        for key, counter in (("connections", self.connections),
                             ("auth_failures", self.auth_failures),
                             ("tls_sessions", self.tls_sessions),
                             ("tls_failures", self.tls_failures),
                             ("messages", self.messages), ("bytes", self.message_bytes)):
            if pending.get(key):
                counter.inc(pending[key])
        for code, n in refused.items():
            self.refused.labels(code).inc(n)
