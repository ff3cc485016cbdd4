"""Preflight: every check `sluice serve` makes before it binds a port.

SUMMARY
    preflight(config)      # ConfigError naming the file, the key and the problem

DESCRIPTION
    ``sluice serve`` calls preflight() first; ``sluice config check`` calls
    it and nothing else.  So a file that `config check` passes does not
    stop `serve` for a reason that lies in the file, and a check added here
    holds for both (a behaviour defined once).

    What is checked, each by the code that will use it:

    * the directories the queue writes to can be made and written
      (sluice.config.make_directories), and the API's audit history's;
    * the store has what it needs to open (the postgres store a DSN);
    * the hooks import (smtpd.hook, delivery.pre_hook, delivery.post_hook);
    * the transport map and the resolver's nameservers parse (the Router);
    * the pickup policy file and the suspension list load;
    * the receiver's settings: every ``smtpd.listen`` address, mynetworks,
      the AUTH users, the suppression list, the TLS certificate and key;
    * ``api.listen`` parses, when the API is enabled.

STRATEGIES
    Build, don't copy.  Each check constructs the object serve will use
    (and throws it away) rather than re-stating its rules, so the rules
    cannot drift apart.

LIMITATIONS
    Nothing here connects or binds: a database that is down, or a port
    that another program holds, is found by `serve` itself (exit 2, one
    line).  A path that is fine now may stop being so before `serve` runs.

SEE ALSO
    sluice.runtime.serve, sluice.cli.config_cmds, docs/configuration.md
"""

from __future__ import annotations

from pathlib import Path

from sluice.config import Config, ConfigError, make_directories
from sluice.delivery.router import Router
from sluice.hooks import Hooks
from sluice.runtime.policy_file import load_suspensions
from sluice.scheduler import PolicyError

__all__ = ["preflight"]


def preflight(config: Config) -> None:
    """Raise ConfigError for the first thing that would stop `sluice serve`."""
    make_directories(config)
    _store(config)
    _audit_dir(config)
    hooks = Hooks.from_config(config)
    Router.from_config(config)
    _policy(config)
    from sluice.smtpd.server import receiver_parts

    receiver_parts(config, hooks=hooks)
    _api(config)


def _store(config: Config) -> None:
    if config.queue.store == "postgres":
        from sluice.store import StorageError

        try:
            from sluice.store.postgres import postgres_dsn
        except StorageError as exc:  # the driver is an optional extra
            raise ConfigError(config.source, "queue.store", str(exc)) from None
        postgres_dsn(config)


def _audit_dir(config: Config) -> None:
    from sluice.api.audit import audit_path

    directory = Path(audit_path(config)).parent
    keypath = "api.audit_path" if config.api.audit_path else "queue.path"
    try:
        directory.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise ConfigError(config.source, keypath,
                          f"cannot create {directory}: {exc.strerror or exc}") from None


def _policy(config: Config) -> None:
    from sluice.policyfile import load_policy_file

    s = config.scheduler
    for keypath, path, load in (("scheduler.policy", s.policy, load_policy_file),
                                ("scheduler.suspensions", s.suspensions, load_suspensions)):
        if not path:
            continue
        try:
            load(path)
        except PolicyError as exc:
            # The policy's own message names its file; keep it to one line.
            message = "; ".join(line.strip() for line in str(exc).splitlines() if line.strip())
            raise ConfigError(config.source, keypath, message) from None


def _api(config: Config) -> None:
    if not config.api.enabled:
        return
    try:
        from sluice.api.server import parse_listen
    except ImportError:  # serve runs without the API then, and says so
        return
    try:
        parse_listen(config.api.listen)
    except ValueError as exc:
        raise ConfigError(config.source, "api.listen", str(exc)) from None
