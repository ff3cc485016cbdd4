"""The meta queue behind one interface, whatever keeps it.

SUMMARY
    Store (a Protocol), Transition, Action, Counts, Change, StorageError,
    open_store(config); ListsRows and LISTING_FIELDS (an optional, cheaper
    listing).

DESCRIPTION
    Callers (the queue life cycle in sluice.queue, the CLI, the API) speak
    only this interface; SQL, file layouts and key schemes stay inside the
    flavours: ``sqlite`` (embedded default), ``fs`` (Mailismus control
    files), ``postgres`` (several nodes, one queue) and ``kv`` (ZoneMTA's
    LevelDB layout).  Every flavour passes tests/integration/test_store_*.

    Durability: submit() and apply() return only when their effect is on
    stable storage.  Concurrent callers share one commit (group commit); a
    flavour that cannot do so must still be correct, only slower.

    State changes made by a running queue manager (claim, results) carry
    ``expect``: the states the entry must still be in, so that an operator's
    hold or delete made meanwhile wins over a late delivery result.  A
    successful delivery is the exception: mail that went out must leave the
    queue whatever an operator did to its entry in the meantime.

    Operator actions (modify) are defined once, as data, in
    sluice.store._actions: the states each touches and what it changes;
    every flavour applies that data.  They are also appended to a change
    feed that a running queue manager polls (changes_since), so it can
    drop its in-memory copy and re-inject the entry, as Halon does.

    Listing a million entries.  entries() builds a QueueEntry per row,
    which is most of the cost of ``sluice qlist`` at a million.  A flavour
    that can read plain rows cheaply also offers ListsRows.list_rows():
    tuples of LISTING_FIELDS in chunks, formatted by the one qlist
    formatter (sluice.listing); for the others sluice.listing adapts
    entries() to the same rows.  The filesystem flavour also offers
    ListsInPieces: the listing split into pieces that other processes read
    and format while this one walks the tree; and CountsInProcesses: a
    long count by names shared likewise.

INVARIANTS
    Every entry is in exactly one state.  Content is deleted after the
    last entry of its message has left the queue, and never before.
"""

from __future__ import annotations

import concurrent.futures
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import IO, TYPE_CHECKING, Any, Protocol, runtime_checkable

from sluice.model import Accepted, QueueEntry, QueueState, Reply, Selector, Submission
from sluice.spool import Content
from sluice.store._actions import ACTION_STATES, Action, narrow

if TYPE_CHECKING:
    from sluice.config import Config

__all__ = [
    "ACTION_STATES",
    "CHANGES_KEEP_S",
    "LISTING_FIELDS",
    "ORPHAN_AGE_S",
    "Action",
    "ApplyByFuture",
    "Change",
    "Counts",
    "CountsInProcesses",
    "ListsInPieces",
    "ListsRows",
    "ReadsContentsAhead",
    "SharedClaims",
    "StorageError",
    "Store",
    "Transition",
    "narrow",
    "open_store",
]


#: Every flavour keeps operator changes this long in its change feed.
CHANGES_KEEP_S = 3600.0

#: Content without queue entries is removed by recover() only once this
#: old: younger content may belong to a submission that another process
#: (or node) wrote and has not committed yet.
ORPHAN_AGE_S = 3600.0


class StorageError(Exception):
    """The store could not do what was asked (I/O error, full disk, lost server).

    Always temporary from the client's point of view: the SMTP server answers
    451 4.3.0, never 250.
    """


@dataclass(frozen=True, slots=True)
class Transition:
    """Move one entry to ``state`` (None: it leaves the queue).

    ``expect``: apply only if the entry is currently in one of these states
    (empty = any).  ``attempted`` counts one more delivery attempt.
    ``next_attempt_at`` is required for DEFERRED.
    """

    qid: str
    state: QueueState | None
    next_attempt_at: float | None = None
    reply: Reply | None = None
    attempted: bool = False
    expect: tuple[QueueState, ...] = ()

    def __post_init__(self) -> None:
        if self.state is QueueState.DEFERRED and self.next_attempt_at is None:
            raise ValueError("a deferral needs next_attempt_at")


@dataclass(frozen=True, slots=True)
class Counts:
    """Totals as qcount shows them."""

    by_state: dict[QueueState, int] = field(default_factory=dict)
    messages: int = 0

    @property
    def recipients(self) -> int:
        """How many recipient entries are queued, over all states."""
        return sum(self.by_state.values())

    def __getitem__(self, state: QueueState) -> int:
        return self.by_state.get(state, 0)


@dataclass(frozen=True, slots=True)
class Change:
    """One entry in the operator change feed."""

    seq: int
    qid: str
    action: Action


@runtime_checkable
class SharedClaims(Protocol):
    """A store whose queue several nodes share (PostgreSQL): each claim names its node."""

    def own_in_flight(self) -> list[QueueEntry]:
        """This node's entries whose attempt had started (state delivering)."""
        ...


