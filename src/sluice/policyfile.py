"""Policy files: read, check against the JSON Schema and the core's rules, parse.

SUMMARY
    load_policy_file(path) -> Policy; load_suspensions_file(path) -> suspensions;
    validate_policy_data(data, source) -> (Policy | None, problems);
    policy_schema() -> the JSON Schema shipped in the package.

DESCRIPTION
    The scheduler reads no files (it is pure); everything that does --
    ``sluice policy validate``, ``sluice serve`` at start and on reload,
    the REST API -- comes here, so a file the validator refuses is refused
    by the server too.  Two passes: the JSON Schema
    (schemas/policy.schema.json), then the rules a schema cannot state (a
    condition names only its counter's fields, ``#id`` names a group of
    that field, regular expressions compile).  Every problem is reported
    with its key path; ISO 8601 ``expires_at`` values become POSIX times.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Iterable, Mapping
from datetime import UTC, datetime
from importlib import resources
from pathlib import Path
from typing import Any

import jsonschema
import yaml

from sluice.scheduler import Policy, PolicyError, Suspension, parse_policy, parse_suspensions

__all__ = [
    "error_problems",
    "load_policy_file",
    "load_suspensions_file",
    "policy_schema",
    "read_yaml",
    "validate_policy_data",
]


def policy_schema() -> dict[str, Any]:
    """The JSON Schema of the pickup policy file, as shipped in the package."""
    text = resources.files("sluice").joinpath("schemas/policy.schema.json").read_text("utf-8")
    schema: dict[str, Any] = json.loads(text)
    return schema


def _keypath(parts: Iterable[object]) -> str:
    out = ""
    for part in parts:
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else str(part))
    return out


def _leaves(error: jsonschema.ValidationError) -> list[jsonschema.ValidationError]:
    """The most specific errors under ``error`` (if/then/else hides them)."""
    if not error.context:
        return [error]
    out: list[jsonschema.ValidationError] = []
    for sub in error.context:
        out.extend(_leaves(sub))
    return out


def error_problems(error: jsonschema.ValidationError) -> list[tuple[str, str]]:
    """(key path, message) for one schema error; an unknown key gets its own path."""
    path = _keypath(error.absolute_path)
    schema = error.schema
    if error.validator == "additionalProperties" and isinstance(error.instance, dict) \
            and isinstance(schema, Mapping):
        known = set(schema.get("properties", {}))
        extras = [k for k in error.instance if k not in known]
        if extras:
            return [(f"{path}.{k}" if path else str(k), "unknown key") for k in extras]
    return [(path, _describe(error))]


def _describe(error: jsonschema.ValidationError) -> str:
    if error.validator == "additionalProperties":
        return error.message.replace("Additional properties are not allowed", "unknown key")
    allowed = error.validator_value
    if error.validator == "enum" and isinstance(allowed, list):
        return f"{error.instance!r} is not one of {', '.join(map(str, allowed))}"
    return error.message


def _times_to_epoch(data: Any) -> Any:
    """YAML reads ISO 8601 times as datetimes; the core wants POSIX seconds."""
    if isinstance(data, datetime):
        return (data if data.tzinfo else data.replace(tzinfo=UTC)).timestamp()
    if isinstance(data, dict):
        out = {}
        for key, value in data.items():
            if key == "expires_at" and isinstance(value, str):
                with contextlib.suppress(ValueError):  # left for the checks to report
                    value = datetime.fromisoformat(value.replace("Z", "+00:00"))
            out[key] = _times_to_epoch(value)
        return out
    if isinstance(data, list):
        return [_times_to_epoch(v) for v in data]
    return data


def read_yaml(path: str) -> Any:
    """Read a YAML file, its ISO 8601 times as POSIX seconds.

    Raises PolicyError naming the file when it is missing, unreadable, not
    UTF-8 or not YAML (with the line and column).
    """
    try:
        text = Path(path).read_text("utf-8")
    except FileNotFoundError:
        raise PolicyError(path, [("", "no such file")]) from None
    except OSError as exc:
        raise PolicyError(path, [("", exc.strerror or str(exc))]) from None
    except UnicodeDecodeError:
        raise PolicyError(path, [("", "not UTF-8 text")]) from None
    try:
        return _times_to_epoch(yaml.safe_load(text))
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        problem = getattr(exc, "problem", None) or str(exc).splitlines()[0]
        raise PolicyError(path, [("", f"invalid YAML{where}: {problem}")]) from None


def _path_key(path: str) -> list[tuple[int, str]]:
    """Sort key for key paths: policies[2] before policies[10]."""
    out: list[tuple[int, str]] = []
    for token in path.replace("[", ".[").split("."):
        if token.startswith("[") and token[1:-1].isdigit():
            out.append((int(token[1:-1]), ""))
        else:
            out.append((-1, token))
    return out


def _merge(schema_problems: list[tuple[str, str]], core_problems: list[tuple[str, str]]
           ) -> list[tuple[str, str]]:
    """Every problem once per key path; the core's wording wins where both speak."""
    by_path: dict[str, str] = {}
    for path, message in schema_problems:
        by_path.setdefault(path, message)
    core: dict[str, str] = {}
    for path, message in core_problems:
        core.setdefault(path, message)
    by_path.update(core)
    return sorted(by_path.items(), key=lambda item: _path_key(item[0]))


def validate_policy_data(data: Any, source: str) -> tuple[Policy | None, list[tuple[str, str]]]:
    """Schema first, then the core's own checks: every problem, by key path."""
    validator = jsonschema.Draft202012Validator(policy_schema())
    schema_problems: list[tuple[str, str]] = []
    for error in validator.iter_errors(data):
        for leaf in _leaves(error):
            if leaf.validator in ("if", "then", "else"):
                continue
            schema_problems.extend(error_problems(leaf))
    policy: Policy | None = None
    core_problems: list[tuple[str, str]] = []
    try:
        policy = parse_policy(data, source)
    except PolicyError as exc:
        core_problems = exc.problems
    problems = _merge(schema_problems, core_problems)
    return (policy if not problems else None), problems


def load_policy_file(path: str) -> Policy:
    """Read, validate and parse a policy file; PolicyError lists every problem."""
    data = read_yaml(path)
    policy, problems = validate_policy_data(data, path)
    if problems or policy is None:
        raise PolicyError(path, problems)
    return policy


def load_suspensions_file(path: str) -> tuple[Suspension, ...]:
    """Read a suspension list (a YAML list of {field: value, ...})."""
    data = read_yaml(path)
    schema = policy_schema()
    validator = jsonschema.Draft202012Validator(
        {"$defs": schema["$defs"], "type": ["array", "null"],
         "items": {"$ref": "#/$defs/suspension"}})
    schema_problems = [p for e in validator.iter_errors(data) for p in error_problems(e)]
    try:
        suspensions = parse_suspensions(data, path)
    except PolicyError as exc:
        raise PolicyError(path, _merge(schema_problems, exc.problems)) from None
    if schema_problems:
        raise PolicyError(path, _merge(schema_problems, []))
    return suspensions
