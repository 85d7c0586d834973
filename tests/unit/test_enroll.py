"""`rigctl hosts add|remove|probe` without the lab: the probe's parser on the stand-in nvidia-smi's real
output, first contact against a real SSH server on loopback (paramiko's), the inventory edited round
trip. The end-to-end enrolment of a stranger rig is tests/test_enroll_lab.py."""

from __future__ import annotations

import io
import json
import re
import shutil
import socket
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

import paramiko
import pytest

from rigctl.errors import ConfigError, EnrollError, HostKeyError, ProbeError
from rigctl.fleet.enroll import (
    InventoryFiles,
    check_fingerprint_option,
    first_contact,
    remove_host,
    remove_known_host,
)
from rigctl.fleet.host_facts import drift, inventory_vars, parse_probe, probe_command, read_cpu
from rigctl.hostside import cpuinfo
from rigctl.inventory import Inventory
from rigctl.inventory.check import check
from rigctl.inventory.edit import round_trip_yaml

REPO = Path(__file__).resolve().parents[2]
ROLES = [REPO / "roles"]
STAND_IN = REPO / "rigctl" / "lab" / "assets" / "nvidia-smi"

TWO_GPUS = {
    "name": "Lab stand-in for RTX 3090", "memory_total_mib": 24576, "compute_cap": "8.6", "uuid": "GPU-aaaa",
    "driver_version": "550.54.15", "cuda_version": "12.4", "temperature": 35, "temperature_sequence": [],
    "memory_used_mib": 0, "utilization_gpu": 0, "persistence_mode": False, "pci_bus_id": "00000000:01:00.0",
    "additional_gpus": [{"name": "Lab stand-in for GTX 1650 Ti", "memory_total_mib": 4096, "compute_cap": "7.5",
                         "uuid": "GPU-bbbb", "pci_bus_id": "00000000:02:00.0"}],
}


# --- the probe ----------------------------------------------------------------------------------


@pytest.fixture
def smi_path(tmp_path: Path) -> dict[str, str]:
    """An environment whose nvidia-smi is the lab's stand-in with two GPUs."""
    bindir = tmp_path / "bin"
    bindir.mkdir()
    shutil.copy(STAND_IN, bindir / "nvidia-smi")
    (bindir / "nvidia-smi").chmod(0o755)
    state = tmp_path / "gpu.json"
    state.write_text(json.dumps(TWO_GPUS))
    return {"PATH": f"{bindir}:/usr/bin:/bin", "RIGCTL_LAB_GPU_STATE": str(state)}


def run_probe(env: dict[str, str], token: str = "t0k3n") -> str:
    return subprocess.run(["sh", "-c", probe_command(token)], capture_output=True, text=True, env=env,
                          timeout=30, check=True).stdout


def test_probe_reads_every_gpu_and_the_machine(smi_path: dict[str, str]) -> None:
    facts = parse_probe("new", run_probe(smi_path), "t0k3n")
    assert [(g.index, g.name, g.vram_mib, g.compute_capability, g.uuid) for g in facts.gpus] == [
        (0, "Lab stand-in for RTX 3090", 24576, "8.6", "GPU-aaaa"),
        (1, "Lab stand-in for GTX 1650 Ti", 4096, "7.5", "GPU-bbbb"),
    ]
    assert (facts.driver_version, facts.cuda_version) == ("550.54.15", "12.4")
    assert facts.cuda_architectures == "75;86"
    cpuinfo = Path("/proc/cpuinfo").read_text()
    assert facts.cpu_model in cpuinfo and facts.cpus >= 1
    # This machine's CPU: its flags are reported as they are, no more (no AVX-512 here unless it has it).
    assert ("avx2" in facts.cpu_flags) == (" avx2" in cpuinfo)
    assert ("avx512f" in facts.cpu_flags) == (" avx512f" in cpuinfo)
    meminfo_kib = int(Path("/proc/meminfo").read_text().split()[1])
    assert facts.memory_mib == meminfo_kib // 1024
    assert facts.disk_free_mib > 0 and facts.os

    written = inventory_vars(facts)
    assert written["gpu_host_gpu"] == {"name": "Lab stand-in for RTX 3090", "vram_mib": 24576,
                                       "compute_capability": "8.6"}
    assert [g["index"] for g in written["gpu_host_gpus"]] == [0, 1]
    assert written["llama_cpp_cuda_architectures"] == "75;86"
    assert "disk_free_mib" not in written["rigctl_host_facts"]  # shown, not recorded: it moves on its own


