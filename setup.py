"""The build's one step beyond ``pyproject.toml``: writing ``lightning_gravac.lightning``'s generated modules.

They are written from the package's sources by ``lightning_gravac/_mirror.py`` (its docstring says why): into the
wheel's build directory, and into the source tree for an editable install, whose modules are imported from there.
"""

import importlib.util
from pathlib import Path

from setuptools import setup
from setuptools.command.build_py import build_py

_PACKAGE = Path(__file__).resolve().parent / "lightning_gravac"


class BuildPyWithMirror(build_py):
    """``build_py`` that also writes the generated modules of ``lightning_gravac.lightning``."""

    def run(self) -> None:
        super().run()
        # The generator is loaded by path: importing ``lightning_gravac`` would need torch, absent from the build.
        spec = importlib.util.spec_from_file_location("_mirror", _PACKAGE / "_mirror.py")
        assert spec is not None and spec.loader is not None
        mirror = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(mirror)
        into = None if self.editable_mode else Path(self.build_lib) / "lightning_gravac" / mirror.MIRROR
        mirror.Mirror(_PACKAGE).write(into)


setup(cmdclass={"build_py": BuildPyWithMirror})
