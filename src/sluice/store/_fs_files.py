"""The filesystem flavour's control files: their names, their format, one file read or written.

SUMMARY
    Control, Meta, Rcpt (one control file and its parts), Name and
    parse_name (what a file name tells), count_names (a directory's
    recipients and SPIDs from its names) and count_dirs (several
    directories'), read_control, write_file,
    NameFilter, STATE_DIRS.

DESCRIPTION
    A control file holds the recipients of one message for one destination
    domain, all in one state.  Its name carries the SPID, the first
    recipient index, the number of recipients, the priority and the
    domain (``<SPID>-<first index>+<recipients>p<priority>@<domain>.mmq``),
    so counting and selecting by queue id or domain read names only; its
    content is one JSON object.  sluice.store.fs describes the whole tree.

STRATEGIES
    Names are parsed with one regular expression (a third of what the
    string operations it replaced cost) and cached: a refill lists the
    same names batch after batch.  A listing or a count of a million
    names goes around the cache, and a walk that only sorts by SPID
    builds no Name (spid_of_name).  A count parses no name one by one:
    count_names lists a directory as bytes and runs a pattern over its
    names joined by line breaks (0.9 s for a million names against 3 s):
    one that takes the SPIDs alone when two byte counts show every name
    holds one recipient, else one that takes each name's ``+N`` too.

    Files are read with orjson: half of what the standard library's
    decoder costs on a control file, which is most of a listing of a
    million (it takes bytes and refuses data after the object itself).

SEE ALSO
    sluice.store.fs (the store), sluice.store._fs_batch (a batch's view)
"""

from __future__ import annotations

import collections
import contextlib
import functools
import itertools
import json
import os
import re
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import quote

import orjson

from sluice._fdio import write_all
from sluice.model import QueueEntry, QueueState, Reply, Selector, parse_qid, reply_fields
from sluice.store import StorageError

#: The version of layout.json: 2 files incoming/ by arrival (incoming/<bucket>/).
LAYOUT_VERSION = 2
#: The version a control file's JSON carries ("v").
FILE_VERSION = 1

#: State directories (deferred has one level more: deferred/<T>/).
STATE_DIRS: dict[QueueState, str] = {
    QueueState.INCOMING: "incoming",
    QueueState.DEFERRED: "deferred",
    QueueState.BOUNCE: "bounces",
    QueueState.HOLD: "hold",
    QueueState.ACTIVE: "active",
    QueueState.DELIVERING: "delivering",
}
DIR_STATES = {d: s for s, d in STATE_DIRS.items()}

SUFFIX = ".mmq"
DOMAIN_MAX = 160
REF_RE = re.compile(r"^([0-9A-F]{8,32})-(\d{1,6})\.ref$")


def enc_domain(domain: str) -> str:
    return quote(domain, safe="-._[]:")[:DOMAIN_MAX]


@dataclass(frozen=True, slots=True)
class Name:
    spid: str
    idx0: int
    n: int
    priority: int
    domain: str  # encoded, maybe shortened

    @classmethod
    def parse(cls, name: str) -> Name | None:
        return parse_name(name)


#: A control file's name: SPID, first index, recipients, priority, domain.
_NAME = re.compile(r"([0-9A-F]{8,32})-([0-9]{1,6})\+([0-9]{1,6})p([01])@(.*)\.mmq", re.S)


@functools.lru_cache(maxsize=1 << 18)
def parse_name(name: str) -> Name | None:
    # Cached: a refill lists the same names batch after batch.
    m = _NAME.fullmatch(name)
    if m is None:
        return None
    spid, idx0, n, prio, domain = m.groups()
    return Name(spid, int(idx0), int(n), int(prio), domain)


#: Control files' names one a line, as bytes (count_names): the SPID, and the
#: recipients unless their group is made non-capturing ("?:").
_NAME_LINES = rb"^([0-9A-F]{8,32})-[0-9]{1,6}\+(%s[0-9]{1,6})p[01]@%s\.mmq$"


@functools.lru_cache(maxsize=128)
def _names_of_domain(domain: str | None, spids_only: bool = False) -> re.Pattern[bytes]:
    """The pattern of count_names: any domain, or this encoded one; the SPIDs alone or with +N."""
    any_or_this = rb"[^\n]*" if domain is None else re.escape(domain.encode())
    return re.compile(_NAME_LINES % (b"?:" if spids_only else b"", any_or_this), re.M)


