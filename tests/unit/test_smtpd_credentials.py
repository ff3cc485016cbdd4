"""AUTH credentials: each Dovecot scheme checks, plain text is refused, slow checks go off-loop."""

from __future__ import annotations

import asyncio
import base64
import hashlib
import logging
from pathlib import Path

import argon2
import bcrypt
import pytest

from sluice.config import ConfigError
from sluice.smtpd.credentials import HASH_SCHEMES, Credentials, hash_password
from tests.conftest import make_config

# Cheap costs keep the suite fast; the scheme strings are the ones
# Dovecot and `sluice auth hash` write, only with smaller numbers in them.
_CHEAP_ARGON2 = {"time_cost": 1, "memory_cost": 1024, "parallelism": 1}


def cheap(scheme: str, password: str) -> str:
    if scheme == "ARGON2ID":
        return "{ARGON2ID}" + argon2.PasswordHasher(type=argon2.Type.ID, **_CHEAP_ARGON2
                                                    ).hash(password)
    if scheme == "ARGON2I":
        return "{ARGON2I}" + argon2.PasswordHasher(type=argon2.Type.I, **_CHEAP_ARGON2
                                                   ).hash(password)
    if scheme == "BLF-CRYPT":
        # Dovecot writes $2y$; the same hash under that name
        made = bcrypt.hashpw(password.encode(), bcrypt.gensalt(rounds=4)).decode()
        return "{BLF-CRYPT}$2y$" + made[4:]
    digest = hashlib.sha256(password.encode()).digest()
    if scheme == "SHA256":
        return "{SHA256}" + base64.b64encode(digest).decode()
    if scheme == "SHA256.HEX":
        return "{sha256}" + digest.hex()  # the spelling of older Sluice files
    raise AssertionError(scheme)


SCHEMES = ("ARGON2ID", "ARGON2I", "BLF-CRYPT", "SHA256", "SHA256.HEX")


@pytest.mark.parametrize("scheme", SCHEMES)
def test_each_scheme_checks_the_password(scheme: str) -> None:
    creds = Credentials({"alice": cheap(scheme, "s3cret"), "bob": cheap(scheme, "hunter2")})
    assert len(creds) == 2
    assert creds.verify("alice", "s3cret")
    assert creds.verify(b"bob", b"hunter2")
    assert not creds.verify("alice", "hunter2")  # another user's password
    assert not creds.verify("alice", "s3cret ")
    assert not creds.verify("alice", "")
    assert not creds.verify("carol", "s3cret")  # unknown user, checked all the same
    assert not creds.verify("alice", cheap(scheme, "s3cret")[len(scheme) + 2:])


def test_plain_text_only_when_allowed(tmp_path: Path) -> None:
    for secret in ("s3cret", "{PLAIN}s3cret", "{plain}s3cret"):
        cfg = make_config(tmp_path, smtpd={"auth": {"users": {"alice": secret}}})
        with pytest.raises(ConfigError) as err:
            Credentials.from_config(cfg)
        assert err.value.keypath == "smtpd.auth.users.alice"
        assert "plain-text password" in str(err.value)
        assert str(err.value).startswith(cfg.source)
        allowed = make_config(tmp_path, smtpd={"auth": {"users": {"alice": secret},
                                                        "allow_plaintext": True}})
        creds = Credentials.from_config(allowed)
        assert creds.verify("alice", "s3cret")
        assert not creds.verify("alice", secret) or secret == "s3cret"
    with pytest.raises(ValueError, match="plain-text"):
        Credentials({"alice": "s3cret"})


def test_legacy_sha256_is_accepted_with_a_warning(tmp_path: Path,
                                                  caplog: pytest.LogCaptureFixture) -> None:
    cfg = make_config(tmp_path, smtpd={"auth": {"users": {"bob": cheap("SHA256", "x"),
                                                          "eve": cheap("ARGON2ID", "y")}}})
    with caplog.at_level(logging.WARNING, logger="sluice.smtpd.credentials"):
        creds = Credentials.from_config(cfg)
    assert creds.verify("bob", "x")
    (record,) = caplog.records
    assert "smtpd.auth.users.bob" in record.getMessage()
    assert "unsalted" in record.getMessage()


@pytest.mark.parametrize(("secret", "why"), [
    ("{sha256}abc", "SHA-256 digest"),
    ("{SHA256.HEX}" + "A" * 44, "SHA-256 digest"),
    ("{ARGON2ID}$argon2i$v=19$m=1024,t=1,p=1$c2FsdHNhbHQ$aGFzaGhhc2hoYXNoaGFzaA",
     "$argon2id$"),
    ("{ARGON2I}$argon2i$v=19$m=1024,t=1", "not a valid argon2i"),
    ("{BLF-CRYPT}$2y$05$short", "bcrypt"),
    ("{SSHA512}abc", "unknown password scheme {SSHA512}"),
])
def test_bad_entry_names_the_user(tmp_path: Path, secret: str, why: str) -> None:
    cfg = make_config(tmp_path, smtpd={"auth": {"users": {"bob": secret},
                                                "allow_plaintext": True}})
    with pytest.raises(ConfigError) as err:
        Credentials.from_config(cfg)
    assert err.value.keypath == "smtpd.auth.users.bob"
    assert why in str(err.value)


def test_no_users() -> None:
    creds = Credentials()
    assert not creds
    assert not creds.verify("", "")


#: One hash at the default (production) cost, shared by the tests below.
SLOW = hash_password("hunter2")


@pytest.mark.parametrize("scheme", HASH_SCHEMES)
def test_hash_password_makes_salted_entries_that_check(scheme: str) -> None:
    made = SLOW if scheme == "ARGON2ID" else hash_password("hunter2", scheme)
    assert made.startswith("{" + scheme + "}")
    assert hash_password("hunter2", scheme.lower()) != made  # a fresh salt each time
    creds = Credentials({"bob": made})
    assert creds.verify("bob", "hunter2")
    assert not creds.verify("bob", "hunter3")


def test_bcrypt_refuses_to_hash_what_it_would_cut() -> None:
    with pytest.raises(ValueError, match="72 bytes"):
        hash_password("x" * 73, "BLF-CRYPT")


def test_slow_check_runs_off_the_event_loop() -> None:
    creds = Credentials({"bob": SLOW})

    async def main() -> tuple[bool, bool, int]:
        ticks = 0
        done = False

        async def ticker() -> None:
            nonlocal ticks
            while not done:
                ticks += 1
                await asyncio.sleep(0)

        task = asyncio.create_task(ticker())
        await asyncio.sleep(0)
        before = ticks
        right, wrong = await asyncio.gather(creds.check("bob", "hunter2"),
                                            creds.check("nobody", "hunter2"))
        done = True
        await task
        return right, wrong, ticks - before

    try:
        right, wrong, ticks = asyncio.run(main())
    finally:
        creds.close()
    assert (right, wrong) == (True, False)
    # An inline check would hold the loop for the whole hash: no ticks.
    assert ticks > 10
