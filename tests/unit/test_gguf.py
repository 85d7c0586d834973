"""The GGUF reader against hostile headers: every length field is the file's word, so each is bounded
(depth, count, size, time) and anything the reader cannot take is its own GGUFError, never another
exception. The reading of real files is checked against the gguf package in test_models.py and
test_hostside.py."""

from __future__ import annotations

import struct
import time
from pathlib import Path

import pytest
import role_modules
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from rigctl.hostside import bench_task, gguf

REPO = Path(__file__).resolve().parents[2]
INT64, STRING, ARRAY, UINT32, FLOAT64, BOOL = 11, 8, 9, 4, 12, 7


def u32(n: int) -> bytes:
    return struct.pack("<I", n)


def u64(n: int) -> bytes:
    return struct.pack("<Q", n)


def text(data: bytes | str) -> bytes:
    data = data.encode() if isinstance(data, str) else data
    return u64(len(data)) + data


def entry(key: str, vtype: int, payload: bytes) -> bytes:
    return text(key) + u32(vtype) + payload


def tensor(name: str, dims: list[int], ttype: int = 0, offset: int = 0) -> bytes:
    return text(name) + u32(len(dims)) + b"".join(u64(d) for d in dims) + u32(ttype) + u64(offset)


def header(entries: list[bytes], tensors: list[bytes] = (), *, n_kv: int | None = None,
           n_tensors: int | None = None) -> bytes:
    """A GGUF v3 header: its counts those of ``entries`` and ``tensors`` unless given."""
    return (b"GGUF" + u32(3) + u64(len(tensors) if n_tensors is None else n_tensors)
            + u64(len(entries) if n_kv is None else n_kv) + b"".join(entries) + b"".join(tensors))


def encode(value: object) -> tuple[int, bytes]:
    """A metadata value as (GGUF type, payload); a list's items all of its first item's type."""
    if isinstance(value, bool):
        return BOOL, struct.pack("<?", value)
    if isinstance(value, int):
        return INT64, struct.pack("<q", value)
    if isinstance(value, float):
        return FLOAT64, struct.pack("<d", value)
    if isinstance(value, str):
        return STRING, text(value)
    assert isinstance(value, list)
    items = [encode(v) for v in value]
    etype = items[0][0] if items else INT64
    return ARRAY, u32(etype) + u64(len(items)) + b"".join(payload for _, payload in items)


def read(tmp_path: Path, data: bytes, **kwargs) -> dict:
    path = tmp_path / "m.gguf"
    path.write_bytes(data)
    return gguf.read_header(str(path), **kwargs)


def refused(tmp_path: Path, data: bytes, message: str) -> str:
    with pytest.raises(gguf.GGUFError, match=message) as caught:
        read(tmp_path, data)
    return str(caught.value)


# ----------------------------------------------------------------------------------------------- each bound


def test_arrays_nested_past_the_depth_bound_are_refused_not_a_recursion_error(tmp_path: Path) -> None:
    depth = 200_000  # far past Python's recursion limit, had the reader recursed into each level
    nested = entry("deep", ARRAY, (u32(ARRAY) + u64(1)) * depth + u32(INT64) + u64(0))
    refused(tmp_path, header([nested]), f"arrays nested deeper than {gguf.MAX_DEPTH}")
    # Inside an array too long to keep (skipped, not read into memory) the bound holds the same.
    skipped = entry("deep", ARRAY, u32(ARRAY) + u64(gguf.MAX_ARRAY + 1) + (u32(ARRAY) + u64(1)) * depth)
    refused(tmp_path, header([skipped]), "arrays nested deeper")
    # Within the bound, nested arrays read as lists of lists.
    assert read(tmp_path, header([entry("ok", *encode([[1, 2], [3]]))]))["meta"] == {"ok": [[1, 2], [3]]}


@pytest.mark.parametrize("alignment", [0, 3, 48, -32, "32", [32], 1.5, True])
def test_an_alignment_that_is_not_a_power_of_two_is_refused(tmp_path: Path, alignment: object) -> None:
    data = header([entry("general.alignment", *encode(alignment))], [tensor("t", [32])])
    message = refused(tmp_path, data, "general.alignment .* is not a power of two")
    assert repr(alignment) in message
    # Read without the tensor table (no data offset to align), the same file reads.
    assert read(tmp_path, data, tensors=False)["meta"]["general.alignment"] == alignment


