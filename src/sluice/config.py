"""Settings: one YAML file, validated by a JSON Schema shipped in the package.

SUMMARY
    load_config(path) -> Config, or ConfigError with the file, the key path
    and what is wrong, in one line.

DESCRIPTION
    Setting names and defaults are the specification's (Mailismus's
    ``queue`` block, Postfix's backoff and concurrency parameters).  The
    defaults live in the schema (``schemas/config.schema.json``), so that
    ``sluice config show`` and the documentation cannot drift apart.

    With no file at all, Sluice runs on the embedded defaults, with its
    state under ``./var``.  Relative paths in a file are taken relative to
    the directory of that file, so that a service started from ``/`` finds
    the same queue as an operator in the config directory.

    Durations are seconds (a number) or strings with the units s, m, h and
    d, alone or combined ("90s", "30m", "1h30m", "3d").

    retry_granularity may not exceed half of the first retry delay; a larger
    value is silently reduced, as Mailismus does (section 4.3.2).

    A key written twice in one mapping, at any depth, is an error naming
    both lines (YAML itself would keep the last one silently).  The loader
    is PyYAML's SafeLoader with its mapping constructor replaced through
    the public add_constructor hook.

    make_directories(config) creates the directories the queue writes to,
    or raises ConfigError naming the key whose path is unusable; the queue
    and ``sluice serve`` call it before they open anything.

SEE ALSO
    docs/configuration.md, sluice.retry
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import socket
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from typing import Any

import jsonschema
import yaml

__all__ = [
    "AccountingConfig",
    "ApiConfig",
    "BounceConfig",
    "Config",
    "ConfigError",
    "DeliveryConfig",
    "QueueConfig",
    "SchedulerConfig",
    "SmtpdConfig",
    "SpoolConfig",
    "config_schema",
    "format_duration",
    "load_config",
    "make_directories",
    "parse_duration",
    "parse_retry_delays",
]

ENV_CONFIG = "SLUICE_CONFIG"

_UNIT_S = {"s": 1.0, "m": 60.0, "h": 3600.0, "d": 86400.0}
_DURATION_RE = re.compile(r"(\d+(?:\.\d+)?)\s*([smhd]?)", re.IGNORECASE)


class ConfigError(Exception):
    """A configuration file is unusable; str() is the one line to print."""

    def __init__(self, source: str, keypath: str, message: str) -> None:
        self.source = source
        self.keypath = keypath
        self.message = message
        where = f"{source}: {keypath}" if keypath else source
        super().__init__(f"{where}: {message}")


def parse_duration(value: object) -> float:
    """Seconds from 90, "90s", "30m", "2h", "1d", "1h30m". Raises ValueError."""
    if isinstance(value, bool):
        raise ValueError(f"{value!r} is not a duration")
    if isinstance(value, int | float):
        if value < 0:
            raise ValueError(f"{value!r} is negative")
        return float(value)
    if not isinstance(value, str):
        raise ValueError(f"{value!r} is not a duration")
    text = value.strip()
    pos = 0
    total = 0.0
    if not text:
        raise ValueError("empty duration")
    while pos < len(text):
        m = _DURATION_RE.match(text, pos)
        if not m or m.end() == pos:
            raise ValueError(f"{value!r} is not a duration (use s, m, h or d, e.g. 30m)")
        unit = m.group(2).lower() or "s"
        total += float(m.group(1)) * _UNIT_S[unit]
        pos = m.end()
        while pos < len(text) and text[pos] == " ":
            pos += 1
    return total


def format_duration(seconds: float) -> str:
    """The shortest exact spelling: 1800 -> "30m", 5400 -> "1h30m", 90 -> "90s"."""
    if seconds != int(seconds):
        return f"{seconds:g}s"
    rest = int(seconds)
    if rest == 0:
        return "0s"
    out = []
    for unit, size in (("d", 86400), ("h", 3600), ("m", 60), ("s", 1)):
        if rest >= size:
            n, rest = divmod(rest, size)
            out.append(f"{n}{unit}")
    if len(out) > 2:  # "1d2h3m4s" reads worse than seconds
        return f"{int(seconds)}s"
    return "".join(out)


def parse_retry_delays(value: object) -> tuple[float, ...]:
    """Mailismus's "30m | 2h | 4h" (or a YAML list) as seconds."""
    items: list[object]
    if isinstance(value, str):
        items = [part for part in value.split("|")]
    elif isinstance(value, list | tuple):
        items = list(value)
    else:
        raise ValueError(f"{value!r} is not a list of delays")
    delays = tuple(
        parse_duration(item.strip() if isinstance(item, str) else item) for item in items
    )
    if not delays:
        raise ValueError("at least one delay is needed")
    if any(d <= 0 for d in delays):
        raise ValueError("every retry delay must be greater than zero")
    return delays


