"""SMTP AUTH credentials: the users of ``smtpd.auth.users`` and their check.

SUMMARY
    Credentials.from_config(config) -> Credentials (ConfigError on a bad entry)
    await credentials.check(user, password) -> bool   (off the event loop)
    credentials.verify(user, password) -> bool        (blocking)
    hash_password(password, scheme="ARGON2ID") -> "{ARGON2ID}$argon2id$..."

DESCRIPTION
    Each user maps to a password written the way Dovecot's passdb writes
    one: ``{SCHEME}`` then the scheme's text (``doveadm pw`` output can be
    pasted as it is; ``sluice auth hash`` makes the same).  Scheme names
    are case-insensitive.

    {ARGON2ID}   $argon2id$v=19$m=...,t=...,p=...$salt$hash  (the default)
    {ARGON2I}    $argon2i$...   the PHC string must be of the named type
    {BLF-CRYPT}  $2y$ / $2b$ / $2a$ bcrypt; a password over 72 bytes is
                 cut at 72, as crypt(3) and Dovecot do
    {SHA256}     unsalted SHA-256 digest, base64 (Dovecot) or 64 hex digits
                 (older Sluice files); also {SHA256.HEX} and {SHA256.B64}.
                 Accepted with a warning at start-up: a legacy form.
    {PLAIN}      the password itself
    no prefix    the password itself

    Plain text ({PLAIN} or no prefix) is refused at start-up, with one line
    naming the file and the key, unless ``smtpd.auth.allow_plaintext`` is
    set.  The SMTP adapter offers AUTH PLAIN and LOGIN only on a TLS session
    (RFC 4954 section 4: credentials never cross the wire in clear).

STRATEGIES
    Slow hashes off the loop.  An Argon2 or bcrypt check takes a good part
    of a second of CPU at the default costs (bench/auth_lines_bench.py),
    and Argon2 its memory cost, 64 MiB by default;
    ``check`` runs it in a small thread pool of its own so the event loop
    keeps serving other sessions, and at most AUTH_THREADS checks run at
    once, which bounds the memory a flood of AUTH commands can take.  A
    cheap check (SHA-256, plain) runs inline.

    Unknown users cost what known ones do.  An unknown user is checked
    against the first configured entry and always fails, so the time taken
    does not tell whether a user exists; digests are compared with
    hmac.compare_digest so it does not tell how much of a password was
    right either.

LIMITATIONS
    An unsalted SHA-256 digest is only as strong as the password: it keeps
    the password out of the config file, not away from a dictionary attack.
    Keep the file readable by the service only, whatever the scheme.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import hashlib
import hmac
import logging
import re
from collections.abc import Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import argon2
import bcrypt

from sluice.config import Config, ConfigError

__all__ = ["AUTH_THREADS", "HASH_SCHEMES", "Credentials", "hash_password"]

log = logging.getLogger(__name__)

#: How many slow hash checks may run at once (each in its own thread).
AUTH_THREADS = 2
#: The schemes ``hash_password`` can make, default first.
HASH_SCHEMES = ("ARGON2ID", "ARGON2I", "BLF-CRYPT")

_SCHEME = re.compile(r"^\{([A-Za-z0-9.-]+)\}")
_HEX64 = re.compile(r"^[0-9a-fA-F]{64}$")
_BCRYPT = re.compile(r"^\$2[aby]\$\d\d\$[./A-Za-z0-9]{53}$")
_BCRYPT_MAX = 72  # bcrypt reads no more of a password than this


class EntryError(ValueError):
    """A password entry that cannot be used; the message says why."""


@dataclass(frozen=True, slots=True)
class _Entry:
    scheme: str
    matches: Callable[[bytes], bool]
    slow: bool  # run it in a thread
    plain: bool = False  # the file holds the password itself
    legacy: bool = False  # unsalted: warn at start-up


def _sha256_entry(scheme: str, text: str) -> _Entry:
    kind = scheme.partition(".")[2]
    digest: bytes | None = None
    if kind in ("", "HEX") and _HEX64.match(text):
        digest = bytes.fromhex(text)
    elif kind in ("", "B64"):
        try:
            digest = base64.b64decode(text, validate=True)
        except (binascii.Error, ValueError):
            digest = None
    if digest is None or len(digest) != 32:
        raise EntryError(f"{{{scheme}}} must be followed by a SHA-256 digest "
                         "(base64, or 64 hex digits)")
    known = digest
    return _Entry("SHA256", lambda pw: hmac.compare_digest(hashlib.sha256(pw).digest(), known),
                  slow=False, legacy=True)


def _argon2_entry(scheme: str, text: str) -> _Entry:
    kind = "argon2id" if scheme == "ARGON2ID" else "argon2i"
    if not text.startswith(f"${kind}$"):
        raise EntryError(f"{{{scheme}}} must be followed by a ${kind}$ hash string")
    try:
        argon2.extract_parameters(text)
    except argon2.exceptions.InvalidHashError:
        raise EntryError(f"{{{scheme}}}: not a valid {kind} hash string") from None
    hasher = argon2.PasswordHasher()  # verify() takes the costs from the hash itself

    def matches(password: bytes) -> bool:
        try:
            return hasher.verify(text, password)
        except (argon2.exceptions.VerificationError, argon2.exceptions.InvalidHashError):
            return False

    return _Entry(scheme, matches, slow=True)


def _bcrypt_entry(scheme: str, text: str) -> _Entry:
    if not _BCRYPT.match(text):
        raise EntryError(f"{{{scheme}}} must be followed by a $2y$ (or $2b$, $2a$) bcrypt hash")
    hashed = text.encode("ascii")
    return _Entry(scheme, lambda pw: bcrypt.checkpw(pw[:_BCRYPT_MAX], hashed), slow=True)


def _plain_entry(text: str) -> _Entry:
    known = hashlib.sha256(text.encode("utf-8")).digest()
    # Compare digests, not the strings, so the time does not depend on
    # how long a common prefix the offered password has.
    return _Entry("PLAIN", lambda pw: hmac.compare_digest(hashlib.sha256(pw).digest(), known),
                  slow=False, plain=True)


def parse_entry(secret: str) -> _Entry:
    """The checker for one ``users`` value; EntryError says what is wrong."""
    m = _SCHEME.match(secret)
    if m is None:
        return _plain_entry(secret)
    scheme = m.group(1).upper()
    text = secret[m.end():]
    if scheme in ("SHA256", "SHA256.HEX", "SHA256.B64"):
        return _sha256_entry(scheme, text)
    if scheme in ("ARGON2ID", "ARGON2I"):
        return _argon2_entry(scheme, text)
    if scheme == "BLF-CRYPT":
        return _bcrypt_entry(scheme, text)
    if scheme == "PLAIN":
        return _plain_entry(text)
    raise EntryError(f"unknown password scheme {{{m.group(1)}}}; use one of {{ARGON2ID}}, "
                     "{ARGON2I}, {BLF-CRYPT}, {SHA256}, {PLAIN}")


def hash_password(password: str, scheme: str = "ARGON2ID") -> str:
    """``password`` hashed with a fresh salt, spelt for the config file.

    Costs are the libraries' defaults: Argon2 t=3, m=64 MiB, p=4 (RFC 9106's
    second recommended option), bcrypt 2^12 rounds.
    """
    scheme = scheme.upper()
    raw = password.encode("utf-8")
    if scheme == "ARGON2ID":
        return "{ARGON2ID}" + argon2.PasswordHasher(type=argon2.Type.ID).hash(raw)
    if scheme == "ARGON2I":
        return "{ARGON2I}" + argon2.PasswordHasher(type=argon2.Type.I).hash(raw)
    if scheme == "BLF-CRYPT":
        if len(raw) > _BCRYPT_MAX:
            raise ValueError(f"bcrypt uses at most {_BCRYPT_MAX} bytes of a password; "
                             "this one is longer (use ARGON2ID)")
        return "{BLF-CRYPT}" + bcrypt.hashpw(raw, bcrypt.gensalt()).decode("ascii")
    raise ValueError(f"cannot make {{{scheme}}} hashes; choose one of {', '.join(HASH_SCHEMES)}")


class Credentials:
    """User names and their password checkers; empty means AUTH is not offered."""

    __slots__ = ("_entries", "_executor")

    def __init__(self, users: Mapping[str, str] | None = None, *,
                 allow_plaintext: bool = False) -> None:
        entries: dict[str, _Entry] = {}
        for user, secret in (users or {}).items():
            try:
                entry = parse_entry(secret)
            except EntryError as exc:
                raise EntryError(f"user {user!r}: {exc}") from None
            if entry.plain and not allow_plaintext:
                raise EntryError(f"user {user!r}: {_PLAINTEXT_REFUSED}")
            entries[user] = entry
        self._entries = entries
        self._executor: ThreadPoolExecutor | None = None

    @classmethod
    def from_config(cls, config: Config) -> Credentials:
        """The users of ``smtpd.auth``; ConfigError names the bad user's key.

        A legacy unsalted entry is logged as a warning (one line per user).
        """
        auth = config.smtpd.auth
        for user, secret in auth.users.items():
            key = f"smtpd.auth.users.{user}"
            try:
                entry = parse_entry(secret)
            except EntryError as exc:
                raise ConfigError(config.source, key, str(exc)) from None
            if entry.plain and not auth.allow_plaintext:
                raise ConfigError(config.source, key, _PLAINTEXT_REFUSED)
            if entry.legacy:
                log.warning("%s: %s: unsalted {SHA256} digest; replace it with the output of "
                            "`sluice auth hash`", config.source, key)
        return cls(auth.users, allow_plaintext=auth.allow_plaintext)

    def __bool__(self) -> bool:
        return bool(self._entries)

    def __len__(self) -> int:
        return len(self._entries)

    def _lookup(self, user: str | bytes) -> tuple[_Entry | None, bool]:
        """The entry to check against and whether the user exists."""
        if isinstance(user, bytes):
            user = user.decode("utf-8", "surrogateescape")
        entry = self._entries.get(user)
        if entry is not None:
            return entry, True
        # Same work for an unknown user (see STRATEGIES); the answer is no.
        return next(iter(self._entries.values()), None), False

    def verify(self, user: str | bytes, password: str | bytes) -> bool:
        """Whether ``password`` is right for ``user``; blocks for a slow hash."""
        entry, known = self._lookup(user)
        if entry is None:
            return False
        if isinstance(password, str):
            password = password.encode("utf-8", "surrogateescape")
        return entry.matches(password) and known

    async def check(self, user: str | bytes, password: str | bytes) -> bool:
        """``verify`` that keeps the event loop free while a slow hash runs."""
        entry, _ = self._lookup(user)
        if entry is None or not entry.slow:
            return self.verify(user, password)
        if self._executor is None:
            self._executor = ThreadPoolExecutor(AUTH_THREADS, thread_name_prefix="smtpd-auth")
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._executor, self.verify, user, password)

    def close(self) -> None:
        """Stop the hashing threads (a check in progress finishes first)."""
        if self._executor is not None:
            self._executor.shutdown(wait=False, cancel_futures=True)
            self._executor = None


_PLAINTEXT_REFUSED = ("a plain-text password; store a hash made by `sluice auth hash` "
                      "(or set smtpd.auth.allow_plaintext: true)")
