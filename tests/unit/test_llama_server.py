"""roles/llama_server's pure parts without rigs: profile resolution, flags, the VRAM estimate, systemd's output."""

from __future__ import annotations

from pathlib import Path

import pytest
import role_modules
import yaml

from rigctl.fleet.servers import operator_start, parse_unit_show
from rigctl.hostside import sandbox
from rigctl.inventory.profiles import ProfileError, host_plan, resolve_profile, server_flags

ROLE = Path(__file__).resolve().parents[2] / "roles" / "llama_server"


filters = role_modules.load(ROLE / "filter_plugins" / "llama_server.py", "llama_server_filters")


# ----------------------------------------------------------------------------------------------- pure


def test_profiles_extend_and_hosts_override() -> None:
    profiles = {"base": {"ctx_size": 4096, "threads": 6, "spec": {"type": "draft-mtp", "draft_n_max": 1}},
                "child": {"extends": "base", "ctx_size": 8192, "spec": {"draft_n_max": 2}}}
    merged = resolve_profile(profiles, "child", {"child": {"threads": 4}})
    assert merged == {"ctx_size": 8192, "threads": 4, "spec": {"type": "draft-mtp", "draft_n_max": 2}}
    with pytest.raises(ProfileError, match="'child' extends 'nope'"):
        resolve_profile({"child": {"extends": "nope"}}, "child")
    with pytest.raises(ProfileError, match="cycle a -> b -> a"):
        resolve_profile({"a": {"extends": "b"}, "b": {"extends": "a"}}, "a")


def test_the_filter_plugin_plans_with_rigctls_resolver() -> None:
    """The role's plan is rigctl's plan: the plugin loads rigctl/inventory/profiles.py by its path, and a bad
    extends chain fails the play with the resolver's message."""
    profiles = {"base": {"ctx_size": 4096, "host": "0.0.0.0"}, "child": {"extends": "base", "threads": 2}}
    instances = {"b": {"artifact": "m", "profile": "child", "port": 8081, "enabled": "no"},
                 "a": {"artifact": "m", "profile": "base", "port": 8080}}
    paths = {"models_dir": "/models", "config_dir": "/etc/ls", "bind_address": "", "api_key": True}
    plan = filters.FilterModule().filters()["llama_server_plan"](instances, profiles, {"child": {"ctx_size": 512}},
                                                                 **paths)
    assert plan == host_plan(instances, profiles, {"child": {"ctx_size": 512}}, **paths)
    assert [(p["name"], p["unit"], p["enabled"], p["check_host"]) for p in plan] == [
        ("a", "llama-server@a.service", True, "127.0.0.1"), ("b", "llama-server@b.service", False, "127.0.0.1")]
    assert plan[1]["flags"] == ["--model /models/m.gguf", "--alias m", "--host 0.0.0.0", "--port 8081", "-c 512",
                                "-t 2", "--api-key-file /etc/ls/api-key"]
    assert filters.FilterModule().filters()["llama_server_key_file"]("/etc/ls") == "/etc/ls/api-key"
    with pytest.raises(filters.AnsibleFilterError, match="profile 'child' extends 'gone', which is not defined"):
        filters.llama_server_plan({"b": instances["b"]}, {"child": {"extends": "gone"}}, **paths)


def test_the_sandboxs_defaults_are_the_roles() -> None:
    """rigctl's fallbacks for a host that sets neither (jobs and probes) are the role's defaults."""
    defaults = yaml.safe_load((ROLE / "defaults" / "main.yml").read_text())
    assert defaults["llama_server_device_allow"] == list(sandbox.DEVICE_ALLOW)
    assert defaults["llama_server_supplementary_groups"] == list(sandbox.SUPPLEMENTARY_GROUPS)
    lines = filters.FilterModule().filters()["llama_server_sandbox"](["char-x rw"], ["/var/lib/llama-server"])
    assert lines == sandbox.properties(["/var/lib/llama-server"], ["char-x rw"])
    assert "PrivateDevices=yes" not in lines and "NoNewPrivileges=yes" in lines and "CapabilityBoundingSet=" in lines
    with pytest.raises(filters.AnsibleFilterError, match="must be absolute"):
        filters.llama_server_sandbox([], ["state"])


def test_flags_one_per_line_as_the_study_serves() -> None:
    profile = {"host": "0.0.0.0", "n_gpu_layers": 99, "ctx_size": 8192, "cache_type_k": "f16", "cache_type_v": "f16",
               "flash_attn": "1", "threads": 6, "threads_batch": 12, "parallel": 1, "reasoning": False,
               "metrics": True, "override_tensor": r"blk\.(18|19|20|21|22|23)\.=CPU",
               "spec": {"type": "draft-mtp", "draft_n_max": 1}, "extra_args": ["--no-webui"]}
    lines = server_flags(profile, model_path="/m/q.gguf", port=8084, alias="qwen",
                         api_key_file="/etc/llama-server/api-key")
    assert lines == ["--model /m/q.gguf", "--alias qwen", "--host 0.0.0.0", "--port 8084", "-ngl 99", "-c 8192",
                     "-ctk f16", "-ctv f16", "-fa 1", "-t 6", "-tb 12", "--parallel 1", "--reasoning off",
                     "--metrics", r"-ot blk\.(18|19|20|21|22|23)\.=CPU", "--spec-type draft-mtp",
                     "--spec-draft-n-max 1", "--api-key-file /etc/llama-server/api-key", "--no-webui"]
    drafter = server_flags({"spec": {"type": "draft-simple", "draft_n_max": 2, "draft_model": "d",
                                     "n_gpu_layers_draft": 99}},
                           model_path="/m/g.gguf", port=1, alias="g", bind_host="10.0.0.2",
                           draft_model_path="/m/d.gguf")
    assert drafter[2:] == ["--host 10.0.0.2", "--port 1", "--spec-type draft-simple", "--spec-draft-n-max 2",
                           "-md /m/d.gguf", "-ngld 99"]


