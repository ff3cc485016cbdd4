"""The end of DATA: the hook, the Received header, the queue, and the 250 when durable.

SUMMARY
    finish_message(settings, registry, peer, txn, buf) -> Reply
    log_suppressed(queue, txn, items, spid, size)        accounting for suppressed recipients

DESCRIPTION
    sluice.smtpd.session reads a message's text into a MessageBuffer and
    hands it here with the transaction and what it knows of the client
    (a Peer).  The content verdict (size, line length) comes first, then
    the end-of-DATA hook (sluice.hooks), which may set queue fields or
    reject; then the Received header (sluice.smtpd.trace) and the queue.

STRATEGIES
    Durable before 250.  The reply names the SPID only once the queue says
    content and meta are durable.  The queue's future is awaited one way
    only: a session that goes away never cancels it, because the committer
    thread owns it and the message may already be committed (the client
    then retries; a duplicate is allowed, a loss is not).  A StorageError
    or OSError answers 451 4.3.0.

    Spool writes off the loop.  Creating a spool file waits while the file
    system commits other messages' fsyncs; on the event loop that stalled
    every session.  Submissions go through a Handoff thread
    (sluice.smtpd.handoff) when the receiver has one.

SEE ALSO
    sluice.smtpd.session, sluice.smtpd.handoff, sluice.hooks, RFC 5321 4.2.5
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from sluice.accounting import EventKind, make_event
from sluice.hooks import Accept, EndOfData, Reject
from sluice.model import ClientSession, QueueEntry, QueueState, Reply, Submission
from sluice.smtpd.content import MessageBuffer
from sluice.smtpd.dedupe import Origin
from sluice.smtpd.envelope import Transaction
from sluice.smtpd.handoff import Submitting, await_durable
from sluice.smtpd.policy import QUEUE_FAILED, ContentState
from sluice.smtpd.settings import Registry, Settings
from sluice.smtpd.trace import protocol_name, received_header
from sluice.spool import new_spid
from sluice.store import StorageError
from sluice.suppression import SuppressionEntry

__all__ = ["Peer", "finish_message", "log_suppressed"]

log = logging.getLogger("sluice.smtpd")


@dataclass(frozen=True, slots=True)
class Peer:
    """What the session knows of its client when DATA ends."""

    ip: str
    port: int
    helo: str
    esmtp: bool
    tls: bool
    auth_user: str | None
    session: ClientSession | None = None  # for the received lines (accounting)

    def __init__(self, ip: str, port: int, helo: str, esmtp: bool, tls: bool,
                 auth_user: str | None, session: ClientSession | None = None) -> None:
        object.__setattr__(self, "ip", ip)
        object.__setattr__(self, "port", port)
        object.__setattr__(self, "helo", helo)
        object.__setattr__(self, "esmtp", esmtp)
        object.__setattr__(self, "tls", tls)
        object.__setattr__(self, "auth_user", auth_user)
        object.__setattr__(self, "session", session)


async def finish_message(settings: Settings, registry: Registry, peer: Peer,
                         txn: Transaction, buf: MessageBuffer) -> Reply:
    """Everything after the final dot; returns the reply to send (see the module doc)."""
    refusal = settings.policy.content(buf.state)
    if buf.state is ContentState.FAILED:
        registry.bump("queue_failures")
    if refusal is not None:
        registry.bump("messages_refused")
        log.info("%s: message from <%s> refused: %s", peer.ip, txn.sender, refusal)
        return refusal
    if not txn.recipients:  # every recipient was suppressed (drop mode)
        log_suppressed(settings.queue, txn, txn.dropped, None, buf.size)
        return Reply(250, "2.0.0", "Ok: dropped, no deliverable recipients")
    tls = peer.tls
    # The SPID is drawn now so that the Received header can name it.
    # SMTPUTF8 goes with the message: delivery must know it may hold UTF-8.
    submission = Submission(sender=txn.sender, recipients=tuple(txn.recipients),
                            spid=new_spid(), smtputf8=txn.smtputf8, client=peer.session)
    accept: Accept | None = None
    hooks = settings.hooks
    if hooks.end_of_data is not None:
        decision = await hooks.run_end_of_data(EndOfData(
            submission=submission, client_ip=peer.ip, client_port=peer.port,
            helo=peer.helo, auth_user=peer.auth_user, tls=tls, size=buf.size,
            header=buf.header_block(), smtputf8=txn.smtputf8))
        if isinstance(decision, Reject):
            registry.bump("messages_refused")
            log.info("%s: message from <%s> rejected by hook: %s", peer.ip, txn.sender,
                     decision.reply)
            return decision.reply
        accept = decision
        submission = decision.apply(submission)
    queue = settings.queue
    spid = submission.spid
    header = received_header(
        helo=peer.helo, client_ip=peer.ip, hostname=settings.hostname,
        protocol=protocol_name(peer.esmtp, tls, peer.auth_user is not None,
                               txn.smtputf8),
        spid=spid,
        recipient=txn.recipients[0] if len(txn.recipients) == 1 else None,
        at=queue.clock())
    content = buf.content(header)
    try:
        if settings.handoff is not None:
            accepted = await settings.handoff.submit(
                submission, content, big=buf.spilled, size=buf.size + len(header),
                origin=Origin(peer.auth_user, peer.ip))
        else:
            accepted = await await_durable(queue.submit_future(submission, content))
    except (StorageError, OSError) as exc:
        registry.bump("queue_failures")
        registry.bump("messages_refused")
        log.warning("%s: message %s from <%s> not queued: %s", peer.ip, spid,
                    txn.sender, exc)
        return QUEUE_FAILED
    registry.bump("messages_accepted")
    registry.bump("bytes_accepted", buf.size)
    if txn.dropped:
        log_suppressed(settings.queue, txn, txn.dropped, accepted.spid, accepted.size)
    if settings.on_accepted is not None:
        settings.on_accepted(accepted, submission)
    if accepted.spid != spid and not accepted.duplicate:  # another process drew it first
        log.info("%s: SPID %s (named in the Received header) was taken; queued as %s",
                 peer.ip, spid, accepted.spid)
    if log.isEnabledFor(logging.DEBUG):
        log.debug("%s: queued as %s from <%s> to %d recipient(s), %d bytes", peer.ip,
                  accepted.spid, txn.sender, len(submission.recipients), accepted.size)
    if accept is not None and accept.reply is not None:
        return accept.reply
    return Reply(250, "2.0.0", f"Ok: queued as {accepted.spid}")


def log_suppressed(queue: Submitting, txn: Transaction, items: list[tuple[str, SuppressionEntry]],
                   spid: str | None, size: int) -> None:
    """One accounting line per suppressed recipient (refused or dropped)."""
    if queue.accounting is None:
        return
    now = queue.clock()
    events = []
    for address, entry in items:
        row = QueueEntry(spid=spid or "", idx=0, sender=txn.sender, recipient=address,
                         state=QueueState.INCOMING, arrival_at=now, next_attempt_at=now,
                         size=size)
        event = make_event(EventKind.SUPPRESSED, row, now, node=queue.node,
                           reply=entry.reply(address), attempt=0)
        event["qid"] = None  # no queue entry exists for this recipient
        event["spid"] = spid
        events.append(event)
    queue.accounting.record(events, now)
