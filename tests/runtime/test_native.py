"""The kernel library as an artifact (``moefit.runtime.kernels.native``): its ABI check at load,
the prototypes against ``moefit_kernels.h``, the variant a CPU's flags pick, where the library
comes from (a built variant, the first-use build), and a wheel built and run with no compiler.
"""

from __future__ import annotations

import ctypes
import os
import re
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from moefit.memory import cpu_kernels
from moefit.runtime.kernels import lean_abi, native, qmatmul

pytestmark = pytest.mark.skipif(not qmatmul.available(), reason=f"C kernels: {qmatmul.unavailable_reason()}")

ROOT = Path(__file__).resolve().parents[2]


def _swapped(cls: type[ctypes.Structure], a: str, b: str) -> type[ctypes.Structure]:
    """A copy of ``cls`` with fields ``a`` and ``b`` in each other's place."""
    fields = list(cls._fields_)
    i, j = ([f[0] for f in fields].index(n) for n in (a, b))
    fields[i], fields[j] = fields[j], fields[i]
    return type(cls.__name__, (ctypes.Structure,), {"_fields_": fields})


def test_the_library_matches_its_python_mirror():
    assert native.abi_mismatches(qmatmul.library()) == []


@pytest.mark.parametrize("a, b", [("heads", "kvh"), ("scale", "hits")])
def test_two_swapped_fields_of_the_mirror_fail_the_abi_check(a, b, capsys):
    """Two fields of ``mf_lean_layer``'s mirror swapped (same size, then different sizes):
    the check names both; a load against that mirror refuses the library and gives no
    library (the torch path), with the reason."""
    structs = {**native.STRUCTS, "mf_lean_layer": _swapped(lean_abi.CLayer, a, b)}
    bad = native.abi_mismatches(qmatmul.library(), structs)
    assert any(f"mf_lean_layer.{a}:" in m for m in bad) and any(f"mf_lean_layer.{b}:" in m for m in bad), bad
    found = native.load(structs=structs)
    assert found.lib is None and "does not match this moefit's ABI" in found.how and bad[0] in found.how


def test_another_abi_version_is_refused(monkeypatch):
    monkeypatch.setattr(native, "ABI_VERSION", native.ABI_VERSION + 1)
    assert native.abi_mismatches(qmatmul.library()) == [
        f"ABI version {native.ABI_VERSION - 1}, this moefit reads version {native.ABI_VERSION}"]


def test_the_prototypes_are_the_headers():
    """Every function ``moefit_kernels.h`` declares is in :data:`native.PROTOTYPES` with as many
    arguments, and no other."""
    header = (native.HERE / "moefit_kernels.h").read_text()
    header = re.sub(r"/\*.*?\*/", "", header, flags=re.S)
    decls = {}
    for m in re.finditer(r"\b(mf_\w+)\(([^)]*)\);", header):
        args = m[2].strip()
        decls[m[1]] = 0 if args in ("", "void") else args.count(",") + 1
    assert decls == {name: len(argtypes) for name, (_, argtypes) in native.PROTOTYPES.items()}


# ---- the variant a CPU picks -------------------------------------------------------------
ZEN4 = "fpu sse2 avx avx2 fma f16c bmi2 avx512f avx512dq avx512bw avx512vl avx512_vnni avx512vbmi avx512_bf16"
CASCADE_LAKE = "sse2 avx avx2 fma f16c bmi2 avx512f avx512dq avx512bw avx512vl avx512_vnni"   # no VBMI
ALDER_LAKE = "sse2 avx avx2 fma f16c bmi2 avx_vnni"
HASWELL = "sse2 avx avx2 fma f16c bmi2"
OLD = "sse2 sse4_2 avx"


