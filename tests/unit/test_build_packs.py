"""A twin's llama.cpp build pack as the llama_cpp role receives it (issue 39, item 3): only as the controller
pinned it, unpacked with no owners and no setuid. The role's own receive tasks, run by Ansible on this machine
as the host (root, as on a rig)."""

from __future__ import annotations

import hashlib
import io
import json
import os
import subprocess
import sys
import tarfile
import textwrap
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
BUILD = "b1-0123456789ab"
BINARY = b"#!/bin/sh\necho llama-server\n"

needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="the role's tasks make root-owned files")

_PLAY = textwrap.dedent("""\
    - hosts: localhost
      gather_facts: false
      tasks:
        - name: The llama_cpp role's receive tasks
          ansible.builtin.include_role:
            name: llama_cpp
            tasks_from: receive
    """)


def _pack(members: dict[str, tuple[bytes, int, int]]) -> bytes:
    """A gzipped tar of ``name: (content, mode, uid)`` files, as a builder (honest or not) makes one."""
    out = io.BytesIO()
    with tarfile.open(fileobj=out, mode="w:gz") as tar:
        for name, (content, mode, uid) in members.items():
            info = tarfile.TarInfo(name)
            info.size, info.mode, info.uid, info.gid = len(content), mode, uid, uid
            tar.addfile(info, io.BytesIO(content))
    return out.getvalue()


def _manifest(binary: bytes) -> bytes:
    return json.dumps({"key": BUILD.split("-", 1)[1], "built_on": "builder",
                       "binaries": {"llama-server": hashlib.sha256(binary).hexdigest()}}).encode()


def _receive(tmp_path: Path, pack: bytes, pin: str) -> subprocess.CompletedProcess[str]:
    builds = tmp_path / "cache" / "builds"
    builds.mkdir(parents=True)
    (builds / f"{BUILD}.tar.gz").write_bytes(pack)
    (builds / f"{BUILD}.tar.gz.sha256").write_text(pin + "\n")
    (tmp_path / "work" / "artifacts").mkdir(parents=True)
    (tmp_path / "opt").mkdir()
    (tmp_path / "play.yml").write_text(_PLAY)
    (tmp_path / "hosts.ini").write_text(f"localhost ansible_connection=local "
                                        f"ansible_python_interpreter={sys.executable}\n")
    (tmp_path / "ansible.cfg").write_text(f"[defaults]\nroles_path = {REPO / 'roles'}\n"
                                          f"module_utils = {REPO / 'rigctl/hostside'}\n")
    extravars = {"rigctl_cache_dir": str(tmp_path / "cache"), "llama_cpp_work_root": str(tmp_path / "work"),
                 "llama_cpp_install_root": str(tmp_path / "opt"), "llama_cpp_targets": ["llama-server"],
                 "_llama_cpp_build_name": BUILD, "_llama_cpp_build_key": BUILD.split("-", 1)[1],
                 "__llama_cpp_source_host": "builder"}
    env = {**os.environ, "ANSIBLE_CONFIG": str(tmp_path / "ansible.cfg"), "ANSIBLE_NOCOLOR": "1",
           "ANSIBLE_LOCALHOST_WARNING": "0"}
    return subprocess.run([str(Path(sys.executable).with_name("ansible-playbook")), "-i", str(tmp_path / "hosts.ini"),
                           str(tmp_path / "play.yml"), "-e", json.dumps(extravars)],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300, check=False)


def _staged(tmp_path: Path) -> Path:
    return tmp_path / "opt" / f".staging-{BUILD}"


