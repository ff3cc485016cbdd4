"""Helpers for the Spark tests: event rows and DataFrame comparison."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from typing import Any

from pyspark.sql import DataFrame
from pyspark.testing import assertDataFrameEqual

from sluice.accounting import EVENT_FIELDS

T0 = datetime(2026, 11, 20, 10, 0, 0, tzinfo=UTC)


def assert_df_equal(actual: DataFrame | list[Any], expected: DataFrame | list[Any],
                    **kwargs: Any) -> None:
    """assertDataFrameEqual for Spark frames (pyspark.testing)."""
    __tracebackhide__ = True
    assertDataFrameEqual(actual, expected, **kwargs)


def event(kind: str, recipient: str = "bob@example.com", at: float = 0.0,
          **fields: Any) -> dict[str, Any]:
    """One event row (EVENT_SCHEMA) ``at`` seconds after T0."""
    row: dict[str, Any] = dict.fromkeys(EVENT_FIELDS)
    row.update({
        "time": T0 + timedelta(seconds=at),
        "event": kind,
        "node": "n1",
        "qid": "0000000A-0",
        "spid": "0000000A",
        "sender": "news@shop.test",
        "recipient": recipient,
        "domain": recipient.rpartition("@")[2].lower(),
        "tenantid": "t1",
        "jobid": "j1",
        "transportid": "",
        "localip": "192.0.2.1",
        "attempt": 0 if kind == "received" else 1,
        "size": 1000,
        "is_report": False,
    })
    if kind in ("delivered", "deferred", "bounced"):
        row.update({"remotemx": "mx1.example.com", "remoteip": "203.0.113.5",
                    "duration_s": 0.5})
    if kind == "delivered":
        row.update({"code": 250, "enhanced": "2.0.0", "response": "OK"})
    row.update(fields)
    return row




def shape(schema: Any) -> list[tuple[str, str]]:
    """A schema's column names and types, nullability aside."""
    return [(f.name, f.dataType.simpleString()) for f in schema.fields]
