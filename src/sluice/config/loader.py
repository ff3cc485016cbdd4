"""Reading the configuration: the file, the schema, and checks across keys.

SUMMARY
    load_config(path) -> Config, or ConfigError with the file, the key path
    and what is wrong, in one line.  config_from_dict(data) does the same
    for data already parsed; make_directories(config) creates the
    directories the queue writes to.

STRATEGY
    Parse, validate, fill, build, check, in that order.  The YAML is read
    with UniqueKeyLoader (a key written twice is an error naming both
    lines); the data is validated against the JSON Schema shipped in the
    package (schemas/config.schema.json), and the most specific error is
    reported; the schema's defaults are filled in, so that the schema is
    the one place defaults are written; the typed sections are built
    field by field (durations and paths read as their metadata says);
    last come the checks that relate two keys.

    With no file at all, Sluice runs on the embedded defaults, with its
    state under ``./var``.  Relative paths in a file are taken relative to
    the directory of that file, so that a service started from ``/`` finds
    the same queue as an operator in the config directory.

    retry_granularity may not exceed half of the first retry delay; a larger
    value is silently reduced, as Mailismus does (section 4.3.2).

    make_directories(config) creates the directories the queue writes to,
    or raises ConfigError naming the key whose path is unusable; the queue
    and ``sluice serve`` call it before they open anything.

SEE ALSO
    sluice.config.sections, sluice.config.durations,
    sluice.config.yaml_keys, docs/configuration.md
"""

from __future__ import annotations

import dataclasses
import json
import os
import socket
from collections.abc import Mapping
from importlib import resources
from pathlib import Path
from typing import Any

import jsonschema
import yaml

from sluice.config.durations import parse_duration, parse_retry_delays
from sluice.config.sections import Config, NodeConfig
from sluice.config.yaml_keys import DuplicateKeyError, UniqueKeyLoader

__all__ = [
    "ENV_CONFIG",
    "ConfigError",
    "config_from_dict",
    "config_schema",
    "load_config",
    "make_directories",
]

ENV_CONFIG = "SLUICE_CONFIG"


class ConfigError(Exception):
    """A configuration file is unusable; str() is the one line to print."""

    def __init__(self, source: str, keypath: str, message: str) -> None:
        self.source = source
        self.keypath = keypath
        self.message = message
        where = f"{source}: {keypath}" if keypath else source
        super().__init__(f"{where}: {message}")



def config_schema() -> dict[str, Any]:
    """The JSON Schema of the configuration file, as shipped in the package."""
    text = resources.files("sluice").joinpath("schemas/config.schema.json").read_text("utf-8")
    schema: dict[str, Any] = json.loads(text)
    return schema


def _keypath(parts: object) -> str:
    out = ""
    for part in parts:  # type: ignore[attr-defined]
        if isinstance(part, int):
            out += f"[{part}]"
        else:
            out += f".{part}" if out else str(part)
    return out


def _describe(error: jsonschema.ValidationError) -> str:
    if error.validator == "additionalProperties":
        return error.message.replace("Additional properties are not allowed", "unknown key")
    if error.validator == "enum":
        allowed = ", ".join(repr(v) for v in list(error.validator_value))  # type: ignore[arg-type]
        return f"{error.instance!r} is not one of {allowed}"
    return error.message


def _fill_defaults(schema: Mapping[str, Any], data: dict[str, Any]) -> None:
    for key, sub in schema.get("properties", {}).items():
        if key not in data and "default" in sub:
            data[key] = json.loads(json.dumps(sub["default"]))
        if isinstance(data.get(key), dict) and sub.get("type") == "object":
            _fill_defaults(sub, data[key])


#: The annotations (strings, under PEP 563) of the settings that are whole numbers.
_INTEGERS = frozenset({"int", "int | None"})


def _build(cls: type[Any], data: Mapping[str, Any], path: str, source: str, base: Path) -> Any:
    kwargs: dict[str, Any] = {}
    for f in dataclasses.fields(cls):
        if f.name not in data:
            continue
        value = data[f.name]
        keypath = f"{path}.{f.name}" if path else f.name
        try:
            if f.metadata.get("duration"):
                value = parse_duration(value)
            elif f.name == "retry_delays":
                value = parse_retry_delays(value)
            elif f.metadata.get("path") and value is not None:
                value = str((base / os.path.expanduser(value)).resolve())
            elif isinstance(value, dict) and isinstance(f.default_factory, type):
                factory = f.default_factory
                if dataclasses.is_dataclass(factory):
                    value = _build(factory, value, keypath, source, base)
            elif isinstance(value, list):
                value = tuple(value)
            elif isinstance(value, float) and f.type in _INTEGERS and value.is_integer():
                # The schema's "integer" admits 1000.0; the code (compiled
                # by mypyc, sluice._native) takes an int only.
                value = int(value)
        except ValueError as exc:
            raise ConfigError(source, keypath, str(exc)) from None
        kwargs[f.name] = value
    return cls(**kwargs)


