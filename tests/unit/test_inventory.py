"""Inventory loading through Ansible's loader, validation, and the `hosts` / `inventory check` CLI."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from inventory_support import edit_yaml

from rigctl.errors import ConfigError
from rigctl.inventory import Inventory
from rigctl.inventory.check import check

REPO = Path(__file__).resolve().parents[2]
ROLES = [REPO / "roles"]


def rigctl(*args: str, cwd: Path = REPO) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "rigctl.cli", *args], cwd=cwd, capture_output=True,
                          text=True, timeout=120)


def lines(inv_path: Path) -> list[str]:
    return [str(p) for p in check(Inventory.load(inv_path), ROLES) if p.severity == "error"]


def test_reference_rigs_load_with_their_pins_and_servers() -> None:
    inv = Inventory.load(REPO / "inventory" / "rigs")
    desktop, laptop = inv.hosts["desktop-3050"], inv.hosts["laptop-1650ti"]
    assert desktop.gpu is not None and desktop.gpu.compute_capability == "8.6" and desktop.gpu.vram_mib == 8192
    assert laptop.gpu is not None and laptop.gpu.cuda_arch == "75" and laptop.gpu.vram_mib == 4096
    assert desktop.llama_cpp.version == laptop.llama_cpp.version == "7182ef71e"
    assert {s.name for s in laptop.servers} == {s.name for s in desktop.servers} >= {"qwen", "gemma", "qwen-bf16"}
    assert desktop.vars["llama_server_profiles"]["rig"]["ctx_size"] == 131072
    bf16 = laptop.vars["llama_server_profile_overrides"]["rig-bf16"]
    assert bf16["override_tensor"] == r"blk\.(18|19|20|21|22|23)\.=CPU" and bf16["ctx_size"] == 8192
    assert lines(REPO / "inventory" / "rigs") == []


def test_lab_inventory_templates_paths_like_ansible() -> None:
    inv = Inventory.load(REPO / "inventory" / "lab")
    desktop = inv.hosts["desktop"]
    lab_dir = desktop.vars["rigctl_lab"]["dir"]
    assert str(desktop.key_file) == f"{lab_dir}/id_ed25519"
    assert str(desktop.known_hosts) == f"{lab_dir}/known_hosts"
    assert "{{" not in desktop.vars["llama_cpp_archive"]["path"]
    assert lines(REPO / "inventory" / "lab") == []


def test_unpinned_model_revision_is_a_warning_not_an_error() -> None:
    problems = check(Inventory.load(REPO / "inventory" / "rigs"), ROLES)
    warnings = [str(p) for p in problems if p.severity == "warning"]
    assert "group all: models_catalog.qwen3.5-2b.source.revision: warning: 'main' is a branch or tag, " \
           "not a pinned commit; the models role refuses to convert it until it is one (40 hex digits)" in warnings
    assert "group all: models_catalog.gemma-4-e2b-qat.source.revision: warning: 'main' is a branch or tag, " \
           "not a pinned commit" in warnings  # a ready GGUF file, not converted


def test_misspelled_variable_names_the_group_and_suggests(rigs: Path) -> None:
    edit_yaml(rigs / "group_vars/all/llama_cpp.yml", lambda d: d.update(llama_cpp_verison=d.pop("llama_cpp_version")))
    assert lines(rigs) == [
        "group all: llama_cpp_verison: unknown variable (did you mean llama_cpp_version?)",
        "host desktop-3050: llama_cpp_version: required but not set",
        "host laptop-1650ti: llama_cpp_version: required but not set",
    ]


def test_misspelled_profile_key_and_missing_key(rigs: Path) -> None:
    def change(d):
        d["llama_server_profiles"]["rig"]["ctx_szie"] = 4096
        del d["llama_server_instances"]["gemma"]["port"]

    edit_yaml(rigs / "group_vars/all/servers.yml", change)
    assert lines(rigs) == [
        "group all: llama_server_instances.gemma.port: required but not set",
        "group all: llama_server_profiles.rig.ctx_szie: unknown key",
    ]


# The laptop's own instance list (host_vars), with two instances on one port.
LAPTOP_CLASH = {"gemma": {"artifact": "gemma-4-e2b-qat-q4_0", "profile": "rig", "port": 8081},
                "qwen-bf16": {"artifact": "qwen3.5-2b-bf16", "profile": "rig-bf16", "port": 8081}}


def test_port_clash_is_reported_on_the_host_that_defines_it(rigs: Path) -> None:
    edit_yaml(rigs / "host_vars/laptop-1650ti.yml", lambda d: d.update(llama_server_instances=LAPTOP_CLASH))
    assert lines(rigs) == ["host laptop-1650ti: llama_server_instances.qwen-bf16.port: port 8081 is also used by gemma"]


def test_undefined_artifact_profile_and_drafter(rigs: Path) -> None:
    def change(d):
        d["llama_server_instances"]["qwen"]["artifact"] = "qwen3.5-2b-q8_0"
        d["llama_server_instances"]["gemma"]["profile"] = "fast"
        d["llama_server_profiles"]["rig-gemma-draft"]["spec"]["draft_model"] = "tiny-drafter"
        d["llama_server_profiles"]["rig"]["extends"] = "rig-race"  # rig-race extends rig: a cycle

    edit_yaml(rigs / "group_vars/all/servers.yml", change)
    got = lines(rigs)
    assert ("group all: llama_server_instances.qwen.artifact: 'qwen3.5-2b-q8_0' is not an artifact in "
            "models_catalog") in got
    assert "group all: llama_server_instances.gemma.profile: 'fast' is not in llama_server_profiles" in got
    assert ("group all: llama_server_profiles.rig-gemma-draft.spec.draft_model: 'tiny-drafter' is not an "
            "artifact in models_catalog") in got
    assert "group all: llama_server_profiles.rig.extends: cycle: rig -> rig-race -> rig" in got


def test_malformed_pins(rigs: Path) -> None:
    edit_yaml(rigs / "group_vars/all/llama_cpp.yml", lambda d: d.update(llama_cpp_version="v1.2-main"))
    edit_yaml(rigs / "host_vars/desktop-3050.yml", lambda d: d["gpu_host_gpu"].update(compute_capability="sm_86"))
    edit_yaml(rigs / "group_vars/all/models.yml",
         lambda d: d["models_catalog"]["qwen3.5-2b"]["artifacts"]["qwen3.5-2b-q4_0"].update({"from": "qwen-f16"}))
    got = lines(rigs)
    assert "group all: llama_cpp_version: 'v1.2-main' is not a commit hash (7 to 40 hex digits)" in got
    assert any(line.startswith("host desktop-3050: gpu_host_gpu.compute_capability: 'sm_86' is not a compute")
               for line in got), got
    assert ("group all: models_catalog.qwen3.5-2b.artifacts.qwen3.5-2b-q4_0.from: 'qwen-f16' is not an artifact "
            "of model qwen3.5-2b") in got


def test_archive_pin_needs_a_sha256(tmp_path: Path) -> None:
    lab = tmp_path / "lab"
    shutil.copytree(REPO / "inventory" / "lab", lab)
    edit_yaml(lab / "group_vars/all/llama_cpp.yml", lambda d: d["llama_cpp_archive"].update(sha256="deadbeef"))
    got = lines(lab)
    assert len(got) == 1 and got[0].startswith("group all: llama_cpp_archive.sha256: String should match pattern")


def test_cuda_wheel_pins_are_checked(tmp_path: Path) -> None:
    lab = tmp_path / "lab"
    shutil.copytree(REPO / "inventory" / "lab", lab)

    def spoil(data: dict) -> None:
        data["gpu_host_cuda_wheels"][0]["sha256"] = "deadbeef"
        del data["gpu_host_cuda_wheels"][1]["version"]
        data["gpu_host_cuda_source"] = "conda"

    edit_yaml(lab / "group_vars/all/cuda.yml", spoil)
    got = lines(lab)
    assert any(line.startswith("group all: gpu_host_cuda_wheels.0.sha256: String should match pattern") for line in got)
    assert "group all: gpu_host_cuda_wheels.1.version: required but not set" in got, got
    assert any(line.startswith("group all: gpu_host_cuda_source: Input should be 'apt' or 'wheels'") for line in got)


def test_select_unknown_host_is_a_one_line_config_error() -> None:
    inv = Inventory.load(REPO / "inventory" / "lab")
    assert [h.name for h in inv.select("lab")] == ["desktop", "laptop"]
    assert [h.name for h in inv.select("laptop")] == ["laptop"]
    with pytest.raises(ConfigError, match=r"unknown host or group 'dekstop' in --limit \(hosts: desktop, laptop\)"):
        inv.select("dekstop")


def test_cli_inventory_check_exit_codes(rigs: Path) -> None:
    ok = rigctl("-i", str(REPO / "inventory" / "lab"), "inventory", "check")
    assert ok.returncode == 0, ok.stderr
    assert "2 hosts, 0 errors, 0 warnings" in ok.stdout
    edit_yaml(rigs / "host_vars/laptop-1650ti.yml", lambda d: d.update(llama_server_instances=LAPTOP_CLASH))
    bad = rigctl("-i", str(rigs), "inventory", "check")
    assert bad.returncode == 2
    assert "host laptop-1650ti: llama_server_instances.qwen-bf16.port: port 8081 is also used by gemma" in bad.stderr
    assert "Traceback" not in bad.stderr


def test_cli_hosts_table_shows_gpu_pin_and_servers() -> None:
    out = rigctl("-i", str(REPO / "inventory" / "rigs"), "hosts")
    assert out.returncode == 0, out.stderr
    row = next(line for line in out.stdout.splitlines() if "laptop-1650ti" in line)
    for cell in ("laptop-1650ti.home.arpa", "NVIDIA GeForce GTX 1650 Ti", "7.5", "4 GiB", "7182ef71e (git)",
                 "gemma: gemma-4-e2b-qat-q4_0 :8081"):
        assert cell in row, (cell, row)


def test_cli_bad_inventory_path_and_unknown_limit_are_one_line_errors() -> None:
    missing = rigctl("-i", "/nonexistent/inv", "hosts")
    assert missing.returncode == 2
    assert missing.stderr.strip() == "error: inventory /nonexistent/inv: no such file or directory"
    limit = rigctl("-i", str(REPO / "inventory" / "lab"), "provision", "--limit", "dekstop")
    assert limit.returncode == 2
    assert limit.stderr.strip().splitlines() == [
        "error: unknown host or group 'dekstop' in --limit (hosts: desktop, laptop)"
    ]


def test_model_pins_must_be_sha256_of_known_artifacts(tmp_path: Path) -> None:
    lab = tmp_path / "lab"
    shutil.copytree(REPO / "inventory" / "lab", lab)
    edit_yaml(lab / "host_vars/laptop.yml", lambda d: d.update(models_pins={"smollm2-135m-q4_1": "abc123",
                                                                       "smollm2-135m-q8_0": "0" * 64},
                                                         models_pin_policy="ignore"))
    got = lines(lab)
    assert "host laptop: models_pins.smollm2-135m-q8_0: not an artifact in models_catalog" in got
    assert any(line.startswith("host laptop: models_pins.smollm2-135m-q4_1: String should match pattern")
               for line in got), got
    assert any(line.startswith("host laptop: models_pin_policy: Input should be 'fail' or 'warn'") for line in got), got


def test_problem_paths_keep_keys_named_like_union_tags(tmp_path: Path) -> None:
    lab = tmp_path / "lab"
    shutil.copytree(REPO / "inventory" / "lab", lab)

    def change(d):
        del d["models_catalog"]["smollm2-135m"]["artifacts"]["smollm2-135m-q4_1"]["file"]
        d["models_catalog"]["smollm2-135m"]["source"]["url"] = "http://example.invalid/x"

    edit_yaml(lab / "group_vars/all/models.yml", change)
    assert lines(lab) == [
        "group all: models_catalog.smollm2-135m.artifacts.smollm2-135m-q4_1.file: required but not set",
        "group all: models_catalog.smollm2-135m.source.url: unknown key",
    ]


def _vault_inventory(tmp_path: Path, password: str) -> Path:
    from ansible.parsing.vault import VaultLib, VaultSecret

    ciphertext = VaultLib([("default", VaultSecret(password.encode()))]).encrypt("hf_secret_token").decode()
    inv = tmp_path / "inv"
    (inv / "group_vars" / "all").mkdir(parents=True)
    (inv / "hosts.yml").write_text("all:\n  hosts:\n    rig:\n      ansible_host: 127.0.0.1\n")
    (inv / "group_vars" / "all" / "secrets.yml").write_text(
        "models_hf_token: !vault |\n" + "".join(f"  {line}\n" for line in ciphertext.splitlines()))
    return inv


def test_vault_values_decrypt_with_the_password_file_ansible_uses(tmp_path: Path, monkeypatch) -> None:
    inv = _vault_inventory(tmp_path, "correct horse")
    (tmp_path / "vault-pass").write_text("correct horse\n")
    monkeypatch.setenv("ANSIBLE_VAULT_PASSWORD_FILE", str(tmp_path / "vault-pass"))
    assert Inventory.load(inv).host("rig").vars["models_hf_token"] == "hf_secret_token"


def test_vault_value_without_its_password_names_the_key(tmp_path: Path, monkeypatch) -> None:
    inv = _vault_inventory(tmp_path, "another password")
    (tmp_path / "wrong-pass").write_text("not it\n")
    monkeypatch.setenv("ANSIBLE_VAULT_PASSWORD_FILE", str(tmp_path / "wrong-pass"))
    with pytest.raises(ConfigError, match=r"^host rig: models_hf_token: .*decrypt"):
        Inventory.load(inv)