#: The fields of a listing row (ListsRows.list_rows), in order; the SQL
#: flavours' column names.  The values are an entry's, flat: ``state`` its
#: value, ``localip`` the addresses joined by commas ('' for none), the
#: last reply in four fields (``last_code`` None: no reply; the others may
#: then be None too), ``is_report`` true or false.  Text fields other than
#: the reply's are never None.
LISTING_FIELDS = (
    "spid", "idx", "state", "sender", "recipient", "domain", "arrival_at", "next_attempt_at",
    "attempts", "priority", "tenantid", "jobid", "transportid", "localip",
    "last_code", "last_enhanced", "last_text", "last_mta", "size", "is_report",
)


@runtime_checkable
class ListsRows(Protocol):
    """A store that lists plain rows cheaply: no QueueEntry per row (SQL flavours, fs)."""

    def list_rows(self, selector: Selector, *, limit: int | None = None
                  ) -> Iterator[list[tuple[Any, ...]]]:
        """The entries entries() would give, as chunks of LISTING_FIELDS tuples.

        Same order, selection and ``limit``; a chunk holds at least one row.
        """
        ...


@runtime_checkable
class ListsInPieces(Protocol):
    """A store whose listing splits into pieces other processes can read (fs).

    qlist of a million control files is mostly reading and parsing them,
    work two processes can share (sluice.listing.write_qlist).
    """

    def listing_pieces(self, selector: Selector
                       ) -> tuple[Callable[[Any], list[tuple[Any, ...]]], Iterator[Any]] | None:
        """A module-level function and the pieces, in listing order; None: not this selection.

        ``function(piece)`` gives the piece's listing rows (LISTING_FIELDS)
        in any process; the pieces are picklable and, listed in order,
        make the rows list_rows(selector) would give.
        """
        ...


@runtime_checkable
class CountsInProcesses(Protocol):
    """A store whose long counts by name can share the work among processes (fs).

    Counting a million control files by name (totals that cannot be
    trusted, or a selection by state or domain) is mostly listing
    directories, work that divides by directory (sluice.store._fs_tally).
    """

    def count_in_processes(self, selector: Selector | None, jobs: int) -> Counts:
        """Store.count, with up to ``jobs`` processes (this one among them) for a long listing."""
        ...


@runtime_checkable
class ReadsContentsAhead(Protocol):
    """A store that reads the small contents of several messages in one go (SQLite, PostgreSQL).

    For SQLite each read of its own costs a cold page cache (in WAL mode a
    reader drops its cache whenever another connection has written); for
    PostgreSQL, a round trip to the server.  So the queue manager reads
    the contents of the deliveries it starts together
    (sluice.runtime.deliveries).
    """

    #: Contents of at most this many bytes can be read ahead (SQLite: those
    #: kept inline; PostgreSQL: those in one chunk); the rest are opened.
    ahead_max: int

    def inline_contents(self, spids: Sequence[str]) -> dict[str, bytes]:
        """The contents of those of ``spids`` that are small enough; the others are absent."""
        ...

    def open_large(self, spid: str) -> IO[bytes]:
        """open_content for a message of more than ahead_max bytes, looking where such are kept.

        The queue manager neither reads such a content ahead nor asks the
        database for it first: for SQLite that read was a wasted cold
        transaction per big message.  The answer is open_content's.
        """
        ...


