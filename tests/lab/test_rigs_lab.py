"""One real lab lifecycle, on a test lab of its own: a copy of inventory/lab whose rigs are renamed (lt-desktop,
lt-laptop) on another bridge and network, with its own lab directory. It uses the same code, base image
and GPU values as the real lab, but never touches a real lab that a developer or another test has up.
"""

from __future__ import annotations

import dataclasses
import errno
import json
import os
import shutil
import socket
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from labrigs_support import (
    FAILING_BRIDGE,
    FAILING_NETWORK,
    TEST_NETWORK,
    TEST_PREFIX,
    LabRun,
    lab_skip_reason,
    make_test_inventory,
    own_lab_up,
    real_inventory,
)

from rigctl.errors import ConfigError, LabError
from rigctl.inventory import Inventory
from rigctl.lab.gpu import GPU_STATE_IN_RIG
from rigctl.lab.network import lab_mac, rig_tag, veth_name
from rigctl.lab.rigs import Lab
from rigctl.lab.system import mounts_under

GPU_QUERY = "--query-gpu=name,temperature.gpu,memory.total,memory.used,compute_cap --format=csv,noheader,nounits"


# ----------------------------------------------------------------------------------------------- pure helpers


# ----------------------------------------------------------------------------------------------- the lifecycle


# A fixture, though its name reads like a test's: the split of tests/test_lab.py by test name lost it once.
@pytest.fixture(scope="module")
def test_lab(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LabRun]:
    with own_lab_up(tmp_path_factory.mktemp("lab")) as run:
        yield run


def on_rig(lab: Lab, name: str, command: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        lab.ssh_argv(name, command), capture_output=True, text=True, timeout=timeout, stdin=subprocess.DEVNULL
    )


def rig_names(lab: Lab) -> list[str]:
    return [r.name for r in lab.config.rigs]


@pytest.mark.lab
def test_up_boots_every_rig_with_strict_ssh(test_lab: LabRun) -> None:
    lab = test_lab.lab
    assert [s.name for s in test_lab.first_up] == [TEST_PREFIX + "desktop", TEST_PREFIX + "laptop"]
    assert all(s.ready and s.systemd == "running" for s in test_lab.first_up), test_lab.first_up
    image = lab.ensure_base_image()
    assert (image.path, image.built, image.size_bytes) == (lab.image_path, False, lab.image_path.stat().st_size)
    assert (image.tree / "usr/bin/cmake").is_file() and (image.tree / "usr/sbin/sshd").is_file()
    assert not list(image.tree.glob("etc/ssh/ssh_host_*")) and (image.tree / "etc/machine-id").read_text() == ""
    known = lab.config.known_hosts.read_text()
    for rig_spec in lab.config.rigs:
        done = on_rig(lab, rig_spec.name, "hostname && systemctl is-system-running")
        assert done.returncode == 0, done.stderr
        assert done.stdout.split() == [rig_spec.name, "running"]
        real_key = (lab.config.hosts_dir / rig_spec.name / "rootfs/etc/ssh/ssh_host_ed25519_key.pub").read_text()
        assert f"{rig_spec.name},{rig_spec.address} {' '.join(real_key.split()[:2])}\n" in known
    machine_ids = {on_rig(lab, r.name, "cat /etc/machine-id").stdout.strip() for r in lab.config.rigs}
    assert len(machine_ids) == len(lab.config.rigs) and "" not in machine_ids


@pytest.mark.lab
def test_stand_in_gpu_answers_with_the_inventorys_values(test_lab: LabRun) -> None:
    lab = test_lab.lab
    inventory = real_inventory()
    for name in ("desktop", "laptop"):
        gpu = inventory.hosts[name].vars["gpu_host_gpu"]
        done = on_rig(lab, TEST_PREFIX + name, f"nvidia-smi {GPU_QUERY}")
        assert done.returncode == 0, done.stderr
        reported_name, temperature, total, used, cap = done.stdout.strip().split(", ")
        assert (reported_name, total, used, cap) == (gpu["name"], str(gpu["vram_mib"]), "0", gpu["compute_capability"])
        assert int(temperature) == lab.gpu_state(TEST_PREFIX + name).temperature
    assert on_rig(lab, TEST_PREFIX + "desktop", "command -v nvidia-smi").stdout.strip() == "/usr/local/bin/nvidia-smi"