def count_names(path: Path, domain: str | None = None) -> tuple[int, list[bytes]]:
    """The recipients in a directory's control files and their SPIDs (as bytes), by name.

    The answer parse_name gives name by name, with ``domain`` (encoded, as
    NameFilter has it) only the files of that domain; a missing directory
    has none.  One listing as bytes and one pass of a pattern over the
    names joined by line breaks: no string or Name a file.  A directory
    with a name holding a line break (none of ours) is parsed name by name.

    Most control files hold one recipient (``+1``).  Over every domain, a
    first pass takes the SPIDs alone, and two counts of bytes show whether
    every ``+`` of the listing is a matched name's ``+1p`` (a name has one
    ``+``: an encoded domain has none); only otherwise does a second pass
    read each ``+N``.
    """
    try:
        names = os.listdir(os.fsencode(path))
    except FileNotFoundError:
        return 0, []
    except OSError as exc:
        raise StorageError(f"cannot list {path}: {exc}") from exc
    text = b"\n".join(names)
    if text.count(b"\n") != max(len(names) - 1, 0):
        parsed = [p for p in map(parse_name.__wrapped__, map(os.fsdecode, names))
                  if p is not None and (domain is None or p.domain == domain)]
        return sum(p.n for p in parsed), [p.spid.encode() for p in parsed]
    if domain is None:
        spids: list[bytes] = _names_of_domain(None, True).findall(text)
        if text.count(b"+") == len(spids) == text.count(b"+1p"):
            return len(spids), spids
    found = _names_of_domain(domain).findall(text)
    by_n = collections.Counter([n for _, n in found])
    return sum(int(n) * k for n, k in by_n.items()), [spid for spid, _ in found]


def count_dirs(root: str, rel_dirs: Iterable[str], domain: str | None = None
               ) -> tuple[list[int], set[bytes]]:
    """count_names of each directory under ``root``: its recipients, and every SPID once.

    Module-level and of picklable arguments: a piece of a count that other
    processes share (sluice.store._fs_tally).
    """
    counts: list[int] = []
    spids: set[bytes] = set()
    for rel_dir in rel_dirs:
        n, of = count_names(Path(root, rel_dir), domain)
        counts.append(n)
        spids.update(of)
    return counts, spids


def spid_of_name(name: str) -> str | None:
    """The SPID of a control file's name; None for a name parse_name refuses.

    No Name built: a listing of a million files sorts them by SPID and
    needs nothing else from their names.
    """
    m = _NAME.fullmatch(name)
    return None if m is None else m.group(1)


@dataclass(frozen=True, slots=True)
class Meta:
    """Message-level fields, the same in every control file of a message."""

    sender: str
    arrival_at: float
    tenantid: str
    jobid: str
    transportid: str
    localip: tuple[str, ...]
    is_report: bool
    size: int
    smtputf8: bool = False


@dataclass(slots=True)
class Rcpt:
    idx: int
    rcpt: str
    attempts: int = 0
    reply: Reply | None = None