def test_one_gpu_gets_no_gpu_list(smi_path: dict[str, str], tmp_path: Path) -> None:
    state = dict(TWO_GPUS, additional_gpus=[])
    Path(smi_path["RIGCTL_LAB_GPU_STATE"]).write_text(json.dumps(state))
    facts = parse_probe("new", run_probe(smi_path), "t0k3n")
    assert len(facts.gpus) == 1
    assert "gpu_host_gpus" not in inventory_vars(facts)
    assert inventory_vars(facts)["llama_cpp_cuda_architectures"] == "86"


def test_probe_refuses_what_it_cannot_vouch_for(smi_path: dict[str, str]) -> None:
    good = run_probe(smi_path)
    with pytest.raises(ProbeError, match="incomplete"):
        parse_probe("new", good, "another-token")  # a host cannot forge sections without the token
    with pytest.raises(ProbeError, match="incomplete"):
        parse_probe("new", good.split("### t0k3n os")[0], "t0k3n")
    bad_cc = good.replace(", 8.6, ", ", 8.x, ", 1)
    with pytest.raises(ProbeError, match=r"new: probe: gpus\[0\]\.compute_capability: '8\.x'"):
        parse_probe("new", bad_cc, "t0k3n")
    no_cuda = good.replace("CUDA Version", "CUDA Vers1on")
    with pytest.raises(ProbeError, match="cuda_version"):
        parse_probe("new", no_cuda, "t0k3n")
    twice = good.replace("### t0k3n cpus", "### t0k3n gpus", 1)
    with pytest.raises(ProbeError, match="unexpected section 'gpus'"):
        parse_probe("new", twice, "t0k3n")


def test_probe_names_a_missing_driver(tmp_path: Path) -> None:
    env = {"PATH": "/usr/bin:/bin"}  # no nvidia-smi at all
    with pytest.raises(ProbeError, match="gpus: nvidia-smi failed"):
        parse_probe("new", run_probe(env), "t0k3n")


def test_drift_names_changed_and_missing_values() -> None:
    recorded = {"gpu_host_gpu": {"name": "A", "vram_mib": 8192, "compute_capability": "8.6"},
                "rigctl_host_facts": {"driver_version": "535", "cpus": 8}, "ansible_user": "rigctl"}
    observed = {"gpu_host_gpu": {"name": "A", "vram_mib": 8192, "compute_capability": "8.9"},
                "rigctl_host_facts": {"driver_version": "550", "cpus": 8},
                "gpu_host_gpus": [{"index": 0}]}
    assert drift(recorded, observed) == [
        ("gpu_host_gpu.compute_capability", "8.6", "8.9"),
        ("rigctl_host_facts.driver_version", "535", "550"),
        ("gpu_host_gpus", None, [{"index": 0}]),
    ]


# --- first contact --------------------------------------------------------------------------------


class _Server(paramiko.ServerInterface):
    def __init__(self) -> None:
        self.auth_attempts: list[str] = []

    def get_allowed_auths(self, username: str) -> str:
        return "password"

    def check_auth_password(self, username: str, password: str) -> int:
        self.auth_attempts.append(username)
        return paramiko.AUTH_FAILED


