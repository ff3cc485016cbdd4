"""The HTTP injection API's work: check, render, claim keys, submit durably, answer.

SUMMARY
    injector = Injector(control)          # settles the idempotency index at start
    await injector.inject(body, who, client_ip) -> InjectResult as a dict

DESCRIPTION
    One request, in this order:

    1. admit     back-pressure: 429 when the queue holds more than
                 ``api.inject.max_queue`` recipients, 503 when recent
                 submissions took longer than ``max_commit_time`` to become
                 durable or the store fails; both with Retry-After, and
                 nothing queued.
    2. check     envelope sender and recipients (sluice.address: RFC 5321
                 and 6531, IDN domains as A-labels) and the suppression
                 list (``suppression.path``): refused per recipient.
    3. build     a complete message is queued once for all its
                 recipients; a template is rendered per recipient (Jinja2,
                 sandboxed, a missing substitution refuses the recipient)
                 into a multipart/alternative message.  Every message gets
                 a Received line ("with HTTP").
    4. claim     recipients with an idempotency key are claimed in the
                 index (sluice.idempotency) under the queue id they will
                 get -- the SPID is drawn before submitting -- and the
                 claim is fsynced.  A key known already is answered with
                 its first queue id and left out.
    5. submit    every message through Queue.submit_future, the path the
                 SMTP receiver takes; the answer waits until all are
                 durable (the store's group commit takes them together).
    6. confirm   the keys of what was queued; a failed submission's keys
                 are forgotten and its recipients refused with 451.

STRATEGIES
    Same durability as SMTP: the submissions are the receiver's, so a
    "queued" means what 250 means.  The request handler never blocks the
    loop: spool writes and index writes run in the API's threads.

    Back-pressure with a probe.  The commit time is a moving average of
    this API's own submissions; while it is too high requests are turned
    away for ``retry_after`` after the last sample, then one gets through
    and measures again.  The queue size is read at most once a second.

    Rendering is sluice.api.rendering's: the common message is written
    directly, not through the email package (most of a request's time).

SEE ALSO
    sluice.api.inject (route, models), sluice.api.rendering, sluice.idempotency, sluice.address,
    sluice.smtpd.handoff (await_durable), docs/api.md
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import jinja2

from sluice.accounting import EventKind, make_event
from sluice.address import Invalid, Mailbox, check
from sluice.api.control import ApiError, Control
from sluice.api.rendering import render
from sluice.idempotency import Claim, Hit, IdempotencyIndex, fingerprint, in_store
from sluice.model import (
    Accepted,
    QueueEntry,
    QueueState,
    Reply,
    Submission,
    ascii_envelope,
    format_qid,
    utf8_header,
)
from sluice.smtpd.handoff import await_durable
from sluice.smtpd.trace import received_header
from sluice.spool import new_spid
from sluice.store import StorageError
from sluice.suppression import SuppressionEntry, SuppressionFileError, SuppressionList

if TYPE_CHECKING:
    import concurrent.futures

    from sluice.api.inject import InjectMessage, InjectRequest

__all__ = ["Injector"]

log = logging.getLogger("sluice.api")

#: How long a count of the queue is used for back-pressure.
COUNT_TTL_S = 1.0

#: Weight of the newest commit time in the moving average.
EWMA_WEIGHT = 0.3

#: How often expired idempotency keys are removed.
EXPIRE_EVERY_S = 60.0

#: Rounds of claiming when concurrent requests race for keys.
CLAIM_ROUNDS = 3

BAD_SENDER = Reply(553, "5.1.7", "bad sender address syntax")
BAD_CONTENT = Reply(554, "5.6.0", "content is not a message")
TOO_BIG = Reply(552, "5.3.4", "message size exceeds fixed maximum message size")
KEY_TWICE = Reply(550, "5.5.0", "the idempotency key appears twice in this request")
KEY_OTHER = Reply(550, "5.7.0", "the idempotency key was used for another recipient or sender")
KEY_BUSY = Reply(451, "4.5.0", "a request with this idempotency key is being queued; try again")
NOT_QUEUED = Reply(451, "4.3.0", "the queue could not store the message; try again")


def _reply_data(email: str, reply: Reply) -> dict[str, Any]:
    return {"email": email, "status": "refused", "code": reply.code,
            "enhanced": reply.enhanced or None, "reason": reply.text}


def recipient_key(msg: InjectMessage, mi: int, ri: int, request_key: str | None
                  ) -> str | None:
    """A recipient's idempotency key: its own, else one derived from the request's.

    Derived from the request's Idempotency-Key header and its place in the
    request (a space cannot occur in a key of its own, so the two never
    collide).
    """
    own = msg.recipients[ri].idempotency_key
    if own:
        return own
    return f"{request_key} {mi}.{ri}" if request_key else None


@dataclass(slots=True)
class _Rcpt:
    slot: tuple[int, int]  # (message, recipient) index in the request
    address: str  # normalised
    key: str | None = None


@dataclass(slots=True)
class _Plan:
    """One submission to make: its recipients and its content."""

    message: int
    rcpts: list[_Rcpt]
    body: bytes
    smtputf8: bool
    spid: str = field(default_factory=new_spid)

    def qid(self, rcpt: _Rcpt) -> str:
        return format_qid(self.spid, self.rcpts.index(rcpt))


def _normal_lines(text: str) -> bytes:
    data = text.encode("utf-8")
    return data.replace(b"\r\n", b"\n").replace(b"\r", b"\n").replace(b"\n", b"\r\n")


class Injector:
    """The injection API of one running server."""

    def __init__(self, control: Control) -> None:
        self.control = control
        cfg = control.config
        self.settings = cfg.api.inject
        self.index = IdempotencyIndex(Path(cfg.queue.path) / "idempotency.db",
                                      self.settings.idempotency_window)
        # Before the queue manager delivers anything: keys claimed by a run
        # that crashed are settled against what the queue holds.
        confirmed, forgotten = self.index.settle(in_store(control.queue.store))
        if confirmed or forgotten:
            log.info("idempotency keys pending at the last stop: %d queued, %d not",
                     confirmed, forgotten)
        try:
            self.suppression: SuppressionList | None = SuppressionList.load(
                cfg.suppression.path)
        except SuppressionFileError as exc:
            log.error("injection API: %s; suppression is off for injected mail", exc)
            self.suppression = None
        self._count: tuple[float, int] | None = None
        self._commit_s = 0.0
        self._sampled_at = 0.0
        self._expired_at = 0.0

    # -- 1. admit -------------------------------------------------------------------

    def _busy(self, status: int, error: str, detail: str) -> ApiError:
        wait = max(1, round(self.settings.retry_after))
        return ApiError(status, error, detail, headers={"Retry-After": str(wait)})

    async def _admit(self, now: float) -> None:
        if self._count is None or now - self._count[0] >= COUNT_TTL_S:
            try:
                counts = await self.control.io(self.control.queue.store.count)
            except ApiError:
                raise self._busy(503, "storage unavailable", "the queue cannot be read") from None
            self._count = (now, counts.recipients)
        queued = self._count[1]
        if queued > self.settings.max_queue:
            raise self._busy(429, "queue full",
                             f"{queued} recipients queued, more than api.inject.max_queue "
                             f"({self.settings.max_queue})")
        if (self._commit_s > self.settings.max_commit_time
                and now < self._sampled_at + self.settings.retry_after):
            raise self._busy(503, "store slow",
                             f"submissions took {self._commit_s:.2f} s to become durable, "
                             f"more than api.inject.max_commit_time")

    def _sample(self, seconds: float, now: float) -> None:
        self._commit_s = seconds if not self._sampled_at else (
            EWMA_WEIGHT * seconds + (1 - EWMA_WEIGHT) * self._commit_s)
        self._sampled_at = now

    # -- 2, 3. check and build -------------------------------------------------------

    def _suppressed(self, address: str) -> SuppressionEntry | None:
        return self.suppression.lookup(address) if self.suppression is not None else None

    def _plans_for(self, mi: int, msg: InjectMessage, who: str, client: str, now: float,
                   answers: dict[tuple[int, int], dict[str, Any]],
                   suppressed: list[tuple[str, str, SuppressionEntry]],
                   request_key: str | None = None) -> list[_Plan]:
        sender = check(msg.envelope_sender)
        accepted: list[tuple[int, Mailbox]] = []
        for ri, r in enumerate(msg.recipients):
            if isinstance(sender, Invalid):
                answers[(mi, ri)] = _reply_data(r.email, Reply(
                    BAD_SENDER.code, BAD_SENDER.enhanced, f"{BAD_SENDER.text}: {sender.reason}"))
                continue
            box = check(r.email)
            if isinstance(box, Invalid):
                answers[(mi, ri)] = _reply_data(
                    r.email, Reply(553, "5.1.3", f"bad recipient address syntax: {box.reason}"))
                continue
            entry = self._suppressed(box.address)
            if entry is not None:
                answers[(mi, ri)] = _reply_data(r.email, entry.reply(box.address))
                suppressed.append((box.address, sender.address, entry))
                continue
            accepted.append((ri, box))
        if not accepted or isinstance(sender, Invalid):
            return []
        hostname = self.control.config.node.hostname
        plans = []
        if isinstance(msg.content, str):
            body = _normal_lines(msg.content)
            if b":" not in body.split(b"\r\n", 1)[0]:
                for ri, _ in accepted:
                    answers[(mi, ri)] = _reply_data(msg.recipients[ri].email, Reply(
                        BAD_CONTENT.code, BAD_CONTENT.enhanced,
                        f"{BAD_CONTENT.text}: it does not start with a header field"))
                return []
            utf8 = (not ascii_envelope(sender.address, [b.address for _, b in accepted])
                    or utf8_header(body))
            plans.append(_Plan(mi, [_Rcpt((mi, ri), box.address,
                                          recipient_key(msg, mi, ri, request_key))
                                    for ri, box in accepted], body, utf8))
        else:
            for ri, box in accepted:
                r = msg.recipients[ri]
                values = {**msg.substitutions, **r.substitutions}
                values.setdefault("email", box.address)
                values.setdefault("name", r.name or "")
                try:
                    body = render(msg.content, values, box.address, r.name, hostname, now)
                except (jinja2.TemplateError, ValueError, TypeError) as exc:
                    answers[(mi, ri)] = _reply_data(r.email,
                                                    Reply(550, "5.6.0", f"template: {exc}"))
                    continue
                utf8 = not ascii_envelope(sender.address, [box.address]) or utf8_header(body)
                plans.append(_Plan(mi, [_Rcpt((mi, ri), box.address,
                                              recipient_key(msg, mi, ri, request_key))],
                                   body, utf8))
        limit = self.control.config.smtpd.max_message_size
        for p in plans:
            if len(p.body) > limit:
                for big in p.rcpts:
                    answers[big.slot] = _reply_data(msg.recipients[big.slot[1]].email, TOO_BIG)
        return [p for p in plans if len(p.body) <= limit]

    # -- 4. claim ------------------------------------------------------------------------

    async def _claim(self, scope: str, plans: list[_Plan], body: InjectRequest,
                     answers: dict[tuple[int, int], dict[str, Any]]) -> list[_Plan]:
        """Claim the keys of ``plans``; returns the plans left to submit."""
        seen: set[str] = set()
        for p in plans:  # a key twice in one request: the later ones are refused
            for r in list(p.rcpts):
                if r.key is None:
                    continue
                if r.key in seen:
                    answers[r.slot] = _reply_data(self._email(body, r), KEY_TWICE)
                    p.rcpts.remove(r)
                seen.add(r.key)
        plans = [p for p in plans if p.rcpts]
        unclaimed = [p for p in plans if any(r.key for r in p.rcpts)]
        for _ in range(CLAIM_ROUNDS):
            if not unclaimed:
                break
            claims = [Claim(r.key, fingerprint(r.address, self._sender(body, p)), p.qid(r))
                      for p in unclaimed for r in p.rcpts if r.key is not None]
            known = await self.control.io(self.index.remember, scope, claims)
            if not known:
                break
            retry = []
            for p in unclaimed:
                hits = [r for r in p.rcpts if r.key in known]
                if not hits:
                    continue
                # Our fresh claims of this plan name queue ids that change now.
                ours = [r.key for r in p.rcpts if r.key is not None and r.key not in known]
                await self.control.io(self.index.forget, scope, ours)
                for r in hits:
                    assert r.key is not None
                    answers[r.slot] = self._known(body, p, r, known[r.key])
                    p.rcpts.remove(r)
                if p.rcpts:
                    p.spid = new_spid()
                    retry.append(p)
            unclaimed = retry
        else:
            for p in unclaimed:  # still racing after several rounds: let them retry
                for r in p.rcpts:
                    answers[r.slot] = _reply_data(self._email(body, r), KEY_BUSY)
                p.rcpts.clear()
        return [p for p in plans if p.rcpts]

    @staticmethod
    def _email(body: InjectRequest, r: _Rcpt) -> str:
        return body.messages[r.slot[0]].recipients[r.slot[1]].email

    @staticmethod
    def _sender(body: InjectRequest, p: _Plan) -> str:
        box = check(body.messages[p.message].envelope_sender)
        assert isinstance(box, Mailbox)
        return box.address

    def _known(self, body: InjectRequest, p: _Plan, r: _Rcpt, hit: Hit) -> dict[str, Any]:
        email = self._email(body, r)
        if hit.fingerprint != fingerprint(r.address, self._sender(body, p)):
            return _reply_data(email, KEY_OTHER)
        if not hit.done:
            return _reply_data(email, KEY_BUSY)
        return {"email": email, "status": "queued", "queue_id": hit.qid, "duplicate": True}

    # -- 5. submit ------------------------------------------------------------------------

    def _start(self, subs: list[tuple[Submission, list[bytes]]]
               ) -> list[concurrent.futures.Future[Accepted] | BaseException]:
        out: list[concurrent.futures.Future[Accepted] | BaseException] = []
        for sub, content in subs:
            try:
                out.append(self.control.queue.submit_future(sub, content))
            except (StorageError, OSError) as exc:
                out.append(exc)
        return out

    async def _submit(self, plans: list[_Plan], body: InjectRequest, who: str, client: str,
                      now: float) -> list[Accepted | BaseException]:
        hostname = self.control.config.node.hostname
        subs = []
        for p in plans:
            msg = body.messages[p.message]
            sub = Submission(sender=self._sender(body, p),
                             recipients=tuple(r.address for r in p.rcpts),
                             tenantid=msg.tenant, jobid=msg.job, priority=msg.priority,
                             spid=p.spid, smtputf8=p.smtputf8)
            trace = received_header(helo=who, client_ip=client, hostname=hostname,
                                    protocol="HTTP", spid=p.spid,
                                    recipient=p.rcpts[0].address if len(p.rcpts) == 1 else None,
                                    at=now)
            subs.append((sub, [trace, p.body]))
        started = time.monotonic()
        futures = await asyncio.get_running_loop().run_in_executor(
            self.control.pool, self._start, subs)
        waits = [await_durable(f) for f in futures if not isinstance(f, BaseException)]
        settled = iter(await asyncio.gather(*waits, return_exceptions=True))
        results: list[Accepted | BaseException] = [
            f if isinstance(f, BaseException) else next(settled) for f in futures]
        if any(isinstance(r, Accepted) for r in results):
            self._sample(time.monotonic() - started, time.time())
        return results

    # -- the request -----------------------------------------------------------------------

    async def inject(self, body: InjectRequest, who: str, client: str,
                     request_key: str | None = None) -> dict[str, Any]:
        """One request; ``request_key``: its Idempotency-Key header, if any."""
        total = sum(len(m.recipients) for m in body.messages)
        if total > self.settings.max_recipients:
            raise ApiError(422, "too many recipients",
                           f"{total} recipients in one request; api.inject.max_recipients is "
                           f"{self.settings.max_recipients}")
        now = time.time()
        await self._admit(now)
        answers: dict[tuple[int, int], dict[str, Any]] = {}
        suppressed: list[tuple[str, str, SuppressionEntry]] = []
        plans = []
        for mi, msg in enumerate(body.messages):
            plans += self._plans_for(mi, msg, who, client, now, answers, suppressed,
                                     request_key)
        if suppressed:
            self._log_suppressed(suppressed, now)
        plans = await self._claim(who, plans, body, answers)
        results = await self._submit(plans, body, who, client, now) if plans else []
        done: dict[str, str] = {}
        failed: list[str] = []
        queued = 0
        for p, res in zip(plans, results, strict=True):
            if isinstance(res, Accepted):
                for r, qid in zip(p.rcpts, res.qids, strict=True):
                    answers[r.slot] = {"email": self._email(body, r), "status": "queued",
                                       "queue_id": qid}
                    if r.key is not None:
                        done[r.key] = qid
                queued += len(p.rcpts)
            else:
                log.warning("injection: a submission failed: %s", res)
                for r in p.rcpts:
                    answers[r.slot] = _reply_data(self._email(body, r), NOT_QUEUED)
                    if r.key is not None:
                        failed.append(r.key)
        if done or failed:
            await self.control.io(self._settle_keys, who, done, failed)
        if queued:
            self.control.manager.notify_mail(queued)
        elif plans:
            # Nothing could be stored: the client should wait, not give up.
            raise self._busy(503, "storage unavailable", "no message could be queued")
        if now - self._expired_at >= EXPIRE_EVERY_S:
            self._expired_at = now
            await self.control.io(self.index.expire, now)
        messages = [{"recipients": [answers[(mi, ri)] for ri in range(len(m.recipients))]}
                    for mi, m in enumerate(body.messages)]
        flat = [a for m in messages for a in m["recipients"]]
        return {"queued": sum(1 for a in flat if a["status"] == "queued"),
                "refused": sum(1 for a in flat if a["status"] == "refused"),
                "duplicates": sum(1 for a in flat if a.get("duplicate")),
                "messages": messages}

    def _settle_keys(self, scope: str, done: dict[str, str], failed: list[str]) -> None:
        self.index.confirm(scope, done)
        self.index.forget(scope, failed)

    def _log_suppressed(self, items: list[tuple[str, str, SuppressionEntry]], now: float) -> None:
        queue = self.control.queue
        if queue.accounting is None:
            return
        events = []
        for address, sender, entry in items:
            row = QueueEntry(spid="", idx=0, sender=sender, recipient=address,
                             state=QueueState.INCOMING, arrival_at=now, next_attempt_at=now)
            event = make_event(EventKind.SUPPRESSED, row, now, node=queue.node,
                               reply=entry.reply(address), attempt=0)
            event["qid"] = None  # no queue entry exists for this recipient
            event["spid"] = None
            events.append(event)
        queue.accounting.record(events, now)
