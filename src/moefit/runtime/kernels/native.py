"""The kernel library: which build to load, the first-use build, and the ABI check at load.

The library is ``qmatmul.c`` + ``decode_step.c`` + ``abi.c`` (interface: ``moefit_kernels.h``).
Where it comes from, in order (:func:`load`):

1. A **built variant** from the wheel: ``setup.py`` compiles one library per x86-64 level of
   :data:`moefit.memory.cpu_kernels.VARIANTS` into the package (beside the sources), and the
   loader takes the best one this CPU's flags run (:func:`moefit.memory.cpu_kernels.pick`), as
   llama.cpp picks its CPU backend variant. Used when its ABI check passes and it was built from
   the sources beside it (``mf_sources``; edited sources are rebuilt by 2 while a compiler is
   there, and used as built, with a note, when none is).
2. The **first-use build** (the JIT): ``$CC`` (else ``gcc``) ``-O3 -march=native -fopenmp``
   into ``$MOEFIT_CACHE_DIR`` (default ``~/.cache/moefit``), named by a hash of the sources,
   the flags and the CPU's flags (about 10 s on a loaded 2-core machine, once); the build
   prints one ``moefit: note:`` line saying why it runs (no built variant for this CPU,
   sources changed since the build).
3. Neither: :func:`load` gives no library and a reason, and the runtime keeps its torch path
   (dequantize, then ``torch.mm``), saying so once when no compiler is the cause.

The ABI check (:func:`abi_mismatches`): the library's ``mf_abi_version`` must equal
:data:`ABI_VERSION`, and each structure's ``sizeof`` and each field's offset and size
(``mf_abi_fields``) must equal those of its ctypes mirror (:data:`STRUCTS`); a library that
differs is refused with the first differences named, as a failed build is. The prototypes are
declared from one table, :data:`PROTOTYPES`.

``MOEFIT_KERNELS_LOG=1`` prints which library was loaded, and from where, to stderr.
No torch here (``setup.py`` builds the variants with :func:`compile_library`; the IQ grid
tables come from the ``gguf`` package when it is installed, else those types are not built).
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import platform
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

from moefit.memory import cpu_kernels
from moefit.outputs import remove_stale_temporaries, temp_prefix
from moefit.runtime.kernels.lean_abi import CLayer, CMat, CStep

HERE = Path(__file__).resolve().parent
#: the library's sources and the headers they include (all part of :func:`sources_key`)
SOURCES = (HERE / "qmatmul.c", HERE / "decode_step.c", HERE / "abi.c")
HEADERS = (HERE / "moefit_kernels.h", HERE / "mf_floats.h")
#: the flags of every build; the first-use build adds ``-march=native``, a variant its own
COMMON_FLAGS = ("-O3", "-ffp-contract=off", "-fopenmp", "-shared", "-fPIC")
JIT_FLAGS = ("-march=native",)
LOG_ENV = "MOEFIT_KERNELS_LOG"
#: ``MF_ABI_VERSION`` of ``moefit_kernels.h`` that :data:`PROTOTYPES` and :data:`STRUCTS` mirror
ABI_VERSION = 2
#: the C structures, by their C name, and their ctypes mirrors (:mod:`.lean_abi`)
STRUCTS: dict[str, type[ctypes.Structure]] = {"mf_mat": CMat, "mf_lean_layer": CLayer, "mf_lean_step": CStep}

_i, _i64, _p, _f = ctypes.c_int, ctypes.c_int64, ctypes.c_void_p, ctypes.c_float


class AbiField(ctypes.Structure):
    """``mf_abi_field`` of ``moefit_kernels.h``: a field's offset and size by name."""

    _fields_ = [("type", ctypes.c_char_p), ("field", ctypes.c_char_p), ("offset", _i64), ("size", _i64)]


