"""`sluice sendmail`: queue a message from a local program, as sendmail(1).

SUMMARY
    sluice sendmail [options] [recipient ...] < message
    sendmail [options] [recipient ...] < message     (sluice under that name)
    queue_message(cfg, envelope, message) -> Outcome

DESCRIPTION
    The command line is Postfix's (sluice.cli.sendmail_args).  The
    message is read from standard input up to its end, or up to a line
    holding a single dot unless -i or -oi is given; -bs instead speaks
    SMTP on standard input and output (sluice.cli.sendmail_smtp) and
    queues each message of the dialogue the same way.  A message without
    Date, Message-ID or From gets them (From with -F's full name).

    Suppression.  The recipients go through the suppression list
    (``suppression.path``, ``suppression.mode``) with the lookup and the
    550 5.1.1 reply the SMTP server and the injection API use, and each
    suppressed recipient is written to the accounting log as theirs are.
    In reject mode each one is named on standard error; if none is left,
    nothing is queued and the exit status is 1.  In drop mode they are
    left out without a word, as the SMTP server does.

STRATEGIES
    Hand-over to a running server.  SQLite, the file store and PostgreSQL
    let several processes write, so sendmail opens the queue itself.  The
    kv store (LevelDB) admits one process: while ``sluice serve`` holds
    it, sendmail hands the message to that server over SMTP, on the first
    ``smtpd.listen`` address (a wildcard address is reached on loopback).
    SMTP rather than the HTTP injection API because the SMTP listener is
    there whenever the server runs and needs no token; loopback clients
    are in ``smtpd.mynetworks`` by default.  The server then applies its
    own policy, suppression included; its 250 is the queueing.  Options
    only the queue can honour (--hold, --tenant, ...) cannot travel over
    SMTP: with them the hand-over is refused rather than done without.

    Read, then queue.  The message goes to a temporary file first (in
    memory up to 8 MB), so the queue is not held open while a slow
    program writes, and a message that ends badly is never half queued.

SEE ALSO
    sluice.cli.sendmail_args (options), sluice.cli.sendmail_smtp (-bs),
    sluice.suppression, docs/cli.md (sendmail), Postfix sendmail(1)
"""

from __future__ import annotations

import argparse
import contextlib
import email.utils
import io
import re
import smtplib
import sys
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass, field
from email.parser import BytesHeaderParser
from email.policy import compat32
from typing import IO, Any

from sluice.cli import CommandError, load
from sluice.cli.queue_cmds import _user
from sluice.cli.sendmail_args import USAGE, SendmailArgs, parse_args
from sluice.config import Config, ConfigError, parse_duration
from sluice.mime import HeaderScan
from sluice.model import Reply, Submission, ascii_envelope
from sluice.queue import Queue
from sluice.store import StorageError
from sluice.suppression import (
    SuppressionEntry,
    SuppressionFileError,
    SuppressionList,
    SuppressionMode,
    suppressed_event,
)

__all__ = ["Envelope", "Outcome", "cmd_sendmail", "main", "queue_message", "register"]

_BARE_LF = re.compile(rb"(?<!\r)\n")
NO_RECIPIENTS = "sendmail: no recipients (give them as arguments, or use -t)"

#: Store flavours that admit a single process (Store.shared_access False).
SINGLE_PROCESS_STORES = frozenset({"kv"})


@dataclass(slots=True)
class Envelope:
    """The envelope of the message to queue, and the options it came with."""
    sender: str
    recipients: list[str]
    smtputf8: bool = False
    args: SendmailArgs = field(default_factory=SendmailArgs)


@dataclass(slots=True)
class Outcome:
    """What became of one message: queued (spid), refused, or dropped recipients."""

    spid: str = ""
    queued: int = 0
    size: int = 0
    refused: list[tuple[str, Reply]] = field(default_factory=list)
    via: str = ""  # "" when queued here, else the server it was handed to

    def report(self, out: IO[str], err: IO[str]) -> int:
        """Print it as the command does; returns the exit status."""
        for address, reply in self.refused:
            print(f"sluice: sendmail: <{address}> not queued: {reply}", file=err)
        if not self.queued:
            if self.refused:
                print("sluice: sendmail: nothing queued: every recipient was refused", file=err)
                return 1
            print("queued nothing: every recipient is suppressed", file=out)
            return 0
        via = f" by the running server at {self.via}" if self.via else ""
        print(f"queued {self.spid or '(id not given)'}{via} for {self.queued} recipient(s), "
              f"{self.size} bytes", file=out)
        return 0


