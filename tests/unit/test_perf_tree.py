"""bench/perf_tree.py: a perf call graph summed by function, as docs/floor.md reads it.

Made-up `perf script` output, in its format: a header line a sample, one
indented frame a line (innermost first, "ADDR SYMBOL+OFFSET (DSO)"),
a blank line after each sample.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
import perf_tree

pytestmark = pytest.mark.unit


def sample(*frames: str) -> str:
    body = "".join(f"\t    7f00{i:04x} {f}+0x1{i} (/x/lib.so)\n" for i, f in enumerate(frames))
    return "python 123/123  100.0:  2004008 cpu-clock:ppp:\n" + body + "\n"


TEXT = (
    # innermost first: the encoder under the delivery, its leaf in libpython
    sample("sre_search", "CPyDef_enc_feed", "CPyDef_deliver", "uv_run")
    + sample("stringlib_count", "CPyDef_enc_feed", "CPyDef_deliver", "uv_run")
    + sample("write", "CPyDef_session_write", "CPyDef_deliver", "uv_run")
    # recursion: the same function twice in one sample counts once
    + sample("CPyDef_deliver", "CPyDef_helper", "CPyDef_deliver", "uv_run")
    + sample("sqlite3VdbeExec", "CPyDef_commit", "start_thread")
)


def test_a_function_counts_once_a_sample_and_owns_what_it_calls_directly() -> None:
    stacks = list(perf_tree.samples(TEXT.splitlines(keepends=True)))
    assert len(stacks) == 5
    assert stacks[0] == ["sre_search", "CPyDef_enc_feed", "CPyDef_deliver", "uv_run"]
    rows = {name: (on, own) for name, on, own in perf_tree.inclusive(stacks, "CPyDef_")}
    assert rows == {"CPyDef_deliver": (4, 1), "CPyDef_enc_feed": (2, 2),
                    "CPyDef_session_write": (1, 1), "CPyDef_helper": (1, 0),
                    "CPyDef_commit": (1, 1)}


def test_under_splits_a_function_by_the_next_match_inside_else_the_leaf() -> None:
    stacks = list(perf_tree.samples(TEXT.splitlines(keepends=True)))
    assert perf_tree.under(stacks, "CPyDef_deliver", "CPyDef_") == {
        "CPyDef_enc_feed": 2, "CPyDef_session_write": 1, "CPyDef_helper": 1}
    assert perf_tree.under(stacks, "CPyDef_enc_feed", "CPyDef_") == {
        "(own) sre_search": 1, "(own) stringlib_count": 1}


def test_the_command_prints_shares_and_refuses_what_is_not_perf_output(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    good = tmp_path / "perf.txt"
    good.write_text(TEXT)
    assert perf_tree.main([str(good), "--top", "2"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0] == "5 samples"
    assert out[2].split() == ["80.0%", "20.0%", "CPyDef_deliver"]
    assert out[3].split() == ["40.0%", "40.0%", "CPyDef_enc_feed"]
    empty = tmp_path / "empty.txt"
    empty.write_text("not perf\n")
    assert perf_tree.main([str(empty)]) == 2
    assert capsys.readouterr().err.strip() == (
        f"perf_tree: no samples in {empty} (is it `perf script` output?)")