#: every exported function of ``moefit_kernels.h``: name -> (result type, argument types)
PROTOTYPES: dict[str, tuple[object, list]] = {
    "mf_abi_version": (_i, []),
    "mf_abi_fields": (ctypes.POINTER(AbiField), [ctypes.POINTER(_i)]),
    "mf_sources": (ctypes.c_char_p, []),
    "mf_row_bytes": (_i64, [_i, _i]),
    "mf_qact_bytes": (_i64, [_i]),
    "mf_quantize_act": (None, [_p, _i, _p]),
    "mf_gemm_ex": (None, [_i, _p, _i, _i, _p, _i, _i, _p, _i, _p, _p, _i]),
    "mf_gemm": (None, [_i, _p, _i, _i, _p, _i, _i, _p, _p, _i]),
    "mf_moe": (None, [_i, _p, _p, _p, _p, _p, _i, _p, _i, _i, _i, _i, _i, _i, _i64, _i64, _p, _i, _i]),
    "mf_dequant": (None, [_i, _p, _i64, _i, _p, _p, _i]),
    "mf_simd": (_i, []),
    "mf_iq_tables": (_i, []),
    "mf_rmsnorm": (None, [_i, _i, _p, _p, _i, _p, _i, _f, _f, _p]),
    "mf_rope_table": (None, [_i, _i, _p, _f, _p, _i, _p, _p]),
    "mf_rope_kv": (None, [_i, _p, _i, _p, _i, _p, _i, _i, _i, _p, _p, _p, _p, _i, _p, _p, _i, _i, _i, _i, _i,
                          _p, _i64]),
    "mf_attn_decode": (None, [_i, _p, _i, _i, _i, _i, _f, _p, _p, _i, _i, _i, _i, _p, _p, _i, _i, _i, _p, _i,
                              _p, _i64]),
    "mf_route": (None, [_i, _i, _i, _p, _i, _i, _p, _p, _p, _p, _p, _p, _p]),
    "mf_lean_layers": (None, [_i, _p, _p]),
}


@dataclass(frozen=True)
class Loaded:
    """What :func:`load` found: the library (None: the torch path), how it was obtained
    (``built variant avx2`` / ``built at first use`` ...) or why there is none, and its file."""

    lib: ctypes.CDLL | None
    how: str
    path: Path | None = None


def _c_array(ctype: str, name: str, values, per_line: int = 8) -> str:
    vals = [str(v) for v in values]
    lines = [", ".join(vals[i:i + per_line]) for i in range(0, len(vals), per_line)]
    return f"static const {ctype} {name} = {{\n    " + ",\n    ".join(lines) + "\n};\n"


@functools.lru_cache(maxsize=1)
def iq_tables_header() -> str | None:
    """The C header of the IQ types' grids and sign tables (``mf_iq_tables.h``, included by
    ``qmatmul.c`` when ``MF_IQ_TABLES`` is 1), generated from the ``gguf`` package's own
    tables (``gguf/quants.py``: ``IQ2_XXS.ksigns`` and each type's ``grid``, ports of
    ggml-common.h's ``ksigns_iq2xs``, ``iq2xxs_grid``, ``iq2xs_grid``, ``iq2s_grid``,
    ``iq3xxs_grid``, ``iq3s_grid``, ``iq1s_grid``) rather than retyped: each grid row packed
    little-endian (byte ``j`` = value ``j``: IQ2 rows of 8 bytes, IQ3 rows of 4, IQ1 rows of
    8 int8 in -1..1, and as ``MF_IQ1S_GRID8`` the same rows times 8, packed), and ``MF_SIGN_MASK[b]``: byte ``j`` 0xff where bit ``j`` of ``b`` is
    set. None when ``gguf`` is not installed (the grid types are then not built; no GGUF file
    is read without it)."""
    try:
        import numpy as np
        from gguf import quants
    except ImportError:
        return None

    def rows(cls) -> "np.ndarray":
        cls.init_grid()
        return np.asarray(cls.grid, dtype=np.float32).reshape(cls.grid_shape)

    def packed(cls) -> list[str]:
        g = rows(cls).astype(np.uint64)
        word = sum(g[:, j] << np.uint64(8 * j) for j in range(g.shape[1]))
        suffix = "ull" if g.shape[1] == 8 else "u"
        return [f"0x{int(w):x}{suffix}" for w in word]

    ksigns = np.frombuffer(quants.IQ2_XXS.ksigns, dtype=np.uint8)
    masks = [sum((0xFF << (8 * j)) for j in range(8) if b >> j & 1) for b in range(256)]
    iq1 = rows(quants.IQ1_S).astype(np.int8)
    return ("/* generated by moefit.runtime.kernels.native.iq_tables_header from the gguf package's tables */\n"
            + _c_array("uint8_t", "MF_KSIGNS[128]", ksigns.tolist(), 16)
            + _c_array("uint64_t", "MF_SIGN_MASK[256]", [f"0x{m:x}ull" for m in masks], 4)
            + _c_array("uint64_t", "MF_IQ2XXS_GRID[256]", packed(quants.IQ2_XXS), 4)
            + _c_array("uint64_t", "MF_IQ2XS_GRID[512]", packed(quants.IQ2_XS), 4)
            + _c_array("uint64_t", "MF_IQ2S_GRID[1024]", packed(quants.IQ2_S), 4)
            + _c_array("uint32_t", "MF_IQ3XXS_GRID[256]", packed(quants.IQ3_XXS), 8)
            + _c_array("uint32_t", "MF_IQ3S_GRID[512]", packed(quants.IQ3_S), 8)
            + _c_array("uint64_t", "MF_IQ1S_GRID8[2048]",
                       [f"0x{int(w):x}ull" for w in (iq1.astype(np.int64) * 8 & 0xFF).astype(np.uint64)
                        @ (np.uint64(1) << (np.arange(8, dtype=np.uint64) * np.uint64(8)))], 4)
            + "static const int8_t MF_IQ1S_GRID[2048][8] = {\n"
            + ",\n".join("    {" + ", ".join(map(str, r)) + "}" for r in iq1.tolist()) + "\n};\n")


