"""The whole life cycle through sluice.queue on real files, with a controlled clock.

submit -> claim -> outcomes (2xx, 4xx with the retry schedule, 5xx) -> expiry
-> NDR queued to the sender (parsed back) -> NDR's own expiry discarded; every
transition written to the accounting log.
"""

from __future__ import annotations

import asyncio
import dataclasses
import email
import email.policy
import email.utils
import json
import time
from collections.abc import Iterator
from datetime import UTC, datetime
from pathlib import Path

import pytest

from sluice.accounting import EVENT_FIELDS, iso_time
from sluice.config import Config
from sluice.journal import SuccessJournal, journal_paths, read_journal
from sluice.marks import MarkLog, mark_of, mark_paths, read_marks
from sluice.model import (
    Delivered,
    PermFail,
    QueueEntry,
    QueueState,
    Reply,
    Selector,
    Submission,
    TempFail,
)
from sluice.queue import AttemptResult, Queue
from sluice.store import Action
from tests.integration.stores import flavour_config

pytestmark = pytest.mark.integration

H = 3600.0
S = QueueState


class Clock:
    """Time moves only when the test says so."""

    def __init__(self, now: float) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        assert seconds >= 0
        self.now += seconds


@pytest.fixture
def clock() -> Clock:
    return Clock(1_800_000_000.0)  # on the 15-minute grid


@pytest.fixture
def cfg(flavour: str, tmp_path: Path) -> Config:
    return flavour_config(flavour, tmp_path, queue={"retry_delays": "30m | 2h | 4h",
                                                    "retry_maxtime": "12h"})


@pytest.fixture
def queue(cfg: Config, clock: Clock) -> Iterator[Queue]:
    q = Queue.open(cfg, clock=clock)
    yield q
    q.close()


def log_lines(cfg: Config) -> list[dict[str, object]]:
    out = []
    for f in sorted(Path(cfg.accounting.path).glob("sluice-acct-*.jsonl")):
        out += [json.loads(line) for line in f.read_text().splitlines()]
    return out


def message(subject: str = "hello") -> bytes:
    return (f"From: alice@example.org\r\nTo: bob@example.net\r\nSubject: {subject}\r\n"
            "Message-ID: <m1@example.org>\r\n\r\nbody\r\n").encode()


def attempt(queue: Queue, outcome_for: dict[str, object]) -> list[QueueEntry]:
    """Claim everything due and report the given outcome per recipient."""
    claimed = queue.claim(100)
    queue.mark_delivering(claimed)
    results = [AttemptResult(e, outcome_for[e.recipient], remotemx="mx.test",  # type: ignore[arg-type]
                             remoteip="127.0.0.1", localip="127.0.0.1", duration_s=0.01)
               for e in claimed]
    queue.record(results)
    return claimed


OK = Delivered(Reply(250, "2.0.0", "queued as X"))
GREY = TempFail(Reply(451, "4.7.1", "greylisted"))
GONE = PermFail(Reply(550, "5.1.1", "no such user"))


def test_delivery_removes_entries_and_content(queue: Queue, cfg: Config) -> None:
    acc = queue.submit(Submission("alice@example.org", ("bob@example.net",)), message())
    attempt(queue, {"bob@example.net": OK})
    assert queue.store.count().recipients == 0
    spool = Path(cfg.queue.spool.rootpath)
    deadline = time.monotonic() + 5  # content is unlinked just after the commit
    while list(spool.rglob(f"{acc.spid}*")) and time.monotonic() < deadline:
        time.sleep(0.01)
    assert not list(spool.rglob(f"{acc.spid}*"))
    events = [(e["event"], e["qid"]) for e in log_lines(cfg)]
    assert events == [("received", acc.qids[0]), ("delivered", acc.qids[0])]