@pytest.fixture
def ssh_server() -> Iterator[tuple[int, paramiko.PKey, _Server]]:
    """A real SSH server on loopback (paramiko's) that records every authentication attempt."""
    key = paramiko.ECDSAKey.generate()
    server = _Server()
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(8)
    listener.settimeout(0.2)
    stop = threading.Event()

    def serve() -> None:
        while not stop.is_set():
            try:
                conn, _ = listener.accept()
            except TimeoutError:
                continue
            transport = paramiko.Transport(conn)
            transport.add_server_key(key)
            try:
                transport.start_server(server=server)
                transport.accept(1)
            except (paramiko.SSHException, EOFError, OSError):
                pass
            finally:
                transport.close()

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    yield listener.getsockname()[1], key, server
    stop.set()
    thread.join(5)
    listener.close()


def test_wrong_fingerprint_is_refused_before_any_authentication(ssh_server, tmp_path: Path) -> None:
    port, key, server = ssh_server
    known = tmp_path / "known_hosts"
    wrong = "SHA256:" + "A" * 43
    expected = re.escape(f"presented ecdsa-sha2-nistp256 {key.fingerprint}, not the expected")
    with pytest.raises(HostKeyError, match=expected):
        first_contact("new", "127.0.0.1", port, known, fingerprint=wrong, confirm=lambda *_: True)
    assert not known.exists() and server.auth_attempts == []

    with pytest.raises(HostKeyError, match="not confirmed"):
        first_contact("new", "127.0.0.1", port, known, fingerprint=None, confirm=lambda *_: False)
    assert not known.exists()


def test_matching_fingerprint_writes_known_hosts_once(ssh_server, tmp_path: Path) -> None:
    port, key, server = ssh_server
    known = tmp_path / "known_hosts"
    known.write_text("other.example ssh-ed25519 AAAAC3NzaC1lZDI1NTE5AAAAIOMqqnkVzrm0SdG6UOoqKLsabgH5C9okWi0dh2l9GKJl\n")
    shown: list[tuple[str, str]] = []
    contact = first_contact("new", "127.0.0.1", port, known, fingerprint=None,
                            confirm=lambda kind, fp: shown.append((kind, fp)) or True)
    assert contact.written and shown == [("ecdsa-sha2-nistp256", key.fingerprint)]
    lines = known.read_text().splitlines()
    assert lines[0].startswith("other.example ")
    assert lines[1] == f"[127.0.0.1]:{port},[new]:{port} ecdsa-sha2-nistp256 {key.get_base64()}"
    # paramiko (as rigctl's own SSH reads the file) finds it under both names.
    keys = paramiko.HostKeys(str(known))
    assert keys.lookup(f"[new]:{port}")["ecdsa-sha2-nistp256"] == key

    again = first_contact("new", "127.0.0.1", port, known, fingerprint="SHA256:" + "B" * 43,
                          confirm=lambda *_: pytest.fail("asked again"))
    assert not again.written and len(known.read_text().splitlines()) == 2
    assert server.auth_attempts == []

    assert remove_known_host(known, {f"[new]:{port}", f"[127.0.0.1]:{port}"})
    assert known.read_text().splitlines() == lines[:1]


def test_a_different_key_for_a_known_host_is_refused(ssh_server, tmp_path: Path) -> None:
    port, _key, _server = ssh_server
    other = paramiko.ECDSAKey.generate()
    known = tmp_path / "known_hosts"
    known.write_text(f"[127.0.0.1]:{port} ecdsa-sha2-nistp256 {other.get_base64()}\n")
    before = known.read_text()
    with pytest.raises(HostKeyError, match="differs from the key"):
        first_contact("new", "127.0.0.1", port, known, fingerprint=None, confirm=lambda *_: True)
    assert known.read_text() == before


def test_nothing_listening_is_one_error(tmp_path: Path) -> None:
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    sock.close()
    with pytest.raises(EnrollError, match=f"new: cannot reach 127.0.0.1:{port}"):
        first_contact("new", "127.0.0.1", port, tmp_path / "kh", fingerprint=None, confirm=lambda *_: True)


