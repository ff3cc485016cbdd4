"""SMTP AUTH credentials: the users of ``smtpd.auth.users`` and their check.

SUMMARY
    Credentials.from_config(config) -> Credentials (ConfigError on a bad entry)
    credentials.verify(user, password) -> bool

DESCRIPTION
    Each user maps to a password, written either as itself or as
    ``{sha256}`` followed by the 64 hex digits of the SHA-256 digest of
    the UTF-8 password (``printf %s secret | sha256sum``).  The SMTP
    adapter offers AUTH PLAIN and LOGIN only on a TLS session (RFC 4954
    section 4: credentials never cross the wire in clear).

STRATEGIES
    Constant time.  Every check hashes the offered password and compares
    digests with hmac.compare_digest, also for an unknown user (against a
    digest no password has), so the time taken does not tell whether a
    user exists nor how much of a password was right.

LIMITATIONS
    An unsalted SHA-256 digest is only as strong as the password: it keeps
    the password out of the config file, not away from a dictionary
    attack.  Keep the file readable by the service only.
"""

from __future__ import annotations

import hashlib
import hmac
import re
from collections.abc import Mapping

from sluice.config import Config, ConfigError

__all__ = ["Credentials", "hash_password"]

_PREFIX = "{sha256}"
_HEX64 = re.compile(r"^[0-9a-fA-F]{64}$")
#: Compared against when the user is unknown; no password hashes to it.
_NOBODY = bytes(32)


def hash_password(password: str) -> str:
    """The ``{sha256}hex`` spelling of ``password`` for the config file."""
    return _PREFIX + hashlib.sha256(password.encode("utf-8")).hexdigest()


class Credentials:
    """User names and password digests; empty means AUTH is not offered."""

    __slots__ = ("_digests",)

    def __init__(self, users: Mapping[str, str] | None = None) -> None:
        digests: dict[str, bytes] = {}
        for user, secret in (users or {}).items():
            if secret.startswith(_PREFIX):
                hexdigest = secret[len(_PREFIX):]
                if not _HEX64.match(hexdigest):
                    raise ValueError(f"user {user!r}: {_PREFIX} must be followed by 64 hex digits")
                digests[user] = bytes.fromhex(hexdigest)
            else:
                digests[user] = hashlib.sha256(secret.encode("utf-8")).digest()
        self._digests = digests

    @classmethod
    def from_config(cls, config: Config) -> Credentials:
        users = config.smtpd.auth.users
        for user, secret in users.items():
            if secret.startswith(_PREFIX) and not _HEX64.match(secret[len(_PREFIX):]):
                raise ConfigError(config.source, f"smtpd.auth.users.{user}",
                                  f"{_PREFIX} must be followed by 64 hex digits")
        return cls(users)

    def __bool__(self) -> bool:
        return bool(self._digests)

    def __len__(self) -> int:
        return len(self._digests)

    def verify(self, user: str | bytes, password: str | bytes) -> bool:
        """Whether ``password`` is right for ``user`` (see STRATEGIES)."""
        if isinstance(user, bytes):
            user = user.decode("utf-8", "surrogateescape")
        if isinstance(password, str):
            password = password.encode("utf-8", "surrogateescape")
        offered = hashlib.sha256(password).digest()
        known = self._digests.get(user)
        same = hmac.compare_digest(offered, known if known is not None else _NOBODY)
        return same and known is not None
