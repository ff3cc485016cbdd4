"""Resent messages: a client's second copy is answered with the first queue id.

SUMMARY
    resends = Resends.open(config, accounting)     # smtpd.dedupe: true
    mark = resends.mark(submission, chunks, origin, size) -> Mark | None
    verdict = resends.claim(mark) -> Claimed | Duplicate | InFlight
    verdicts = resends.claim_all([mark, ...])           # one transaction for all
    (submit under mark.submission; wait until durable)
    resends.confirm(mark, accepted) | resends.forget(mark)   # after the queue's answer
    resends.settle_all([(mark, accepted or None), ...])
    resends.close()
    settle(config, store) -> (confirmed, forgotten)   once, before any receiver serves

DESCRIPTION
    A client that did not see our 250 (the connection broke, it timed out)
    sends the message again, and without this the recipients get it
    twice.  With ``smtpd.dedupe`` on, a message is marked by a key: the
    SHA-256 of its Message-ID, envelope sender, recipients (sorted) and the
    digest of its body (the text after the header block), in a scope: the
    authenticated user, or else the client's network (/24 for IPv4, /64
    for IPv6, so that a client that comes back from another address of
    its pool is still recognised).  A message whose key was queued in the
    same scope within ``smtpd.dedupe_window`` is answered 250 with the
    first message's queue id, queued nothing, and gets one ``duplicate``
    line per recipient in the accounting log.

    A message without a Message-ID is never deduplicated: a client that
    does not name its messages cannot be told from one that sends the
    same text twice on purpose (a monitoring probe).

STRATEGIES
    One index, one behaviour.  The keys live in a sluice.idempotency
    index, the HTTP injection API's: claim durably before submitting,
    confirm once durable, forget on failure, settle once at start against
    what the queue holds.  Its file is ``<queue.path>/smtpd-dedupe.db``,
    not the API's, because expiry is by the index's window and the two
    windows differ.  SQLite in WAL mode, one write transaction per batch
    of claims: every receiving process of the node opens the same file,
    and exactly one of two processes claiming one key wins (the other
    answers 451 4.3.0: a copy is being queued right now, try again).

    One key per message.  The recipients of a message are committed
    together, so the queue id of its first recipient stands for all of
    them: settle() finds it with that recipient, or not at all.

    The digest is of the client's text only: the receiver's own Received
    header (the first chunk handed over, it names the SPID and the time)
    is left out, and so is the header block, so a client that rebuilds
    the Date header on a retry but keeps the Message-ID is recognised.
    Text without an empty line is digested whole: when in doubt, two
    messages are different (a duplicate costs a second copy, a wrong
    match would lose a message).

    Claims in batches.  The handoff thread claims every message waiting
    for it in one transaction of the index (claim_all).

    Claims written, not synced.  The HTTP API syncs its claims before
    submitting; here that fsync halved the receivers' throughput
    (bench/dedupe_bench.py), and it buys little: a claim matters only if
    its message's 250 is lost, and a plain crash of the process keeps
    what was written.  Only a power cut can lose claims (a WAL loses its
    last commits, never one in the middle), and then a resend of such a
    message is queued again -- a duplicate, as without dedupe.  It cannot
    make the rule answer for a message that is not in the queue: a key
    is confirmed only after its message is durable, and a key left
    pending is settled against the queue.

INVARIANTS
    A message is answered "queued as X" from the index only for an X that
    is, or was, in the queue: a claim is confirmed after its submission is
    durable, and settle() forgets a pending claim whose message is not in
    the queue.  Dedupe never drops a message it has not queued once.

LIMITATIONS
    At-least-once still: a resend after the window, from another scope, to
    another node, or after a claim's confirmation was lost with power
    (sluice.idempotency), or whose claim a power cut took, is queued
    again.  Claims add a write of the index before the message's own, in
    the receiver's handoff thread.
    A message spilled to disk during DATA is read twice (digest, then
    spool).
    Per node in a cluster: with the postgres flavour each node keeps its
    own index under its queue.path.  A claim a crash left pending is
    settled against the shared queue, where another node may already
    have delivered its message and removed it: the key is forgotten, and
    a resend is queued again (a duplicate, never a wrong answer).

SEE ALSO
    sluice.idempotency, sluice.smtpd.handoff, docs/queue.md, docs/smtpd.md
"""

from __future__ import annotations

import hashlib
import ipaddress
import json
import logging
import re
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from email.parser import BytesHeaderParser
from email.policy import compat32
from pathlib import Path
from typing import TYPE_CHECKING

from sluice.accounting import AccountingLog, EventKind, make_event
from sluice.idempotency import Claim, Hit, IdempotencyIndex, fingerprint, in_store
from sluice.model import Accepted, Reply, Submission, format_qid, parse_qid
from sluice.queue import Queue

