"""A new GPU host joins the fleet: first contact, bootstrap, facts into the inventory.

:func:`add_host` does it in order, and only what the previous step vouched for:

1. **First contact.** The host key is fetched without authenticating (paramiko, nothing added on its
   own); its SHA256 fingerprint must match ``--fingerprint`` or be confirmed. Only then is it written
   to the inventory's known_hosts. A mismatch stops here, before any password is sent.
2. **Bootstrap.** ``playbooks/bootstrap.yml`` through ansible-runner, with the password answered at
   ansible-playbook's own prompt (never an argument, variable or file) or an existing key: the fleet
   user, the controller's key (made when missing), sudo without a password, Python.
3. **Facts.** One SSH command as the fleet user (:mod:`rigctl.fleet.host_facts`), written to
   ``host_vars/NAME.yml``; NAME added to ``hosts.yml`` under its group. Both are edited round trip
   (ruamel.yaml), so comments and order stay; the text the host chose is written ``!unsafe``, so no
   later inventory load or play templates it. ``inventory check`` must pass or nothing is kept.

Run again for the same host, every step finds its work done and no file changes.
"""

from __future__ import annotations

import contextlib
import io
import logging
import os
import re
import shlex
import socket
import subprocess
import tempfile
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import paramiko
from ruamel.yaml.comments import CommentedMap

from rigctl.errors import ConfigError, EnrollError, HostKeyError
from rigctl.files import write_atomically
from rigctl.fleet.deploy import DeployResult, TaskEvent, project_root, roles_paths, run_playbook
from rigctl.fleet.host_facts import (
    PROBE_TIMEOUT_S,
    HostFacts,
    drift,
    inventory_vars,
    new_token,
    parse_probe,
    probe_command,
)
from rigctl.hostside import sandbox
from rigctl.inventory import Host, Inventory
from rigctl.inventory.edit import InventoryEdit, round_trip_yaml
from rigctl.ssh import DEFAULT_CONNECT_TIMEOUT, SshClient, SshTarget, known_hosts_name

log = logging.getLogger(__name__)

DEFAULT_GROUP = "gpu_hosts"
DEFAULT_FLEET_USER = "rigctl"
DEFAULT_FLEET_KEY = "~/.ssh/id_ed25519"
BOOTSTRAP_TIMEOUT_S = 600
KEYGEN_TIMEOUT_S = 30
_HOST_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,62}$")
_FINGERPRINT = re.compile(r"^SHA256:[A-Za-z0-9+/]{43}$")
#: ansible-playbook's prompts for --ask-pass and --ask-become-pass.
SSH_PASSWORD_PROMPT = r"SSH password:\s*?$"
BECOME_PASSWORD_PROMPT = r"BECOME password.*:\s*?$"
HOST_VARS_HEADER = ("Written by `rigctl hosts add` from what the host reported; `rigctl hosts probe NAME` "
                    "shows drift.\nEdit freely: values rigctl does not probe are kept.")


@dataclass(frozen=True)
class FirstContact:
    name: str
    key_type: str
    fingerprint: str
    #: False when known_hosts already held this very key (nothing was written).
    written: bool


@dataclass
class AddResult:
    name: str
    contact: FirstContact
    bootstrap: DeployResult
    facts: HostFacts
    #: Files this run changed (empty when the host was in the inventory exactly so already).
    changed_files: list[Path] = field(default_factory=list)


@dataclass(frozen=True)
class ProbeResult:
    host: str
    facts: HostFacts
    #: (key path, in host_vars, on the host) for each value the host reports otherwise now.
    drift: list[tuple[str, object, object]]
    written: bool


# ----------------------------------------------------------------------------------------------- first contact


def check_fingerprint_option(value: str) -> str:
    """``--fingerprint`` as OpenSSH prints it (``SHA256:`` and 43 base64 characters)."""
    if not _FINGERPRINT.match(value):
        raise ConfigError(f"--fingerprint {value!r} is not a SHA256 fingerprint such as "
                          "SHA256:uNiVztksCsDhcc0u9e8BujQXVUpKZIDTMczCvj3tD2s (ssh-keygen -lf shows it)")
    return value