@pytest.mark.lab
def test_temperature_sequence_and_gpu_state_through_the_rig(test_lab: LabRun) -> None:
    lab, name = test_lab.lab, TEST_PREFIX + "desktop"
    lab.set_gpu(name, temperature_sequence=[81, 67, 52], memory_used_mib=3000)
    seen = [
        on_rig(
            lab, name, "nvidia-smi --query-gpu=temperature.gpu,memory.used --format=csv,noheader,nounits"
        ).stdout.strip()
        for _ in range(4)
    ]
    assert seen == ["81, 3000", "67, 3000", "52, 3000", "52, 3000"]
    state = lab.gpu_state(name)
    assert (state.temperature, state.temperature_sequence, state.memory_used_mib) == (52, (), 3000)
    assert on_rig(lab, name, "nvidia-smi -pm 1").returncode == 0
    assert lab.gpu_state(name).persistence_mode is True
    assert "Driver Version:" in on_rig(lab, name, "nvidia-smi").stdout
    with pytest.raises(ConfigError, match="unknown GPU field"):
        lab.set_gpu(name, clock_mhz=1500)
    state_file = lab.config.hosts_dir / name / "rootfs" / GPU_STATE_IN_RIG
    assert json.loads(state_file.read_text())["memory_used_mib"] == 3000


@pytest.mark.lab
def test_up_again_changes_nothing(test_lab: LabRun) -> None:
    lab = test_lab.lab
    before = lab.status()
    known_hosts_mtime = lab.config.known_hosts.stat().st_mtime_ns
    again = lab.up()
    assert [(s.supervisor_pid, s.nspawn_pid) for s in again] == [(s.supervisor_pid, s.nspawn_pid) for s in before]
    assert all(s.ready for s in again)
    assert lab.config.known_hosts.stat().st_mtime_ns == known_hosts_mtime


@pytest.mark.lab
def test_status_shows_every_rig_running(test_lab: LabRun) -> None:
    statuses = test_lab.lab.status()
    assert [s.name for s in statuses] == rig_names(test_lab.lab)
    for status in statuses:
        assert status.exists and status.running and status.sshd and status.systemd == "running", status


@pytest.mark.lab
def test_ssh_argv_runs_with_real_ssh(test_lab: LabRun) -> None:
    lab = test_lab.lab
    done = on_rig(lab, TEST_PREFIX + "laptop", "cat /etc/hostname; id -un")
    assert (done.returncode, done.stdout.split()) == (0, [TEST_PREFIX + "laptop", "root"]), done.stderr
    # A key that is not the rig's real one is refused: checking is strict.
    other = lab.config.known_hosts.with_name("wrong_known_hosts")
    laptop_keys = [
        line for line in lab.config.known_hosts.read_text().splitlines() if line.startswith(TEST_PREFIX + "laptop,")
    ]
    desktop_key = next(
        line for line in lab.config.known_hosts.read_text().splitlines() if line.startswith(TEST_PREFIX + "desktop,")
    )
    other.write_text("".join(f"{line.split()[0]} {' '.join(desktop_key.split()[1:])}\n" for line in laptop_keys))
    argv = [a.replace(str(lab.config.known_hosts), str(other)) for a in lab.ssh_argv(TEST_PREFIX + "laptop", "true")]
    refused = subprocess.run(argv, capture_output=True, text=True, timeout=60, stdin=subprocess.DEVNULL)
    other.unlink()
    assert refused.returncode == 255 and "host key" in refused.stderr.lower(), refused.stderr


