"""A twin's build pack received on a lab rig over SSH (issue 39, item 3): the llama_cpp role's receive tasks
take a pack only as the controller pinned it, and unpack it as root's files with no setuid, whatever its
builder put in its headers. The pack is made here (a builder's, honest or not) in a cache of the test's own;
the rig's real builds are not touched."""

from __future__ import annotations

import hashlib
import io
import json
import tarfile
from pathlib import Path

import pytest
import yaml

from rigctl.fleet.deploy import run_playbook
from rigctl.inventory import Inventory
from rigctl.ssh import SshClient, SshTarget

REPO = Path(__file__).resolve().parents[2]
BUILD = "b1-0123456789ab"
BINARY = b"#!/bin/sh\necho llama-server\n"
#: On the rig: a tree of the test's own (install root, work root), removed afterwards.
ROOT = "/var/tmp/rigctl-pack-test"


def _pack(mode: int, uid: int) -> bytes:
    manifest = json.dumps({"key": BUILD.split("-", 1)[1], "built_on": "builder",
                           "binaries": {"llama-server": hashlib.sha256(BINARY).hexdigest()}}).encode()
    out = io.BytesIO()
    with tarfile.open(fileobj=out, mode="w:gz") as tar:
        for name, content, file_mode in (("./build.json", manifest, 0o644), ("./bin/llama-server", BINARY, mode)):
            info = tarfile.TarInfo(name)
            info.size, info.mode, info.uid, info.gid = len(content), file_mode, uid, uid
            tar.addfile(info, io.BytesIO(content))
    return out.getvalue()


def _receive(inventory: Inventory, tmp_path: Path, pack: bytes, pin: str) -> tuple[str, str]:
    """Run the receive tasks on laptop; (its failure or "", the unpacked tree as ``stat`` sees it)."""
    builds = tmp_path / "cache" / "builds"
    builds.mkdir(parents=True, exist_ok=True)
    (builds / f"{BUILD}.tar.gz").write_bytes(pack)
    (builds / f"{BUILD}.tar.gz.sha256").write_text(pin + "\n")
    project = tmp_path / "project"
    (project / "playbooks").mkdir(parents=True, exist_ok=True)
    config = (REPO / "ansible.cfg").read_text().replace("roles_path = roles", f"roles_path = {REPO / 'roles'}")
    (project / "ansible.cfg").write_text(config.replace("module_utils = rigctl/hostside",
                                                        f"module_utils = {REPO / 'rigctl/hostside'}"))
    (project / "playbooks" / "receive.yml").write_text(yaml.safe_dump([{
        "hosts": "laptop", "gather_facts": False, "become": True, "tasks": [
            {"name": "Make the test's roots", "ansible.builtin.file": {"path": f"{ROOT}/work/artifacts",
                                                                       "state": "directory", "mode": "0755"}},
            {"name": "Receive the pack", "ansible.builtin.include_role": {"name": "llama_cpp",
                                                                          "tasks_from": "receive"}}]}]))
    extravars = {"rigctl_cache_dir": str(tmp_path / "cache"), "llama_cpp_work_root": f"{ROOT}/work",
                 "llama_cpp_install_root": ROOT, "llama_cpp_targets": ["llama-server"],
                 "_llama_cpp_build_name": BUILD, "_llama_cpp_build_key": BUILD.split("-", 1)[1],
                 "__llama_cpp_source_host": "desktop"}
    result = run_playbook(inventory, "receive.yml", project=project, extravars=extravars, timeout=300)
    with SshClient(SshTarget.from_host(inventory.host("laptop"))) as ssh:
        tree = ssh.run(f"cd {ROOT}/.staging-{BUILD} 2>/dev/null && find . -mindepth 1 -printf '%P %U %m\\n' | sort; "
                       f"rm -rf {ROOT}", timeout=60).stdout
    return result.hosts["laptop"].failure or "", tree


@pytest.mark.lab
@pytest.mark.timeout(300)
def test_a_rig_takes_a_twins_pack_only_as_pinned_and_unpacks_it_without_owners_or_setuid(lab_up: Inventory,
                                                                                       tmp_path: Path) -> None:
    hostile = _pack(0o4755, 1234)
    other = hashlib.sha256(b"the pack the controller first published").hexdigest()
    failure, tree = _receive(lab_up, tmp_path / "unpinned", hostile, other)
    assert failure == (f"laptop: the llama.cpp {BUILD} pack has sha256 {hashlib.sha256(hostile).hexdigest()} but "
                       f"the controller pinned {other} ({tmp_path}/unpinned/cache/builds/{BUILD}.tar.gz.sha256); "
                       "not unpacked"), failure
    assert tree == ""

    failure, tree = _receive(lab_up, tmp_path / "pinned", hostile, hashlib.sha256(hostile).hexdigest())
    assert failure == "", failure
    assert tree.splitlines() == ["bin 0 755", "bin/llama-server 0 755", "build.json 0 644"], tree