def register(sub: Any) -> None:
    """Add `sluice sendmail` to the command line; it parses its own options."""
    p = sub.add_parser("sendmail", help="queue a message read from standard input "
                       "(Postfix's sendmail options)", add_help=False, prefix_chars="\0",
                       usage="sluice sendmail [options] [recipient ...]")
    p.add_argument("argv", nargs="*")
    p.set_defaults(func=cmd_sendmail)


def main(argv: list[str] | None = None) -> int:
    """Sluice run as ``sendmail``: the configuration comes from -C or $SLUICE_CONFIG."""
    from sluice.cli import run_command

    args = argparse.Namespace(config=None, argv=list(sys.argv[1:] if argv is None else argv))
    return run_command(cmd_sendmail, args)


# -- reading ------------------------------------------------------------------------------

def read_message(stream: IO[bytes], dot_ends: bool, into: IO[bytes]) -> None:
    """Copy the message from ``stream`` to ``into``.

    To its end, or (``dot_ends``) to a line holding a single dot, which is
    not part of it.
    """
    at_line_start = True
    while True:
        line = stream.readline(65536)
        if not line:
            return
        if dot_ends and at_line_start and line in (b".\n", b".\r\n", b"."):
            return
        at_line_start = line.endswith(b"\n")
        into.write(line)


def split_header(message: IO[bytes], limit: int = 1 << 20) -> bytes:
    """The header block, blank line included; ``message`` is left at the body."""
    out = bytearray()
    while True:
        line = message.readline(65536)
        out += line
        if not line or line in (b"\r\n", b"\n"):
            return bytes(out)
        if len(out) > limit:
            raise CommandError("sendmail: the message header is larger than 1 MB")


def header_lines(header: bytes) -> Iterator[bytes]:
    """Header fields with their continuation lines, one item per field."""
    lines = b""
    for line in io.BytesIO(header):
        if line[:1] in (b" ", b"\t") and lines:
            lines += line
            continue
        if lines:
            yield lines
        lines = line
    if lines:
        yield lines


def complete_header(cfg: Config, args: SendmailArgs, sender: str,
                    header: bytes) -> tuple[bytes, list[str]]:
    """The header with Date, Message-ID and From added where missing.

    Bcc is removed under -t; returns the recipients -t found in it too.
    """
    parsed = BytesHeaderParser(policy=compat32).parsebytes(header)
    found: list[str] = []
    if args.from_headers:
        fields = parsed.get_all("To", []) + parsed.get_all("Cc", []) + parsed.get_all("Bcc", [])
        found = [addr for _, addr in email.utils.getaddresses(fields) if addr]
        if parsed.get("Bcc") is not None:
            header = b"".join(line for line in header_lines(header)
                              if not line.lower().startswith(b"bcc:"))
    eol = b"\r\n" if header.endswith(b"\r\n") else b"\n"
    extra = b""
    if parsed.get("Date") is None:
        extra += b"Date: " + email.utils.formatdate(localtime=False).encode() + eol
    if parsed.get("Message-ID") is None:
        extra += b"Message-ID: " + email.utils.make_msgid(domain=cfg.node.hostname).encode() + eol
    if parsed.get("From") is None and sender:
        name = (args.full_name or "").strip()
        value = email.utils.formataddr((name, sender)) if name else f"<{sender}>"
        extra += b"From: " + value.encode() + eol
    if not header.strip():  # no header at all: the text is the body
        header = eol
    return extra + header, found


def is_utf8_message(args: SendmailArgs, sender: str, recipients: list[str], header: bytes,
                    body: IO[bytes]) -> bool:
    """Whether to flag the message SMTPUTF8, as Postfix's sendmail does.

    That is, smtputf8_autodetect_classes = sendmail: a message whose
    envelope or any header block (attachments' too) is UTF-8 is flagged,
    so delivery treats it as received with SMTPUTF8.
    """
    if args.smtputf8 or not ascii_envelope(sender, recipients):
        return True
    scan = HeaderScan()
    scan.feed(header)
    if not scan.settled:
        start = body.tell()
        for chunk in iter(lambda: body.read(65536), b""):
            scan.feed(chunk)
            if scan.settled:
                break
        body.seek(start)
    return scan.close()


