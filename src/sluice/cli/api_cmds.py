"""Live policy commands through a running server: suspend, condition, policy-audit.

DESCRIPTION
    These talk to `sluice serve` over its REST API (sluice.api.client),
    because suspensions and conditions live in the running scheduler:

    suspend add FIELD=VALUE... --reason R [--ttl 30m] [--id ID] [--tag T]
    suspend remove ID --reason R
    suspend list [--json]
    condition add COUNTER FIELD=VALUE... --reason R [--concurrency N]
                  [--rate X/Y] [--connectinterval S] [--position P] [--ttl D]
    condition remove COUNTER ID --reason R
    policy-audit list [--limit N] [--json]
    policy-audit show ID
    policy-audit rollback ID --reason R [--force]

    Every change is recorded in the server's audit history under the
    name of the token used (--token, $SLUICE_API_TOKEN, or the first of
    api.tokens), with the reason given.  --api names another server
    (default: api.listen).

    Exit status: 0 done, 1 refused or no server, 2 misuse (bad arguments,
    or a request the server finds invalid).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Sequence
from datetime import UTC, datetime
from typing import Any

from sluice.api.client import ApiClient, ApiRequestError, ApiUnavailable
from sluice.cli import CommandError, load

FIELDS = ("tenantid", "jobid", "transportid", "localip", "grouping", "remoteip", "remotemx",
          "recipientdomain")


def _client_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--api", metavar="URL", help="the server (default: http://<api.listen>)")
    p.add_argument("--token", help="an API token (default: $SLUICE_API_TOKEN, or the first "
                                   "of api.tokens)")


def register(sub: Any) -> None:
    """Add `sluice suspend`, `sluice condition` and `sluice policy-audit` to the command line."""
    p = sub.add_parser("suspend", help="suspend pickup of matching mail in the running server")
    ssub = p.add_subparsers(dest="suspend_command", metavar="ACTION")
    ssub.required = True
    a = ssub.add_parser("add", help="suspend mail matching every FIELD=VALUE")
    a.add_argument("fields", nargs="+", metavar="FIELD=VALUE",
                   help=f"fields: {', '.join(FIELDS)}")
    a.add_argument("--ttl", help="how long (30m, 2h, 1d); default: until removed")
    a.add_argument("--id", dest="sid", help="an id (default: the fields, e.g. "
                                            "recipientdomain=example.com)")
    a.add_argument("--tag", default="")
    a.add_argument("--reason", required=True, help="why (kept in the audit history)")
    _client_args(a)
    a.set_defaults(func=cmd_suspend_add)
    r = ssub.add_parser("remove", help="lift a suspension")
    r.add_argument("sid", metavar="ID")
    r.add_argument("--reason", required=True)
    _client_args(r)
    r.set_defaults(func=cmd_suspend_remove)
    ls = ssub.add_parser("list", help="suspensions in force")
    ls.add_argument("--json", action="store_true")
    _client_args(ls)
    ls.set_defaults(func=cmd_suspend_list)

    p = sub.add_parser("condition", help="add or remove pickup policy conditions live")
    csub = p.add_subparsers(dest="condition_command", metavar="ACTION")
    csub.required = True
    a = csub.add_parser("add", help="add a condition to a counter of the running policy")
    a.add_argument("counter", metavar="COUNTER", help="the counter's id (sluice policy show)")
    a.add_argument("match", nargs="+", metavar="FIELD=VALUE",
                   help="values to match: literal, #group, wildcard or /regex/")
    a.add_argument("--concurrency", type=int)
    a.add_argument("--rate", help="X or X/Y (X per Y seconds)")
    a.add_argument("--connectinterval", type=float, metavar="SECONDS")
    a.add_argument("--position", type=int, default=0,
                   help="where among the counter's conditions (0: first; first match wins)")
    a.add_argument("--ttl", help="how long (30m, 2h, 1d); default: until removed")
    a.add_argument("--id", dest="cid")
    a.add_argument("--tag", default="")
    a.add_argument("--reason", required=True)
    _client_args(a)
    a.set_defaults(func=cmd_condition_add)
    r = csub.add_parser("remove", help="remove a condition (by id)")
    r.add_argument("counter", metavar="COUNTER")
    r.add_argument("cid", metavar="ID")
    r.add_argument("--reason", required=True)
    _client_args(r)
    r.set_defaults(func=cmd_condition_remove)

    p = sub.add_parser("policy-audit", help="the running server's history of changes")
    asub = p.add_subparsers(dest="audit_command", metavar="ACTION")
    asub.required = True
    ls = asub.add_parser("list", help="changes, newest first")
    ls.add_argument("--limit", type=int, default=20)
    ls.add_argument("--json", action="store_true")
    _client_args(ls)
    ls.set_defaults(func=cmd_audit_list)
    sh = asub.add_parser("show", help="one change, with its before and after")
    sh.add_argument("record", type=int, metavar="ID")
    _client_args(sh)
    sh.set_defaults(func=cmd_audit_show)
    rb = asub.add_parser("rollback", help="undo one change")
    rb.add_argument("record", type=int, metavar="ID")
    rb.add_argument("--reason", required=True)
    rb.add_argument("--force", action="store_true",
                    help="roll a policy reload back even if the policy changed since")
    _client_args(rb)
    rb.set_defaults(func=cmd_audit_rollback)


# --------------------------------------------------------------------------


def _call(args: argparse.Namespace, method: str, path: str, *,
          query: dict[str, Any] | None = None, body: Any = None) -> Any:
    client = ApiClient.from_config(load(args), url=args.api, token=args.token)
    try:
        return client.request(method, path, query=query, body=body)
    except ApiUnavailable as exc:
        raise CommandError(f"{exc}; is `sluice serve` running with api.enabled?") from None
    except ApiRequestError as exc:
        raise CommandError(exc.describe(), status=2 if exc.status in (400, 422) else 1
                           ) from None


def _pairs(items: Sequence[str], what: str) -> dict[str, str]:
    out: dict[str, str] = {}
    for item in items:
        name, sep, value = item.partition("=")
        name = name.strip()
        if not sep or not value:
            raise CommandError(f"{what} are FIELD=VALUE, not {item!r}", status=2)
        if name not in FIELDS:
            raise CommandError(f"unknown field {name!r} (one of {', '.join(FIELDS)})", status=2)
        if name in out:
            raise CommandError(f"field {name!r} given twice", status=2)
        out[name] = value
    return out


def _when(at: float | None) -> str:
    if at is None:
        return "-"
    left = at - time.time()
    stamp = datetime.fromtimestamp(at, UTC).strftime("%Y-%m-%d %H:%M:%S")
    return f"{stamp} (in {max(0, int(left))}s)"


def cmd_suspend_add(args: argparse.Namespace) -> int:
    """`sluice suspend add`: suspend pickup of matching mail in the running server."""
    body: dict[str, Any] = {"fields": _pairs(args.fields, "suspension fields"),
                            "reason": args.reason, "tag": args.tag}
    if args.ttl:
        body["ttl"] = args.ttl
    if args.sid:
        body["id"] = args.sid
    answer = _call(args, "POST", "/suspensions", body=body)
    s = answer["suspension"]
    print(f"suspended {s['id']} until {_when(s['expires_at']) if s['expires_at'] else 'removed'}"
          f" (audit #{answer['audit_id']})")
    return 0


def cmd_suspend_remove(args: argparse.Namespace) -> int:
    """`sluice suspend remove`: lift a suspension by its id."""
    from urllib.parse import quote

    answer = _call(args, "DELETE", f"/suspensions/{quote(args.sid, safe='')}",
                   query={"reason": args.reason})
    print(f"lifted {args.sid} (audit #{answer['audit_id']})")
    return 0


def cmd_suspend_list(args: argparse.Namespace) -> int:
    """`sluice suspend list`: the suspensions in force, as text or JSON."""
    answer = _call(args, "GET", "/suspensions")
    if args.json:
        json.dump(answer, sys.stdout, indent=1)
        print()
        return 0
    if not answer["manual"]:
        print("no suspensions by hand")
    for s in answer["manual"]:
        reason = f"  -- {s['reason']}" if s["reason"] else ""
        print(f"{s['id']}  expires {_when(s['expires_at'])}  waiting "
              f"{s['waiting_subqueues']}{reason}")
    if answer["automatic_total"]:
        print(f"{answer['automatic_total']} counter entries over their thresholds:")
        for s in answer["automatic"]:
            print(f"  {s['id']}: {s['reason']}")
    return 0


def cmd_condition_add(args: argparse.Namespace) -> int:
    """`sluice condition add`: add a condition to a counter of the running policy."""
    body: dict[str, Any] = {"counter": args.counter, "if": _pairs(args.match, "conditions"),
                            "position": args.position, "tag": args.tag, "reason": args.reason}
    for key in ("concurrency", "rate", "connectinterval", "ttl"):
        value = getattr(args, key)
        if value is not None:
            body[key] = value
    if args.cid:
        body["id"] = args.cid
    answer = _call(args, "POST", "/policy/conditions", body=body)
    print(f"added condition {answer['condition']['id']} to counter {answer['counter']} at "
          f"position {answer['position']} (audit #{answer['audit_id']})")
    return 0


def cmd_condition_remove(args: argparse.Namespace) -> int:
    """`sluice condition remove`: remove a condition from a counter by its id."""
    from urllib.parse import quote

    answer = _call(args, "DELETE", f"/policy/counters/{quote(args.counter, safe='')}"
                                   f"/conditions/{quote(args.cid, safe='')}",
                   query={"reason": args.reason})
    print(f"removed condition {args.cid} from counter {args.counter} "
          f"(audit #{answer['audit_id']})")
    return 0


def _record_line(r: dict[str, Any]) -> str:
    stamp = datetime.fromtimestamp(r["at"], UTC).strftime("%Y-%m-%d %H:%M:%S")
    what = r["action"] + (f" of #{r['rollback_of']}" if r.get("rollback_of") else "")
    state = ""
    if r.get("rolled_back_by"):
        state = f"  [rolled back by #{r['rolled_back_by']}]"
    elif r["reversible"]:
        state = "  [reversible]"
    return f"#{r['id']}  {stamp}  {r['who']}  {what}  {r['target']}  -- {r['reason']}{state}"


def cmd_audit_list(args: argparse.Namespace) -> int:
    """`sluice policy-audit list`: the running server's changes, newest first."""
    if not 1 <= args.limit <= 1000:
        raise CommandError("--limit is 1 to 1000", status=2)
    answer = _call(args, "GET", "/audit", query={"limit": args.limit})
    if args.json:
        json.dump(answer, sys.stdout, indent=1)
        print()
        return 0
    if not answer["records"]:
        print("no changes recorded")
    for r in answer["records"]:
        print(_record_line(r))
    return 0


def cmd_audit_show(args: argparse.Namespace) -> int:
    """`sluice policy-audit show`: one change, with its before and after."""
    r = _call(args, "GET", f"/audit/{args.record}")
    print(_record_line(r))
    print("before: " + json.dumps(r["before"], indent=1))
    print("after:  " + json.dumps(r["after"], indent=1))
    return 0


def cmd_audit_rollback(args: argparse.Namespace) -> int:
    """`sluice policy-audit rollback`: undo one change."""
    answer = _call(args, "POST", f"/audit/{args.record}/rollback",
                   body={"reason": args.reason, "force": bool(args.force)})
    print(f"rolled back #{answer['rolled_back']} (audit #{answer['audit_id']})")
    return 0
