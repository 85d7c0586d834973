"""roles/llama_server and rigctl.servers against the lab rigs: units, idempotence, targeted restarts,
crash and reboot recovery, a failed rollout's rollback, the API key. Pure parts (profile resolution,
flags, the VRAM estimate, systemd's output) are tested without the lab."""

from __future__ import annotations

import importlib.util
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import yaml
from conftest import wait_healthy

from rigctl.deploy import run_playbook
from rigctl.errors import DeployError
from rigctl.inventory import Inventory
from rigctl.server import Endpoint, ServerClient
from rigctl.servers import list_servers, operator_start, parse_unit_show, restart, unit_states
from rigctl.ssh import SshClient, SshTarget

ROLE = Path(__file__).resolve().parent.parent / "roles" / "llama_server"
QUESTION = [{"role": "user", "content": "What is 2+2?"}]


def _load(path: Path, name: str) -> Any:
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


filters = _load(ROLE / "filter_plugins" / "llama_server.py", "llama_server_filters")


# ----------------------------------------------------------------------------------------------- pure


def test_profiles_extend_and_hosts_override() -> None:
    profiles = {"base": {"ctx_size": 4096, "threads": 6, "spec": {"type": "draft-mtp", "draft_n_max": 1}},
                "child": {"extends": "base", "ctx_size": 8192, "spec": {"draft_n_max": 2}}}
    merged = filters.resolve_profile(profiles, "child", {"child": {"threads": 4}})
    assert merged == {"ctx_size": 8192, "threads": 4, "spec": {"type": "draft-mtp", "draft_n_max": 2}}
    with pytest.raises(filters.AnsibleFilterError, match="'child' extends 'nope'"):
        filters.resolve_profile({"child": {"extends": "nope"}}, "child")
    with pytest.raises(filters.AnsibleFilterError, match="cycle a -> b -> a"):
        filters.resolve_profile({"a": {"extends": "b"}, "b": {"extends": "a"}}, "a")


