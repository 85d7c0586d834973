"""The lab module without rigs: pure helpers, the stand-in nvidia-smi, preflight errors."""

from __future__ import annotations

import dataclasses
import json
import os
import pickle
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
import yaml
from labrigs_support import LAB_SLOT, REPO, TEST_NETWORK, lab_skip_reason, make_test_inventory, real_inventory, rig

from rigctl.errors import ConfigError, LabError
from rigctl.inventory import Inventory
from rigctl.lab.config import check_lab_paths, known_hosts_lines, render_etc_hosts
from rigctl.lab.gpu import GpuState, capture_text, gpu_from_capture, gpu_seed, host_gpu_uuid
from rigctl.lab.image import (
    BASE_PACKAGES,
    IMAGE_RECIPE_REVISION,
    BaseImage,
    _unpack_into,
    apt_mirror,
    image_file_name,
)
from rigctl.lab.network import check_lab_network, dead_end_gateway, find_host_conflicts, lab_mac, rig_tag, veth_name
from rigctl.lab.rigs import Lab
from rigctl.lab.system import cgroup_roots, mounts_under

NVIDIA_SMI = REPO / "rigctl" / "lab" / "assets" / "nvidia-smi"
needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="needs root")


# ----------------------------------------------------------------------------------------------- pure helpers


DEB822 = """\
Types: deb
URIs: http://mirror.example/debian-security
Suites: bookworm-security
Components: main

Types: deb-src
URIs: http://src.example/debian
Suites: bookworm

Types: deb
URIs: http://mirror.example/debian http://second.example/debian
Suites: bookworm bookworm-updates
Components: main
"""


def test_apt_mirror_prefers_the_suite_entry_and_first_uri() -> None:
    assert apt_mirror([DEB822], None) == "http://mirror.example/debian"


def test_apt_mirror_skips_disabled_stanzas_and_reads_one_line_format() -> None:
    disabled = "Types: deb\nURIs: http://off.example/debian\nSuites: bookworm\nEnabled: no\n"
    one_line = (
        "# deb http://commented.example/debian bookworm main\n"
        "deb [arch=amd64 signed-by=/k.gpg] http://one.example/debian bookworm main\n"
    )
    assert apt_mirror([disabled], one_line) == "http://one.example/debian"


def test_apt_mirror_falls_back_to_first_entry_and_fails_on_none() -> None:
    assert apt_mirror(["Types: deb\nURIs: http://a.example/d\nSuites: trixie\n"], None) == "http://a.example/d"
    with pytest.raises(LabError, match="no Debian mirror"):
        apt_mirror([], "deb-src http://x.example/debian bookworm main\n")


def test_image_name_carries_the_package_list_hash() -> None:
    name = image_file_name("bookworm", "minbase", BASE_PACKAGES, IMAGE_RECIPE_REVISION)
    assert name.startswith("bookworm-minbase-") and name.endswith(".tar.zst")
    assert image_file_name("bookworm", "minbase", tuple(reversed(BASE_PACKAGES)), IMAGE_RECIPE_REVISION) == name
    assert image_file_name("bookworm", "minbase", (*BASE_PACKAGES, "vim"), IMAGE_RECIPE_REVISION) != name
    assert image_file_name("bookworm", "minbase", BASE_PACKAGES, IMAGE_RECIPE_REVISION + 1) != name


def _small_image(cache: Path, files: int) -> BaseImage:
    """A real zstd tarball of ``files`` small files where the lab keeps its base image."""
    source = cache / "source"
    for n in range(files):
        (source / f"d{n % 10}").mkdir(parents=True, exist_ok=True)
        (source / f"d{n % 10}" / f"f{n}").write_text(f"file {n}\n" * 20)
    tarball = cache / "lab" / "bookworm-minbase-0123456789abcdef.tar.zst"
    tarball.parent.mkdir(parents=True)
    subprocess.run(f"tar -C {source} -cf - . | zstd -q -o {tarball}", shell=True, check=True, timeout=60)
    return BaseImage(tarball, tarball.stat().st_size, built=False)


@pytest.mark.skipif(not shutil.which("zstd"), reason="needs zstd")
def test_unpackers_started_together_all_get_one_complete_tree(tmp_path: Path) -> None:
    """Two lab slots sharing a cache unpack the same base image at once: every one of them gets the tree,
    whole, and none fails on the other's rename (what `lab prepare` beside `lab up` once did)."""
    image = _small_image(tmp_path, 3000)
    go = tmp_path / "go"
    code = (
        "import sys, time\nfrom pathlib import Path\nfrom rigctl.lab.image import BaseImage, ensure_base_tree\n"
        f"while not Path({str(go)!r}).exists():\n    time.sleep(0.01)\n"
        f"print(ensure_base_tree(BaseImage(Path({str(image.path)!r}), 0, built=False)))\n"
    )
    unpackers = [
        subprocess.Popen([sys.executable, "-c", code], cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                         text=True)
        for _ in range(3)
    ]
    time.sleep(1.0)  # every interpreter up and polling, so they start within milliseconds of each other
    go.touch()
    outcomes = [(proc.wait(timeout=120), *proc.communicate()) for proc in unpackers]
    assert outcomes == [(0, f"{image.tree}\n", "")] * 3
    unpacked = sorted(p.relative_to(image.tree) for p in image.tree.rglob("f*"))
    assert unpacked == sorted(p.relative_to(tmp_path / "source") for p in (tmp_path / "source").rglob("f*"))
    assert len(unpacked) == 3000
    assert [p.name for p in image.path.parent.iterdir() if p.name.startswith(".unpack-")] == []


