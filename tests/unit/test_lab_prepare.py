"""`rigctl lab prepare` without rigs: what decides a rerun, the record, the compiler-cache bind's config."""

from __future__ import annotations

from pathlib import Path, PurePosixPath

import pytest
import yaml
from labrigs_support import make_test_inventory, real_inventory

from rigctl.errors import ConfigError
from rigctl.inventory import Inventory
from rigctl.lab.prepare import (
    Prepared,
    artifact_path,
    deciding_digest,
    ensure_pin,
    fetch_cuda_wheels,
    file_sha256,
    is_prepared,
    pin_path,
)
from rigctl.lab.rigs import Lab

IMAGE = "bookworm-minbase-abc123-r3.tar.zst"


def test_the_digest_follows_the_pin_flags_and_image_and_nothing_else() -> None:
    desktop = real_inventory(slot=0).hosts["desktop"].vars
    base = deciding_digest(IMAGE, desktop)
    assert deciding_digest(IMAGE, dict(desktop)) == base
    assert deciding_digest(IMAGE, {**desktop, "llama_cpp_version": "b11435"}) != base
    assert deciding_digest(IMAGE, {**desktop, "llama_cpp_cmake_options": {"GGML_CPU_REPACK": "OFF"}}) != base
    assert deciding_digest(IMAGE, {**desktop, "models_catalog": {}}) != base
    assert deciding_digest("bookworm-minbase-def456-r4.tar.zst", desktop) != base
    # What the build does not depend on reruns nothing.
    assert deciding_digest(IMAGE, {**desktop, "llama_server_api_key": "another"}) == base
    assert deciding_digest(IMAGE, {**desktop, "ansible_host": "10.213.0.99"}) == base


def _prepared(cache: Path, content: bytes = b"build") -> Prepared:
    artifact = artifact_path(cache, "b11434-0123456789ab")
    artifact.parent.mkdir(parents=True)
    artifact.write_bytes(content)
    return Prepared(digest="d" * 64, build="b11434-0123456789ab", artifact=str(artifact.relative_to(cache)),
                    artifact_sha256=file_sha256(artifact))


def test_prepared_only_with_the_same_digest_and_the_artifact_byte_for_byte(tmp_path: Path) -> None:
    record = _prepared(tmp_path)
    assert is_prepared(record, "d" * 64, tmp_path)
    assert not is_prepared(record, "e" * 64, tmp_path)
    (tmp_path / record.artifact).write_bytes(b"truncat")
    assert not is_prepared(record, "d" * 64, tmp_path)
    (tmp_path / record.artifact).unlink()
    assert not is_prepared(record, "d" * 64, tmp_path)


def test_a_prepared_artifact_gets_its_pin_from_the_record_and_another_pin_unprepares_it(tmp_path: Path) -> None:
    """A cache prepared before packs had the controller's pin gets it from prepare's own record (made when
    this controller first made the artifact); a pin that disagrees with the record means it is not ready."""
    record = _prepared(tmp_path)
    pin = pin_path(tmp_path / record.artifact)
    assert pin.name == "b11434-0123456789ab.tar.gz.sha256" and not pin.exists()
    ensure_pin(record, tmp_path)
    assert pin.read_text() == record.artifact_sha256 + "\n" and is_prepared(record, "d" * 64, tmp_path)
    pin.write_text("f" * 64 + "\n")
    ensure_pin(record, tmp_path)  # never overwrites a pin
    assert pin.read_text() == "f" * 64 + "\n" and not is_prepared(record, "d" * 64, tmp_path)


def test_the_record_round_trips_and_a_damaged_one_reads_as_none(tmp_path: Path) -> None:
    record = _prepared(tmp_path)
    path = tmp_path / "lab" / "prepared.json"
    record.save(path)
    assert Prepared.load(path) == record
    for damaged in ("", "{", "[]", '{"digest": "x"}', "null"):
        path.write_text(damaged)
        assert Prepared.load(path) is None, damaged
    assert Prepared.load(tmp_path / "missing.json") is None


def test_the_lab_binds_the_rigs_ccache_to_one_dir_per_lab_under_the_cache() -> None:
    config = Lab.from_inventory(real_inventory(slot=0)).config
    desktop = real_inventory(slot=0).hosts["desktop"].vars
    assert config.guest_ccache_dir == PurePosixPath(desktop["llama_cpp_ccache_dir"])
    assert config.compiler_cache == config.cache_dir / "ccache" / config.dir.name


@pytest.mark.parametrize(("value", "message"), [
    ("relative/ccache", "must be an absolute path"),
    ("/var/cache/a:b", "must be an absolute path without ':'"),
])
def test_a_bad_ccache_dir_is_one_line(tmp_path: Path, value: str, message: str) -> None:
    inv = make_test_inventory(tmp_path / "inv", tmp_path / "lab")
    settings = inv / "group_vars" / "all" / "llama_cpp.yml"
    settings.write_text(yaml.safe_dump({**yaml.safe_load(settings.read_text()), "llama_cpp_ccache_dir": value}))
    with pytest.raises(ConfigError, match=f"llama_cpp_ccache_dir {value} {message}"):
        Lab.from_inventory(Inventory.load(inv))


def test_rigs_with_different_ccache_dirs_are_refused(tmp_path: Path) -> None:
    inv = make_test_inventory(tmp_path / "inv", tmp_path / "lab")
    laptop = inv / "host_vars" / "lt-laptop.yml"
    laptop.write_text(yaml.safe_dump({**yaml.safe_load(laptop.read_text()), "llama_cpp_ccache_dir": "/var/b"}))
    with pytest.raises(ConfigError, match="lt-laptop: llama_cpp_ccache_dir differs from lt-desktop's"):
        Lab.from_inventory(Inventory.load(inv))


def test_cuda_wheels_already_in_the_cache_are_not_fetched_again(tmp_path: Path) -> None:
    """A wheel whose pinned sha256 a file in ``<cache>/wheels`` has is kept: no index is asked (an index
    would be the network; this test has none)."""
    wheels_dir = tmp_path / "wheels"
    wheels_dir.mkdir()
    present = wheels_dir / "nvidia_cuda_cccl-13.0.85-py3-none-manylinux_2_27_x86_64.whl"
    present.write_bytes(b"a pinned wheel's bytes")
    pin = {"name": "nvidia-cuda-cccl", "version": "13.0.85", "sha256": file_sha256(present)}
    outcome = fetch_cuda_wheels([pin], wheels_dir)
    assert outcome == {"made": False, "detail": f"1 pinned wheels in {wheels_dir}"}
    assert list(wheels_dir.iterdir()) == [present]


def test_the_lab_inventory_pins_the_wheels_prepare_fetches() -> None:
    rig = real_inventory(slot=0).host("desktop").vars
    assert rig["gpu_host_cuda_source"] == "wheels"
    assert {wheel["name"] for wheel in rig["gpu_host_cuda_wheels"]} >= {"nvidia-cuda-nvcc", "nvidia-cublas"}
