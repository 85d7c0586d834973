"""What the fleet refuses, on the lab rigs over real SSH, with the real build serving meanwhile:

* a llama.cpp build that starts but cannot compute is never made current (the llama_cpp role's
  smoke test bites), and `rigctl build status` still shows the old build, which keeps serving;
* a new llama-server instance that will not start fails the play naming it with its journal and
  leaves no unit enablement, arguments file or binary link behind.

The build that cannot compute is made for the test from the lab's real build: its binaries with the
entry of ``ggml_graph_compute`` (every CPU computation of ggml passes through it, ``--version`` does
not) overwritten by ``ud2``, an instruction every x86-64 CPU refuses with SIGILL. So it crashes on
its first computation on any machine, whatever its CPU supports. It reaches the host the way a
twin's build does: as an artifact in the controller's cache whose manifest matches its binaries.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import re
import struct
import subprocess
import sys
import tarfile
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from labrigs_support import check_mode_play

from rigctl.errors import DeployError
from rigctl.fleet.deploy import run_playbook
from rigctl.forward import server_endpoint
from rigctl.inventory import Host, Inventory
from rigctl.ssh import SshClient, SshTarget

REPO = Path(__file__).resolve().parents[2]
INSTALL_ROOT = "/opt/llama.cpp"
SMOKE_LOGS = "/var/cache/llama.cpp/smoke"
#: Stamping the pin explicitly changes the build key and nothing in the binaries.
BROKEN_VARS = {"llama_cpp_build_commit": "b11434", "llama_cpp_build_number": "11434"}
UD2 = b"\x0f\x0b"

pytestmark = [pytest.mark.lab, pytest.mark.timeout(3600)]


def ssh(host: Host, cmd: str, timeout: float = 120.0) -> str:
    with SshClient(SshTarget.from_host(host)) as client:
        return client.run(cmd, timeout=timeout).stdout


def link(host: Host, name: str) -> str:
    return ssh(host, f"readlink {INSTALL_ROOT}/{name} || true").strip()


def elf_symbol_offset(image: bytes, symbol: str) -> int | None:
    """File offset of a function symbol in an ELF64 little-endian image (from .symtab), or None."""
    if image[:4] != b"\x7fELF" or image[4] != 2 or image[5] != 1:
        raise ValueError("not an ELF64 little-endian file")
    shoff, = struct.unpack_from("<Q", image, 0x28)
    shentsize, shnum = struct.unpack_from("<HH", image, 0x3A)
    sections = [struct.unpack_from("<IIQQQQIIQQ", image, shoff + i * shentsize) for i in range(shnum)]
    for _name, kind, _flags, _addr, offset, size, strtab, _info, _align, entsize in sections:
        if kind != 2:  # SHT_SYMTAB
            continue
        names = sections[strtab]
        for at in range(offset, offset + size, entsize):
            st_name, st_info, _other, st_shndx, st_value, _size = struct.unpack_from("<IBBHQQ", image, at)
            end = image.index(b"\0", names[4] + st_name)
            if st_info & 0xF == 2 and st_shndx and image[names[4] + st_name:end] == symbol.encode():
                _n, _k, _f, sh_addr, sh_offset, *_ = sections[st_shndx]
                return sh_offset + st_value - sh_addr
    return None


def broken_artifact(good: Path, name: str, key: str) -> bytes:
    """``good`` (a build tarball from the controller's cache) with ggml_graph_compute trapping in every
    binary, and a manifest naming ``name``/``key`` and the patched binaries' checksums."""
    out = io.BytesIO()
    patched = 0
    with tarfile.open(good) as src, tarfile.open(fileobj=out, mode="w:gz") as dst:
        members = {m.name: (m, src.extractfile(m).read() if m.isfile() else b"") for m in src.getmembers()}  # type: ignore[union-attr]
        manifest_name = next(n for n in members if n.endswith("build.json"))
        manifest = json.loads(members[manifest_name][1])
        for member_name, (member, data) in members.items():
            if member.isfile() and "/bin/" in f"/{member_name}":
                at = elf_symbol_offset(data, "ggml_graph_compute")
                assert at is not None, f"{member_name}: no ggml_graph_compute symbol to patch"
                data = data[:at] + UD2 + data[at + len(UD2):]
                manifest["binaries"][Path(member_name).name] = hashlib.sha256(data).hexdigest()
                patched += 1
                members[member_name] = (member, data)
        manifest.update(name=name, key=key, built_on="test_refusals_lab (ud2 in ggml_graph_compute)")
        members[manifest_name] = (members[manifest_name][0], (json.dumps(manifest, indent=2) + "\n").encode())
        for member, data in members.values():
            member.size = len(data)
            dst.addfile(member, io.BytesIO(data) if member.isfile() else None)
    assert patched == len(manifest["binaries"]) >= 6
    return out.getvalue()


def planned_build_name(inv: Inventory, extravars: dict[str, str]) -> str:
    """The build name the role derives for desktop with these variables (its check-mode plan line)."""
    stdout = check_mode_play(inv, extravars)
    match = re.search(r"desktop: would build llama\.cpp (b11434-[0-9a-f]{12}) ", stdout)
    assert match, stdout[-3000:]
    return match.group(1)


def build_status(inv: Inventory) -> str:
    env = {**os.environ, "RIGCTL_INVENTORY": str(inv.source), "COLUMNS": "300"}
    proc = subprocess.run([str(Path(sys.executable).parent / "rigctl"), "build", "status", "--limit", "desktop"],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=120, check=False)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return proc.stdout


def serves(host: Host) -> str:
    """The instance smollm2's completion of a fixed prompt (it must answer, and with text)."""
    endpoint = server_endpoint(host, host.server("smollm2"))  # its URL and the inventory's key
    reply = httpx.post(f"{endpoint.url}/completion", timeout=60,
                       headers={"Authorization": f"Bearer {endpoint.api_key}"} if endpoint.api_key else {},
                       json={"prompt": "The capital of France is", "n_predict": 4, "temperature": 0})
    reply.raise_for_status()
    text = reply.json()["content"]
    assert text.strip()
    return text


@pytest.fixture()
def broken_build(lab_served: Inventory) -> Iterator[tuple[Inventory, str]]:
    inv = lab_served
    desktop = inv.host("desktop")
    cache = Path(os.path.expanduser(os.environ.get("RIGCTL_CACHE_DIR") or "~/.cache/rigctl")) / "builds"
    good = cache / f"{link(desktop, 'current')}.tar.gz"
    assert good.is_file(), f"{good}: the lab's build_once export of the current build"
    name = planned_build_name(inv, BROKEN_VARS)
    artifact = cache / f"{name}.tar.gz"
    artifact.write_bytes(broken_artifact(good, name, name.rsplit("-", 1)[1]))
    # Pinned as the controller pins a pack it publishes (roles/llama_cpp export.yml): the role takes no unpinned pack.
    pin = artifact.with_name(f"{artifact.name}.sha256")
    pin.write_text(hashlib.sha256(artifact.read_bytes()).hexdigest() + "\n")
    try:
        yield inv, name
    finally:
        artifact.unlink(missing_ok=True)
        pin.unlink(missing_ok=True)
        ssh(desktop, f"rm -f {SMOKE_LOGS}/{name}.log /var/cache/llama.cpp/artifacts/{name}.tar.gz")


def test_a_build_that_cannot_compute_is_refused_and_current_keeps_serving(broken_build: tuple[Inventory, str]) -> None:
    inv, name = broken_build
    desktop = inv.host("desktop")
    current, previous = link(desktop, "current"), link(desktop, "previous")
    answer = serves(desktop)
    listing = ssh(desktop, f"ls -A {INSTALL_ROOT}")
    # Twice: a refusal is not remembered, the next run tries again (and refuses again).
    for _ in range(2):
        result = run_playbook(inv, "site.yml", limit="desktop", tags=["llama_cpp"], extravars=BROKEN_VARS,
                              timeout=1800)
        outcome = result.hosts["desktop"]
        assert outcome.failed and outcome.failure, outcome
        assert outcome.failed_task == "Assert the staged build runs, reports the pin and computes"
        assert "\n" not in outcome.failure
        assert outcome.failure.startswith(
            f"desktop: llama.cpp {name} refused, current stays: llama-bench on a tiny model (CPU): killed by SIGILL"
        ), outcome.failure
        assert f"(log: {SMOKE_LOGS}/{name}.log)" in outcome.failure
        # current and previous untouched; the staged tree removed; the failed run's log kept.
        assert (link(desktop, "current"), link(desktop, "previous")) == (current, previous)
        assert ssh(desktop, f"ls -A {INSTALL_ROOT}") == listing
        log = ssh(desktop, f"cat {SMOKE_LOGS}/{name}.log")
        assert "# signal SIGILL" in log and "llama-bench" in log.splitlines()[0]
    status = build_status(inv)
    row = next(line for line in status.splitlines() if "desktop" in line)
    assert current in row and name not in status, status
    assert serves(desktop) == answer


def test_a_new_instance_that_will_not_start_fails_naming_it_and_leaves_nothing(lab_served: Inventory) -> None:
    inv = lab_served
    desktop = inv.host("desktop")
    v = desktop.vars
    profiles = {**v["llama_server_profiles"], "lab-broken": {"extends": "lab", "extra_args": ["--no-such-flag"]}}
    instances = {**v["llama_server_instances"],
                 "smollm2-broken": {"artifact": "smollm2-135m-q4_1", "profile": "lab-broken", "port": 8097}}
    answer = serves(desktop)
    with pytest.raises(DeployError):
        result = run_playbook(inv, "site.yml", limit="desktop", tags=["llama_server"],
                              extravars={"llama_server_profiles": profiles, "llama_server_instances": instances})
        outcome = result.hosts["desktop"]
        result.raise_for_failures()
    failure = outcome.failure or ""
    assert outcome.failed_task == "Fail the rollout of llama-server@smollm2-broken", outcome
    assert "\n" not in failure
    assert failure.startswith("desktop: llama-server@smollm2-broken failed its rollout ("), failure
    assert "new instance stopped and removed" in failure
    assert "invalid argument: --no-such-flag" in failure.split("journal: ", 1)[1]  # the journal's tail
    # No enablement, no arguments file, no binary link; systemd holds no failed state for it.
    key_file = ["api-key"] if desktop.vars.get("llama_server_api_key") else []
    assert ssh(desktop, "ls /etc/llama-server").split() == sorted(
        [*key_file, *(f"{s.name}.{ext}" for s in desktop.servers for ext in ("args", "bin", "env"))])
    wants = ssh(desktop, "ls /etc/systemd/system/multi-user.target.wants/")
    assert "smollm2-broken" not in wants, wants
    state = ssh(desktop, "systemctl is-failed llama-server@smollm2-broken.service || true").strip()
    assert state in ("inactive", "unknown"), state
    assert serves(desktop) == answer