def test_parse_unit_show() -> None:
    text = ("Id=llama-server@a.service\nActiveState=active\nSubState=running\nMainPID=812\nNRestarts=1\n\n"
            "Id=llama-server@b.service\nActiveState=inactive\nSubState=dead\nMainPID=0\nNRestarts=0\n")
    states = parse_unit_show(text)
    assert states["llama-server@a.service"].main_pid == 812
    assert states["llama-server@a.service"].n_restarts == 1
    assert states["llama-server@b.service"].active_state == "inactive"


def test_operator_start_clears_the_start_limit_first() -> None:
    units = ["llama-server@a.service", "llama-server@b c.service"]
    quoted = "llama-server@a.service 'llama-server@b c.service'"
    assert operator_start(units, "restart") == f"systemctl reset-failed {quoted}; systemctl restart {quoted}"


# ----------------------------------------------------------------------------------------------- VRAM


def _qwen_like_header(path: Path) -> Path:
    """A GGUF header shaped like the study's bf16 Qwen3.5-2B: 24 blocks of 110 MiB plus an MTP block,
    a tied 248,320 x 2048 bf16 embedding, one full-attention layer in four (the rest recurrent)."""
    import gguf
    import numpy as np

    writer = gguf.GGUFWriter(str(path), "qwen35")
    writer.add_uint32("qwen35.block_count", 25)
    writer.add_uint32("qwen35.nextn_predict_layers", 1)
    writer.add_uint32("qwen35.embedding_length", 2048)
    writer.add_uint32("qwen35.context_length", 262144)
    writer.add_uint32("qwen35.attention.head_count", 8)
    writer.add_uint32("qwen35.attention.head_count_kv", 2)
    writer.add_uint32("qwen35.attention.key_length", 256)
    writer.add_uint32("qwen35.attention.value_length", 256)
    writer.add_uint32("qwen35.ssm.state_size", 128)
    writer.add_uint32("qwen35.full_attention_interval", 4)
    writer.add_uint32("qwen35.vocab_size", 248320)
    bf16 = gguf.GGMLQuantizationType.BF16
    writer.add_tensor_info("token_embd.weight", [248320, 2048], np.dtype(np.uint16), 248320 * 2048 * 2, bf16)
    for block in range(25):
        writer.add_tensor_info(f"blk.{block}.ffn_up.weight", [28160, 2048], np.dtype(np.uint16),
                               28160 * 2048 * 2, bf16)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    writer.close()
    return path


def test_vram_estimate_finds_the_studys_offload(tmp_path: Path) -> None:
    vram = role_modules.load(ROLE / "library" / "llama_server_vram.py", "llama_server_vram")
    header = vram.read_header(str(_qwen_like_header(tmp_path / "qwen.gguf")))
    shape = vram.model_shape(header)
    assert shape["n_block"] == 24 and len(shape["kv_layers"]) == 6 and shape["n_vocab"] == 248320
    params = {"ctx_size": 8192, "cache_type_k": "f16", "cache_type_v": "f16", "flash_attn": True,
              "n_gpu_layers": 99, "n_gpu_layers_draft": -1, "override_tensor": [], "n_ubatch": 512,
              "vram_mib": 4096, "reserve_mib": 350}
    full = vram.estimate(header, None, params)
    assert not full["fits"]
    assert full["need_mib"]["kv"] == 96.0 and round(full["need_mib"]["compute"]) == 501
    assert full["need_mib"]["weights"] == 25 * 110 + 970  # the tied head is the embeddings' copy
    assert "-ot 'blk\\.(18|19|20|21|22|23)\\.=CPU' (the last 6 of 24 blocks on the CPU)" in full["suggestions"]
    offloaded = vram.estimate(header, None, {**params, "override_tensor": [r"blk\.(18|19|20|21|22|23)\.=CPU"]})
    assert offloaded["fits"] and offloaded["need_mib"]["weights"] == 19 * 110 + 970
    # 8 GB: the full context fits without offloading; a cache in f32 at 256k does not, and -c is suggested.
    assert vram.estimate(header, None, {**params, "vram_mib": 8192, "ctx_size": 131072})["fits"]
    huge = vram.estimate(header, None, {**params, "vram_mib": 8192, "ctx_size": 262144, "cache_type_k": "f32",
                                        "cache_type_v": "f32"})
    assert not huge["fits"] and huge["suggestions"][0].startswith("-c ")