def fetch_host_key(name: str, address: str, port: int, timeout: float = DEFAULT_CONNECT_TIMEOUT) -> paramiko.PKey:
    """The key ``address:port`` presents in the key exchange; no authentication is attempted."""
    try:
        sock = socket.create_connection((address, port), timeout=timeout)
    except OSError as exc:
        raise EnrollError(f"{name}: cannot reach {address}:{port}: {exc.strerror or exc}") from None
    transport = paramiko.Transport(sock)
    transport.banner_timeout = transport.handshake_timeout = timeout
    try:
        transport.start_client(timeout=timeout)
        return transport.get_remote_server_key()
    except (OSError, EOFError, paramiko.SSHException) as exc:
        reason = str(exc) or type(exc).__name__
        raise EnrollError(f"{name}: SSH key exchange with {address}:{port} failed: {reason}") from None
    finally:
        transport.close()
        sock.close()


def known_hosts_names(name: str, address: str, port: int) -> list[str]:
    names = [known_hosts_name(address, port)]
    if name != address:
        names.append(known_hosts_name(name, port))
    return names


def first_contact(
    name: str,
    address: str,
    port: int,
    known_hosts: Path,
    *,
    fingerprint: str | None,
    confirm: Callable[[str, str], bool],
) -> FirstContact:
    """Vouch for the host's key and put it in ``known_hosts``: already there, matching ``fingerprint``,
    or confirmed by ``confirm(key_type, fingerprint)``. Anything else raises HostKeyError."""
    key = fetch_host_key(name, address, port)
    presented = key.fingerprint
    names = known_hosts_names(name, address, port)
    known = _load_known_hosts(name, known_hosts)
    recorded = [known.lookup(n) for n in names]
    recorded = [entry for entry in recorded if entry is not None]
    if recorded:
        if all(entry.get(key.get_name()) == key for entry in recorded):
            log.info("%s: %s %s is in %s already", name, key.get_name(), presented, known_hosts)
            return FirstContact(name, key.get_name(), presented, written=False)
        raise HostKeyError(name, f"{address}:{port} presented {key.get_name()} {presented}, which differs from "
                                 f"the key {known_hosts} holds for it; remove the old entry if the host was rebuilt")
    if fingerprint is not None:
        if fingerprint != presented:
            raise HostKeyError(name, f"{address}:{port} presented {key.get_name()} {presented}, not the expected "
                                     f"{fingerprint}; refused, nothing sent")
    elif not confirm(key.get_name(), presented):
        raise HostKeyError(name, f"{key.get_name()} {presented} not confirmed; refused, nothing sent")
    line = f"{','.join(names)} {key.get_name()} {key.get_base64()}\n"
    known_hosts.parent.mkdir(parents=True, exist_ok=True)
    before = known_hosts.read_text() if known_hosts.is_file() else ""
    write_atomically(known_hosts, before + ("" if not before or before.endswith("\n") else "\n") + line, 0o644)
    log.info("%s: %s %s written to %s", name, key.get_name(), presented, known_hosts)
    return FirstContact(name, key.get_name(), presented, written=True)


def remove_known_host(known_hosts: Path, names: set[str]) -> bool:
    """Drop ``names`` from every line of ``known_hosts`` (a line left with no name goes); True if it changed."""
    if not known_hosts.is_file():
        return False
    out = []
    for line in known_hosts.read_text().splitlines(keepends=True):
        fields = line.split(None, 1)
        if not fields or line.lstrip().startswith(("#", "@", "|")):
            out.append(line)
            continue
        kept = [n for n in fields[0].split(",") if n not in names]
        if kept:
            out.append(",".join(kept) + " " + fields[1] if len(fields) > 1 else line)
    text = "".join(out)
    if text == known_hosts.read_text():
        return False
    write_atomically(known_hosts, text, 0o644)
    return True


