"""The rigctl.fleet Ansible collection, made from the roles that came with this rigctl: for users who write
their own playbooks (``roles: [rigctl.fleet.gpu_host]``).

A collection's roles get no plugins from their own directories (Ansible adds a role's ``library/`` and
``filter_plugins/`` for roles outside collections only), so the build lays them out as a collection does:
each role's modules in ``plugins/modules/``, importing the host-side code they use from
``plugins/module_utils/`` (``ansible.module_utils.gguf`` becomes the collection's ``gguf``), the llama_server
filters in ``plugins/filter/`` with the two standard-library files they load beside them
(``plugins/module_utils/profiles.py`` and ``sandbox.py``), which the roles name by FQCN (a collection's role finds
its collection's modules by short name, not its filters). ``ansible-galaxy collection build`` makes the
archive; ``ansible-galaxy collection install`` puts it in a collections path.
"""

from __future__ import annotations

import logging
import os
import re
import shutil
import subprocess
import tempfile
from pathlib import Path

import rigctl
from rigctl.errors import ConfigError, DeployError
from rigctl.fleet.deploy import ansible_env, ansible_tool, project_root

log = logging.getLogger(__name__)

NAMESPACE, NAME = "rigctl", "fleet"
FQCN = f"{NAMESPACE}.{NAME}"
GALAXY_FILE = Path(__file__).resolve().parent / "data" / "galaxy.yml"
PACKAGE = Path(rigctl.__file__).resolve().parent
#: The files the llama_server filter plugin loads by path, where it looks for them inside the collection.
FILTER_FILES = {"profiles.py": PACKAGE / "inventory" / "profiles.py", "sandbox.py": PACKAGE / "hostside" / "sandbox.py"}
#: Seconds ansible-galaxy may take to build or install the archive (it reads and writes local files only).
GALAXY_TIMEOUT = 300
_MODULE_UTILS_IMPORT = re.compile(r"^(\s*from\s+)ansible\.module_utils\.(\w+)(\s+import\s)", re.MULTILINE)
_SEMVER = re.compile(r"^\d+\.\d+\.\d+(-[0-9A-Za-z.-]+)?(\+[0-9A-Za-z.-]+)?$")


def collection_version() -> str:
    version = rigctl.__version__
    if not _SEMVER.match(version):
        raise ConfigError(f"rigctl {version}: not a SemVer version, which a collection needs (install rigctl)")
    return version


def _module_utils(source: str, hostside: Path) -> tuple[str, set[str]]:
    """``source`` with its imports of rigctl's host-side module_utils made the collection's; those it imports."""
    used: set[str] = set()

    def collection_import(match: re.Match[str]) -> str:
        if not (hostside / f"{match[2]}.py").is_file():
            return match[0]  # Ansible's own (basic, common...)
        used.add(match[2])
        return f"{match[1]}ansible_collections.{NAMESPACE}.{NAME}.plugins.module_utils.{match[2]}{match[3]}"

    return _MODULE_UTILS_IMPORT.sub(collection_import, source), used


def stage(dest: Path) -> None:
    """The collection's tree at ``dest`` (an empty directory)."""
    root = project_root()
    hostside = PACKAGE / "hostside"
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc", "library", "filter_plugins")
    shutil.copytree(root / "roles", dest / "roles", ignore=ignore)
    shutil.copytree(root / "playbooks", dest / "playbooks", ignore=shutil.ignore_patterns("__pycache__"))
    modules, utils, filters = (dest / "plugins" / part for part in ("modules", "module_utils", "filter"))
    for folder in (modules, utils, filters):
        folder.mkdir(parents=True)
    used: set[str] = set()
    for role in sorted((root / "roles").iterdir()):
        for module in sorted((role / "library").glob("*.py")):
            text, imported = _module_utils(module.read_text(), hostside)
            (modules / module.name).write_text(text)
            used |= imported
        for plugin in sorted((role / "filter_plugins").glob("*.py")):
            shutil.copyfile(plugin, filters / plugin.name)
    _qualify_filters(dest / "roles", filters)
    for name in sorted(used):
        text, imported = _module_utils((hostside / f"{name}.py").read_text(), hostside)
        if imported - used:
            raise ConfigError(f"rigctl/hostside/{name}.py imports {', '.join(sorted(imported - used))}, which no "
                              "module of the roles does: the collection would lack it")
        (utils / f"{name}.py").write_text(text)
    for name, source in FILTER_FILES.items():
        shutil.copyfile(source, utils / name)
    version = collection_version()
    galaxy = GALAXY_FILE.read_text()
    if "\nversion: 0.0.0\n" not in galaxy:
        raise ConfigError(f"{GALAXY_FILE}: no 'version: 0.0.0' line for the build to set")
    (dest / "galaxy.yml").write_text(galaxy.replace("\nversion: 0.0.0\n", f"\nversion: {version}\n"))
    (dest / "README.md").write_text(
        f"# {FQCN}\n\nrigctl {version}'s roles, for your own playbooks:\n\n"
        f"```yaml\n- hosts: gpu_hosts\n  become: true\n  roles: [{FQCN}.gpu_host]\n```\n\n"
        "Each role's README and `meta/argument_specs.yml` document its variables.\n")


