"""The sendmail(1) command line: Postfix's options, parsed the way it does.

SUMMARY
    parse_args(argv) -> SendmailArgs
    USAGE

DESCRIPTION
    Programs that send mail (PHP's mail(), cron, git send-email, mutt,
    logwatch) run ``sendmail`` with the options Sendmail invented and
    Postfix kept: ``-t -i``, ``-oi``, ``-f sender`` or ``-fsender``,
    ``-F "Full Name"``, ``-bs``, ``-odi`` and so on.  This module reads
    that command line; sluice.cli.sendmail acts on it.

    The grammar is getopt(3)'s, with Postfix's option string: single
    letters, several flags may share one word (``-ti``), an option that
    takes a value takes the rest of its word or else the next word
    (``-fme@x`` or ``-f me@x``).  ``-o`` and ``-b`` take a value too, so
    ``-oi`` is option o with value i, as in Postfix.  Sluice's own long
    options (``--tenant``, ``--hold``, ...) may appear anywhere; ``--``
    ends the options.

    Accepted and honoured: -t, -i, -oi, -f, -r, -F, -C (the Sluice
    configuration file), -bm, -bs, -N (checked), -B (checked).
    Accepted and ignored as Postfix ignores them: -A, -G, -h, -L, -m,
    -O, -R, -U, -V, -v, -x, -c, -e, -p, -o (other than -oi), -qNN.
    No-ops that succeed: -bi, -I (Sluice has no alias database), -bh, -bH.
    Refused: everything else, with one line and exit status 2.

STRATEGIES
    Unknown is misuse.  An option Sluice does not know ends the command
    before anything is read: a program that asked for something Sluice
    cannot do must hear so, not have its mail sent some other way.  The
    exit status is 2, as for every misuse of ``sluice`` (Postfix uses
    EX_USAGE, 64; callers test for non-zero).

SEE ALSO
    sluice.cli.sendmail, Postfix sendmail(1), docs/cli.md (sendmail)
"""

from __future__ import annotations

from dataclasses import dataclass, field

from sluice.cli import CommandError

__all__ = ["USAGE", "SendmailArgs", "parse_args"]

USAGE = """\
usage: sluice sendmail [options] [recipient ...]
  -t            recipients from the To, Cc and Bcc headers too (Bcc is removed)
  -i, -oi       a line with a single dot does not end the message
  -f SENDER     envelope sender (also -fSENDER, -r SENDER; '' or <> for the null sender)
  -F NAME       full name for the From header added when the message has none
  -C FILE       Sluice configuration file (as sluice -c FILE)
  -bm           read a message from standard input and queue it (the default)
  -bs           speak SMTP on standard input and output
  -N DSN        never, or success,delay,failure (checked, then Sluice's own rules apply)
  -B TYPE       7BIT or 8BITMIME (checked)
  ignored: -A -G -h -L -m -O -R -U -V -v -x -c -e -p -odb -odi -oX... -qNN
Sluice's own:
  --tenant ID --job ID --transport ID --localip IP (repeatable) --priority 0|1
  --hold --delay DURATION --smtputf8
"""

# getopt's option string of Postfix's sendmail: a letter followed by ':' takes a value.
_OPTSTRING = "A:B:C:F:GIL:N:O:R:UV:X:b:ce:f:h:imno:p:r:q:tvx"
_WITH_VALUE = frozenset(c for i, c in enumerate(_OPTSTRING) if _OPTSTRING[i + 1:i + 2] == ":")
_FLAGS = frozenset(c for c in _OPTSTRING if c != ":") - _WITH_VALUE
#: Options Postfix accepts and does nothing with; Sluice does the same.
_IGNORED = frozenset("AGLORUVcehmpvx")
_LONG_VALUE = ("--tenant", "--job", "--transport", "--localip", "--priority", "--delay")
_LONG_FLAGS = ("--hold", "--smtputf8")
_DSN_NOTIFY = frozenset(("success", "delay", "failure"))


@dataclass(slots=True)
class SendmailArgs:
    """What the command line asked for."""

    mode: str = "m"  # b's value: m (queue a message), s (SMTP on stdio), or a no-op
    recipients: list[str] = field(default_factory=list)
    sender: str | None = None  # None: the user at node.hostname
    full_name: str | None = None
    from_headers: bool = False  # -t
    dot_ends: bool = True  # without -i / -oi a lone "." ends the message
    config: str | None = None  # -C
    notify: str | None = None  # -N, checked
    tenant: str = ""
    job: str = ""
    transport: str = ""
    localip: list[str] = field(default_factory=list)
    priority: int = 0
    hold: bool = False
    delay: str | None = None
    smtputf8: bool = False
    help: bool = False
    warnings: list[str] = field(default_factory=list)

    @property
    def queue_fields(self) -> list[str]:
        """The Sluice options given that only the queue itself can honour."""
        given = [("--tenant", self.tenant), ("--job", self.job),
                 ("--transport", self.transport), ("--localip", self.localip),
                 ("--priority", self.priority), ("--hold", self.hold), ("--delay", self.delay)]
        return [name for name, value in given if value]


