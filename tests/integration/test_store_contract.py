"""The store contract: every flavour must pass all of this, on real files.

Life cycle, refill order with quota_deferred, the ``expect`` rule, restart
recovery, operator actions and selectors, listing with cursors, counts,
qshape buckets, expiry selection, content lifetime.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import hashlib
import threading
import time
from pathlib import Path

import pytest

from sluice.model import QueueState, Reply, Selector, Submission
from sluice.spool import new_spid
from sluice.store import (
    ACTION_STATES,
    Action,
    ReadsContentsAhead,
    StorageError,
    Store,
    Transition,
)
from sluice.store._actions import OperatorChange
from tests.integration.stores import open_flavour

pytestmark = pytest.mark.integration

T0 = 1_800_000_000.0
S = QueueState


def sub(*rcpts: str, sender: str = "alice@example.org", **kw: object) -> Submission:
    return Submission(sender=sender, recipients=rcpts or ("bob@example.net",), **kw)  # type: ignore[arg-type]


def body(n: int = 0) -> bytes:
    return f"Subject: message {n}\r\n\r\nbody {n}\r\n".encode()


def states(store: Store) -> dict[str, QueueState]:
    return {e.qid: e.state for e in store.entries(Selector())}


def read(store: Store, spid: str) -> bytes:
    with store.open_content(spid) as stream:
        return stream.read()


def test_contents_read_ahead_are_the_inline_ones_byte_for_byte(store: Store) -> None:
    if not isinstance(store, ReadsContentsAhead):
        assert store.flavour not in ("sqlite", "postgres"), f"{store.flavour} reads ahead"
        pytest.skip(f"{store.flavour}: each delivery reads its own content")
    small = store.submit(sub(), body(1), T0)
    big_body = b"Subject: big\r\n\r\n" + b"x" * (store.ahead_max + 10) + b"\r\n"
    big = store.submit(sub(), big_body, T0)
    got = store.inline_contents([small.spid, big.spid, new_spid()])
    # Only a small message is read ahead (an inline one for SQLite, and
    # sqlite_files keeps none inline; one of a chunk for PostgreSQL); the
    # rest is opened as before.
    want = {small.spid: body(1)} if len(body(1)) <= store.ahead_max else {}
    assert got == want
    assert read(store, small.spid) == body(1) and read(store, big.spid) == big_body
    assert store.inline_contents([]) == {}
    # What is not read ahead is opened with open_large, whatever its size.
    for acc, data in ((big, big_body), (small, body(1))):
        with store.open_large(acc.spid) as stream:
            assert stream.read() == data


# -- submission --------------------------------------------------------------------------

def test_submit_creates_one_entry_per_recipient_with_its_fields(store: Store) -> None:
    acc = store.submit(
        sub("b@one.org", "c@Two.ORG", tenantid="t1", jobid="j1", transportid="tr",
            localip=("192.0.2.1", "192.0.2.2"), priority=1),
        body(), T0)
    assert len(acc.qids) == 2 and acc.size == len(body())
    entries = list(store.entries(Selector()))
    assert [e.qid for e in entries] == list(acc.qids)
    e0, e1 = entries
    assert (e0.recipient, e0.domain, e1.domain) == ("b@one.org", "one.org", "two.org")
    for e in entries:
        assert e.state is S.INCOMING
        assert (e.tenantid, e.jobid, e.transportid) == ("t1", "j1", "tr")
        assert e.localip == ("192.0.2.1", "192.0.2.2")
        assert e.priority == 1 and e.attempts == 0 and e.last_reply is None
        assert e.arrival_at == T0 and e.size == acc.size and not e.is_report
    assert read(store, acc.spid) == body()
    assert store.get(acc.qids[1]) == e1
    c = store.count()
    assert (c.messages, c.recipients, c[S.INCOMING]) == (1, 2, 2)


def test_hold_and_delay_at_submission(store: Store) -> None:
    held = store.submit(sub(hold=True), body(1), T0)
    later = store.submit(sub(delay_s=600), body(2), T0)
    assert store.get(held.qids[0]).state is S.HOLD  # type: ignore[union-attr]
    e = store.get(later.qids[0])
    assert e is not None and e.state is S.DEFERRED and e.next_attempt_at == T0 + 600
    assert store.claim(10, T0 + 599, 10) == []
    assert [x.qid for x in store.claim(10, T0 + 600, 10)] == [later.qids[0]]


def test_null_sender_and_reports_are_kept(store: Store) -> None:
    acc = store.submit(sub(sender="", is_report=True), body(), T0)
    e = store.get(acc.qids[0])
    assert e is not None and e.sender == "" and e.is_report


def test_the_smtputf8_flag_stays_with_every_entry_of_its_message(store: Store) -> None:
    """Received with SMTPUTF8: every entry says so, listed, got, claimed,
    deferred (a rewrite in some flavours) and claimed again; other mail not."""
    flagged = store.submit(sub("b@one.org", "c@two.org", smtputf8=True), body(1), T0)
    plain = store.submit(sub(), body(2), T0 + 1)
    want = {flagged.qids[0]: True, flagged.qids[1]: True, plain.qids[0]: False}
    assert {e.qid: e.smtputf8 for e in store.entries(Selector())} == want
    assert store.get(flagged.qids[1]).smtputf8  # type: ignore[union-attr]
    claimed = store.claim(10, T0 + 1, 10)
    assert {e.qid: e.smtputf8 for e in claimed} == want
    store.apply([Transition(e.qid, S.DEFERRED, next_attempt_at=T0 + 50, attempted=True)
                 for e in claimed])
    assert {e.qid: e.smtputf8 for e in store.claim(10, T0 + 50, 10)} == want


def test_concurrent_submissions_are_all_durable_and_distinct(store: Store) -> None:
    with concurrent.futures.ThreadPoolExecutor(16) as pool:
        accs = list(pool.map(lambda i: store.submit(sub(), body(i), T0), range(200)))
    assert len({a.spid for a in accs}) == 200
    assert store.count().messages == 200
    for i, a in enumerate(accs[:20]):
        assert read(store, a.spid) == body(i)


@pytest.mark.parametrize("size", [100, 200_000], ids=["small", "big"])
def test_a_spid_drawn_by_the_caller_is_used_unless_taken(store: Store, size: int) -> None:
    """The SMTP server draws the SPID to name it in the Received header; a
    SPID already in use (another process drew it too) gets a fresh one."""
    data = [b"Subject: %d\r\n\r\n" % i + b"x" * size for i in range(3)]
    first = store.submit(sub(spid="0123456789ABCDEF"), data[0], T0)
    again = store.submit(sub(spid="0123456789ABCDEF"), data[1], T0)
    other = store.submit(sub(), data[2], T0)
    assert first.spid == "0123456789ABCDEF" and first.qids == ("0123456789ABCDEF-0",)
    assert again.spid not in ("0123456789ABCDEF", other.spid)
    assert [read(store, a.spid) for a in (first, again, other)] == data
    assert store.count().messages == 3
    with pytest.raises(ValueError, match="not a SPID"):
        sub(spid="not-hex")


def test_submit_future_resolves_after_the_commit(store: Store) -> None:
    futs = [store.submit_future(sub(), body(i), T0) for i in range(50)]
    done = [f.result(timeout=30) for f in futs]
    assert store.count().recipients == 50
    assert {d.spid for d in done} == {e.spid for e in store.entries(Selector())}


# -- refill ------------------------------------------------------------------------------

def test_claim_takes_incoming_fifo_with_priority_first(store: Store) -> None:
    normal = [store.submit(sub(), body(i), T0 + i) for i in range(3)]
    urgent = store.submit(sub(priority=1), body(9), T0 + 10)
    claimed = store.claim(10, T0 + 20, 10)
    assert [e.spid for e in claimed] == [urgent.spid] + [a.spid for a in normal]
    assert all(e.state is S.ACTIVE for e in claimed)
    assert store.claim(10, T0 + 20, 10) == []  # nothing is claimed twice
    assert store.count()[S.ACTIVE] == 4


def test_claim_respects_the_limit(store: Store) -> None:
    for i in range(7):
        store.submit(sub(), body(i), T0 + i)
    assert len(store.claim(5, T0 + 10, 10)) == 5
    assert len(store.claim(5, T0 + 10, 10)) == 2


def _defer_all(store: Store, at: float) -> None:
    claimed = store.claim(1000, T0, 0)
    store.apply([Transition(e.qid, S.DEFERRED, next_attempt_at=at, attempted=True)
                 for e in claimed])


def test_quota_deferred_gives_deferred_mail_its_share(store: Store) -> None:
    for i in range(30):
        store.submit(sub(), body(i), T0)
    _defer_all(store, T0 + 100)  # 30 deferred, due at T0+100
    for i in range(30):
        store.submit(sub(), body(100 + i), T0 + 50)  # 30 new
    claimed = store.claim(10, T0 + 200, 20)
    kinds = ["d" if e.attempts else "i" for e in claimed]
    assert kinds.count("d") == 2 and kinds.count("i") == 8  # 20 % of 10 from deferred
    # One from each in turn while both last (Postfix): i d i d i i i i i i
    assert kinds[:4] == ["i", "d", "i", "d"]


def test_deferred_fill_idle_capacity_and_only_when_due(store: Store) -> None:
    for i in range(5):
        store.submit(sub(), body(i), T0)
    _defer_all(store, T0 + 100)
    store.submit(sub(), body(9), T0 + 1)
    assert len(store.claim(10, T0 + 99, 10)) == 1  # deferred not due yet
    claimed = store.claim(10, T0 + 100, 10)
    assert len(claimed) == 5 and all(e.attempts == 1 for e in claimed)


def test_quota_zero_still_takes_deferred_when_incoming_is_empty(store: Store) -> None:
    for i in range(3):
        store.submit(sub(), body(i), T0)
    _defer_all(store, T0)
    assert len(store.claim(10, T0, 0)) == 3


def test_a_refill_smaller_than_the_due_backlog_takes_priority_then_the_earliest_due(
        store: Store) -> None:
    early = [store.submit(sub(), body(i), T0 + i) for i in range(4)]
    late = [store.submit(sub(), body(10 + i), T0 + 10 + i) for i in range(4)]
    urgent = store.submit(sub(priority=1), body(20), T0 + 20)
    claimed = {e.spid: e for e in store.claim(1000, T0 + 30, 0)}
    assert len(claimed) == 9
    # Two due times far apart (their own directories in the fs flavour), the
    # urgent one due last, and the later ones deferred first.
    due = {**{a.spid: T0 + 50_000 for a in [*late, urgent]}, **{a.spid: T0 + 100 for a in early}}
    for spid in [a.spid for a in [*late, urgent, *early]]:
        store.apply([Transition(claimed[spid].qid, S.DEFERRED, next_attempt_at=due[spid],
                                attempted=True)])
    first = store.claim(3, T0 + 100_000, 10)
    assert [e.spid for e in first] == [urgent.spid, early[0].spid, early[1].spid]
    rest = store.claim(4, T0 + 100_000, 10)
    assert [e.spid for e in rest] == [early[2].spid, early[3].spid, late[0].spid, late[1].spid]
    assert [e.spid for e in store.claim(10, T0 + 100_000, 10)] == [a.spid for a in late[2:]]


def test_due_at_is_the_earliest_deferred_time(store: Store) -> None:
    assert store.due_at() is None
    a = store.submit(sub(delay_s=500), body(1), T0)
    store.submit(sub(delay_s=200), body(2), T0)
    assert store.due_at() == T0 + 200
    assert a.spid


def test_oldest_is_the_first_arrival_of_each_state(store: Store) -> None:
    assert store.oldest() == {}

    def at(x: int, **kw: object) -> None:
        spid = new_spid(int((T0 + x) * 1000))  # the SPID says when, as a real one does
        store.submit(sub(spid=spid, **kw), body(x), T0 + x)

    at(0, delay_s=900)  # deferred, due last: the oldest is by arrival, not by due time
    at(10, hold=True)
    at(20, delay_s=100)
    at(30)
    at(40)
    assert store.oldest() == pytest.approx({S.DEFERRED: T0, S.HOLD: T0 + 10,
                                            S.INCOMING: T0 + 30})
    assert [e.spid for e in store.claim(1, T0 + 50, 0)]
    assert store.oldest() == pytest.approx({S.DEFERRED: T0, S.HOLD: T0 + 10,
                                            S.ACTIVE: T0 + 30, S.INCOMING: T0 + 40})


# -- outcomes ------------------------------------------------------------------------------

def test_delivered_entries_leave_and_content_goes_with_the_last(store: Store) -> None:
    acc = store.submit(sub("a@x.org", "b@y.org"), body(), T0)
    e0, e1 = store.claim(10, T0, 10)
    assert store.apply([Transition(e0.qid, None, reply=Reply(250, "2.0.0", "ok"))]) == {e0.qid}
    assert read(store, acc.spid) == body()  # one recipient left
    store.apply([Transition(e1.qid, None)])
    assert store.count().recipients == 0 and store.count().messages == 0
    assert _content_goes(store, acc.spid)


def test_one_call_for_all_recipients_of_a_message_reports_each(store: Store) -> None:
    """The recipients of one transaction in one apply (SQLite runs them as one
    statement): each is reported by itself, and one not in the expected
    state is neither changed nor reported."""
    acc = store.submit(sub("a@x.org", "b@x.org", "c@x.org", "d@x.org"), body(), T0)
    e0, e1, e2, e3 = store.claim(10, T0, 10)
    store.apply([Transition(e2.qid, S.HOLD)])
    marked = store.apply([Transition(e.qid, S.DELIVERING, expect=(S.ACTIVE,))
                          for e in (e0, e1, e2, e3)])
    assert marked == {e0.qid, e1.qid, e3.qid}
    assert states(store) == {e0.qid: S.DELIVERING, e1.qid: S.DELIVERING, e2.qid: S.HOLD,
                             e3.qid: S.DELIVERING}
    ok = Reply(250, "2.0.0", "ok")
    gone = store.apply([Transition(e.qid, None, reply=ok, expect=(S.DELIVERING,))
                        for e in (e0, e1, e2, e3)])
    assert gone == {e0.qid, e1.qid, e3.qid}
    assert states(store) == {e2.qid: S.HOLD}
    assert read(store, acc.spid) == body()  # the held recipient keeps the content
    # The same entry twice in one call: applied in order, not grouped.
    twice = store.apply([Transition(e2.qid, S.DEFERRED, next_attempt_at=T0, expect=(S.HOLD,)),
                         Transition(e2.qid, S.HOLD, expect=(S.HOLD,))])
    assert twice == {e2.qid} and states(store) == {e2.qid: S.DEFERRED}
    store.apply([Transition(e2.qid, None)])
    assert _content_goes(store, acc.spid)


def test_outcomes_applied_without_a_flush_still_apply_and_free_content(store: Store) -> None:
    acc = store.submit(sub(), body(), T0)
    (e,) = store.claim(10, T0, 10)
    assert store.apply([Transition(e.qid, None, reply=Reply(250, "2.0.0", "ok"))],
                       durable=False) == {e.qid}
    assert store.count().recipients == 0
    assert _content_goes(store, acc.spid)


def test_apply_future_resolves_to_what_apply_returns(store: Store) -> None:
    # The queue manager's loop waits for this future instead of a thread.
    store.submit(sub("a@example.net", "b@example.net"), body(), T0)
    first, second = store.claim(10, T0, 10)
    assert store.apply_future([]).result(10) == set()
    marked = store.apply_future(
        [Transition(q, QueueState.DELIVERING, expect=(QueueState.ACTIVE,))
         for q in (first.qid, second.qid)], durable=False)
    assert marked.result(10) == {first.qid, second.qid}
    again = store.apply_future([Transition(first.qid, QueueState.DELIVERING,
                                           expect=(QueueState.ACTIVE,))])
    assert again.result(10) == set()  # no longer active: not applied
    gone = store.apply_future([Transition(first.qid, None)])
    assert gone.result(10) == {first.qid}
    assert store.get(first.qid) is None
    assert store.get(second.qid).state is QueueState.DELIVERING  # type: ignore[union-attr]


def _content_goes(store: Store, spid: str, within: float = 5) -> bool:
    """True once the content of ``spid`` cannot be read (unlinks may run
    on a background thread after the commit)."""
    deadline = time.monotonic() + within
    while True:
        try:
            read(store, spid)
        except (StorageError, FileNotFoundError):
            return True
        if time.monotonic() > deadline:
            return False
        time.sleep(0.01)


def test_deferral_records_reply_attempts_and_time(store: Store) -> None:
    acc = store.submit(sub(), body(), T0)
    (e,) = store.claim(10, T0, 10)
    reply = Reply(451, "4.7.1", "greylisted, try later")
    assert store.apply([Transition(e.qid, S.DEFERRED, next_attempt_at=T0 + 1800, reply=reply,
                                   attempted=True, expect=(S.ACTIVE, S.DELIVERING))])
    got = store.get(acc.qids[0])
    assert got is not None
    assert (got.state, got.next_attempt_at, got.attempts, got.last_reply) == (
        S.DEFERRED, T0 + 1800, 1, reply)


def test_a_reply_keeps_who_gave_it_and_when_until_the_next_replaces_it(store: Store) -> None:
    # The NDR's Remote-MTA and Last-Attempt-Date (RFC 3464) come from here.
    acc = store.submit(sub(), body(), T0)
    (e,) = store.claim(10, T0, 10)
    said = Reply(452, "4.2.2", "mailbox full", remote_mta="mx1.example.net", attempt_at=T0 + 5)
    store.apply([Transition(e.qid, S.DEFERRED, next_attempt_at=T0 + 60, reply=said,
                            attempted=True)])
    got = store.get(acc.qids[0])
    assert got is not None and got.last_reply == said
    assert (got.last_reply.remote_mta, got.last_reply.attempt_at) == ("mx1.example.net", T0 + 5)
    # A transition without a reply keeps it; one with Sluice's own replaces all of it.
    store.modify(Selector(qids=acc.qids), Action.HOLD, T0 + 6)
    store.modify(Selector(qids=acc.qids), Action.RELEASE, T0 + 7)
    assert store.get(acc.qids[0]).last_reply == said  # type: ignore[union-attr]
    (e,) = store.claim(10, T0 + 60, 10)
    own = Reply(451, "4.4.1", "connect to mx1.example.net[192.0.2.1]:25: refused",
                attempt_at=T0 + 61)
    store.apply([Transition(e.qid, S.DEFERRED, next_attempt_at=T0 + 120, reply=own,
                            attempted=True)])
    assert store.get(acc.qids[0]).last_reply == own  # type: ignore[union-attr]
    # An operator's bounce: Sluice's reply, given at no attempt.
    store.modify(Selector(qids=acc.qids), Action.BOUNCE, T0 + 130)
    got = store.get(acc.qids[0])
    assert got is not None and got.last_reply is not None
    assert (got.last_reply.remote_mta, got.last_reply.attempt_at) == ("", None)


def test_a_late_failure_loses_to_an_operator_hold(store: Store) -> None:
    acc = store.submit(sub(), body(), T0)
    (e,) = store.claim(10, T0, 10)
    store.modify(Selector(qids=(e.qid,)), Action.HOLD, T0 + 1)
    applied = store.apply([Transition(e.qid, S.DEFERRED, next_attempt_at=T0 + 60,
                                      attempted=True, expect=(S.ACTIVE, S.DELIVERING))])
    assert applied == set()
    assert store.get(acc.qids[0]).state is S.HOLD  # type: ignore[union-attr]


def test_a_successful_delivery_wins_over_an_operator_hold(store: Store) -> None:
    store.submit(sub(), body(), T0)
    (e,) = store.claim(10, T0, 10)
    store.modify(Selector(qids=(e.qid,)), Action.HOLD, T0 + 1)
    assert store.apply([Transition(e.qid, None)]) == {e.qid}
    assert store.count().recipients == 0


def test_bounce_state_and_removal_after_the_ndr(store: Store) -> None:
    store.submit(sub(), body(), T0)
    (e,) = store.claim(10, T0, 10)
    store.apply([Transition(e.qid, S.BOUNCE, reply=Reply(550, "5.1.1", "unknown"),
                            attempted=True)])
    assert store.count()[S.BOUNCE] == 1
    assert store.claim(10, T0 + 10_000, 10) == []  # bounces are not delivered
    assert store.apply([Transition(e.qid, None, expect=(S.BOUNCE,))]) == {e.qid}


def test_mark_delivering_without_waiting(store: Store) -> None:
    store.submit(sub(), body(), T0)
    (e,) = store.claim(10, T0, 10)
    store.apply([Transition(e.qid, S.DELIVERING, expect=(S.ACTIVE,))], wait=False)
    # Writes apply in order: once a later write has returned, the earlier is in.
    assert store.apply([Transition("00000000000000000-0", None)]) == set()
    assert store.get(e.qid).state is S.DELIVERING  # type: ignore[union-attr]


# -- restart -----------------------------------------------------------------------------------

def test_recover_returns_in_flight_entries_and_survives_reopen(flavour: str, tmp_path: Path
                                                               ) -> None:
    store = open_flavour(flavour, tmp_path)
    accs = [store.submit(sub(), body(i), T0) for i in range(4)]
    claimed = store.claim(3, T0, 10)
    store.apply([Transition(claimed[0].qid, S.DELIVERING)])
    store.close()

    store = open_flavour(flavour, tmp_path)
    try:
        assert store.recover(T0 + 5) == 3
        st = states(store)
        assert sorted(st.values()) == sorted([S.DEFERRED] * 3 + [S.INCOMING])
        again = store.claim(10, T0 + 5, 10)
        assert {e.spid for e in again} == {a.spid for a in accs}
        for a in accs:
            assert read(store, a.spid).startswith(b"Subject: message")
        c = store.count()
        assert (c.messages, c[S.ACTIVE]) == (4, 4)
    finally:
        store.close()


# -- operator actions --------------------------------------------------------------------------

def test_hold_release_retry_priority_delete_by_selector(store: Store) -> None:
    a = store.submit(sub("x@gmail.com", tenantid="t1", jobid="j1"), body(1), T0)
    b = store.submit(sub("y@yahoo.com", tenantid="t2", jobid="j2"), body(2), T0)
    held = store.modify(Selector(domain="gmail.com"), Action.HOLD, T0 + 1)
    assert [e.qid for e in held] == [a.qids[0]] and held[0].state is S.INCOMING
    assert states(store) == {a.qids[0]: S.HOLD, b.qids[0]: S.INCOMING}
    assert store.claim(10, T0 + 2, 10)[0].qid == b.qids[0]  # held mail is ignored

    released = store.modify(Selector(tenantid="t1"), Action.RELEASE, T0 + 3)
    assert [e.qid for e in released] == [a.qids[0]]
    assert store.get(a.qids[0]).state is S.INCOMING  # type: ignore[union-attr]

    store.modify(Selector(jobid="j1"), Action.PRIORITY, T0 + 4, priority=1)
    assert store.get(a.qids[0]).priority == 1  # type: ignore[union-attr]

    # retry now: a deferred entry becomes due at once
    (c,) = store.claim(10, T0 + 5, 10)
    store.apply([Transition(c.qid, S.DEFERRED, next_attempt_at=T0 + 9999, attempted=True)])
    assert store.claim(10, T0 + 6, 10) == []
    store.modify(Selector(qids=(a.spid,)), Action.RETRY, T0 + 7)
    assert [e.qid for e in store.claim(10, T0 + 7, 10)] == [a.qids[0]]

    deleted = store.modify(Selector(sender="ALICE@example.org"), Action.DELETE, T0 + 8)
    assert len(deleted) == 2 and store.count().recipients == 0
    assert store.count().messages == 0


def test_release_of_a_tried_entry_makes_it_due_now(store: Store) -> None:
    acc = store.submit(sub(), body(), T0)
    (e,) = store.claim(1, T0, 10)
    store.apply([Transition(e.qid, S.DEFERRED, next_attempt_at=T0 + 9999, attempted=True)])
    store.modify(Selector(qids=acc.qids), Action.HOLD, T0 + 1)
    store.modify(Selector(qids=acc.qids), Action.RELEASE, T0 + 2)
    got = store.get(acc.qids[0])
    assert got is not None and got.state is S.DEFERRED and got.next_attempt_at == T0 + 2


def test_actions_only_touch_the_states_they_apply_to(store: Store) -> None:
    acc = store.submit(sub(), body(), T0)
    assert store.modify(Selector(qids=acc.qids), Action.RELEASE, T0) == []  # not held
    store.modify(Selector(qids=acc.qids), Action.BOUNCE, T0,
                 reply=Reply(550, "5.7.1", "spam"))
    e = store.get(acc.qids[0])
    assert e is not None and e.state is S.BOUNCE and e.last_reply == Reply(550, "5.7.1", "spam")
    assert store.modify(Selector(qids=acc.qids), Action.HOLD, T0) == []  # bounce stays


@pytest.mark.parametrize("action", list(Action))
def test_every_flavour_applies_the_one_definition_of_an_action(store: Store,
                                                               action: Action) -> None:
    """For each state an entry can be in, tried or not: the store does what
    sluice.store._actions says, field by field, and touches nothing else."""
    entries = []
    for state in S:
        for tried in (False, True):
            acc = store.submit(sub(f"{state}-{int(tried)}@x.org", hold=True), body(), T0)
            qid = acc.qids[0]
            store.apply([Transition(qid, state, next_attempt_at=T0 + 50,
                                    reply=Reply(451, "4.0.0", "try later"), attempted=tried)])
            got = store.get(qid)
            assert got is not None and got.state is state
            entries.append(got)
    priority = 1 if action is Action.PRIORITY else None
    reply = Reply(550, "5.7.1", "by hand") if action is Action.BOUNCE else None
    change = OperatorChange(action, T0 + 100, priority, reply)
    touched = store.modify(Selector(), action, T0 + 100, priority=priority, reply=reply)
    assert sorted(e.qid for e in touched) == sorted(
        e.qid for e in entries if e.state in ACTION_STATES[action])
    for before in entries:
        after = store.get(before.qid)
        if before.state not in ACTION_STATES[action]:
            assert after == before
            continue
        edit = change.edit(before.attempts)
        if edit is None:
            assert after is None
            continue
        # The fields themselves: asdict() would turn the Reply into a dict,
        # which a compiled QueueEntry refuses (sluice._native).
        expected = dataclasses.replace(before, **{
            field.name: value for field in dataclasses.fields(edit)
            if (value := getattr(edit, field.name)) is not None})
        assert after == expected, (action, before.state, before.attempts)


def test_operator_changes_appear_in_the_change_feed(store: Store) -> None:
    seq0, _ = store.changes_since(0)
    a = store.submit(sub("a@x.org", "b@x.org"), body(), T0)
    store.modify(Selector(qids=(a.spid,)), Action.HOLD, T0)
    seq1, changes = store.changes_since(seq0)
    assert sorted(c.qid for c in changes) == sorted(a.qids)
    assert {c.action for c in changes} == {Action.HOLD}
    assert store.changes_since(seq1) == (seq1, [])


# -- listing and counting ---------------------------------------------------------------------

def test_entries_are_paginated_by_cursor_in_arrival_order(store: Store) -> None:
    accs = [store.submit(sub("a@x.org", "b@y.org"), body(i), T0 + i) for i in range(7)]
    all_qids = [q for a in accs for q in a.qids]
    assert [e.qid for e in store.entries(Selector())] == all_qids
    page1 = [e.qid for e in store.entries(Selector(), limit=5)]
    page2 = [e.qid for e in store.entries(Selector(), after=page1[-1], limit=5)]
    page3 = [e.qid for e in store.entries(Selector(), after=page2[-1], limit=5)]
    assert page1 + page2 + page3 == all_qids
    assert [e.qid for e in store.entries(Selector(domain="y.org"))] == [a.qids[1] for a in accs]


def test_counts_with_and_without_selectors_match_the_listing(store: Store) -> None:
    for i in range(6):
        store.submit(sub("a@x.org", f"b{i}@y.org", tenantid=f"t{i % 2}"), body(i), T0)
    store.modify(Selector(tenantid="t1"), Action.HOLD, T0)
    store.claim(4, T0, 10)
    listed: dict[QueueState, int] = {}
    for e in store.entries(Selector()):
        listed[e.state] = listed.get(e.state, 0) + 1
    c = store.count()
    assert {s: c[s] for s in QueueState if c[s]} == listed
    assert c.messages == 6 and c.recipients == 12
    ct = store.count(Selector(tenantid="t1"))
    assert (ct.messages, ct.recipients, ct[S.HOLD]) == (3, 6, 6)
    cd = store.count(Selector(domain="x.org", states=(S.ACTIVE,)))
    assert cd.recipients == sum(1 for e in store.entries(Selector(domain="x.org"))
                                if e.state is S.ACTIVE)


def test_shape_buckets_by_domain_and_age(store: Store) -> None:
    store.submit(sub("a@x.org"), body(), T0)  # 0 s old at T0
    store.submit(sub("b@x.org"), body(), T0 - 400)  # 400 s
    store.submit(sub("c@y.org"), body(), T0 - 5000)  # beyond the last edge
    shape = store.shape(Selector(), T0, [300.0, 600.0, 1200.0])
    assert shape == {"x.org": [1, 1, 0, 0], "y.org": [0, 0, 0, 1]}


def test_expired_selects_deferred_entries_past_their_maxtime(store: Store) -> None:
    old = store.submit(sub(delay_s=10), body(1), T0 - 1000)
    report = store.submit(sub(sender="", is_report=True, delay_s=10), body(2), T0 - 500)
    fresh = store.submit(sub(delay_s=10), body(3), T0)
    store.submit(sub(hold=True), body(4), T0 - 5000)  # held mail never expires here
    got = {e.qid for e in store.expired(T0 - 900, T0 - 400)}
    assert got == {old.qids[0], report.qids[0]}
    assert fresh.qids[0] not in {e.qid for e in store.expired(T0 - 900, T0 - 600)}


# -- content ---------------------------------------------------------------------------------

def test_large_content_streams_intact(store: Store) -> None:
    data = bytes(range(256)) * 4096 * 3  # 3 MB
    acc = store.submit(sub(), iter([data[i:i + 100_000] for i in range(0, len(data), 100_000)]),
                       T0)
    digest = hashlib.sha256()
    with store.open_content(acc.spid) as stream:
        for block in iter(lambda: stream.read(65536), b""):
            digest.update(block)
    assert digest.digest() == hashlib.sha256(data).digest()
    assert acc.size == len(data)


def test_a_failing_content_source_queues_nothing(store: Store) -> None:
    def broken():  # type: ignore[no-untyped-def]
        yield b"Subject: x\r\n"
        raise ConnectionResetError("client went away")

    with pytest.raises(ConnectionResetError):
        store.submit(sub(), broken(), T0)
    assert store.count().recipients == 0


def test_readers_work_while_a_writer_commits(store: Store) -> None:
    stop = threading.Event()
    errors: list[BaseException] = []

    def reader() -> None:
        try:
            while not stop.is_set():
                store.count()
                list(store.entries(Selector(), limit=50))
        except BaseException as exc:
            errors.append(exc)

    t = threading.Thread(target=reader)
    t.start()
    try:
        for i in range(100):
            store.submit(sub(), body(i), T0)
    finally:
        stop.set()
        t.join()
    assert errors == []
    assert store.count().messages == 100


def test_bounce_leases_keep_concurrent_ndr_runs_apart(store: Store) -> None:
    accs = [store.submit(sub("a@x.org", "b@x.org"), body(i), T0) for i in range(3)]
    for e in store.claim(10, T0, 10):
        store.apply([Transition(e.qid, S.BOUNCE, next_attempt_at=T0,
                                reply=Reply(550, "5.1.1", "no"))])
    first = store.claim_bounces(4, T0 + 1, 600)
    assert [e.qid for e in first] == [q for a in accs[:2] for q in a.qids]
    assert all(e.state is S.BOUNCE and e.next_attempt_at == T0 + 601 for e in first)
    second = store.claim_bounces(10, T0 + 2, 600)  # another runner: only the rest
    assert [e.qid for e in second] == list(accs[2].qids)
    assert store.claim_bounces(10, T0 + 3, 600) == []
    # A runner that died: its entries come back when the lease ends.
    again = store.claim_bounces(10, T0 + 601, 600)
    assert [e.qid for e in again] == [q for a in accs[:2] for q in a.qids]
    assert store.count()[S.BOUNCE] == 6


def test_cancelled_futures_never_fail_a_committed_batch(store: Store) -> None:
    futs = [store.submit_future(sub(), body(i), T0) for i in range(200)]
    cancelled = [f.cancel() for f in futs]  # some are taken already: those cannot be
    kept = [f for f, c in zip(futs, cancelled, strict=True) if not c]
    results = [f.result(timeout=30) for f in kept]  # no StorageError from a neighbour
    assert store.count().messages == len(results)
    assert {a.spid for a in results} == {e.spid for e in store.entries(Selector())}


def test_a_selection_of_thousands_of_ids(store: Store) -> None:
    accs = [store.submit(sub("a@x.org", "b@x.org"), body(i), T0) for i in range(60)]
    qids = tuple(q for a in accs for q in a.qids) + tuple(
        f"{i:016X}-{n}" for i in range(1, 1500) for n in (0,))  # many that match nothing
    spids = tuple(a.spid for a in accs[:10])
    assert store.count(Selector(qids=qids)).recipients == 120
    assert len(store.modify(Selector(qids=qids + spids), Action.HOLD, T0)) == 120
    assert store.count(Selector(states=(S.HOLD,))).recipients == 120