def test_retry_schedule_then_success(queue: Queue, clock: Clock, cfg: Config) -> None:
    acc = queue.submit(Submission("alice@example.org", ("bob@example.net",)), message())
    qid = acc.qids[0]
    t0 = clock.now
    attempt(queue, {"bob@example.net": GREY})
    e = queue.store.get(qid)
    assert e is not None
    assert (e.state, e.attempts, e.next_attempt_at) == (S.DEFERRED, 1, t0 + 30 * 60)
    assert e.last_reply == dataclasses.replace(GREY.reply, attempt_at=t0)  # and when

    clock.advance(29 * 60)
    assert queue.claim(10) == []  # not due yet
    clock.advance(60)
    attempt(queue, {"bob@example.net": GREY})
    e = queue.store.get(qid)
    assert e is not None
    assert (e.attempts, e.next_attempt_at) == (2, clock.now + 2 * H)

    clock.advance(2 * H)
    attempt(queue, {"bob@example.net": OK})
    assert queue.store.get(qid) is None
    kinds = [x["event"] for x in log_lines(cfg)]
    assert kinds == ["received", "deferred", "deferred", "delivered"]
    delivered = log_lines(cfg)[-1]
    assert set(delivered) == set(EVENT_FIELDS)
    assert delivered["attempt"] == 3
    assert delivered["queue_age_s"] == pytest.approx(2.5 * H)
    assert (delivered["remotemx"], delivered["code"]) == ("mx.test", 250)


def _ndrs(queue: Queue) -> list[QueueEntry]:
    return [e for e in queue.store.entries(Selector()) if e.is_report]


def _parse(queue: Queue, spid: str) -> email.message.EmailMessage:
    with queue.store.open_content(spid) as stream:
        raw = stream.read()
    msg = email.message_from_bytes(raw, policy=email.policy.default)
    assert isinstance(msg, email.message.EmailMessage)
    return msg


def test_permanent_failure_sends_one_ndr_for_the_failed_recipients(queue: Queue,
                                                                    cfg: Config) -> None:
    acc = queue.submit(Submission("alice@example.org",
                                  ("bob@example.net", "carol@example.com", "dave@example.net")),
                       message("quarterly report"))
    attempt(queue, {"bob@example.net": GONE, "carol@example.com": OK,
                    "dave@example.net": GONE})
    assert queue.store.count()[S.BOUNCE] == 2
    assert queue.run_bounces() == 1
    (ndr,) = _ndrs(queue)
    assert (ndr.sender, ndr.recipient, ndr.state) == ("", "alice@example.org", S.INCOMING)
    msg = _parse(queue, ndr.spid)
    assert msg.get_content_type() == "multipart/report"
    blocks = list(msg.iter_parts())[1].get_payload()
    assert blocks[0]["X-Sluice-Queue-ID"] == acc.spid
    assert [b["Final-Recipient"] for b in blocks[1:]] == [
        "rfc822; bob@example.net", "rfc822; dave@example.net"]
    assert {b["Status"] for b in blocks[1:]} == {"5.1.1"}
    assert "Subject: quarterly report" in list(msg.iter_parts())[2].get_payload()
    # the original message is gone entirely; only the NDR remains
    assert queue.store.count().messages == 1
    kinds = [x["event"] for x in log_lines(cfg)]
    assert kinds.count("bounced") == 2 and kinds.count("ndr") == 2
    assert kinds.count("delivered") == 1


