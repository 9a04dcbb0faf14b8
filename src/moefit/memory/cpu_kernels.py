"""What the planner knows of the runtime's C kernels without building them.

The runtime multiplies and dequantizes stored (GGUF) tensors on the CPU with C kernels
(``moefit.runtime.kernels.qmatmul``: a library built into the wheel per x86-64 variant,
:data:`VARIANTS`, else compiled with a C compiler at first use). They write their
results straight into the buffers the runtime hands them and allocate nothing else, while
the torch fallback (``moefit.runtime.kernels.quant``) allocates fp32 scratch beside each tile it
dequantizes. The staging line of a plan therefore depends on which path will run; this
module answers that before torch is imported:

- the C kernels read these ggml types (:data:`CTYPES`, the codes ``qmatmul.c`` uses), rows
  a multiple of 32 values (256 for the K-quants and the IQ types but IQ4_NL);
- they are expected on a CPU device unless ``MOEFIT_NO_CKERNELS`` is set, or neither a built
  variant for this CPU (:func:`built_library`) nor a C compiler (``$CC``, else ``gcc``) on
  ``PATH`` is there (:func:`expected`). A library that is there but fails to build or load is
  reported by the engine at start (exit 2), never ignored.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Mapping
from pathlib import Path

from moefit.errors import InputError
from moefit.records import record

#: ggml type -> the C kernels' type code (``qmatmul.c``).
CTYPES: dict[str, int] = {"F32": 0, "F16": 1, "BF16": 2, "Q8_0": 3, "Q4_0": 4, "Q4_K": 5, "Q5_K": 6,
                          "Q6_K": 7, "Q4_1": 8, "Q5_0": 9, "Q5_1": 10, "IQ4_NL": 11, "MXFP4": 12,
                          "Q2_K": 13, "Q3_K": 14, "IQ4_XS": 15, "IQ2_XXS": 16, "IQ2_XS": 17, "IQ2_S": 18,
                          "IQ3_XXS": 19, "IQ3_S": 20, "IQ1_S": 21, "IQ1_M": 22}
#: the IQ types whose grids and sign tables the kernels take from the ``gguf`` package at
#: build time (``native.iq_tables_header``): read only when it is installed
GRID_TYPES = frozenset({"IQ2_XXS", "IQ2_XS", "IQ2_S", "IQ3_XXS", "IQ3_S", "IQ1_S", "IQ1_M"})
#: ggml types whose rows are made of 256-value super-blocks
SUPER_BLOCK_TYPES = frozenset({"Q4_K", "Q5_K", "Q6_K", "Q2_K", "Q3_K", "IQ4_XS"}) | GRID_TYPES
DISABLE_ENV = "MOEFIT_NO_CKERNELS"


#: The runtime's choice of path on a CPU device, by rows (shared by the runtime and the speed
#: model, :mod:`moefit.plan.speed`, so that the model prices the kernels that run):
#:
#: A dense product (``StoredMatrix.matmul``) of at most :func:`small_rows` activation rows
#: runs the C kernels on the stored blocks; more rows dequantize the matrix (C) and multiply
#: with ``torch.mm`` (oneDNN's bf16 GEMM). :data:`SMALL_ROWS` by default; where the C kernels
#: stay faster (:data:`SMALL_ROWS_BY_TYPE`): measured with a 2048 x 1024 matrix, one thread
#: (AMD EPYC, a loaded 2-core machine, 15 interleaved pairs of 3 products, the median of the
#: time ratios C / dequantize + mm): Q3_K 0.86 at 32 rows, 1.32 at 64; Q2_K 0.83 / 1.26;
#: IQ4_XS 0.86 at 64, 1.30 at 128 (low-bit super-blocks are unpacked once per 8 activation
#: rows, the dequantized matrix once per product). At two threads the C kernels were faster
#: up to 128 rows for Q3_K and IQ4_XS (0.91, 0.87). Q6_K, since its rows are unpacked once per
#: 8 activation rows too and dequantized to bf16 16 values at a time (AVX-512; the same
#: matrix, a loaded machine, 9 interleaved pairs): 0.65 at 16 rows, 0.88 at 24, 0.99 at 32,
#: 1.37 at 64 (a 512 x 1024 expert matrix: 0.65 / 0.88 / 1.03 / 1.26). Q6_K again since
#: products of 25 rows or more take ``q6k_tile`` (16 weight rows unpacked once per super-block
#: for every activation row, vpdpbusd on 16 rows at once; AVX-512): ``mf_gemm_ex`` against
#: ``mf_dequant`` to bf16 + ``torch.mm``, one thread, a loaded machine (load 5-9 on 2 cores),
#: 5-7 interleaved rounds, CPU time: a 512 x 1024 matrix 0.65 at 64 rows, 0.94 at 128; 2048 x
#: 1024 0.81 at 128, 0.98 at 512; hence 256. Q5_K, whose 25 rows or more take its twin
#: ``q5k_tile`` (the same harness, a 512 x 1024 matrix): 0.43 at 32 rows, 0.61 at 64, 0.93 at
#: 128; hence 128. IQ4_XS again since its AVX-512 VNNI kernel takes 16 weight rows per
#: unpacking (``iq4x_rows16``) and its bf16
#: dequantization no longer goes through the scalar unpacking: the dense matrices of the two
#: ``benchmarks/vs_llamacpp.py --mixes`` shapes (2048 x 1024, 1024 x 2048, 512 x 1024,
#: 4096 x 2048, 2048 x 4096, 512 x 2048), one thread, a loaded machine (load 8), 5
#: interleaved pairs: 0.82-1.05 at 256 rows, 0.95-1.25 at 512.
SMALL_ROWS = 8
SMALL_ROWS_BY_TYPE = {"Q2_K": 32, "Q3_K": 32, "IQ4_XS": 256, "Q6_K": 256, "Q5_K": 128}

#: A MoE layer (``moefit.runtime.moe.batch.run_layer``) runs the batched C kernel while its
#: experts get at most this many tokens each on average (the (token, expert) pairs over the
#: layer's experts), by the ggml type of the expert's matrices (the harmonic mean over gate,
#: up and down: :func:`tokens_per_expert`); larger chunks (prefill) run expert by expert, each
#: matrix dequantized (C) and multiplied by ``torch.mm`` (oneDNN's bf16 kernels). Measured
#: on the CI machine (AMD EPYC, one thread) with the 1.37B Qwen3-MoE-shaped files of
#: ``benchmarks/vs_llamacpp.py`` (hidden 1024, 64 experts of width 512, 8 active), one
#: chunk of 16 .. 256 tokens both ways: the batched kernel is as fast or faster up to
#: 4-6 tokens per expert for the K-quants (Q4_K_M: 84 against 124 ms at 2 per expert,
#: 193 / 191 ms at 6, 274 / 218 ms at 9), 20 for Q8_0 (434 / 492 ms at 20, 541 / 494 ms at
#: 24) and 32 or more for Q4_0 (570 / 650 ms at 32) and BF16 (639 / 644 ms at 32). Q5_K
#: takes the K-quants' figure and F16 / F32 BF16's (the same kernels, not measured apart);
#: the other types the kernels read keep the 8 of the first measurement
#: (:data:`DEFAULT_TOKENS_PER_EXPERT`). The low-bit types, since their super-blocks are
#: unpacked once per 8 tokens of an expert (``benchmarks``-style interleaved pairs of one
#: layer, hidden 1024, 64 experts of 512, 8 active, one thread, a loaded machine; time
#: ratio batched / expert by expert): Q3_K 0.68 at 32 tokens per expert, 1.07 at 64; Q2_K
#: 0.68 / 1.02; IQ4_XS 0.59 / 0.83 (hidden 2048, 32 experts of 768: 0.90 at 64); IQ2_XXS
#: 0.72 / 1.17; IQ3_XXS 0.67 at 16, 1.09 at 32; IQ1_M 0.68 / 1.18 (the other IQ types, not
#: measured, keep 8). Whole model again (``benchmarks/vs_llamacpp.py``'s 1.37B ``--mixes``
#: files, one thread, a loaded machine, 5 interleaved pairs of one prefill chunk): Q4_K_M
#: (Q4_K / Q6_K experts) batched against expert by expert 0.72 at 8 tokens per expert, 1.20
#: at 16, 1.22 at 24 (both ways 1.02 at 32: the noise), hence 8 for the K-quants (Q5_K with
#: them until ``q5k_tile``, below). Q6_K was 24 since its rows are unpacked once per 8 tokens
#: of an expert (``q6k_tok``):
#: a 512 x 1024 expert matrix, one thread, a loaded machine, C kernel against dequantize +
#: ``torch.mm`` (the crossover of :data:`SMALL_ROWS_BY_TYPE`'s measurement, not a whole-model
#: one): 0.65 at 16 tokens, 0.88 at 24, 1.03 at 32. Q2_K, Q3_K and IQ4_XS again since their
#: bf16 dequantization runs 16 values at a time (AVX-512; 0.27-0.43x its scalar time): whole
#: model, the 2048-wide ``--mixes`` files (32 experts of 768, 8 active), one thread, a
#: loaded machine (load 4-5), 7 interleaved pairs of one prefill chunk, process CPU time,
#: expert by expert against batched: IQ4_XS 1.23 at 16 tokens per expert, 0.95 at 24, 0.92
#: at 32; Q2_K (Q2_K gate / up, Q3_K down) 1.00 at 16, 0.82 at 32; Q3_K_M (Q3_K gate / up,
#: Q4_K down) 0.91 at 16; hence 16 for the three (was 64, 48, 48). Q6_K 256 since an expert's
#: 25 tokens or more take ``q6k_tile`` (see :data:`SMALL_ROWS_BY_TYPE`) and the SwiGLU's exp
#: runs 16 values at a time (the scalar ``expf`` had been a fifth of the batched layer): one
#: layer of Q6_K experts, ``mf_moe`` against expert by expert (``mf_dequant`` to bf16 +
#: ``torch.mm``), one thread, a loaded machine (load 5-9), 3-7 interleaved rounds, CPU time:
#: hidden 1024, 64 experts of 512, 0.55 at 64 tokens per expert, 0.78 at 256; hidden 2048,
#: 32 experts of 768, 0.64 at 128. Q5_K 128 since its experts' 25 tokens or more take
#: ``q5k_tile`` (the same harness): Q5_K gate / up with Q6_K down (the Q5_K_M mix's layers),
#: hidden 1024, 64 experts of 512, 0.62 at 64 tokens per expert; all Q5_K, hidden 2048, 32 of
#: 768, 0.74 at 128 (not measured further). IQ4_XS since its 16-row kernel (``iq4x_rows16``;
#: :data:`SMALL_ROWS_BY_TYPE`'s measurement, the four expert
#: matrices of the two shapes, 512 x 1024, 1024 x 512, 768 x 2048, 2048 x 768): 0.73-0.88 at
#: 128 tokens, 0.89-0.95 at 256, 0.90-1.01 at 384, the kernel against its matrix's
#: dequantization and ``torch.mm`` alone (the expert-by-expert path adds its per-expert
#: work): 256.
TOKENS_PER_EXPERT = {"Q4_K": 8, "Q5_K": 128, "Q6_K": 256, "Q8_0": 20, "Q4_0": 32,
                     "BF16": 32, "F16": 32, "F32": 32, "Q2_K": 16, "Q3_K": 16, "IQ4_XS": 256,
                     "IQ2_XXS": 48, "IQ3_XXS": 24, "IQ1_M": 24}
DEFAULT_TOKENS_PER_EXPERT = 8


def small_rows(qtype: str) -> int:
    """Activation rows up to which a dense product with a stored matrix of ``qtype`` runs
    the C kernels on a CPU device (:data:`SMALL_ROWS_BY_TYPE`, else :data:`SMALL_ROWS`);
    more rows: dequantize + ``torch.mm``."""
    return SMALL_ROWS_BY_TYPE.get(qtype, SMALL_ROWS)


def tokens_per_expert(qtypes: Iterable[str]) -> int:
    """Average tokens per expert up to which a MoE layer whose expert matrices are of
    ``qtypes`` (gate, up, down) runs the batched C kernel: the harmonic mean, rounded down,
    of their :data:`TOKENS_PER_EXPERT` (:data:`DEFAULT_TOKENS_PER_EXPERT` for a type not
    listed; the three matrices have the same number of values), so a layer of one type takes
    that type's figure; more: expert by expert, dequantize + ``torch.mm``. Not the smallest:
    a Q3_K_M layer (Q3_K gate / up, 16; Q4_K down, 8) was faster batched up to 16-24 tokens
    per expert while Q3_K's dequantization was scalar (whole model, one thread, loaded
    machine: time ratio batched / expert by expert 0.60 at 8, 0.76 at 16, 1.02 at 24, 1.26
    at 32), expert by expert at 16 since (:data:`TOKENS_PER_EXPERT`); the harmonic mean
    gives it 12, the smallest 8."""
    figures = [TOKENS_PER_EXPERT.get(t, DEFAULT_TOKENS_PER_EXPERT) for t in qtypes]
    return int(len(figures) / sum(1 / f for f in figures) + 1e-9)


def batched_pairs(pairs: float, experts: int, qtypes: Iterable[str]) -> bool:
    """Whether a step that gives a layer's ``experts`` ``pairs`` (token, expert) pairs in all
    runs them on the batched C kernel: at most :func:`tokens_per_expert` of ``qtypes`` (gate,
    up, down) per expert on average, ``pairs <= tokens_per_expert(qtypes) x experts`` (the
    runtime's test, for a layer's step and for its host misses alike)."""
    return pairs <= tokens_per_expert(qtypes) * experts


def batched_experts(tokens: int, experts_per_token: int, experts: int, qtypes: Iterable[str]) -> bool:
    """Whether a step of ``tokens`` tokens, each routed to ``experts_per_token`` of a layer's
    ``experts``, runs that layer's experts on the batched C kernel (:func:`batched_pairs` of
    its ``tokens x experts_per_token`` pairs)."""
    return batched_pairs(tokens * experts_per_token, experts, qtypes)


def row_block(qtype: str) -> int:
    """Values per row unit the C kernels need for ``qtype``: 256 for K-quants, else 32."""
    return 256 if qtype in SUPER_BLOCK_TYPES else 32


def supports(qtype: str, cols: int) -> bool:
    """Whether the C kernels read rows of ``cols`` values of ggml type ``qtype``."""
    return qtype in CTYPES and cols % row_block(qtype) == 0


def keeps_stored(qtype: str, cols: int) -> bool:
    """Whether the runtime keeps a dense GGUF matrix of ggml type ``qtype`` with rows of
    ``cols`` values in that type on a CPU device where the kernels run (:func:`expected`):
    a quantized type they read. (Float matrices become the compute dtype; the token
    embedding, looked up by row, is never a matrix kept stored.)"""
    return qtype not in ("F32", "F16", "BF16") and supports(qtype, cols)


def compiler(env: Mapping[str, str] = os.environ) -> str:
    """The C compiler the runtime builds the kernels with: ``$CC``, else ``gcc``."""
    return env.get("CC") or "gcc"


def switched_off(env: Mapping[str, str], name: str, what: str) -> bool:
    """Whether the variable ``name`` of ``env`` turns ``what`` (e.g. "the C kernels") off:
    ``1``, ``true``, ``yes`` or ``on`` (any case) do; unset, empty, ``0``, ``false``, ``no``
    and ``off`` do not. Raises InputError for another value."""
    value = env.get(name, "").strip().lower()
    if value in ("", "0", "false", "no", "off"):
        return False
    if value in ("1", "true", "yes", "on"):
        return True
    raise InputError(f"{name}={env.get(name)!r}: use 1 to run without {what}, "
                     "or 0 / unset to run with them")


def disabled(env: Mapping[str, str] = os.environ) -> bool:
    """Whether :data:`DISABLE_ENV` turns the C kernels off (:func:`switched_off`).
    Raises InputError for a value that is not a yes or a no."""
    return switched_off(env, DISABLE_ENV, "the C kernels")


# ---- the built library's x86-64 variants (setup.py builds them into the wheel) ----
@record
class Variant:
    """One build of the library for a level of x86-64: the CPU flags (``/proc/cpuinfo``
    names) it needs, and the compiler flags that turn on the kernels' ``#ifdef`` paths for
    them (``qmatmul.c``: ``__AVX2__``, ``__AVXVNNI__``, the AVX-512 set with VNNI and VBMI,
    ``__AVX512BF16__``; ``mf_floats.h``: ``__F16C__``)."""

    name: str
    cpu_flags: tuple[str, ...]
    cflags: tuple[str, ...]

    @property
    def filename(self) -> str:
        """The library's file name in :data:`LIB_DIR`."""
        return f"libmoefit_kernels-{self.name}.so"


