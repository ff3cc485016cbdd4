"""Queue ids, selectors and other plain data."""

from __future__ import annotations

import json

import pytest
from hypothesis import given
from hypothesis import strategies as st

from sluice.model import (
    QueueEntry,
    QueueState,
    Reply,
    Selector,
    Submission,
    format_qid,
    parse_qid,
    recipient_domain,
    reply_fields,
)

pytestmark = pytest.mark.unit


def entry(**kw: object) -> QueueEntry:
    base: dict[str, object] = dict(spid="0123456789ABCDEF", idx=0, sender="a@x.org",
                                   recipient="b@Example.COM", state=QueueState.INCOMING,
                                   arrival_at=0.0, next_attempt_at=0.0)
    base.update(kw)
    return QueueEntry(**base)  # type: ignore[arg-type]


def test_qids() -> None:
    assert format_qid("0123456789ABCDEF", 3) == "0123456789ABCDEF-3"
    assert parse_qid("0123456789abcdef-3") == ("0123456789ABCDEF", 3)
    assert parse_qid("0123456789ABCDEF") == ("0123456789ABCDEF", None)
    for bad in ("", "xyz", "0123-1", "0123456789ABCDEF-", "0123456789ABCDEF-x", "*"):
        with pytest.raises(ValueError):
            parse_qid(bad)


def test_domain_is_lower_case_without_trailing_dot() -> None:
    assert recipient_domain("Bob@Example.COM.") == "example.com"
    assert recipient_domain("postmaster") == ""
    assert entry().domain == "example.com"


def test_selector_matching() -> None:
    e = entry(tenantid="t1", jobid="j1")
    assert Selector().matches(e)
    assert Selector(domain="EXAMPLE.com").matches(e)
    assert not Selector(domain="example.org").matches(e)
    assert Selector(qids=("0123456789ABCDEF",)).matches(e)
    assert Selector(qids=("0123456789ABCDEF-0",)).matches(e)
    assert not Selector(qids=("0123456789ABCDEF-1",)).matches(e)
    assert Selector(states=(QueueState.INCOMING, QueueState.HOLD)).matches(e)
    assert not Selector(states=(QueueState.HOLD,)).matches(e)
    assert Selector(tenantid="t1", jobid="j1", sender="A@X.ORG").matches(e)
    assert not Selector(tenantid="t1", jobid="j2").matches(e)
    assert Selector().is_empty and not Selector(sender="").is_empty


def test_malformed_selector_qid_is_refused() -> None:
    with pytest.raises(ValueError):
        Selector(qids=("not-a-qid",))


def test_submission_checks() -> None:
    with pytest.raises(ValueError, match="recipient"):
        Submission("a@x.org", ())
    with pytest.raises(ValueError, match="priority"):
        Submission("a@x.org", ("b@y.org",), priority=2)
    with pytest.raises(ValueError, match="delay"):
        Submission("a@x.org", ("b@y.org",), delay_s=-1)


def test_submission_initial_state() -> None:
    def sub(**kw: object) -> Submission:
        return Submission("a@x.org", ("b@y.org",), **kw)  # type: ignore[arg-type]

    assert sub().initial_state(100.0) == (QueueState.INCOMING, 100.0)
    assert sub(delay_s=60).initial_state(100.0) == (QueueState.DEFERRED, 160.0)
    assert sub(hold=True).initial_state(100.0) == (QueueState.HOLD, 100.0)
    # hold wins over a delay
    assert sub(hold=True, delay_s=60).initial_state(100.0) == (QueueState.HOLD, 100.0)


@given(st.builds(Reply, st.integers(200, 599), st.text(max_size=8), st.text(max_size=20),
                 st.text(max_size=12),
                 st.none() | st.floats(0, 2e9, allow_nan=False, allow_infinity=False)))
def test_a_stored_reply_reads_back_as_it_was(reply: Reply) -> None:
    record = json.loads(json.dumps(reply.to_record()))
    assert Reply.from_record(record) == reply
    assert reply_fields(record) == (reply.code, reply.enhanced, reply.text, reply.remote_mta)


def test_an_old_three_item_reply_and_empty_fields_read_as_sluice_s_own() -> None:
    assert reply_fields([451, None, "later"]) == (451, "", "later", "")
    assert Reply.from_record(["550", "5.1.1", None, None, None]) == Reply(550, "5.1.1")


def test_the_written_out_copies_keep_every_other_field() -> None:
    # Reply.attempted_at and AttemptResult.logged_at stand in for
    # dataclasses.replace on the delivery path: a field added to either
    # class and forgotten there would be lost from every recorded outcome.
    import dataclasses

    from sluice.attempts import AttemptResult
    from sluice.model import Delivered

    def every_field(obj: object) -> list[object]:  # equality skips phase (compare=False)
        return [getattr(obj, f.name) for f in dataclasses.fields(obj)]  # type: ignore[arg-type]

    reply = Reply(250, "2.0.0", "queued as X", "mx.example.com", None, "end-of-data")
    assert every_field(reply.attempted_at(12.5)) == every_field(
        dataclasses.replace(reply, attempt_at=12.5))
    res = AttemptResult(entry(), Delivered(reply), False, "192.0.2.1", "mx.example.com",
                        "192.0.2.25", 0.25)
    marked = res.logged_at(99.0)
    assert marked == dataclasses.replace(res, at=99.0, logged=True)
    before = [getattr(res, f.name) for f in dataclasses.fields(res)]
    assert [getattr(marked, f.name) for f in dataclasses.fields(marked)] == [
        *before[:-2], 99.0, True]
