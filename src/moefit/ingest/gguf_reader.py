"""GGUF headers read, never the tensor data: the metadata and one info record per tensor of
every shard (:func:`read_header` -> :class:`GGUFHeader`), with errors that name the file and
what is wrong with it.

A GGUF file (format spec: ggml ``docs/gguf.md``) is a header -- magic, version, tensor count,
metadata key/values, one info record per tensor (name, dims ``ne`` innermost first, ggml type,
data offset) -- then the aligned tensor data. The header is read through the ``gguf``
package's :class:`gguf.GGUFReader` (which maps the file and never touches the tensor data).

Split files (``name-00001-of-00003.gguf``, written by ``llama-gguf-split`` / ``GGUFWriter``
with ``split_max_*``): any shard names the set (:func:`shard_paths`); every shard's header is
read; the metadata comes from the first.

Speed: the stock reader walks metadata arrays one element at a time with numpy (about 20 s
for a 151k-token vocabulary), so :func:`_reader_class` skips scalar and string arrays in
one step (their contents are not needed to plan). Everything else, including validation, is
the package's own parsing.

What the headers become (the geometry, exact bytes): :mod:`moefit.ingest.gguf_header`.
Imports: the ``gguf`` package (and numpy) lazily, only when a file is read; never torch.
"""

from __future__ import annotations

import functools
import re
import struct
from pathlib import Path
from typing import Any

from moefit.errors import InputError
from moefit.ingest.inputs import read_bytes
from moefit.records import field, record

#: A shard's file name of a split GGUF model: ``<stem>-0000K-of-0000N.gguf``.
SHARD_NAME = re.compile(r"^(?P<stem>.*)-(?P<no>\d{5})-of-(?P<count>\d{5})\.gguf$", re.IGNORECASE)


@record
class GGUFTensor:
    """One tensor info record.

    ``ne``: dims innermost first, as GGUF stores them (a torch ``[out, in]`` weight is
    ``ne = (in, out)``; a stacked expert tensor ``[E, out, in]`` is ``(in, out, E)``).
    ``nbytes``: ``n_elements / block_size x type_size`` of ``ggml_type``.
    ``shard``: index of the file (0-based) holding its data; ``offset``: absolute byte
    offset of the data in that file.
    """

    name: str
    ggml_type: str
    ne: tuple[int, ...]
    n_elements: int
    nbytes: int
    shard: int
    offset: int

    @property
    def shape(self) -> tuple[int, ...]:
        """Torch order, outermost first."""
        return tuple(reversed(self.ne))


@record(frozen=False)
class GGUFHeader:
    """Metadata (first shard) and tensor infos (all shards) of a GGUF model.

    ``meta``: scalars and numeric arrays as Python values; string arrays (the tokenizer's
    vocabulary and merges) are not kept, only their length in ``array_lengths``.
    ``data_bytes``: per shard, the bytes from the start of the tensor data to the end of
    the file (tensor data plus alignment padding).
    """

    paths: list[Path]
    meta: dict[str, Any]
    tensors: dict[str, GGUFTensor]
    data_bytes: list[int]
    array_lengths: dict[str, int] = field(default_factory=dict)

    @property
    def arch(self) -> str:
        return str(self.meta.get("general.architecture", ""))

    def tensor_data_bytes(self) -> int:
        """Sum of every tensor's bytes (the file's tensor data without alignment padding)."""
        return sum(t.nbytes for t in self.tensors.values())


