"""The `sluice` command.

SUMMARY
    sluice [-c FILE] COMMAND ...

DESCRIPTION
    One module per group of commands; each has ``register(subparsers)``
    that adds its sub-commands, and each sub-command's handler takes the
    parsed arguments and returns the exit status.  The configuration is
    loaded lazily by ``load(args)`` so that a command that needs none (for
    example ``policy validate FILE``) works without one.

    A bad configuration file ends the command with one line naming the
    file, the key path and the problem, and exit status 2 -- never a
    traceback.  Misuse exits 2, an operation that failed exits 1.

    Importing this package imports no command and not the configuration
    (JSON Schema's validator is a fifth of a second): the processes qlist
    and qcount start to share their work run the ``sluice`` script again
    as their main module, and each would pay for it before its first piece.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from sluice.config import Config

__all__ = ["CommandError", "load", "main", "run_command"]

#: Modules that contribute sub-commands, in the order of the help text.
COMMAND_MODULES = (
    "sluice.cli.sendmail",
    "sluice.cli.queue_cmds",
    "sluice.cli.config_cmds",
    "sluice.cli.policy_cmds",
    "sluice.cli.api_cmds",
    "sluice.cli.serve_cmds",
    "sluice.cli.cluster_cmds",
    "sluice.cli.bench_cmds",
    "sluice.cli.analytics_cmds",
    "sluice.cli.sendout_cmds",
    "sluice.cli.shaping_cmds",
    "sluice.cli.auth_cmds",
)


class CommandError(Exception):
    """A command could not do its work; the message is printed, exit 1."""

    def __init__(self, message: str, status: int = 1) -> None:
        super().__init__(message)
        self.status = status


def load(args: argparse.Namespace) -> Config:
    """The configuration named by -c, $SLUICE_CONFIG, or the embedded defaults."""
    from sluice.config import Config, load_config

    cached = getattr(args, "_config", None)
    if isinstance(cached, Config):
        return cached
    cfg = load_config(getattr(args, "config", None))
    args._config = cfg
    return cfg


def _command_in(argv: Sequence[str] | None) -> str | None:
    """The sub-command ``argv`` names, if it names one before anything else."""
    pre = argparse.ArgumentParser(add_help=False)
    pre.add_argument("-c", "--config")
    _, rest = pre.parse_known_args(argv)
    return rest[0] if rest and not rest[0].startswith("-") else None


def build_parser(command: str | None = None) -> argparse.ArgumentParser:
    """The whole command line; with ``command``, only up to the module that has it.

    Importing every command's module costs more than qcount's own work
    (half a second on a loaded machine); a command found early skips the
    rest.  A command no module has gets the whole parser and its error.
    """
    parser = argparse.ArgumentParser(
        prog="sluice",
        description="Sluice: a mail transfer agent's queue manager.",
    )
    parser.add_argument(
        "-c", "--config", metavar="FILE",
        help=f"configuration file (default: ${'{'}SLUICE_CONFIG{'}'} or the embedded defaults)",
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True
    for name in COMMAND_MODULES:
        try:
            module = importlib.import_module(name)
        except ModuleNotFoundError as exc:
            if exc.name == name:  # not written yet, or an optional part not installed
                continue
            raise
        module.register(sub)
        if command is not None and command in sub.choices:
            break
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run the `sluice` command line; returns the exit status.

    Called as ``sendmail`` (installed or linked under that name), it takes
    Postfix's sendmail command line instead, with no sub-command.
    """
    if argv is None and os.path.basename(sys.argv[0]) == "sendmail":
        # Installed or linked as sendmail(1): Postfix's command line, no sub-command.
        from sluice.cli.sendmail import main as sendmail_main

        return sendmail_main()
    parser = build_parser(_command_in(argv))
    args = parser.parse_args(argv)
    return run_command(args.func, args)


def run_command(func: Callable[[argparse.Namespace], int | None],
                args: argparse.Namespace) -> int:
    """Run a command's handler: expected failures are one line and a status."""
    from sluice.config import ConfigError

    try:
        status = func(args)
    except ConfigError as exc:
        print(f"sluice: config error: {exc}", file=sys.stderr)
        return 2
    except CommandError as exc:
        print(f"sluice: {exc}", file=sys.stderr)
        return exc.status
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:
        # `sluice qlist | head`: the reader went away; that is not an error.
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        return 0
    return int(status or 0)


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