def test_the_ndr_of_mail_received_with_smtputf8_is_flagged_and_rfc_6533(queue: Queue
                                                                        ) -> None:
    utf8_message = ("From: jürgen@exämple.org\r\nSubject: Grüße\r\n"
                    "Message-ID: <m2@example.org>\r\n\r\nbody\r\n").encode()
    queue.submit(Submission("alice@example.org", ("usér@exämple.net", "bob@example.net"),
                            smtputf8=True), utf8_message)
    queue.submit(Submission("carol@example.org", ("dave@example.net",)), message())
    attempt(queue, {"usér@exämple.net": GONE, "bob@example.net": GONE,
                    "dave@example.net": GONE})
    assert queue.run_bounces() == 2
    by_rcpt = {e.recipient: e for e in _ndrs(queue)}
    flagged, plain = by_rcpt["alice@example.org"], by_rcpt["carol@example.org"]
    # The store gives the flag back: delivery asks for SMTPUTF8 for the NDR.
    assert flagged.smtputf8 and not plain.smtputf8
    with queue.store.open_content(flagged.spid) as stream:
        raw = stream.read()
    msg = _parse(queue, flagged.spid)
    assert [p.get_content_type() for p in msg.iter_parts()] == [
        "text/plain", "message/global-delivery-status", "message/global-headers"]
    assert "\r\n\r\nFinal-Recipient: utf-8; usér@exämple.net\r\n".encode() in raw
    assert b"\r\n\r\nFinal-Recipient: rfc822; bob@example.net\r\n" in raw
    assert utf8_message[:utf8_message.index(b"\r\n\r\n") + 2] + b"\r\n--" in raw
    assert [p.get_content_type() for p in _parse(queue, plain.spid).iter_parts()] == [
        "text/plain", "message/delivery-status", "text/rfc822-headers"]


def test_expiry_bounces_with_the_last_reply_and_ndr_says_so(queue: Queue, clock: Clock,
                                                            cfg: Config) -> None:
    queue.submit(Submission("alice@example.org", ("bob@example.net",)), message())
    # 30m, 2h, 4h, 4h ... within retry_maxtime 12h; keep failing
    for _ in range(20):
        claimed = queue.claim(10)
        if claimed:
            queue.record([AttemptResult(claimed[0], TempFail(Reply(421, "4.4.1",
                                                                   "connection refused")))])
        if queue.store.count()[S.BOUNCE]:
            break
        due = queue.store.due_at()
        assert due is not None
        clock.now = max(clock.now, due)
    assert queue.store.count()[S.BOUNCE] == 1
    assert clock.now - 1_800_000_000.0 == pytest.approx(12 * H)  # the last try at the deadline
    queue.run_bounces()
    (ndr,) = _ndrs(queue)
    blocks = list(_parse(queue, ndr.spid).iter_parts())[1].get_payload()
    assert blocks[1]["Status"] == "4.4.1"
    assert blocks[1]["Action"] == "failed"
    assert "connection refused" in blocks[1]["Diagnostic-Code"]
    assert [x["event"] for x in log_lines(cfg)].count("expired") == 1


def test_the_ndr_names_the_server_and_the_time_of_the_attempt(queue: Queue, clock: Clock
                                                              ) -> None:
    # RFC 3464: Remote-MTA and an smtp Diagnostic-Code for what a server said;
    # X-Sluice for what Sluice said itself; Last-Attempt-Date from the attempt.
    queue.submit(Submission("alice@example.org", ("bob@example.net", "carol@example.com",
                                                  "dave@example.org")), message())
    tried_at = clock.now
    attempt(queue, {
        "bob@example.net": PermFail(Reply(550, "5.1.1", "no such user",
                                          remote_mta="mx1.example.net")),
        "carol@example.com": PermFail(Reply(552, "5.3.4", "message size 99 exceeds the limit "
                                            "of 10 bytes of host mx.example.com")),
        "dave@example.org": GREY,
    })
    clock.advance(30 * 60)
    queue.store.modify(Selector(recipient="dave@example.org"), Action.BOUNCE, clock.now)
    clock.advance(3 * H)  # the NDR is built well after the attempt
    assert queue.run_bounces() == 1
    (ndr,) = _ndrs(queue)
    blocks = {b["Final-Recipient"]: b for b in
              list(_parse(queue, ndr.spid).iter_parts())[1].get_payload()[1:]}
    bob = blocks["rfc822; bob@example.net"]
    assert bob["Remote-MTA"] == "dns; mx1.example.net"
    assert bob["Diagnostic-Code"] == "smtp; 550 5.1.1 no such user"
    assert email.utils.parsedate_to_datetime(bob["Last-Attempt-Date"]).timestamp() == tried_at
    carol = blocks["rfc822; carol@example.com"]
    assert carol["Remote-MTA"] is None
    assert carol["Diagnostic-Code"] == ("X-Sluice; message size 99 exceeds the limit of 10 "
                                        "bytes of host mx.example.com")
    assert carol["Last-Attempt-Date"] == bob["Last-Attempt-Date"]
    # The operator's bounce replaced the reply: no attempt got it.
    dave = blocks["rfc822; dave@example.org"]
    assert dave["Diagnostic-Code"] == "X-Sluice; bounced by the operator"
    assert dave["Last-Attempt-Date"] is None