def test_fingerprint_option_is_checked() -> None:
    assert check_fingerprint_option("SHA256:" + "x" * 43)
    with pytest.raises(ConfigError, match="--fingerprint 'MD5:aa'"):
        check_fingerprint_option("MD5:aa")


# --- the inventory files --------------------------------------------------------------------------


def test_host_joins_its_group_keeping_comments_and_order(lab_copy: Path) -> None:
    hosts = lab_copy / "hosts.yml"
    before = hosts.read_text()
    files = InventoryFiles(lab_copy, ROLES)
    assert files.add_to_group("newrig", "lab", {"ansible_host": "10.213.0.13"})
    facts = {"gpu_host_gpu": {"name": "X", "vram_mib": 4096, "compute_capability": "7.5"},
             "gpu_host_gpus": [{"index": 0, "name": "X", "vram_mib": 4096, "compute_capability": "7.5"},
                               {"index": 1, "name": "Y", "vram_mib": 8192, "compute_capability": "8.6"}],
             "llama_cpp_cuda_architectures": "75;86", "ansible_user": "rigctl"}
    assert files.update_host_vars("newrig", facts)
    assert hosts.read_text() == before  # staged: nothing lands before the commit
    assert files.commit() == [hosts, lab_copy / "host_vars" / "newrig.yml"]
    after = hosts.read_text()
    assert after.startswith(before.split("all:")[0])  # the header comment stays
    assert after.index("desktop:") < after.index("laptop:") < after.index("newrig:")
    inv = Inventory.load(lab_copy)
    assert inv.hosts["newrig"].groups == ("all", "gpu_hosts", "lab") or "lab" in inv.hosts["newrig"].groups
    assert inv.hosts["newrig"].vars["gpu_host_gpus"][1]["name"] == "Y"
    assert [str(p) for p in check(inv, ROLES) if p.severity == "error"] == []

    # The same values again: no file is touched.
    again = InventoryFiles(lab_copy, ROLES)
    assert not again.update_host_vars("newrig", facts)
    with pytest.raises(EnrollError, match="already in"):
        again.add_to_group("newrig", "lab", {"ansible_host": "10.213.0.13"})
    assert again.changed == [] and again.commit() == []

    # A hand edit in host_vars survives an update.
    vars_file = lab_copy / "host_vars" / "newrig.yml"
    vars_file.write_text(vars_file.read_text() + "# kept: a note by hand\nllama_server_bind_address: 127.0.0.1\n")
    files = InventoryFiles(lab_copy, ROLES)
    assert files.update_host_vars("newrig", {**facts, "llama_cpp_cuda_architectures": "75"})
    files.commit()
    text = vars_file.read_text()
    assert "# kept: a note by hand" in text and "llama_server_bind_address: 127.0.0.1" in text
    assert "llama_cpp_cuda_architectures: '75'" in text or 'llama_cpp_cuda_architectures: "75"' in text

    result = remove_host(Inventory.load(lab_copy), "newrig")
    assert result.hosts_file and result.host_vars
    assert hosts.read_text() == before and not vars_file.exists()


def test_new_group_goes_under_all_and_an_entry_that_fails_the_check_lands_nowhere(lab_copy: Path) -> None:
    hosts = lab_copy / "hosts.yml"
    before = hosts.read_text()
    files = InventoryFiles(lab_copy, ROLES, what="newrig's entry")
    files.add_to_group("newrig", "spare", {"ansible_host": "10.213.0.14"})
    files.update_host_vars("newrig", {"ansible_user": "rigctl", "llama_server_bind_adress": "0.0.0.0"})
    with pytest.raises(ConfigError, match=r"^newrig's entry: refused, nothing written: .*host newrig: "
                                          r"llama_server_bind_adress: unknown variable"):
        files.commit()
    assert hosts.read_text() == before and not (lab_copy / "host_vars" / "newrig.yml").exists()
    files = InventoryFiles(lab_copy, ROLES)
    files.add_to_group("newrig", "spare", {"ansible_host": "10.213.0.14"})
    files.update_host_vars("newrig", {"ansible_user": "rigctl"})
    files.commit()
    assert "spare" in Inventory.load(lab_copy).hosts["newrig"].groups


