"""The sizes of ggml's tensor types: values per block and bytes per block.

One home for the figures the planner needs to price a GGUF tensor without the ``gguf``
package (a failing plan's llama.cpp remedy, ``--gguf-type``, the CUDA kernels' types). Source:
the ``block_*`` structs of ggml's ``ggml/src/ggml-common.h`` and ``type_traits`` in
``ggml/src/ggml.c``, as the ``gguf`` package mirrors them in ``gguf.constants.GGML_QUANT_SIZES``
(tests/test_ggml_types.py checks this table against it type by type).
"""

from __future__ import annotations

import math

from moefit.errors import InputError

#: ggml type name -> (values per block, bytes per block)
BLOCKS: dict[str, tuple[int, int]] = {
    "F32": (1, 4), "F16": (1, 2), "BF16": (1, 2), "F64": (1, 8),
    "I8": (1, 1), "I16": (1, 2), "I32": (1, 4), "I64": (1, 8),
    "Q4_0": (32, 18), "Q4_1": (32, 20), "Q5_0": (32, 22), "Q5_1": (32, 24),
    "Q8_0": (32, 34), "Q8_1": (32, 40),
    "Q2_K": (256, 84), "Q3_K": (256, 110), "Q4_K": (256, 144), "Q5_K": (256, 176),
    "Q6_K": (256, 210), "Q8_K": (256, 292),
    "IQ2_XXS": (256, 66), "IQ2_XS": (256, 74), "IQ2_S": (256, 82), "IQ3_XXS": (256, 98),
    "IQ3_S": (256, 110), "IQ1_S": (256, 50), "IQ1_M": (256, 56), "IQ4_NL": (32, 18),
    "IQ4_XS": (256, 136), "TQ1_0": (256, 54), "TQ2_0": (256, 66),
    "MXFP4": (32, 17), "NVFP4": (64, 36), "Q1_0": (128, 18),
}


def block_values(kind: str) -> int:
    """Values per block of ggml type ``kind`` (e.g. ``"Q4_K"`` -> 256).

    Raises InputError for a name ggml does not have."""
    return _sizes(kind)[0]


def tensor_bytes(kind: str, ne: tuple[int, ...]) -> int:
    """Bytes of a tensor of ggml type ``kind`` and shape ``ne`` (innermost first):
    ``ggml_row_size(kind, ne[0]) x rows``, as ggml's ``ggml_nbytes`` of a contiguous tensor.

    Raises InputError for a name ggml does not have or a row that is not whole blocks."""
    values, size = _sizes(kind)
    if ne[0] % values:
        raise InputError(f"a {kind} row of {ne[0]} values is not whole blocks of {values}: "
                         "use a type whose block divides the row")
    return size * ne[0] // values * math.prod(ne[1:])


def _sizes(kind: str) -> tuple[int, int]:
    try:
        return BLOCKS[kind]
    except KeyError:
        raise InputError(f"unknown ggml type {kind!r}: use one of {', '.join(BLOCKS)}") from None
