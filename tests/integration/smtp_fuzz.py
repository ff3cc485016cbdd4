"""A seeded fuzzer of SMTP sessions, for the suite's test and bench/smtp_fuzz.py.

SUMMARY
    session_script(rng) -> list[Step]        one random session, drawn from rng
    run_session(port, steps) -> Outcome      plays it against a server on 127.0.0.1
    fuzz(port, seed, sessions, threads) -> Tally

STRATEGY
    Grammar-biased random generation, not blind bytes: a session is a short
    list of steps, each a command line (EHLO, MAIL, RCPT, DATA, BDAT, AUTH,
    STARTTLS, garbage verbs...) with an argument that is valid about half the
    time and otherwise malformed (missing brackets, source routes, unknown
    or repeated parameters, NUL, 8-bit bytes, bare LF, lines past the
    998-octet limit).  Most steps are played lock-step (send, read the whole
    reply) so that later steps reach the states they aim at: after a 354
    the next step sends content (dot-stuffing, bare CR and LF, over-long
    lines, oversized bodies, a missing terminator).  Some steps pipeline
    several commands in one write; the last step may drop the connection
    mid-line, mid-content or without QUIT.

    Every reply line must be a three-digit code then ``-`` or a space
    (RFC 5321 section 4.2); anything else is a ``malformed`` reply.  A
    reply that does not come within REPLY_TIMEOUT_S is ``silent``.  Neither
    stops the run: they are counted and the caller decides.

    The same seed gives the same sessions, so a failure found by a long run
    is replayed with ``--seed`` and ``--first``.
"""

from __future__ import annotations

import random
import re
import socket
import threading
import time
from collections import Counter
from dataclasses import dataclass, field

#: How long one reply may take before the step counts as silent.  Generous:
#: the machine is shared, and the accepting fsync may wait behind others.
REPLY_TIMEOUT_S = 10.0

REPLY_LINE = re.compile(rb"^[2-5]\d\d[ -]")

# -- generation -------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Step:
    """One write, and how many reply lines-that-end-a-reply to wait for."""

    data: bytes
    replies: int = 1
    #: The step after which the client drops the connection, without QUIT.
    drop: bool = False
    #: Content sent only if the previous reply was 354.
    content: bool = False


GOOD_SENDERS = [b"<a@sender.example>", b"<>", b"<b.c+tag@sender.example> SIZE=300",
                b"<d@sender.example> BODY=8BITMIME", b"<\xc3\xa9@s\xc3\xa9nder.example> SMTPUTF8",
                b"<e@sender.example> BODY=7BIT SIZE=12"]
GOOD_RECIPIENTS = [b"<r1@dest.example>", b"<r2@dest.example>", b"<postmaster>",
                   b"<R3@DEST.EXAMPLE>", b"<\xc3\xbc@dest.example>", b"<\"q u\"@dest.example>"]
BAD_ADDRESSES = [b"", b"<", b">", b"<<>>", b"a@b", b"<@relay.example:x@dest.example>",
                 b"<x@>", b"<@>", b"<x@dest.example", b"<x@[127.0.0.1]>", b"<x@[IPv6:::1]>",
                 b"<x@dest.example> SIZE=", b"<x@dest.example> SIZE=-1",
                 b"<x@dest.example> SIZE=99999999999999999999", b"<x@dest.example> BODY=9BIT",
                 b"<x@dest.example> FOO=BAR", b"<x@dest.example> SIZE=1 SIZE=2",
                 b"<x@dest.example> NOTIFY=NEVER", b"<x\x00y@dest.example>",
                 b"<x@dest.example>\x00", b"<x@dest\xff.example>", b"<x y@dest.example>",
                 b"<x@" + b"d" * 300 + b".example>", b"<" + b"l" * 80 + b"@dest.example>",
                 b"<x@dest.example> SMTPUTF8=yes", b"<x@.example>", b"<x@dest..example>"]
VERBS = [b"NOOP", b"RSET", b"VRFY", b"EXPN", b"HELP", b"STARTTLS", b"AUTH", b"BDAT",
         b"XCLIENT", b"TURN", b"ETRN", b"SEND", b"SAML", b"SOML", b"DEBUG", b"GET", b"\x00",
         b"QUIT"]
AUTH_ARGS = [b"PLAIN", b"LOGIN", b"PLAIN AGFAYg==", b"CRAM-MD5", b"", b"PLAIN ====", b"X"]


def _junk(rng: random.Random, n: int) -> bytes:
    return bytes(rng.randrange(256) for _ in range(n))


def _case(rng: random.Random, word: bytes) -> bytes:
    r = rng.random()
    if r < 0.7:
        return word
    if r < 0.85:
        return word.lower()
    return bytes(c ^ 0x20 if 65 <= c <= 90 and rng.random() < 0.5 else c for c in word)


