"""AUTH commands: auth hash (what ``doveadm pw`` is to Dovecot).

DESCRIPTION
    ``auth hash [-s SCHEME]`` reads a password and prints it hashed with a
    fresh salt, prefixed with its scheme, ready to paste as a value of
    ``smtpd.auth.users``.  On a terminal the password is asked for twice
    without echo; otherwise the first line of standard input is the
    password (its line end is not part of it), so a script can pipe one
    in.  The password never appears on the command line, where ps(1)
    would show it.

    SCHEME is ARGON2ID (the default), ARGON2I or BLF-CRYPT; see
    sluice.smtpd.credentials for what the server accepts.
"""

from __future__ import annotations

import argparse
import getpass
import sys
from typing import Any

from sluice.cli import CommandError
from sluice.smtpd.credentials import HASH_SCHEMES, hash_password


def register(sub: Any) -> None:
    """Add `sluice auth` to the command line."""
    p = sub.add_parser("auth", help="SMTP AUTH users: make password hashes")
    psub = p.add_subparsers(dest="auth_command", metavar="ACTION")
    psub.required = True
    h = psub.add_parser("hash", help="hash a password for smtpd.auth.users",
                        description="Read a password (asked twice without echo on a "
                                    "terminal, else the first line of stdin) and print "
                                    "{SCHEME}hash.")
    h.add_argument("-s", "--scheme", default=HASH_SCHEMES[0], type=str.upper,
                   choices=HASH_SCHEMES, help=f"hash scheme (default {HASH_SCHEMES[0]})")
    h.set_defaults(func=cmd_hash)


def _read_password() -> str:
    if sys.stdin.isatty():
        first = getpass.getpass("Enter new password: ")
        if getpass.getpass("Retype new password: ") != first:
            raise CommandError("the passwords do not match", status=2)
        return first
    line = sys.stdin.readline()
    return line.removesuffix("\n").removesuffix("\r")


def cmd_hash(args: argparse.Namespace) -> int:
    """`sluice auth hash`: print a password's ``{SCHEME}hash`` for smtpd.auth.users."""
    password = _read_password()
    if not password:
        raise CommandError("empty password", status=2)
    try:
        print(hash_password(password, args.scheme))
    except ValueError as exc:
        raise CommandError(str(exc), status=2) from None
    return 0
