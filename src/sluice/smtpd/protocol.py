"""The SMTP server's state machine (RFC 5321 4.1.4), as a table: no I/O here.

SUMMARY
    Phase, Verb                      the states of a session and its commands
    parse_command(line) -> Command   one command line, split and checked
    rule(phase, verb) -> Rule        allowed?  where does it lead?
    render(reply, esmtp) -> bytes    one reply line on the wire

DESCRIPTION
    A session is in one Phase at a time: CONNECTED (greeted, no HELO yet),
    READY (HELO or EHLO said, no transaction), MAIL (MAIL accepted, no RCPT
    tried yet), RCPT_NONE (RCPTs tried, none accepted) and RCPT (at least
    one recipient accepted).  RULES says, for every Phase and Verb, either
    the reply that refuses the command as out of sequence (503 5.5.1 and
    friends, RFC 5321 4.1.4 and 4.3.2), or the phase the command leads to
    when it takes effect and when the session's handler refuses it for a
    reason of its own (a bad address, a policy refusal).

    sluice.smtpd.session does the I/O and the policy; it asks rule() before
    running a command's handler and moves to the phase the rule names
    after it.  What is not about sequence (TLS active, EHLO rather than
    HELO, already authenticated) stays in the handlers.

STRATEGIES
    Transitions are data.  Adding a command or a phase is one row here; a
    unit test walks every command in every phase (tests/unit/
    test_smtpd_protocol.py).  Commands that do not change the transaction
    (NOOP, VRFY, HELP, QUIT) keep the phase wherever they are allowed.

    RFC 2034 codes on every reply.  Replies carry an enhanced code; it is
    written only once the client said EHLO (HELO clients may not expect
    it), except 421, which any client must understand.

INVARIANTS
    Every (Phase, Verb) pair has a Rule; a refusal is a 5yz Reply.  The
    phases MAIL, RCPT_NONE and RCPT are exactly those with a transaction.

SEE ALSO
    sluice.smtpd.session, RFC 5321 4.1.4, 4.3.2 and 4.5.3.1, RFC 2034, RFC 3207
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

from sluice.model import Reply
from sluice.smtpd.policy import NO_VALID_RECIPIENTS

__all__ = ["COMMAND_LINE_MAX", "LINE_READ_MAX", "Command", "Outcome", "Phase", "Rule", "Verb",
           "command_limit", "parse_command", "render", "rule"]

#: RFC 5321 4.5.3.1.4: a command line is at most 512 octets with its CRLF.
COMMAND_LINE_MAX = 512
#: RFC 1870 4 and RFC 6531 3.4: MAIL may be longer by SIZE= and SMTPUTF8.
_MAIL_EXTRA_ESMTP = 26 + 10
#: Longer input without a line end is read and thrown away up to its end.
LINE_READ_MAX = 65536


class Phase(enum.Enum):
    """Where a session stands in RFC 5321's command sequence."""

    CONNECTED = "connected"  # greeted; HELO/EHLO not yet said (again, after STARTTLS)
    READY = "ready"  # HELO/EHLO said, no mail transaction
    MAIL = "mail"  # MAIL FROM accepted, no RCPT tried
    RCPT_NONE = "rcpt_none"  # RCPTs tried, none accepted
    RCPT = "rcpt"  # at least one recipient accepted (or dropped)

    @property
    def in_transaction(self) -> bool:
        """Whether a mail transaction is open (MAIL FROM said, DATA not yet ended)."""
        return self in _TRANSACTION


_TRANSACTION = frozenset((Phase.MAIL, Phase.RCPT_NONE, Phase.RCPT))


class Verb(enum.Enum):
    """The commands this server knows; anything else is 500 5.5.2."""

    EHLO = "EHLO"
    HELO = "HELO"
    MAIL = "MAIL"
    RCPT = "RCPT"
    DATA = "DATA"
    RSET = "RSET"
    NOOP = "NOOP"
    VRFY = "VRFY"
    HELP = "HELP"
    QUIT = "QUIT"
    STARTTLS = "STARTTLS"
    AUTH = "AUTH"


