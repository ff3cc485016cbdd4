"""The store flavours every conformance test runs against.

A flavour is added here once (FLAVOURS plus a branch in ``flavour_config``);
the whole contract in test_store_contract.py and the crash test then run
against it.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from sluice.config import Config
from sluice.store import Store, open_store
from tests.conftest import make_config

FLAVOURS: list[str] = ["sqlite", "fs", "kv"]


def flavour_sections(flavour: str, tmp: Path) -> dict[str, dict[str, Any]]:
    """Config sections that select ``flavour`` with its state under ``tmp``."""
    return {"queue": {"store": flavour}}


def flavour_config(flavour: str, tmp: Path, **sections: dict[str, Any]) -> Config:
    merged = flavour_sections(flavour, tmp)
    for name, values in sections.items():
        merged.setdefault(name, {}).update(values)
    return make_config(tmp, **merged)


def open_flavour(flavour: str, tmp: Path, **sections: dict[str, Any]) -> Store:
    return open_store(flavour_config(flavour, tmp, **sections))