@needs_root
def test_a_pack_that_is_not_the_controllers_pin_is_not_unpacked(tmp_path: Path) -> None:
    """The manifest inside the pack matches its binaries (its builder wrote both): the pin is what counts."""
    pack = _pack({"./build.json": (_manifest(BINARY), 0o644, 0), "./bin/llama-server": (BINARY, 0o755, 0)})
    pin = hashlib.sha256(b"the pack the controller first published").hexdigest()
    done = _receive(tmp_path, pack, pin)
    out = done.stdout + done.stderr
    assert done.returncode != 0, out
    assert (f"localhost: the llama.cpp {BUILD} pack has sha256 {hashlib.sha256(pack).hexdigest()} but the "
            f"controller pinned {pin} ") in out, out
    assert not _staged(tmp_path).exists()


@needs_root
def test_a_pinned_pack_is_unpacked_with_no_owners_and_no_setuid(tmp_path: Path) -> None:
    """A builder's pack whose files say owner 1234 and setuid: root's files, modes under root's umask, no
    setuid (GNU tar's --no-same-permissions drops it; the role's find refuses one that would remain)."""
    pack = _pack({"./build.json": (_manifest(BINARY), 0o644, 1234), "./bin/llama-server": (BINARY, 0o4755, 1234)})
    done = _receive(tmp_path, pack, hashlib.sha256(pack).hexdigest())
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    found = {str(path.relative_to(_staged(tmp_path))): (path.stat().st_uid, oct(path.stat().st_mode & 0o7777))
             for path in _staged(tmp_path).rglob("*")}
    assert found == {"build.json": (0, "0o644"), "bin": (0, "0o755"), "bin/llama-server": (0, "0o755")}, found


_PLAN_PLAY = textwrap.dedent("""\
    - hosts: all
      gather_facts: false
      tasks:
        - name: The llama_cpp role's install tasks
          ansible.builtin.include_role:
            name: llama_cpp
            tasks_from: install
    """)


def _plans(tmp_path: Path, builders: list[str]) -> list[str]:
    """What each of three twins would get (check mode: nothing is made), where b says it has the build."""
    hosts = {"all": {"vars": {"ansible_connection": "local", "ansible_python_interpreter": sys.executable,
                              "llama_cpp_build_once": True, "rigctl_cache_dir": str(tmp_path / "cache"),
                              "llama_cpp_install_root": str(tmp_path / "opt"),
                              "llama_cpp_work_root": str(tmp_path / "work")},
                     # What the preflight registers and the install tasks read: the stat, the probe's config home.
                     "hosts": {name: {"__llama_cpp_installed": {"stat": {"exists": name == "b"}},
                                      "__llama_cpp_probe": {"config_home": str(tmp_path / "config-home")}}
                               for name in ("a", "b", "c")}}}
    tmp_path.mkdir()
    (tmp_path / "hosts.json").write_text(json.dumps(hosts))
    (tmp_path / "play.yml").write_text(_PLAN_PLAY)
    (tmp_path / "ansible.cfg").write_text(f"[defaults]\nroles_path = {REPO / 'roles'}\n"
                                          f"module_utils = {REPO / 'rigctl/hostside'}\n")
    env = {**os.environ, "ANSIBLE_CONFIG": str(tmp_path / "ansible.cfg"), "ANSIBLE_NOCOLOR": "1"}
    done = subprocess.run([str(Path(sys.executable).with_name("ansible-playbook")), "-i", str(tmp_path / "hosts.json"),
                           str(tmp_path / "play.yml"), "--check",
                           "-e", json.dumps({"llama_cpp_build_hosts": builders})],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300, check=False)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return sorted(line.strip().removeprefix('"msg": "').split(" llama.cpp ")[0]
                  for line in done.stdout.splitlines() if '"msg": "' in line and " would " in line)


def test_the_pack_comes_from_a_builder_the_inventory_names_never_from_a_host_that_says_it_has_the_build(
        tmp_path: Path) -> None:
    """b says it has the build: it keeps its own, and nobody takes it from b for that."""
    assert _plans(tmp_path / "any", []) == ["a: would build", "c: would copy from a"]
    assert _plans(tmp_path / "named", ["c"]) == ["a: would copy from c", "c: would build"]
