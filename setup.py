"""The build hook: the C kernel library compiled into the wheel, one file per x86-64 variant.

Everything else is in pyproject.toml. ``build_ext`` compiles ``src/moefit/runtime/kernels``'s
library once per variant of :data:`moefit.memory.cpu_kernels.VARIANTS` (in parallel) into the
package, where the loader picks the best one the CPU runs (:mod:`moefit.runtime.kernels.native`);
the wheel is therefore a platform wheel (``py3-none-<platform>``: the library does not link
Python). ``MOEFIT_KERNEL_VARIANTS`` (comma-separated names) builds only those, ``none`` none.
An editable install (``pip install -e .``) builds none: the sources compile at first use there,
so an edited C file is picked up. Without a compiler, or off x86-64, the wheel holds no library
and the kernels compile at first use (or, with no compiler there either, the torch path runs).
"""

import os
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from setuptools import Distribution, setup
from setuptools.command.bdist_wheel import bdist_wheel
from setuptools.command.build_ext import build_ext

sys.dont_write_bytecode = True          # no __pycache__ left in src/ by the imports below
sys.path.insert(0, str(Path(__file__).resolve().parent / "src"))
from moefit.memory import cpu_kernels  # noqa: E402  (torch-free: the variant table)
from moefit.runtime.kernels import native  # noqa: E402  (torch-free: the compile command)

VARIANTS_ENV = "MOEFIT_KERNEL_VARIANTS"


def _say(message: str) -> None:
    print(f"moefit build: {message}", file=sys.stderr, flush=True)


class BuildKernels(build_ext):
    """Compile the library variants into the build tree (``moefit/runtime/kernels/``)."""

    def run(self) -> None:
        if getattr(self, "editable_mode", False) or self.inplace:
            _say("editable install: the C kernels compile at first use")
            return
        known = {v.name for v in cpu_kernels.VARIANTS}
        wanted = {w.strip() for w in os.environ.get(VARIANTS_ENV, "").split(",") if w.strip()} or known
        if wanted - known - {"none"}:
            raise SystemExit(f"{VARIANTS_ENV}: unknown {sorted(wanted - known - {'none'})}; "
                             f"use none or some of {', '.join(sorted(known))}")
        variants = [v for v in cpu_kernels.VARIANTS if v.name in wanted]
        if not variants or cpu_kernels.pick((), ["x86-64"]) is None:
            _say(f"no variant to build (off x86-64, or {VARIANTS_ENV}=none): the kernels compile at first use")
            return
        cc = cpu_kernels.compiler()
        out = Path(self.build_lib) / "moefit" / "runtime" / "kernels"

        def one(v):
            try:
                native.compile_library(out / v.filename, v.cflags, cc)
                return v.name, None
            except OSError as e:
                return v.name, str(e)

        with ThreadPoolExecutor(max_workers=os.cpu_count() or 1) as pool:
            for name, err in pool.map(one, variants):
                _say(f"variant {name}: " + (f"not built ({err})" if err else "built"))


class BinaryDistribution(Distribution):
    """A distribution with compiled files: a platform wheel."""

    def has_ext_modules(self) -> bool:
        return True


class Wheel(bdist_wheel):
    """``py3-none-<platform>``: the library is loaded with ctypes and links no Python."""

    def get_tag(self):
        _, _, plat = super().get_tag()
        return "py3", "none", plat


setup(distclass=BinaryDistribution, cmdclass={"build_ext": BuildKernels, "bdist_wheel": Wheel})