@pytest.mark.skipif(not shutil.which("zstd"), reason="needs zstd")
def test_an_unpacker_that_loses_the_rename_takes_the_winners_tree(tmp_path: Path) -> None:
    """A writer that did not take the entry's lock (an older rigctl) landed its tree first: this one's
    rename fails, and it uses that tree instead of failing, leaving no work directory behind."""
    image = _small_image(tmp_path, 5)
    winner = image.tree
    winner.mkdir()
    (winner / "theirs").write_text("the winner's tree\n")
    _unpack_into(image.path, winner)
    assert [p.name for p in winner.iterdir()] == ["theirs"]
    assert sorted(p.name for p in image.path.parent.iterdir()) == sorted([image.path.name, winner.name])


def test_dead_end_gateway_is_the_last_host_address() -> None:
    assert str(dead_end_gateway("10.213.0.1/24")) == "10.213.0.254"
    assert str(dead_end_gateway("192.0.2.9/28")) == "192.0.2.14"


@pytest.mark.parametrize(
    ("address", "message"),
    [
        ("10.99.0.11", r"desktop: address 10\.99\.0\.11 is not inside the lab network 10\.213\.0\.0/24"),
        ("10.213.0.1", "is the bridge's own address"),
        ("10.213.0.254", "dead-end gateway"),
        ("10.213.0.255", "broadcast"),
        ("desktop.local", "is not an IPv4 address"),
    ],
)
def test_check_lab_network_rejects_bad_rig_addresses(address: str, message: str) -> None:
    with pytest.raises(LabError, match=message):
        check_lab_network("rigctl-br0", "10.213.0.1/24", [rig("desktop", address)])


def test_check_lab_network_rejects_duplicates_and_long_names() -> None:
    check_lab_network("rigctl-br0", "10.213.0.1/24", [rig("desktop", "10.213.0.11"), rig("laptop", "10.213.0.12")])
    with pytest.raises(LabError, match="laptop: address 10.213.0.11 is also desktop's"):
        check_lab_network("rigctl-br0", "10.213.0.1/24", [rig("desktop", "10.213.0.11"), rig("laptop", "10.213.0.11")])
    with pytest.raises(LabError, match="too long for a link name"):
        check_lab_network("rigctl-br0", "10.213.0.1/24", [rig("a-very-long-rig-name", "10.213.0.11")])
    with pytest.raises(LabError, match="longer than 15"):
        check_lab_network("rigctl-bridge-zero", "10.213.0.1/24", [])
    with pytest.raises(LabError, match="must be IPv4"):
        check_lab_network("rigctl-br0", "fd00::1/64", [])


def test_lab_paths_must_fit_overlay_mount_options() -> None:
    config = Lab.from_inventory(real_inventory(slot=0)).config
    check_lab_paths(config)
    with pytest.raises(LabError, match="rigctl_lab.dir /srv/lab:1 must be an absolute path without"):
        check_lab_paths(dataclasses.replace(config, dir=Path("/srv/lab:1")))
    with pytest.raises(LabError, match="rigctl_cache_dir cache must be an absolute path"):
        check_lab_paths(dataclasses.replace(config, cache_dir=Path("cache")))


def test_find_host_conflicts_names_strangers_only() -> None:
    config = Lab.from_inventory(real_inventory(slot=0)).config
    mine = {
        "ifname": "rigctl-br0",
        "ifalias": config.link_marker,
        "addr_info": [{"family": "inet", "local": "10.213.0.1", "prefixlen": 24}],
    }
    eth0 = {"ifname": "eth0", "addr_info": [{"family": "inet", "local": "192.0.2.2", "prefixlen": 24}]}
    assert find_host_conflicts([mine, eth0], config) == []
    stranger_bridge = {"ifname": "rigctl-br0", "addr_info": []}
    assert find_host_conflicts([stranger_bridge], config) == [
        "rigctl-br0 (the lab bridge's name) is already used by an interface that is not this lab's"
    ]
    overlapping = {"ifname": "tun0", "addr_info": [{"family": "inet", "local": "10.213.0.12", "prefixlen": 32}]}
    assert find_host_conflicts([overlapping], config) == [
        "address 10.213.0.12/32 on tun0 overlaps the lab network 10.213.0.0/24"
    ]


def test_render_etc_hosts_and_known_hosts() -> None:
    rigs = [rig("desktop", "10.213.0.11"), rig("laptop", "10.213.0.12")]
    hosts = render_etc_hosts("laptop", rigs)
    assert "127.0.1.1\tlaptop\n" in hosts and "10.213.0.11\tdesktop\n" in hosts and "10.213.0.12\tlaptop\n" in hosts
    keys = ["ssh-ed25519 AAAAC3Nz root@build\n", "ecdsa-sha2-nistp256 AAAAE2V root@build\n"]
    assert known_hosts_lines(rigs[0], keys) == [
        "desktop,10.213.0.11 ssh-ed25519 AAAAC3Nz",
        "desktop,10.213.0.11 ecdsa-sha2-nistp256 AAAAE2V",
    ]
    assert known_hosts_lines(dataclasses.replace(rigs[0], port=2222), keys[:1]) == [
        "[desktop]:2222,[10.213.0.11]:2222 ssh-ed25519 AAAAC3Nz"
    ]


