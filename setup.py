"""Build Sluice: the package, with its hot modules compiled by mypyc where it can.

STRATEGY
    pyproject.toml says everything but the extension modules.  These come
    from src/sluice/_native.py's MODULES, compiled as one mypyc group, when
    mypyc and Sluice's dependencies are importable here (mypyc type-checks
    the code against them): scripts/setup installs the package first, then
    builds it again with `--no-build-isolation`.  A build without mypyc (an
    isolated build that only has setuptools) or with SLUICE_NATIVE=0 is
    pure Python and works the same, slower.  After compiling, the sources'
    hashes go to src/sluice/_native.json, which `import sluice` checks
    (see _native.py): an edit after the build runs the pure modules again.
"""

from __future__ import annotations

import importlib.util
import json
import os
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

from setuptools import setup
from setuptools.command.build_ext import build_ext

ROOT = Path(__file__).resolve().parent
SRC = ROOT / "src"
#: The commands that build extension modules; metadata queries compile nothing.
BUILDING = {"build", "build_ext", "bdist_wheel", "editable_wheel", "develop", "install"}
#: The manifest of the sources handed to mypyc, written once the build is done.
_HASHES: dict[str, Any] = {}


def _native_module() -> ModuleType:
    """src/sluice/_native.py, loaded alone (importing sluice would run its guard)."""
    spec = importlib.util.spec_from_file_location("_sluice_native", SRC / "sluice" / "_native.py")
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def extensions() -> list[Any]:
    """The mypyc group, or none for a pure-Python build."""
    native = _native_module()
    if not BUILDING.intersection(sys.argv[1:]):
        return []
    (SRC / "sluice" / native.MANIFEST).unlink(missing_ok=True)
    try:
        from mypyc.build import mypycify
    except ImportError:
        mypycify = None
    if os.environ.get(native.SWITCH) == "0" or mypycify is None:
        why = "SLUICE_NATIVE=0" if mypycify else "mypyc is not installed here"
        print(f"setup: {why}, a pure-Python build", file=sys.stderr)
        for built in [*SRC.glob("sluice__mypyc.*"), *(SRC / "sluice").rglob("*.so")]:
            built.unlink()  # an earlier in-place build's, which the sources no longer match
        return []
    os.chdir(ROOT)
    _HASHES.update(native.manifest_of(SRC))  # what is compiled, read before mypyc reads it
    paths = [str(native.source_path(Path("src"), name)) for name in native.MODULES]
    return list(mypycify(paths, opt_level="3", group_name="sluice"))


class BuildNative(build_ext):
    """build_ext, then the manifest of what it compiled: only a finished build gets one."""

    def run(self) -> None:
        """Compile, then write the manifest in the tree and in the wheel's copy."""
        super().run()
        if not self.extensions:
            return
        native = _native_module()
        text = json.dumps(_HASHES, indent=1) + "\n"
        for package in {SRC / "sluice", Path(self.build_lib) / "sluice"}:
            if package.is_dir():
                (package / native.MANIFEST).write_text(text)


setup(ext_modules=extensions(), cmdclass={"build_ext": BuildNative})