def _qualify_filters(roles: Path, filters: Path) -> None:
    """The roles' uses of the collection's filters by their FQCN: a collection's role finds its collection's
    modules by their short names, but not its filters."""
    import importlib.util

    names: set[str] = set()
    for plugin in sorted(filters.glob("*.py")):
        spec = importlib.util.spec_from_file_location(f"_rigctl_collection_{plugin.stem}", plugin)
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        names |= set(module.FilterModule().filters())
    if not names:
        return
    use = re.compile(r"(\|\s*)(" + "|".join(sorted(map(re.escape, names))) + r")\b")
    for path in sorted(roles.rglob("*")):
        if path.is_file() and path.suffix in (".yml", ".yaml", ".j2"):
            text = path.read_text()
            qualified = use.sub(lambda m: f"{m[1]}{FQCN}.{m[2]}", text)
            if qualified != text:
                path.write_text(qualified)


def _galaxy_env() -> dict[str, str]:
    return {**os.environ, **ansible_env(project_root())}


def _galaxy(args: list[str], what: str) -> None:
    env = _galaxy_env()
    done = subprocess.run([ansible_tool("ansible-galaxy", env), *args], capture_output=True, text=True,
                          timeout=GALAXY_TIMEOUT, env=env, check=False)
    if done.returncode != 0:
        lines = [ln.strip() for ln in (done.stderr + done.stdout).splitlines() if ln.strip()]
        reason = next((ln for ln in lines if ln.startswith(("ERROR", "[ERROR]"))), lines[-1] if lines else "no output")
        raise DeployError(f"ansible-galaxy {what} failed (rc {done.returncode}): {reason}")


def build(out_dir: Path) -> Path:
    """``rigctl.fleet``'s archive (``rigctl-fleet-VERSION.tar.gz``) in ``out_dir``, made by ansible-galaxy."""
    _writable(out_dir, "--out")
    ansible_tool("ansible-galaxy", _galaxy_env())
    archive = out_dir / f"{NAMESPACE}-{NAME}-{collection_version()}.tar.gz"
    with tempfile.TemporaryDirectory(prefix="rigctl-collection-") as tmp:
        staging = Path(tmp) / "collection"
        stage(staging)
        _galaxy(["collection", "build", str(staging), "--output-path", tmp], "collection build")
        built = Path(tmp) / archive.name
        if not built.is_file():
            raise DeployError(f"ansible-galaxy collection build left no {archive.name}")
        shutil.copyfile(built, out_dir / f".{archive.name}.part")
        os.replace(out_dir / f".{archive.name}.part", archive)
    log.info("built %s", archive)
    return archive


def install(path: Path) -> Path:
    """``rigctl.fleet`` built and installed into the collections path ``path`` (replacing a copy there): Ansible
    finds it when ``path`` is on ``collections_path`` (ANSIBLE_COLLECTIONS_PATH). A path that cannot be
    written is refused before anything is built or written. The collection's directory there."""
    _writable(path, "--path")
    ansible_tool("ansible-galaxy", _galaxy_env())
    with tempfile.TemporaryDirectory(prefix="rigctl-collection-") as tmp:
        archive = build(Path(tmp))
        _galaxy(["collection", "install", str(archive), "--force", "-p", str(path)], "collection install")
    return path / "ansible_collections" / NAMESPACE / NAME


def _writable(folder: Path, option: str) -> None:
    """ConfigError naming ``option`` unless ``folder`` is a directory this process can write in."""
    if not folder.is_dir():
        raise ConfigError(f"{option} {folder}: not a directory")
    try:
        with tempfile.TemporaryFile(dir=folder):
            pass
    except OSError as exc:
        raise ConfigError(f"{option} {folder}: cannot write there ({exc.strerror}); nothing was written") from None