def sources_key() -> str:
    """A hash of the library's sources and headers (16 hex digits): a built library says the
    one it was built from (``mf_sources``)."""
    return hashlib.sha256(b"".join(p.read_bytes() for p in (*SOURCES, *HEADERS))).hexdigest()[:16]


def compile_library(out: Path, flags: tuple[str, ...], cc: str | None = None) -> None:
    """Compile the library into ``out`` with ``cc`` (default :func:`cpu_kernels.compiler`) and
    ``flags`` (a variant's, or :data:`JIT_FLAGS`) after :data:`COMMON_FLAGS`, with the IQ grid
    tables when the ``gguf`` package is there (:func:`iq_tables_header`), atomically (a
    temporary file in ``out``'s folder, then renamed: concurrent builders each write their own).
    Raises OSError when the compiler fails or is missing."""
    cc = cc or cpu_kernels.compiler()
    out.parent.mkdir(parents=True, exist_ok=True)
    remove_stale_temporaries(out.parent)      # half-built libraries of killed builders
    fd, tmp = tempfile.mkstemp(prefix=temp_prefix("qmatmul"), suffix=".so", dir=out.parent)
    os.close(fd)
    tables = iq_tables_header()
    inc = tempfile.mkdtemp(dir=out.parent)
    if tables is not None:
        Path(inc, "mf_iq_tables.h").write_text(tables)
    try:
        cmd = [cc, *COMMON_FLAGS, *flags, f'-DMF_SOURCES="{sources_key()}"', f"-DMF_IQ_TABLES={int(tables is not None)}",
               f"-I{inc}", "-o", tmp, *map(str, SOURCES), "-lm"]
        r = subprocess.run(cmd, capture_output=True, text=True)
        if r.returncode:
            raise OSError(f"{cc} failed: {r.stderr.strip()[-500:]}")
        os.replace(tmp, out)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
        shutil.rmtree(inc, ignore_errors=True)


def declare(lib: ctypes.CDLL) -> ctypes.CDLL:
    """Set every function's result and argument types from :data:`PROTOTYPES`; returns ``lib``.
    Raises AttributeError when the library lacks one."""
    for name, (restype, argtypes) in PROTOTYPES.items():
        fn = getattr(lib, name)
        fn.restype, fn.argtypes = restype, argtypes
    return lib


def abi_mismatches(lib: ctypes.CDLL, structs: dict[str, type[ctypes.Structure]] | None = None) -> list[str]:
    """How the library's ABI differs from the Python mirror (empty: it matches): its
    ``mf_abi_version`` against :data:`ABI_VERSION`, then for each structure of ``structs``
    (default :data:`STRUCTS`) its size and each field's offset and size, by name, both ways."""
    structs = STRUCTS if structs is None else structs
    version = lib.mf_abi_version()
    if version != ABI_VERSION:
        return [f"ABI version {version}, this moefit reads version {ABI_VERSION}"]
    n = _i()
    table = lib.mf_abi_fields(ctypes.byref(n))
    c = {(table[j].type.decode(), table[j].field.decode()): (table[j].offset, table[j].size) for j in range(n.value)}
    out = []
    for sname, cls in structs.items():
        if (sname, "") not in c:
            out.append(f"{sname}: not in the library")
            continue
        if c[sname, ""][1] != ctypes.sizeof(cls):
            out.append(f"{sname}: {c[sname, ''][1]} bytes in C, {ctypes.sizeof(cls)} in Python")
        names = [f[0] for f in cls._fields_]
        for fname in names:
            desc = getattr(cls, fname)
            if (sname, fname) not in c:
                out.append(f"{sname}.{fname}: not in the C structure")
            elif c[sname, fname] != (desc.offset, desc.size):
                off, size = c[sname, fname]
                out.append(f"{sname}.{fname}: offset {off} size {size} in C, offset {desc.offset} size "
                           f"{desc.size} in Python")
        out += [f"{sname}.{f}: not in the Python mirror" for (s, f) in c if s == sname and f and f not in names]
    return out


