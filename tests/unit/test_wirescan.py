"""sluice._wirescan: the C module and its Python twin give one answer, and it is the right one."""

from __future__ import annotations

import importlib.machinery
import importlib.util
import sys
from pathlib import Path
from types import ModuleType

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from sluice import _native

pytestmark = pytest.mark.unit

SRC = Path(_native.__file__).resolve().parent.parent
NAME = "sluice._wirescan"


def _load(name: str, path: Path) -> ModuleType:
    if path.suffix == ".py":
        spec = importlib.util.spec_from_file_location(name, path)
    else:
        spec = importlib.util.spec_from_file_location(
            NAME, path, loader=importlib.machinery.ExtensionFileLoader(NAME, str(path)))
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


TWIN = _load("wirescan_twin", _native.source_path(SRC, NAME))
C_BUILT = _native.current(SRC) and _native.built_path(SRC, NAME).exists()
C = _load(NAME, _native.built_path(SRC, NAME)) if C_BUILT else None


def reference(data: bytes, at_line_start: bool, col: int, limit: int) -> int:
    """clean_run by its definition, a line at a time."""
    if not data:
        return col
    if data.replace(b"\r\n", b"").count(b"\r") or data.replace(b"\r\n", b"").count(b"\n"):
        return -1  # a CR or an LF that is not part of a CRLF inside the chunk
    lines = data.split(b"\r\n")
    if at_line_start and data.startswith(b"."):
        return -1
    if any(line.startswith(b".") for line in lines[1:]):
        return -1
    lengths = [len(line) for line in lines]
    lengths[0] += col
    if limit and max(lengths) > limit:
        return -1
    return lengths[-1]


chunks = st.lists(st.sampled_from([b"a", b"b c", b".", b"\r\n", b"\r", b"\n", b"\r\n."]),
                  max_size=40).map(b"".join)
limits = st.sampled_from([0, 2, 3, 5, 8, 998])


@settings(max_examples=600)
@given(chunks, st.booleans(), st.integers(0, 12), limits)
def test_the_python_twin_answers_what_the_definition_says(
        data: bytes, at_line_start: bool, col: int, limit: int) -> None:
    assert TWIN.clean_run(data, at_line_start, col, limit) == reference(
        data, at_line_start, col, limit)


@pytest.mark.skipif(C is None, reason="no current build of the C module in this tree "
                    "(scripts/setup builds one)")
@settings(max_examples=600)
@given(chunks, st.booleans(), st.integers(0, 12), limits)
def test_the_c_module_answers_what_its_twin_does(
        data: bytes, at_line_start: bool, col: int, limit: int) -> None:
    assert C is not None
    assert C.clean_run(data, at_line_start, col, limit) == TWIN.clean_run(
        data, at_line_start, col, limit)


@settings(max_examples=400)
@given(chunks, st.integers(-3, 60))
def test_the_receivers_searches_answer_what_the_definition_says(data: bytes, start: int) -> None:
    assert TWIN.dot_line(data) == (b"\n." in data)
    at = data.find(b".\r\n", max(start, 0))
    assert TWIN.end_mark(bytearray(data), start) == (-1 if at < 0 else at + 3)


@pytest.mark.skipif(C is None, reason="no current build of the C module in this tree "
                    "(scripts/setup builds one)")
@settings(max_examples=400)
@given(chunks, st.integers(-3, 60))
def test_the_c_modules_searches_answer_what_its_twin_does(data: bytes, start: int) -> None:
    assert C is not None
    assert C.dot_line(data) == TWIN.dot_line(data)
    assert C.end_mark(bytearray(data), start) == TWIN.end_mark(bytearray(data), start)


@pytest.mark.skipif(C is None, reason="no current build of the C module in this tree")
def test_the_c_module_takes_any_buffer_and_refuses_wrong_calls() -> None:
    assert C is not None
    text = b"Subject: x\r\n\r\nbody\r\n"
    for data in (text, bytearray(text), memoryview(text)):
        assert C.clean_run(data, True, 0, 998) == 0
    assert C.clean_run(b"", True, 7, 998) == 7
    with pytest.raises(TypeError):
        C.clean_run("text", True, 0, 998)
    with pytest.raises(TypeError):
        C.clean_run(text, True, 0)
    with pytest.raises(TypeError):
        C.dot_line("text")
    with pytest.raises(TypeError):
        C.end_mark(text)
    for module in (C, TWIN):
        with pytest.raises(ValueError):
            module.clean_run(text, True, -1, 998)
        with pytest.raises(ValueError):
            module.clean_run(text, True, 0, -1)
    with pytest.raises(OverflowError):
        C.clean_run(text, True, sys.maxsize - 2, 0)
    assert C.end_mark(text, sys.maxsize) == -1 == TWIN.end_mark(text, sys.maxsize)
    assert C.end_mark(memoryview(b"a.\r\n"), 0) == 4 and C.end_mark(b".\r\n", 1) == -1


def test_the_package_runs_the_c_module_while_its_build_is_current() -> None:
    import sluice._wirescan as imported
    from sluice.delivery import encoder

    assert encoder.clean_run is imported.clean_run
    kept_out = any(isinstance(f, _native.SourcesOnly) for f in sys.meta_path)
    assert str(imported.__file__).endswith(".py") == (C is None or kept_out)
