"""The serving processes space their young collections apart (sluice._gc)."""

from __future__ import annotations

import argparse
import gc
from collections.abc import Iterator
from typing import Any

import pytest

from sluice import _gc
from sluice.config import Config

pytestmark = pytest.mark.unit


@pytest.fixture(autouse=True)
def thresholds() -> Iterator[tuple[int, int, int]]:
    saved = gc.get_threshold()
    gc.set_threshold(700, 10, 10)
    yield saved
    gc.set_threshold(*saved)


def test_for_serving_raises_only_the_young_threshold() -> None:
    gc.set_threshold(700, 7, 9)
    _gc.for_serving()
    assert gc.get_threshold() == (_gc.YOUNG, 7, 9)
    assert _gc.YOUNG > 700


def test_serve_and_each_receiving_process_run_with_it(monkeypatch: pytest.MonkeyPatch) -> None:
    import sluice.runtime.serve as serve_mod
    from sluice.cli.serve_cmds import cmd_serve
    from sluice.smtpd import worker

    seen: dict[str, int] = {}

    def fake_serve(config: Config, **_: Any) -> int:
        seen["serve"] = gc.get_threshold()[0]
        return 0

    def fake_receiver(*_: Any, **__: Any) -> int:
        seen["receiver"] = gc.get_threshold()[0]
        return 0

    monkeypatch.setattr(serve_mod, "serve", fake_serve)
    args = argparse.Namespace(log_level=None, _config=Config())
    assert cmd_serve(args) == 0
    gc.set_threshold(700, 10, 10)
    monkeypatch.setattr(worker, "run_receiver_process", fake_receiver)
    monkeypatch.setattr(worker.signal, "signal", lambda *a: None)
    with pytest.raises(SystemExit) as stop:
        worker._process_main(Config(), None, 1, 1, [])
    assert stop.value.code == 0
    assert seen == {"serve": _gc.YOUNG, "receiver": _gc.YOUNG}