_AVX2 = ("avx2", "fma", "f16c", "bmi2")
_AVX2_FLAGS = ("-mavx2", "-mfma", "-mf16c", "-mbmi2")
_AVX512 = (*_AVX2, "avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512_vnni", "avx512vbmi")
_AVX512_FLAGS = (*_AVX2_FLAGS, "-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq", "-mavx512vnni",
                 "-mavx512vbmi")
#: the variants, best first (as llama.cpp's CPU backend variants, ``ggml-cpu`` built per
#: micro-architecture and picked at load by the CPU's features): :func:`pick` takes the first
#: whose flags the CPU has. ``x86-64`` is the baseline (plain C, any x86-64).
VARIANTS: tuple[Variant, ...] = (
    Variant("avx512-bf16", (*_AVX512, "avx512_bf16"), ("-march=x86-64", *_AVX512_FLAGS, "-mavx512bf16")),
    Variant("avx512-vnni", _AVX512, ("-march=x86-64", *_AVX512_FLAGS)),
    Variant("avx-vnni", (*_AVX2, "avx_vnni"), ("-march=x86-64", *_AVX2_FLAGS, "-mavxvnni")),
    Variant("avx2", _AVX2, ("-march=x86-64", *_AVX2_FLAGS)),
    Variant("x86-64", (), ("-march=x86-64",)),
)
#: where the wheel holds the built variants: beside the C sources (``moefit/runtime/kernels/``)
LIB_DIR = Path(__file__).resolve().parent.parent / "runtime" / "kernels"