_VERBS = {verb.value: verb for verb in Verb}


class Outcome(enum.Enum):
    """How a command's handler ended."""

    DONE = "done"  # it took effect (250 to MAIL, RCPT; 354 sent for DATA)
    REFUSED = "refused"  # refused for what it asked (an address, a policy)
    MALFORMED = "malformed"  # not a well-formed command: as if never sent


@dataclass(frozen=True, slots=True)
class Rule:
    """What a command does in a phase.

    ``refusal`` set: the command is out of sequence; reply with it and stay.
    Otherwise the handler runs, and the session moves to ``done`` when the
    command took effect, or to ``refused`` (None: stay) when it was refused.
    """

    refusal: Reply | None = None
    done: Phase | None = None
    refused: Phase | None = None

    def __init__(self, refusal: Reply | None = None, done: Phase | None = None,
                 refused: Phase | None = None) -> None:
        object.__setattr__(self, "refusal", refusal)
        object.__setattr__(self, "done", done)
        object.__setattr__(self, "refused", refused)

    def after(self, outcome: Outcome) -> Phase | None:
        """The phase to move to after the handler's ``outcome``; None: stay."""
        if outcome is Outcome.DONE:
            return self.done
        if outcome is Outcome.REFUSED:
            return self.refused
        return None


SEND_HELO_FIRST = Reply(503, "5.5.1", "Send HELO or EHLO first")
NEED_MAIL = Reply(503, "5.5.1", "Need MAIL command")
NEED_RCPT = Reply(503, "5.5.1", "Need RCPT command")
NESTED_MAIL = Reply(503, "5.5.1", "Nested MAIL command")
IN_TRANSACTION = Reply(503, "5.5.1", "Not permitted during a mail transaction")

_STAY = Rule()


def _everywhere(rule_: Rule) -> dict[Phase, Rule]:
    return dict.fromkeys(Phase, rule_)


def _greeted(done: Phase, refused: Phase | None = None) -> dict[Phase, Rule]:
    """Allowed once HELO/EHLO was said, leading to ``done``."""
    out = _everywhere(Rule(done=done, refused=refused))
    out[Phase.CONNECTED] = Rule(refusal=SEND_HELO_FIRST)
    return out


#: The state machine.  Rows are commands, columns phases.
RULES: dict[Verb, dict[Phase, Rule]] = {
    # HELO/EHLO may come again at any time and reset the transaction (RFC 5321 4.1.4).
    Verb.EHLO: _everywhere(Rule(done=Phase.READY)),
    Verb.HELO: _everywhere(Rule(done=Phase.READY)),
    Verb.MAIL: {
        Phase.CONNECTED: Rule(refusal=SEND_HELO_FIRST),
        Phase.READY: Rule(done=Phase.MAIL),
        Phase.MAIL: Rule(refusal=NESTED_MAIL),
        Phase.RCPT_NONE: Rule(refusal=NESTED_MAIL),
        Phase.RCPT: Rule(refusal=NESTED_MAIL),
    },
    Verb.RCPT: {
        Phase.CONNECTED: Rule(refusal=SEND_HELO_FIRST),
        Phase.READY: Rule(refusal=NEED_MAIL),
        Phase.MAIL: Rule(done=Phase.RCPT, refused=Phase.RCPT_NONE),
        Phase.RCPT_NONE: Rule(done=Phase.RCPT),
        Phase.RCPT: Rule(done=Phase.RCPT),
    },
    # DATA takes effect once 354 is sent; whatever the verdict on the
    # message, the transaction is over (RFC 5321 4.1.1.4).
    Verb.DATA: {
        Phase.CONNECTED: Rule(refusal=SEND_HELO_FIRST),
        Phase.READY: Rule(refusal=NEED_MAIL),
        Phase.MAIL: Rule(refusal=NEED_RCPT),
        Phase.RCPT_NONE: Rule(refusal=NO_VALID_RECIPIENTS),
        Phase.RCPT: Rule(done=Phase.READY),
    },
    Verb.RSET: {**_greeted(Phase.READY), Phase.CONNECTED: Rule(done=Phase.CONNECTED)},
    Verb.NOOP: _everywhere(_STAY),
    Verb.VRFY: _everywhere(_STAY),
    Verb.HELP: _everywhere(_STAY),
    Verb.QUIT: _everywhere(_STAY),
    # RFC 3207 4.2: after the handshake the client starts over with EHLO.
    Verb.STARTTLS: {
        Phase.CONNECTED: Rule(done=Phase.CONNECTED),
        Phase.READY: Rule(done=Phase.CONNECTED),
        Phase.MAIL: Rule(refusal=IN_TRANSACTION),
        Phase.RCPT_NONE: Rule(refusal=IN_TRANSACTION),
        Phase.RCPT: Rule(refusal=IN_TRANSACTION),
    },
    # RFC 4954 4: AUTH is not permitted during a mail transaction.
    Verb.AUTH: {
        Phase.CONNECTED: Rule(refusal=SEND_HELO_FIRST),
        Phase.READY: Rule(done=Phase.READY),
        Phase.MAIL: Rule(refusal=IN_TRANSACTION),
        Phase.RCPT_NONE: Rule(refusal=IN_TRANSACTION),
        Phase.RCPT: Rule(refusal=IN_TRANSACTION),
    },
}