MOUNTINFO = """\
31 23 0:28 / /sys/fs/cgroup rw,relatime - tmpfs tmpfs rw,mode=755
32 31 0:29 / /sys/fs/cgroup/cpu rw,relatime - cgroup cgroup rw,cpu
40 31 0:37 / /sys/fs/cgroup/systemd rw,relatime - cgroup cgroup rw,name=systemd
41 31 0:38 / /sys/fs/cgroup/unified rw,relatime - cgroup2 cgroup2 rw
50 23 0:40 / /var/lib/rigctl/lab/hosts/desktop/rootfs/proc rw - proc proc rw
51 50 0:41 / /var/lib/rigctl/lab/hosts/desktop/rootfs/proc/sys/fs/binfmt_misc rw - binfmt_misc b rw
52 23 0:42 / /var/lib/rigctl/lab/hosts/desktop2 rw - tmpfs tmpfs rw
53 23 0:43 / /var/lib/rigctl/with\\040space rw - tmpfs tmpfs rw
"""


def test_cgroup_roots_are_systemds_and_the_unified_hierarchy() -> None:
    assert cgroup_roots(MOUNTINFO) == [Path("/sys/fs/cgroup/systemd"), Path("/sys/fs/cgroup/unified")]


def test_mounts_under_lists_deepest_first_and_not_siblings() -> None:
    assert mounts_under(MOUNTINFO, Path("/var/lib/rigctl/lab/hosts/desktop")) == [
        Path("/var/lib/rigctl/lab/hosts/desktop/rootfs/proc/sys/fs/binfmt_misc"),
        Path("/var/lib/rigctl/lab/hosts/desktop/rootfs/proc"),
    ]
    assert mounts_under(MOUNTINFO, Path("/var/lib/rigctl/with space")) == [Path("/var/lib/rigctl/with space")]


def test_lab_macs_are_fixed_local_unicast_and_distinct() -> None:
    assert lab_mac("10.213.0.11") == "02:72:0a:d5:00:0b"
    assert lab_mac("10.213.0.12") != lab_mac("10.213.0.11") != lab_mac("10.213.1.11")


def test_names_of_the_rigs_pieces() -> None:
    assert rig_tag("rigctl-br0", "desktop") == "rigctl-br0-desktop"
    # Same rig names on two bridges: two different link names, both short enough for the kernel.
    first, second = veth_name("rigctl-br0", "desktop"), veth_name("rigctl-bb0", "desktop")
    assert first != second and first.endswith("-desktop") and len(first) <= 15


def test_gpu_seed_from_the_inventory_and_state_checks() -> None:
    seed = gpu_seed("desktop", {"name": "Lab stand-in", "vram_mib": 8192, "compute_capability": "8.6"})
    assert (seed.name, seed.memory_total_mib, seed.compute_cap, seed.memory_used_mib) == (
        "Lab stand-in",
        8192,
        "8.6",
        0,
    )
    assert seed.uuid == gpu_seed("desktop", {"name": "x", "vram_mib": 1, "compute_capability": "1"}).uuid
    assert seed.uuid != gpu_seed("laptop", {"name": "x", "vram_mib": 1, "compute_capability": "1"}).uuid
    assert (
        gpu_seed("d", {"name": "n", "vram_mib": 1, "compute_capability": "1", "driver_version": "550.1"}).driver_version
        == "550.1"
    )
    with pytest.raises(ConfigError, match="desktop: gpu_host_gpu: missing vram_mib"):
        gpu_seed("desktop", {"name": "n", "compute_capability": "8.6"})
    data = dataclasses.asdict(seed)
    with pytest.raises(ConfigError, match="unknown GPU field.*fan_speed"):
        GpuState.from_mapping({**data, "fan_speed": 30}, "t")
    with pytest.raises(ConfigError, match="temperature must be int"):
        GpuState.from_mapping({**data, "temperature": "hot"}, "t")
    with pytest.raises(ConfigError, match="memory_used_mib 9000 is outside 0..8192"):
        GpuState.from_mapping({**data, "memory_used_mib": 9000}, "t")
    assert json.loads(seed.to_json())["temperature_sequence"] == []


# ----------------------------------------------------------------------------------------------- inventory wiring


def test_lab_from_the_lab_inventory() -> None:
    inventory = real_inventory(slot=0)
    lab = Lab.from_inventory(inventory)
    lab_vars = inventory.hosts["desktop"].vars["rigctl_lab"]
    assert lab.config.dir == Path(lab_vars["dir"])
    assert lab.config.bridge == lab_vars["bridge"]
    assert lab.config.bridge_address == lab_vars["bridge_address"]
    assert lab.config.key_file == inventory.hosts["desktop"].key_file
    assert lab.config.known_hosts == inventory.hosts["desktop"].known_hosts
    assert lab.config.cache_dir == Path(inventory.hosts["desktop"].vars["rigctl_cache_dir"])
    assert {r.name: r.address for r in lab.config.rigs} == {h.name: h.address for h in inventory.hosts.values()}
    desktop_gpu = inventory.hosts["desktop"].vars["gpu_host_gpu"]
    assert lab.rig("desktop").gpu.name == desktop_gpu["name"]
    assert lab.rig("desktop").gpu.memory_total_mib == desktop_gpu["vram_mib"]


def test_ssh_argv_is_strict_and_unknown_rigs_are_named() -> None:
    lab = Lab.from_inventory(real_inventory(slot=0))
    config = lab.config
    assert lab.ssh_argv("laptop") == [
        "ssh",
        "-o",
        f"UserKnownHostsFile={config.known_hosts}",
        "-o",
        "StrictHostKeyChecking=yes",
        "-o",
        "BatchMode=yes",
        "-i",
        str(config.key_file),
        "-o",
        "IdentitiesOnly=yes",
        "root@10.213.0.12",
    ]
    assert lab.ssh_argv("laptop", ["echo", "a b"])[-2:] == ["--", "echo 'a b'"]
    with pytest.raises(ConfigError, match=r"unknown lab rig 'server' \(lab rigs: desktop, laptop\)"):
        lab.ssh_argv("server")


