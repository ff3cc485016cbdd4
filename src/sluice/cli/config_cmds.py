"""`sluice config check|show|schema`."""

from __future__ import annotations

import argparse
import json
import re
import sys
from typing import Any

import yaml

from sluice.cli import load
from sluice.config import config_schema


def register(sub: Any) -> None:
    """Add `sluice config` to the command line."""
    p = sub.add_parser("config", help="check or show the configuration")
    csub = p.add_subparsers(dest="config_command", metavar="ACTION")
    csub.required = True
    check = csub.add_parser("check", help="make every check `sluice serve` makes before it "
                            "listens; exit 0 when they pass")
    check.set_defaults(func=cmd_check)
    show = csub.add_parser("show", help="print the effective configuration with defaults")
    show.add_argument("--json", action="store_true", help="JSON instead of YAML")
    show.set_defaults(func=cmd_show)
    schema = csub.add_parser("schema", help="print the JSON Schema of the configuration file")
    schema.set_defaults(func=cmd_schema)


def cmd_check(args: argparse.Namespace) -> int:
    """`sluice config check`: every check `sluice serve` makes before it listens."""
    from sluice.runtime.preflight import preflight

    cfg = load(args)
    preflight(cfg)  # what `sluice serve` checks before it binds a port
    print(f"{cfg.source}: OK")
    return 0


def _masked(data: dict[str, Any]) -> dict[str, Any]:
    """Secrets stay out of a printed configuration."""
    api = data.get("api", {})
    tokens = api.get("tokens")
    if isinstance(tokens, dict):
        api["tokens"] = {name: "********" for name in tokens}
    elif tokens:
        api["tokens"] = ["********" for _ in tokens]
    users = data.get("smtpd", {}).get("auth", {}).get("users")
    if users:
        data["smtpd"]["auth"]["users"] = {u: "********" for u in users}
    pg = data.get("queue", {}).get("postgres", {})
    if pg.get("dsn"):
        pg["dsn"] = re.sub(r"(password=)\S+|(://[^:/@]+:)[^@]+@", _hide, pg["dsn"])
    return data


def _hide(m: re.Match[str]) -> str:
    return f"{m.group(1)}********" if m.group(1) else f"{m.group(2)}********@"


def cmd_show(args: argparse.Namespace) -> int:
    """`sluice config show`: the effective configuration with defaults, secrets masked."""
    cfg = load(args)
    data = _masked(cfg.to_dict(readable=not args.json))
    if args.json:
        json.dump(data, sys.stdout, indent=2)
        print()
    else:
        print(f"# effective configuration from {cfg.source}")
        sys.stdout.write(yaml.safe_dump(data, sort_keys=False, allow_unicode=True))
    return 0


def cmd_schema(args: argparse.Namespace) -> int:
    """`sluice config schema`: print the JSON Schema of the configuration file."""
    json.dump(config_schema(), sys.stdout, indent=2)
    print()
    return 0
