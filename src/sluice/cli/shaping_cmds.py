"""`sluice shaping ...`: the automatic actions in force, and checking a rules file.

    sluice shaping status [--json]   rules loaded, firings, actions in force (asks the server)
    sluice shaping check [FILE]      validate a rules file and run each rule's test reply
    sluice shaping reload            read delivery.shaping again (asks the server)
    sluice shaping lift KEY          end an automatic action now (asks the server)
"""

from __future__ import annotations

import argparse
import json
from datetime import UTC, datetime
from typing import Any

from sluice.cli import CommandError, load

__all__ = ["register"]


def register(sub: Any) -> None:
    p = sub.add_parser("shaping", help="adaptive traffic shaping (docs/shaping.md)")
    cmds = p.add_subparsers(dest="shaping_cmd", required=True)
    st = cmds.add_parser("status", help="rules loaded and automatic actions in force")
    st.add_argument("--json", action="store_true")
    st.set_defaults(func=cmd_status)
    ck = cmds.add_parser("check", help="validate a rules file; each rule must match its test")
    ck.add_argument("file", nargs="?", help="rules file (default: delivery.shaping)")
    ck.set_defaults(func=cmd_check)
    rl = cmds.add_parser("reload", help="read delivery.shaping again")
    rl.set_defaults(func=cmd_reload)
    lf = cmds.add_parser("lift", help="end an automatic action now")
    lf.add_argument("key", help="the action's key (from `sluice shaping status`)")
    lf.set_defaults(func=cmd_lift)


def _ask(args: argparse.Namespace, method: str, path: str,
         query: dict[str, str] | None = None) -> Any:
    from sluice.api.client import ApiClient, ApiRequestError, ApiUnavailable

    client = ApiClient.from_config(load(args))
    try:
        return client.request(method, path, query=query)
    except ApiUnavailable as exc:
        raise CommandError(f"{exc} (is `sluice serve` running with api.enabled?)") from None
    except ApiRequestError as exc:
        raise CommandError(f"the running server refused: {exc}") from None


def _at(ts: float) -> str:
    return datetime.fromtimestamp(ts, UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def print_status(data: dict[str, Any]) -> None:
    print(f"{len(data['rules'])} rules ({data['file'] or 'no own file'}"
          f"{', with the shipped ones' if data['defaults'] else ''}); "
          f"{data['backoff_groups']} groups backed off")
    for rule, count in data["firings"].items():
        print(f"  fired {count:>5}  {rule}")
    if not data["active"]:
        print("no automatic action in force")
    for a in data["active"]:
        print(f"{a['key']}\n    {a['text']}\n    since {_at(a['since_at'])}"
              + (f"; {a['note']}" if a["note"] else ""))


def cmd_status(args: argparse.Namespace) -> int:
    data = _ask(args, "GET", "/shaping")
    if args.json:
        print(json.dumps(data, indent=2))
    else:
        print_status(data)
    return 0


def cmd_reload(args: argparse.Namespace) -> int:
    data = _ask(args, "POST", "/shaping/reload")
    print(f"reloaded: {len(data['rules'])} rules")
    return 0


def cmd_lift(args: argparse.Namespace) -> int:
    _ask(args, "POST", "/shaping/actions/lift", {"key": args.key})
    print(f"lifted {args.key}")
    return 0


def cmd_check(args: argparse.Namespace) -> int:
    from sluice.shaping.rulefile import ShapingError, load_file
    from sluice.shaping.rules import Observation

    path = args.file or load(args).delivery.shaping
    if not path:
        from sluice.shaping.rulefile import default_rules_path
        path = default_rules_path()
    try:
        rules = load_file(path)
    except ShapingError as exc:
        raise CommandError(str(exc), status=2) from None
    bad = 0
    for rule in rules:
        if not rule.test:
            continue
        mx = dict(rule.where.fields).get("remotemx", "").replace("*", "mx1")
        where = {k: v.replace("*", "x") for k, v in rule.where.fields if k != "remotemx"}
        try:
            obs = Observation.from_line(rule.test, 0.0, remotemx=mx, **where)
        except ValueError as exc:
            print(f"{path}: rule {rule.name}: test: {exc}")
            bad += 1
            continue
        first = next((r for r in rules if r.matches(obs)), None)
        if first is not rule:
            other = f"rule {first.name} matches it first" if first else "no rule matches it"
            print(f"{path}: rule {rule.name}: its test reply is not its own: {other}")
            bad += 1
    if bad:
        return 1
    print(f"{path}: OK ({len(rules)} rules)")
    return 0
