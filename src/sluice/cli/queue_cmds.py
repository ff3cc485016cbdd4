"""Queue commands: qlist, qcount, qshape, hold, release, retry, delete, priority, bounce.

DESCRIPTION
    qlist follows Mailismus (its lines: sluice.listing): semicolon-separated
    fields, the first row names them, the last column (DSN) tells a
    delivery report from a message, and the totals close the listing.
    qshape follows Postfix's qshape(1): recipients per domain by age in
    minutes.

    The commands open the queue directly.  They work while ``sluice serve``
    runs: SQLite readers never block the server, and a running queue
    manager learns of changes through the store's change feed.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import sys
import time
from typing import Any

from sluice.cli import CommandError, load
from sluice.listing import listing_jobs, write_qlist
from sluice.model import QueueState, Selector
from sluice.queue import QSHAPE_EDGES_MIN, Queue
from sluice.render import counts_json, entry_json, shape_table, totals_line
from sluice.store import Action, Counts, CountsInProcesses, StorageError, Store, narrow


def _add_selector_args(p: argparse.ArgumentParser, with_ids: bool) -> None:
    if with_ids:
        p.add_argument("ids", nargs="*", metavar="QUEUEID",
                       help="queue ids (SPID-N) or SPIDs (all recipients of the message)")
    p.add_argument("--state", action="append", choices=[s.value for s in QueueState],
                   help="only entries in this state (repeatable)")
    p.add_argument("--domain", help="recipient domain")
    p.add_argument("--sender", help="envelope sender ('' for the null sender)")
    p.add_argument("--recipient", help="recipient address")
    p.add_argument("--tenant", help="tenantid")
    p.add_argument("--job", help="jobid")
    p.add_argument("--transport", help="transportid")


def selector_from_args(args: argparse.Namespace) -> Selector:
    """The Selector the command's selector options describe; a bad value ends the command."""
    try:
        return Selector(
            qids=tuple(getattr(args, "ids", None) or ()),
            states=tuple(QueueState(s) for s in (args.state or ())),
            domain=args.domain,
            sender=args.sender,
            recipient=args.recipient,
            tenantid=args.tenant,
            jobid=args.job,
            transportid=args.transport,
        )
    except ValueError as exc:
        raise CommandError(str(exc), status=2) from None


def _open(args: argparse.Namespace) -> Queue:
    try:
        return Queue.open(load(args))
    except StorageError as exc:
        raise CommandError(str(exc)) from None


def _audit(args: argparse.Namespace, action: Action, selector: Selector, qids: list[str],
           priority: int | None) -> None:
    """Record a queue action made from the command line in the audit history.

    The same record the API writes, who being ``cli:<user>``.
    """
    from sluice.api.audit import AuditLog, audit_path

    path = audit_path(load(args))
    try:
        AuditLog(path).queue_action(f"cli:{_user()}", action, selector, all_=bool(args.all),
                                    reason="from the command line", qids=qids,
                                    priority=priority, now=time.time())
    except OSError as exc:
        # The change is made; say that its record is missing, in one line.
        print(f"warning: audit history {path}: {exc.strerror or exc} (the change was made)",
              file=sys.stderr)