# --------------------------------------------------------------------------
# Typed sections.  Field metadata: "duration" -> parse_duration, "path" ->
# resolved against the config directory.

def _dur(default: str) -> Any:
    return field(default=parse_duration(default), metadata={"duration": True})


def _path(default: str | None) -> Any:
    return field(default=default, metadata={"path": True})


@dataclass(frozen=True, slots=True)
class NodeConfig:
    hostname: str = ""
    id: str = ""


@dataclass(frozen=True, slots=True)
class SpoolConfig:
    rootpath: str = _path("var/spool")
    partitiondepth: int = 2
    bufsize: int = 8192
    sync_method: str = "fsync"
    inline_max: int = 65536


@dataclass(frozen=True, slots=True)
class PostgresConfig:
    dsn: str | None = None
    pool_size: int = 4


@dataclass(frozen=True, slots=True)
class QueueConfig:
    store: str = "sqlite"
    path: str = _path("var/queue")
    maxmemoryqueue: int = 10000
    retry_maxtime: float = _dur("72h")
    retry_maxtime_reports: float = _dur("24h")
    retry_delays: tuple[float, ...] = (1800.0, 7200.0, 14400.0)
    retry_mode: str = "schedule"
    minimal_backoff: float = _dur("300s")
    maximal_backoff: float = _dur("4000s")
    quota_deferred: int = 10
    retry_granularity: float = _dur("15m")
    bounces_interval: float = _dur("10m")
    commit_max_batch: int = 2000
    spool: SpoolConfig = field(default_factory=SpoolConfig)
    postgres: PostgresConfig = field(default_factory=PostgresConfig)


@dataclass(frozen=True, slots=True)
class AccountingConfig:
    path: str = _path("var/log")
    rotate: str = "hourly"
    keep: float = _dur("30d")


@dataclass(frozen=True, slots=True)
class BounceConfig:
    from_address: str = "MAILER-DAEMON"
    max_original_headers: int = 65536


@dataclass(frozen=True, slots=True)
class TenantsConfig:
    """Tenants' shares of every contended limit (deficit round robin)."""

    fair: bool = True
    default_weight: float = 1.0
    shares: Mapping[str, Mapping[str, Any]] = field(default_factory=dict)

    @property
    def weights(self) -> dict[str, float]:
        return {t: float(v.get("weight", self.default_weight)) for t, v in self.shares.items()}

    @property
    def min_shares(self) -> dict[str, float]:
        out = {}
        for tenant, v in self.shares.items():
            share = v.get("min_share")
            if share is not None:
                out[tenant] = parse_fraction(share)
        return out


def parse_fraction(value: object) -> float:
    """A share as ``0.2`` or ``"20%"``."""
    if isinstance(value, str) and value.strip().endswith("%"):
        return float(value.strip()[:-1]) / 100
    if isinstance(value, int | float) and not isinstance(value, bool):
        return float(value)
    raise ValueError(f"{value!r} is not a share (use 0.2 or \"20%\")")


@dataclass(frozen=True, slots=True)
class SchedulerConfig:
    policy: str | None = _path(None)
    suspensions: str | None = _path(None)
    initial_destination_concurrency: int = 2
    default_destination_concurrency_limit: int = 20
    destination_concurrency_failed_cohort_limit: int = 1
    dead_destination_ttl: float = _dur("5m")
    destination_cache_size: int = 10000
    refill_interval: float = _dur("1s")
    refill_batch: int = 1000
    max_deliveries: int = 0
    tenants: TenantsConfig = field(default_factory=TenantsConfig)


@dataclass(frozen=True, slots=True)
class TlsConfig:
    cert: str | None = _path(None)
    key: str | None = _path(None)


@dataclass(frozen=True, slots=True)
class AuthConfig:
    users: Mapping[str, str] = field(default_factory=dict)
    allow_plaintext: bool = False