if TYPE_CHECKING:
    from sluice.config import Config
    from sluice.store import Store

__all__ = [
    "Claimed",
    "Duplicate",
    "InFlight",
    "Mark",
    "Origin",
    "Resends",
    "body_digest",
    "index_path",
    "message_key",
    "scope_of",
    "settle",
]

log = logging.getLogger("sluice.smtpd")

#: How often a process removes keys older than the window.
EXPIRE_EVERY_S = 60.0

#: Bytes of header block read for the Message-ID (as MessageBuffer.header_block).
HEADER_MAX = 64 * 1024

#: The end of a header block: a line feed, then an empty line.
_EMPTY_LINE = re.compile(rb"\n\r?\n")

#: The reply text of a duplicate line in the accounting log.
DUPLICATE_TEXT = "a resend of a message already queued; not queued again"


@dataclass(frozen=True, slots=True)
class Origin:
    """Who handed a message over: the authenticated user, else the client's address."""

    auth_user: str | None
    client_ip: str


def scope_of(origin: Origin) -> str:
    """'user:alice', or the client's network: 'net:192.0.2.0/24', 'net:2001:db8::/64'."""
    if origin.auth_user:
        return f"user:{origin.auth_user}"
    try:
        addr = ipaddress.ip_address(origin.client_ip)
    except ValueError:
        return f"ip:{origin.client_ip}"
    prefix = 24 if addr.version == 4 else 64
    return f"net:{ipaddress.ip_network(f'{addr}/{prefix}', strict=False)}"


def message_key(message_id: str, sender: str, recipients: Iterable[str], digest: str) -> str:
    """The key of a message: order of recipients does not matter, everything else does."""
    parts = json.dumps([message_id, sender, sorted(recipients), digest])  # unambiguous
    return hashlib.sha256(parts.encode("utf-8", "surrogateescape")).hexdigest()


def body_digest(chunks: Iterable[bytes]) -> tuple[str, str]:
    """(Message-ID, SHA-256 of the body) of a message's text in pieces.

    The body is what follows the first empty line (CRLF, or a bare LF as
    some clients send); chunk boundaries do not matter.  Text without an
    empty line in its first 64 KiB is digested whole.  The Message-ID is
    '' when the header block has none.
    """
    sha = hashlib.sha256()
    head = b""
    in_body = False
    for chunk in chunks:
        if in_body:
            sha.update(chunk)
            continue
        scan_from = max(0, len(head) - 2)  # an end may straddle two chunks
        head += chunk
        if head.startswith((b"\n", b"\r\n")):  # an empty header block
            sha.update(head[head.index(b"\n") + 1:])
            head = b""
            in_body = True
            continue
        end = _EMPTY_LINE.search(head, scan_from)
        if end is not None:
            sha.update(head[end.end():])
            head = head[:end.end()]
            in_body = True
        elif len(head) > HEADER_MAX:  # no header block worth the name
            sha.update(head)
            head = head[:HEADER_MAX]
            in_body = True
    if not in_body:  # no empty line at all: every byte counts
        sha.update(head)
    value = BytesHeaderParser(policy=compat32).parsebytes(head[:HEADER_MAX]).get("Message-ID")
    return ("" if value is None else "".join(str(value).split())), sha.hexdigest()


@dataclass(frozen=True, slots=True)
class Mark:
    """A message to be queued at most once: its key in its scope."""

    scope: str
    key: str
    submission: Submission
    size: int


@dataclass(frozen=True, slots=True)
class Claimed:
    """The key is ours: submit the message under its SPID."""


@dataclass(frozen=True, slots=True)
class Duplicate:
    """Queued already: answer with ``accepted`` (the first message's queue ids)."""

    accepted: Accepted
    hit: Hit


@dataclass(frozen=True, slots=True)
class InFlight:
    """Another session is queueing the same message right now: try again."""


Verdict = Claimed | Duplicate | InFlight


def index_path(config: Config) -> Path:
    """Where the receiving side's idempotency index lives: beside the queue."""
    return Path(config.queue.path) / "smtpd-dedupe.db"


def settle(config: Config, store: Store) -> tuple[int, int]:
    """Settle the claims left pending by the last run against the queue.

    Once per node start, before any receiver serves and before anything is
    delivered.
    """
    path = index_path(config)
    if not path.exists():
        return 0, 0
    index = IdempotencyIndex(path, config.smtpd.dedupe_window)
    try:
        return index.settle(in_store(store))
    finally:
        index.close()