# -- queueing -----------------------------------------------------------------------------

def load_suppression(cfg: Config) -> SuppressionList:
    """The suppression list the server uses.

    A file that cannot be used is a config error, as it is for ``sluice
    serve`` (suppression must not quietly turn off).
    """
    try:
        return SuppressionList.load(cfg.suppression.path)
    except SuppressionFileError as exc:
        raise ConfigError(cfg.source, "suppression.path", str(exc)) from None


def _log_suppressed(queue: Queue, sender: str, items: list[tuple[str, SuppressionEntry]],
                    spid: str, size: int) -> None:
    """One accounting line per suppressed recipient, as the SMTP server writes."""
    if queue.accounting is None or not items:
        return
    now = queue.clock()
    queue.accounting.record([suppressed_event(address, sender, entry, now, node=queue.node,
                                              spid=spid, size=size)
                             for address, entry in items], now)


def _open_queue(cfg: Config) -> Queue | StorageError:
    """The queue, or why a single-process store will not open.

    A running server holds such a store; the message then goes to that
    server.
    """
    try:
        return Queue.open(cfg)
    except StorageError as exc:
        if cfg.queue.store in SINGLE_PROCESS_STORES and server_address(cfg) is not None:
            return exc
        raise CommandError(f"sendmail: not queued: {exc}") from None


def queue_message(cfg: Config, env: Envelope, message: IO[bytes]) -> Outcome:
    """Queue ``message`` (header first, at position 0) for ``env``.

    Here, or by the running server when it holds the queue.
    """
    queue = _open_queue(cfg)
    if isinstance(queue, StorageError):
        return hand_over(cfg, env, message, queue)
    with queue:
        suppression = load_suppression(cfg)
        mode = SuppressionMode(cfg.suppression.mode)
        kept: list[str] = []
        suppressed: list[tuple[str, SuppressionEntry]] = []
        for rcpt in env.recipients:
            entry = suppression.lookup(rcpt)
            if entry is None:
                kept.append(rcpt)
            else:
                suppressed.append((rcpt, entry))
        refused = [] if mode is SuppressionMode.DROP else [
            (a, e.reply(a)) for a, e in suppressed]
        if not kept:
            _log_suppressed(queue, env.sender, suppressed, "", 0)
            return Outcome(refused=refused)
        a = env.args
        sub = Submission(
            sender=env.sender, recipients=tuple(kept), tenantid=a.tenant, jobid=a.job,
            transportid=a.transport, localip=tuple(a.localip), priority=a.priority,
            hold=a.hold, delay_s=parse_duration(a.delay) if a.delay else 0.0,
            smtputf8=env.smtputf8,
        )
        message.seek(0)
        try:
            accepted = queue.submit(sub, iter(lambda: message.read(65536), b""))
        except StorageError as exc:
            raise CommandError(f"sendmail: not queued: {exc}") from None
        _log_suppressed(queue, env.sender, suppressed, accepted.spid, accepted.size)
    return Outcome(spid=accepted.spid, queued=len(accepted.qids), size=accepted.size,
                   refused=refused)


def server_address(cfg: Config) -> tuple[str, int] | None:
    """Where the running server's SMTP listener is reached from this host.

    The first ``smtpd.listen`` address; a wildcard one on loopback.
    """
    for listen in cfg.smtpd.listen:
        host, _, port = listen.rpartition(":")
        host = host.strip("[]")
        if not port.isdigit():
            continue
        if host in ("", "0.0.0.0", "*"):
            host = "127.0.0.1"
        elif host == "::":
            host = "::1"
        return host, int(port)
    return None