def _load_known_hosts(name: str, path: Path) -> paramiko.HostKeys:
    keys = paramiko.HostKeys()
    if path.is_file():
        try:
            keys.load(str(path))
        except (OSError, paramiko.hostkeys.InvalidHostKey) as exc:
            raise HostKeyError(name, f"cannot read {path}: {exc}") from None
    return keys


# ----------------------------------------------------------------------------------------------- bootstrap


def ensure_key_pair(private: Path) -> str:
    """The public key of ``private``, made first (ed25519, no passphrase) when there is none."""
    if not private.is_file():
        log.info("making the controller's SSH key %s", private)
        private.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
        _run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-C", "rigctl-fleet", "-f", str(private)])
    public = _run(["ssh-keygen", "-y", "-f", str(private)]).strip()
    if not public:
        raise EnrollError(f"{private}: ssh-keygen printed no public key")
    return public


def bootstrap(
    name: str,
    address: str,
    port: int,
    known_hosts: Path,
    *,
    login_user: str,
    password: str | None,
    login_key: Path | None,
    fleet_user: str,
    fleet_public_key: str,
    project: Path,
    check: bool = False,
    on_event: Callable[[TaskEvent], None] | None = None,
    on_task: Callable[[str], None] | None = None,
) -> DeployResult:
    """Run playbooks/bootstrap.yml on the new host, logged in as ``login_user`` with ``password`` or
    ``login_key``."""
    if (password is None) == (login_key is None):
        raise ConfigError("bootstrap needs exactly one of a password (--ask-pass) or a key (--key)")
    common = f"-o UserKnownHostsFile={known_hosts} -o StrictHostKeyChecking=yes"
    host: dict[str, Any] = {"ansible_host": address, "ansible_port": port, "ansible_user": login_user,
                            "ansible_ssh_common_args": common, "ansible_python_interpreter": "auto_silent",
                            "rigctl_known_hosts": str(known_hosts)}
    extra_args: list[str] = []
    passwords: dict[str, str] = {}
    if login_key is not None:
        host["ansible_ssh_private_key_file"] = str(login_key)
    else:
        host["ansible_ssh_common_args"] = f"{common} -o PubkeyAuthentication=no"
        extra_args.append("--ask-pass")
        passwords[SSH_PASSWORD_PROMPT] = password or ""
    if login_user != "root":
        extra_args.append("--become")
        if password is not None:
            extra_args.append("--ask-become-pass")
            passwords[BECOME_PASSWORD_PROMPT] = password
    with tempfile.TemporaryDirectory(prefix="rigctl-bootstrap-") as tmp:
        inventory_file = Path(tmp) / "hosts.yml"
        buffer = io.StringIO()
        round_trip_yaml().dump({"all": {"hosts": {name: host}}}, buffer)
        inventory_file.write_text(buffer.getvalue())
        inventory = Inventory.load(inventory_file)
        result = run_playbook(
            # First contact vouched for the key a moment ago; Ansible still checks it against known_hosts.
            inventory, "bootstrap.yml", check=check, project=project, extra_args=extra_args, preflight=False,
            passwords=passwords or None,
            extravars={"bootstrap_user": fleet_user, "bootstrap_public_key": fleet_public_key},
            on_event=on_event, on_task=on_task, timeout=BOOTSTRAP_TIMEOUT_S,
        )
    return result


# ----------------------------------------------------------------------------------------------- probe


def probe(target: SshTarget) -> HostFacts:
    """The host's facts, from one SSH command as ``target`` (strict host keys)."""
    token = new_token()
    with SshClient(target) as client:
        result = client.run(probe_command(token), timeout=PROBE_TIMEOUT_S, check=False)
    return parse_probe(target.name, result.stdout, token)