class Store(Protocol):
    """A meta queue flavour with its spool.  All methods are thread-safe."""

    flavour: str
    #: Whether several processes may open the same queue at once (SQLite,
    #: PostgreSQL: yes; LevelDB: no -- one process owns it).  `sluice serve`
    #: runs its receivers in separate processes only when this is true.
    shared_access: bool
    #: Content of at most this many bytes, handed over in memory, is kept in
    #: the meta queue's own commit instead of a spool file (0: never).  A
    #: receiver may submit such a message straight from its event loop: the
    #: call touches no file.
    inline_max: int

    # -- submission ------------------------------------------------------------

    def submit(self, submission: Submission, content: Content, now: float) -> Accepted:
        """Spool the content and queue one entry per recipient; durable on return."""
        ...

    def submit_future(
        self, submission: Submission, content: Content, now: float
    ) -> concurrent.futures.Future[Accepted]:
        """As submit(); the content is written now, the future resolves when durable."""
        ...

    # -- the queue manager's side ------------------------------------------------

    def claim(self, limit: int, now: float, quota_deferred: int) -> list[QueueEntry]:
        """Move up to ``limit`` entries from incoming and due deferred to active.

        Alternates one from each; at least ``quota_deferred`` percent come from
        deferred when both have work.  Within each, the tenants with entries
        waiting share it by the store's ``tenant_weights``
        (sluice.fairshare.fair_pick); within a tenant, priority 1 first,
        then oldest first.  The returned entries are in that interleaved order.
        """
        ...

    def apply(self, transitions: Sequence[Transition], *, wait: bool = True,
              durable: bool = True) -> set[str]:
        """Apply state changes; returns the qids that were applied.

        ``durable=False`` is for changes whose loss in a power cut only
        repeats work -- attempt outcomes, which the queue manager would
        otherwise redo -- never for operator actions or NDR bookkeeping.  A
        flavour may then return before the change is flushed, but must not
        delete content the change frees until it is.  Flavours that gain
        nothing from it treat it as durable.
        """
        ...

    def apply_future(self, transitions: Sequence[Transition], *, durable: bool = True,
                     flush_soon: bool = False) -> concurrent.futures.Future[set[str]]:
        """As apply(), without waiting: the future resolves as apply() would return.

        For a caller on an event loop (asyncio.wrap_future), which then
        needs no thread of its own to wait in.  ``flush_soon`` (with
        ``durable=False``): the future still resolves at the commit, but the
        flavour flushes right after it rather than whenever another change
        needs a flush (queue.success_sync "write": successes).  Flavours
        that flush every change anyway (fs, postgres) ignore both.
        """
        ...

    def claim_bounces(self, limit: int, now: float, lease_s: float) -> list[QueueEntry]:
        """Lease up to ``limit`` entries in the bounce state for NDR generation.

        Only entries whose next_attempt_at <= now are taken; their
        next_attempt_at becomes now + lease_s, so a concurrent caller (another
        process or node) skips them, and a caller that crashes before removing
        them leaves them to be taken again when the lease ends.  Ordered by
        queue id, so the entries of one message come together.
        """
        ...

    def recover(self, now: float) -> int:
        """After a restart: entries left active/delivering by this node become due deferred.

        Orphaned spool files are removed.  Returns the count.
        """
        ...

    def expired(self, cutoff_at: float, reports_cutoff_at: float,
                limit: int = 10000) -> list[QueueEntry]:
        """Deferred entries that arrived before the cutoff.

        Reports (NDRs) before ``reports_cutoff_at``.
        """
        ...

    def due_at(self) -> float | None:
        """The earliest next_attempt_at among deferred entries (None: none)."""
        ...

    def oldest(self) -> dict[QueueState, float]:
        """The arrival time of the oldest entry of each state that has one.

        Cheap enough for every scrape: an index step per state, or the
        names a count reads anyway; never a read of every entry.
        """
        ...

    # -- operator side -------------------------------------------------------------

    def modify(self, selector: Selector, action: Action, now: float,
               priority: int | None = None, reply: Reply | None = None
               ) -> list[QueueEntry]:
        """Apply an operator action; returns the affected entries as they were."""
        ...

    def changes_since(self, seq: int) -> tuple[int, list[Change]]:
        """Operator changes after ``seq``; returns the newest seq and the changes."""
        ...

    # -- reading -----------------------------------------------------------------

    def get(self, qid: str) -> QueueEntry | None:
        """The entry with queue id ``qid``; None if there is none."""
        ...

    def entries(self, selector: Selector, *, after: str | None = None,
                limit: int | None = None) -> Iterator[QueueEntry]:
        """Entries in queue-id order (i.e. arrival order), after cursor ``after``."""
        ...

    def count(self, selector: Selector | None = None) -> Counts:
        """Totals as qcount shows them, of the entries ``selector`` matches (all without one)."""
        ...

    def shape(self, selector: Selector, now: float,
              edges_s: Sequence[float]) -> dict[str, list[int]]:
        """Per recipient domain, entry counts by age bucket (qshape).

        Bucket i counts ages < edges_s[i] (and >= edges_s[i-1]); the last
        bucket counts the rest, so each list has len(edges_s) + 1 items.
        """
        ...

    def open_content(self, spid: str) -> IO[bytes]:
        """The content of message ``spid``, for streaming reads."""
        ...

    def close(self) -> None:
        """Release the store's files and connections; it is not used after."""
        ...


class ApplyByFuture:
    """Store.apply defined once, on the flavour's apply_future."""

    def apply_future(self, transitions: Sequence[Transition], *, durable: bool = True,
                     flush_soon: bool = False) -> concurrent.futures.Future[set[str]]:
        """Store.apply_future; each flavour has its own."""
        raise NotImplementedError

    def apply(self, transitions: Sequence[Transition], *, wait: bool = True,
              durable: bool = True) -> set[str]:
        """Store.apply: apply_future, and its result when ``wait``."""
        fut = self.apply_future(transitions, durable=durable)
        return fut.result() if wait else set()


def applied_nothing() -> concurrent.futures.Future[set[str]]:
    """apply_future's answer to no transitions."""
    fut: concurrent.futures.Future[set[str]] = concurrent.futures.Future()
    fut.set_result(set())
    return fut


def open_store(config: Config) -> Store:
    """The store flavour that ``queue.store`` names, opened on its paths."""
    flavour = config.queue.store
    if flavour == "sqlite":
        from sluice.store.sqlite import SqliteStore

        return SqliteStore.from_config(config)
    if flavour == "fs":
        from sluice.store.fs import FsStore

        store: Store = FsStore.from_config(config)
        return store
    if flavour == "postgres":
        from sluice.store.postgres import PgStore

        store = PgStore.from_config(config)
        return store
    if flavour == "kv":
        from sluice.store.kv import KvStore

        store = KvStore.from_config(config)
        return store
    raise ValueError(f"unknown store flavour {flavour!r}")
