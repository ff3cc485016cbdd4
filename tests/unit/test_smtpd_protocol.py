"""The SMTP state machine table: every command in every phase, and command line parsing."""

from __future__ import annotations

import pytest

from sluice.model import Reply
from sluice.smtpd.protocol import (
    COMMAND_LINE_MAX,
    RULES,
    Outcome,
    Phase,
    Verb,
    parse_command,
    render,
    rule,
)

pytestmark = pytest.mark.unit

C, R, M, N, T = Phase.CONNECTED, Phase.READY, Phase.MAIL, Phase.RCPT_NONE, Phase.RCPT
PHASES = (C, R, M, N, T)

#: What RFC 5321 4.1.4 and 4.3.2 (with RFC 3207 and RFC 4954) say, written out
#: independently of the table: per command, per phase in the order above,
#: either the code of the out-of-sequence refusal or (phase when done,
#: phase when refused) with None meaning "stays".
EXPECTED: dict[Verb, tuple[object, ...]] = {
    Verb.EHLO: ((R, None), (R, None), (R, None), (R, None), (R, None)),
    Verb.HELO: ((R, None), (R, None), (R, None), (R, None), (R, None)),
    Verb.MAIL: ("503 5.5.1", (M, None), "503 5.5.1", "503 5.5.1", "503 5.5.1"),
    Verb.RCPT: ("503 5.5.1", "503 5.5.1", (T, N), (T, None), (T, None)),
    Verb.DATA: ("503 5.5.1", "503 5.5.1", "503 5.5.1", "554 5.5.1", (R, None)),
    Verb.RSET: ((C, None), (R, None), (R, None), (R, None), (R, None)),
    Verb.NOOP: ((None, None),) * 5,
    Verb.VRFY: ((None, None),) * 5,
    Verb.HELP: ((None, None),) * 5,
    Verb.QUIT: ((None, None),) * 5,
    Verb.STARTTLS: ((C, None), (C, None), "503 5.5.1", "503 5.5.1", "503 5.5.1"),
    Verb.AUTH: ("503 5.5.1", (R, None), "503 5.5.1", "503 5.5.1", "503 5.5.1"),
}


def test_every_command_has_a_rule_in_every_phase() -> None:
    assert set(RULES) == set(Verb)
    for verb, row in RULES.items():
        assert set(row) == set(Phase), verb


@pytest.mark.parametrize("verb", list(Verb), ids=lambda v: v.value)
def test_the_table_says_what_rfc_5321_says(verb: Verb) -> None:
    for phase, expected in zip(PHASES, EXPECTED[verb], strict=True):
        step = rule(phase, verb)
        if isinstance(expected, str):
            assert step.refusal is not None, (verb, phase)
            assert f"{step.refusal.code} {step.refusal.enhanced}" == expected, (verb, phase)
            assert step.done is None and step.refused is None
        else:
            assert step.refusal is None, (verb, phase)
            assert (step.done, step.refused) == expected, (verb, phase)


def test_a_malformed_command_never_moves_the_phase() -> None:
    for verb in Verb:
        for phase in Phase:
            assert rule(phase, verb).after(Outcome.MALFORMED) is None


def test_after_follows_the_outcome() -> None:
    step = rule(Phase.MAIL, Verb.RCPT)
    assert step.after(Outcome.DONE) is Phase.RCPT
    assert step.after(Outcome.REFUSED) is Phase.RCPT_NONE  # tried: DATA now says 554


def test_only_transaction_phases_hold_a_transaction() -> None:
    assert {p for p in Phase if p.in_transaction} == {Phase.MAIL, Phase.RCPT_NONE, Phase.RCPT}


def test_refusals_are_permanent_and_coded() -> None:
    for row in RULES.values():
        for step in row.values():
            if step.refusal is not None:
                assert 500 <= step.refusal.code < 600
                assert step.refusal.enhanced.startswith("5.")


@pytest.mark.parametrize(("line", "verb", "arg"), [
    (b"EHLO client.test\r\n", Verb.EHLO, "client.test"),
    (b"ehlo client.test\r\n", Verb.EHLO, "client.test"),
    (b"MAIL FROM:<a@b.test> SIZE=10\r\n", Verb.MAIL, "FROM:<a@b.test> SIZE=10"),
    (b"DATA\r\n", Verb.DATA, None),
    (b"NOOP   \r\n", Verb.NOOP, None),
    (b"QUIT\n", Verb.QUIT, None),  # a bare LF ends a line too
    ("RCPT TO:<jürgen@b.test>\r\n".encode(), Verb.RCPT, "TO:<jürgen@b.test>"),
])
def test_parse_command(line: bytes, verb: Verb, arg: str | None) -> None:
    command = parse_command(line, esmtp=True)
    assert (command.verb, command.arg, command.error) == (verb, arg, None)


def test_parse_command_keeps_undecodable_bytes() -> None:
    command = parse_command(b"RCPT TO:<\xff@b.test>\r\n", esmtp=True)
    assert command.arg is not None
    assert command.arg.encode("utf-8", "surrogateescape") == b"TO:<\xff@b.test>"


def test_parse_command_errors() -> None:
    assert parse_command(b"\r\n", esmtp=True).error == Reply(500, "5.5.2", "Bad syntax")
    assert parse_command(b"\xc3\xa9HLO x\r\n", esmtp=True).error is not None
    unknown = parse_command(b"FROB x\r\n", esmtp=True)
    assert (unknown.verb, unknown.name, unknown.error) == (None, "FROB", None)
    long_noop = b"NOOP " + b"x" * (COMMAND_LINE_MAX - 7) + b"\r\n"
    assert len(long_noop) == COMMAND_LINE_MAX
    assert parse_command(long_noop, esmtp=True).error is None
    assert parse_command(b"NOOP x" + long_noop[5:], esmtp=True).error is not None
    # RFC 1870 / RFC 6531: MAIL may be longer, but only for ESMTP clients
    mail = b"MAIL FROM:<" + b"a" * (COMMAND_LINE_MAX - 5) + b">\r\n"
    assert parse_command(mail, esmtp=True).error is None
    assert parse_command(mail, esmtp=False).error is not None


def test_render() -> None:
    assert render(Reply(250, "2.1.0", "Sender ok"), esmtp=True) == b"250 2.1.0 Sender ok\r\n"
    assert render(Reply(250, "2.1.0", "Sender ok"), esmtp=False) == b"250 Sender ok\r\n"
    assert render(Reply(220, "", "Ready to start TLS"), esmtp=True) == \
        b"220 Ready to start TLS\r\n"