def register(sub: Any) -> None:
    """Add the queue commands (qlist, qcount, qshape and the actions) to the command line."""
    p = sub.add_parser("qlist", help="list the queue (semicolon-separated, Mailismus style)")
    _add_selector_args(p, with_ids=False)
    p.add_argument("--json", action="store_true", help="JSON instead of semicolon CSV")
    p.add_argument("--limit", type=int, default=None, help="at most this many entries")
    p.add_argument("--jobs", type=int, default=None, metavar="N",
                   help="processes that read a filesystem queue's files (default: two per CPU,"
                        " up to 8; 1: none); its totals are counted by at most one per CPU")
    p.set_defaults(func=cmd_qlist)

    p = sub.add_parser("qcount", help="the queue's totals")
    _add_selector_args(p, with_ids=False)
    p.add_argument("--json", action="store_true")
    p.add_argument("--jobs", type=int, default=None, metavar="N",
                   help="processes that may share a long count of a filesystem queue's names"
                        " (totals not trusted, or a selection by state or domain); at most"
                        " one per CPU (default: one per CPU, up to 4; 1: none)")
    p.set_defaults(func=cmd_qcount)

    p = sub.add_parser("qshape", help="recipients per domain by age (Postfix qshape)")
    _add_selector_args(p, with_ids=False)
    p.add_argument("--top", type=int, default=0, help="only the N largest domains")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=cmd_qshape)

    for action, text in (
        (Action.HOLD, "put entries on hold"),
        (Action.RELEASE, "release held entries"),
        (Action.RETRY, "retry deferred entries now"),
        (Action.DELETE, "delete entries (no NDR)"),
        (Action.BOUNCE, "bounce entries (the sender gets an NDR)"),
    ):
        p = sub.add_parser(action.value, help=text)
        _add_selector_args(p, with_ids=True)
        p.add_argument("--all", action="store_true", help="allow an empty selection (everything)")
        p.add_argument("--dry-run", action="store_true", help="only say how many would change")
        p.set_defaults(func=cmd_action, action=action)
    p = sub.add_parser("priority", help="set the priority (0 normal, 1 high)")
    p.add_argument("value", type=int, choices=(0, 1))
    _add_selector_args(p, with_ids=True)
    p.add_argument("--all", action="store_true")
    p.add_argument("--dry-run", action="store_true")
    p.set_defaults(func=cmd_action, action=Action.PRIORITY)


def _user() -> str:
    import getpass

    try:
        return getpass.getuser()
    except (KeyError, OSError):
        return "nobody"


# -- listing --------------------------------------------------------------------------------

def _jobs(args: argparse.Namespace, default: int) -> int:
    jobs = default if args.jobs is None else args.jobs
    if jobs < 1:
        raise CommandError(f"{args.command} --jobs: must be 1 or more, not {jobs}", status=2)
    return jobs


#: qcount's processes by default, at most: a count is a second of work at a million.
COUNT_JOBS = 4


def _count(store: Store, selector: Selector, jobs: int) -> Counts:
    """store.count, shared among at most ``jobs`` processes, one a CPU, where the store can.

    More processes than CPUs would only wait on each other: a count by
    names is the kernel's listing and a pattern, no disk wait once cached.
    """
    if isinstance(store, CountsInProcesses):
        return store.count_in_processes(selector, min(jobs, len(os.sched_getaffinity(0))))
    return store.count(selector)


def cmd_qlist(args: argparse.Namespace) -> int:
    """`sluice qlist`: the selected entries, semicolon-separated or as JSON with totals."""
    selector = selector_from_args(args)
    jobs = _jobs(args, listing_jobs())
    out = sys.stdout
    with _open(args) as queue:
        store = queue.store
        if args.json:
            out.write('{"entries": [')
            for i, e in enumerate(store.entries(selector, limit=args.limit)):
                out.write(("," if i else "") + "\n" + json.dumps(entry_json(e)))
            counts = _count(store, selector, jobs)
            out.write('\n], "totals": ' + json.dumps(counts_json(counts)) + "}\n")
            return 0
        write_qlist(out, store, selector, args.limit, jobs)
        counts = _count(store, selector, jobs)
    out.write(totals_line(counts) + "\n")
    return 0


def cmd_qcount(args: argparse.Namespace) -> int:
    """`sluice qcount`: the selected entries' totals, and their counts by state."""
    selector = selector_from_args(args)
    jobs = _jobs(args, COUNT_JOBS)  # _count keeps it to one a CPU
    with _open(args) as queue:
        counts = _count(queue.store, selector, jobs)
    if args.json:
        print(json.dumps(counts_json(counts)))
        return 0
    print(totals_line(counts))
    print("; ".join(f"{s.value}: {counts[s]}" for s in QueueState))
    return 0


