"""Parsing pickup policies and suspension lists from plain data (as YAML gives it).

SUMMARY
    parse_policy(data, source) -> Policy, or PolicyError naming every
    problem by its key path.  parse_suspensions(data, source) for a
    suspension list, parse_suspension(item) for one.  Pure: the caller
    reads the file and the YAML (sluice.policyfile).

DESCRIPTION
    Both spellings of sluice.scheduler.policy's module doc are accepted --
    Halon's file (``policies`` and ``suspends``, conditions as
    ``if``/``then``) and the compact list of the seeds -- and end in the
    same Policy.  Every problem is collected, not only the first, each
    with its key path (``policies[2].conditions[0].then.rate``), so that
    an operator fixes a file in one round.

SEE ALSO
    sluice.scheduler.policy (the data), schemas/policy.schema.json,
    docs/policies.md
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from sluice.scheduler.policy import (
    FIELDS,
    PATTERN_SUSPENSION_FIELDS,
    SCOPES,
    Condition,
    Counter,
    FieldSpec,
    Group,
    Pattern,
    Policy,
    PolicyError,
    Rate,
    Suspension,
    Thresholds,
    host_pattern,
)

__all__ = ["parse_policy", "parse_suspension", "parse_suspensions"]

_THRESHOLD_KEYS = ("concurrency", "rate", "connectinterval")
_RATE_RE = re.compile(r"^\s*(\d+)\s*(?:/\s*(\d+(?:\.\d+)?)\s*)?$")
_ID_RE = re.compile(r"^[A-Za-z0-9_.:@-]+$")


class _Problems:
    def __init__(self) -> None:
        self.items: list[tuple[str, str]] = []

    def add(self, path: str, message: str) -> None:
        self.items.append((path, message))


def _join(path: str, key: str | int) -> str:
    if isinstance(key, int):
        return f"{path}[{key}]"
    return f"{path}.{key}" if path else key


def _parse_rate(value: object, path: str, problems: _Problems) -> Rate | None:
    if isinstance(value, bool):
        problems.add(path, f"{value!r} is not a rate (use X or \"X/Y\")")
        return None
    if isinstance(value, int):
        if value < 0:
            problems.add(path, "a rate must not be negative")
            return None
        return Rate(value, 1.0)
    if isinstance(value, str):
        m = _RATE_RE.match(value)
        if m:
            per = float(m.group(2)) if m.group(2) else 1.0
            if per > 0:
                return Rate(int(m.group(1)), per)
            problems.add(path, "the interval of a rate must be more than 0 seconds")
            return None
    problems.add(path, f"{value!r} is not a rate (use X or \"X/Y\": X per Y seconds)")
    return None


def _parse_thresholds(data: Mapping[str, Any], path: str, problems: _Problems) -> Thresholds:
    concurrency: int | None = None
    rate: Rate | None = None
    interval: float | None = None
    if "concurrency" in data:
        value = data["concurrency"]
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            problems.add(_join(path, "concurrency"), f"{value!r} is not a whole number >= 0")
        else:
            concurrency = value
    if "rate" in data:
        rate = _parse_rate(data["rate"], _join(path, "rate"), problems)
    if "connectinterval" in data:
        value = data["connectinterval"]
        if isinstance(value, bool) or not isinstance(value, int | float) or value < 0:
            problems.add(_join(path, "connectinterval"),
                         f"{value!r} is not a number of seconds >= 0")
        else:
            interval = float(value)
    return Thresholds(concurrency, rate, interval)


def _check_keys(data: Mapping[str, Any], allowed: Iterable[str], path: str,
                problems: _Problems) -> None:
    allowed = set(allowed)
    for key in data:
        if key not in allowed:
            problems.add(_join(path, str(key)), "unknown key")


def _parse_field(item: object, path: str, problems: _Problems) -> FieldSpec | None:
    if isinstance(item, str):
        if item not in FIELDS:
            problems.add(path, f"unknown field {item!r} (one of {', '.join(FIELDS)})")
            return None
        return FieldSpec(item)
    if isinstance(item, Mapping) and len(item) == 1:
        name, groups_data = next(iter(item.items()))
        gpath = _join(path, str(name))
        if name not in FIELDS:
            problems.add(gpath, f"unknown field {name!r} (one of {', '.join(FIELDS)})")
            return None
        if not isinstance(groups_data, Mapping) or not groups_data:
            problems.add(gpath, "groups are a mapping of group id to a list of patterns, "
                                "e.g. {gsuite: ['*.google.com']}")
            return None
        groups: list[Group] = []
        for gid, patterns in groups_data.items():
            ppath = _join(gpath, str(gid))
            if not isinstance(gid, str) or not _ID_RE.match(gid):
                problems.add(ppath, "a group id is letters, digits and _.:@-")
                continue
            if isinstance(patterns, str):
                patterns = [patterns]
            if not isinstance(patterns, list) or not patterns:
                problems.add(ppath, "a group needs a list of patterns")
                continue
            compiled: list[Pattern] = []
            for i, text in enumerate(patterns):
                if not isinstance(text, str) or not text:
                    problems.add(_join(ppath, i), "a pattern is a non-empty string")
                    continue
                try:
                    compiled.append(Pattern.compile(text))
                except ValueError as exc:
                    problems.add(_join(ppath, i), str(exc))
            groups.append(Group(gid, tuple(compiled)))
        return FieldSpec(name, tuple(groups))
    problems.add(path, "a field is a name, or {name: {group-id: [patterns]}}")
    return None


def _parse_match(data: Mapping[str, Any], fields: Sequence[FieldSpec], path: str,
                 problems: _Problems) -> tuple[tuple[str, str], ...]:
    by_name = {f.name: f for f in fields}
    out: list[tuple[str, str]] = []
    for name, value in data.items():
        vpath = _join(path, str(name))
        if name not in FIELDS:
            problems.add(vpath, f"unknown field {name!r}")
            continue
        spec = by_name.get(name)
        if spec is None:
            problems.add(vpath, f"the counter does not count {name!r}; a condition can only "
                                "name the counter's own fields")
            continue
        if isinstance(value, int | float) and not isinstance(value, bool):
            value = str(value)
        if not isinstance(value, str) or not value:
            problems.add(vpath, "a condition value is a non-empty string")
            continue
        if value.startswith("#"):
            if value[1:] not in {g.id for g in spec.groups}:
                problems.add(vpath, f"no group {value!r} on field {name!r}")
                continue
        elif Pattern.is_pattern(value):
            try:
                Pattern.compile(value)
            except ValueError as exc:
                problems.add(vpath, str(exc))
                continue
        out.append((name, value))
    if not out and not data:
        problems.add(path, "a condition needs at least one field to match")
    return tuple(out)


def _parse_extra(data: Mapping[str, Any], path: str, problems: _Problems
                 ) -> tuple[str, float | None, str, str]:
    cid = data.get("id", "")
    if not isinstance(cid, str):
        problems.add(_join(path, "id"), "an id is a string")
        cid = ""
    expires = data.get("expires_at")
    if expires is not None and (isinstance(expires, bool) or not isinstance(expires, int | float)):
        problems.add(_join(path, "expires_at"), "expires_at is a time (POSIX seconds)")
        expires = None
    tag = data.get("tag", "")
    reason = data.get("reason", "")
    if not isinstance(tag, str):
        problems.add(_join(path, "tag"), "a tag is a string")
        tag = ""
    if not isinstance(reason, str):
        problems.add(_join(path, "reason"), "a reason is a string")
        reason = ""
    return cid, float(expires) if expires is not None else None, tag, reason


_CONDITION_EXTRA = ("id", "expires_at", "tag", "reason")


def _parse_condition(item: object, fields: Sequence[FieldSpec], path: str,
                     problems: _Problems, compact: bool) -> Condition | None:
    if not isinstance(item, Mapping):
        problems.add(path, "a condition is a mapping")
        return None
    if compact:
        # The seed's spelling: the values to match and the thresholds side by side.
        _check_keys(item, (*FIELDS, *_THRESHOLD_KEYS, *_CONDITION_EXTRA), path, problems)
        match_data = {k: v for k, v in item.items() if k in FIELDS}
        thresholds = _parse_thresholds(item, path, problems)
        match = _parse_match(match_data, fields, path, problems)
    else:
        _check_keys(item, ("if", "then", *_THRESHOLD_KEYS, *_CONDITION_EXTRA), path, problems)
        cond_if = item.get("if")
        if not isinstance(cond_if, Mapping):
            problems.add(_join(path, "if"), "a condition needs 'if': {field: value, ...}")
            return None
        _check_keys(cond_if, FIELDS, _join(path, "if"), problems)
        match = _parse_match(cond_if, fields, _join(path, "if"), problems)
        then = item.get("then")
        if then is not None and any(k in item for k in _THRESHOLD_KEYS):
            problems.add(path, "give the thresholds either under 'then' or beside 'if', not both")
        if then is None:
            thresholds = _parse_thresholds(item, path, problems)
        elif not isinstance(then, Mapping):
            problems.add(_join(path, "then"), "'then' is a mapping of thresholds")
            return None
        else:
            _check_keys(then, _THRESHOLD_KEYS, _join(path, "then"), problems)
            thresholds = _parse_thresholds(then, _join(path, "then"), problems)
    if not match:
        if not any(p.startswith(path) for p, _ in problems.items):
            problems.add(path, "a condition needs at least one field to match")
        return None
    cid, expires, tag, reason = _parse_extra(item, path, problems)
    return Condition(match, thresholds, cid, expires, tag, reason)


def _parse_counter(item: object, path: str, problems: _Problems) -> Counter | None:
    if not isinstance(item, Mapping):
        problems.add(path, "a counter is a mapping with 'fields'")
        return None
    _check_keys(item, ("id", "fields", "conditions", "if", "default", "scope",
                       *_THRESHOLD_KEYS), path, problems)
    fields_data = item.get("fields", [])
    if fields_data is None:
        fields_data = []
    fields: list[FieldSpec] = []
    if not isinstance(fields_data, list):
        problems.add(_join(path, "fields"), "'fields' is a list")
    else:
        for i, fitem in enumerate(fields_data):
            spec = _parse_field(fitem, _join(_join(path, "fields"), i), problems)
            if spec is not None:
                if spec.name in {f.name for f in fields}:
                    problems.add(_join(_join(path, "fields"), i), f"field {spec.name!r} twice")
                    continue
                fields.append(spec)
    conditions: list[Condition] = []
    if "conditions" in item and "if" in item:
        problems.add(path, "use either 'conditions' (with if/then) or 'if', not both")
    if "conditions" in item:
        cpath = _join(path, "conditions")
        data = item["conditions"]
        if not isinstance(data, list):
            problems.add(cpath, "'conditions' is a list of {if: ..., then: ...}")
        else:
            for i, citem in enumerate(data):
                cond = _parse_condition(citem, fields, _join(cpath, i), problems, compact=False)
                if cond is not None:
                    conditions.append(cond)
    elif "if" in item:
        cpath = _join(path, "if")
        data = item["if"]
        items = data if isinstance(data, list) else [data]
        for i, citem in enumerate(items):
            ipath = _join(cpath, i) if isinstance(data, list) else cpath
            cond = _parse_condition(citem, fields, ipath, problems, compact=True)
            if cond is not None:
                conditions.append(cond)
    if "default" in item and any(k in item for k in _THRESHOLD_KEYS):
        problems.add(path, "give the fall-back either under 'default' or on the counter, not both")
    if "default" in item:
        ddata = item["default"]
        if not isinstance(ddata, Mapping):
            problems.add(_join(path, "default"), "'default' is a mapping of thresholds")
            default = Thresholds()
        else:
            _check_keys(ddata, _THRESHOLD_KEYS, _join(path, "default"), problems)
            default = _parse_thresholds(ddata, _join(path, "default"), problems)
    else:
        default = _parse_thresholds(item, path, problems)
    cid = item.get("id", "")
    if not isinstance(cid, str):
        problems.add(_join(path, "id"), "an id is a string")
        cid = ""
    scope = item.get("scope", "cluster")
    if scope not in SCOPES:
        problems.add(_join(path, "scope"), f"{scope!r} is not one of {', '.join(SCOPES)}")
        scope = "cluster"
    return Counter(tuple(fields), tuple(conditions), default, cid, scope)


#: Fields whose values are host names or addresses: never any white space.
_HOST_FIELDS = frozenset({"recipientdomain", "remotemx", "remoteip", "localip"})


def parse_suspension(item: object, path: str = "", source: str = "<suspension>") -> Suspension:
    """One suspension from plain data; raises PolicyError."""
    problems = _Problems()
    susp = _parse_suspension(item, path, problems)
    if problems.items or susp is None:
        raise PolicyError(source, problems.items or [(path, "not a suspension")])
    return susp


def _parse_suspension(item: object, path: str, problems: _Problems) -> Suspension | None:
    if not isinstance(item, Mapping):
        problems.add(path, "a suspension is a mapping of field: value")
        return None
    _check_keys(item, (*FIELDS, *_CONDITION_EXTRA), path, problems)
    fields: list[tuple[str, str]] = []
    for name in FIELDS:
        if name not in item:
            continue
        value = item[name]
        if isinstance(value, int | float) and not isinstance(value, bool):
            value = str(value)
        if not isinstance(value, str) or not value:
            problems.add(_join(path, name), f"the {name} to suspend is a non-empty string")
            continue
        if Pattern.is_pattern(value):
            if name not in PATTERN_SUSPENSION_FIELDS:
                problems.add(_join(path, name), "a suspension matches exact values, not "
                             "patterns (only remotemx and recipientdomain take one)")
                continue
            try:
                host_pattern(value)
            except ValueError as exc:
                problems.add(_join(path, name), str(exc))
                continue
            fields.append((name, value))
            continue
        if name in _HOST_FIELDS and any(c.isspace() for c in value):
            problems.add(_join(path, name), f"{value!r} is not a {name}: it has spaces")
            continue
        fields.append((name, value))
    if not fields:
        if not any(p.startswith(path) for p, _ in problems.items):
            problems.add(path, "a suspension needs at least one field")
        return None
    sid, expires, tag, reason = _parse_extra(item, path, problems)
    return Suspension(tuple(fields), sid, expires, tag, reason)


def parse_suspensions(data: object, source: str = "<suspensions>", path: str = ""
                      ) -> tuple[Suspension, ...]:
    """A list of suspensions (a suspension file, or a policy's ``suspends``)."""
    problems = _Problems()
    out = _parse_suspension_list(data, path, problems)
    if problems.items:
        raise PolicyError(source, problems.items)
    return out


def _parse_suspension_list(data: object, path: str, problems: _Problems
                           ) -> tuple[Suspension, ...]:
    if data is None:
        return ()
    if not isinstance(data, list):
        problems.add(path, "suspensions are a list of {field: value, ...}")
        return ()
    out: list[Suspension] = []
    for i, item in enumerate(data):
        susp = _parse_suspension(item, _join(path, i), problems)
        if susp is not None:
            out.append(susp)
    return tuple(out)


def parse_policy(data: object, source: str = "<policy>") -> Policy:
    """A Policy from plain data; PolicyError lists every problem with its key path."""
    problems = _Problems()
    counters_data: object
    suspensions: tuple[Suspension, ...] = ()
    prefix = ""
    if data is None:
        counters_data = []
    elif isinstance(data, Mapping):
        _check_keys(data, ("policies", "suspends"), "", problems)
        counters_data = data.get("policies") or []
        prefix = "policies"
        suspensions = _parse_suspension_list(data.get("suspends"), "suspends", problems)
    else:
        counters_data = data
    counters: list[Counter] = []
    if not isinstance(counters_data, list):
        problems.add(prefix, "the policy is a list of counters, "
                             "or {policies: [...], suspends: [...]}")
    else:
        for i, item in enumerate(counters_data):
            counter = _parse_counter(item, f"{prefix}[{i}]", problems)
            if counter is not None:
                counters.append(counter)
    seen: dict[str, int] = {}
    for i, c in enumerate(counters):
        if c.id in seen:
            # Two counters over the same fields are legal; give the later an ordinal id.
            seen[c.id] += 1
            counters[i] = Counter(c.fields, c.conditions, c.default, f"{c.id}#{seen[c.id]}",
                                  c.scope)
        else:
            seen[c.id] = 1
    if problems.items:
        raise PolicyError(source, problems.items)
    return Policy(tuple(counters), suspensions, source)