def _eol(rng: random.Random) -> bytes:
    return rng.choices([b"\r\n", b"\n", b"\r\r\n", b" \r\n"], [90, 5, 3, 2])[0]


def _address(rng: random.Random, good: list[bytes]) -> bytes:
    if rng.random() < 0.55:
        return rng.choice(good)
    if rng.random() < 0.9:
        return rng.choice(BAD_ADDRESSES)
    return b"<" + _junk(rng, rng.randint(1, 40)).replace(b"\n", b"") + b">"


def _command(rng: random.Random) -> bytes:
    """One command line, without its end of line."""
    kind = rng.choices(["ehlo", "mail", "rcpt", "data", "verb", "junk", "long", "empty"],
                       [12, 18, 24, 14, 14, 6, 4, 2])[0]
    if kind == "ehlo":
        verb = rng.choice([b"EHLO", b"HELO", b"LHLO"])
        arg = rng.choice([b" client.test", b" [127.0.0.1]", b"", b" ", b" a b c",
                          b" " + b"h" * rng.randint(64, 600), b" \xc3\xa9.test"])
        return _case(rng, verb) + arg
    if kind == "mail":
        sep = rng.choice([b"FROM:", b"FROM: ", b"FROM:", b"FROM", b"TO:", b""])
        return _case(rng, b"MAIL ") + _case(rng, sep) + _address(rng, GOOD_SENDERS)
    if kind == "rcpt":
        sep = rng.choice([b"TO:", b"TO: ", b"TO:", b"TO", b"FROM:", b""])
        return _case(rng, b"RCPT ") + _case(rng, sep) + _address(rng, GOOD_RECIPIENTS)
    if kind == "data":
        return _case(rng, b"DATA") + rng.choice([b"", b"", b"", b" now", b" \x00"])
    if kind == "verb":
        verb = rng.choice(VERBS)
        if verb == b"AUTH":
            return verb + b" " + rng.choice(AUTH_ARGS)
        if verb == b"BDAT":
            return verb + rng.choice([b" 10", b" 0 LAST", b" x", b""])
        return _case(rng, verb) + rng.choice([b"", b" ", b" arg", b" <x@dest.example>"])
    if kind == "junk":
        return _junk(rng, rng.randint(1, 60)).replace(b"\n", b" ").replace(b"\r", b" ")
    if kind == "long":
        return _case(rng, rng.choice([b"NOOP ", b"MAIL FROM:<", b"RCPT TO:<", b"EHLO "])) + (
            b"x" * rng.randint(990, 4000))
    return b""


def _content(rng: random.Random) -> tuple[bytes, bool]:
    """A message body after 354, and whether it ends with the terminator."""
    lines = [b"Subject: fuzz", b"From: <a@sender.example>"]
    if rng.random() < 0.3:
        lines.append(b"X-Bad-Header " + _junk(rng, 20).replace(b"\n", b""))
    lines.append(b"")
    for _ in range(rng.randint(0, 30)):
        kind = rng.choices(["text", "dot", "8bit", "long", "bare", "junk"],
                           [50, 10, 10, 4, 8, 8])[0]
        if kind == "text":
            lines.append(b"line %d" % rng.randrange(10**6))
        elif kind == "dot":
            lines.append(rng.choice([b".", b"..", b".x", b". ", b"..\r"]))
        elif kind == "8bit":
            lines.append("caf\u00e9 \u2603".encode() + _junk(rng, 3).replace(b"\n", b""))
        elif kind == "long":
            lines.append(b"L" * rng.randint(999, 5000))
        elif kind == "bare":
            lines.append(rng.choice([b"a\rb", b"a\nb", b"\r", b"x\r\r"]))
        else:
            lines.append(_junk(rng, rng.randint(1, 100)))
    body = b"\r\n".join(lines) + b"\r\n"
    if rng.random() < 0.03:
        body += b"B" * rng.randint(70_000, 200_000) + b"\r\n"  # past a 64 KB size limit
    if rng.random() < 0.05:
        return body, False
    return body + b".\r\n", True


