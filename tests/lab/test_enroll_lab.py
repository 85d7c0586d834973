"""`rigctl hosts add` end to end: a third lab rig that the fleet has never seen (root with a password
only, no fleet user, not in the inventory, two GPUs) is enrolled with the fingerprint it shows on its
own console, provisioned with `provision --limit`, and serves. Works on a copy of the lab inventory."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from labrigs_support import REPO, lab_unavailable_reason
from ruamel.yaml import YAML

from rigctl.fleet.enroll import bootstrap, ensure_key_pair
from rigctl.inventory import Inventory
from rigctl.lab.rigs import Lab

pytestmark = pytest.mark.lab

RIG = "spare"
GPUS = [
    {"name": "Lab stand-in for RTX 4060 Ti", "vram_mib": 16384, "compute_capability": "8.9"},
    {"name": "Lab stand-in for RTX 3050 OEM", "vram_mib": 8192, "compute_capability": "8.6"},
]


@pytest.fixture(scope="module")
def stranger(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Path, Lab]]:
    """A copy of the lab inventory whose lab has one more rig, ``spare``, not enrolled; up."""
    reason = lab_unavailable_reason()
    if reason:
        pytest.skip(reason)
    inv = tmp_path_factory.mktemp("enroll") / "lab"
    shutil.copytree(REPO / "inventory" / "lab", inv)
    yaml = YAML()
    lab_vars = inv / "group_vars" / "all" / "lab.yml"
    data = yaml.load(lab_vars.read_text())
    data["rigctl_lab"]["unenrolled"] = {RIG: {"address": "10.213.{{ rigctl_lab_slot }}.13", "gpus": GPUS}}
    with lab_vars.open("w") as f:
        yaml.dump(data, f)
    lab = Lab.from_inventory(Inventory.load(inv))
    lab.up()
    try:
        yield inv, lab
    finally:
        lab.remove(RIG)


def rigctl(inv: Path, *args: str, stdin: str = "", timeout: float = 900) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "RIGCTL_PROJECT": str(REPO),
           "PATH": "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"}
    # A session of its own: no controlling terminal, so the password prompt reads stdin as a script's would.
    return subprocess.run([sys.executable, "-m", "rigctl.cli", "-i", str(inv), *args], input=stdin, cwd=REPO,
                          capture_output=True, text=True, timeout=timeout, env=env, start_new_session=True)


class CmdlineWatch:
    """Every process's command line and environment, read over and over while a command runs: the
    secret must be in none."""

    def __init__(self, secret: str):
        self.secret = secret.encode()
        self.seen: list[str] = []
        self.scans = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, daemon=True)

    def _watch(self) -> None:
        while not self._stop.is_set():
            for entry in Path("/proc").iterdir():
                if entry.name.isdigit():
                    try:
                        cmdline = (entry / "cmdline").read_bytes()
                        environ = (entry / "environ").read_bytes()
                    except OSError:
                        continue
                    if self.secret in cmdline or self.secret in environ:
                        self.seen.append(cmdline.replace(b"\0", b" ").decode(errors="replace"))
            self.scans += 1
            time.sleep(0.05)

    def __enter__(self) -> CmdlineWatch:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(5)


def snapshot(inv: Path, known_hosts: Path) -> dict[str, str]:
    files = [inv / "hosts.yml", *sorted((inv / "host_vars").glob("*.yml")), known_hosts]
    return {str(p): p.read_text() for p in files if p.is_file()}


def sshd_log(lab: Lab) -> str:
    return lab.guest_run(RIG, ["journalctl", "-u", "ssh.service", "--no-pager", "-o", "cat"])


def test_stranger_rig_is_enrolled_provisioned_and_serves(stranger: tuple[Path, Lab]) -> None:
    inv, lab = stranger
    rig = lab.rig(RIG)
    known_hosts = lab.config.known_hosts
    password = lab.root_password(RIG)
    # What the rig's owner reads on its console.
    shown = lab.guest_run(RIG, ["ssh-keygen", "-lf", "/etc/ssh/ssh_host_ed25519_key.pub"]).split()[1]
    assert shown.startswith("SHA256:")
    # No key gets in: root has none and the lab's is not authorised anywhere on it.
    assert lab.guest_run(RIG, ["sh", "-c", "cat /root/.ssh/authorized_keys 2>/dev/null; "
                                           "getent passwd rigctl || echo no-fleet-user"]).strip() == "no-fleet-user"

    # A wrong fingerprint: refused before the password is sent, nothing written.
    before = snapshot(inv, known_hosts)
    wrong = "SHA256:" + "A" * 43
    refused = rigctl(inv, "hosts", "add", RIG, rig.address, "--ask-pass", "--fingerprint", wrong, "--group", "lab",
                     stdin=password + "\n")
    assert refused.returncode != 0
    assert re.search(rf"error: {RIG}: host key rejected: .* presented ssh-ed25519 {re.escape(shown)}, not the "
                     rf"expected {wrong}; refused, nothing sent", refused.stderr), refused.stderr
    assert snapshot(inv, known_hosts) == before
    assert "password" not in sshd_log(lab)

    # The right one: bootstrapped with the password, facts into the inventory.
    with CmdlineWatch(password) as watch:
        added = rigctl(inv, "hosts", "add", RIG, rig.address, "--ask-pass", "--fingerprint", shown, "--group", "lab",
                       stdin=password + "\n")
    assert added.returncode == 0, added.stdout + added.stderr
    assert watch.scans > 10 and watch.seen == []
    assert password not in added.stdout + added.stderr
    assert f"Accepted password for root from {lab.config.bridge_address.split('/')[0]}" in sshd_log(lab)
    assert f"next: rigctl -i {inv} provision --limit {RIG}" in added.stdout
    assert f"{RIG}: host key ssh-ed25519 {shown} written to known_hosts" in added.stdout

    loaded = Inventory.load(inv)
    host = loaded.hosts[RIG]
    assert "lab" in host.groups and host.address == rig.address and host.user == "rigctl"
    assert host.vars["gpu_host_gpu"] == GPUS[0]
    assert host.vars["gpu_host_gpus"] == [{"index": i, **g} for i, g in enumerate(GPUS)]
    assert host.vars["llama_cpp_cuda_architectures"] == "86;89"
    facts = host.vars["rigctl_host_facts"]
    assert facts["os"].startswith("Debian GNU/Linux 12") and facts["cuda_version"] == "12.2" and facts["cpus"] >= 1
    text = (inv / "hosts.yml").read_text()
    assert text.startswith("# The local lab rigs") and text.index("laptop:") < text.index(f"{RIG}:")
    entries = [line for line in known_hosts.read_text().splitlines() if RIG in line]
    assert len(entries) == 1 and entries[0].startswith(f"{rig.address},{RIG} ssh-ed25519 "), entries
    check = rigctl(inv, "inventory", "check")
    assert check.returncode == 0 and ", 0 errors" in check.stdout, check.stdout + check.stderr
    for secret_free in snapshot(inv, known_hosts).values():
        assert password not in secret_free
    # The fleet user: the lab key, sudo without a password (what provision will use).
    assert lab.guest_run(RIG, ["sudo", "-l", "-U", "rigctl"]).count("NOPASSWD: ALL") == 1

    # A second `hosts add`: every step finds its work done; no file changes.
    enrolled = snapshot(inv, known_hosts)
    again = rigctl(inv, "hosts", "add", RIG, rig.address, "--ask-pass", "--fingerprint", shown, "--group", "lab",
                   stdin=password + "\n")
    assert again.returncode == 0, again.stdout + again.stderr
    assert "nothing changed" in again.stdout and "(known already)" in again.stdout
    assert snapshot(inv, known_hosts) == enrolled

    # The bootstrap again in check mode, as the fleet user with its key (sudo): nothing would change.
    checked = bootstrap(RIG, rig.address, rig.port, known_hosts, login_user="rigctl", password=None,
                        login_key=lab.config.key_file, fleet_user="rigctl",
                        fleet_public_key=ensure_key_pair(lab.config.key_file), project=REPO, check=True)
    assert checked.succeeded and checked.hosts[RIG].changed == 0 and checked.hosts[RIG].ok >= 6, checked.hosts

    # Pin the instance to the second GPU, then provision the new host alone.
    vars_file = inv / "host_vars" / f"{RIG}.yml"
    vars_file.write_text(vars_file.read_text() + "llama_server_instances:\n  smollm2:\n"
                         "    artifact: smollm2-135m-q4_1\n    profile: lab\n    port: 8080\n    gpu: 1\n")
    provisioned = rigctl(inv, "provision", "--limit", RIG, timeout=1800)
    assert provisioned.returncode == 0, provisioned.stdout[-4000:] + provisioned.stderr
    assert re.search(rf"│ {RIG} +│ \d+ +│ \d+ +│ 0 +│ 0 ", provisioned.stdout), provisioned.stdout[-3000:]

    # It serves: health, then a completion that computes.
    base = f"http://{rig.address}:8080"
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        try:
            if httpx.get(f"{base}/health", timeout=5).status_code == 200:
                break
        except httpx.HTTPError:
            pass
        time.sleep(1)
    key = Inventory.load(inv).host(RIG).vars.get("llama_server_api_key")  # the lab's servers carry one
    reply = httpx.post(f"{base}/completion", json={"prompt": "The capital of France is", "n_predict": 8,
                                                   "temperature": 0, "seed": 1}, timeout=60,
                       headers={"Authorization": f"Bearer {key}"} if key else {})
    assert reply.status_code == 200
    body = reply.json()
    assert body["tokens_predicted"] == 8 and body["content"].strip()
    pid = lab.guest_run(RIG, ["systemctl", "show", "-p", "MainPID", "--value", "llama-server@smollm2"]).strip()
    environ = lab.guest_run(RIG, ["cat", f"/proc/{pid}/environ"]).split("\0")
    assert "CUDA_VISIBLE_DEVICES=1" in environ

    # The facts still hold: probe shows no drift.
    probed = rigctl(inv, "hosts", "probe", RIG)
    assert probed.returncode == 0 and f"{RIG}: host_vars agree with the host" in probed.stdout, probed.stdout

    # Removed: out of the inventory and known_hosts; the host itself untouched.
    removed = rigctl(inv, "hosts", "remove", RIG)
    assert removed.returncode == 0, removed.stderr
    assert RIG not in Inventory.load(inv).hosts
    assert RIG not in known_hosts.read_text() and rig.address not in known_hosts.read_text()
    assert httpx.get(f"{base}/health", timeout=5).status_code == 200


class Planted:
    """What rig ``spare`` answers a probe with, changed from outside it: its os-release and /proc/cpuinfo
    overmounted by bind mounts (in its mount namespace), its stand-in GPU's name rewritten."""

    def __init__(self, lab: Lab):
        self.lab = lab
        self.name = lab.gpu_state(RIG).name
        self.mounted: list[str] = []

    def file(self, target: str, text: str) -> None:
        copy = f"/root/planted{target.replace('/', '-')}"
        self.lab.guest_run(RIG, ["sh", "-c", f"umount {target} 2>/dev/null; true"])
        self.lab.guest_run(RIG, ["sh", "-c", f"printf '%s\\n' \"$0\" > {copy}", text])
        self.lab.guest_run(RIG, ["mount", "--bind", copy, target])
        if target not in self.mounted:
            self.mounted.append(target)

    def os_name(self, pretty: str) -> None:
        self.file("/etc/os-release", f'PRETTY_NAME="{pretty}"\nNAME="Debian GNU/Linux"\nVERSION_ID="12"\nID=debian')

    def cpu_model(self, model: str) -> None:
        real = self.lab.guest_run(RIG, ["sh", "-c", "umount /proc/cpuinfo 2>/dev/null; cat /proc/cpuinfo"])
        self.file("/proc/cpuinfo", re.sub(r"(?m)^model name\t: .*$", lambda _: f"model name\t: {model}", real))

    def gpu_name(self, name: str) -> None:
        self.lab.set_gpu(RIG, name=name)

    def restore(self) -> None:
        for target in self.mounted:
            self.lab.guest_run(RIG, ["umount", target])
        self.lab.set_gpu(RIG, name=self.name)


