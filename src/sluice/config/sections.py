"""The typed sections of the configuration: one frozen dataclass per block.

SUMMARY
    Config(queue=QueueConfig(...), smtpd=SmtpdConfig(...), ...)
    config.to_dict(readable=True) -> plain data, spelt as in a file

STRATEGY
    Data only: each section is a frozen dataclass whose fields are the
    keys of its YAML block, with the same defaults as the JSON Schema
    (schemas/config.schema.json, which the loader fills in first, so
    that ``sluice config show`` and the documentation cannot drift).
    Field metadata tells the loader how to read a value: "duration" ->
    parse_duration, "path" -> resolved against the config file's
    directory.  Nothing here reads a file or checks one value against
    another (sluice.config.loader does).

SEE ALSO
    sluice.config.loader, sluice.config.durations, docs/configuration.md
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from sluice.config.durations import format_duration, parse_duration, parse_fraction

__all__ = [
    "AccountingConfig",
    "AnalyticsConfig",
    "ApiConfig",
    "AuthConfig",
    "BounceConfig",
    "ClusterConfig",
    "Config",
    "DeliveryConfig",
    "DeliveryTimeouts",
    "InjectConfig",
    "LoggingConfig",
    "NodeConfig",
    "PostgresConfig",
    "QueueConfig",
    "ResolverConfig",
    "SchedulerConfig",
    "SmtpdConfig",
    "SpoolConfig",
    "SuppressionConfig",
    "TenantsConfig",
    "TlsConfig",
]

def _dur(default: str) -> Any:
    return field(default=parse_duration(default), metadata={"duration": True})


def _path(default: str | None) -> Any:
    return field(default=default, metadata={"path": True})


@dataclass(frozen=True, slots=True)
class NodeConfig:
    """This node: its host name (HELO, Received, Reporting-MTA) and its id."""

    hostname: str = ""
    id: str = ""


@dataclass(frozen=True, slots=True)
class SpoolConfig:
    """Where and how message content is written (queue.spool, docs/queue.md)."""

    rootpath: str = _path("var/spool")
    partitiondepth: int = 2
    bufsize: int = 8192
    sync_method: str = "fsync"
    inline_max: int = 65536
    #: Contents over inline_max: a "files" each, or appended to "segments".
    layout: str = "segments"
    segment_max: int = 16 << 20
    segment_age: float = _dur("10s")


@dataclass(frozen=True, slots=True)
class PostgresConfig:
    """The PostgreSQL store's connection (queue.postgres, docs/storage.md)."""

    dsn: str | None = None
    pool_size: int = 4


@dataclass(frozen=True, slots=True)
class QueueConfig:
    """The meta queue: its store, the active queue's size, retries and expiry."""

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
    #: Successes synced to a journal under path before the store has them
    #: (sluice.journal): "auto" (PostgreSQL only), true or false.
    success_journal: str | bool = "auto"
    #: Before a connection carries the next message, the last success is
    #: "flush"ed to stable storage, or only "write"n to the kernel (it then
    #: survives a crash of Sluice, not a power cut: Postfix's own way).
    success_sync: str = "flush"
    spool: SpoolConfig = field(default_factory=SpoolConfig)
    postgres: PostgresConfig = field(default_factory=PostgresConfig)

    @property
    def journals_successes(self) -> bool:
        """Whether serve keeps the success journal (success_journal, "auto" by store)."""
        if self.success_journal == "auto":
            return self.store == "postgres"
        return self.success_journal is True


@dataclass(frozen=True, slots=True)
class AccountingConfig:
    """The accounting log: its directory, rotation and how long files are kept."""

    path: str = _path("var/log")
    rotate: str = "hourly"
    keep: float = _dur("30d")


@dataclass(frozen=True, slots=True)
class BounceConfig:
    """Non-delivery reports: their From header and how much of the original."""

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
        """Each listed tenant's weight (default_weight where none is given)."""
        return {t: float(v.get("weight", self.default_weight)) for t, v in self.shares.items()}

    @property
    def min_shares(self) -> dict[str, float]:
        """The tenants that have a min_share, as fractions of the limit."""
        out = {}
        for tenant, v in self.shares.items():
            share = v.get("min_share")
            if share is not None:
                out[tenant] = parse_fraction(share)
        return out


@dataclass(frozen=True, slots=True)
class SchedulerConfig:
    """The scheduler's knobs and its policy files (docs/scheduler.md)."""

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
    """The receiver's certificate and key for STARTTLS (docs/smtpd.md)."""

    cert: str | None = _path(None)
    key: str | None = _path(None)


@dataclass(frozen=True, slots=True)
class AuthConfig:
    """SMTP AUTH users of the receiver, as password hashes (docs/security.md)."""

    users: Mapping[str, str] = field(default_factory=dict)
    allow_plaintext: bool = False


@dataclass(frozen=True, slots=True)
class SmtpdConfig:
    """The receiving ESMTP server: listeners, limits, TLS, AUTH (docs/smtpd.md)."""

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
    """The DNS resolver used for MX and address lookups (docs/delivery.md)."""

    nameservers: tuple[str, ...] = ()
    port: int = 53
    timeout: float = _dur("5s")
    cache_size: int = 10000
    inet_protocols: tuple[str, ...] = ("ipv4", "ipv6")


@dataclass(frozen=True, slots=True)
class DeliveryTimeouts:
    """Per-stage timeouts of an outgoing SMTP session (docs/delivery.md)."""

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
    """The sending SMTP edge: routes, connections, TLS, hooks (docs/delivery.md)."""

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
    """The suppression list and what to do with listed recipients (docs/analytics.md)."""

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
        """The tokens as (name, token) pairs, whichever way they were written."""
        if isinstance(self.tokens, Mapping):
            return tuple((str(k), str(v)) for k, v in self.tokens.items())
        return tuple((f"token-{i}", t) for i, t in enumerate(self.tokens, 1))


@dataclass(frozen=True, slots=True)
class AnalyticsConfig:
    """The PySpark jobs over the accounting log (docs/analytics.md)."""

    master: str = "local[*]"
    suppress_soft_count: int = 5
    suppress_soft_days: float = 7.0
    suppress_soft_ttl_days: float = 30.0


@dataclass(frozen=True, slots=True)
class ClusterConfig:
    """Several nodes on one queue: Redis, leases and heartbeats (docs/cluster.md)."""

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
        """This node's host name (node.hostname, filled in by the loader)."""
        return self.node.hostname

    def to_dict(self, readable: bool = False) -> dict[str, Any]:
        """The effective settings as plain data, without source and base_dir.

        Durations are in seconds, or with ``readable`` spelt as in a config
        file ("30m", "30m | 2h | 4h").
        """
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