def test_key_file_must_be_the_labs_key(tmp_path: Path) -> None:
    inv = make_test_inventory(tmp_path / "inv", tmp_path / "lab")
    connection = inv / "group_vars" / "all" / "connection.yml"
    data = yaml.safe_load(connection.read_text())
    data["ansible_ssh_private_key_file"] = "/root/.ssh/id_ed25519"
    connection.write_text(yaml.safe_dump(data))
    with pytest.raises(
        ConfigError, match=r"lt-desktop: ansible_ssh_private_key_file is /root/.ssh/id_ed25519, but the lab's key is"
    ):
        Lab.from_inventory(Inventory.load(inv))


def test_up_refuses_an_address_outside_the_bridge_network_before_touching_anything(tmp_path: Path) -> None:
    inv = make_test_inventory(tmp_path / "inv", tmp_path / "lab")
    hosts_yml = inv / "hosts.yml"
    hosts_yml.write_text(hosts_yml.read_text().replace(f"{TEST_NETWORK}.12", "10.99.0.12"))
    lab = Lab.from_inventory(Inventory.load(inv))
    with pytest.raises(LabError, match=r"lt-laptop: address 10\.99\.0\.12 is not inside the lab network"):
        lab.up()
    assert not (tmp_path / "lab").exists()


@needs_root
def test_missing_tool_names_its_package(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for tool in ("systemd-nspawn", "debootstrap", "ip", "ssh-keygen", "ssh", "tar"):
        found = shutil.which(tool)
        if found is None:
            pytest.skip(f"{tool} is not installed here")
        (bin_dir / tool).symlink_to(found)
    monkeypatch.setenv("PATH", str(bin_dir))
    lab = Lab.from_inventory(Inventory.load(make_test_inventory(tmp_path / "inv", tmp_path / "lab")))
    with pytest.raises(LabError, match="^zstd not found; install the zstd package$"):
        lab.up()


def readable_by_others(request: pytest.FixtureRequest) -> Path:
    """A fresh directory another uid can reach, removed after the test. pytest's tmp_path is root's alone,
    and the checkout may be too (a clone in root's 0700 home): what a test runs as another uid is copied
    here, never run from the checkout."""
    readable = Path(tempfile.mkdtemp(prefix="rigctl-lab-test-", dir="/tmp"))
    request.addfinalizer(lambda: shutil.rmtree(readable))
    readable.chmod(0o755)
    return readable


#: The interpreter a test runs as another uid: the one running the tests, by its real path (the venv's
#: link may sit inside an unreachable checkout).
OTHER_UID_PYTHON = os.path.realpath(sys.executable)


@needs_root
def test_up_refuses_when_not_root(request: pytest.FixtureRequest) -> None:
    if shutil.which("setpriv") is None:
        pytest.skip("needs setpriv to drop root")
    readable = readable_by_others(request)
    lab = Lab.from_inventory(Inventory.load(make_test_inventory(readable / "inv", readable / "lab")))
    (readable / "lab.pickle").write_bytes(pickle.dumps(lab))
    # What the unprivileged child imports: rigctl and its one import outside the standard library.
    for package in (REPO / "rigctl", Path(yaml.__file__).parent):
        shutil.copytree(package, readable / "lib" / package.name, ignore=shutil.ignore_patterns("__pycache__"))
    home = readable / "home"
    home.mkdir()
    os.chown(home, 65534, 65534)
    code = (
        "import pickle\nfrom rigctl.errors import LabError\n"
        f"lab = pickle.loads(open({str(readable / 'lab.pickle')!r}, 'rb').read())\n"
        "try:\n    lab.up()\nexcept LabError as exc:\n    print(exc)\n"
    )
    done = subprocess.run(
        ["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups", OTHER_UID_PYTHON, "-c", code],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=readable,
        env={**os.environ, "PYTHONPATH": str(readable / "lib"), "HOME": str(home)},
    )
    assert (
        done.stdout.strip() == "the lab rigs need root (network namespaces, systemd-nspawn, debootstrap); run as root"
    ), done.stderr


@needs_root
def test_up_and_down_fail_at_once_while_another_holds_the_lock(tmp_path: Path) -> None:
    reason = lab_skip_reason()
    if reason:
        pytest.skip(reason)
    lab = Lab.from_inventory(Inventory.load(make_test_inventory(tmp_path / "inv", tmp_path / "lab")))
    (tmp_path / "lab").mkdir()
    holder = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import fcntl, os, sys, time\n"
            "fd = os.open(sys.argv[1], os.O_RDWR | os.O_CREAT)\n"
            "fcntl.flock(fd, fcntl.LOCK_EX)\n"
            "os.pwrite(fd, f'{os.getpid()}\\n'.encode(), 0)\n"
            "print('locked', flush=True)\n"
            "time.sleep(60)\n",
            str(lab.config.lock_file),
        ],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert holder.stdout is not None and holder.stdout.readline().strip() == "locked"
        for action in (lab.up, lab.down):
            started = time.monotonic()
            with pytest.raises(LabError, match=rf"is busy: another rigctl lab command \(pid {holder.pid}\) holds"):
                action()
            assert time.monotonic() - started < 5
    finally:
        holder.kill()
        holder.wait(timeout=10)
    assert not lab.config.hosts_dir.exists()


