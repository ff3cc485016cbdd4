"""Settings: one YAML file, validated by a JSON Schema shipped in the package.

SUMMARY
    load_config(path) -> Config, or ConfigError with the file, the key path
    and what is wrong, in one line.

DESCRIPTION
    Setting names and defaults are the specification's (Mailismus's
    ``queue`` block, Postfix's backoff and concurrency parameters).  The
    defaults live in the schema (``schemas/config.schema.json``), so that
    ``sluice config show`` and the documentation cannot drift apart.

    The package is one noun a file; this module only gathers their public
    names, which the rest of Sluice imports from ``sluice.config``:

        sections.py    the typed sections, one frozen dataclass per block
        loader.py      the file, the schema, defaults, checks across keys;
                       make_directories
        durations.py   "1h30m", "30m | 2h | 4h", "20%" as numbers
        yaml_keys.py   the YAML loader that refuses a key written twice

SEE ALSO
    docs/configuration.md, sluice.retry
"""

from __future__ import annotations

from sluice.config.durations import (
    format_duration,
    parse_duration,
    parse_fraction,
    parse_retry_delays,
)
from sluice.config.loader import (
    ENV_CONFIG,
    ConfigError,
    config_from_dict,
    config_schema,
    load_config,
    make_directories,
)
from sluice.config.sections import (
    AccountingConfig,
    AnalyticsConfig,
    ApiConfig,
    AuthConfig,
    BounceConfig,
    ClusterConfig,
    Config,
    DeliveryConfig,
    DeliveryTimeouts,
    InjectConfig,
    LoggingConfig,
    NodeConfig,
    PostgresConfig,
    QueueConfig,
    ResolverConfig,
    SchedulerConfig,
    SmtpdConfig,
    SpoolConfig,
    SuppressionConfig,
    TenantsConfig,
    TlsConfig,
)

__all__ = [
    "ENV_CONFIG",
    "AccountingConfig",
    "AnalyticsConfig",
    "ApiConfig",
    "AuthConfig",
    "BounceConfig",
    "ClusterConfig",
    "Config",
    "ConfigError",
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
    "config_from_dict",
    "config_schema",
    "format_duration",
    "load_config",
    "make_directories",
    "parse_duration",
    "parse_fraction",
    "parse_retry_delays",
]