def config_files(target: SshTarget) -> list[str]:
    """The llama.cpp config files on the host (:func:`rigctl.hostside.sandbox.config_files_command`): drift
    unless the inventory adopts them, since any llama.cpp started there by hand reads them."""
    with SshClient(target) as client:
        listing = client.run(shlex.join(sandbox.config_files_command()), timeout=PROBE_TIMEOUT_S, check=False)
    return sandbox.parse_config_files(listing.stdout)


def probe_host(inventory: Inventory, name: str, *, write: bool = False) -> ProbeResult:
    """Read ``name``'s facts again; the drift against its host_vars; with ``write``, host_vars updated."""
    host = inventory.host(name)
    facts = probe(SshTarget.from_host(host))
    observed = inventory_vars(facts)
    found = drift(host.vars, observed)
    adopted = set(host.vars.get("llama_cpp_allow_config_files") or ())
    found += [(f"llama.cpp config file {path}", None, "present, not adopted (llama_cpp_allow_config_files)")
              for path in config_files(SshTarget.from_host(host)) if path not in adopted]
    written = False
    if write:
        files = InventoryFiles(inventory.source, roles_paths(), what=f"{name}'s facts")
        written = files.update_host_vars(name, observed) and bool(files.commit())
    return ProbeResult(name, facts, found, written)


# ----------------------------------------------------------------------------------------------- inventory files


class InventoryFiles:
    """``hosts.yml`` and ``host_vars/`` of one inventory, edited round trip through one
    :class:`~rigctl.inventory.edit.InventoryEdit`: nothing lands until :meth:`commit`, which refuses an
    inventory that fails ``inventory check`` and leaves the files as they were."""

    def __init__(self, source: Path, roles_paths: Sequence[Path], *, what: str = "the host's entry"):
        if source.is_dir():
            candidates = [source / "hosts.yml", source / "hosts.yaml"]
            found = [c for c in candidates if c.is_file()]
            if not found:
                raise ConfigError(f"inventory {source}: no hosts.yml to add the host to")
            self.hosts_file = found[0]
            self.host_vars_dir = source / "host_vars"
        else:
            self.hosts_file = source
            self.host_vars_dir = source.parent / "host_vars"
        self.edit = InventoryEdit(source, roles_paths, what=what)

    def host_vars_file(self, name: str) -> Path:
        return self.host_vars_dir / f"{name}.yml"

    # ---------------------------------------------------------------- hosts.yml

    def add_to_group(self, name: str, group: str, host_entry: Mapping[str, Any]) -> bool:
        """``name`` under ``group`` (made under ``all.children`` when missing) in hosts.yml; True if it changes."""
        data = self.edit.read(self.hosts_file)
        if not isinstance(data, dict) or not isinstance(data.get("all"), dict):
            raise ConfigError(f"{self.hosts_file}: expected a top-level 'all' group")
        where = _find_host(data["all"], "all", name)
        if where is not None:
            raise EnrollError(f"{name}: already in {self.hosts_file} (group {where}) with other settings; "
                              f"`rigctl hosts remove {name}` first")
        node = _find_group(data["all"], "all", group)
        if node is None:
            children = data["all"].setdefault("children", CommentedMap())
            if children is None:
                children = data["all"]["children"] = CommentedMap()
            node = children[group] = CommentedMap()
        if node.get("hosts") is None:
            node["hosts"] = CommentedMap()
        node["hosts"][name] = CommentedMap(host_entry)
        return self.edit.write(self.hosts_file, data)

    def remove_from_groups(self, name: str) -> bool:
        data = self.edit.read(self.hosts_file)
        if not isinstance(data, dict) or not isinstance(data.get("all"), dict):
            return False
        removed = _remove_host(data["all"], name)
        return self.edit.write(self.hosts_file, data) if removed else False

    # ---------------------------------------------------------------- host_vars

    def update_host_vars(self, name: str, values: Mapping[str, Any]) -> bool:
        """Set ``values`` in host_vars/NAME.yml (made when missing), keeping its other keys and comments;
        :class:`~rigctl.fleet.host_facts.HostText` in them is written ``!unsafe``. A value the file holds already,
        tagged alike, is left as it is."""
        return self.edit.update(self.host_vars_file(name), values, header=HOST_VARS_HEADER)

    def remove_host_vars_keys(self, name: str, keys: Sequence[str]) -> bool:
        """Remove ``keys`` from host_vars/NAME.yml, keeping the rest and its comments; True if written."""
        path = self.host_vars_file(name)
        data = self.edit.read(path)
        if not isinstance(data, dict) or not any(key in data for key in keys):
            return False
        for key in keys:
            data.pop(key, None)
        return self.edit.write(path, data)

    def remove_host_vars(self, name: str) -> bool:
        return self.edit.delete(self.host_vars_file(name))

    # ---------------------------------------------------------------- writes

    def commit(self) -> list[Path]:
        """Land what is staged, once the inventory it makes passes ``inventory check``; the files changed."""
        return self.edit.commit()

    @property
    def changed(self) -> list[Path]:
        return self.edit.changed