@needs_root
def test_up_refuses_a_bridge_name_used_by_a_stranger(tmp_path: Path) -> None:
    reason = lab_skip_reason()
    if reason:
        pytest.skip(reason)
    stranger = f"rigctl-lsbr{LAB_SLOT}"
    lab = Lab.from_inventory(
        Inventory.load(
            make_test_inventory(tmp_path / "inv", tmp_path / "lab", network=f"10.213.{40 + LAB_SLOT}", bridge=stranger)
        )
    )
    subprocess.run(["ip", "link", "add", stranger, "type", "bridge"], check=True, timeout=10)
    try:
        with pytest.raises(LabError, match=f"^{stranger} \\(the lab bridge's name\\) is already used by an interface"):
            lab.up()
        assert subprocess.run(["ip", "link", "show", stranger], capture_output=True, timeout=10).returncode == 0
    finally:
        subprocess.run(["ip", "link", "del", stranger], timeout=10)
    assert not lab.config.hosts_dir.exists()


# ----------------------------------------------------------------------------------------------- stand-in nvidia-smi


@pytest.fixture
def gpu_state(tmp_path: Path) -> Path:
    state = gpu_seed(
        "desktop", {"name": "Lab stand-in for RTX 3050 OEM", "vram_mib": 8192, "compute_capability": "8.6"}
    )
    path = tmp_path / "gpu.json"
    path.write_text(dataclasses.replace(state, memory_used_mib=512, utilization_gpu=7, temperature=41).to_json())
    return path


def smi(state: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, str(NVIDIA_SMI), *args],
        capture_output=True,
        text=True,
        timeout=30,
        env={**os.environ, "RIGCTL_LAB_GPU_STATE": str(state)},
    )


def test_stand_in_says_loudly_what_it_is() -> None:
    head = NVIDIA_SMI.read_text().splitlines()[:5]
    assert head[0] == "#!/usr/bin/python3"
    assert any("NOT NVIDIA'S nvidia-smi" in line and "LAB GPU STAND-IN" in line for line in head)


def test_stand_in_query_formats_like_the_real_tool(gpu_state: Path) -> None:
    fields = "--query-gpu=name,temperature.gpu,memory.total,memory.used,memory.free,utilization.gpu,compute_cap"
    full = smi(gpu_state, fields, "--format=csv")
    assert full.returncode == 0, full.stderr
    assert full.stdout.splitlines() == [
        "name, temperature.gpu, memory.total [MiB], memory.used [MiB], memory.free [MiB], utilization.gpu [%], "
        "compute_cap",
        "Lab stand-in for RTX 3050 OEM, 41, 8192 MiB, 512 MiB, 7680 MiB, 7 %, 8.6",
    ]
    assert smi(gpu_state, fields, "--format=csv,noheader").stdout == (
        "Lab stand-in for RTX 3050 OEM, 41, 8192 MiB, 512 MiB, 7680 MiB, 7 %, 8.6\n"
    )
    assert smi(gpu_state, fields, "--format=csv,noheader,nounits").stdout == (
        "Lab stand-in for RTX 3050 OEM, 41, 8192, 512, 7680, 7, 8.6\n"
    )
    other = smi(gpu_state, "--query-gpu=index,driver_version,persistence_mode,pci.bus_id,uuid", "--format=csv,noheader")
    uuid = json.loads(gpu_state.read_text())["uuid"]
    assert other.stdout == f"0, 535.183.01, Disabled, 00000000:01:00.0, {uuid}\n"


def test_stand_in_rejects_unknown_fields_and_formats(gpu_state: Path) -> None:
    bad = smi(gpu_state, "--query-gpu=name,fan.speedy", "--format=csv")
    assert (bad.returncode, bad.stdout, bad.stderr.strip()) == (
        2,
        "",
        'Field "fan.speedy" is not a valid field to query.',
    )
    assert smi(gpu_state, "--query-gpu=name", "--format=xml").returncode == 2
    assert smi(gpu_state, "--query-gpu=name").returncode == 2
    assert smi(gpu_state, "--bogus").returncode == 2


def test_stand_in_temperature_sequence_is_consumed_and_the_last_value_sticks(gpu_state: Path) -> None:
    state = json.loads(gpu_state.read_text())
    gpu_state.write_text(json.dumps({**state, "temperature_sequence": [83, 62, 44]}))
    seen = [
        smi(gpu_state, "--query-gpu=temperature.gpu", "--format=csv,noheader,nounits").stdout.strip() for _ in range(5)
    ]
    assert seen == ["83", "62", "44", "44", "44"]
    assert smi(gpu_state, "--query-gpu=name", "--format=csv,noheader").stdout.strip() == state["name"]
    after = json.loads(gpu_state.read_text())
    assert (after["temperature"], after["temperature_sequence"]) == (44, [])


@pytest.mark.skipif(os.geteuid() != 0 or not shutil.which("setpriv"), reason="needs root and setpriv")
def test_stand_in_sequences_move_on_for_a_reader_who_cannot_write_the_state(
    gpu_state: Path, request: pytest.FixtureRequest
) -> None:
    """rigctl's jobs read the card as the service account in a read-only sandbox: their readings move on
    through the sequences too (a cursor in the reader's own /tmp), the state itself stays as root left it."""
    state = json.loads(gpu_state.read_text())
    shared = readable_by_others(request)
    stand_in = shared / "nvidia-smi"
    shutil.copy2(NVIDIA_SMI, stand_in)
    gpu_state = shared / "gpu.json"
    gpu_state.write_text(json.dumps({**state, "temperature_sequence": [83, 62, 44]}))
    reader_tmp = shared / "reader-tmp"
    reader_tmp.mkdir()
    reader_tmp.chmod(0o777)

    def read() -> str:
        done = subprocess.run(
            [
                "setpriv",
                "--reuid=65534",
                "--regid=65534",
                "--clear-groups",
                OTHER_UID_PYTHON,
                str(stand_in),
                "--query-gpu=temperature.gpu",
                "--format=csv,noheader,nounits",
            ],
            capture_output=True,
            text=True,
            timeout=30,
            check=False,
            env={**os.environ, "RIGCTL_LAB_GPU_STATE": str(gpu_state), "TMPDIR": str(reader_tmp)},
        )
        assert done.returncode == 0, done.stderr
        return done.stdout.strip()

    assert [read() for _ in range(4)] == ["83", "62", "44", "44"]
    assert json.loads(gpu_state.read_text())["temperature_sequence"] == [83, 62, 44]  # root's to move on
    gpu_state.write_text(json.dumps({**state, "temperature_sequence": [90, 70]}))  # a test sets another
    assert [read() for _ in range(3)] == ["90", "70", "70"]


