"""The store flavours every conformance test runs against.

A flavour is added here once (FLAVOURS plus a branch in ``flavour_sections``);
the whole contract in test_store_contract.py, the life cycle, the property
test and the crash test then run against it.  The postgres flavour gets a
schema of its own per queue directory on the tests' server (tests/integration/pg.py).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from sluice.config import Config
from sluice.store import Store, open_store
from tests.conftest import make_config

FLAVOURS: list[str] = ["sqlite", "fs", "postgres", "kv"]


def flavour_sections(flavour: str, tmp: Path) -> dict[str, dict[str, Any]]:
    """Config sections that select ``flavour`` with its state under ``tmp``."""
    if flavour == "postgres":
        from tests.integration.pg import dsn_for

        return {"queue": {"store": "postgres", "postgres": {"dsn": dsn_for(tmp)}}}
    return {"queue": {"store": flavour}}


def flavour_config(flavour: str, tmp: Path, **sections: dict[str, Any]) -> Config:
    merged = flavour_sections(flavour, tmp)
    for name, values in sections.items():
        base = merged.setdefault(name, {})
        for key, value in values.items():
            if isinstance(value, dict) and isinstance(base.get(key), dict):
                base[key] = {**base[key], **value}
            else:
                base[key] = value
    return make_config(tmp, **merged)


def open_flavour(flavour: str, tmp: Path, **sections: dict[str, Any]) -> Store:
    return open_store(flavour_config(flavour, tmp, **sections))