def _groups(node: Any) -> Iterator[tuple[str, Any]]:
    children = node.get("children") if isinstance(node, dict) else None
    for child_name, child in (children or {}).items():
        yield str(child_name), child if child is not None else None


def _find_group(node: Any, name: str, wanted: str) -> Any:
    if name == wanted:
        return node
    for child_name, child in _groups(node):
        if child is None and child_name == wanted:
            node["children"][child_name] = CommentedMap()
            return node["children"][child_name]
        found = _find_group(child, child_name, wanted)
        if found is not None:
            return found
    return None


def _find_host(node: Any, name: str, host: str) -> str | None:
    hosts = node.get("hosts") if isinstance(node, dict) else None
    if hosts and host in hosts:
        return name
    for child_name, child in _groups(node):
        found = _find_host(child, child_name, host)
        if found is not None:
            return found
    return None


def _remove_host(node: Any, host: str) -> bool:
    removed = False
    hosts = node.get("hosts") if isinstance(node, dict) else None
    if hosts and host in hosts:
        del hosts[host]
        removed = True
    for _child_name, child in _groups(node):
        removed = _remove_host(child, host) or removed
    return removed


# ----------------------------------------------------------------------------------------------- add / remove


@dataclass(frozen=True)
class AddOptions:
    name: str
    address: str
    port: int = 22
    login_user: str = "root"
    #: Log in with a password, asked for once the host key is vouched for (else ``login_key``).
    ask_pass: bool = False
    login_key: Path | None = None
    fingerprint: str | None = None
    group: str = DEFAULT_GROUP


def check_host_name(name: str) -> str:
    if not _HOST_NAME.match(name):
        raise ConfigError(f"host name {name!r}: letters, digits, '.', '_' and '-' only, "
                          "starting with a letter or digit")
    return name


