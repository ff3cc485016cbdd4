"""Policy commands: policy validate|show|schema, simulate, why.

DESCRIPTION
    ``policy validate FILE`` checks a pickup policy file against the JSON
    Schema shipped in the package (schemas/policy.schema.json) and then
    against the rules a schema cannot say (a condition names only its
    counter's fields, ``#id`` names a group of that field, regexes
    compile); it prints every problem with its key path and exits 0 only
    when there is none.  ``--suspensions`` checks a suspension list file.

    ``policy show`` prints the effective policy: the file that
    ``scheduler.policy`` names (none: no counters), normalised to Halon's
    spelling with every counter's id, plus the suspensions of
    ``scheduler.suspensions``.

    ``simulate SCENARIO.yaml`` runs the real scheduler against simulated
    destinations and traffic (sluice.scheduler.simulation) and prints per
    destination and tenant figures, or JSON with ``--json``.

    ``why QUEUEID`` explains a recipient from the store: held, deferred
    until when and after which reply, waiting for a refill, or waiting for
    its NDR, and when it would be picked.  A running server answers the
    same question with its in-memory details over the REST API.

    The file readers live in sluice.policyfile, shared with the server.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import yaml

from sluice.cli import CommandError, load
from sluice.model import Selector, parse_qid
from sluice.policyfile import (
    load_policy_file,
    load_suspensions_file,
    policy_schema,
    read_yaml,
)
from sluice.retry import RetryPolicy
from sluice.scheduler import (
    Policy,
    PolicyError,
    Suspension,
    explain_stored,
)
from sluice.scheduler.simulation import (
    GroupReport,
    ScenarioError,
    Simulation,
    SimulationReport,
    parse_scenario,
)

__all__ = ["register"]


# --------------------------------------------------------------------------


def register(sub: Any) -> None:
    """Add `sluice policy`, `sluice simulate` and `sluice why` to the command line."""
    p = sub.add_parser("policy", help="validate or show the pickup policy")
    psub = p.add_subparsers(dest="policy_command", metavar="ACTION")
    psub.required = True
    validate = psub.add_parser("validate", help="check a policy file; exit 0 only when valid")
    validate.add_argument("file", metavar="FILE")
    validate.add_argument("--suspensions", action="store_true",
                          help="FILE is a suspension list, not a policy")
    validate.set_defaults(func=cmd_validate)
    show = psub.add_parser("show", help="print the effective policy (config scheduler.policy)")
    show.add_argument("--json", action="store_true", help="JSON instead of YAML")
    show.set_defaults(func=cmd_show)
    schema = psub.add_parser("schema", help="print the JSON Schema of the policy file")
    schema.set_defaults(func=cmd_schema)

    sim = sub.add_parser("simulate", help="try a policy on simulated traffic and destinations")
    sim.add_argument("scenario", metavar="SCENARIO.yaml")
    sim.add_argument("--policy", metavar="FILE", help="use this policy file instead")
    sim.add_argument("--json", action="store_true", help="print the whole report as JSON")
    sim.add_argument("--top", type=int, default=15, metavar="N",
                     help="destinations to list, busiest first (default 15)")
    sim.set_defaults(func=cmd_simulate)

    why = sub.add_parser("why", help="explain why a queued recipient waits")
    why.add_argument("qid", metavar="QUEUEID", help="a queue id (SPID-N) or a SPID")
    why.add_argument("--json", action="store_true",
                     help="the explanations as JSON (state, reasons, expected_at, lines)")
    why.set_defaults(func=cmd_why)


def cmd_validate(args: argparse.Namespace) -> int:
    path = args.file
    try:
        if args.suspensions:
            suspensions = load_suspensions_file(path)
            print(f"{path}: OK ({len(suspensions)} suspensions)")
        else:
            policy = load_policy_file(path)
            print(f"{path}: OK ({len(policy.counters)} counters, "
                  f"{len(policy.suspensions)} suspensions)")
    except PolicyError as exc:
        for key, message in exc.problems:
            print(f"{path}: {key or '(top)'}: {message}", file=sys.stderr)
        return 1
    return 0


def cmd_schema(args: argparse.Namespace) -> int:
    json.dump(policy_schema(), sys.stdout, indent=2)
    print()
    return 0


def _load_effective(args: argparse.Namespace) -> tuple[Policy, tuple[Suspension, ...], str]:
    cfg = load(args)
    policy = Policy(source="<none>")
    suspensions: tuple[Suspension, ...] = ()
    try:
        if cfg.scheduler.policy:
            policy = load_policy_file(cfg.scheduler.policy)
        if cfg.scheduler.suspensions and Path(cfg.scheduler.suspensions).exists():
            suspensions = load_suspensions_file(cfg.scheduler.suspensions)
    except PolicyError as exc:
        raise CommandError(str(exc)) from None
    return policy, suspensions, cfg.source


def cmd_show(args: argparse.Namespace) -> int:
    policy, suspensions, source = _load_effective(args)
    data = policy.to_data()
    data["suspends"] = data["suspends"] + [s.to_data() for s in suspensions]
    if args.json:
        json.dump(data, sys.stdout, indent=2)
        print()
        return 0
    print(f"# effective pickup policy (configuration: {source})")
    print(f"# policy file: {policy.source if policy.counters or policy.suspensions else 'none'}")
    if not policy.counters:
        print("# no counters: only slow start and scheduler.max_deliveries limit deliveries")
    sys.stdout.write(yaml.safe_dump(data, sort_keys=False, allow_unicode=True))
    return 0


# --------------------------------------------------------------------------


def _fmt_s(value: float | None) -> str:
    if value is None:
        return "-"
    if value >= 3600:
        return f"{value / 3600:.1f}h"
    if value >= 60:
        return f"{value / 60:.1f}m"
    return f"{value:.2f}s"


def _group_table(title: str, groups: Iterable[GroupReport]) -> Any:
    from rich.table import Table

    table = Table(title=title, title_justify="left")
    table.add_column("name", no_wrap=True)
    for name in ("msgs", "delivered", "bounced", "deferrals", "msg/s", "peak/limit",
                 "wait p50", "p95", "p99", "drained at"):
        table.add_column(name, justify="right", no_wrap=True)
    for g in groups:
        limit = "-" if g.limit is None else str(g.limit)
        table.add_row(g.name, str(g.messages), str(g.delivered), str(g.bounced),
                      str(g.deferrals), f"{g.throughput_per_s:.1f}",
                      f"{g.peak_concurrency}/{limit}", _fmt_s(g.wait_p50_s),
                      _fmt_s(g.wait_p95_s), _fmt_s(g.wait_p99_s), _fmt_s(g.drain_s))
    return table


def _print_report(report: SimulationReport, top: int, wall_s: float) -> None:
    from rich.console import Console

    # Wide enough for the tables when the output is a file or a pipe.
    console = Console(width=None if sys.stdout.isatty() else 140)
    state = "drained" if report.drained else f"NOT drained ({report.remaining} left)"
    console.print(
        f"[bold]{report.name}[/bold]: {report.messages} messages, {state} after "
        f"{_fmt_s(report.simulated_s)} simulated ({wall_s:.1f}s of real time)\n"
        f"delivered {report.delivered}, bounced {report.bounced}, deferrals {report.deferrals} "
        f"({report.cache_deferrals} by the destination status cache), pickups {report.pickups}\n"
        f"peak in flight {report.peak_inflight}/{report.max_deliveries}, peak memory "
        f"{report.peak_memory}/{report.maxmemoryqueue} recipients")
    console.print(_group_table("tenants", report.tenants))
    busiest = sorted(report.destinations, key=lambda g: (-g.messages, g.name))[:top]
    more = len(report.destinations) - len(busiest)
    title = f"destinations (busiest {len(busiest)}" + (f" of {len(report.destinations)})"
                                                       if more else ")")
    console.print(_group_table(title, busiest))


def cmd_simulate(args: argparse.Namespace) -> int:
    path = args.scenario
    try:
        data = read_yaml(path)
        policy: Policy | None = None
        policy_file = args.policy
        if policy_file is None and isinstance(data, dict) and data.get("policy_file"):
            policy_file = str(Path(path).resolve().parent / str(data["policy_file"]))
        if policy_file is not None:
            policy = load_policy_file(policy_file)
        scenario = parse_scenario(data, path, policy)
    except (PolicyError, ScenarioError) as exc:
        for key, message in exc.problems:
            print(f"{exc.source}: {key or '(top)'}: {message}", file=sys.stderr)
        return 1
    started = time.perf_counter()
    report = Simulation(scenario).run()
    wall_s = time.perf_counter() - started
    if args.json:
        out = report.to_data()
        out["wall_s"] = round(wall_s, 3)
        json.dump(out, sys.stdout, indent=1, default=_json_default)
        print()
    else:
        _print_report(report, args.top, wall_s)
    return 0


def _json_default(value: object) -> object:
    if isinstance(value, float) and not math.isfinite(value):
        return None
    raise TypeError(f"not JSON: {value!r}")


# --------------------------------------------------------------------------


def cmd_why(args: argparse.Namespace) -> int:
    from sluice.store import StorageError, open_store

    try:
        spid, idx = parse_qid(args.qid)
    except ValueError as exc:
        raise CommandError(str(exc), status=2) from None
    cfg = load(args)
    # A running server knows more (counters, suspensions, dead destinations):
    # ask it first; without one, explain from the store.
    from sluice.api.client import ApiRequestError, explain

    try:
        answered = explain(cfg, args.qid)
    except ApiRequestError as exc:
        raise CommandError(f"the running server refused: {exc}") from None
    if answered is not None:
        if not answered:
            raise CommandError(f"no entry {args.qid} in the queue (delivered, or never queued)")
        if getattr(args, "json", False):
            print(json.dumps(answered, indent=2))
            return 0
        for item in answered:
            print("\n".join(item["lines"]))
        return 0
    try:
        store = open_store(cfg)
    except StorageError as exc:
        raise CommandError(f"cannot open the queue: {exc}") from None
    try:
        if idx is None:
            entries = list(store.entries(Selector(qids=(spid,))))
        else:
            entry = store.get(args.qid.strip().upper())
            entries = [entry] if entry is not None else []
    except StorageError as exc:
        raise CommandError(f"cannot read the queue: {exc}") from None
    finally:
        store.close()
    if not entries:
        raise CommandError(f"no entry {args.qid} in the queue (delivered, or never queued)")
    retry = RetryPolicy.from_config(cfg.queue)
    now = time.time()
    if getattr(args, "json", False):
        print(json.dumps([{**explain_stored(entry, now, retry).data("store", now),
                           "recipient": entry.recipient, "sender": entry.sender,
                           "attempts": entry.attempts, "priority": entry.priority}
                          for entry in entries], indent=2))
        return 0
    for entry in entries:
        explanation = explain_stored(entry, now, retry)
        print("\n".join(explanation.lines(now)))
        print(f"  recipient: {entry.recipient}  sender: <{entry.sender}>  "
              f"attempts: {entry.attempts}  priority: {entry.priority}")
    return 0