def test_instance_gpu_pin_is_checked(lab_copy: Path) -> None:
    (lab_copy / "host_vars" / "desktop.yml").write_text(
        "gpu_host_gpu: {name: A, vram_mib: 8192, compute_capability: '8.6'}\n"
        "gpu_host_gpus:\n"
        "  - {index: 0, name: A, vram_mib: 8192, compute_capability: '8.6'}\n"
        "  - {index: 1, name: B, vram_mib: 4096, compute_capability: '7.5'}\n"
        "llama_server_instances:\n"
        "  smollm2: {artifact: smollm2-135m-q4_1, profile: lab, port: 8080, gpu: 1}\n"
        "  other: {artifact: smollm2-135m-q4_1, profile: lab, port: 8081, gpu: 2}\n")
    errors = [str(p) for p in check(Inventory.load(lab_copy), ROLES) if p.severity == "error"]
    assert errors == ["host desktop: llama_server_instances.other.gpu: GPU 2 does not exist: this host has 2 "
                      "(gpu_host_gpus indexes 0..1)"]


def test_cli_add_needs_one_way_in(lab_copy: Path) -> None:
    out = subprocess.run([sys.executable, "-m", "rigctl.cli", "-i", str(lab_copy), "hosts", "add", "x", "10.0.0.1"],
                         capture_output=True, text=True, timeout=60, cwd=REPO)
    assert out.returncode == 2 and out.stderr.strip() == "error: give exactly one of --ask-pass or --key FILE"


def test_lab_config_knows_a_stranger_rig_until_it_is_enrolled(lab_copy: Path) -> None:
    from ruamel.yaml import YAML

    from rigctl.errors import LabError
    from rigctl.lab.rigs import Lab

    yaml = YAML()
    lab_vars = lab_copy / "group_vars" / "all" / "lab.yml"
    data = yaml.load(lab_vars.read_text())
    gpus = [{"name": "A", "vram_mib": 16384, "compute_capability": "8.9"},
            {"name": "B", "vram_mib": 8192, "compute_capability": "8.6"}]
    data["rigctl_lab"]["unenrolled"] = {"spare": {"address": "10.213.{{ rigctl_lab_slot }}.13", "gpus": gpus}}
    with lab_vars.open("w") as f:
        yaml.dump(data, f)
    lab = Lab.from_inventory(Inventory.load(lab_copy))
    desktop, spare = lab.rig("desktop"), lab.rig("spare")
    assert not desktop.stranger and desktop.enrolled and desktop.gpu.additional_gpus == ()
    assert spare.stranger and not spare.enrolled and spare.user == "root" and spare.address.endswith(".13")
    assert (spare.gpu.name, spare.gpu.compute_cap) == ("A", "8.9")
    assert [(g["name"], g["compute_cap"], g["pci_bus_id"]) for g in spare.gpu.additional_gpus] == [
        ("B", "8.6", "00000000:02:00.0")]
    assert json.loads(spare.gpu.to_json())["additional_gpus"][0]["memory_total_mib"] == 8192
    with pytest.raises(LabError, match="spare is not enrolled yet"):
        lab.ssh_argv("spare")

    files = InventoryFiles(lab_copy, ROLES)
    files.add_to_group("spare", "lab", {"ansible_host": spare.address})
    files.update_host_vars("spare", {"ansible_user": "rigctl", "gpu_host_gpu": gpus[0]})
    files.commit()
    enrolled = Lab.from_inventory(Inventory.load(lab_copy)).rig("spare")
    assert enrolled.stranger and enrolled.enrolled and enrolled.user == "rigctl"
    assert "rigctl@" in " ".join(Lab.from_inventory(Inventory.load(lab_copy)).ssh_argv("spare"))