def rule(phase: Phase, verb: Verb) -> Rule:
    """The rule for ``verb`` in ``phase`` (every pair has one)."""
    return RULES[verb][phase]


@dataclass(frozen=True, slots=True)
class Command:
    """One parsed command line.

    ``verb`` is None for an unknown command (``name`` says which) and for a
    line that is not a command at all (``error`` says why).  ``arg`` is
    the rest of the line, stripped, decoded as UTF-8 with surrogateescape
    so that the original bytes can be recovered; None when there is none.
    """

    verb: Verb | None
    name: str = ""
    arg: str | None = None
    error: Reply | None = None

    def __init__(self, verb: Verb | None, name: str = "", arg: str | None = None,
                 error: Reply | None = None) -> None:
        object.__setattr__(self, "verb", verb)
        object.__setattr__(self, "name", name)
        object.__setattr__(self, "arg", arg)
        object.__setattr__(self, "error", error)


BAD_SYNTAX = Reply(500, "5.5.2", "Bad syntax")
LINE_TOO_LONG = Reply(500, "5.5.2", "Command line too long")


def command_limit(verb: Verb | None, esmtp: bool) -> int:
    """The longest line (with CRLF) accepted for ``verb``."""
    if esmtp and verb is Verb.MAIL:
        return COMMAND_LINE_MAX + _MAIL_EXTRA_ESMTP
    return COMMAND_LINE_MAX


def parse_command(line: bytes, esmtp: bool) -> Command:
    """Split one line (with or without its CRLF) into a Command."""
    size = len(line)
    text = line.rstrip(b"\r\n")
    if not text:
        return Command(None, error=BAD_SYNTAX)
    name_bytes, _, arg_bytes = text.partition(b" ")
    try:
        name = name_bytes.upper().decode("ascii")
    except UnicodeDecodeError:
        return Command(None, error=BAD_SYNTAX)
    verb = _VERBS.get(name)
    if size > command_limit(verb, esmtp):
        return Command(verb, name, error=LINE_TOO_LONG)
    arg_bytes = arg_bytes.strip()
    arg = arg_bytes.decode("utf-8", "surrogateescape") if arg_bytes else None
    return Command(verb, name, arg)


_CRLF = b"\r\n"


def render(reply: Reply, esmtp: bool) -> bytes:
    """``reply`` as one line with CRLF; its enhanced code only for ESMTP clients or 421."""
    if reply.enhanced and (esmtp or reply.code == 421):
        line = f"{reply.code} {reply.enhanced} {reply.text}"
    else:
        line = f"{reply.code} {reply.text}"
    return line.encode("utf-8", "surrogateescape") + _CRLF