def test_expiry_sweep_bounces_deferred_mail_without_an_attempt(queue: Queue,
                                                               clock: Clock) -> None:
    acc = queue.submit(Submission("alice@example.org", ("bob@example.net",), delay_s=20 * H),
                       message())
    clock.advance(12 * H)
    assert queue.expire() == 1
    e = queue.store.get(acc.qids[0])
    assert e is not None and e.state is S.BOUNCE
    assert queue.run_bounces() == 1
    (ndr,) = _ndrs(queue)
    blocks = list(_parse(queue, ndr.spid).iter_parts())[1].get_payload()
    assert blocks[1]["Status"] == "4.4.7"  # delivery time expired


def test_never_an_ndr_for_the_null_sender(queue: Queue, cfg: Config) -> None:
    queue.submit(Submission("", ("bob@example.net",)), message())
    attempt(queue, {"bob@example.net": GONE})
    assert queue.run_bounces() == 0
    assert queue.store.count().recipients == 0
    assert [x["event"] for x in log_lines(cfg)][-1] == "discarded"


def test_an_expired_ndr_is_discarded_and_logged(queue: Queue, clock: Clock,
                                                cfg: Config) -> None:
    queue.submit(Submission("alice@example.org", ("bob@example.net",)), message())
    attempt(queue, {"bob@example.net": GONE})
    queue.run_bounces()
    (ndr,) = _ndrs(queue)
    # The sender's server is down for good: NDRs expire after retry_maxtime_reports (24h),
    # before the 12h... no: reports use their own limit; fail it until then.
    for _ in range(30):
        claimed = queue.claim(10)
        if claimed:
            queue.record([AttemptResult(c, GREY) for c in claimed])
        if queue.store.count()[S.BOUNCE]:
            break
        due = queue.store.due_at()
        assert due is not None
        clock.now = max(clock.now, due)
    assert clock.now - ndr.arrival_at == pytest.approx(24 * H)
    assert queue.run_bounces() == 0  # no NDR for an NDR
    assert queue.store.count().recipients == 0
    assert [x["event"] for x in log_lines(cfg)][-1] == "discarded"


def test_operator_actions_are_logged_and_a_late_result_loses(queue: Queue, cfg: Config
                                                             ) -> None:
    acc = queue.submit(Submission("alice@example.org", ("bob@example.net", "c@example.com")),
                       message())
    claimed = queue.claim(10)
    queue.act(Selector(domain="example.net"), Action.HOLD)
    applied = queue.record([AttemptResult(e, GREY) for e in claimed])
    assert [r.entry.recipient for r, _ in applied] == ["c@example.com"]
    assert queue.store.get(acc.qids[0]).state is S.HOLD  # type: ignore[union-attr]
    queue.act(Selector(qids=(acc.qids[0],)), Action.RELEASE)
    queue.act(Selector(qids=(acc.spid,)), Action.PRIORITY, priority=1)
    queue.act(Selector(qids=(acc.spid,)), Action.DELETE)
    kinds = [x["event"] for x in log_lines(cfg)]
    assert kinds == ["received", "received", "held", "deferred", "released", "priority",
                     "priority", "deleted", "deleted"]


