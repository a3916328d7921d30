"""Builds the CPU matmul kernel (`specjax/models/cpu_kernels/matmul.cc`, an XLA FFI handler) with the
package. The build is optional: without a C++17 compiler or jaxlib's FFI headers the install still
succeeds, and `config.matmul = "auto"` runs XLA's matmul (`specjax.models.matmul` says why)."""

import importlib.util
import os

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext


def _ffi_include_dir() -> str:
  """jaxlib's XLA FFI headers (what `jax.ffi.include_dir()` returns), found without importing jax."""
  spec = importlib.util.find_spec("jaxlib")
  return os.path.join(spec.submodule_search_locations[0], "include") if spec else ""


class _BuildKernel(build_ext):
  """Plain C++ flags: the handlers pick AVX-512 or AVX2 paths at run time (function target attributes), so
  the library runs on any x86-64 or other CPU."""
  def build_extension(self, ext):
    if self.compiler.compiler_type == "unix":
      ext.extra_compile_args = ["-std=c++17", "-O3"]
    super().build_extension(ext)


setup(
    ext_modules=[
        Extension("specjax.models._cpu_kernels", ["specjax/models/cpu_kernels/matmul.cc"],
                  include_dirs=[_ffi_include_dir()], language="c++", optional=True)
    ],
    cmdclass={"build_ext": _BuildKernel},
)
