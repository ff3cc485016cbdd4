"""The shaping rules file: YAML, checked by a JSON Schema, parsed into Rules.

SUMMARY
    rules = load_rules(path, defaults=True)   the rules in force (ShapingError if unusable)
    rules = parse_rules(data, source)         the same from parsed YAML
    default_rules_path()                      the file shipped for the large providers

DESCRIPTION
    ``delivery.shaping`` names the operator's file; ``delivery.
    shaping_defaults`` (on unless switched off) adds the shipped file
    (sluice/shaping/default_rules.yaml) after it.  An operator's rule with
    the name of a shipped one replaces it; ``disable: [NAME, ...]`` in the
    operator's file switches shipped rules off one by one, and
    ``delivery.shaping_defaults: false`` all of them.

    Errors are one line each, naming the file and the key path
    (``rules.yaml: rules[3].trigger.within: 'soon' is not a duration``),
    the same way the policy file's are (sluice.policyfile).

STRATEGIES
    Schema first, then what a schema cannot say (a regex that does not
    compile, a rule name used twice, a rate written wrong): every problem
    is reported at once, the file is refused whole and the rules in force
    stay (a half-read file never replaces a good one).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from importlib import resources
from typing import Any

import jsonschema

from sluice.config import parse_duration
from sluice.policyfile import _leaves, _merge, error_problems, read_yaml
from sluice.scheduler.policy import PolicyError, Rate
from sluice.shaping.rules import (
    WHERE_FIELDS,
    Action,
    Backoff,
    ReplyMatch,
    Rule,
    Trigger,
    Where,
)

__all__ = ["ShapingError", "default_rules_path", "load_rules", "parse_rules", "shaping_schema"]


class ShapingError(PolicyError):
    """A rules file is unusable; str() is one line per problem, naming file and key."""


def shaping_schema() -> dict[str, Any]:
    """The JSON Schema of the shaping rules file, as shipped in the package."""
    text = resources.files("sluice").joinpath("schemas/shaping.schema.json").read_text("utf-8")
    schema: dict[str, Any] = json.loads(text)
    return schema


def default_rules_path() -> str:
    """The path of the rules file shipped in the package."""
    return str(resources.files("sluice").joinpath("shaping/default_rules.yaml"))


def _rate(value: Any) -> Rate:
    text = str(value)
    count, _, per = text.partition("/")
    return Rate(int(count), float(per) if per else 1.0)


def _one(item: dict[str, Any], path: str, problems: list[tuple[str, str]]) -> Rule | None:
    where_data = item.get("where") or {}
    bad = False
    for key, value in where_data.items():
        try:  # one field at a time, so that the error names its key
            Where(((WHERE_FIELDS[key], str(value)),))
        except ValueError as exc:
            problems.append((f"{path}.where.{key}", str(exc)))
            bad = True
    if bad:
        return None
    where = Where(tuple(sorted((WHERE_FIELDS[k], str(v)) for k, v in where_data.items())))
    reply_data = item.get("reply") or {}
    try:
        reply = ReplyMatch(str(reply_data.get("code", "")), str(reply_data.get("enhanced", "")),
                           str(reply_data.get("regex", "")),
                           tuple(reply_data.get("phase", ())))
    except ValueError as exc:
        problems.append((f"{path}.reply.regex", str(exc)))
        return None
    try:
        trig = item.get("trigger") or {}
        trigger = Trigger(int(trig.get("matches", 1)), parse_duration(trig.get("within", "1h")))
        duration_s = parse_duration(item.get("duration", "1h"))
        b = item.get("backoff") or {}
        d = Backoff()
        backoff = Backoff(
            float(b.get("factor", d.factor)),
            int(b.get("floor_concurrency", d.floor_concurrency)),
            _rate(b["floor_rate"]) if "floor_rate" in b else d.floor_rate,
            int(b.get("start_concurrency", d.start_concurrency)),
            _rate(b["start_rate"]) if "start_rate" in b else d.start_rate,
            int(b.get("step_concurrency", d.step_concurrency)),
            int(b.get("step_rate", d.step_rate)),
            parse_duration(b.get("quiet", d.quiet_s)),
            parse_duration(b.get("hold", d.hold_s)))
        th = item.get("thresholds") or {}
        action = Action(item["action"])
        if action is Action.CONDITION and not th:
            problems.append((f"{path}.thresholds", "a condition action needs thresholds"))
            return None
        return Rule(str(item["name"]), action, where, reply, trigger, duration_s, backoff,
                    th.get("concurrency"), _rate(th["rate"]) if "rate" in th else None,
                    str(item.get("note", "")), str(item.get("test", "")))
    except (ValueError, KeyError, TypeError) as exc:
        problems.append((path, str(exc)))
        return None


def parse_rules(data: Any, source: str) -> tuple[Rule, ...]:
    """Rules from parsed YAML; ShapingError lists every problem."""
    validator = jsonschema.Draft202012Validator(shaping_schema())
    schema_problems: list[tuple[str, str]] = []
    for error in validator.iter_errors(data):
        for leaf in _leaves(error):
            schema_problems.extend(error_problems(leaf))
    if schema_problems:
        raise ShapingError(source, _merge(schema_problems, []))
    problems: list[tuple[str, str]] = []
    rules: list[Rule] = []
    seen: set[str] = set()
    for i, item in enumerate(data.get("rules") or []):
        path = f"rules[{i}]"
        if item["name"] in seen:
            problems.append((f"{path}.name", f"rule {item['name']!r} is named twice"))
            continue
        seen.add(item["name"])
        rule = _one(item, path, problems)
        if rule is not None:
            rules.append(rule)
    if problems:
        raise ShapingError(source, _merge([], problems))
    return tuple(rules)


def load_file(path: str) -> tuple[Rule, ...]:
    try:
        data = read_yaml(path)
    except PolicyError as exc:
        raise ShapingError(path, exc.problems) from None
    return parse_rules(data, path)


def _disabled(path: str) -> set[str]:
    data = read_yaml(path)
    return {str(n) for n in data.get("disable", [])} if isinstance(data, dict) else set()


def load_rules(path: str | None, *, defaults: bool = True) -> tuple[Rule, ...]:
    """The operator's rules, then the shipped ones not named (or disabled) by the operator."""
    own = load_file(path) if path else ()
    shipped: Sequence[Rule] = load_file(default_rules_path()) if defaults else ()
    names = {r.name for r in own} | (_disabled(path) if path else set())
    return tuple(own) + tuple(r for r in shipped if r.name not in names)