def test_add_asks_for_the_password_only_after_the_host_key_is_vouched_for(ssh_server, lab_copy: Path) -> None:
    from rigctl.fleet.enroll import AddOptions, add_host

    port, _key, server = ssh_server
    before = {p: p.read_text() for p in lab_copy.rglob("*.yml")}
    options = AddOptions(name="new", address="127.0.0.1", port=port, ask_pass=True, fingerprint="SHA256:" + "A" * 43,
                         group="lab")
    with pytest.raises(HostKeyError, match="refused, nothing sent"):
        add_host(Inventory.load(lab_copy), options, confirm=lambda *_: True,
                 ask_password=lambda: pytest.fail("asked for the password"))
    assert server.auth_attempts == []
    assert {p: p.read_text() for p in lab_copy.rglob("*.yml")} == before


# --- what a host says is data ---------------------------------------------------------------------

PAYLOAD = "{{ lookup('pipe', 'touch MARKER') }}Debian"


REAL_CPUINFO = sorted((Path(__file__).resolve().parents[1] / "fixtures" / "real" / "cpuinfo").glob("*.txt"))


@pytest.mark.parametrize("capture", REAL_CPUINFO, ids=lambda p: p.name)
def test_the_probes_cpu_lines_read_as_the_whole_file(capture: Path, tmp_path: Path) -> None:
    # The probe sends only some lines of /proc/cpuinfo (the shell of cpuinfo.probe_command, run here on a
    # recorded real file); read, they must give what the whole file gives.
    whole = capture.read_text().partition("\n")[2]
    (tmp_path / "cpuinfo").write_text(whole)
    sent = subprocess.run(["sh", "-c", cpuinfo.probe_command(str(tmp_path / "cpuinfo"))], capture_output=True,
                          text=True, timeout=30, check=True).stdout
    assert len(sent) <= len(whole)
    assert read_cpu("h", sent) == read_cpu("h", whole)


def test_an_arm_host_without_a_part_line_is_refused_in_one_line() -> None:
    with pytest.raises(ProbeError, match=r"^h: probe: cpu_model: /proc/cpuinfo names no model and no CPU part$"):
        read_cpu("h", "processor\t: 0\nFeatures\t: fp asimd\n")


def with_section(output: str, name: str, body: str, token: str = "t0k3n") -> str:
    """``output`` of the probe with section ``name``'s lines replaced by ``body``."""
    head, rest = output.split(f"### {token} {name}\n", 1)
    _old, tail = rest.split(f"\n### {token} ", 1)
    return f"{head}### {token} {name}\n{body}\n### {token} {tail}"


@pytest.mark.parametrize(("section", "body", "field"), [
    ("os", f'PRETTY_NAME="{PAYLOAD}"', "os"),
    ("os", 'PRETTY_NAME="Debian {% if 1 %}x{% endif %}"', "os"),
    ("os", 'PRETTY_NAME="Debian {# note #}"', "os"),
    ("cpu", f"model name\t: {PAYLOAD}\nflags\t: avx2", "cpu_model"),
    ("cpu", "model name\t: Intel\x1b]0;owned\x07 Xeon\nflags\t: avx2", "cpu_model"),
    ("os", f'PRETTY_NAME="{"x" * 129}"', "os"),
])
def test_probe_refuses_text_that_is_not_plain_data(smi_path: dict[str, str], section: str, body: str,
                                                   field: str) -> None:
    output = with_section(run_probe(smi_path), section, body)
    with pytest.raises(ProbeError, match=rf"^new: probe: {field}: ") as raised:
        parse_probe("new", output, "t0k3n")
    assert "\n" not in str(raised.value)


