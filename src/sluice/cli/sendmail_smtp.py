"""`sluice sendmail -bs`: an SMTP dialogue on standard input and output.

SUMMARY
    smtp_dialogue(cfg, args, rfile, wfile) -> exit status

DESCRIPTION
    Some programs (mutt with ``sendmail -bs``, older MUAs, test rigs) talk
    SMTP to the sendmail command instead of handing it a message.  This is
    the local end of that: HELO/EHLO, MAIL, RCPT, DATA, RSET, NOOP, VRFY,
    HELP and QUIT, one command per line, replies as RFC 5321 gives them.
    Each message is queued by sluice.cli.sendmail.queue_message, so the
    suppression list, the accounting and the hand-over to a running server
    are those of the plain command.

STRATEGIES
    Suppression at RCPT.  In reject mode a suppressed recipient is
    answered with the 550 5.1.1 the SMTP server gives; in drop mode it is
    accepted.  Either way it stays in the envelope handed to
    queue_message, which leaves it out of the queued message and writes
    its accounting line, as the server does.

    No pipelining, no AUTH, no STARTTLS: the peer is a local program that
    already runs as a local user; the 354 and the 250 after the dot come
    only when the message is durable (the rule: a 250 is never lost).

LIMITATIONS
    Only a line of at most 64 KiB is read as one; longer lines are split.
    A recipient refused at RCPT gets its accounting line only when the
    transaction reaches DATA (the plain SMTP server writes it at RCPT).

SEE ALSO
    sluice.cli.sendmail, RFC 5321
"""

from __future__ import annotations

import re
import tempfile
from typing import IO

from sluice.cli import CommandError
from sluice.cli.sendmail import (
    Envelope,
    complete_header,
    is_utf8_message,
    load_suppression,
    queue_message,
    split_header,
)
from sluice.cli.sendmail_args import SendmailArgs
from sluice.config import Config
from sluice.suppression import SuppressionMode

__all__ = ["smtp_dialogue"]

_PATH_RE = re.compile(rb"^(?:FROM|TO):\s*<([^>]*)>\s*(.*)$", re.IGNORECASE)


def _address(arg: bytes) -> tuple[str, list[str]] | None:
    m = _PATH_RE.match(arg)
    if m is None:
        return None
    try:
        address = m.group(1).decode()
    except UnicodeDecodeError:
        return None
    return address, m.group(2).decode(errors="replace").upper().split()


def smtp_dialogue(cfg: Config, args: SendmailArgs, rfile: IO[bytes], wfile: IO[bytes]) -> int:
    """Serve one SMTP dialogue; 0 when it ends with QUIT or end of input."""
    hostname = cfg.smtpd.hostname or cfg.node.hostname
    suppression = load_suppression(cfg)
    mode = SuppressionMode(cfg.suppression.mode)

    def say(*lines: str) -> None:
        for i, line in enumerate(lines):
            sep = " " if i == len(lines) - 1 else "-"
            wfile.write(line[:3].encode() + sep.encode() + line[4:].encode() + b"\r\n")
        wfile.flush()

    sender: str | None = None
    utf8_asked = False
    recipients: list[str] = []
    accepted = 0
    say(f"220 {hostname} ESMTP Sluice (sendmail -bs)")
    while True:
        line = rfile.readline(65536)
        if not line:
            return 0
        verb, _, arg = line.rstrip(b"\r\n").partition(b" ")
        cmd = verb.upper().decode(errors="replace")
        if cmd == "QUIT":
            say(f"221 2.0.0 {hostname} closing")
            return 0
        if cmd == "HELO":
            say(f"250 {hostname}")
        elif cmd == "EHLO":
            say(f"250 {hostname}", "250 8BITMIME", "250 SMTPUTF8", "250 ENHANCEDSTATUSCODES")
        elif cmd in ("NOOP", "HELP"):
            say("250 2.0.0 Ok")
        elif cmd == "VRFY":
            say("252 2.0.0 Send some mail, I'll try my best")
        elif cmd == "RSET":
            sender, recipients, accepted, utf8_asked = None, [], 0, False
            say("250 2.0.0 Ok")
        elif cmd == "MAIL":
            parsed = _address(arg)
            if sender is not None:
                say("503 5.5.1 Error: nested MAIL command")
            elif parsed is None:
                say("501 5.5.4 Syntax: MAIL FROM:<address>")
            else:
                sender, params = parsed
                utf8_asked = "SMTPUTF8" in params
                say("250 2.1.0 Ok")
        elif cmd == "RCPT":
            parsed = _address(arg)
            if sender is None:
                say("503 5.5.1 Error: need MAIL command")
            elif parsed is None or "@" not in parsed[0]:
                say("501 5.1.3 Syntax: RCPT TO:<address@domain>")
            else:
                address = parsed[0]
                recipients.append(address)
                entry = suppression.lookup(address)
                if entry is not None and mode is SuppressionMode.REJECT:
                    say(str(entry.reply(address)))
                else:
                    accepted += 1
                    say("250 2.1.5 Ok")
        elif cmd == "DATA":
            if sender is None or not accepted:
                say("503 5.5.1 Error: need RCPT command")
                continue
            say("354 End data with <CR><LF>.<CR><LF>")
            say(_data(cfg, args, rfile, Envelope(sender, recipients, utf8_asked, args)))
            sender, recipients, accepted, utf8_asked = None, [], 0, False
        else:
            say("500 5.5.2 Error: command not recognized")


def _data(cfg: Config, args: SendmailArgs, rfile: IO[bytes], env: Envelope) -> str:
    """Read the message up to the lone dot, queue it; the reply to give."""
    with tempfile.SpooledTemporaryFile(max_size=8 << 20) as raw, \
            tempfile.SpooledTemporaryFile(max_size=8 << 20) as message:
        ended = False
        while True:
            line = rfile.readline(65536)
            if not line:
                break
            if line in (b".\r\n", b".\n"):
                ended = True
                break
            raw.write(line[1:] if line.startswith(b".") else line)  # RFC 5321 4.5.2
        if not ended:
            return "451 4.3.0 Error: the input ended inside the message; not queued"
        raw.seek(0)
        header, _ = complete_header(cfg, args, env.sender, split_header(raw))
        message.write(header)
        body_at = message.tell()
        for chunk in iter(lambda: raw.read(65536), b""):
            message.write(chunk)
        message.seek(body_at)
        env.smtputf8 = env.smtputf8 or is_utf8_message(args, env.sender, env.recipients,
                                                       header, message)
        try:
            outcome = queue_message(cfg, env, message)
        except CommandError as exc:
            return f"451 4.3.0 {exc}"
    if outcome.queued:
        return f"250 2.0.0 Ok: queued as {outcome.spid}"
    if outcome.refused and outcome.via:  # the server refused every recipient
        return str(outcome.refused[0][1])
    return "250 2.0.0 Ok: every recipient is suppressed; nothing queued"
