"""run_jobs: one read and a compact cache give what separate runs give."""

from __future__ import annotations

from pathlib import Path

import pytest

from sluice.accounting import EVENT_FIELDS
from sluice.pipeline.bounces import MASKED_COLUMN
from sluice.pipeline.jobs import (
    cached_events,
    run_bounces,
    run_jobs,
    run_report,
    run_shape,
    run_suppress,
)
from sluice.pipeline.report import OUTCOME_COLUMNS, outcomes
from sluice.pipeline.schema import EVENT_SCHEMA
from tests.spark.frames import assert_df_equal, event
from tests.spark.test_cli import _run_log

pytestmark = pytest.mark.spark


def _frame(spark):
    rows = [
        event("received", "a@example.com", 0),
        event("delivered", "a@example.com", 10, queue_age_s=10.0),
        event("received", "b@example.com", 1),
        event("deferred", "b@example.com", 20, code=451, enhanced="4.7.1",
              response="<b@example.com>: greylisted for 300 seconds"),
        event("bounced", "b@example.com", 40, code=550, enhanced="5.1.1",
              response="<b@example.com>: user unknown"),
    ]
    return spark.createDataFrame([tuple(r[f] for f in EVENT_FIELDS) for r in rows], EVENT_SCHEMA)


def test_outcomes_read_only_the_outcome_columns(spark):
    df = _frame(spark)
    assert_df_equal(outcomes(df.select(*OUTCOME_COLUMNS)), outcomes(df))


def test_the_cache_keeps_what_the_jobs_read(spark):
    df = _frame(spark)
    both = {r.event: r for r in cached_events(df, ["report", "bounces"]).collect()}
    assert both["received"].sender is None and both["received"].domain == "example.com"
    assert both["delivered"].response is None and both["delivered"].queue_age_s == 10.0
    assert both["bounced"].sender == "news@shop.test"
    assert both["bounced"][MASKED_COLUMN] == "<addr>: user unknown"
    assert both["received"][MASKED_COLUMN] is None
    alone = cached_events(df, ["bounces"]).collect()
    assert sorted(r.event for r in alone) == ["bounced", "deferred"]
    shape = cached_events(df, ["shape"])
    assert MASKED_COLUMN not in shape.columns
    assert sorted(r.event for r in shape.collect()) == ["bounced", "deferred", "delivered"]


def _tables(out: Path) -> list[str]:
    return sorted(p.name for p in out.glob("*.parquet"))


def test_one_read_gives_what_separate_runs_give(spark, tmp_path):
    _run_log(tmp_path / "log")
    inputs = [str(tmp_path / "log" / "*.jsonl")]
    together, apart = tmp_path / "together", tmp_path / "apart"
    run_jobs(spark, inputs, str(together), ["report", "bounces", "suppress", "shape"],
             options={"report": {"html": False}, "suppress": {"now": 0.0}})
    run_report(spark, inputs, str(apart), html=False)
    run_bounces(spark, inputs, str(apart))
    run_suppress(spark, inputs, str(apart), now=0.0)
    run_shape(spark, inputs, str(apart))
    assert _tables(together) == _tables(apart)
    assert len(_tables(together)) == 11  # clients is the eleventh
    for name in _tables(together):
        assert_df_equal(spark.read.parquet(str(together / name)),
                        spark.read.parquet(str(apart / name)))
    for name in ("suppression.jsonl", "policy.yaml"):
        def body(path: Path) -> list[str]:
            return [line for line in path.read_text().splitlines()
                    if not line.startswith("#") and '"generated_at"' not in line]
        assert body(together / name) == body(apart / name), name