def test_probe_refuses_a_gpu_name_with_a_template(smi_path: dict[str, str]) -> None:
    state = dict(TWO_GPUS, name="RTX {{ 7*7 }}")
    Path(smi_path["RIGCTL_LAB_GPU_STATE"]).write_text(json.dumps(state))
    with pytest.raises(ProbeError, match=r"new: probe: gpus\[0\]\.name: template marker '\{\{'"):
        parse_probe("new", run_probe(smi_path), "t0k3n")


def test_probe_keeps_odd_but_printable_text_as_it_is(smi_path: dict[str, str]) -> None:
    state = dict(TWO_GPUS, name="RTX [bold]3090[/] } { $(id) é")
    Path(smi_path["RIGCTL_LAB_GPU_STATE"]).write_text(json.dumps(state))
    output = with_section(run_probe(smi_path), "os", "PRETTY_NAME='Debian [/] 12'")
    facts = parse_probe("new", output, "t0k3n")
    assert (facts.gpus[0].name, facts.os) == ("RTX [bold]3090[/] } { $(id) é", "Debian [/] 12")


def host_facts(name: str = "RTX 3090", os_name: str = "Debian GNU/Linux 12 (bookworm)") -> dict[str, object]:
    from rigctl.fleet.host_facts import GpuFacts, HostFacts, HostText

    gpu = GpuFacts(0, HostText(name), 24576, "8.6", HostText("GPU-aaaa"))
    return inventory_vars(HostFacts(gpus=(gpu,), driver_version="550", cuda_version="12.4",
                                    cpu_model=HostText("Intel Xeon"), cpu_flags=("avx2",), cpus=8,
                                    memory_mib=32000, disk_free_mib=1, os=HostText(os_name)))


def land_unchecked(files: InventoryFiles) -> None:
    """What ``files`` stages, written as a hand edit would write it: past ``inventory check``."""
    for path in files.changed:
        buffer = io.StringIO()
        round_trip_yaml().dump(files.edit.read(path), buffer)
        path.write_text(buffer.getvalue())


def test_host_text_is_written_unsafe_and_read_back_literally(lab_copy: Path) -> None:
    vars_file = lab_copy / "host_vars" / "newrig.yml"
    files = InventoryFiles(lab_copy, ROLES)
    files.add_to_group("newrig", "lab", {"ansible_host": "10.213.0.13"})
    # Text a probe refuses, written as if it had not: the writer's check refuses it, and even past that
    # only the tag stands between it and the templar.
    facts = host_facts(name="RTX {{ 7*7 }}", os_name=PAYLOAD.replace("MARKER", str(lab_copy / "marker")))
    assert files.update_host_vars("newrig", facts)
    with pytest.raises(ConfigError, match=r"host newrig: gpu_host_gpu\.name: template marker"):
        files.commit()
    assert not vars_file.exists()
    land_unchecked(files)
    text = vars_file.read_text()
    assert "name: !unsafe 'RTX {{ 7*7 }}'" in text and "os: !unsafe '{{ lookup(" in text
    # Pattern-checked values keep their plain type: Ansible would load `!unsafe '8.6'` as a float.
    assert "compute_capability: '8.6'" in text and "driver_version: '550'" in text

    host = Inventory.load(lab_copy).hosts["newrig"]
    assert host.vars["gpu_host_gpu"]["name"] == "RTX {{ 7*7 }}"
    assert host.gpu is not None and host.gpu.name == "RTX {{ 7*7 }}"
    assert host.vars["rigctl_host_facts"]["os"].startswith("{{ lookup(")
    assert host.vars["rigctl_host_facts"]["driver_version"] == "550"
    assert not (lab_copy / "marker").exists()
    # Written again: no change, the tags included.
    assert not InventoryFiles(lab_copy, ROLES).update_host_vars("newrig", facts)