def session_script(rng: random.Random) -> list[Step]:
    """A random session: a few steps, perhaps a content step after DATA, perhaps a drop."""
    steps: list[Step] = []
    if rng.random() < 0.8:
        steps.append(Step(_case(rng, rng.choice([b"EHLO", b"HELO"])) + b" client.test\r\n"))
    for _ in range(rng.randint(0, 14)):
        r = rng.random()
        if r < 0.12:
            n = rng.randint(2, 6)
            lines = [_command(rng) for _ in range(n)]
            # A pipelined DATA would leave content ambiguous; keep it lock-step.
            lines = [ln for ln in lines if not ln.upper().startswith(b"DATA")] or [b"NOOP"]
            steps.append(Step(b"".join(ln + b"\r\n" for ln in lines), replies=len(lines)))
        elif r < 0.22:
            # A well-formed transaction, so deep states (content, queueing) are reached often.
            steps += [Step(b"MAIL FROM:" + rng.choice(GOOD_SENDERS[:4]) + b"\r\n"),
                      Step(b"RCPT TO:" + rng.choice(GOOD_RECIPIENTS[:4]) + b"\r\n"),
                      Step(b"DATA\r\n")]
            body, ends = _content(rng)
            steps.append(Step(body, content=True, drop=not ends))
            if not ends:
                return steps
        else:
            line = _command(rng)
            steps.append(Step(line + _eol(rng)))
            if line.upper().startswith(b"DATA") and rng.random() < 0.9:
                body, ends = _content(rng)
                steps.append(Step(body, content=True, drop=not ends))
                if not ends:
                    return steps
            if line.upper() == b"QUIT":
                return steps
    end = rng.random()
    if end < 0.6:
        steps.append(Step(b"QUIT\r\n"))
    elif end < 0.75:
        steps.append(Step(_command(rng)[: rng.randint(0, 20)], replies=0, drop=True))
    elif end < 0.85:
        steps.append(Step(_junk(rng, rng.randint(1, 2000)), replies=0, drop=True))
    # else: the connection just closes after the last reply
    return steps


# -- playing ----------------------------------------------------------------


@dataclass(slots=True)
class Outcome:
    codes: Counter[int] = field(default_factory=Counter)
    malformed: list[bytes] = field(default_factory=list)
    silent: int = 0
    refused: int = 0  # the connection could not be made or was reset at once
    accepted: int = 0  # 250 after content
    inputs: int = 0  # writes made: command lines, pipelined groups, contents, junk


class _Reader:
    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.buf = b""

    def reply(self, out: Outcome) -> int | None:
        """The code of the next whole reply; None when closed or silent."""
        deadline = time.monotonic() + REPLY_TIMEOUT_S
        while True:
            while b"\n" in self.buf:
                line, self.buf = self.buf.split(b"\n", 1)
                if not REPLY_LINE.match(line):
                    out.malformed.append(line[:200])
                    continue
                if line[3:4] == b" ":
                    return int(line[:3])
            left = deadline - time.monotonic()
            if left <= 0:
                out.silent += 1
                return None
            self.sock.settimeout(left)
            try:
                chunk = self.sock.recv(65536)
            except TimeoutError:
                out.silent += 1
                return None
            except OSError:
                return None
            if not chunk:
                return None
            self.buf += chunk


def run_session(port: int, steps: list[Step], out: Outcome) -> None:
    """Plays one session; counts into ``out``."""
    try:
        sock = socket.create_connection(("127.0.0.1", port), timeout=REPLY_TIMEOUT_S)
    except OSError:
        out.refused += 1
        return
    reader = _Reader(sock)
    try:
        code = reader.reply(out)  # the greeting
        if code is None:
            return
        out.codes[code] += 1
        last = code
        for step in steps:
            if step.content and last != 354:
                continue
            out.inputs += 1
            try:
                sock.sendall(step.data)
            except OSError:
                return
            if step.drop:
                return
            for _ in range(step.replies):
                code = reader.reply(out)
                if code is None:
                    return
                out.codes[code] += 1
                last = code
                if step.content and code == 250:
                    out.accepted += 1
                if code in (221, 421):
                    return
    finally:
        sock.close()


@dataclass(slots=True)
class Tally:
    sessions: int = 0
    outcome: Outcome = field(default_factory=Outcome)
    elapsed_s: float = 0.0


def fuzz(port: int, seed: int, sessions: int, threads: int = 4, first: int = 0) -> Tally:
    """Plays sessions ``first`` .. ``first + sessions - 1`` of ``seed`` from ``threads`` threads.

    Session i is drawn from its own generator (seeded with seed and i), so
    any one of them can be replayed alone.
    """
    tally = Tally()
    lock = threading.Lock()
    todo = iter(range(first, first + sessions))

    def worker() -> None:
        out = Outcome()
        while True:
            with lock:
                i = next(todo, None)
            if i is None:
                break
            run_session(port, session_script(random.Random(f"{seed}:{i}")), out)
            with lock:
                tally.sessions += 1
        with lock:
            tally.outcome.codes.update(out.codes)
            tally.outcome.malformed += out.malformed
            tally.outcome.silent += out.silent
            tally.outcome.refused += out.refused
            tally.outcome.accepted += out.accepted
            tally.outcome.inputs += out.inputs

    start = time.monotonic()
    workers = [threading.Thread(target=worker) for _ in range(threads)]
    for t in workers:
        t.start()
    for t in workers:
        t.join()
    tally.elapsed_s = time.monotonic() - start
    return tally
