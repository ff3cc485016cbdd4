"""The Spark session's Python workers run the CLI's interpreter unless the operator chose."""

from __future__ import annotations

import os
import sys

import pytest

from sluice.pipeline.session import python_workers

pytestmark = pytest.mark.unit


def test_workers_run_this_interpreter_by_default(monkeypatch: pytest.MonkeyPatch) -> None:
    # Spark's default, python3 from the PATH, has no Sluice outside the venv;
    # a local master's workers take the interpreter from the environment.
    monkeypatch.delenv("PYSPARK_PYTHON", raising=False)
    assert python_workers({}) == {"spark.pyspark.python": sys.executable}
    assert os.environ["PYSPARK_PYTHON"] == sys.executable


def test_the_operators_choice_wins(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("PYSPARK_PYTHON", raising=False)
    assert python_workers({"spark.pyspark.python": "/opt/py/bin/python3"}) == {}
    assert os.environ["PYSPARK_PYTHON"] == "/opt/py/bin/python3"
    monkeypatch.setenv("PYSPARK_PYTHON", "/srv/py/bin/python3")
    assert python_workers({}) == {"spark.pyspark.python": "/srv/py/bin/python3"}