@pytest.mark.parametrize("flags, built, want", [
    (ZEN4, None, "avx512-bf16"),
    (ZEN4, ["avx512-vnni", "avx2", "x86-64"], "avx512-vnni"),
    (ZEN4, ["x86-64"], "x86-64"),
    (CASCADE_LAKE, None, "avx2"),            # the AVX-512 path needs VBMI (vpermi2b)
    (ALDER_LAKE, None, "avx-vnni"),
    (HASWELL, None, "avx2"),
    (OLD, None, "x86-64"),
    (OLD, ["avx2"], None),
])
def test_the_variant_a_cpu_picks(flags, built, want):
    got = cpu_kernels.pick(flags.split(), built, machine="x86_64")
    assert (got and got.name) == want


def test_no_variant_off_x86_64():
    assert cpu_kernels.pick(ZEN4.split(), machine="aarch64") is None


def test_each_variant_turns_on_what_it_needs():
    """A variant compiles with an ``-m`` flag for each CPU flag it needs (so its ``#ifdef``
    paths are on), and a better variant needs more."""
    names = {"avx2": "-mavx2", "fma": "-mfma", "f16c": "-mf16c", "bmi2": "-mbmi2", "avx_vnni": "-mavxvnni",
             "avx512_vnni": "-mavx512vnni", "avx512_bf16": "-mavx512bf16"}
    for v in cpu_kernels.VARIANTS:
        assert {names.get(f, f"-m{f}") for f in v.cpu_flags} == {f for f in v.cflags if f != "-march=x86-64"}
    assert cpu_kernels.VARIANTS[-1].cpu_flags == ()


# ---- where the library comes from ----------------------------------------------------------
def _built_dir(tmp_path: Path, name: str) -> Path:
    """A folder holding the first-use build under variant ``name``'s file name."""
    d = tmp_path / "built"
    d.mkdir()
    shutil.copy(qmatmul.library()._name, d / next(v for v in cpu_kernels.VARIANTS if v.name == name).filename)
    return d


def test_a_built_variant_is_loaded_before_any_build(tmp_path, monkeypatch):
    monkeypatch.setenv("CC", "no-such-cc")
    found = native.load(_built_dir(tmp_path, "x86-64"))
    assert found.lib is not None and found.how == "built variant x86-64" and found.path.parent == tmp_path / "built"


def test_one_variant_can_be_asked_for(tmp_path):
    lib_dir = _built_dir(tmp_path, "x86-64")
    assert cpu_kernels.built_library(lib_dir, {})[0].name == "x86-64"
    assert cpu_kernels.built_library(lib_dir, {cpu_kernels.VARIANT_ENV: "x86-64"})[0].name == "x86-64"
    assert cpu_kernels.built_library(lib_dir, {cpu_kernels.VARIANT_ENV: "avx2"}) is None
    assert cpu_kernels.built_library(lib_dir, {cpu_kernels.VARIANT_ENV: "none"}) is None


def test_edited_sources_prefer_the_first_use_build(tmp_path, monkeypatch, capsys):
    """A built variant of other sources: rebuilt (here: the first-use build already there)
    with a note saying why, or used as built, with a note, when no compiler can rebuild."""
    lib_dir = _built_dir(tmp_path, "x86-64")
    jit = native.jit_path()
    monkeypatch.setattr(native, "sources_key", lambda: "edited")
    monkeypatch.setattr(native, "jit_path", lambda: jit)
    found = native.load(lib_dir)
    assert found.how == "built at first use" and found.path == jit
    monkeypatch.setenv("CC", "no-such-cc")
    found = native.load(lib_dir)
    assert found.lib is not None and found.path.parent == lib_dir and "other sources" in found.how
    err = capsys.readouterr().err
    assert "the sources changed since the built variant x86-64 was built" in err and "no C compiler" in err