def _semantic_checks(cfg: Config) -> Config:
    queue = cfg.queue
    # Mailismus 4.3.2: "This setting cannot exceed half the value of the first
    # retry_delays interval ... and will be silently reduced".
    limit = queue.retry_delays[0] / 2
    if queue.retry_granularity > limit:
        queue = dataclasses.replace(queue, retry_granularity=limit)
    if queue.minimal_backoff > queue.maximal_backoff:
        raise ConfigError(
            cfg.source, "queue.minimal_backoff", "must not exceed queue.maximal_backoff"
        )
    tenants = cfg.scheduler.tenants
    if sum(tenants.min_shares.values()) > 1:
        raise ConfigError(cfg.source, "scheduler.tenants.shares",
                          "the min_share values add up to more than 100 %")
    if 0 < cfg.delivery.smtp_line_length_limit < 78:
        raise ConfigError(cfg.source, "delivery.smtp_line_length_limit",
                          "must be 0 (send long lines unchanged) or at least 78")
    if cfg.smtpd.dedupe_window <= 0:
        raise ConfigError(cfg.source, "smtpd.dedupe_window", "must be longer than 0 s")
    hostname = cfg.node.hostname or socket.gethostname() or "localhost"
    node = NodeConfig(hostname=hostname, id=cfg.node.id or hostname)
    return dataclasses.replace(cfg, queue=queue, node=node)


def config_from_dict(
    data: Mapping[str, Any] | None, *, source: str = "<dict>", base_dir: str | Path = "."
) -> Config:
    """Validate plain data (as parsed from YAML) and build the Config."""
    raw: dict[str, Any] = json.loads(json.dumps(dict(data or {}), default=str))
    schema = config_schema()
    validator = jsonschema.Draft202012Validator(schema)
    errors = list(validator.iter_errors(raw))
    if errors:
        # The most specific error is the most useful single line.
        err = max(errors, key=lambda e: len(e.absolute_path))
        raise ConfigError(source, _keypath(err.absolute_path), _describe(err))
    _fill_defaults(schema, raw)
    hostname = (raw.get("node") or {}).get("hostname")
    if hostname is None:
        raw.setdefault("node", {})["hostname"] = ""
    if raw["node"].get("id") is None:
        raw["node"]["id"] = ""
    base = Path(base_dir).resolve()
    cfg = _build(Config, raw, "", source, base)
    cfg = dataclasses.replace(cfg, source=source, base_dir=str(base))
    return _semantic_checks(cfg)


def make_directories(config: Config) -> None:
    """Create the directories the queue writes to, or raise ConfigError.

    They are queue.path, the spool's root for the stores that use it, and
    accounting.path; the error names the key whose directory cannot be
    made or written.
    """
    dirs = [("queue.path", config.queue.path)]
    if config.queue.store in ("sqlite", "fs"):
        dirs.append(("queue.spool.rootpath", config.queue.spool.rootpath))
    dirs.append(("accounting.path", config.accounting.path))
    for keypath, path in dirs:
        try:
            Path(path).mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise ConfigError(config.source, keypath,
                              f"cannot create {path}: {exc.strerror or exc}") from None
        if not os.access(path, os.W_OK | os.X_OK):
            raise ConfigError(config.source, keypath, f"{path} is not writable")


def load_config(path: str | os.PathLike[str] | None = None) -> Config:
    """Load ``path``, or $SLUICE_CONFIG, or the embedded defaults."""
    if path is None:
        path = os.environ.get(ENV_CONFIG) or None
    if path is None:
        return config_from_dict({}, source="<embedded defaults>", base_dir=Path.cwd())
    source = str(path)
    try:
        text = Path(path).read_text("utf-8")
    except FileNotFoundError:
        raise ConfigError(source, "", "no such file") from None
    except OSError as exc:
        raise ConfigError(source, "", exc.strerror or str(exc)) from None
    except UnicodeDecodeError:
        raise ConfigError(source, "", "not UTF-8 text") from None
    try:
        data = yaml.load(text, Loader=UniqueKeyLoader)
    except DuplicateKeyError as exc:
        raise ConfigError(source, exc.keypath, str(exc)) from None
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f"line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        problem = getattr(exc, "problem", None) or str(exc).splitlines()[0]
        message = f"invalid YAML {where}: {problem}".replace("  ", " ")
        raise ConfigError(source, "", message) from None
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise ConfigError(source, "", "the top level must be a mapping of sections")
    return config_from_dict(data, source=source, base_dir=Path(path).resolve().parent)