def test_operator_bounce_sends_an_ndr(queue: Queue) -> None:
    queue.submit(Submission("alice@example.org", ("bob@example.net",)), message())
    queue.act(Selector(domain="example.net"), Action.BOUNCE,
              reply=Reply(550, "5.7.1", "removed by the postmaster"))
    assert queue.run_bounces() == 1
    (ndr,) = _ndrs(queue)
    blocks = list(_parse(queue, ndr.spid).iter_parts())[1].get_payload()
    assert blocks[1]["Status"] == "5.7.1"


def test_recovery_after_restart_returns_claimed_mail(cfg: Config, clock: Clock) -> None:
    q = Queue.open(cfg, clock=clock)
    acc = q.submit(Submission("alice@example.org", ("bob@example.net",)), message())
    q.claim(10)
    q.close()
    q = Queue.open(cfg, clock=clock)
    try:
        assert q.recover() == 1
        (again,) = q.claim(10)
        assert again.qid == acc.qids[0]
    finally:
        q.close()


def test_recovery_notes_the_attempts_the_mark_log_names(cfg: Config, clock: Clock,
                                                       tmp_path: Path, flavour: str) -> None:
    """Only the mark log had bob's and carol's attempts (the store's marks were not in);
    carol's attempt had ended (deferred, claimed again, not yet tried); dave was
    claimed and never started; erin's mark reached the store as well."""
    paths = mark_paths(tmp_path / "marks", "n1")
    paths[0].parent.mkdir()
    q = Queue.open(cfg, clock=clock)
    q.submit(Submission("alice@example.org", ("bob@example.net", "carol@example.net",
                                              "dave@example.net", "erin@example.net")),
             message())
    claimed = {e.recipient: e for e in q.claim(10)}
    log = MarkLog.open(paths)
    assert log.write([mark_of(claimed[who]) for who in ("bob@example.net", "carol@example.net",
                                                         "erin@example.net")]) == 0
    log.close()
    q.mark_delivering([claimed["erin@example.net"]])
    q.record([AttemptResult(claimed["carol@example.net"], GREY)])
    clock.advance(31 * 60.0)
    (carol,) = q.claim(10)
    assert (carol.recipient, carol.attempts) == ("carol@example.net", 1)
    q.close()  # the crash

    q = Queue.open(cfg, clock=clock)
    try:
        assert q.recover(marked=read_marks(paths)) == 4
    finally:
        q.close()
    noted = sorted(x["recipient"] for x in log_lines(cfg) if x["event"] == "recovered")
    if flavour == "postgres":
        # A queue nodes share: an active entry may be another node's after an
        # outage, so the queue manager keeps no mark log there (sluice.marks).
        assert noted == ["erin@example.net"]
    else:
        assert noted == ["bob@example.net", "erin@example.net"]


def test_recovery_replays_a_journaled_success_the_store_had_not_marked(
        cfg: Config, clock: Clock, tmp_path: Path, flavour: str) -> None:
    """bob's attempt went out on the mark log's line alone; its success reached the
    journal, not the store.  On a queue of one node the journal's line is proof enough."""
    paths = journal_paths(tmp_path / "journal", "n1")
    paths[0].parent.mkdir()
    q = Queue.open(cfg, clock=clock)
    q.submit(Submission("alice@example.org", ("bob@example.net",)), message())
    (bob,) = q.claim(10)

    async def journal_it() -> None:
        journal = SuccessJournal.open(paths, asyncio.get_running_loop())
        await journal.append([AttemptResult(bob, OK)], clock())
        journal.close()

    asyncio.run(journal_it())
    q.close()  # the crash
    q = Queue.open(cfg, clock=clock)
    try:
        q.recover(read_journal(paths), {mark_of(bob)})
        left = q.claim(10)
    finally:
        q.close()
    events = [x["event"] for x in log_lines(cfg) if x["event"] != "received"]
    if flavour == "postgres":  # a shared queue replays only what the store had marked
        assert [e.recipient for e in left] == ["bob@example.net"]
        assert events == []
    else:
        assert left == []
        assert events == ["delivered"]