def test_facts_written_untagged_are_never_templated_and_are_retagged(lab_copy: Path) -> None:
    files = InventoryFiles(lab_copy, ROLES)
    files.add_to_group("newrig", "lab", {"ansible_host": "10.213.0.13"})
    files.commit()
    marker = lab_copy / "marker"
    vars_file = lab_copy / "host_vars" / "newrig.yml"
    # As rigctl wrote facts before it tagged them: verbatim, a template to any loader that templates.
    vars_file.write_text(f"# by hand\ngpu_host_gpu:\n  name: \"RTX {{{{ 7*7 }}}}\"\n  vram_mib: 8192\n"
                         f"  compute_capability: '8.6'\nrigctl_host_facts:\n"
                         f"  os: \"{PAYLOAD.replace('MARKER', str(marker))}\"\n")
    host = Inventory.load(lab_copy).hosts["newrig"]
    assert host.gpu is not None and host.gpu.name == "RTX {{ 7*7 }}"
    assert not marker.exists()
    problems = [str(p) for p in check(Inventory.load(lab_copy), ROLES) if "template marker" in p.message]
    assert problems == [
        "host newrig: gpu_host_gpu.name: template marker '{{' in 'RTX {{ 7*7 }}': a host's text is data, "
        "never a template",
        f"host newrig: rigctl_host_facts.os: template marker '{{{{' in "
        f"{PAYLOAD.replace('MARKER', str(marker))!r}: a host's text is data, never a template",
    ]
    # The same values from a probe: rewritten tagged, the comment kept.
    facts = host_facts()
    files = InventoryFiles(lab_copy, ROLES)
    assert files.update_host_vars("newrig", facts)
    files.commit()
    text = vars_file.read_text()
    assert text.startswith("# by hand\n") and "name: !unsafe 'RTX 3090'" in text


def test_check_refuses_unprintable_and_overlong_facts(lab_copy: Path) -> None:
    files = InventoryFiles(lab_copy, ROLES)
    files.add_to_group("newrig", "lab", {"ansible_host": "10.213.0.13"})
    facts = host_facts(name="RTX\x1b[2J 3090", os_name="D" * 200)
    files.update_host_vars("newrig", facts)
    with pytest.raises(ConfigError, match=r"host newrig: gpu_host_gpu\.name: unprintable character .* \(and 1 more\)$"):
        files.commit()
    land_unchecked(files)
    problems = {p.key: p.message for p in check(Inventory.load(lab_copy), ROLES) if p.where == "host newrig"}
    assert problems["gpu_host_gpu.name"] == "unprintable character '\\x1b' in 'RTX\\x1b[2J 3090'"
    assert problems["rigctl_host_facts.os"] == "200 characters, more than 128"


def test_hosts_shows_gpu_names_as_the_literal_text(lab_copy: Path) -> None:
    """`rigctl hosts` over facts with markup, templates and an escape: each shown as written, nothing run."""
    names = {"desktop": ("Lab stand-in for RTX 3050 OEM", "RTX [/] {{ 7*7 }} \\e[2J"),
             # A lookup runs in the command's directory: the copy's, where the marker is looked for.
             "laptop": ("Lab stand-in for GTX 1650 Ti", "{{lookup('pipe','touch m')}}")}
    for host, (before, after) in names.items():
        vars_file = lab_copy / "host_vars" / f"{host}.yml"
        vars_file.write_text(vars_file.read_text().replace(f"name: {before}", f'name: !unsafe "{after}"'))
    out = subprocess.run([sys.executable, "-m", "rigctl.cli", "-i", str(lab_copy), "hosts"],
                         capture_output=True, text=True, timeout=60, cwd=lab_copy)
    assert out.returncode == 0, out.stderr
    assert "RTX [/] {{ 7*7 }} \\x1b[2J" in out.stdout and "{{lookup('pipe','touch m')}}" in out.stdout
    assert "\x1b" not in out.stdout and not (lab_copy / "m").exists()
