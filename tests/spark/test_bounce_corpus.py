"""The classifier against real-world replies: accuracy, and every miss named."""

from __future__ import annotations

import pytest

from sluice.accounting import EVENT_FIELDS
from sluice.pipeline.bounces import classify_failures
from sluice.pipeline.rules import classify
from sluice.pipeline.schema import EVENT_SCHEMA
from tests.spark.bounce_corpus import CORPUS, KNOWN_MISSES
from tests.spark.frames import event

#: Required share of the corpus classified as an engineer would.
ACCURACY = 0.95


def _misses() -> dict[int, str]:
    out = {}
    for i, (_, kind, code, enhanced, text, want) in enumerate(CORPUS):
        got, _ = classify(kind, code, enhanced, text)
        if got != want:
            out[i] = str(got)
    return out


@pytest.mark.unit
def test_the_corpus_is_large_and_varied() -> None:
    assert len(CORPUS) >= 100
    assert len({source for source, *_ in CORPUS}) >= 25
    assert len({want for *_, want in CORPUS}) >= 15


@pytest.mark.unit
def test_accuracy_on_real_world_replies() -> None:
    misses = _misses()
    accuracy = 1 - len(misses) / len(CORPUS)
    shown = "\n".join(f"  [{i}] {CORPUS[i][0]}: {CORPUS[i][4][:90]!r} -> {got}, "
                      f"want {CORPUS[i][5]}" for i, got in misses.items())
    # Every miss is listed in KNOWN_MISSES with what the classifier says.
    assert misses == {i: str(c) for i, c in KNOWN_MISSES.items()}, f"misses:\n{shown}"
    assert accuracy >= ACCURACY, f"accuracy {accuracy:.3f}:\n{shown}"


@pytest.mark.spark
def test_spark_classifies_the_corpus_as_the_reference_does(spark) -> None:
    rows = [event(kind, f"r{i}@example.com", i, code=code, enhanced=enhanced, response=text)
            for i, (_, kind, code, enhanced, text, _) in enumerate(CORPUS)]
    df = spark.createDataFrame([tuple(r[f] for f in EVENT_FIELDS) for r in rows], EVENT_SCHEMA)
    for keys_max in (0, 10_000):  # the Spark expression, then the driver's table
        got = {r.recipient: r.category for r in
               classify_failures(df, driver_keys_max=keys_max).collect()}
        for i, (_, kind, code, enhanced, text, _) in enumerate(CORPUS):
            assert got[f"r{i}@example.com"] == str(classify(kind, code, enhanced, text)[0]), i