def test_recovery_records_what_the_success_journal_kept(cfg: Config, clock: Clock,
                                                        tmp_path: Path) -> None:
    """bob's success was journaled only; carol's journaled and committed; dave's neither;
    erin's line names her queue id with another arrival time (not her entry); frank's
    was logged, then journaled, as the recorder does (no second line at the replay)."""
    paths = journal_paths(tmp_path / "journal", "n1")
    paths[0].parent.mkdir()
    q = Queue.open(cfg, clock=clock)
    acc = q.submit(Submission("alice@example.org", ("bob@example.net", "carol@example.net",
                                                    "dave@example.net", "erin@example.net",
                                                    "frank@example.net")),
                   message())
    claimed = q.claim(10)
    q.mark_delivering(claimed)
    result = {e.recipient: AttemptResult(e, OK, remotemx="mx.test", remoteip="127.0.0.2",
                                         localip="127.0.0.1", duration_s=0.5) for e in claimed}
    erin = result["erin@example.net"]
    erin = dataclasses.replace(erin, entry=dataclasses.replace(
        erin.entry, arrival_at=erin.entry.arrival_at - 60))

    replied = clock()
    (frank,) = q.log_successes([result["frank@example.net"]])
    assert frank.logged

    async def journal_them() -> None:
        journal = SuccessJournal.open(paths, asyncio.get_running_loop())
        await journal.append([result["bob@example.net"], result["carol@example.net"], erin,
                              frank], replied)
        journal.close()

    asyncio.run(journal_them())
    q.record([result["carol@example.net"]])
    q.close()  # the crash: bob's, dave's and erin's attempts were in flight

    clock.advance(7200.0)  # the restart, two hours later
    q = Queue.open(cfg, clock=clock)
    try:
        assert q.recover(read_journal(paths)) == 2
        assert sorted(e.recipient for e in q.claim(10)) == ["dave@example.net",
                                                           "erin@example.net"]
    finally:
        q.close()
    events = [(x["event"], x["recipient"]) for x in log_lines(cfg) if x["event"] != "received"]
    assert sorted(events) == [("delivered", "bob@example.net"), ("delivered", "carol@example.net"),
                              ("delivered", "frank@example.net"),
                              ("recovered", "dave@example.net"), ("recovered", "erin@example.net")]
    assert read_journal(paths)[frank.entry.qid].logged
    assert not read_journal(paths)[result["bob@example.net"].entry.qid].logged
    bob = next(x for x in log_lines(cfg) if x["recipient"] == "bob@example.net"
               and x["event"] == "delivered")
    assert (bob["code"], bob["remotemx"], bob["remoteip"], bob["duration_s"], bob["spid"]) == \
        (250, "mx.test", "127.0.0.2", 0.5, acc.spid)
    # bob's line has the time of his reply, dave's the restart's, each in
    # the file of its hour.
    dave = next(x for x in log_lines(cfg) if x["recipient"] == "dave@example.net"
                and x["event"] == "recovered")
    assert (bob["time"], dave["time"]) == (iso_time(replied), iso_time(replied + 7200.0))
    for who, event, at in (("bob@example.net", "delivered", replied),
                           ("dave@example.net", "recovered", replied + 7200.0)):
        hour = datetime.fromtimestamp(at, UTC).strftime("%Y%m%dT%H")
        lines = (Path(cfg.accounting.path) / f"sluice-acct-{hour}.jsonl").read_text()
        assert any(x["recipient"] == who and x["event"] == event
                   for x in map(json.loads, lines.splitlines()))


def test_a_torn_last_line_of_the_journal_is_skipped(tmp_path: Path) -> None:
    first, second = journal_paths(tmp_path, "n1")
    first.write_bytes(b'{"q":"AB12-0","r":[250,"2.0.0","ok"],"l":null,"m":null,"i":null,'
                      b'"d":null}\n{"q":"AB12-1","r":[250')
    kept = read_journal([first, second])
    assert list(kept) == ["AB12-0"] and kept["AB12-0"].reply == Reply(250, "2.0.0", "ok")
    assert read_journal([tmp_path / "absent"]) == {}