@dataclass(frozen=True, slots=True)
class SmtpdConfig:
    listen: tuple[str, ...] = ("127.0.0.1:2525",)
    processes: int = 0
    hostname: str | None = None
    mynetworks: tuple[str, ...] = ("127.0.0.0/8", "::1/128")
    relay_domains: tuple[str, ...] = ()
    allow_routed_local_parts: bool = False
    max_message_size: int = 52428800
    max_recipients: int = 1000
    max_line_length: int = 998
    reject_long_lines: bool = False
    max_connections_per_client: int = 50
    max_connections: int = 1000
    timeout: float = _dur("300s")
    backlog: int = 1024
    spill_size: int = 1048576
    shutdown_timeout: float = _dur("30s")
    tls: TlsConfig = field(default_factory=TlsConfig)
    auth: AuthConfig = field(default_factory=AuthConfig)
    hook: str | None = None
    dedupe: bool = False
    dedupe_window: float = _dur("1h")


@dataclass(frozen=True, slots=True)
class ResolverConfig:
    nameservers: tuple[str, ...] = ()
    port: int = 53
    timeout: float = _dur("5s")
    cache_size: int = 10000
    inet_protocols: tuple[str, ...] = ("ipv4", "ipv6")


@dataclass(frozen=True, slots=True)
class DeliveryTimeouts:
    connect: float = _dur("30s")
    greeting: float = _dur("300s")
    helo: float = _dur("300s")
    mail: float = _dur("300s")
    rcpt: float = _dur("300s")
    data_init: float = _dur("120s")
    data_block: float = _dur("180s")
    data_done: float = _dur("600s")
    idle: float = _dur("10s")
    starttls: float = _dur("300s")
    rset: float = _dur("20s")


@dataclass(frozen=True, slots=True)
class DeliveryConfig:
    transport: Mapping[str, str] = field(default_factory=dict)
    port: int = 25
    resolver: ResolverConfig = field(default_factory=ResolverConfig)
    helo: Mapping[str, str] = field(default_factory=dict)
    max_messages_per_connection: int = 100
    max_connections: int = 200
    mx_address_limit: int = 5
    starttls: str = "opportunistic"
    timeouts: DeliveryTimeouts = field(default_factory=DeliveryTimeouts)
    pre_hook: str | None = None
    post_hook: str | None = None
    shaping: str | None = _path(None)
    shaping_defaults: bool = True
    smtp_line_length_limit: int = 998


@dataclass(frozen=True, slots=True)
class SuppressionConfig:
    path: str | None = _path(None)
    mode: str = "reject"


@dataclass(frozen=True, slots=True)
class InjectConfig:
    """The HTTP injection API (POST /api/v1/inject, docs/api.md)."""

    max_queue: int = 1_000_000
    max_commit_time: float = _dur("2s")
    retry_after: float = _dur("5s")
    idempotency_window: float = _dur("24h")
    max_recipients: int = 10_000


@dataclass(frozen=True, slots=True)
class ApiConfig:
    """The REST API, web page and /metrics (docs/api.md).

    ``tokens`` is a list (named token-1, token-2, ... in order) or a mapping
    of name to token; ``named_tokens`` gives both as (name, token) pairs.
    ``body_tokens`` names the tokens that may read message bodies.
    """

    enabled: bool = True
    listen: str = "127.0.0.1:8025"
    tokens: tuple[str, ...] | Mapping[str, str] = ()
    audit_path: str | None = _path(None)
    metrics_domains: int = 20
    metrics_tenants: int = 20
    metrics_min_count: int = 10
    metrics_domain_groups: Mapping[str, Sequence[str]] = field(default_factory=dict)
    history_max_bytes: int = 1 << 30
    body_tokens: tuple[str, ...] = ()
    inject: InjectConfig = field(default_factory=InjectConfig)

    @property
    def named_tokens(self) -> tuple[tuple[str, str], ...]:
        if isinstance(self.tokens, Mapping):
            return tuple((str(k), str(v)) for k, v in self.tokens.items())
        return tuple((f"token-{i}", t) for i, t in enumerate(self.tokens, 1))


@dataclass(frozen=True, slots=True)
class AnalyticsConfig:
    master: str = "local[*]"
    suppress_soft_count: int = 5
    suppress_soft_days: float = 7.0
    suppress_soft_ttl_days: float = 30.0


@dataclass(frozen=True, slots=True)
class ClusterConfig:
    redis: str | None = None
    redis_password: str | None = None
    redis_ca: str | None = _path(None)
    lease_ttl: float = _dur("30s")
    node_lease: float = _dur("30s")
    heartbeat_interval: float = _dur("5s")
    claim_per_destination: int = 20


