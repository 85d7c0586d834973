"""Ansible runs through ansible-runner, with per-task progress and per-host outcomes.

The repository's ``ansible.cfg`` holds the settings (roles path, pipelining, ControlPersist,
forks, the mitogen strategy); this module only points ansible-runner at it, so that a plain
``ansible-playbook playbooks/site.yml`` and ``rigctl provision`` behave the same.

Host keys are checked as strictly as rigctl's own SSH does: ansible-runner would otherwise set
``ANSIBLE_HOST_KEY_CHECKING=False``, which mitogen turns into ``StrictHostKeyChecking no`` with
``UserKnownHostsFile /dev/null``. Before the play starts, every host it will reach is connected to once
with :mod:`rigctl.ssh` against its ``rigctl_known_hosts``: a changed or unknown key stops the run in one
line naming the host and that file, before any task ran on any host.
"""

from __future__ import annotations

import logging
import os
import shlex
import sys
import tempfile
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rigctl.errors import ConfigError, DeployError, HostKeyError
from rigctl.fleet.deploy_lock import inventory_lock
from rigctl.inventory import Host, Inventory

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class TaskEvent:
    """One host's result for one task, as ansible-runner streams it."""

    host: str
    task: str
    status: str  # ok, changed, failed, unreachable, skipped
    message: str = ""


@dataclass
class HostOutcome:
    host: str
    ok: int = 0
    changed: int = 0
    failed: int = 0
    unreachable: int = 0
    skipped: int = 0
    #: The task that failed or could not reach the host (not one a block rescued), with its message.
    failed_task: str | None = None
    failure: str | None = None

    @property
    def succeeded(self) -> bool:
        return self.failed == 0 and self.unreachable == 0


@dataclass
class DeployResult:
    playbook: str
    status: str  # ansible-runner's: successful, failed, timeout, canceled
    rc: int
    duration: float
    hosts: dict[str, HostOutcome] = field(default_factory=dict)

    @property
    def succeeded(self) -> bool:
        return self.rc == 0 and all(h.succeeded for h in self.hosts.values())

    def failures(self) -> list[HostOutcome]:
        return [h for h in self.hosts.values() if not h.succeeded]

    def raise_for_failures(self) -> None:
        if self.succeeded:
            return
        bad = self.failures()
        if bad:
            parts = [
                f"{h.host} {'unreachable' if h.unreachable else 'failed'} at {h.failed_task!r}: {h.failure}"
                for h in bad
            ]
            raise DeployError("; ".join(parts))
        raise DeployError(f"{self.playbook}: ansible-playbook {self.status} (rc {self.rc})")


def project_root(inventory: Inventory | None = None) -> Path:
    """The directory holding ``ansible.cfg`` and ``playbooks/``: $RIGCTL_PROJECT, or found by walking up
    from the inventory, then from the working directory."""
    env = os.environ.get("RIGCTL_PROJECT")
    if env:
        root = Path(env).resolve()
        if not (root / "playbooks").is_dir():
            raise ConfigError(f"RIGCTL_PROJECT={env}: no playbooks/ directory there")
        return root
    starts = [Path.cwd()]
    if inventory is not None:
        starts.insert(0, inventory.source.resolve())
    for start in starts:
        for candidate in [start, *start.parents]:
            if (candidate / "playbooks").is_dir() and (candidate / "ansible.cfg").is_file():
                return candidate
    raise ConfigError("cannot find the rigctl project (ansible.cfg + playbooks/); set RIGCTL_PROJECT")


def mitogen_strategy_dir() -> str | None:
    """Where mitogen's strategy plugins are installed, whichever environment rigctl runs from."""
    try:
        import ansible_mitogen
    except ImportError:
        return None
    return str(Path(ansible_mitogen.__file__).parent / "plugins" / "strategy")