def test_the_first_use_build_says_why_once(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("MOEFIT_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(native, "compile_library", lambda out, flags, cc: shutil.copy(qmatmul.library()._name, out))
    assert native.load(tmp_path / "none").how == "built at first use"
    assert native.load(tmp_path / "none").how == "built at first use"
    notes = [l for l in capsys.readouterr().err.splitlines() if l.startswith("moefit: note:")]
    assert len(notes) == 1 and "no built variant for this CPU" in notes[0] and "-march=native" in notes[0]


def test_no_compiler_and_no_library_is_the_torch_path_said_so(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("CC", "no-such-cc")
    found = native.load(tmp_path)
    assert found.lib is None and found.how.startswith("no C compiler (no-such-cc) on PATH")
    assert cpu_kernels.unexpected_reason() == "no C compiler (no-such-cc) on PATH and no built library for this CPU"
    assert "the C kernels are off (dequantize-then-multiply)" in capsys.readouterr().err


# ---- a wheel, installed where no compiler is -----------------------------------------------
@pytest.mark.slow
@pytest.mark.process
def test_a_wheel_runs_the_c_kernels_with_no_compiler(tmp_path):
    """``pip wheel`` of a copy of the project: a platform wheel with the library variants;
    unpacked and run with ``cc`` / ``gcc`` off ``PATH`` and an empty cache, ``moefit generate``
    on a ``make-demo`` model loads the built variant this CPU picks. (Two variants are built,
    that one and the baseline, to keep the test short; ``pip wheel`` builds them all.)"""
    pick = cpu_kernels.pick(cpu_kernels.cpu_flags())
    if pick is None:
        pytest.skip("not an x86-64 machine")
    src = tmp_path / "project"
    src.mkdir()
    for name in ("setup.py", "pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, src / name)
    shutil.copytree(ROOT / "src", src / "src", ignore=shutil.ignore_patterns("__pycache__", "*.so", "*.egg-info"))
    env = {**os.environ, "MOEFIT_KERNEL_VARIANTS": f"{pick.name},x86-64"}
    r = subprocess.run([sys.executable, "-m", "pip", "wheel", ".", "--no-deps", "--no-build-isolation", "-q",
                        "-w", str(tmp_path / "dist")], cwd=src, env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr
    (wheel,) = (tmp_path / "dist").glob("*.whl")
    assert wheel.name.endswith("-py3-none-linux_x86_64.whl"), wheel.name
    names = zipfile.ZipFile(wheel).namelist()
    libs = sorted(n for n in names if n.endswith(".so"))
    assert libs == sorted(f"moefit/runtime/kernels/libmoefit_kernels-{n}.so" for n in {pick.name, "x86-64"})
    assert "moefit/runtime/kernels/moefit_kernels.h" in names
    site = tmp_path / "site"
    zipfile.ZipFile(wheel).extractall(site)

    nocc = tmp_path / "bin"                  # PATH without cc / gcc
    nocc.mkdir()
    env = {k: v for k, v in os.environ.items() if k not in ("CC", "MOEFIT_NO_CKERNELS")}
    env.update(PATH=str(nocc), PYTHONPATH=str(site), MOEFIT_CACHE_DIR=str(tmp_path / "cache"),
               MOEFIT_KERNELS_LOG="1", OMP_NUM_THREADS="1")
    assert shutil.which("gcc", path=env["PATH"]) is None and shutil.which("cc", path=env["PATH"]) is None

    def moefit(*args):
        return subprocess.run([sys.executable, "-m", "moefit", *args], env=env, capture_output=True, text=True,
                              timeout=300)

    r = moefit("make-demo", str(tmp_path / "demo"), "--family", "qwen3_moe")
    assert r.returncode == 0, r.stderr
    r = moefit("generate", str(tmp_path / "demo"), "--device", "cpu", "--vram", "1GiB", "--max-context", "4096",
               "--prompt", "Hello", "--max-tokens", "4")
    assert r.returncode == 0, r.stderr
    lib = site / "moefit" / "runtime" / "kernels" / pick.filename
    assert f"moefit: C kernels: built variant {pick.name} ({lib})" in r.stderr, r.stderr
    assert "moefit: note:" not in r.stderr