def test_stand_in_persistence_mode_and_summary_table(gpu_state: Path) -> None:
    on = smi(gpu_state, "-pm", "1")
    assert on.stdout == "Enabled persistence mode for GPU 00000000:01:00.0.\nAll done.\n"
    assert json.loads(gpu_state.read_text())["persistence_mode"] is True
    table = smi(gpu_state).stdout.splitlines()
    assert table[2].startswith("| NVIDIA-SMI 535.183.01") and "Driver Version: 535.183.01" in table[2]
    assert "CUDA Version: 12.2" in table[2]
    assert all(len(line) == 89 for line in table[1:] if line.startswith(("|", "+")))
    assert any("Lab stand-in for RTX 3050" in line and " On " in line for line in table)
    assert any("41C" in line and "512MiB /  8192MiB" in line for line in table)


# ----------------------------------------------------------------------------------------------- replayed captures


def captured(tmp_path: Path, capture: str, **readings: object) -> Path:
    state = gpu_from_capture(capture, host_gpu_uuid("duo"))
    path = tmp_path / "gpu.json"
    path.write_text(GpuState.from_mapping({**dataclasses.asdict(state), **readings}, "test").to_json())
    return path


def test_a_captured_card_prints_its_recorded_table_as_it_was(tmp_path: Path) -> None:
    for capture in ("r610-2x-rtx5090", "gb10-unified-memory", "rtx3050-8gb", "gtx1650ti", "a100-mig",
                    "mixed-5-gpu"):
        source, table = capture_text(capture)
        assert source.startswith("# source: https://github.com/")
        shown = smi(captured(tmp_path, capture))
        assert shown.returncode == 0 and shown.stdout == table, shown.stdout


def test_a_captured_card_shows_the_tests_readings_in_its_own_columns(tmp_path: Path) -> None:
    state = gpu_from_capture("r610-2x-rtx5090", host_gpu_uuid("duo"))
    second = {**state.additional_gpus[0], "temperature": 83, "memory_used_mib": 512, "utilization_gpu": 100}
    path = captured(tmp_path, "r610-2x-rtx5090", temperature=7, memory_used_mib=0, utilization_gpu=5,
                    additional_gpus=[second])
    _, table = capture_text("r610-2x-rtx5090")
    shown = smi(path).stdout.splitlines()
    recorded = table.splitlines()
    assert [len(line) for line in shown] == [len(line) for line in recorded]
    changed = {n: line for n, line in enumerate(shown) if line != recorded[n]}
    assert changed == {
        9: "|  0%    7C    P8             22W /  575W |       0MiB /  32607MiB |      5%      Default |",
        13: "| 31%   83C    P8             12W /  600W |     512MiB /  32607MiB |    100%      Default |",
    }
    # The R610 header as the driver prints it: no "Driver Version", no "CUDA Version".
    assert "KMD Version: 610.57.04     CUDA UMD Version: 13.3" in shown[2]
    only = smi(path, "-i", "1").stdout.splitlines()
    assert only[:8] == recorded[:8] and only[8:] == shown[12:]
    query = "--query-gpu=index,name,memory.total,compute_cap,driver_version,uuid,pci.bus_id,temperature.gpu"
    rows = smi(path, query, "--format=csv,noheader,nounits").stdout.splitlines()
    assert [row.split(", ")[:5] + row.split(", ")[6:] for row in rows] == [
        ["0", "NVIDIA GeForce RTX 5090", "32607", "12.0", "610.57.04", "00000000:01:00.0", "7"],
        ["1", "NVIDIA GeForce RTX 5090", "32607", "12.0", "610.57.04", "00000000:02:00.0", "83"],
    ]
    assert smi(path, query, "--format=csv,noheader,nounits", "--id=1").stdout == rows[1] + "\n"
    assert smi(path, query, "--format=csv,noheader,nounits", "-i", rows[1].split(", ")[5]).stdout == rows[1] + "\n"
    assert smi(path, "--query-gpu=mig.mode.current", "--format=csv,noheader").stdout == "[N/A]\n[N/A]\n"
    # Each card's own power cap, as its table row shows it (575 W and 600 W).
    assert smi(path, "--query-gpu=power.limit", "--format=csv,noheader").stdout == "575.00 W\n600.00 W\n"
    missing = smi(path, query, "--format=csv", "-i", "2")
    assert (missing.returncode, missing.stdout) == (6, "No devices were found\n")


def test_a_unified_memory_card_answers_as_the_real_ones_did(tmp_path: Path) -> None:
    path = captured(tmp_path, "gb10-unified-memory", temperature=35, power_draw_w=11.17)
    # https://github.com/marimo-team/marimo/pull/6822: a DGX Spark's answer to this very query.
    assert smi(path, "--query-gpu=index,name,memory.total,memory.used,memory.free",
               "--format=csv,noheader,nounits").stdout == "0, NVIDIA GB10, [N/A], [N/A], [N/A]\n"
    # https://github.com/XuehaiPan/nvitop/pull/208: another's, with units (none after [N/A]).
    assert smi(path, "--query-gpu=memory.total,memory.used,memory.free,utilization.gpu,power.draw,temperature.gpu",
               "--format=csv").stdout.splitlines() == [
        "memory.total [MiB], memory.used [MiB], memory.free [MiB], utilization.gpu [%], power.draw [W], "
        "temperature.gpu",
        "[N/A], [N/A], [N/A], 0 %, 11.17 W, 35",
    ]
    assert smi(path, "--query-gpu=power.limit", "--format=csv,noheader").stdout == "[N/A]\n"


