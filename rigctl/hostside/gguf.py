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
#: Arrays longer than this (vocabularies, merges, token scores) are skipped; only their length is kept.
MAX_ARRAY = 4096
_LENGTH = struct.Struct("<Q")
VERSIONS = (2, 3)


class GGUFError(Exception):
    """Not a GGUF file this reader understands, or one cut short."""


class Tensor(NamedTuple):
    name: str
    type: str  # ggml type name: Q4_0, F32, ...
    offset: int  # from the start of the tensor data
    bytes: int


class _Reader:
    def __init__(self, handle: BinaryIO, size: int):
        self.handle = handle
        self.size = size

    def take(self, n: int) -> bytes:
        data = self.handle.read(n)
        if len(data) != n:
            raise GGUFError(f"truncated at byte {self.handle.tell()} (file has {self.size})")
        return data

    def scalar(self, fmt: str) -> Any:
        return struct.unpack(fmt, self.take(struct.calcsize(fmt)))[0]

    def string(self) -> str:
        n = self.scalar("<Q")
        if n > self.size:
            raise GGUFError(f"string length {n} past the end of the file")
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

    def value(self, vtype: int) -> Any:
        if vtype in _SCALARS:
            return self.scalar(_SCALARS[vtype])
        if vtype == 8:
            return self.string()
        if vtype == 9:
            etype, count = self.scalar("<I"), self.scalar("<Q")
            if etype in _SCALARS and count > MAX_ARRAY:
                self.handle.seek(struct.calcsize(_SCALARS[etype]) * count, os.SEEK_CUR)
                return {"length": count}
            if etype == 8 and count > MAX_ARRAY:
                self.skip_strings(count)
                return {"length": count}
            items = [self.value(etype) for _ in range(count)]
            return items if count <= MAX_ARRAY else {"length": count}
        raise GGUFError(f"unknown metadata value type {vtype}")


def read_header(path: str, *, tensors: bool = True) -> dict[str, Any]:
    """``version``, ``meta`` (scalars, strings and arrays of up to :data:`MAX_ARRAY` items; a longer
    array as ``{"length": n}``), ``tensor_count``, ``kv_count``, ``size`` and, with ``tensors``, the
    tensor table (:class:`Tensor` each) and ``data_start`` (where the aligned tensor data begins)."""
    size = os.path.getsize(path)
    with open(path, "rb") as handle:
        r = _Reader(handle, size)
        if r.take(4) != b"GGUF":
            raise GGUFError("not a GGUF file (bad magic)")
        version = r.scalar("<I")
        if version not in VERSIONS:
            raise GGUFError(f"GGUF version {version}: only versions {VERSIONS[0]} and {VERSIONS[-1]} are read")
        n_tensors, n_kv = r.scalar("<Q"), r.scalar("<Q")
        meta = {}
        for _ in range(n_kv):
            key = r.string()
            meta[key] = r.value(r.scalar("<I"))
        header: dict[str, Any] = {"version": version, "meta": meta, "tensor_count": n_tensors, "kv_count": n_kv,
                                  "size": size}
        if not tensors:
            return header
        table = []
        for _ in range(n_tensors):
            name = r.string()
            dims = [r.scalar("<Q") for _ in range(r.scalar("<I"))]
            ttype, offset = r.scalar("<I"), r.scalar("<Q")
            if ttype not in GGML_TYPES:
                raise GGUFError(f"tensor {name}: unknown ggml type {ttype}")
            n = 1
            for d in dims:
                n *= d
            tname, block, block_bytes = GGML_TYPES[ttype]
            table.append(Tensor(name, tname, offset, n // block * block_bytes))
        alignment = int(meta.get("general.alignment", 32))
        header["tensors"] = table
        header["data_start"] = (handle.tell() + alignment - 1) // alignment * alignment
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