class _EventCollector:
    """ansible-runner's event handler: tallies per-host outcomes and forwards progress."""

    _STATUS = {
        "runner_on_ok": "ok",
        "runner_on_failed": "failed",
        "runner_on_unreachable": "unreachable",
        "runner_on_skipped": "skipped",
    }
    _STATS = (("ok", "ok"), ("changed", "changed"), ("failures", "failed"),
              ("dark", "unreachable"), ("skipped", "skipped"))

    def __init__(self, hosts: Iterable[str], on_event: Callable[[TaskEvent], None] | None,
                 on_task: Callable[[str], None] | None):
        self.hosts = {name: HostOutcome(host=name) for name in hosts}
        self.on_event = on_event
        self.on_task = on_task

    def outcome(self, name: str) -> HostOutcome:
        return self.hosts.setdefault(name, HostOutcome(host=name))

    def __call__(self, event: Mapping[str, Any]) -> bool:
        kind = event.get("event", "")
        data = event.get("event_data") or {}
        if kind == "playbook_on_task_start" and self.on_task:
            self.on_task(str(data.get("task", "")))
        elif kind == "playbook_on_stats":
            for key, attr in self._STATS:
                for host, count in (data.get(key) or {}).items():
                    setattr(self.outcome(host), attr, int(count))
            for outcome in self.hosts.values():
                if outcome.succeeded:  # its only failures were rescued
                    outcome.failed_task = outcome.failure = None
        elif kind in self._STATUS:
            self._task_result(self._STATUS[kind], data)
        return True

    def _task_result(self, status: str, data: Mapping[str, Any]) -> None:
        res = data.get("res") or {}
        if status == "ok" and res.get("changed"):
            status = "changed"
        if status == "failed" and data.get("ignore_errors"):
            status = "ok"
        host, task = str(data.get("host", "?")), str(data.get("task", ""))
        message = ""
        if status == "ok" and str(data.get("task_action", "")).rsplit(".", 1)[-1] == "debug" and res.get("msg"):
            # What a role says to the operator (the build plan, what an interrupted build left, a unit's
            # exposure): one line, without the host name the role's message starts with.
            message = " ".join(str(res["msg"]).split()).removeprefix(f"{host}: ")
        elif status in {"failed", "unreachable"}:
            message = _message(res)
            outcome = self.outcome(host)
            # The last failure is the one that stopped the host; an earlier one was rescued by a block.
            outcome.failed_task, outcome.failure = task, message
        if self.on_event:
            self.on_event(TaskEvent(host, task, status, message))


def _message(res: Mapping[str, Any]) -> str:
    # A looped task only says "One or more items failed"; the failed item says why.
    for item in res.get("results") or ():
        if isinstance(item, Mapping) and item.get("failed"):
            return _message(item)
    for key in ("msg", "stderr", "reason", "module_stderr"):
        value = res.get(key)
        if value:
            lines = [ln for ln in str(value).strip().splitlines() if ln.strip()]
            return lines[-1] if lines else str(value)
    return "failed"


def _reason(stdout: str) -> str:
    """Ansible's own error line from its output (it is followed by context lines)."""
    lines = [ln.strip() for ln in stdout.splitlines() if ln.strip()]
    errors = [ln for ln in lines if ln.startswith(("[ERROR]", "ERROR!"))]
    return (errors or lines or ["no output"])[0]


def ansible_env(root: Path) -> dict[str, str]:
    """The environment every Ansible run of rigctl gets: the project's ansible.cfg, plain output,
    and mitogen's strategy plugins from wherever rigctl is installed."""
    env = {"ANSIBLE_CONFIG": str(root / "ansible.cfg"), "ANSIBLE_FORCE_COLOR": "0", "ANSIBLE_NOCOLOR": "1",
           # ansible-runner sets it False unless it is set; whatever the caller's environment says,
           # rigctl's Ansible runs check host keys (mitogen then passes StrictHostKeyChecking yes).
           "ANSIBLE_HOST_KEY_CHECKING": "True",
           # ansible-runner starts ansible-playbook by name: find the one installed beside rigctl,
           # so a venv's rigctl works without the venv activated.
           "PATH": os.pathsep.join([str(Path(sys.executable).parent), os.environ.get("PATH", "")])}
    strategy_dir = mitogen_strategy_dir()
    if strategy_dir:
        env["ANSIBLE_STRATEGY_PLUGINS"] = strategy_dir
    return env