def test_flags_one_per_line_as_the_study_serves() -> None:
    profile = {"host": "0.0.0.0", "n_gpu_layers": 99, "ctx_size": 8192, "cache_type_k": "f16", "cache_type_v": "f16",
               "flash_attn": "1", "threads": 6, "threads_batch": 12, "parallel": 1, "reasoning": False,
               "metrics": True, "override_tensor": r"blk\.(18|19|20|21|22|23)\.=CPU",
               "spec": {"type": "draft-mtp", "draft_n_max": 1}, "extra_args": ["--no-webui"]}
    lines = filters.server_flags(profile, model_path="/m/q.gguf", port=8084, alias="qwen",
                                 api_key_file="/etc/llama-server/api-key")
    assert lines == ["--model /m/q.gguf", "--alias qwen", "--host 0.0.0.0", "--port 8084", "-ngl 99", "-c 8192",
                     "-ctk f16", "-ctv f16", "-fa 1", "-t 6", "-tb 12", "--parallel 1", "--reasoning off",
                     "--metrics", r"-ot blk\.(18|19|20|21|22|23)\.=CPU", "--spec-type draft-mtp",
                     "--spec-draft-n-max 1", "--api-key-file /etc/llama-server/api-key", "--no-webui"]
    drafter = filters.server_flags({"spec": {"type": "draft-simple", "draft_n_max": 2, "draft_model": "d",
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


# ----------------------------------------------------------------------------------------------- lab helpers


def _remote(inv: Inventory, host: str, cmd: str, timeout: float = 60.0) -> str:
    with SshClient(SshTarget.from_host(inv.host(host))) as ssh:
        return ssh.run(cmd, timeout=timeout, check=True).stdout


def _pids(inv: Inventory, host: str, names: list[str]) -> dict[str, int]:
    return {name: state.main_pid for name, state in unit_states(inv.host(host), names).items()}


def _ask(inv: Inventory, host: str, server: str, api_key: str | None = None, port: int | None = None) -> str:
    """A greedy answer of instance ``server`` (or whatever listens on ``port``) on ``host``."""
    endpoint = Endpoint(f"http://{inv.host(host).address}:{port}", api_key) if port else \
        Endpoint.from_inventory(inv.host(host), server)
    with ServerClient(endpoint) as client:
        return client.chat(QUESTION, max_tokens=16).content


def _expected_build(inv: Inventory) -> str:
    pin = next(iter(inv.hosts.values())).llama_cpp.version  # b11434
    return f"b{pin.removeprefix('b')}-{pin}"


# ----------------------------------------------------------------------------------------------- lab


@pytest.mark.lab
def test_units_serve_the_pinned_build_and_answer(lab_served: Inventory) -> None:
    rows = [r for r in list_servers(lab_served) if r.enabled]
    assert {(r.host, r.name) for r in rows} >= {("desktop", "smollm2"), ("laptop", "smollm2")}
    for row in rows:
        assert row.state == "active" and row.main_pid > 0, row
        assert row.healthy and row.health == "ok", row
        assert row.build == _expected_build(lab_served), row
        assert row.model == f"/var/lib/rigctl/models/{row.artifact}.gguf", row
    for host in ("desktop", "laptop"):
        assert _ask(lab_served, host, "smollm2").strip()
        hardening = _remote(lab_served, host, "systemctl show -p ProtectSystem,PrivateDevices,NoNewPrivileges,User,"
                                              "DevicePolicy llama-server@smollm2.service").split()
        assert sorted(hardening) == ["DevicePolicy=closed", "NoNewPrivileges=yes", "PrivateDevices=no",
                                     "ProtectSystem=strict", "User=llama"]


def test_operator_start_clears_the_start_limit_first() -> None:
    units = ["llama-server@a.service", "llama-server@b c.service"]
    quoted = "llama-server@a.service 'llama-server@b c.service'"
    assert operator_start(units, "restart") == f"systemctl reset-failed {quoted}; systemctl restart {quoted}"


@pytest.mark.lab
def test_operator_restarts_beyond_the_start_limit_burst(lab_served: Inventory) -> None:
    """systemd's StartLimitBurst counts every start; restarts an operator asks for must not trip it."""
    defaults = yaml.safe_load((ROLE / "defaults" / "main.yml").read_text())
    burst = int(lab_served.host("desktop").vars.get("llama_server_start_limit_burst",
                                                    defaults["llama_server_start_limit_burst"]))
    pids = set()
    for _ in range(burst + 2):
        status = restart(lab_served, "desktop", "smollm2")
        assert status.state == "active" and status.healthy, status
        pids.add(status.main_pid)
    assert len(pids) == burst + 2  # every restart was a real one


@pytest.mark.lab
def test_second_provision_restarts_nothing(lab_served: Inventory) -> None:
    before = {h: _pids(lab_served, h, ["smollm2"]) for h in ("desktop", "laptop")}
    result = run_playbook(lab_served, "site.yml", tags=["llama_server"])
    result.raise_for_failures()
    assert {h: o.changed for h, o in result.hosts.items()} == {"desktop": 0, "laptop": 0}
    assert {h: _pids(lab_served, h, ["smollm2"]) for h in ("desktop", "laptop")} == before


def _extravars(inv: Inventory, lab_b: dict[str, Any], api_key: str) -> dict[str, Any]:
    """The lab's servers plus instance smollm2-b (profile lab-b) and an API key: test-only, as extra
    vars, so the shared inventory never changes."""
    v = inv.host("desktop").vars
    profiles = {**v["llama_server_profiles"], "lab-b": {"extends": "lab", **lab_b}}
    instances = {**v["llama_server_instances"],
                 "smollm2-b": {"artifact": "smollm2-135m-q4_1", "profile": "lab-b", "port": 8095}}
    return {"llama_server_profiles": profiles, "llama_server_instances": instances, "llama_server_api_key": api_key}


@pytest.mark.lab
def test_targeted_restart_failed_rollout_and_api_key(lab_served: Inventory) -> None:
    inv, key = lab_served, "lab-key-5f1d"
    try:
        # A second instance and an API key: every instance restarts (the key is theirs too).
        run_playbook(inv, "site.yml", limit="desktop", tags=["llama_server"],
                     extravars=_extravars(inv, {}, key)).raise_for_failures()
        base = f"http://{inv.host('desktop').address}"
        import httpx

        assert httpx.get(f"{base}:8080/health", timeout=10).status_code == 200
        assert httpx.get(f"{base}:8080/props", timeout=10).status_code == 401
        assert httpx.get(f"{base}:8080/props", timeout=10,
                         headers={"Authorization": f"Bearer {key}"}).status_code == 200
        key_file = _remote(inv, "desktop", "stat -c '%U %a' /etc/llama-server/api-key").strip()
        assert key_file == "root 640"

        # One profile flag changes: only its instance restarts.
        before = _pids(inv, "desktop", ["smollm2", "smollm2-b"])
        run_playbook(inv, "site.yml", limit="desktop", tags=["llama_server"],
                     extravars=_extravars(inv, {"ctx_size": 1024}, key)).raise_for_failures()
        after = _pids(inv, "desktop", ["smollm2", "smollm2-b"])
        assert after["smollm2"] == before["smollm2"]
        assert after["smollm2-b"] not in (0, before["smollm2-b"])
        answer = _ask(inv, "desktop", "smollm2-b", key, port=8095)

        # A broken flag: the rollout fails naming the instance with its journal, the previous
        # configuration is back and answers the same.
        with pytest.raises(DeployError) as failed:
            run_playbook(inv, "site.yml", limit="desktop", tags=["llama_server"],
                         extravars=_extravars(inv, {"ctx_size": 1024, "extra_args": ["--no-such-flag"]}, key)
                         ).raise_for_failures()
        message = str(failed.value)
        assert "llama-server@smollm2-b failed its rollout" in message
        assert "previous configuration restored and serving" in message
        assert "invalid argument: --no-such-flag" in message  # from the journal tail
        args = _remote(inv, "desktop", "cat /etc/llama-server/smollm2-b.args")
        assert "-c 1024" in args and "--no-such-flag" not in args
        assert _ask(inv, "desktop", "smollm2-b", key, port=8095) == answer
        assert _pids(inv, "desktop", ["smollm2"])["smollm2"] == before["smollm2"]
    finally:
        # The inventory as it is: smollm2-b goes away, the key file holds the inventory's key again.
        run_playbook(inv, "site.yml", limit="desktop", tags=["llama_server"]).raise_for_failures()
    key_file = ["api-key"] if inv.host("desktop").vars.get("llama_server_api_key") else []
    assert _remote(inv, "desktop", "ls /etc/llama-server").split() == sorted(
        [*key_file, *(f"{s.name}.{ext}" for s in inv.host("desktop").servers for ext in ("args", "bin", "env"))])
    assert unit_states(inv.host("desktop"), ["smollm2-b"])["smollm2-b"].active_state == "inactive"
    wait_healthy(inv)


@pytest.mark.lab
def test_systemd_restarts_a_killed_server(lab_served: Inventory) -> None:
    old = _pids(lab_served, "laptop", ["smollm2"])["smollm2"]
    _remote(lab_served, "laptop", f"kill -9 {old}")
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        state = unit_states(lab_served.host("laptop"), ["smollm2"])["smollm2"]
        if state.active_state == "active" and state.main_pid not in (0, old):
            break
        time.sleep(0.5)
    assert state.main_pid not in (0, old) and state.n_restarts >= 1, state
    wait_healthy(lab_served, timeout=60)
    assert _ask(lab_served, "laptop", "smollm2").strip()


@pytest.mark.lab
def test_servers_come_back_after_a_reboot(lab_served: Inventory) -> None:
    from rigctl.errors import RigctlError

    # PID 1's start time (in ticks since the machine booted) changes when the rig's systemd restarts.
    boot = "cut -d' ' -f22 /proc/1/stat"
    boot_id = _remote(lab_served, "laptop", boot).strip()
    with SshClient(SshTarget.from_host(lab_served.host("laptop"))) as ssh:
        ssh.run("systemctl reboot", timeout=30, check=False)
    deadline = time.monotonic() + 180
    new_boot = boot_id
    while time.monotonic() < deadline and new_boot == boot_id:
        time.sleep(2)
        try:
            new_boot = _remote(lab_served, "laptop", boot, timeout=10).strip()
        except RigctlError:
            continue
    assert new_boot != boot_id, "the laptop rig did not come back from its reboot"
    wait_healthy(lab_served, timeout=180)
    row = next(r for r in list_servers(lab_served, "laptop") if r.name == "smollm2")
    assert row.state == "active" and row.healthy and row.build == _expected_build(lab_served)


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
    vram = _load(ROLE / "library" / "llama_server_vram.py", "llama_server_vram")
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
