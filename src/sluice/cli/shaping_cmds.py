"""`sluice shaping ...`: the automatic actions in force, and checking a rules file.

SUMMARY
    sluice shaping status [--json]   rules loaded, firings, actions in force (asks the server)
    sluice shaping check [FILE]      validate a rules file and run each rule's test reply
    sluice shaping reload            read delivery.shaping again (asks the server)
    sluice shaping lift KEY          end an automatic action now (asks the server)
    sluice shaping apply FILE [--dry-run]
                                     install advice (sluice analytics shape) now, after
                                     simulating the queue with and without it
"""

from __future__ import annotations

import argparse
import json
from datetime import UTC, datetime
from typing import Any

from sluice.cli import CommandError, load

__all__ = ["register"]


def register(sub: Any) -> None:
    """Add `sluice shaping` to the command line."""
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
    ap = cmds.add_parser("apply", help="install shaping advice now, after simulating the "
                                       "queue with and without it")
    ap.add_argument("file", help="advice rules (shaping-advice.yaml of sluice analytics shape)")
    ap.add_argument("--dry-run", action="store_true", help="simulate and print; install nothing")
    ap.add_argument("--top", type=int, default=100, metavar="N",
                    help="domains of the queue to look at, largest first (default 100)")
    ap.add_argument("--limit", type=int, default=2000, metavar="N",
                    help="recipients per domain to simulate (default 2000)")
    ap.set_defaults(func=cmd_apply)


def _ask(args: argparse.Namespace, method: str, path: str,
         query: dict[str, Any] | None = None, body: Any = None) -> Any:
    from sluice.api.client import ApiClient, ApiRequestError, ApiUnavailable

    client = ApiClient.from_config(load(args))
    try:
        return client.request(method, path, query=query, body=body)
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


# -- apply --------------------------------------------------------------------------------


def _duration(seconds: float | None) -> str:
    if seconds is None:
        return "not drained"
    if seconds < 120:
        return f"{seconds:.0f}s"
    if seconds < 7200:
        return f"{seconds / 60:.0f}m"
    return f"{seconds / 3600:.1f}h"


def _next_hops(cfg: Any, domains: list[str]) -> dict[str, str]:
    """Each domain's first next-hop host (remotemx), as delivery would route it."""
    import asyncio

    from sluice.delivery.router import NextHop, Router

    router = Router.from_config(cfg)

    async def route_all() -> list[Any]:
        return await asyncio.gather(*(router.route(d) for d in domains))

    out = {}
    for domain, hop in zip(domains, asyncio.run(route_all()), strict=True):
        if isinstance(hop, NextHop):
            out[domain] = hop.remotemx
        else:
            print(f"{domain}: not routed ({hop.reply.text}); left out")
    return out


def cmd_apply(args: argparse.Namespace) -> int:
    import time

    from sluice.scheduler.policy import PolicyError
    from sluice.scheduler.policy_parse import parse_policy
    from sluice.scheduler.settings import Settings
    from sluice.scheduler.simulation import Simulation
    from sluice.shaping.advice_apply import (
        AdviceError,
        Queued,
        compare,
        plan_advice,
        scenarios,
    )
    from sluice.shaping.rulefile import ShapingError, load_file
    from sluice.shaping.runtime import Shaper

    if args.top < 1 or args.limit < 1:
        raise CommandError("--top and --limit are at least 1", status=2)
    cfg = load(args)
    try:
        rules = load_file(args.file)
    except ShapingError as exc:
        raise CommandError(str(exc), status=2) from None
    running = _ask(args, "GET", "/policy")
    try:
        policy = Shaper.augment(parse_policy(running["policy"], "the running policy"))
        plan = plan_advice(rules, policy, time.time())
    except (PolicyError, AdviceError) as exc:
        raise CommandError(f"{args.file}: {exc}", status=2) from None
    if not plan:
        print(f"{args.file}: no advice rules; nothing to do")
        return 0
    shape = _ask(args, "GET", "/queue/shape", query={"top": args.top})
    counts = {row["domain"]: int(row["total"]) for row in shape["rows"]}
    hops = _next_hops(cfg, sorted(counts))
    queued = [Queued(d, n, hops[d]) for d, n in counts.items() if d in hops]
    without, with_advice, simulated = scenarios(queued, plan, policy, Settings.from_config(cfg),
                                                args.limit)
    print(f"{len(plan)} advice rules from {args.file}, on counter {plan[0].counter}")
    if simulated:
        changes = compare(plan, queued, simulated, Simulation(without).run(),
                          Simulation(with_advice).run())
        print(f"{'domain':<28} {'next hop':<32} {'rule':<22} {'queued':>7} {'simulated':>9}"
              f"  {'drain without':>13} {'with':>11}  {'refused without':>15} {'with':>6}")
        for c in changes:
            print(f"{c.domain:<28} {c.remotemx:<32} {c.rule:<22} {c.queued:>7} "
                  f"{c.simulated:>9}  {_duration(c.drain_before_s):>13} "
                  f"{_duration(c.drain_after_s):>11}  {c.refused_before:>15} "
                  f"{c.refused_after:>6}")
    else:
        print(f"no queued mail (of the {len(counts)} largest domains) goes to a host the "
              "advice names; nothing to simulate")
    if args.dry_run:
        print("dry run: nothing installed")
        return 0
    for p in plan:
        th = p.condition.thresholds
        body: dict[str, Any] = {
            "counter": p.counter, "if": dict(p.condition.match), "id": p.condition.id,
            "ttl": f"{p.ttl_s:.0f}s", "tag": "advice",
            "reason": f"sluice shaping apply {args.file}: {p.condition.reason}"}
        if th.concurrency is not None:
            body["concurrency"] = th.concurrency
        if th.rate is not None:
            body["rate"] = str(th.rate)
        answer = _ask(args, "POST", "/policy/conditions", body=body)
        print(f"installed {p.condition.id} ({th}) on {p.counter} until "
              f"{_at(p.condition.expires_at or 0)}; undo: sluice policy-audit rollback "
              f"{answer['audit_id']}")
    return 0