@functools.lru_cache(maxsize=None)
def _reader_class():
    """:class:`gguf.GGUFReader` with a fast path for metadata arrays of scalars and strings.

    The stock ``_get_field_parts`` builds one numpy view per array element; here a scalar
    array becomes one view of all its elements (``contents()`` still returns them) and a
    string array is stepped over by its length prefixes (``contents()`` returns ``[]``).
    Nested arrays fall back to the stock code.
    """
    import numpy as np
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFReader, GGUFValueType

    class HeaderReader(GGUFReader):
        def _get_field_parts(self, orig_offs, raw_type):
            if raw_type != GGUFValueType.ARRAY:
                return super()._get_field_parts(orig_offs, raw_type)
            raw_itype = self._get(orig_offs, np.uint32)
            alen = self._get(orig_offs + 4, np.uint64)
            if len(raw_itype) < 1 or len(alen) < 1:
                raise ValueError(f"metadata array at byte {orig_offs} runs past the end of the file")
            itype, n, start = GGUFValueType(int(raw_itype[0])), int(alen[0]), orig_offs + 12
            if n > len(self.data) - start:       # every element takes a byte at least
                raise _Corrupt(f"metadata array at byte {orig_offs} declares {n:,} elements, more "
                               f"than the file's {len(self.data):,} bytes can hold")
            nptype = self.gguf_scalar_to_np.get(itype)
            if nptype is not None:
                values = self._get(start, nptype, n)
                if len(values) != n:
                    raise ValueError(f"metadata array at byte {orig_offs} runs past the end of the file")
                return 12 + int(values.nbytes), [raw_itype, alen, values], [2], [GGUFValueType.ARRAY, itype]
            if itype == GGUFValueType.STRING:
                view = memoryview(self.data)
                little = np.little_endian if self.byte_order == "I" else not np.little_endian
                u64 = struct.Struct("<Q" if little else ">Q")
                off = start
                if n > (len(view) - start) // 8:   # each string takes 8 bytes at least
                    raise ValueError(f"metadata string array at byte {orig_offs} declares {n} "
                                     "strings, more than the file can hold")
                for _ in range(n):
                    (length,) = u64.unpack_from(view, off)
                    off += 8 + length
                if off > len(view):
                    raise ValueError(f"metadata string array at byte {orig_offs} runs past the end of the file")
                return off - orig_offs, [raw_itype, alen, self.data[start:off]], [], \
                    [GGUFValueType.ARRAY, GGUFValueType.STRING]
            return super()._get_field_parts(orig_offs, raw_type)

        def _build_tensors(self, start_offs, fields):
            # before the stock code builds a view of each tensor's data (a numpy reshape
            # error when the file is cut short): a zero dimension, or data past the end
            end = 0
            for f in fields:
                _, name, _, dims, raw_type, offset = f.parts
                ne = [int(d) for d in dims]
                if 0 in ne:
                    raise _Corrupt(f"tensor {bytes(name).decode('utf-8', 'replace')!r} has a zero "
                                   f"dimension (ne {ne})")
                block, size = GGML_QUANT_SIZES[GGMLQuantizationType(int(raw_type[0]))]
                numel = 1
                for d in ne:
                    numel *= d
                end = max(end, int(start_offs) + int(offset[0]) + numel * size // block)
            if end > len(self.data):
                raise _Truncated(end, len(self.data))
            return super()._build_tensors(start_offs, fields)

    return HeaderReader


class _Truncated(Exception):
    """The tensor data a GGUF header lists ends past the end of the file."""

    def __init__(self, expected: int, actual: int):
        super().__init__(f"{expected} > {actual}")
        self.expected, self.actual = expected, actual


class _Corrupt(Exception):
    """A GGUF header entry no writer produces."""


def shard_paths(path: str | Path) -> list[Path]:
    """Every file of a (possibly split) GGUF model, in shard order.

    ``x.gguf`` -> ``[x.gguf]``; ``x-0000K-of-0000N.gguf`` -> the N shards beside it.

    Errors: :class:`InputError` naming the first missing shard, or a path that does not exist.
    """
    path = Path(path).expanduser()
    m = SHARD_NAME.match(path.name)
    if m is None:
        if not path.exists():
            raise InputError(f"{path}: no such GGUF file")
        return [path]      # open_reader says what is wrong when it is not a regular file
    count = int(m["count"])
    if count < 1 or int(m["no"]) < 1 or int(m["no"]) > count:
        raise InputError(f"{path}: not a valid split GGUF name (shard {m['no']} of {m['count']})")
    paths = [path.with_name(f"{m['stem']}-{i:05d}-of-{count:05d}.gguf") for i in range(1, count + 1)]
    missing = [p.name for p in paths if not p.is_file()]
    if missing:
        raise InputError(f"{path}: split GGUF incomplete, {len(missing)} of {count} shard(s) missing "
                         f"(e.g. {missing[0]}); all shards must sit in the same directory")
    return paths


def open_reader(path: Path):
    """A header reader (memory-mapped, read-only) for one GGUF file.

    Errors: :class:`InputError` for an unreadable file, a file that is not GGUF (bad magic),
    an unsupported version, or any inconsistency the reader finds (truncated header, tensor
    data beyond the end of the file, an unknown ggml type, duplicate names).
    """
    head = read_bytes(path, "GGUF file", head=4)    # a regular file (never a FIFO), readable
    size = path.stat().st_size
    if head != b"GGUF":
        raise InputError(f"{path}: not a GGUF file (bad magic bytes)")
    if size < 24:
        raise InputError(f"{path}: truncated GGUF file ({size} bytes, shorter than a GGUF header)")
    _check_counts(path, size)
    try:
        return _reader_class()(path)
    except _Truncated as e:
        raise InputError(f"{path}: truncated GGUF file: its header lists {e.expected:,} bytes, "
                         f"the file has {e.actual:,}; download it again") from None
    except _Corrupt as e:
        raise InputError(f"{path}: corrupt GGUF header: {e}") from None
    except OSError as e:
        raise InputError(f"{path}: cannot read GGUF file ({e.strerror or e})") from e
    except Exception as e:  # noqa: BLE001 -- the reader raises ValueError, KeyError, IndexError, ...
        msg = str(e) or type(e).__name__
        raise InputError(f"{path}: corrupt or truncated GGUF header ({msg})") from e


#: The fewest bytes one metadata key/value and one tensor info record take (ggml
#: ``docs/gguf.md``): a key/value is a u64 key length, the key's bytes, a u32 type and a
#: value (a byte at least); a tensor info a u64 name length, the name's bytes, a u32
#: dimension count, a u64 per dimension (none for a scalar), a u32 type and a u64 offset.
MIN_KV_BYTES = 8 + 4 + 1
MIN_TENSOR_INFO_BYTES = 8 + 4 + 4 + 8


def _check_counts(path: Path, size: int) -> None:
    """InputError when the header's tensor count and key/value count (bytes 8-24) declare
    more records than the file's ``size`` bytes can hold: the reader walks them one by one
    first (a count of 2^60 took minutes and gigabytes before failing)."""
    head = read_bytes(path, "GGUF file", head=24)
    (version,) = struct.unpack_from("<I", head, 4)
    order = ">" if version & 0xFFFF == 0 else "<"      # a big-endian file (as the reader tells)
    tensors, kvs = struct.unpack_from(order + "QQ", head, 8)
    need = 24 + kvs * MIN_KV_BYTES + tensors * MIN_TENSOR_INFO_BYTES
    if need > size:
        raise InputError(f"{path}: truncated GGUF header (or a corrupt one): it declares {tensors:,} "
                         f"tensors and {kvs:,} metadata keys, more than a file of {size:,} bytes "
                         "can hold; download it again")


def _field_value(f) -> Any:
    """A metadata field as a Python value (string arrays are not materialised: None)."""
    from gguf import GGUFValueType

    if f.types and f.types[0] == GGUFValueType.ARRAY and f.types[-1] == GGUFValueType.STRING:
        return None
    return f.contents()


def read_header(path: str | Path) -> GGUFHeader:
    """Metadata and tensor infos of the GGUF model at ``path`` (every shard), never the data.

    Errors: :class:`InputError` (see :func:`shard_paths`, :func:`open_reader`), or a split
    whose shards disagree with ``split.count``.
    """
    paths = shard_paths(path)
    meta: dict[str, Any] = {}
    lengths: dict[str, int] = {}
    tensors: dict[str, GGUFTensor] = {}
    data_bytes: list[int] = []
    for i, p in enumerate(paths):
        r = open_reader(p)
        try:
            if i == 0:
                for key, f in r.fields.items():
                    if key.startswith("GGUF."):
                        continue
                    try:
                        meta[key] = _field_value(f)
                        if meta[key] is None:
                            lengths[key] = int(f.parts[4][0])   # key len, key, type, item type, count
                    except Exception as e:  # noqa: BLE001
                        raise InputError(f"{p}: corrupt GGUF metadata value {key!r} ({e})") from e
            split = r.fields.get("split.count")
            if split is not None and int(split.contents()) != len(paths):
                raise InputError(f"{p}: header says the model is split in {int(split.contents())} "
                                 f"file(s), found {len(paths)}; point at the first shard of a complete set")
            for t in r.tensors:
                if t.name in tensors:
                    raise InputError(f"{p}: tensor {t.name!r} appears in two shards")
                tensors[t.name] = GGUFTensor(
                    name=t.name, ggml_type=t.tensor_type.name, ne=tuple(int(d) for d in t.shape),
                    n_elements=int(t.n_elements), nbytes=int(t.n_bytes), shard=i,
                    offset=int(t.data_offset))
            data_bytes.append(len(r.data) - int(r.data_offset))
        finally:
            close_reader(r)
    if not paths or "general.architecture" not in meta:
        raise InputError(f"{paths[0]}: corrupt GGUF header (no general.architecture key)")
    return GGUFHeader(paths, meta, tensors, data_bytes, lengths)


def close_reader(reader) -> None:
    """Drop the reader's memory map now rather than at garbage collection."""
    mm = getattr(reader.data, "_mmap", None)
    reader.data = None
    reader.tensors = []
    if mm is not None:
        try:
            mm.close()
        except (BufferError, ValueError):   # views still alive: the GC closes it later
            pass