def add_host(
    inventory: Inventory,
    options: AddOptions,
    *,
    confirm: Callable[[str, str], bool],
    ask_password: Callable[[], str] | None = None,
    on_event: Callable[[TaskEvent], None] | None = None,
    on_task: Callable[[str], None] | None = None,
) -> AddResult:
    """First contact, bootstrap and facts for a new host; the inventory files changed only when every
    step, and ``inventory check``, passed. ``confirm(key_type, fingerprint)`` vouches for an unknown host
    key; ``ask_password()`` is called only after that, for ``ask_pass``."""
    name = check_host_name(options.name)
    if options.ask_pass == (options.login_key is not None):
        raise ConfigError("give exactly one of --ask-pass or --key FILE")
    if options.ask_pass and ask_password is None:
        raise ConfigError("--ask-pass needs a way to ask for the password")
    if options.login_key is not None and not options.login_key.is_file():
        raise ConfigError(f"--key {options.login_key}: no such file")
    existing = inventory.hosts.get(name)
    if existing is not None and (existing.address, existing.port) != (options.address, options.port):
        raise EnrollError(f"{name}: already in the inventory at {existing.address}:{existing.port}; "
                          f"`rigctl hosts remove {name}` first")
    if existing is not None and options.group not in existing.groups:
        raise EnrollError(f"{name}: already in the inventory in groups {', '.join(existing.groups)}, "
                          f"not {options.group}")
    root = project_root()
    # The variables the host gets from its group: known_hosts, the fleet's key and user.
    prospective = existing or Inventory.load(inventory.source, add_hosts={name: options.group}).hosts[name]
    known_hosts = prospective.known_hosts
    # The fleet logs in as a sudoer, not root: the inventory's rigctl_fleet_user, else its ansible_user.
    fleet_user = str(prospective.vars.get("rigctl_fleet_user")
                     or (prospective.user if prospective.user != "root" else DEFAULT_FLEET_USER))
    fleet_key = prospective.key_file or Path(os.path.expanduser(DEFAULT_FLEET_KEY))

    contact = first_contact(name, options.address, options.port, known_hosts,
                            fingerprint=options.fingerprint, confirm=confirm)
    files = InventoryFiles(inventory.source, [root / "roles"], what=f"{name}'s entry")
    try:
        password = ask_password() if options.ask_pass and ask_password is not None else None
        public_key = ensure_key_pair(fleet_key)
        result = bootstrap(name, options.address, options.port, known_hosts, login_user=options.login_user,
                           password=password, login_key=options.login_key, fleet_user=fleet_user,
                           fleet_public_key=public_key, project=root, on_event=on_event, on_task=on_task)
        result.raise_for_failures()
        target = SshTarget(name, options.address, options.port, fleet_user, fleet_key, known_hosts)
        facts = probe(target)
        entry: dict[str, Any] = {"ansible_host": options.address}
        if options.port != 22:
            entry["ansible_port"] = options.port
        if existing is None:
            files.add_to_group(name, options.group, entry)
        host_vars = {"ansible_user": fleet_user} if fleet_user != prospective.user else {}
        host_vars.update(inventory_vars(facts))
        if prospective.key_file is None:
            host_vars["ansible_ssh_private_key_file"] = str(fleet_key)
        files.update_host_vars(name, host_vars)
        files.commit()
    except BaseException:
        if contact.written:
            with contextlib.suppress(OSError):
                remove_known_host(known_hosts, set(known_hosts_names(name, options.address, options.port)))
        raise
    return AddResult(name, contact, result, facts, files.changed + ([known_hosts] if contact.written else []))


@dataclass(frozen=True)
class RemoveResult:
    name: str
    hosts_file: bool
    host_vars: bool
    known_hosts: bool


def remove_host(inventory: Inventory, name: str) -> RemoveResult:
    """``name`` out of hosts.yml, its host_vars file and its known_hosts names; nothing on the host."""
    host: Host = inventory.host(name)
    others = {h.address for h in inventory.hosts.values() if h.name != name}
    names = {known_hosts_name(name, host.port)}
    if host.address not in others:
        names.add(known_hosts_name(host.address, host.port))
    files = InventoryFiles(inventory.source, roles_paths(), what=f"{name}'s removal")
    in_hosts = files.remove_from_groups(name)
    in_vars = files.remove_host_vars(name)
    files.commit()
    try:
        in_known = remove_known_host(host.known_hosts, names)
    except BaseException:
        files.edit.undo()
        raise
    return RemoveResult(name, in_hosts, in_vars, in_known)


# ----------------------------------------------------------------------------------------------- helpers


def _run(argv: list[str]) -> str:
    try:
        done = subprocess.run(argv, capture_output=True, text=True, timeout=KEYGEN_TIMEOUT_S, stdin=subprocess.DEVNULL)
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise EnrollError(f"`{' '.join(argv)}`: {exc}") from None
    if done.returncode != 0:
        last = (done.stderr or done.stdout).strip().splitlines()
        raise EnrollError(f"`{' '.join(argv)}` exited {done.returncode}: {last[-1] if last else 'no output'}")
    return done.stdout