def test_a_power_of_two_alignment_places_the_data(tmp_path: Path) -> None:
    data = header([entry("general.alignment", UINT32, u32(64))], [tensor("t", [32, 2])])
    parsed = read(tmp_path, data)
    assert parsed["data_start"] == 64 * -(-len(data) // 64)
    assert parsed["tensors"] == [gguf.Tensor("t", "F32", 0, 256)]


@pytest.mark.parametrize("etype", [UINT32, INT64, BOOL])
def test_a_scalar_array_counted_past_the_file_is_truncated_not_an_overflow(tmp_path: Path, etype: int) -> None:
    for count in (2**61, 2**64 - 1, gguf.MAX_ARRAY + 1):
        refused(tmp_path, header([entry("scores", ARRAY, u32(etype) + u64(count))]), "truncated")


def test_huge_counts_are_refused_before_anything_is_read_into_memory(tmp_path: Path) -> None:
    started = time.monotonic()
    refused(tmp_path, header([], n_kv=2**63), "metadata entries: more than")
    refused(tmp_path, header([], n_tensors=2**40), "tensors: more than")
    refused(tmp_path, header([entry("tokens", ARRAY, u32(STRING) + u64(2**40))]), "array of .* items: more than")
    refused(tmp_path, header([entry("nested", ARRAY, u32(ARRAY) + u64(2**40))]), "array of .* items: more than")
    refused(tmp_path, header([], [text("t") + u32(2**31)]), r"tensor t: 2147483648 dimensions \(ggml has at most 4\)")
    assert time.monotonic() - started < 5  # counts, not the items they claim


def test_the_values_read_in_all_are_bounded_however_they_are_split(tmp_path: Path, monkeypatch) -> None:
    # Many arrays each under the bound: their sum is what the bound counts (the reader's time).
    monkeypatch.setattr(gguf, "MAX_VALUES", 1000)
    vocab = entry("tokens", ARRAY, u32(STRING) + u64(300) + text("x") * 300)
    assert read(tmp_path, header([vocab] * 3))["meta"] == {"tokens": ["x"] * 300}
    refused(tmp_path, header([vocab] * 4), "more than 1000 values")


def test_the_bytes_kept_are_bounded(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setattr(gguf, "MAX_KEPT", 10_000)
    short = entry("k", *encode(["y" * 1000] * 9))
    assert len(read(tmp_path, header([short]))["meta"]["k"]) == 9
    refused(tmp_path, header([short, short]), "more than 10000 bytes of metadata")


def test_a_file_sized_string_is_kept_as_its_length_only(tmp_path: Path) -> None:
    big = "A" * (gguf.MAX_STRING + 1)
    data = header([entry("general.architecture", STRING, text(big)),
                   entry("general.name", STRING, text("x" * gguf.MAX_STRING)),
                   entry("llama.block_count", UINT32, u32(30))])
    data += bytes(-len(data) % 32)  # to the default alignment, where the (empty) tensor data starts
    meta = read(tmp_path, data)["meta"]
    assert meta == {"general.architecture": {"length": gguf.MAX_STRING + 1}, "general.name": "x" * gguf.MAX_STRING,
                    "llama.block_count": 30}
    # What the records take from it: a bench's model shape (run.json) and a manifest, neither the string.
    path = tmp_path / "m.gguf"
    assert bench_task.gguf_shape(str(path)) is None
    artifact = role_modules.load(REPO / "roles/models/library/models_artifact.py", "models_artifact")
    assert artifact.gguf_summary(str(path))["architecture"] == ""
    # A string claiming more bytes than the file has is cut short, not skipped past the end.
    refused(tmp_path, header([entry("general.name", STRING, u64(2**62))]), "truncated")


def test_keys_and_tensor_names_longer_than_the_bound_are_refused(tmp_path: Path) -> None:
    long_name = "k" * (gguf.MAX_STRING + 1)
    refused(tmp_path, header([entry(long_name, UINT32, u32(1))]), f"a metadata key of {gguf.MAX_STRING + 1} bytes")
    refused(tmp_path, header([], [tensor(long_name, [1])]), "a tensor name of")
    refused(tmp_path, header([u64(2**63)]), "a metadata key of 9223372036854775808 bytes")


def test_a_file_that_cannot_be_read_is_a_gguf_error(tmp_path: Path) -> None:
    with pytest.raises(gguf.GGUFError, match="cannot read: No such file"):
        gguf.read_header(str(tmp_path / "gone.gguf"))
    with pytest.raises(gguf.GGUFError, match="cannot read: Is a directory"):
        gguf.read_header(str(tmp_path))


# ----------------------------------------------------------------------------------------------- properties

_scalar = st.integers(-2**63, 2**63 - 1) | st.text(max_size=20) | st.booleans() | st.floats(allow_nan=False)
_value = _scalar | st.lists(st.integers(-2**63, 2**63 - 1), max_size=5) | st.lists(st.text(max_size=5), max_size=5) \
    | st.lists(st.lists(st.integers(0, 9), min_size=1, max_size=3), min_size=1, max_size=3)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(meta=st.dictionaries(st.text(min_size=1, max_size=30), _value, max_size=8))
def test_any_header_within_the_bounds_reads_back_as_written(tmp_path: Path, meta: dict) -> None:
    parsed = read(tmp_path, header([entry(k, *encode(v)) for k, v in meta.items()], [tensor("w", [256], 2)]))
    assert parsed["meta"] == meta
    assert parsed["tensors"] == [gguf.Tensor("w", "Q4_0", 0, 144)]


# Length fields a hostile file would pick: the edges of each type, counts past any file.
_length = st.sampled_from([0, 1, 2, 3, 31, 4096, 4097, 2**31, 2**32 - 1, 2**63, 2**64 - 1]) | st.integers(0, 2**64 - 1)
_field = st.one_of(_length.map(u64), _length.filter(lambda n: n < 2**32).map(u32),
                   st.sampled_from(range(14)).map(u32), st.binary(max_size=12))


@pytest.mark.timeout(120)
@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.one_of(
    st.binary(max_size=200),
    st.tuples(st.sampled_from([2, 3]), st.lists(_field, max_size=30)).map(
        lambda v: b"GGUF" + u32(v[0]) + b"".join(v[1])),
    st.lists(st.tuples(st.text(max_size=8), _value), max_size=4).flatmap(
        lambda kv: st.tuples(st.just(header([entry(k, *encode(v)) for k, v in kv])), st.lists(_field, max_size=12),
                             st.integers(0, 400)).map(lambda t: t[0][:t[2]] + b"".join(t[1]) + t[0][t[2]:])),
))
@example(data=header([entry("general.alignment", UINT32, u32(0))], [tensor("t", [1])]))
@example(data=b"GGUF" + u32(3) + u64(0) + u64(1) + text("a") + u32(ARRAY) + (u32(ARRAY) + u64(1)) * 5000)
def test_any_bytes_are_a_header_or_the_readers_own_error(tmp_path: Path, data: bytes) -> None:
    for tensors in (True, False):
        try:
            parsed = read(tmp_path, data, tensors=tensors)
            if tensors:
                gguf.type_summary(parsed)  # what the manifest takes from the table: its own error too
        except gguf.GGUFError as exc:
            assert str(exc) and "\n" not in str(exc)
            continue
        assert set(parsed) >= {"version", "meta", "tensor_count", "kv_count", "size"}


@pytest.mark.parametrize(("meta", "why"), [
    ({"llama.block_count": "many"}, "ValueError"),
    ({"llama.block_count": 2**62}, "block_count 4611686018427387904"),
    ({"llama.block_count": [1, 2]}, "TypeError"),
    ({"llama.block_count": 2, "llama.attention.head_count": []}, "IndexError"),
    ({"llama.block_count": 2, "llama.attention.head_count_kv": [[1]]}, "TypeError"),
])
def test_the_vram_estimate_refuses_metadata_of_another_shape_as_a_gguf_error(meta: dict, why: str) -> None:
    vram = role_modules.load(REPO / "roles/llama_server/library/llama_server_vram.py", "llama_server_vram")
    header = {"meta": {"general.architecture": "llama", **meta}, "tensors": []}
    with pytest.raises(gguf.GGUFError, match=f"its metadata is not a model shape this estimate reads .*{why}"):
        vram.model_shape(header)
    # A value too long to keep (kept as its length) is no shape either, never a crash.
    assert vram.model_shape({"meta": {"general.architecture": {"length": 5000}}, "tensors": []})["n_layer"] == 0