@dataclass(slots=True)
class Control:
    """One control file: recipients of one message and domain, one state."""

    spid: str
    domain: str
    state: QueueState
    next_at: float
    priority: int
    meta: Meta
    rcpts: list[Rcpt]
    gen: str = ""
    path: str = ""  # relative to the root, "" while not yet placed
    prepared: str = ""  # a temporary file already holding dump(), relative to the root

    def name(self) -> str:
        return (f"{self.spid}-{self.rcpts[0].idx}+{len(self.rcpts)}p{self.priority}"
                f"@{enc_domain(self.domain)}{SUFFIX}")

    def entries(self) -> list[QueueEntry]:
        m = self.meta
        return [
            QueueEntry(
                spid=self.spid, idx=r.idx, sender=m.sender, recipient=r.rcpt,
                state=self.state, arrival_at=m.arrival_at, next_attempt_at=self.next_at,
                attempts=r.attempts, last_reply=r.reply, priority=self.priority,
                tenantid=m.tenantid, jobid=m.jobid, transportid=m.transportid,
                localip=m.localip, is_report=m.is_report, size=m.size, domain=self.domain,
                smtputf8=m.smtputf8,
            )
            for r in self.rcpts
        ]

    def same_content(self, other: Control) -> bool:
        return (self.next_at == other.next_at and self.priority == other.priority
                and self.rcpts == other.rcpts)

    def dump(self) -> bytes:
        m = self.meta
        doc = {
            "v": FILE_VERSION, "gen": self.gen, "spid": self.spid, "domain": self.domain,
            "next_at": self.next_at, "priority": self.priority, "sender": m.sender,
            "arrival_at": m.arrival_at, "tenantid": m.tenantid, "jobid": m.jobid,
            "transportid": m.transportid, "localip": list(m.localip),
            "is_report": m.is_report, "size": m.size, "smtputf8": m.smtputf8,
            "rcpts": [[r.idx, r.rcpt, r.attempts,
                       None if r.reply is None else r.reply.to_record()]
                      for r in self.rcpts],
        }
        return json.dumps(doc, separators=(",", ":"), ensure_ascii=False).encode() + b"\n"

    @classmethod
    def load(cls, data: bytes, state: QueueState, path: str) -> Control:
        doc = orjson.loads(data)
        meta = Meta(doc["sender"], doc["arrival_at"], doc["tenantid"], doc["jobid"],
                     doc["transportid"], tuple(doc["localip"]), doc["is_report"], doc["size"],
                     # Absent from files written before Sluice kept the flag.
                     doc.get("smtputf8", False))
        rcpts = [Rcpt(r[0], r[1], r[2], None if r[3] is None else Reply.from_record(r[3]))
                 for r in doc["rcpts"]]
        return cls(doc["spid"], doc["domain"], state, doc["next_at"], doc["priority"], meta,
                   rcpts, doc["gen"], path)


gen_counter = itertools.count()


def new_gen() -> str:
    return f"{os.getpid():x}.{time.time_ns():x}.{next(gen_counter):x}"


def state_of(rel: str) -> QueueState:
    return DIR_STATES[rel.split("/", 1)[0]]


def read_control(root: Path, rel: str) -> Control | None:
    try:
        data = read_small(f"{root}/{rel}")
    except FileNotFoundError:
        return None
    except OSError as exc:
        raise StorageError(f"cannot read {root / rel}: {exc}") from exc
    try:
        return Control.load(data, state_of(rel), rel)
    except (ValueError, KeyError, IndexError, TypeError) as exc:
        raise StorageError(f"{root / rel} is not a control file: {exc}") from exc


def read_message(root: str, rels: Iterable[str], selector: Selector
                 ) -> list[tuple[str, QueueState, bytes]]:
    """(relative path, state, bytes) of the control files of one message a listing shows.

    ``root`` is the queue's directory as a string; a file gone meanwhile
    is left out.  ``selector`` must be one the names answer (names_suffice):
    only its states are checked here.
    """
    out = []
    for rel in rels:
        state = state_of(rel)
        if selector.states and state not in selector.states:
            continue
        path = f"{root}/{rel}"
        try:
            out.append((rel, state, read_small(path)))
        except FileNotFoundError:
            continue
        except OSError as exc:
            raise StorageError(f"cannot read {path}: {exc}") from exc
    return out


def message_rows(root: str, files: Iterable[tuple[str, QueueState, bytes]]
                 ) -> list[tuple[Any, ...]]:
    """The listing rows (sluice.store.LISTING_FIELDS) of one message's control files.

    ``files`` as read_message() read them.  Made from each file's JSON
    without building a Control or QueueEntry (a listing of a million
    files spent most of its time there); in recipient order, a recipient
    once if its file moved while it was listed.
    """
    rows: dict[int, tuple[Any, ...]] = {}
    for rel, state, data in files:
        try:
            doc = orjson.loads(data)  # a ValueError for anything after the object
            spid, sender, domain = doc["spid"], doc["sender"], doc["domain"]
            arrival, next_at, priority = doc["arrival_at"], doc["next_at"], doc["priority"]
            tenant, job, transport = doc["tenantid"], doc["jobid"], doc["transportid"]
            localip, size, report = ",".join(doc["localip"]), doc["size"], doc["is_report"]
            value = state.value
            for idx, rcpt, attempts, reply in doc["rcpts"]:
                if reply is None:
                    rows[idx] = (spid, idx, value, sender, rcpt, domain, arrival, next_at,
                                 attempts, priority, tenant, job, transport, localip, None,
                                 None, None, None, size, report)
                else:
                    rows[idx] = (spid, idx, value, sender, rcpt, domain, arrival, next_at,
                                 attempts, priority, tenant, job, transport, localip,
                                 *reply_fields(reply), size, report)
        except (ValueError, KeyError, IndexError, TypeError) as exc:
            raise StorageError(f"{root}/{rel} is not a control file: {exc}") from exc
    return [rows[i] for i in sorted(rows)]


