"""The one GGUF header reader: metadata, tensor table and the ggml type sizes. Standard library only.

Runs on the hosts in three ways: Ansible modules import it as ``ansible.module_utils.gguf``
(``ansible.cfg`` lists ``rigctl/hostside`` under ``module_utils``; the models role's manifest and the
llama_server role's VRAM preflight), and jobs ship it (the bench task's model shape). Its tests check it
against the gguf package's own reader.
"""

from __future__ import annotations

import os
import struct
from typing import Any, BinaryIO, NamedTuple

#: ggml type id -> (name, elements per block, bytes per block), as in gguf-py's GGML_QUANT_SIZES of the
#: pinned llama.cpp tree (b11434).
_QK_K = 256
GGML_TYPES = {
    0: ("F32", 1, 4), 1: ("F16", 1, 2), 2: ("Q4_0", 32, 18), 3: ("Q4_1", 32, 20),
    6: ("Q5_0", 32, 22), 7: ("Q5_1", 32, 24), 8: ("Q8_0", 32, 34), 9: ("Q8_1", 32, 36),
    10: ("Q2_K", 256, 4 + _QK_K // 16 + _QK_K // 4), 11: ("Q3_K", 256, 2 + _QK_K // 4 + _QK_K // 8 + 12),
    12: ("Q4_K", 256, 4 + _QK_K // 2 + 12), 13: ("Q5_K", 256, 4 + _QK_K // 2 + _QK_K // 8 + 12),
    14: ("Q6_K", 256, 2 + _QK_K // 2 + _QK_K // 4 + _QK_K // 16), 15: ("Q8_K", 256, 4 + _QK_K + _QK_K // 8),
    16: ("IQ2_XXS", 256, 2 + _QK_K // 4), 17: ("IQ2_XS", 256, 2 + _QK_K // 4 + _QK_K // 32),
    18: ("IQ3_XXS", 256, 2 + _QK_K // 4 + _QK_K // 8), 19: ("IQ1_S", 256, 2 + _QK_K // 8 + _QK_K // 16),
    20: ("IQ4_NL", 32, 18), 21: ("IQ3_S", 256, 2 + _QK_K // 4 + _QK_K // 8 + _QK_K // 32 + 4),
    22: ("IQ2_S", 256, 2 + _QK_K // 4 + _QK_K // 16), 23: ("IQ4_XS", 256, 4 + _QK_K // 2 + _QK_K // 64),
    24: ("I8", 1, 1), 25: ("I16", 1, 2), 26: ("I32", 1, 4), 27: ("I64", 1, 8), 28: ("F64", 1, 8),
    29: ("IQ1_M", 256, _QK_K // 8 + _QK_K // 16 + _QK_K // 32), 30: ("BF16", 1, 2),
    34: ("TQ1_0", 256, 2 + 4 * 13), 35: ("TQ2_0", 256, 2 + 64), 39: ("MXFP4", 32, 17),
    40: ("NVFP4", 64, 36), 41: ("Q1_0", 128, 18), 42: ("Q2_0", 64, 18),
}
#: GGUF metadata value types: struct format of the scalars; 8 string, 9 array.
_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
_STRING, _ARRAY = 8, 9
_LENGTH = struct.Struct("<Q")
VERSIONS = (2, 3)

# A header's length fields are the file's word, and the file may be anyone's (a model repository, a
# mirror): every one is checked against these bounds before it is acted on, so a hostile header costs
# at most MAX_VALUES reads and MAX_KEPT bytes, then is refused.
#: Arrays longer than this (vocabularies, merges, token scores) are skipped; only their length is kept.
MAX_ARRAY = 4096
#: Strings longer than this are skipped and kept as ``{"length": n}``, so no file-sized string reaches a
#: manifest or a run record; a key or tensor name longer is refused.
MAX_STRING = 1024
#: Arrays nested deeper than this are refused: no model's metadata nests arrays at all.
MAX_DEPTH = 3
#: Metadata entries, tensors and array items read one by one, in all: the largest vocabularies and merge
#: lists are well under a million; the time a header may take is bounded by this.
MAX_VALUES = 1 << 22
#: Bytes of strings and numbers kept in the returned header, in all.
MAX_KEPT = 16 << 20
#: Dimensions of a tensor (ggml's GGML_MAX_DIMS).
MAX_DIMS = 4


class GGUFError(Exception):
    """Not a GGUF file this reader understands, or one cut short: the only error the reader raises."""


class Tensor(NamedTuple):
    name: str
    type: str  # ggml type name: Q4_0, F32, ...
    offset: int  # from the start of the tensor data
    bytes: int


class _Reader:
    def __init__(self, handle: BinaryIO, size: int):
        self.handle = handle
        self.size = size
        self.values = 0  # read one by one so far (MAX_VALUES)
        self.kept = 0  # bytes kept so far (MAX_KEPT)

    def take(self, n: int) -> bytes:
        data = self.handle.read(n)
        if len(data) != n:
            raise GGUFError(f"truncated at byte {self.handle.tell()} (file has {self.size})")
        return data

    def skip(self, n: int) -> None:
        """Past ``n`` bytes, refused when they run past the end (a count times an item size can be any
        64-bit number, more than a seek takes)."""
        if n > self.size - self.handle.tell():
            raise GGUFError(f"truncated at byte {self.size} ({n} bytes claimed at byte {self.handle.tell()})")
        self.handle.seek(n, os.SEEK_CUR)

    def count(self, n: int, what: str) -> None:
        self.values += n
        if self.values > MAX_VALUES:
            raise GGUFError(f"{what}: more than {MAX_VALUES} values in the header")

    def keep(self, n: int) -> None:
        self.kept += n
        if self.kept > MAX_KEPT:
            raise GGUFError(f"more than {MAX_KEPT} bytes of metadata")

    def scalar(self, fmt: str) -> Any:
        return struct.unpack(fmt, self.take(struct.calcsize(fmt)))[0]

    def name(self, what: str) -> str:
        """A key or a tensor name: refused when longer than :data:`MAX_STRING`."""
        n = self.scalar("<Q")
        if n > MAX_STRING:
            raise GGUFError(f"{what} of {n} bytes at byte {self.handle.tell() - 8} (at most {MAX_STRING})")
        self.keep(n)
        return self.take(n).decode("utf-8", errors="replace")

    def string(self) -> str | dict[str, int]:
        n = self.scalar("<Q")
        if n > MAX_STRING:
            self.skip(n)
            return {"length": n}
        self.keep(n)
        return self.take(n).decode("utf-8", errors="replace")

    def skip_strings(self, count: int) -> None:
        """Past ``count`` length-prefixed strings, reading only their lengths: a vocabulary's 100k tokens
        and merges in a fifth of the time decoding them takes."""
        read, seek, length = self.handle.read, self.handle.seek, _LENGTH.unpack
        for _ in range(count):
            prefix = read(8)
            if len(prefix) != 8:
                raise GGUFError(f"truncated at byte {self.handle.tell()} (file has {self.size})")
            (n,) = length(prefix)
            if n > self.size:
                raise GGUFError(f"string length {n} past the end of the file")
            seek(n, os.SEEK_CUR)
        if self.handle.tell() > self.size:
            raise GGUFError(f"truncated at byte {self.size} (an array of strings runs past the end)")

    def array_head(self, depth: int) -> tuple[int, int]:
        """An array's element type and count, checked: nesting within :data:`MAX_DEPTH`, the count within
        :data:`MAX_VALUES` unless its items can be skipped in one seek."""
        if depth >= MAX_DEPTH:
            raise GGUFError(f"arrays nested deeper than {MAX_DEPTH} at byte {self.handle.tell()}")
        etype, count = self.scalar("<I"), self.scalar("<Q")
        if etype not in _SCALARS and etype not in (_STRING, _ARRAY):
            raise GGUFError(f"unknown metadata value type {etype}")
        if etype not in _SCALARS:
            self.count(count, f"an array of {count} items")
        return etype, count

    def skip_items(self, etype: int, count: int, depth: int) -> None:
        if etype in _SCALARS:
            self.skip(struct.calcsize(_SCALARS[etype]) * count)
        elif etype == _STRING:
            self.skip_strings(count)
        else:
            for _ in range(count):
                self.skip_items(*self.array_head(depth), depth + 1)

    def value(self, vtype: int, depth: int = 0) -> Any:
        if vtype in _SCALARS:
            self.keep(8)
            return self.scalar(_SCALARS[vtype])
        if vtype == _STRING:
            return self.string()
        if vtype == _ARRAY:
            etype, count = self.array_head(depth)
            if count > MAX_ARRAY:
                self.skip_items(etype, count, depth + 1)
                return {"length": count}
            if etype in _SCALARS:
                self.count(count, f"an array of {count} items")
            return [self.value(etype, depth + 1) for _ in range(count)]
        raise GGUFError(f"unknown metadata value type {vtype}")


def read_header(path: str, *, tensors: bool = True) -> dict[str, Any]:
    """``version``, ``meta`` (scalars, strings of up to :data:`MAX_STRING` bytes and arrays of up to
    :data:`MAX_ARRAY` items; a longer one as ``{"length": n}``), ``tensor_count``, ``kv_count``, ``size``
    and, with ``tensors``, the tensor table (:class:`Tensor` each) and ``data_start`` (where the aligned
    tensor data begins). Raises only :class:`GGUFError`, whatever the file holds."""
    try:
        size = os.path.getsize(path)
        with open(path, "rb") as handle:
            return _read(_Reader(handle, size), tensors)
    except OSError as exc:
        raise GGUFError(f"cannot read: {exc.strerror or exc}") from None


def _read(r: _Reader, tensors: bool) -> dict[str, Any]:
    if r.take(4) != b"GGUF":
        raise GGUFError("not a GGUF file (bad magic)")
    version = r.scalar("<I")
    if version not in VERSIONS:
        raise GGUFError(f"GGUF version {version}: only versions {VERSIONS[0]} and {VERSIONS[-1]} are read")
    n_tensors, n_kv = r.scalar("<Q"), r.scalar("<Q")
    r.count(n_kv, f"{n_kv} metadata entries")
    meta = {}
    for _ in range(n_kv):
        key = r.name("a metadata key")
        meta[key] = r.value(r.scalar("<I"))
    header: dict[str, Any] = {"version": version, "meta": meta, "tensor_count": n_tensors, "kv_count": n_kv,
                              "size": r.size}
    if not tensors:
        return header
    r.count(n_tensors, f"{n_tensors} tensors")
    table = []
    for _ in range(n_tensors):
        name = r.name("a tensor name")
        n_dims = r.scalar("<I")
        if n_dims > MAX_DIMS:
            raise GGUFError(f"tensor {name}: {n_dims} dimensions (ggml has at most {MAX_DIMS})")
        dims = [r.scalar("<Q") for _ in range(n_dims)]
        ttype, offset = r.scalar("<I"), r.scalar("<Q")
        if ttype not in GGML_TYPES:
            raise GGUFError(f"tensor {name}: unknown ggml type {ttype}")
        n = 1
        for d in dims:
            n *= d
        tname, block, block_bytes = GGML_TYPES[ttype]
        r.keep(64)  # the Tensor itself, roughly
        table.append(Tensor(name, tname, offset, n // block * block_bytes))
    alignment = meta.get("general.alignment", 32)
    # A power of two, as llama.cpp requires: 0 would divide by zero, a string or a list is no number.
    if isinstance(alignment, bool) or not isinstance(alignment, int) or alignment <= 0 \
            or alignment & (alignment - 1):
        raise GGUFError(f"general.alignment {alignment!r} is not a power of two")
    header["tensors"] = table
    header["data_start"] = (r.handle.tell() + alignment - 1) // alignment * alignment
    return header


def type_summary(header: dict[str, Any]) -> dict[str, dict[str, int]]:
    """Tensors and bytes per ggml type, by type name; GGUFError when the tensor data runs past the file."""
    types: dict[str, dict[str, int]] = {}
    end = header["data_start"]
    for tensor in header["tensors"]:
        entry = types.setdefault(tensor.type, {"tensors": 0, "bytes": 0})
        entry["tensors"] += 1
        entry["bytes"] += tensor.bytes
        end = max(end, header["data_start"] + tensor.offset + tensor.bytes)
    if end > header["size"]:
        raise GGUFError(f"tensor data ends at byte {end} but the file has {header['size']} (truncated)")
    return dict(sorted(types.items()))