class Resends:
    """The resend rule of one receiving process (thread-safe)."""

    def __init__(self, index: IdempotencyIndex, accounting: AccountingLog | None = None,
                 node: str = "", clock: Callable[[], float] = time.time,
                 spill_dir: str | None = None) -> None:
        self.index = index
        #: Where a big message is copied while its digest is taken.
        self.spill_dir = spill_dir
        self.accounting = accounting
        self.node = node
        self.clock = clock
        self._expired_at = 0.0

    @classmethod
    def open(cls, config: Config, accounting: AccountingLog | None = None) -> Resends:
        """The resend detector for a configuration, its index opened."""
        index = IdempotencyIndex(index_path(config), config.smtpd.dedupe_window)
        return cls(index, accounting, node=config.node.id, spill_dir=config.queue.path)

    def close(self) -> None:
        """Close the index."""
        self.index.close()

    # -- the rule ---------------------------------------------------------------------

    def mark(self, submission: Submission, text: Iterable[bytes], origin: Origin,
             size: int) -> Mark | None:
        """The mark of a message, from its client's ``text`` (without our trace header).

        None when the message has no Message-ID.
        """
        message_id, digest = body_digest(text)
        if not message_id:
            return None
        key = message_key(message_id, submission.sender, submission.recipients, digest)
        return Mark(scope_of(origin), key, submission, size)

    def claim(self, mark: Mark, now: float | None = None) -> Verdict:
        """Claim the key for the message's planned queue ids (written, not synced)."""
        return self.claim_all([mark], now)[0]

    def claim_all(self, marks: Sequence[Mark], now: float | None = None) -> list[Verdict]:
        """claim() for several messages in one write transaction of the index.

        The same key twice: the first is claimed, the others are InFlight.
        """
        at = self.clock() if now is None else now
        claims: dict[str, dict[str, Claim]] = {}
        mine: list[bool] = []  # whether marks[i] is the one that claims its key
        for mark in marks:
            sub = mark.submission
            if not sub.spid:
                raise ValueError("a marked submission needs its SPID drawn")
            scope = claims.setdefault(mark.scope, {})
            mine.append(mark.key not in scope)
            if mine[-1]:
                scope[mark.key] = Claim(mark.key, fingerprint(sub.recipients[0], sub.sender),
                                        format_qid(sub.spid, 0))
        # Not synced: see STRATEGIES, "Claims written, not synced".
        known = self.index.remember_all(
            {scope: list(items.values()) for scope, items in claims.items()}, at,
            durable=False)
        if at - self._expired_at >= EXPIRE_EVERY_S:
            self._expired_at = at
            self.index.expire(at)
        verdicts: list[Verdict] = []
        for mark, first in zip(marks, mine, strict=True):
            hit = known.get(mark.scope, {}).get(mark.key)
            if hit is None:
                verdicts.append(Claimed() if first else InFlight())
            elif not hit.done:
                verdicts.append(InFlight())
            else:
                verdicts.append(self._duplicate(mark, hit, at))
        return verdicts

    def _duplicate(self, mark: Mark, hit: Hit, now: float) -> Duplicate:
        sub = mark.submission
        spid, _ = parse_qid(hit.qid)
        accepted = Accepted(spid=spid,
                            qids=tuple(format_qid(spid, i) for i in range(len(sub.recipients))),
                            size=mark.size, duplicate=True)
        self._record(sub, accepted, now)
        log.info("message %s from <%s> is a resend of %s (%s): not queued again",
                 sub.spid, sub.sender, spid, mark.scope)
        return Duplicate(accepted, hit)

    def confirm(self, mark: Mark, accepted: Accepted) -> None:
        """The marked message is durable, under the queue ids of ``accepted``."""
        self.index.confirm(mark.scope, {mark.key: accepted.qids[0]})

    def forget(self, mark: Mark) -> None:
        """The marked message was not queued: its resend must be."""
        self.index.forget(mark.scope, [mark.key])

    def settle_all(self, answered: Sequence[tuple[Mark, Accepted | None]]) -> None:
        """confirm() or forget() several marks, one call of the index per scope."""
        done: dict[str, dict[str, str]] = {}
        failed: dict[str, list[str]] = {}
        for mark, accepted in answered:
            if accepted is not None:
                done.setdefault(mark.scope, {})[mark.key] = accepted.qids[0]
            else:
                failed.setdefault(mark.scope, []).append(mark.key)
        for scope, keys in done.items():
            self.index.confirm(scope, keys)
        for scope, lost in failed.items():
            self.index.forget(scope, lost)

    def _record(self, sub: Submission, accepted: Accepted, now: float) -> None:
        if self.accounting is None:
            return
        reply = Reply(250, "2.0.0", DUPLICATE_TEXT)
        self.accounting.record(
            [make_event(EventKind.DUPLICATE, e, now, node=self.node, reply=reply, attempt=0)
             for e in Queue.entries_of(sub, accepted, now)], now)
