"""Build Sluice: the package, with its hot modules compiled by mypyc where it can.

STRATEGY
    pyproject.toml says everything but the extension modules.  These come
    from src/sluice/_native.py's MODULES, compiled as one mypyc group, and
    its C_MODULES, small modules written in C beside their Python twins, when
    mypyc and Sluice's dependencies are importable here (mypyc type-checks
    the code against them): scripts/setup installs the package first, then
    builds it again with `--no-build-isolation`.  A build without mypyc (an
    isolated build that only has setuptools) or with SLUICE_NATIVE=0 is
    pure Python and works the same, slower.  Every build first removes an
    earlier in-place one (our extension modules and manifest, nothing
    else).  After compiling, the manifest (the modules, the interpreter's
    suffix, the hash and the stat of every source) goes to
    src/sluice/_native.json, which `import sluice` checks (see
    _native.py): an edit after the build runs the pure modules again.
"""

from __future__ import annotations

import importlib.util
import json
import os
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext

ROOT = Path(__file__).resolve().parent
SRC = ROOT / "src"
#: The commands that build extension modules; metadata queries compile nothing.
BUILDING = {"build", "build_ext", "bdist_wheel", "editable_wheel", "develop", "install"}
#: The manifest of the sources handed to mypyc, written once the build is done.
_MANIFEST: dict[str, Any] = {}


def _native_module() -> ModuleType:
    """src/sluice/_native.py, loaded alone (importing sluice would run its guard)."""
    spec = importlib.util.spec_from_file_location("_sluice_native", SRC / "sluice" / "_native.py")
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


NATIVE = _native_module()


def _clean() -> None:
    """Remove an earlier in-place build: its manifest and its extension modules, ours only."""
    old = NATIVE.recorded(SRC) or {}
    names = NATIVE.kept_out(SRC)  # today's list and the last build's, read before the unlink
    suffixes = {NATIVE.SUFFIX, old.get("suffix") or NATIVE.SUFFIX}
    (SRC / "sluice" / NATIVE.MANIFEST).unlink(missing_ok=True)
    for suffix in suffixes:
        (SRC / f"sluice__mypyc{suffix}").unlink(missing_ok=True)
        for name in names:
            NATIVE.built_path(SRC, name, suffix).unlink(missing_ok=True)


def extensions() -> list[Any]:
    """The mypyc group, or none for a pure-Python build."""
    if not BUILDING.intersection(sys.argv[1:]):
        return []
    _clean()
    try:
        from mypyc.build import mypycify
    except ImportError:
        mypycify = None
    if os.environ.get(NATIVE.SWITCH) == "0" or mypycify is None:
        why = "SLUICE_NATIVE=0" if mypycify else "mypyc is not installed here"
        print(f"setup: {why}, a pure-Python build", file=sys.stderr)
        return []
    os.chdir(ROOT)
    _MANIFEST.update(NATIVE.manifest_of(SRC))  # the sources as mypyc is about to read them
    paths = [str(NATIVE.source_path(Path("src"), name)) for name in NATIVE.MODULES]
    hand_written = [Extension(name, [str(NATIVE.c_source_path(Path("src"), name))],
                              extra_compile_args=["-O2"])
                    for name in NATIVE.C_MODULES]
    return [*mypycify(paths, opt_level="3", group_name="sluice"), *hand_written]


class BuildNative(build_ext):
    """build_ext, then the manifest of what it compiled: only a finished build gets one."""

    def run(self) -> None:
        """Compile, then write the manifest in the wheel's copy, and in the tree if in place."""
        super().run()
        if not self.extensions:
            return
        text = json.dumps(_MANIFEST, indent=1) + "\n"
        packages = [Path(self.build_lib) / "sluice"]
        if self.inplace or getattr(self, "editable_mode", False):
            packages.append(SRC / "sluice")
        for package in packages:
            if package.is_dir():
                (package / NATIVE.MANIFEST).write_text(text)


setup(ext_modules=extensions(), cmdclass={"build_ext": BuildNative})
