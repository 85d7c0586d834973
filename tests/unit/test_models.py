"""roles/models and rigctl.models without rigs: manifests against the gguf package's reader, pins."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import role_modules
import yaml

from rigctl.models import parse_manifest, set_pins_text

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "fixtures"))
from make_hf_checkout import gguf_file  # noqa: E402
from models_support import gguf_reader_summary  # noqa: E402


def _artifact_module():
    return role_modules.load(REPO / "roles/models/library/models_artifact.py", "models_artifact")


# ------------------------------------------------------------------------------------------- no lab


def test_gguf_summary_matches_the_gguf_reader():
    path = gguf_file(Path(__import__("make_hf_checkout").cache_dir()))
    ours = _artifact_module().gguf_summary(str(path))
    theirs = gguf_reader_summary(path)
    assert ours["tensor_count"] == theirs["tensor_count"] == 272
    assert ours["types"] == dict(sorted(theirs["types"].items()))


def test_gguf_summary_refuses_a_truncated_file(tmp_path):
    path = gguf_file(Path(__import__("make_hf_checkout").cache_dir()))
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(path.read_bytes()[: path.stat().st_size // 2])
    module = _artifact_module()
    with pytest.raises(module.GGUFError, match="truncated"):
        module.gguf_summary(str(cut))


def test_set_pins_text_replaces_only_the_pins_block():
    text = "# rig\ngpu_host_gpu:\n  name: x\nmodels_pins:\n  old: " + "0" * 64 + "\nother: 1\n"
    out = set_pins_text(text, {"a": "1" * 64, "b": "2" * 64})
    assert yaml.safe_load(out) == {"gpu_host_gpu": {"name": "x"}, "other": 1,
                                   "models_pins": {"a": "1" * 64, "b": "2" * 64}}
    assert out.startswith("# rig\n")
    assert set_pins_text("a: 1", {"x": "3" * 64}) == "a: 1\nmodels_pins:\n  x: \"" + "3" * 64 + "\"\n"


def test_parse_manifest_quant_mix():
    m = parse_manifest(json.dumps({
        "artifact": "q", "path": "/m/q.gguf", "bytes": 10, "sha256": "a" * 64, "tensor_count": 335,
        "types": {"Q4_0": {"tensors": 194, "bytes": 806_400_000}, "Q6_K": {"tensors": 1, "bytes": 417_200_000},
                  "F32": {"tensors": 140, "bytes": 300_000}}}))
    assert m.quant_mix == "194 Q4_0 (806.4 MB), 1 Q6_K (417.2 MB), 140 F32"
