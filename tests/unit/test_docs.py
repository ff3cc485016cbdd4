"""The documentation keeps up with the code: every setting is documented."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from sluice.config import config_schema

pytestmark = pytest.mark.unit

DOCS = Path(__file__).resolve().parents[2] / "docs"

#: Sections of the configuration and the documents that describe them.
SECTION_DOCS = {
    "queue": "configuration.md",
    "accounting": "configuration.md",
    "bounce": "configuration.md",
    "node": "configuration.md",
    "delivery": "delivery.md",
    "api": "api.md",
    "scheduler": "scheduler.md",
    "analytics": "analytics.md",
    "suppression": "analytics.md",
    "smtpd": "smtpd.md",
    "cluster": "cluster.md",
    "logging": "observability.md",
}


def keys(schema: dict[str, Any], prefix: str = "") -> Iterator[str]:
    for name, sub in schema.get("properties", {}).items():
        path = f"{prefix}{name}"
        if sub.get("type") == "object" and "properties" in sub:
            yield from keys(sub, path + ".")
        else:
            yield path


@pytest.mark.parametrize("section", sorted(SECTION_DOCS))
def test_every_setting_is_documented(section: str) -> None:
    text = (DOCS / SECTION_DOCS[section]).read_text()
    schema = config_schema()["properties"][section]
    missing = [k for k in keys(schema)
               if f"`{k}`" not in text and f"`{section}.{k}`" not in text]
    assert not missing, f"{SECTION_DOCS[section]} does not describe {section}: {missing}"
