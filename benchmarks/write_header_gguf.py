"""Write a header-only GGUF of a model in a llama-quantize type mix (metadata and tensor infos, no data).

``moefit gguf-header MODEL OUT --type FTYPE`` (:mod:`moefit.tools.stand_in`) as a script, and
:func:`write_sparse`, which the tests use to rebuild the headers recorded by
``benchmarks/record_llamacpp.py`` (their metadata as recorded). It reproduces the README's and docs/engines.md's
llama.cpp example without the real download (``Qwen3.5-35B-A3B-Q4_K_M.gguf`` from Hugging
Face plans the same way):

    .venv/bin/python benchmarks/write_header_gguf.py Qwen3.5-35B-A3B Q4_K_M Qwen3.5-35B-A3B-Q4_K_M.gguf
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path


def write_sparse(path: Path, meta, tensors) -> Path:
    """A GGUF with ``meta`` (``(key, type, value)``) and the infos of ``tensors`` (``(name,
    ggml type, ne)``, innermost first) whose data region is a hole (``truncate``)."""
    import gguf
    import numpy as np

    arch = next(v for k, _, v in meta if k == "general.architecture")
    w = gguf.GGUFWriter(str(path), arch)
    for key, kind, value in meta:
        if key == "general.architecture":
            continue
        t = gguf.GGUFValueType[kind]
        v = value if t == gguf.GGUFValueType.STRING else (
            float(value) if t in (gguf.GGUFValueType.FLOAT32, gguf.GGUFValueType.FLOAT64) else
            (value == "True" if t == gguf.GGUFValueType.BOOL else int(value)))
        w.add_key_value(key, v, t)
    total = 0
    for name, kind, ne in tensors:
        qt = gguf.GGMLQuantizationType[kind]
        bs, ts = gguf.GGML_QUANT_SIZES[qt]
        nbytes = int(np.prod(ne)) // bs * ts
        w.add_tensor_info(name, tuple(reversed(ne)), np.dtype(np.float32), nbytes, raw_dtype=qt)
        total += -(-nbytes // 32) * 32
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    w.close()
    os.truncate(path, -(-path.stat().st_size // 32) * 32 + total)
    return path


def write_header_gguf(model: str, ftype: str, out: Path) -> Path:
    """Write ``model``'s (a preset or a config) header-only GGUF in ``ftype`` to ``out``:
    ``moefit gguf-header`` (:func:`moefit.tools.stand_in.write_stand_in`)."""
    from moefit.tools.stand_in import write_stand_in

    return write_stand_in(model, ftype, out)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model", help="a preset name, a model directory or its config.json")
    ap.add_argument("ftype", help="llama-quantize's file type, e.g. Q4_K_M")
    ap.add_argument("out", type=Path, help="the .gguf file to write")
    args = ap.parse_args(argv)
    path = write_header_gguf(args.model, args.ftype, args.out)
    print(f"wrote {path} ({path.stat().st_size / 2**30:.2f} GiB apparent, headers only)", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
