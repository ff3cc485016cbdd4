"""Every dataclass of a compiled module writes its __init__ out, and it matches the fields.

mypyc compiles the methods a class's source has, but runs the ones the
dataclass decorator generates in the interpreter: making a Reply took
1.8 µs that way and 0.2 µs with the __init__ written out (timed from
Python; sluice._native, docs/benchmarks.md).  A written __init__ is a
second statement of the fields, so this test holds each one to its
class: the same parameters in the same order, with the same annotations
and defaults (a ``default_factory`` field takes None and makes its
default), every field set once from its own parameter, and
__post_init__ called last where the class has one.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from sluice._native import MODULES
from tests.conftest import ROOT

pytestmark = pytest.mark.unit


def _dataclasses(tree: ast.Module) -> list[ast.ClassDef]:
    def is_dataclass(d: ast.expr) -> bool:
        fn = d.func if isinstance(d, ast.Call) else d
        return (isinstance(fn, ast.Name) and fn.id == "dataclass") or (
            isinstance(fn, ast.Attribute) and fn.attr == "dataclass")

    return [node for node in ast.walk(tree) if isinstance(node, ast.ClassDef)
            and any(is_dataclass(d) for d in node.decorator_list)]


def _field_args(value: ast.expr | None) -> dict[str, ast.expr] | None:
    if isinstance(value, ast.Call) and isinstance(value.func, ast.Name) \
            and value.func.id == "field":
        return {k.arg: k.value for k in value.keywords if k.arg}
    return None


def _expected(cls: ast.ClassDef) -> list[tuple[str, str, str | None, bool]]:
    """(name, annotation, default, made by a factory) of each field __init__ takes."""
    out = []
    for stmt in cls.body:
        if not (isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name)):
            continue
        ann = ast.unparse(stmt.annotation)
        if ann.startswith("ClassVar"):
            continue
        args = _field_args(stmt.value)
        if args is not None:
            init = args.get("init")
            if isinstance(init, ast.Constant) and init.value is False:
                continue
            if "default_factory" in args:
                out.append((stmt.target.id, f"{ann} | None", "None", True))
            else:
                default = args.get("default")
                out.append((stmt.target.id, ann,
                            None if default is None else ast.unparse(default), False))
        else:
            out.append((stmt.target.id, ann,
                        None if stmt.value is None else ast.unparse(stmt.value), False))
    return out


def _assigned(init: ast.FunctionDef) -> list[tuple[str, str]]:
    """(field, the value's source) of each field __init__ sets, in order."""
    out = []
    for stmt in init.body:
        if isinstance(stmt, ast.Expr) and isinstance(stmt.value, ast.Call) \
                and ast.unparse(stmt.value.func) == "object.__setattr__":
            target = stmt.value.args[1]
            assert isinstance(target, ast.Constant)
            out.append((target.value, ast.unparse(stmt.value.args[2])))
        elif isinstance(stmt, ast.Assign):
            for t in stmt.targets:
                if isinstance(t, ast.Attribute) and ast.unparse(t.value) == "self":
                    out.append((t.attr, ast.unparse(stmt.value)))
    return out


def _factory(cls: ast.ClassDef, name: str) -> str:
    for stmt in cls.body:
        if isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name) \
                and stmt.target.id == name:
            args = _field_args(stmt.value)
            assert args is not None
            made = ast.unparse(args["default_factory"]) + "()"
            return {"list()": "[]", "dict()": "{}"}.get(made, made)
    raise AssertionError(name)


CLASSES = [(module, cls) for module in MODULES
           for cls in _dataclasses(ast.parse(
               (ROOT / "src" / Path(*module.split("."))).with_suffix(".py").read_text()))]


def test_the_compiled_modules_have_dataclasses_to_check() -> None:
    assert len(CLASSES) >= 20
    assert ("sluice.model", "QueueEntry") in {(m, c.name) for m, c in CLASSES}


@pytest.mark.parametrize(("module", "cls"), CLASSES, ids=[f"{m}.{c.name}" for m, c in CLASSES])
def test_a_compiled_dataclass_writes_out_an_init_that_matches_its_fields(
        module: str, cls: ast.ClassDef) -> None:
    inits = [f for f in cls.body if isinstance(f, ast.FunctionDef) and f.name == "__init__"]
    assert inits, f"{module}.{cls.name}: no __init__ written out (mypyc would interpret one)"
    init = inits[0]
    params = init.args.args[1:]
    defaults = [None] * (len(params) - len(init.args.defaults)) + list(init.args.defaults)
    got = [(p.arg, ast.unparse(p.annotation) if p.annotation else "",
            None if d is None else ast.unparse(d)) for p, d in zip(params, defaults, strict=True)]
    want = _expected(cls)
    assert got == [(name, ann, default) for name, ann, default, _ in want]
    assert not init.args.kwonlyargs and init.args.vararg is None and init.args.kwarg is None
    # Each field from its own parameter; a factory's when the parameter is None.
    assert _assigned(init) == [
        (name, f"{_factory(cls, name)} if {name} is None else {name}" if made else name)
        for name, _, _, made in want]
    has_post_init = any(isinstance(f, ast.FunctionDef) and f.name == "__post_init__"
                        for f in cls.body)
    calls_it = ast.unparse(init.body[-1]) == "self.__post_init__()"
    assert calls_it == has_post_init
