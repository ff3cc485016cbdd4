"""Bearer tokens: who is calling, or 401.

SUMMARY
    Tokens(config.api.named_tokens).who(authorization_header) -> name | None

DESCRIPTION
    ``api.tokens`` is a list of tokens or a mapping of name to token; the
    name of the token a request carries is who the audit history records.
    The header is ``Authorization: Bearer <token>`` (RFC 6750).

STRATEGIES
    Constant time.  The presented token is compared with every configured
    token by hmac.compare_digest, and the loop never stops early, so the
    time a request takes says nothing about how much of a token matched
    or which one.  Both sides are hashed first (SHA-256) so tokens of
    different lengths compare in the same time too.

LIMITATIONS
    Tokens are read at start; changing them needs a restart.  There is
    one scope: reading a message's body needs a token named in
    api.body_tokens (sluice.api.console checks it); otherwise any token
    may do anything the API offers.
"""

from __future__ import annotations

import hashlib
import hmac
from collections.abc import Iterable

__all__ = ["Tokens"]


def _digest(token: str) -> bytes:
    return hashlib.sha256(token.encode("utf-8", "surrogateescape")).digest()


class Tokens:
    """The configured tokens, by digest, with their names."""

    def __init__(self, named: Iterable[tuple[str, str]]) -> None:
        self._tokens = [(name, _digest(token)) for name, token in named]

    def __len__(self) -> int:
        return len(self._tokens)

    def who(self, authorization: str | None) -> str | None:
        """The name of the token in an Authorization header, or None."""
        if not authorization:
            return None
        scheme, _, credentials = authorization.strip().partition(" ")
        if scheme.lower() != "bearer" or not credentials.strip():
            return None
        given = _digest(credentials.strip())
        found: str | None = None
        for name, digest in self._tokens:
            if hmac.compare_digest(given, digest) and found is None:
                found = name
        return found
