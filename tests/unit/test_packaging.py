"""What an installed rigctl brings besides its Python code (#38): the roles and playbooks it finds when it does
not run from a checkout, the starter inventory of `rigctl init`, the rigctl.fleet collection's layout, the
version, and the refusals of a command that would write to an inventory it was not told about. The wheel
itself, installed outside the checkout and used against the lab, is tests/lab/test_install_lab.py."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

import rigctl
from rigctl.fleet import collection, deploy
from rigctl.inventory import Inventory
from rigctl.inventory.check import check
from rigctl.inventory.starter import write_starter

REPO = Path(__file__).resolve().parents[2]
RIGCTL = str(Path(sys.executable).parent / "rigctl")
ANSIBLE = Path(sys.executable).parent


def rigctl_cli(*args: str, cwd: Path, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run([RIGCTL, *args], cwd=cwd, capture_output=True, text=True, timeout=300,
                          env={**os.environ, **(env or {})})


def test_version_is_the_packages_with_the_checkouts_commit(tmp_path: Path) -> None:
    done = rigctl_cli("--version", cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    head = subprocess.run(["git", "-C", str(REPO), "rev-parse", "HEAD"], capture_output=True, text=True,
                          check=True).stdout.strip()
    assert re.fullmatch(rf"rigctl {re.escape(rigctl.__version__)} \(commit {head}(-dirty)?\)\n", done.stdout)
    assert re.fullmatch(r"\d+\.\d+\.\d+", rigctl.__version__)


def test_a_checkout_uses_its_own_roles_wherever_it_runs(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Not the ones near the working directory or the inventory: the roles are those of the code that reads
    their results. RIGCTL_PROJECT must hold a project."""
    monkeypatch.delenv("RIGCTL_PROJECT", raising=False)
    decoy = tmp_path / "decoy"
    (decoy / "playbooks").mkdir(parents=True)
    (decoy / "ansible.cfg").write_text("[defaults]\n")
    monkeypatch.chdir(decoy)
    assert deploy.project_root() == REPO
    monkeypatch.setenv("RIGCTL_PROJECT", str(tmp_path))
    with pytest.raises(deploy.ConfigError, match=f"RIGCTL_PROJECT={tmp_path}: no ansible.cfg and playbooks/ there"):
        deploy.project_root()


def installed_config(text: str) -> subprocess.CompletedProcess[str]:
    """setup.py's copy of ``text`` (ansible.cfg), made in a process of its own: setuptools replaces distutils,
    which this one may have imported already."""
    script = "import sys\nfrom setup import installed_config\nsys.stdout.write(installed_config(sys.stdin.read()))\n"
    return subprocess.run([sys.executable, "-c", script], cwd=REPO, input=text, capture_output=True, text=True,
                          timeout=60)


def test_the_installed_ansible_cfg_points_at_the_package() -> None:
    """setup.py's copy of ansible.cfg: module_utils from the package's hostside/, no default inventory, and
    mitogen's strategy from wherever it is installed; the rest as the checkout has it."""
    checkout = (REPO / "ansible.cfg").read_text()
    done = installed_config(checkout)
    assert done.returncode == 0, done.stderr
    settings = dict(re.findall(r"^(\w+) = (.*)$", done.stdout, re.MULTILINE))
    assert settings["module_utils"] == "../hostside" and settings["roles_path"] == "roles"
    assert "inventory" not in settings and "strategy_plugins" not in settings
    assert settings["strategy"] == "mitogen_linear"
    refused = installed_config(checkout.replace("\ninventory =", "\n# inventory ="))
    assert refused.returncode == 1 and refused.stderr == "ansible.cfg: no inventory to set for the installed copy\n"