def test_a_mixed_host_lists_its_cards_in_bus_order(tmp_path: Path) -> None:
    path = captured(tmp_path, "mixed-5-gpu")
    assert smi(path, "--query-gpu=index,name,pci.bus_id,compute_cap,memory.total",
               "--format=csv,noheader,nounits").stdout.splitlines() == [
        "0, NVIDIA GeForce RTX 2060, 00000000:01:00.0, 7.5, 6144",
        "1, NVIDIA GeForce RTX 3060, 00000000:02:00.0, 8.6, 12288",
        "2, NVIDIA GeForce RTX 3060, 00000000:03:00.0, 8.6, 12288",
        "3, NVIDIA GeForce RTX 3060 Ti, 00000000:06:00.0, 8.6, 8192",
        "4, NVIDIA GeForce RTX 3070, 00000000:08:00.0, 8.6, 8192"]


def test_a_mig_host_says_which_gpu_is_partitioned(tmp_path: Path) -> None:
    """Two A100s, MIG on GPU 0 only: the partitioned card reports no utilisation of its own."""
    path = captured(tmp_path, "a100-mig")
    assert smi(path, "--query-gpu=index,name,mig.mode.current,utilization.gpu,memory.total",
               "--format=csv,noheader,nounits").stdout.splitlines() == [
        "0, NVIDIA A100-PCIE-40GB, Enabled, [N/A], 40960", "1, NVIDIA A100-PCIE-40GB, Disabled, 0, 40960"]


def test_a_captured_card_stays_that_card(tmp_path: Path) -> None:
    state = dataclasses.asdict(gpu_from_capture("r610-2x-rtx5090", host_gpu_uuid("duo")))
    for field, value in (("name", "NVIDIA GeForce RTX 4090"), ("memory_total_mib", 65536), ("cuda_version", "12.2"),
                         ("summary", "")):
        with pytest.raises(ConfigError, match=f"t: {field} must stay as capture r610-2x-rtx5090 has them"):
            GpuState.from_mapping({**state, field: value}, "t")
    with pytest.raises(ConfigError, match="t: mig_mode, additional_gpus must stay as capture"):
        GpuState.from_mapping({**state, "mig_mode": "Enabled", "additional_gpus": [
            {**state["additional_gpus"][0], "mig_mode": "Enabled"}]}, "t")
    with pytest.raises(ConfigError, match="memory_used_mib 40000 is outside 0..32607"):
        GpuState.from_mapping({**state, "memory_used_mib": 40000}, "t")
    second = {**state["additional_gpus"][0], "memory_used_mib": 40000}
    with pytest.raises(ConfigError, match=r"additional_gpus\[0\]: memory_used_mib 40000 is outside"):
        GpuState.from_mapping({**state, "additional_gpus": [second]}, "t")
    with pytest.raises(ConfigError, match="capture nope: no such capture"):
        gpu_from_capture("nope", host_gpu_uuid("duo"))
    with pytest.raises(ConfigError, match="not a capture name"):
        gpu_from_capture("../../etc/passwd", host_gpu_uuid("duo"))


def test_the_reference_pair_from_their_captures() -> None:
    """The reference rigs' cards (an RTX 3050 8 GB, sm_86; a GTX 1650 Ti 4 GB, sm_75) as real ones printed them."""
    desktop = gpu_from_capture("rtx3050-8gb", "GPU-desktop")
    laptop = gpu_from_capture("gtx1650ti", "GPU-laptop")
    assert (desktop.name, desktop.memory_total_mib, desktop.compute_cap, desktop.driver_version,
            desktop.cuda_version) == ("NVIDIA GeForce RTX 3050", 8192, "8.6", "550.163.01", "12.4")
    assert (laptop.name, laptop.memory_total_mib, laptop.compute_cap, laptop.driver_version,
            laptop.cuda_version) == ("NVIDIA GeForce GTX 1650 Ti", 4096, "7.5", "560.35.03", "12.6")
    assert (desktop.memory_used_mib, desktop.temperature, laptop.memory_used_mib, laptop.temperature) == (
        520, 44, 364, 37)


