"""petrel's C kernels, compiled when petrel is installed (`pip install .`, `pip install -e .`): everything else
about the package is in pyproject.toml.

The kernels are plain C loaded with ctypes, not a Python extension module: the one extension here is built by
petrel/model/kernel_build.py (the same compiler, flags and sources as the first-use build that native.py falls back
on) into petrel/model/_kernels<EXT_SUFFIX>. The extension is optional: with no C compiler, or not on x86-64, the
install goes on without it and petrel runs its torch paths (native.py logs a WARNING naming what is lost)."""

from __future__ import annotations

import importlib.util
import os

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext
from setuptools.errors import CompileError


def _kernel_build():
    """petrel/model/kernel_build.py, loaded by path (importing petrel would import torch, absent at build time)."""
    path = os.path.join(os.path.dirname(os.path.abspath(__file__)), "petrel", "model", "kernel_build.py")
    spec = importlib.util.spec_from_file_location("petrel_kernel_build", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


kernel_build = _kernel_build()


class BuildKernels(build_ext):
    """build_ext whose one extension, the kernels' library, is compiled by kernel_build (optional: a failure is
    reported and the install goes on)."""

    def build_extension(self, ext: Extension) -> None:
        output = self.get_ext_fullpath(ext.name)
        try:
            kernel_build.build(output)
        except kernel_build.BuildError as exc:
            raise CompileError(
                f"petrel's C kernels were not built ({exc}); petrel will build them on first use "
                "where a compiler is found, or run with torch (slower)"
            ) from exc


setup(
    ext_modules=[
        Extension(
            kernel_build.INSTALLED_NAME,
            sources=[os.path.join("petrel", "model", name) for name in kernel_build.SOURCES if name.endswith(".c")],
            depends=[os.path.join("petrel", "model", name) for name in kernel_build.SOURCES],
            optional=True,
        )
    ],
    cmdclass={"build_ext": BuildKernels},
)
