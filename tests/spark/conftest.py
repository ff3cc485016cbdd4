"""One SparkSession for the whole Spark suite, and small-frame helpers.

The session is local[2], UI off, UTC, two shuffle partitions, loopback
only, with Spark's log at ERROR (log4j2.properties beside this file, via
SPARK_CONF_DIR) -- the settings in the project's field notes.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import pytest

HERE = Path(__file__).resolve().parent
os.environ["SPARK_CONF_DIR"] = str(HERE)
os.environ["SPARK_LOCAL_IP"] = "127.0.0.1"
os.environ.setdefault("PYSPARK_PYTHON", sys.executable)

pyspark = pytest.importorskip("pyspark", reason="the analytics extra is not installed")

from pyspark.sql import DataFrame, SparkSession  # noqa: E402

from sluice.accounting import EVENT_FIELDS  # noqa: E402
from sluice.pipeline.schema import EVENT_SCHEMA  # noqa: E402
from sluice.pipeline.session import build_session  # noqa: E402


@pytest.fixture(scope="session")
def spark() -> Iterator[SparkSession]:
    if SparkSession.getActiveSession() is not None:  # pragma: no cover
        raise RuntimeError("a SparkSession exists before the suite's own")
    session = build_session(
        "local[2]",
        app_name="sluice-tests",
        conf={
            "spark.sql.shuffle.partitions": "2",
            "spark.default.parallelism": "2",
            "spark.driver.memory": "1g",
            "spark.sql.adaptive.enabled": "true",
        },
        driver_memory="1g",
    )
    yield session
    session.stop()


@pytest.fixture
def events_df(spark: SparkSession) -> Callable[[Sequence[dict[str, Any]]], DataFrame]:
    def make(rows: Sequence[dict[str, Any]]) -> DataFrame:
        return spark.createDataFrame([tuple(r[f] for f in EVENT_FIELDS) for r in rows],
                                     EVENT_SCHEMA)
    return make