def _open(path: Path, structs) -> ctypes.CDLL:
    """``path`` loaded, declared and ABI-checked; raises OSError naming the differences."""
    lib = ctypes.CDLL(str(path))
    try:
        declare(lib)
    except AttributeError as e:
        raise OSError(f"{path} lacks a function of moefit_kernels.h ({e})") from None
    bad = abi_mismatches(lib, structs)
    if bad:
        raise OSError(f"{path} does not match this moefit's ABI ({'; '.join(bad[:4])}"
                      f"{'; ...' if len(bad) > 4 else ''}); refused")
    return lib


def jit_path(cache: Path | None = None) -> Path:
    """The first-use build's file: in ``cache`` (default ``$MOEFIT_CACHE_DIR``, else
    ``~/.cache/moefit``), named by the sources, flags, CPU flags, machine and IQ tables."""
    cpu = " ".join(sorted(cpu_kernels.cpu_flags())) or platform.processor()
    key = hashlib.sha256((sources_key() + " ".join((*COMMON_FLAGS, *JIT_FLAGS)) + cpu + platform.machine()
                          + (iq_tables_header() or "")).encode()).hexdigest()[:16]
    cache = cache or Path(os.environ.get("MOEFIT_CACHE_DIR") or Path.home() / ".cache" / "moefit")
    return cache / f"qmatmul-{key}.so"


def note(message: str) -> None:
    """One ``moefit: note:`` line on stderr."""
    print(f"moefit: note: {message}", file=sys.stderr, flush=True)


def load(lib_dir: Path | None = None, structs: dict[str, type[ctypes.Structure]] | None = None) -> Loaded:
    """Find, build if need be, load and check the library (the order of the module's docstring).

    Args:
        lib_dir: where built variants are looked for (default
            :data:`moefit.memory.cpu_kernels.LIB_DIR`).
        structs: the ctypes mirror to check against (default :data:`STRUCTS`; a test passes a
            damaged one).

    Returns a :class:`Loaded`; never raises for a missing or refused library (its ``how`` says
    why). Raises InputError for a bad ``MOEFIT_NO_CKERNELS``."""
    if cpu_kernels.disabled():
        return Loaded(None, f"{cpu_kernels.DISABLE_ENV} is set")
    built = cpu_kernels.built_library(lib_dir or cpu_kernels.LIB_DIR)
    stale = None                         # a built variant of other sources, used when nothing rebuilds it
    if built is None:
        why = "no built variant for this CPU (a source checkout, an editable install or another machine)"
    else:
        variant, path = built
        try:
            lib = _open(path, structs)
        except OSError as e:
            why = f"the built variant {variant.name} was refused: {e}"
        else:
            if lib.mf_sources().decode() == sources_key():
                return Loaded(lib, f"built variant {variant.name}", path)
            stale = Loaded(lib, f"built variant {variant.name} (built from other sources than those beside it)", path)
            why = f"the sources changed since the built variant {variant.name} was built"
    cc = cpu_kernels.compiler()
    if shutil.which(cc) is None:
        if stale is not None:
            note(f"{why}; no C compiler ({cc}) on PATH to rebuild them: using the built variant")
            return stale
        note(f"no C compiler ({cc}) on PATH and {why}: the C kernels are off (dequantize-then-multiply)")
        return Loaded(None, f"no C compiler ({cc}) on PATH and {why}")
    so = jit_path()
    try:
        if not so.is_file():
            note(f"{why}: building the C kernels with {cc} -march=native into {so.parent} (once)")
            compile_library(so, JIT_FLAGS, cc)
        return Loaded(_open(so, structs), "built at first use", so)
    except OSError as e:
        return Loaded(None, f"the C kernels could not be built or loaded ({e}); using dequantize-then-multiply")


def log(found: Loaded) -> None:
    """With ``MOEFIT_KERNELS_LOG`` set (non-empty, not 0), one stderr line: the library
    loaded and how, or why none."""
    if os.environ.get(LOG_ENV, "") not in ("", "0"):
        where = f" ({found.path})" if found.path else ""
        print(f"moefit: C kernels: {found.how}{where}" if found.lib else f"moefit: C kernels: off: {found.how}",
              file=sys.stderr, flush=True)