@pytest.mark.lab
def test_rigs_reach_each_other_but_nothing_off_the_bridge(test_lab: LabRun) -> None:
    lab = test_lab.lab
    gateway = f"{TEST_NETWORK}.254"
    desktop, laptop = lab.config.rigs
    # Routing decisions only: no packet is sent to any address outside the lab.
    route = on_rig(lab, desktop.name, "ip route get 1.1.1.1").stdout
    assert f"via {gateway} dev eth0" in route, route
    routes = sorted(line.strip() for line in on_rig(lab, desktop.name, "ip -4 route show").stdout.splitlines())
    assert routes == [
        f"{TEST_NETWORK}.0/24 dev eth0 proto kernel scope link src {desktop.address}",
        f"default via {gateway} dev eth0",
    ]
    links = on_rig(lab, desktop.name, "ip -o link show | cut -d: -f2 | cut -d@ -f1").stdout.split()
    assert sorted(links) == ["eth0", "lo"]
    # What Ansible's facts read: the rig's own links, none of this machine's.
    assert sorted(on_rig(lab, desktop.name, "ls /sys/class/net").stdout.split()) == ["eth0", "lo"]
    host_addresses = subprocess.run(
        ["ip", "-4", "-o", "addr", "show"], capture_output=True, text=True, timeout=10
    ).stdout
    assert f" {gateway}/" not in host_addresses
    for tool in (["iptables-save", "-t", "nat"], ["nft", "list", "ruleset"]):
        if shutil.which(tool[0]):
            rules = subprocess.run(tool, capture_output=True, text=True, timeout=30).stdout
            assert TEST_NETWORK not in rules and "masquerade" not in rules.lower()
    # The other rig, on the bridge, answers.
    reach = on_rig(lab, desktop.name, f"timeout 5 bash -c 'exec 3<>/dev/tcp/{laptop.address}/22; head -c 7 <&3'")
    assert reach.stdout == "SSH-2.0", reach.stderr
    by_name = on_rig(lab, desktop.name, f"getent hosts {laptop.name}").stdout.split()
    assert by_name == [laptop.address, laptop.name]


@pytest.mark.lab
def test_a_guest_reboot_comes_back_under_the_same_supervisor(test_lab: LabRun) -> None:
    lab, name = test_lab.lab, TEST_PREFIX + "laptop"
    before = {s.name: s for s in lab.status()}[name]
    on_rig(lab, name, "systemctl reboot", timeout=30)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        now = {s.name: s for s in lab.status()}[name]
        if now.nspawn_pid not in (None, before.nspawn_pid) and now.systemd == "running":
            break
        time.sleep(1)
    assert now.supervisor_pid == before.supervisor_pid
    assert now.nspawn_pid != before.nspawn_pid and now.systemd == "running", now
    assert (
        on_rig(lab, name, "nvidia-smi --query-gpu=name --format=csv,noheader").stdout.strip() == lab.rig(name).gpu.name
    )


@pytest.mark.lab
def test_up_recreates_a_crashed_rig_and_keeps_the_healthy_one(test_lab: LabRun) -> None:
    lab = test_lab.lab
    before = {s.name: s for s in lab.status()}
    crashed = before[TEST_PREFIX + "laptop"]
    assert crashed.supervisor_pid and crashed.nspawn_pid
    os.kill(crashed.supervisor_pid, 9)
    os.kill(crashed.nspawn_pid, 9)
    time.sleep(0.5)
    assert not {s.name: s for s in lab.status()}[crashed.name].running
    started = time.monotonic()
    after = {s.name: s for s in lab.up()}
    # Made again with the same MAC, the rig answers at once: no neighbour waits out a stale entry.
    assert time.monotonic() - started < 30
    assert after[TEST_PREFIX + "desktop"].nspawn_pid == before[TEST_PREFIX + "desktop"].nspawn_pid
    assert after[crashed.name].nspawn_pid not in (None, crashed.nspawn_pid)
    assert all(s.ready for s in after.values())
    assert on_rig(lab, crashed.name, "systemctl is-system-running").stdout.strip() == "running"
    address = lab.rig(crashed.name).address
    assert on_rig(lab, crashed.name, "cat /sys/class/net/eth0/address").stdout.strip() == lab_mac(address)
    reach = on_rig(lab, TEST_PREFIX + "desktop", f"timeout 5 bash -c 'exec 3<>/dev/tcp/{address}/22; head -c 7 <&3'")
    assert reach.stdout == "SSH-2.0", reach.stderr