@dataclass(frozen=True, slots=True)
class LoggingConfig:
    """How `sluice serve` logs (sluice.logs, docs/observability.md)."""

    format: str = "text"
    level: str = "info"
    levels: Mapping[str, str] = field(default_factory=dict)
    maillog: str | None = _path(None)


@dataclass(frozen=True, slots=True)
class Config:
    """The effective configuration; ``source`` says where it came from."""

    node: NodeConfig = field(default_factory=NodeConfig)
    queue: QueueConfig = field(default_factory=QueueConfig)
    accounting: AccountingConfig = field(default_factory=AccountingConfig)
    bounce: BounceConfig = field(default_factory=BounceConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    smtpd: SmtpdConfig = field(default_factory=SmtpdConfig)
    delivery: DeliveryConfig = field(default_factory=DeliveryConfig)
    suppression: SuppressionConfig = field(default_factory=SuppressionConfig)
    api: ApiConfig = field(default_factory=ApiConfig)
    analytics: AnalyticsConfig = field(default_factory=AnalyticsConfig)
    cluster: ClusterConfig = field(default_factory=ClusterConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    source: str = "<embedded defaults>"
    base_dir: str = "."

    @property
    def hostname(self) -> str:
        return self.node.hostname

    def to_dict(self, readable: bool = False) -> dict[str, Any]:
        """The effective settings as plain data: durations in seconds, or with
        ``readable`` spelt as in a config file ("30m", "30m | 2h | 4h")."""
        out = _to_plain(self, readable)
        assert isinstance(out, dict)
        out.pop("source", None)
        out.pop("base_dir", None)
        return out


def _to_plain(value: object, readable: bool = False) -> object:
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        out: dict[str, object] = {}
        for f in dataclasses.fields(value):
            item = getattr(value, f.name)
            if readable and f.metadata.get("duration"):
                out[f.name] = format_duration(item)
            elif readable and f.name == "retry_delays":
                out[f.name] = " | ".join(format_duration(d) for d in item)
            else:
                out[f.name] = _to_plain(item, readable)
        return out
    if isinstance(value, Mapping):
        return {str(k): _to_plain(v, readable) for k, v in value.items()}
    if isinstance(value, tuple | list):
        return [_to_plain(v, readable) for v in value]
    return value


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


class _DuplicateKey(yaml.YAMLError):
    def __init__(self, keypath: str, message: str) -> None:
        super().__init__(message)
        self.keypath = keypath


class _UniqueKeyLoader(yaml.SafeLoader):
    """SafeLoader that refuses a key given twice in one mapping, at any depth."""

    def construct_document(self, node: yaml.Node) -> Any:
        _refuse_duplicates(self, node, "", set())
        return super().construct_document(node)


def _refuse_duplicates(loader: yaml.SafeLoader, node: yaml.Node, path: str,
                       seen_nodes: set[int]) -> None:
    if id(node) in seen_nodes:  # an alias: checked where its anchor is
        return
    seen_nodes.add(id(node))
    if isinstance(node, yaml.SequenceNode):
        for i, item in enumerate(node.value):
            _refuse_duplicates(loader, item, f"{path}[{i}]", seen_nodes)
        return
    if not isinstance(node, yaml.MappingNode):
        return
    first_line: dict[object, int] = {}
    for key_node, value_node in node.value:
        if key_node.tag == "tag:yaml.org,2002:merge":
            continue  # "<<" merges are YAML's own way of overriding on purpose
        key = loader.construct_object(key_node, deep=True)
        keypath = f"{path}.{key}" if path else str(key)
        line = key_node.start_mark.line + 1
        try:
            seen = first_line.get(key)
            first_line.setdefault(key, line)
        except TypeError:
            continue  # an unhashable key: the constructor says so itself
        if seen is not None:
            raise _DuplicateKey(keypath, f"duplicate key at line {line} "
                                f"(first at line {seen}; YAML would keep the last)")
        _refuse_duplicates(loader, value_node, keypath, seen_nodes)


def make_directories(config: Config) -> None:
    """Create the directories the queue writes to (queue.path, the spool's
    root for the stores that use it, accounting.path); ConfigError names the
    key whose directory cannot be made or written."""
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
        data = yaml.load(text, Loader=_UniqueKeyLoader)
    except _DuplicateKey as exc:
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