def hand_over(cfg: Config, env: Envelope, message: IO[bytes], why: StorageError) -> Outcome:
    """Submit over SMTP to the server that holds the queue."""
    address = server_address(cfg)
    assert address is not None  # _open_queue checked
    host, port = address
    where = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
    if env.args.queue_fields:
        raise CommandError(
            f"sendmail: not queued: {', '.join(env.args.queue_fields)} cannot reach the queue, "
            f"which the running server holds ({cfg.queue.store} store); without them "
            f"sendmail hands the message over by SMTP at {where}; or use the injection API")
    message.seek(0)
    # smtplib stuffs dots only at the starts of CRLF lines and leaves bytes as
    # they are: a local program's bare LF lines become CRLF lines first.
    data = _BARE_LF.sub(b"\r\n", message.read())
    out = Outcome(via=where)
    try:
        with smtplib.SMTP(host, port, local_hostname=cfg.node.hostname,
                          timeout=cfg.smtpd.timeout) as smtp:
            smtp.ehlo()
            options = ["SMTPUTF8"] if env.smtputf8 and smtp.has_extn("smtputf8") else []
            if smtp.has_extn("8bitmime"):
                options.append("BODY=8BITMIME")
            code, text = smtp.mail(env.sender, options)
            if code != 250:
                raise CommandError(f"sendmail: not queued: {where} refused the sender: {code} "
                                   f"{text.decode(errors='replace')}")
            accepted = 0
            for rcpt in env.recipients:
                code, text = smtp.rcpt(rcpt)
                if code in (250, 251):
                    accepted += 1
                else:
                    out.refused.append((rcpt, _reply(code, text)))
            if not accepted:
                return out
            code, text = smtp.data(data)
            if code != 250:
                raise CommandError(f"sendmail: not queued: {where} answered the message with "
                                   f"{code} {text.decode(errors='replace')}")
            words = text.decode(errors="replace").split()
            out.spid = words[-1] if "queued" in words else ""
            out.queued, out.size = accepted, len(data)
    except (OSError, smtplib.SMTPException) as exc:
        raise CommandError(f"sendmail: not queued: {why}; and the server at {where} cannot "
                           f"take the message: {exc}") from None
    return out


def _reply(code: int, text: bytes) -> Reply:
    words = text.decode(errors="replace").split(" ", 1)
    if len(words) == 2 and words[0][:1] in "245" and words[0].count(".") == 2:
        return Reply(code, words[0], words[1])
    return Reply(code, "", " ".join(words))


# -- the command --------------------------------------------------------------------------

def default_sender(cfg: Config) -> str:
    return f"{_user()}@{cfg.node.hostname}"


def cmd_sendmail(args: argparse.Namespace) -> int:
    """`sluice sendmail`: queue a message read from standard input, as Postfix's sendmail."""
    opts = parse_args(list(args.argv))
    if opts.help:
        sys.stdout.write(USAGE)
        return 0
    for warning in opts.warnings:
        print(f"sluice: sendmail: {warning}", file=sys.stderr)
    if opts.config is not None:
        args.config = opts.config
    if opts.mode in ("i", "h", "H"):  # newaliases, host status: nothing to do here
        return 0
    cfg = load(args)
    if opts.delay:
        parse_duration(opts.delay)  # a bad duration is misuse, found before reading
    if opts.mode == "s":
        from sluice.cli.sendmail_smtp import smtp_dialogue

        return smtp_dialogue(cfg, opts, sys.stdin.buffer, sys.stdout.buffer)
    if not opts.recipients and not opts.from_headers:
        raise CommandError(NO_RECIPIENTS, status=2)
    sender = opts.sender if opts.sender is not None else default_sender(cfg)
    with contextlib.ExitStack() as stack:
        raw = stack.enter_context(tempfile.SpooledTemporaryFile(max_size=8 << 20))
        read_message(sys.stdin.buffer, opts.dot_ends, raw)
        raw.seek(0)
        header = split_header(raw)
        header, found = complete_header(cfg, opts, sender, header)
        recipients = opts.recipients + found
        if not recipients:
            raise CommandError(NO_RECIPIENTS, status=2)
        message = stack.enter_context(tempfile.SpooledTemporaryFile(max_size=8 << 20))
        message.write(header)
        body_at = message.tell()
        for chunk in iter(lambda: raw.read(65536), b""):
            message.write(chunk)
        message.seek(body_at)
        utf8 = is_utf8_message(opts, sender, recipients, header, message)
        env = Envelope(sender=sender, recipients=recipients, smtputf8=utf8, args=opts)
        outcome = queue_message(cfg, env, message)
    return outcome.report(sys.stdout, sys.stderr)


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