def page_rows(piece: tuple[str, tuple[QueueState, ...], list[list[str]]]
              ) -> list[tuple[Any, ...]]:
    """The listing rows of a page of messages: (root, states, each message's paths).

    What a listing's worker process runs (sluice.store.ListsInPieces); the
    page's messages in order, each as read_message() and message_rows().
    """
    return rows_of_page(piece[0], read_page(piece))


def rows_of_page(root: str, page: list[list[tuple[str, QueueState, bytes]]]
                 ) -> list[tuple[Any, ...]]:
    """The listing rows of a page read_page() read, message by message."""
    return [row for files in page for row in message_rows(root, files)]


def read_page(piece: tuple[str, tuple[QueueState, ...], list[list[str]]]
              ) -> list[list[tuple[str, QueueState, bytes]]]:
    """The control files of a page's messages, as read_message() reads them, in order."""
    root, states, page = piece
    selector = Selector(states=states)
    return [read_message(root, rels, selector) for rels in page]


def read_small(path: str) -> bytes:
    """A small file's bytes: one open, reads until the end, one close."""
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        data = os.read(fd, 1 << 16)
        if len(data) == 1 << 16:
            parts = [data]
            while chunk := os.read(fd, 1 << 16):
                parts.append(chunk)
            data = b"".join(parts)
        return data
    finally:
        os.close(fd)


def scandir_entries(path: Path) -> Iterator[os.DirEntry[str]]:
    """The entries of a directory, one at a time (none if it is missing)."""
    try:
        with os.scandir(path) as it:
            yield from it
    except FileNotFoundError:
        return
    except OSError as exc:
        raise StorageError(f"cannot list {path}: {exc}") from exc


def scandir(path: Path) -> Iterator[str]:
    """The names in a directory, one at a time (none if it is missing)."""
    for entry in scandir_entries(path):
        yield entry.name


def listdir(path: Path) -> list[str]:
    try:
        return os.listdir(path)
    except FileNotFoundError:
        return []
    except OSError as exc:
        raise StorageError(f"cannot list {path}: {exc}") from exc


def unlink(path: Path) -> None:
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)


class NameFilter:
    """Whether a file of a given name may hold entries a selector picks.

    Built once per listing: a selection of thousands of queue ids is a set
    lookup per name, not a scan of the ids.
    """

    __slots__ = ("domain", "spids")

    def __init__(self, selector: Selector | None) -> None:
        self.spids: frozenset[str] | None = None
        self.domain: str | None = None
        if selector is not None:
            if selector.qids:
                self.spids = frozenset(parse_qid(q)[0] for q in selector.qids)
            if selector.domain is not None:
                self.domain = enc_domain(selector.domain)

    @property
    def everything(self) -> bool:
        """Whether every name passes (no queue ids, no domain)."""
        return self.spids is None and self.domain is None

    def __call__(self, parsed: Name) -> bool:
        if self.spids is not None and parsed.spid not in self.spids:
            return False
        return self.domain is None or parsed.domain == self.domain


def names_suffice(selector: Selector) -> bool:
    """Whether counting by names alone answers the selector exactly."""
    return (not selector.qids and selector.sender is None and selector.recipient is None
            and selector.tenantid is None and selector.jobid is None
            and selector.transportid is None
            and (selector.domain is None or len(enc_domain(selector.domain)) < DOMAIN_MAX))


def write_file(path: Path, data: bytes) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o640)
    try:
        write_all(fd, data)
    except BaseException:
        os.close(fd)
        unlink(path)
        raise
    os.close(fd)

