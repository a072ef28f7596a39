"""Packaging is declared in setup.cfg; this file only adds the ahead-of-time build of the C++ extension.

    ZERO_ENGINE_BUILD_OPS=1 pip install --no-build-isolation .

compiles csrc/ at install into the per-user cache the first training run would otherwise fill (the
cache key includes the torch version, so the build needs the torch you will train with: hence
--no-build-isolation). Without the variable nothing is built here and the extension compiles just in
time on first use. `python -m engine.ops.build` does the same at any time after install.
"""

from __future__ import annotations

import os
import sys

from setuptools import setup
from setuptools.command.build_py import build_py

ENV_BUILD = "ZERO_ENGINE_BUILD_OPS"


class BuildPyWithOps(build_py):
    def run(self) -> None:
        super().run()
        if os.environ.get(ENV_BUILD, "0") not in ("1", "true", "yes"):
            return
        try:
            import torch  # noqa: F401
        except ImportError:
            raise SystemExit(
                f"{ENV_BUILD}=1: torch is not importable in the build environment; install torch "
                "first and pass --no-build-isolation to pip"
            ) from None
        sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
        from engine.ops import build

        if build.main() != 0:
            raise SystemExit(
                f"{ENV_BUILD}=1: the C++ extension did not build (reason above); unset {ENV_BUILD} "
                "to install without it (it then builds on first use, or the engine runs on its "
                "pure-torch fallbacks)"
            )


setup(cmdclass={"build_py": BuildPyWithOps})