def cmd_qshape(args: argparse.Namespace) -> int:
    """`sluice qshape`: entries per recipient domain by age (Postfix's qshape)."""
    selector = selector_from_args(args)
    edges_s = [m * 60.0 for m in QSHAPE_EDGES_MIN]
    with _open(args) as queue:
        shape = queue.store.shape(selector, time.time(), edges_s)
    if args.json:
        print(json.dumps({"buckets_min": list(QSHAPE_EDGES_MIN), "domains": shape}))
        return 0
    rows = shape_table(shape, args.top)
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    for r in rows:
        print(" ".join(cell.rjust(w) for cell, w in zip(r, widths, strict=True)))
    return 0


# -- actions ---------------------------------------------------------------------------------

def working(text: str) -> contextlib.AbstractContextManager[object]:
    """A spinner on stderr while a long call runs (a bulk action).

    Nothing when stderr is not a terminal (scripts, pipes, logs).
    """
    from rich.console import Console

    console = Console(stderr=True)
    if not console.is_terminal:
        return contextlib.nullcontext()
    return console.status(text)


_HEX_ID_RE = re.compile(r"^([0-9A-F]{4,32})(-\d{1,6})?$")


def resolve_ids(store: Store, what: str, ids: list[str]) -> list[str]:
    """Queue ids and SPIDs as given, each checked against the queue.

    A prefix of at least 4 hex digits stands for the one SPID it starts.
    An id that names nothing, or a prefix that fits several messages, ends
    the command (exit 2) with one line naming it: an operator who typed a
    wrong id must not read "bounced 0" and wonder.
    """
    out = []
    for given in ids:
        text = given.strip().upper()
        m = _HEX_ID_RE.match(text)
        if m is None:
            raise CommandError(f"{what}: {given!r} is not a queue id or SPID", status=2)
        prefix, idx = m.group(1), m.group(2) or ""
        if len(prefix) >= 8 and store.count(Selector(qids=(text,))).recipients:
            out.append(text)
            continue
        spids = sorted({e.spid for e in store.entries(Selector()) if e.spid.startswith(prefix)})
        if not spids:
            raise CommandError(f"{what}: no message in the queue has SPID or queue id {given}",
                               status=2)
        if len(spids) > 1:
            shown = ", ".join(spids[:3]) + (", ..." if len(spids) > 3 else "")
            raise CommandError(f"{what}: {given} is ambiguous: {len(spids)} messages have SPIDs "
                               f"starting so ({shown})", status=2)
        if idx and not store.count(Selector(qids=(spids[0] + idx,))).recipients:
            raise CommandError(f"{what}: message {spids[0]} has no recipient {idx[1:]}",
                               status=2)
        out.append(spids[0] + idx)
    return out


def cmd_action(args: argparse.Namespace) -> int:
    """A queue action (hold, release, retry, delete, bounce, priority) on ids or a selector.

    Exit 1 when ids were given and none changed; ``--dry-run`` only counts.
    """
    action: Action = args.action
    if not args.ids:
        selector = selector_from_args(args)
        if selector.is_empty and not args.all:
            raise CommandError(
                f"{action.value}: give queue ids or a selector (--domain, --sender, ...), "
                "or --all for the whole queue", status=2)
    with _open(args) as queue:
        if args.ids:
            args.ids = resolve_ids(queue.store, action.value, args.ids)
            selector = selector_from_args(args)
        if args.dry_run:
            touched_by = narrow(selector, action)
            n = 0 if touched_by is None else queue.store.count(touched_by).recipients
            print(f"{action.value}: would change {n} recipient(s)")
            return 0
        priority = getattr(args, "value", None)
        with working(f"{action.value}: changing the selected recipients"):
            touched = queue.act(selector, action, priority=priority)
        if action is Action.BOUNCE:
            with working(f"bounce: queueing NDRs for {len(touched)} recipient(s)"):
                queue.run_bounces()
        if touched:
            _audit(args, action, selector, [e.qid for e in touched], priority)
    verb = {"hold": "held", "release": "released", "retry": "scheduled for retry now",
            "delete": "deleted", "bounce": "bounced", "priority": "reprioritised"}[action.value]
    print(f"{verb} {len(touched)} recipient(s)")
    return 0 if touched or not selector.qids else 1