def test_init_writes_a_starter_that_passes_check_and_takes_a_first_host(tmp_path: Path) -> None:
    done = rigctl_cli("init", "fleet", cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    inventory = Inventory.load(tmp_path / "fleet")
    assert inventory.hosts == {} and check(inventory, [REPO / "roles"]) == []
    assert "next: rigctl -i fleet hosts add gpu1 ADDRESS --key" in done.stdout
    # Every file says what it is for.
    for path in (tmp_path / "fleet").rglob("*.yml"):
        assert path.read_text().startswith("#"), path
    from rigctl.fleet.enroll import InventoryFiles

    files = InventoryFiles(tmp_path / "fleet", [REPO / "roles"], what="gpu1's entry")
    files.add_to_group("gpu1", "gpu_hosts", {"ansible_host": "192.0.2.7"})
    # What `hosts add`'s probe writes: the GPU, which the starter's CUDA build needs to know its architecture.
    files.update_host_vars("gpu1", {"gpu_host_gpu": {"name": "NVIDIA GeForce RTX 3050 OEM", "vram_mib": 8192,
                                                     "compute_capability": "8.6"}})
    files.commit()  # checked before it lands: with the starter's settings, a probed host passes
    assert Inventory.load(tmp_path / "fleet").hosts["gpu1"].address == "192.0.2.7"


def test_init_refuses_a_directory_with_files_and_writes_nothing(tmp_path: Path) -> None:
    (tmp_path / "fleet").mkdir()
    (tmp_path / "fleet" / "notes.txt").write_text("mine\n")
    done = rigctl_cli("init", "fleet", cwd=tmp_path)
    assert done.returncode == 2
    assert done.stderr == "error: fleet: not empty; init writes a new inventory, it never adds to one\n"
    assert [p.name for p in (tmp_path / "fleet").iterdir()] == ["notes.txt"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["fleet"]  # no staging left beside it
    with pytest.raises(deploy.ConfigError, match="does not exist"):
        write_starter(tmp_path / "no" / "such")


def test_an_empty_fleet_loads_and_hosts_add_gets_past_it(tmp_path: Path) -> None:
    """`hosts add` into a fresh inventory reaches its own checks (here: the key file), not "no hosts"."""
    write_starter(tmp_path / "fleet")
    done = rigctl_cli("-i", "fleet", "hosts", "add", "gpu1", "192.0.2.7", "--key", "missing-key", cwd=tmp_path)
    assert done.returncode == 2 and done.stderr == "error: --key missing-key: no such file\n"
    (tmp_path / "junk.yml").write_text("just: a mapping\n")
    done = rigctl_cli("-i", "junk.yml", "hosts", cwd=tmp_path)
    assert done.returncode == 2 and "no hosts (is it an Ansible inventory?)" in done.stderr


@pytest.mark.parametrize("args", [["hosts", "add", "gpu1", "192.0.2.7", "--key", "k"], ["hosts", "remove", "gpu1"],
                                  ["hosts", "probe", "gpu1", "--write"], ["models", "pin"],
                                  ["build", "upgrade", "--to", "b9999"], ["hosts", "drain", "gpu1", "--reason", "fan"],
                                  ["hosts", "undrain", "gpu1"], ["models", "pin-revisions"]])
def test_a_command_that_writes_to_an_inventory_needs_it_named(tmp_path: Path, args: list[str]) -> None:
    """Without -i the default is ansible.cfg's (a checkout's: the lab): no command writes there unasked."""
    env = {k: v for k, v in os.environ.items() if k != "RIGCTL_INVENTORY"}
    done = subprocess.run([RIGCTL, *args], cwd=REPO, capture_output=True, text=True, timeout=120, env=env)
    command = "hosts probe --write" if args[:2] == ["hosts", "probe"] else " ".join(args[:2])
    assert done.returncode == 2
    assert done.stderr == (f"error: {command} writes to the inventory: name it with -i DIR (or RIGCTL_INVENTORY); "
                           "rigctl never writes to an inventory it was not told about\n")


# ---------------------------------------------------------------------------------------------- the collection


@pytest.fixture(scope="module")
def staged(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """rigctl.fleet's tree, where Ansible looks for it (a collections path)."""
    path = tmp_path_factory.mktemp("collections")
    dest = path / "ansible_collections" / collection.NAMESPACE / collection.NAME
    collection.stage(dest)
    return path


def test_the_collection_lays_the_roles_plugins_out_as_a_collection_does(staged: Path) -> None:
    tree = staged / "ansible_collections" / "rigctl" / "fleet"
    modules = sorted(p.name for p in (REPO / "roles").glob("*/library/*.py"))
    assert sorted(p.name for p in (tree / "plugins" / "modules").glob("*.py")) == modules
    assert not list((tree / "roles").glob("*/library")) and not list((tree / "roles").glob("*/filter_plugins"))
    hostside = {p.stem for p in (REPO / "rigctl" / "hostside").glob("*.py")}
    for module in (tree / "plugins" / "modules").glob("*.py"):
        text = module.read_text()
        assert not [m for m in re.findall(r"ansible\.module_utils\.(\w+)", text) if m in hostside], module
        for used in re.findall(r"ansible_collections\.rigctl\.fleet\.plugins\.module_utils\.(\w+)", text):
            assert (tree / "plugins" / "module_utils" / f"{used}.py").is_file(), (module, used)
    galaxy = (tree / "galaxy.yml").read_text()
    assert f"\nversion: {rigctl.__version__}\n" in galaxy and "\nnamespace: rigctl\n" in galaxy
    plain = (REPO / "roles" / "llama_server" / "vars" / "main.yml").read_text()
    assert "| llama_server_plan(" in plain
    assert "| rigctl.fleet.llama_server_plan(" in (tree / "roles" / "llama_server" / "vars" / "main.yml").read_text()


def test_the_collections_modules_and_filters_run_from_it_alone(staged: Path, tmp_path: Path) -> None:
    """A module importing the collection's module_utils runs, and the filter loads rigctl's resolver from the
    collection: Ansible with nothing of the checkout (no ansible.cfg, cwd elsewhere)."""
    binary = tmp_path / "llama-server"
    binary.write_text("#!/bin/sh\necho 'version: 4547 (c5d9effb)'\n")
    binary.chmod(0o755)
    env = {**os.environ, "ANSIBLE_COLLECTIONS_PATH": str(staged), "ANSIBLE_CONFIG": str(tmp_path / "none.cfg")}
    play = tmp_path / "play.yml"
    play.write_text(json.dumps([{"hosts": "localhost", "gather_facts": False, "tasks": [
        {"name": "version", "register": "seen", "rigctl.fleet.llama_cpp_version": {
            "binary": str(binary), "build_number": 4547, "commit": "c5d9eff"}},
        {"name": "show", "ansible.builtin.debug": {"msg": "{{ {'matches': seen.matches, 'said': seen.said, "
                                                          "'key': '/etc/ls' | rigctl.fleet.llama_server_key_file} "
                                                          "| to_json }}"}},
    ]}]))
    done = subprocess.run([str(ANSIBLE / "ansible-playbook"), "-i", "localhost,", "-c", "local", str(play)],
                          cwd=tmp_path, capture_output=True, text=True, timeout=300, env=env)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-2000:]
    shown = re.search(r'^\s*"msg": (".*")$', done.stdout, re.MULTILINE)
    assert shown, done.stdout[-3000:]
    assert json.loads(json.loads(shown[1])) == {"matches": True, "said": "build 4547, commit c5d9effb",
                                                "key": "/etc/ls/api-key"}


@pytest.mark.skipif(os.geteuid() != 0 or shutil.which("unshare") is None, reason="a read-only mount needs root")
def test_a_read_only_collections_path_is_one_error_line_and_nothing_written(tmp_path: Path) -> None:
    path = tmp_path / "collections"
    path.mkdir()
    script = (f"mount --bind {path} {path} && mount -o remount,bind,ro {path} && "
              f"exec {RIGCTL} collection install --path {path}")
    done = subprocess.run(["unshare", "--mount", "sh", "-c", script], cwd=tmp_path, capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 2
    assert done.stderr == (f"error: --path {path}: cannot write there (Read-only file system); "
                           "nothing was written\n")
    assert list(path.iterdir()) == [] and sorted(p.name for p in tmp_path.iterdir()) == ["collections"]
