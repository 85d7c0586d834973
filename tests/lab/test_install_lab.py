"""rigctl as a user installs it (#38): the wheel built from this checkout, installed in a fresh venv outside it,
run with the working directory elsewhere and no RIGCTL_PROJECT (`make wheel-check`): `--version`, `init`,
`inventory check` of a copy of the reference inventory, `provision --check` against the lab; the rigctl.fleet
collection it builds, installed into a scratch collections path and used by a three-line playbook of the user's
own against the lab. Bad input: the same install without Ansible's commands, one error line each, nothing
written. The venv's packages come from pip's cache (PIP_CACHE_DIR, as `make` sets it) or the package index."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from benchlab import REPO

from rigctl.inventory import Inventory

pytestmark = pytest.mark.lab

#: The environment a user's shell gives the installed command: nothing of this checkout or its venv.
PLAIN_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
#: What the lab inventory reads from the environment (the slot; the cache with the lab's keys), and pip's cache.
PASSED = ("HOME", "RIGCTL_LAB_SLOT", "RIGCTL_CACHE_DIR", "PIP_CACHE_DIR", "PIP_FIND_LINKS", "PIP_CONFIG_FILE")
INSTALL_TIMEOUT = 900


def user_env(**extra: str) -> dict[str, str]:
    return {"PATH": PLAIN_PATH, "LANG": "C.UTF-8", **{k: os.environ[k] for k in PASSED if k in os.environ}, **extra}


@pytest.fixture(scope="module")
def installed(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """The venv (outside the checkout) with the wheel built from the checkout installed, as `pip install
    rigctl-*.whl` does; its directory holds nothing else."""
    home = tmp_path_factory.mktemp("user")
    assert REPO not in home.parents
    wheels = home / "wheels"
    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "-w", str(wheels), str(REPO)],
                   cwd=home, check=True, timeout=INSTALL_TIMEOUT, capture_output=True)
    (wheel,) = wheels.glob("rigctl-*.whl")
    venv = home / "venv"
    subprocess.run([getattr(sys, "_base_executable", sys.executable), "-m", "venv", str(venv)], check=True,
                   timeout=120)
    subprocess.run([str(venv / "bin" / "pip"), "install", "-q", str(wheel)], cwd=home, check=True,
                   timeout=INSTALL_TIMEOUT, env=user_env(), capture_output=True)
    yield venv


def rigctl(venv: Path, *args: str, cwd: Path, **env: str) -> subprocess.CompletedProcess[str]:
    done = subprocess.run([str(venv / "bin" / "rigctl"), *args], cwd=cwd, capture_output=True, text=True,
                          timeout=900, env=user_env(**env))
    print(f"$ rigctl {' '.join(args)} (exit {done.returncode})\n{done.stdout[-4000:]}\n{done.stderr[-2000:]}")
    assert "Traceback" not in done.stdout + done.stderr
    return done


def lab_copy(dest: Path) -> Path:
    shutil.copytree(REPO / "inventory" / "lab", dest)
    return dest


def test_the_wheel_is_the_whole_tool_outside_the_checkout(installed: Path, tmp_path: Path) -> None:
    from importlib import metadata

    version = rigctl(installed, "--version", cwd=tmp_path)
    assert version.returncode == 0 and version.stdout == f"rigctl {metadata.version('rigctl')}\n"
    where = subprocess.run([str(installed / "bin" / "python"), "-c",
                            "import rigctl.fleet.deploy as d; print(d.project_root())"],
                           cwd=tmp_path, capture_output=True, text=True, timeout=60, env=user_env(), check=True)
    project = Path(where.stdout.strip())
    assert installed in project.parents and (project / "roles" / "llama_cpp" / "tasks" / "main.yml").is_file()

    started = rigctl(installed, "init", "fleet", cwd=tmp_path)
    assert started.returncode == 0, started.stderr
    checked = rigctl(installed, "-i", "fleet", "inventory", "check", cwd=tmp_path)
    assert checked.returncode == 0 and checked.stdout.strip() == "fleet: 0 hosts, 0 errors, 0 warnings"

    shutil.copytree(REPO / "inventory" / "rigs", tmp_path / "rigs")
    rigs = rigctl(installed, "-i", "rigs", "inventory", "check", cwd=tmp_path)
    assert rigs.returncode == 0, rigs.stderr
    assert rigs.stdout.splitlines()[-1] == "rigs: 2 hosts, 0 errors, 4 warnings"  # the four unpinned revisions

    # No default inventory for an installed rigctl: a command without -i says so, and one that writes refuses.
    bare = rigctl(installed, "hosts", cwd=tmp_path)
    assert bare.returncode == 2 and bare.stderr.startswith("error: no inventory given and none found")
    assert len(bare.stderr.splitlines()) == 1


def test_provision_check_from_the_wheel_against_the_lab(installed: Path, lab_up: Inventory, tmp_path: Path) -> None:
    inventory = lab_copy(tmp_path / "lab")
    done = rigctl(installed, "-i", str(inventory), "provision", "--check", "--tags", "gpu_host", cwd=tmp_path)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr
    # The summary's rows: host, ok, changed, failed, unreachable, ...
    cells = [[cell.strip() for cell in line.strip("│ ").split("│")] for line in done.stdout.splitlines()
             if re.match(r"^│ (desktop|laptop) ", line)]
    rows = {row[0]: row[1:5] for row in cells}
    assert set(rows) == {"desktop", "laptop"}
    assert all(int(ok) > 0 and (failed, unreachable) == ("0", "0") for ok, _, failed, unreachable in rows.values())
    assert "site.yml (check mode)" in done.stdout


def test_the_collection_from_the_wheel_provisions_the_lab_from_a_users_playbook(
        installed: Path, lab_up: Inventory, tmp_path: Path) -> None:
    collections = tmp_path / "collections"
    collections.mkdir()
    done = rigctl(installed, "collection", "install", "--path", str(collections), cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    inventory = lab_copy(tmp_path / "lab")
    (tmp_path / "site.yml").write_text("- hosts: desktop\n  become: true\n  roles: [rigctl.fleet.gpu_host]\n")
    play = subprocess.run([str(installed / "bin" / "ansible-playbook"), "-i", str(inventory), "site.yml"],
                          cwd=tmp_path, capture_output=True, text=True, timeout=900,
                          env=user_env(ANSIBLE_COLLECTIONS_PATH=str(collections)))
    print(play.stdout[-4000:], play.stderr[-2000:])
    assert play.returncode == 0, play.stdout[-3000:]
    assert re.search(r"^desktop\s+: ok=\d+\s+changed=\d+\s+unreachable=0\s+failed=0", play.stdout, re.MULTILINE)
    assert "TASK [rigctl.fleet.gpu_host : " in play.stdout


def test_without_ansibles_commands_each_command_says_so_in_one_line(installed: Path, lab_up: Inventory,
                                                                     tmp_path: Path) -> None:
    """A rigctl whose Ansible commands are neither beside its Python nor on PATH (installed without them):
    provision and collection install refuse before anything runs or is written."""
    inventory = lab_copy(tmp_path / "lab")
    collections = tmp_path / "collections"
    collections.mkdir()
    hidden = {name: installed / "bin" / name for name in ("ansible-playbook", "ansible-galaxy")}
    for path in hidden.values():
        path.rename(path.with_name(f".{path.name}"))
    try:
        provision = rigctl(installed, "-i", str(inventory), "provision", "--check", cwd=tmp_path)
        collection = rigctl(installed, "collection", "install", "--path", str(collections), cwd=tmp_path)
    finally:
        for path in hidden.values():
            path.with_name(f".{path.name}").rename(path)
    for done, tool in ((provision, "ansible-playbook"), (collection, "ansible-galaxy")):
        assert done.returncode == 2 and len(done.stderr.splitlines()) == 1, done.stderr
        assert done.stderr.startswith(f"error: {tool} is not installed beside rigctl's Python ({installed}/bin) "
                                      "nor on PATH")
    assert list(collections.iterdir()) == []