def _usage(text: str) -> CommandError:
    return CommandError(f"sendmail: {text} (sluice sendmail --help lists the options)",
                        status=2)


def _sender(value: str) -> str:
    text = value.strip()
    if text.startswith("<") and text.endswith(">"):
        text = text[1:-1].strip()
    return text


def _long(out: SendmailArgs, name: str, value: str | None) -> None:
    if name in _LONG_FLAGS:
        if value is not None:
            raise _usage(f"{name} takes no value")
        setattr(out, name[2:], True)
        return
    assert value is not None
    if name == "--localip":
        out.localip.append(value)
    elif name == "--priority":
        if value not in ("0", "1"):
            raise _usage(f"--priority must be 0 or 1, not {value!r}")
        out.priority = int(value)
    else:
        setattr(out, name[2:], value)


def _letter(out: SendmailArgs, c: str, value: str) -> None:
    """Apply one single-letter option (value is '' for a flag)."""
    if c in _IGNORED:
        return
    if c == "t":
        out.from_headers = True
    elif c == "i":
        out.dot_ends = False
    elif c in "fr":
        out.sender = _sender(value)
    elif c == "F":
        out.full_name = value
    elif c == "C":
        out.config = value
    elif c == "I":
        out.mode = "i"
    elif c == "B":
        if value.upper() not in ("7BIT", "8BITMIME"):
            raise _usage("-B needs 7BIT or 8BITMIME")
    elif c == "N":
        words = {w.strip().lower() for w in value.split(",")}
        if not (words == {"never"} or (words and words <= _DSN_NOTIFY)):
            # As Postfix: a bad -N is reported and ignored, the mail still goes.
            out.warnings.append(f"bad -N value {value!r} ignored")
        else:
            out.notify = value
    elif c == "o":
        if value[:1] == "i":
            out.dot_ends = False
        elif value[:1] == "A" and len(value) == 1:
            raise _usage("-oA needs a file name")
        # -odb, -odi, -om, -o7, -o8, -oX...: ignored, as Postfix does.
    elif c == "b":
        if value[:1] not in ("m", "s", "i", "h", "H"):
            what = {"d": "daemon mode: run sluice serve", "p": "the queue listing: run sluice "
                    "qlist", "v": "address verification"}.get(value[:1], f"-b{value}")
            raise _usage(f"-b{value} is not supported ({what})")
        out.mode = value[:1]
    elif c == "q":
        if not value[:1].isdigit():  # -q15m is a daemon's interval: Postfix ignores it
            raise _usage(f"-q{value} is not supported (run sluice retry to retry the queue now)")
    elif c == "X":
        raise _usage(f"-X{value} is not supported")
    elif c == "n":
        raise _usage("-n is not supported")
    else:  # pragma: no cover - the option string and this table disagree
        raise AssertionError(c)


def parse_args(argv: list[str]) -> SendmailArgs:
    """Read a sendmail command line.  Raises CommandError (exit 2) on misuse."""
    out = SendmailArgs()
    i = 0
    while i < len(argv):
        word = argv[i]
        i += 1
        if word == "--":
            out.recipients += argv[i:]
            break
        if word in ("--help", "-?"):
            out.help = True
            continue
        if word.startswith("--"):
            name, eq, value = word.partition("=")
            if name in _LONG_FLAGS:
                _long(out, name, value if eq else None)
                continue
            if name not in _LONG_VALUE:
                raise _usage(f"unknown option {name}")
            if not eq:
                if i >= len(argv):
                    raise _usage(f"{name} needs a value")
                value = argv[i]
                i += 1
            _long(out, name, value)
            continue
        if not word.startswith("-") or word == "-":
            out.recipients.append(word)
            continue
        if word == "-q":  # not getopt-shaped: Postfix treats it apart too
            raise _usage("-q is not supported (run sluice retry to retry the queue now)")
        j = 1
        while j < len(word):
            c = word[j]
            j += 1
            if c in _FLAGS:
                _letter(out, c, "")
                continue
            if c not in _WITH_VALUE:
                raise _usage(f"unknown option -{c}")
            value = word[j:]
            if not value:
                if i >= len(argv):
                    raise _usage(f"-{c} needs a value")
                value = argv[i]
                i += 1
            _letter(out, c, value)
            break
    if out.from_headers and out.mode != "m":
        raise _usage("-t can be used only when queueing a message (-bm)")
    if out.mode == "s" and out.recipients:
        raise _usage("-bs takes no recipients")
    return out
