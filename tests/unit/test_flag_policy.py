"""The dangerous-flag policy and one-line profile values: a profile whose arguments carry a flag that hands the
model or the network more power is refused by `inventory check` and `provision` unless the inventory allows
it by name with a reason; a line break in a profile value never becomes a flag of its own."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from inventory_support import edit_yaml

from rigctl.errors import ConfigError
from rigctl.inventory import Inventory, flag_policy
from rigctl.inventory.check import check
from rigctl.inventory.profiles import ProfileError, server_flags

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture
def lab(lab_copy: Path) -> Path:
    return lab_copy


def servers_file(lab: Path) -> Path:
    return lab / "group_vars" / "all" / "servers.yml"


def set_profile(lab: Path, **values) -> None:
    edit_yaml(servers_file(lab), lambda d: d["llama_server_profiles"]["lab"].update(values))


def flag_problems(lab: Path) -> list:
    return [p for p in check(Inventory.load(lab))
            if p.key.startswith(("llama_server_instances.", flag_policy.ALLOWED_VAR)) and p.severity == "error"]


def test_the_lab_uses_no_dangerous_flag(lab: Path):
    assert flag_problems(lab) == []
    flag_policy.refuse_dangerous_flags(Inventory.load(lab).select(None))


@pytest.mark.parametrize(("extra", "cited"), [
    ("--rpc 10.0.0.2:50052", "ggml-org/llama.cpp#13061"),
    ("--rpc=10.0.0.2:50052", "ggml-org/llama.cpp#13061"),
    ("--slot-save-path /var/tmp/slots", "CVE-2026-43629"),
    ("--sleep-idle-seconds 300", "CVE-2026-43632"),
    ("--mcp-servers-config /etc/mcp.json", "ggml-org/llama.cpp#25736"),
    ("--tools all", "ggml-org/llama.cpp#20673"),
    ("--agent", "ggml-org/llama.cpp#20673"),
    ("--props", "POST /props"),
    ("--reranking", "CVE-2026-52132"),
])
def test_a_dangerous_flag_is_refused_citing_why_until_allowed_by_name(lab: Path, extra: str, cited: str):
    set_profile(lab, extra_args=[extra])
    problems = flag_problems(lab)
    # Every instance on the lab profile, on both hosts, once each.
    assert {(p.key, p.where) for p in problems} >= {("llama_server_instances.smollm2", "group all")}
    flag = flag_policy.dangerous(flag_policy.flag_name(extra))
    assert flag is not None
    for problem in problems:
        assert problem.message.startswith(flag_policy.flag_name(extra))
        assert cited in problem.message and f"naming {flag.flag} in rigctl_allowed_server_flags" in problem.message
    with pytest.raises(ConfigError, match=r"host desktop: llama_server_instances\.smollm2: ") as refused:
        flag_policy.refuse_dangerous_flags(Inventory.load(lab).select(None))
    assert "\n" not in str(refused.value)

    edit_yaml(servers_file(lab), lambda d: d.update(rigctl_allowed_server_flags={flag.flag: "reviewed: lab only"}))
    assert flag_problems(lab) == []
    flag_policy.refuse_dangerous_flags(Inventory.load(lab).select(None))


def test_rerank_is_refused_only_beyond_loopback(lab: Path):
    set_profile(lab, extra_args=["--rerank"])  # the lab binds 0.0.0.0
    assert [p for p in flag_problems(lab) if "--rerank on 0.0.0.0" in p.message]
    set_profile(lab, host="127.0.0.1")
    assert flag_problems(lab) == []
    flag_policy.refuse_dangerous_flags(Inventory.load(lab).select(None))
    # A host's bind address wins over the profile's: exposing it brings the refusal back.
    edit_yaml(lab / "host_vars" / "desktop.yml", lambda d: d.update(llama_server_bind_address="192.0.2.7"))
    with pytest.raises(ConfigError, match=r"host desktop: .*--rerank on 192\.0\.2\.7"):
        flag_policy.refuse_dangerous_flags(Inventory.load(lab).select(None))


def test_an_allowance_must_name_a_flag_of_the_policy_with_a_reason(lab: Path):
    edit_yaml(servers_file(lab), lambda d: d.update(rigctl_allowed_server_flags={"--jinja": "why not"}))
    bad = flag_problems(lab)
    assert [p.key for p in bad] == ["rigctl_allowed_server_flags"] and "not a flag of the dangerous-flag" in \
        bad[0].message
    with pytest.raises(ConfigError, match="give the reason"):
        flag_policy.allowed_flags({"--rpc": " "}, "host h")


def test_ordinary_flags_pass_and_the_flag_is_read_as_the_launcher_reads_it():
    assert flag_policy.server_refusals(["--model /m.gguf", "--host 0.0.0.0", "--jinja", "-fa on",
                                        "--metrics", "--rpc-hint x"], "0.0.0.0", {}) == []
    assert flag_policy.flag_name("--rpc=a:1") == "--rpc" and flag_policy.flag_name("--rpc a:1") == "--rpc"


@pytest.mark.parametrize("values", [
    {"alias": "smol\n--rpc 10.0.0.2:50052"},
    {"extra_args": ["--jinja\n--tools all"]},
    {"override_tensor": "exps=CPU\r--props"},
    {"host": "0.0.0.0\n--props"},
])
def test_a_line_break_in_a_profile_value_is_refused_and_never_adds_a_flag(lab: Path, values: dict):
    set_profile(lab, **values)
    key = next(iter(values))
    problems = [p for p in check(Inventory.load(lab)) if p.key.startswith(f"llama_server_profiles.lab.{key}")]
    assert any("would add a flag" in p.message for p in problems)
    # provision reads the same plan before any play: it cannot be made, so nothing is written.
    with pytest.raises(ConfigError, match="would add a flag to the arguments file"):
        flag_policy.refuse_dangerous_flags(Inventory.load(lab).select(None))
    with pytest.raises(ProfileError, match="would add a flag"):
        server_flags(values, model_path="/m.gguf", port=8080, alias="a")


def test_provision_refuses_a_dangerous_flag_in_one_line_before_any_play(lab: Path):
    set_profile(lab, extra_args=["--slot-save-path /srv/slots"])
    before = servers_file(lab).read_bytes()
    done = subprocess.run([sys.executable, "-m", "rigctl.cli", "-i", str(lab), "provision", "--check"],
                          capture_output=True, text=True, timeout=120, cwd=REPO)
    assert done.returncode == 2, done.stderr
    lines = done.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: host desktop: llama_server_instances.smollm2: "
                                                   "--slot-save-path lets clients")
    assert "TASK" not in done.stdout  # no play ran
    assert servers_file(lab).read_bytes() == before