def check_host_keys(hosts: Iterable[Host]) -> None:
    """Connect to every SSH host once, at the same time, with rigctl's strict host-key checking; a refused
    key raises HostKeyError naming the host and its known_hosts file (several: one DeployError line
    naming each).

    Other connect failures are left to the play, which reports each unreachable host on its own.
    """
    from rigctl.ssh import SshClient, on_each_host

    def one(host: Host) -> None:
        with SshClient.for_host(host, retries=0):  # a fresh connection: the key check is the point
            return None

    outcomes = on_each_host([h for h in hosts if str(h.vars.get("ansible_connection", "ssh")) != "local"], one,
                            thread_name_prefix="rigctl-hostkeys")
    refused = [exc for exc in outcomes.values() if isinstance(exc, HostKeyError)]
    if len(refused) == 1:
        raise refused[0]
    if refused:
        raise DeployError("; ".join(str(exc) for exc in refused))


def run_playbook(
    inventory: Inventory,
    playbook: str = "site.yml",
    *,
    limit: str | None = None,
    tags: Iterable[str] = (),
    check: bool = False,
    extravars: Mapping[str, Any] | None = None,
    env: Mapping[str, str] | None = None,
    on_event: Callable[[TaskEvent], None] | None = None,
    on_task: Callable[[str], None] | None = None,
    timeout: int | None = None,
    preflight: bool = True,
    extra_args: Iterable[str] = (),
    passwords: Mapping[str, str] | None = None,
    project: Path | None = None,
) -> DeployResult:
    """Run ``playbooks/<playbook>`` against ``inventory`` and return every host's outcome.

    A failed host never stops the others from being reported; the caller decides whether to raise.
    ``preflight``: first check the selected hosts' keys (:func:`check_host_keys`); a refused key raises
    HostKeyError and nothing runs. Off, Ansible's own strict checking refuses the host (unreachable).
    One run per inventory at a time: DeployBusyError names the run that holds the inventory's lock.
    ``passwords`` maps a prompt (a regular expression) to its answer: ansible-runner types it at
    ansible-playbook's prompt (``--ask-pass`` in ``extra_args``), so a secret reaches no command
    line, file or event.
    """
    selected = inventory.select(limit)
    if preflight:
        check_host_keys(selected)
    import ansible_runner

    root = project or project_root(inventory)
    playbook_path = root / "playbooks" / playbook
    if not playbook_path.is_file():
        raise ConfigError(f"playbook {playbook_path}: no such file")
    collector = _EventCollector((h.name for h in selected), on_event, on_task)
    log.info("running %s on %s", playbook, limit or "all hosts")
    started = time.monotonic()
    # ansible-runner keeps its artifacts in the private data dir; rigctl reports from the events.
    with inventory_lock(inventory.source), tempfile.TemporaryDirectory(prefix="rigctl-runner-") as private:
        runner = ansible_runner.run(
            private_data_dir=private,
            project_dir=str(root),
            playbook=str(playbook_path),
            inventory=str(inventory.source.resolve()),
            limit=",".join(h.name for h in selected) if limit is not None else None,
            tags=",".join(tags) or None,
            cmdline=" ".join([*(["--check", "--diff"] if check else []), *map(shlex.quote, extra_args)]) or None,
            extravars=dict(extravars or {}),
            envvars={**ansible_env(root), **(env or {})},
            event_handler=collector,
            quiet=True,
            timeout=timeout,
            passwords=dict(passwords) if passwords else None,
        )
        stdout = runner.stdout.read() if runner.stdout else ""
    result = DeployResult(
        playbook=playbook,
        status=str(runner.status),
        rc=int(runner.rc if runner.rc is not None else 1),
        duration=time.monotonic() - started,
        hosts=collector.hosts,
    )
    if result.rc != 0 and not result.failures():
        # ansible-playbook stopped before any host ran (syntax error, bad option): say why.
        raise DeployError(f"{playbook}: ansible-playbook {result.status} (rc {result.rc}): {_reason(stdout)}")
    return result