def leftovers(lab: Lab) -> list[str]:
    """Everything of ``lab`` still on this machine."""
    config = lab.config
    found = []
    netns = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, timeout=10).stdout.split()
    tags = {rig_tag(config.bridge, r.name) for r in config.rigs}
    found += [f"netns {n}" for n in netns if n in tags]
    links = json.loads(subprocess.run(["ip", "-j", "link", "show"], capture_output=True, text=True, timeout=10).stdout)
    ours = {config.bridge, *(veth_name(config.bridge, r.name) for r in config.rigs)}
    found += [
        f"link {link['ifname']}"
        for link in links
        if link["ifname"] in ours or link.get("ifalias") == config.link_marker
    ]
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            cmdline = (proc / "cmdline").read_bytes().decode(errors="replace")
        except OSError:
            continue
        if str(config.dir) in cmdline:
            found.append(f"process {proc.name}: {cmdline.replace(chr(0), ' ')}")
    for root in (Path("/sys/fs/cgroup/systemd"), Path("/sys/fs/cgroup/unified")):
        found += [f"cgroup {root / tag}" for tag in tags if (root / tag).exists()]
    found += [f"mount {m}" for m in mounts_under(Path("/proc/self/mountinfo").read_text(), config.dir)]
    found += [f"nspawn runtime {p}" for tag in tags for p in Path("/run/systemd/nspawn").glob(f"*/{tag}")]
    found += [f"path {p}" for p in (config.hosts_dir, config.known_hosts) if p.exists()]
    found += [f"partial image {p}" for p in [*config.image_dir.glob(".build-*"), *config.image_dir.glob(".unpack-*")]]
    return found


@pytest.mark.lab
def test_down_leaves_nothing_and_is_safe_to_repeat(test_lab: LabRun) -> None:
    """Also after a crash: one rig's supervisor and nspawn are killed, leaving its guest orphaned."""
    lab = test_lab.lab
    crashed = lab.status()[0]
    assert crashed.supervisor_pid and crashed.nspawn_pid
    os.kill(crashed.supervisor_pid, 9)
    os.kill(crashed.nspawn_pid, 9)
    deadline = time.monotonic() + 10
    while lab.status()[0].running and time.monotonic() < deadline:
        time.sleep(0.1)
    started = time.monotonic()
    lab.down()
    assert time.monotonic() - started < 60
    assert leftovers(lab) == []
    # The fence stays: what is still aimed at a rig fails here at once instead of taking the default route.
    for rig in lab.config.rigs:
        with socket.socket() as probe, pytest.raises(OSError) as unreachable:
            probe.settimeout(5)
            probe.connect((rig.address, 22))
        assert unreachable.value.errno == errno.EHOSTUNREACH, rig.name
    assert lab.config.key_file.is_file() and lab.image_path.is_file()
    assert all(not s.exists and not s.running and not s.sshd for s in lab.status())
    lab.down()
    assert leftovers(lab) == []


def failing_lab(tmp_path: Path) -> Lab:
    """A lab of its own (lf- rigs on FAILING_NETWORK) whose base image lives in ``tmp_path``."""
    reason = lab_skip_reason()
    if reason:
        pytest.skip(reason)
    inventory = make_test_inventory(
        tmp_path / "inv", tmp_path / "lab", prefix="lf-", network=FAILING_NETWORK, bridge=FAILING_BRIDGE
    )
    config = Lab.from_inventory(Inventory.load(inventory)).config
    lab = Lab(dataclasses.replace(config, cache_dir=tmp_path / "cache"))
    lab.image_path.parent.mkdir(parents=True)
    return lab


@pytest.mark.lab
def test_a_base_image_that_does_not_unpack_leaves_nothing(tmp_path: Path) -> None:
    lab = failing_lab(tmp_path)
    lab.image_path.write_bytes(b"not a zstd tarball")
    with pytest.raises(LabError, match=r"^base image: unpack: `zstd -dcq .*` exited 1"):
        lab.up()
    assert leftovers(lab) == []
    # Beside the image only the entries' lock files (rigctl.files.entry_lock), which stay for the next writer.
    assert [p for p in lab.image_path.parent.iterdir() if p.suffix != ".lock"] == [lab.image_path]


@pytest.mark.lab
def test_a_rig_that_cannot_boot_fails_up_and_everything_it_made_goes(tmp_path: Path) -> None:
    """An image with no OS in it: the bridge, namespaces, links, cgroups and overlays are made, nspawn
    refuses to boot, and up must take all of it down again."""
    lab = failing_lab(tmp_path)
    tree = tmp_path / "not-an-os"
    for directory in ("etc/ssh", "root", "usr/local/bin"):
        (tree / directory).mkdir(parents=True)
    packed = subprocess.run(f"tar -C {tree} -cf - . | zstd -q -o {lab.image_path}", shell=True, timeout=60)
    assert packed.returncode == 0
    with pytest.raises(LabError, match=r"^lf-(desktop|laptop): (boot|wait for sshd): .*doesn't look like an OS root"):
        lab.up()
    assert leftovers(lab) == []