def test_a_rig_whose_answers_carry_templates_runs_nothing(stranger: tuple[Path, Lab], tmp_path: Path) -> None:
    """os-release, CPU model and GPU name carrying Jinja: each refused in one line naming the field, nothing
    written, nothing run (the marker stays absent); text that is odd but plain is enrolled and shown as it is."""
    inv, lab = stranger
    rig = lab.rig(RIG)
    known_hosts = lab.config.known_hosts
    password = lab.root_password(RIG)
    shown = lab.guest_run(RIG, ["ssh-keygen", "-lf", "/etc/ssh/ssh_host_ed25519_key.pub"]).split()[1]
    marker = tmp_path / "marker"
    payload = f"{{{{ lookup('pipe', 'touch {marker}') }}}}"
    planted = Planted(lab)

    def add() -> subprocess.CompletedProcess[str]:
        return rigctl(inv, "hosts", "add", RIG, rig.address, "--ask-pass", "--fingerprint", shown, "--group", "lab",
                      stdin=password + "\n")

    try:
        # nvidia-smi's answer is CSV: a GPU name with a comma (as a lookup has) fails as a line of 8 fields.
        planted.gpu_name("RTX {{ 7*7 }}")
        planted.cpu_model(f"Xeon {{% if lookup('pipe', 'touch {marker}') %}}{{% endif %}}")
        planted.os_name(f"Debian {payload}")
        for field in ("gpus\\[0\\]\\.name", "cpu_model", "os"):
            before = snapshot(inv, known_hosts)
            refused = add()
            assert refused.returncode == 1, refused.stdout + refused.stderr
            # Before it, stderr holds only the password prompt.
            errors = [line for line in refused.stderr.splitlines() if line.startswith("error:")]
            assert len(errors) == 1 and refused.stderr.endswith(errors[0] + "\n"), refused.stderr
            assert re.match(rf"error: {RIG}: probe: {field}: template marker", errors[0]), errors
            assert snapshot(inv, known_hosts) == before and not marker.exists()
            if field.startswith("gpus"):
                planted.gpu_name("Lab stand-in for RTX 4060 Ti")
            elif field == "cpu_model":
                planted.cpu_model("Xeon [/] $(touch /tmp/x) \\e[2J")

        # Plain text that is markup to rich and shell to a shell: enrolled, and shown as written.
        planted.gpu_name("RTX [/] [bold]4060[/] `id`")
        planted.os_name("Debian [/] 12")
        added = add()
        assert added.returncode == 0, added.stdout + added.stderr
        listed = rigctl(inv, "hosts")
        assert listed.returncode == 0 and "RTX [/] [bold]4060[/] `id`" in listed.stdout, listed.stdout + listed.stderr
        vars_file = inv / "host_vars" / f"{RIG}.yml"
        text = vars_file.read_text()
        assert "name: !unsafe 'RTX [/] [bold]4060[/] `id`'" in text and "os: !unsafe 'Debian [/] 12'" in text
        checked = rigctl(inv, "inventory", "check")
        assert checked.returncode == 0, checked.stdout + checked.stderr

        # A payload that appears later: probe --write refuses it and leaves host_vars as they were.
        planted.gpu_name("RTX {% raw %}")
        probed = rigctl(inv, "hosts", "probe", RIG, "--write")
        assert probed.returncode == 1
        assert re.fullmatch(rf"error: {RIG}: probe: gpus\[0\]\.name: template marker '{{%' .*\n", probed.stderr), \
            probed.stderr
        assert vars_file.read_text() == text and not marker.exists()
    finally:
        planted.restore()
        rigctl(inv, "hosts", "remove", RIG)
    assert not marker.exists()