@pytest.mark.parametrize(("capture", "driver", "cuda", "cards", "architectures"), [
    ("r610-2x-rtx5090", "610.57.04", "13.3", [("NVIDIA GeForce RTX 5090", 32607, "12.0")] * 2, "120"),
    ("gb10-unified-memory", "580.126.09", "13.0", [("NVIDIA GB10", None, "12.1")], "121"),
    ("mixed-5-gpu", "560.35.03", "12.6", [("NVIDIA GeForce RTX 2060", 6144, "7.5"),
                                          ("NVIDIA GeForce RTX 3060", 12288, "8.6"),
                                          ("NVIDIA GeForce RTX 3060", 12288, "8.6"),
                                          ("NVIDIA GeForce RTX 3060 Ti", 8192, "8.6"),
                                          ("NVIDIA GeForce RTX 3070", 8192, "8.6")], "75;86"),
    ("a100-mig", "535.129.03", "12.2", [("NVIDIA A100-PCIE-40GB", 40960, "8.0")] * 2, "80"),
    ("rtx3050-8gb", "550.163.01", "12.4", [("NVIDIA GeForce RTX 3050", 8192, "8.6")], "86"),
    ("gtx1650ti", "560.35.03", "12.6", [("NVIDIA GeForce GTX 1650 Ti", 4096, "7.5")], "75"),
])
def test_the_probe_reads_a_replayed_capture_as_the_card_it_was(
        tmp_path: Path, capture: str, driver: str, cuda: str, cards: list, architectures: str) -> None:
    """rigctl's own probe command, run against the stand-in replaying each capture: the facts are the card's."""
    from rigctl.fleet.host_facts import parse_probe, probe_command

    state = captured(tmp_path, capture)
    (tmp_path / "bin").mkdir()
    (tmp_path / "bin" / "nvidia-smi").symlink_to(NVIDIA_SMI)
    env = {**os.environ, "RIGCTL_LAB_GPU_STATE": str(state), "PATH": f"{tmp_path / 'bin'}:{os.environ['PATH']}"}
    out = subprocess.run(["bash", "-c", probe_command("t0k")], capture_output=True, text=True, env=env,
                         timeout=60).stdout
    facts = parse_probe("h", out, "t0k")
    assert (facts.driver_version, facts.cuda_version, facts.cuda_architectures) == (driver, cuda, architectures)
    assert [(g.name, g.vram_mib, g.compute_capability) for g in facts.gpus] == cards


def test_the_inventory_schema_takes_a_strangers_capture_or_gpus_not_both() -> None:
    from pydantic import ValidationError

    from rigctl.inventory.schema import UnenrolledRigSpec

    assert UnenrolledRigSpec.model_validate({"address": "10.213.9.14", "capture": "mixed-5-gpu"}).capture
    gpu = {"name": "g", "vram_mib": 4096, "compute_capability": "7.5"}
    for wrong in ({"address": "10.213.9.14"}, {"address": "10.213.9.14", "capture": "a100-mig", "gpus": [gpu]},
                  {"address": "10.213.9.14", "capture": "../x"}):
        with pytest.raises(ValidationError):
            UnenrolledRigSpec.model_validate(wrong)


def test_a_stranger_rig_can_replay_a_capture() -> None:
    from rigctl.lab.config import _stranger

    rig = _stranger("duo", {"address": "10.213.9.14", "capture": "r610-2x-rtx5090"})
    assert rig.stranger and rig.gpu.capture == "r610-2x-rtx5090" and len(rig.gpu.additional_gpus) == 1
    with pytest.raises(ConfigError, match="rigctl_lab.unenrolled.duo: needs address and either gpus"):
        _stranger("duo", {"address": "10.213.9.14", "capture": "gb10-unified-memory", "gpus": [{}]})
    with pytest.raises(ConfigError, match="rigctl_lab.unenrolled.duo: capture nope: no such capture"):
        _stranger("duo", {"address": "10.213.9.14", "capture": "nope"})


def test_set_gpu_can_rename_the_stand_in(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """``name`` is both the rig's and a GPU field: the rig's is positional only, so the GPU's can be set."""
    lab = Lab.from_inventory(real_inventory(slot=0))
    state = tmp_path / "gpu.json"
    state.write_text(lab.rig("desktop").gpu.to_json())
    monkeypatch.setattr(Lab, "_gpu_state_path", lambda self, rig: state)
    assert lab.set_gpu("desktop", name="Renamed stand-in").name == "Renamed stand-in"
    assert json.loads(state.read_text())["name"] == "Renamed stand-in"


def test_a_lab_inventory_of_n_rigs(tmp_path: Path) -> None:
    from rigctl.lab.config import write_lab_inventory

    dest = write_lab_inventory(REPO / "inventory" / "lab", tmp_path / "lab8", 8)
    inventory = Inventory.load(dest)
    assert list(inventory.hosts) == ["desktop", "laptop", *(f"rig{n}" for n in range(3, 9))]
    assert [h.address.rsplit(".", 1)[1] for h in inventory.hosts.values()] == [str(11 + n) for n in range(8)]
    # The stand-in GPUs alternate as the first two rigs' do; every rig is the lab's, on one bridge.
    gpus = [h.vars["gpu_host_gpu"]["name"] for h in inventory.hosts.values()]
    assert gpus[2::2] == [gpus[0]] * 3 and gpus[3::2] == [gpus[1]] * 3 and gpus[0] != gpus[1]
    config = Lab.from_inventory(inventory).config
    assert len(config.rigs) == 8 and len({r.address for r in config.rigs}) == 8
    check_lab_network(config.bridge, config.bridge_address, config.rigs)
    one = Inventory.load(write_lab_inventory(REPO / "inventory" / "lab", tmp_path / "lab1", 1))
    assert list(one.hosts) == ["desktop"] and not (tmp_path / "lab1" / "host_vars" / "laptop.yml").exists()


@pytest.mark.parametrize(("rigs", "message"), [(0, "--rigs: 0 is outside 1..32"), (33, "--rigs: 33 is outside")])
def test_a_lab_inventory_is_refused_what_it_cannot_make(tmp_path: Path, rigs: int, message: str) -> None:
    from rigctl.lab.config import write_lab_inventory

    with pytest.raises(ConfigError, match=message):
        write_lab_inventory(REPO / "inventory" / "lab", tmp_path / "x", rigs)
    (tmp_path / "taken").mkdir()
    with pytest.raises(ConfigError, match="already exists"):
        write_lab_inventory(REPO / "inventory" / "lab", tmp_path / "taken", 2)
    with pytest.raises(ConfigError, match="not a lab inventory's hosts"):
        write_lab_inventory(REPO / "inventory" / "rigs", tmp_path / "y", 2)
    assert not (tmp_path / "x").exists() and not (tmp_path / "y").exists()