def cpu_flags() -> frozenset[str]:
    """This CPU's feature flags (the ``flags`` line of ``/proc/cpuinfo``; empty elsewhere)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return frozenset(line.partition(":")[2].split())
    except OSError:
        pass
    return frozenset()


def _machine() -> str:
    """This machine's architecture: ``os.uname().machine``, which is ``platform.machine()``
    on POSIX (importing ``platform`` compiles nine regular expressions, a few ms of every
    plan); ``platform.machine()`` where there is no ``os.uname`` (Windows: ``AMD64``)."""
    if hasattr(os, "uname"):
        return os.uname().machine
    import platform
    return platform.machine()


def pick(flags: Iterable[str], built: Iterable[str] | None = None, machine: str | None = None) -> Variant | None:
    """The best of :data:`VARIANTS` a CPU with ``flags`` runs, among the names in ``built``
    (default: every variant); None off x86-64 (``machine``, default this one's) or when none fits."""
    machine = (machine or _machine()).lower()
    if machine not in ("x86_64", "amd64"):
        return None
    have, names = set(flags), None if built is None else set(built)
    return next((v for v in VARIANTS if set(v.cpu_flags) <= have and (names is None or v.name in names)), None)


#: names the one built variant to load (a test or a check of one variant; its CPU flags still apply)
VARIANT_ENV = "MOEFIT_KERNEL_VARIANT"


def built_library(lib_dir: Path = LIB_DIR, env: Mapping[str, str] = os.environ) -> tuple[Variant, Path] | None:
    """The built variant this CPU runs and its file in ``lib_dir`` (None: none is there, as
    in a source checkout or an editable install, which compile at first use); only the one
    :data:`VARIANT_ENV` names when it is set."""
    only = env.get(VARIANT_ENV)
    built = [v.name for v in VARIANTS if (lib_dir / v.filename).is_file() and only in (None, "", v.name)]
    v = pick(cpu_flags(), built) if built else None
    return None if v is None else (v, lib_dir / v.filename)


#: Whether a program is on a PATH, by (program, PATH): :func:`unexpected_reason` is asked once
#: per priced plan (a failing plan's alternatives: a dozen times), and each ``shutil.which``
#: walks the PATH's directories (and importing ``shutil`` brings zlib, bz2 and lzma).
_ON_PATH: dict[tuple[str, str | None], bool] = {}


def _on_path(program: str, path: str | None) -> bool:
    """``shutil.which(program, path=path)`` found it (kept per process, :data:`_ON_PATH`)."""
    key = (program, path)
    found = _ON_PATH.get(key)
    if found is None:
        found = _ON_PATH[key] = _which(program, path)
    return found


def _which(program: str, path: str | None) -> bool:
    """``shutil.which(program, path=path) is not None`` (CPython 3.11's POSIX branch, written
    out: importing ``shutil`` imports zlib, bz2 and lzma, ~3 ms of a plan); ``shutil`` itself
    elsewhere."""
    if os.name != "posix":
        import shutil
        return shutil.which(program, path=path) is not None

    def runs(f: str) -> bool:
        return os.path.exists(f) and os.access(f, os.F_OK | os.X_OK) and not os.path.isdir(f)

    if os.path.dirname(program):
        return runs(program)
    if path is None:
        path = os.environ.get("PATH", None)
        if path is None:
            try:
                path = os.confstr("CS_PATH")
            except (AttributeError, ValueError):
                path = os.defpath
    if not path:
        return False
    seen = set()
    for d in path.split(os.pathsep):
        if d not in seen:
            seen.add(d)
            if runs(os.path.join(d, program)):
                return True
    return False


def unexpected_reason(env: Mapping[str, str] = os.environ) -> str | None:
    """Why the C kernels will not run on a CPU device (None when they are expected: a built
    variant for this CPU, or a C compiler to build them). Raises InputError for a value of
    :data:`DISABLE_ENV` that is not a yes or a no."""
    if disabled(env):
        return f"{DISABLE_ENV} is set"
    cc = compiler(env)
    if not _on_path(cc, env.get("PATH")) and built_library() is None:
        return f"no C compiler ({cc}) on PATH and no built library for this CPU"
    return None


def expected(device_kind: str, env: Mapping[str, str] = os.environ) -> bool:
    """Whether stored tensors on a device of ``device_kind`` (``cpu`` / ``cuda``) run
    through the C kernels: only on the CPU, and only when :func:`unexpected_reason` is None."""
    return device_kind == "cpu" and unexpected_reason(env) is None


# ---- the kernels' scratch (``qmatmul.c``), priced by the planner and taken by the runtime ----
def qact_bytes(k: int) -> int:
    """Scratch bytes of one quantized activation of ``k`` values (``qmatmul.c``
    ``qact_bytes``): two forms, each ``k`` int8 and ``k/16`` int16 sums, with ``k/32``
    fp32 scales and ``k/32`` fp32 scaled block sums (the K-quant form: ``k/256`` scales),
    and the first form's int8 again in the order of 4-bit blocks' nibbles."""
    return 3 * k + k // 32 * 8 + k // 16 * 4 + k // 256 * 4


def gemm_scratch_bytes(n: int, k: int) -> int:
    """Scratch of ``moefit.runtime.kernels.qmatmul.gemm`` for ``n`` rows of ``k`` values: fp32 copies and their
    quantized form."""
    return n * (4 * k + qact_bytes(k))


def moe_scratch_bytes(tokens: int, hidden: int, inter: int, pairs: int | None = None) -> int:
    """Scratch of ``moefit.runtime.kernels.qmatmul.moe`` for ``tokens`` token rows run ``pairs`` (token, expert) pairs
    at a time (default: ``tokens``): the rows converted to fp32 and quantized once
    (``[T, H]`` fp32 + quantized), then per pair the gate/up outputs ``[2I]`` fp32, the
    SwiGLU product ``[I]`` fp32 and its quantized form, and the down output ``[H]`` fp32."""
    pairs = tokens if pairs is None else pairs
    return tokens * (4 * hidden + qact_bytes(hidden)) + pairs * pair_bytes(hidden, inter)


def pair_bytes(hidden: int, inter: int) -> int:
    """Scratch of ``moefit.runtime.kernels.qmatmul.moe`` per (token, expert) pair run at once: the gate/up outputs
    ``[2I]`` fp32, the SwiGLU product ``[I]`` fp32 and its quantized form, the down output
    ``[H]`` fp32."""
    return 12 * inter + qact_bytes(inter) + 4 * hidden
