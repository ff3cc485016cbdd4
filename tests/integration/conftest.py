from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from sluice.store import Store
from tests.integration.stores import FLAVOURS, open_flavour


@pytest.fixture(params=FLAVOURS)
def flavour(request: pytest.FixtureRequest) -> str:
    return str(request.param)


@pytest.fixture
def store(flavour: str, tmp_path: Path) -> Iterator[Store]:
    s = open_flavour(flavour, tmp_path)
    yield s
    s.close()
