"""Ansible runs through ansible-runner, with per-task progress and per-host outcomes.

The repository's ``ansible.cfg`` holds the settings (roles path, pipelining, ControlPersist,
forks, the mitogen strategy); this module only points ansible-runner at it, so that a plain
``ansible-playbook playbooks/site.yml`` and ``rigctl provision`` behave the same.

Rolling rollouts: with ``serial`` (``rigctl provision --serial``, or ``rigctl_serial`` in the inventory) the
site play goes through the hosts in batches (Ansible's ``serial``: counts or percentages) with
``max_fail_percentage: 0``: a host failing stops its batch's other hosts at that task and no later batch
starts (a batch whose every host is unreachable stops the rest too). Ansible announces each batch as a
play start, so the outcome records which batch each host ran in, the batch that stopped the rollout and the
hosts it never reached.

Host keys are checked as strictly as rigctl's own SSH does: ansible-runner would otherwise set
``ANSIBLE_HOST_KEY_CHECKING=False``, which mitogen turns into ``StrictHostKeyChecking no`` with
``UserKnownHostsFile /dev/null``. Before the play starts, every host it will reach is connected to once
with :mod:`rigctl.ssh` against its ``rigctl_known_hosts``: a changed or unknown key stops the run in one
line naming the host and that file, before any task ran on any host.
"""

from __future__ import annotations

import contextlib
import logging
import os
import shlex
import sys
import tempfile
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rigctl.errors import ConfigError, DeployError, HostKeyError
from rigctl.fleet.deploy_lock import holder_env, hosts_lock
from rigctl.fleet.tether import Tether
from rigctl.inventory import Host, Inventory
from rigctl.inventory.schema import parse_serial

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
    #: The batch (1, 2, ...) of the rollout the host ran in; None: the run never reached it.
    batch: int | None = None

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
    #: The batch sizes asked (Ansible's ``serial``); None: every host at once.
    serial: list[int | str] | None = None
    #: The batches as they ran: the hosts of each, in order.
    batches: list[list[str]] = field(default_factory=list)

    @property
    def succeeded(self) -> bool:
        return self.rc == 0 and all(h.succeeded for h in self.hosts.values())

    def failures(self) -> list[HostOutcome]:
        return [h for h in self.hosts.values() if not h.succeeded]

    @property
    def stopped_batch(self) -> int | None:
        """In a rolling rollout that failed: the batch whose failure stopped it (the last that ran)."""
        if self.serial is None or self.succeeded or not self.batches or not self.failures():
            return None
        return len(self.batches)

    def not_run(self) -> list[str]:
        """The hosts a stopped rollout never reached."""
        if self.stopped_batch is None:
            return []
        return [h.host for h in self.hosts.values() if h.batch is None]

    def raise_for_failures(self) -> None:
        if self.succeeded:
            return
        bad = self.failures()
        if bad:
            parts = [
                f"{h.host} {'unreachable' if h.unreachable else 'failed'} at {h.failed_task!r}: {h.failure}"
                for h in bad
            ]
            stopped = self.stopped_batch
            if stopped is not None:
                not_run = self.not_run()
                parts.insert(0, f"batch {stopped} of the rollout ({', '.join(self.batches[stopped - 1])}) "
                                f"stopped it")
                parts.append(f"not run: {', '.join(not_run)}" if not_run else "no batch was left")
            raise DeployError("; ".join(parts))
        raise DeployError(f"{self.playbook}: ansible-playbook {self.status} (rc {self.rc})")


#: Where an installed rigctl keeps the roles, playbooks and ansible.cfg (setup.py copies them into the wheel).
INSTALLED_PROJECT = Path(__file__).resolve().parents[1] / "project"
#: The checkout a rigctl run from its source tree sits in.
CHECKOUT = Path(__file__).resolve().parents[2]


def is_project(path: Path) -> bool:
    return (path / "playbooks").is_dir() and (path / "ansible.cfg").is_file()


def project_root() -> Path:
    """The directory holding ``ansible.cfg``, ``roles/`` and ``playbooks/``: $RIGCTL_PROJECT when set, else the
    ones that came with this rigctl: the checkout it runs from, or the copy inside the installed package. Never
    one found near the inventory or the working directory: the roles are those of the code that reads their
    results."""
    env = os.environ.get("RIGCTL_PROJECT")
    if env:
        root = Path(env).resolve()
        if not is_project(root):
            raise ConfigError(f"RIGCTL_PROJECT={env}: no ansible.cfg and playbooks/ there")
        return root
    for candidate in (CHECKOUT, INSTALLED_PROJECT):
        if is_project(candidate):
            return candidate
    raise ConfigError(f"rigctl's roles and playbooks are missing (neither {CHECKOUT} nor {INSTALLED_PROJECT} has "
                      "ansible.cfg and playbooks/): reinstall rigctl, or set RIGCTL_PROJECT to a checkout")


def roles_paths() -> list[Path]:
    """The project's roles, whose defaults ``inventory check`` knows as variables; none without a project."""
    try:
        return [project_root() / "roles"]
    except ConfigError:
        return []


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
        self.batches: list[list[str]] = []
        self._play: str | None = None

    def outcome(self, name: str) -> HostOutcome:
        return self.hosts.setdefault(name, HostOutcome(host=name))

    def __call__(self, event: Mapping[str, Any]) -> bool:
        kind = event.get("event", "")
        data = event.get("event_data") or {}
        if kind == "playbook_on_play_start":
            # Ansible starts a play once per batch of its serial (the batch's uuid is the play's with "_N" after
            # it); a play of its own starts the count anew.
            play = str(data.get("play_uuid") or data.get("play") or "").split("_", 1)[0]
            if play != self._play:
                self._play, self.batches = play, []
            self.batches.append([])
        host = data.get("host")
        if host is not None and kind.startswith("runner_on_") and self.batches:
            outcome = self.outcome(str(host))
            if outcome.batch is None or outcome.batch < len(self.batches):
                outcome.batch = len(self.batches)
                if str(host) not in self.batches[-1]:
                    self.batches[-1].append(str(host))
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
    if res.get("msg") == "failed to validate":  # the validator (promtool, visudo...) says why
        said = [ln.strip() for ln in f"{res.get('stdout') or ''}\n{res.get('stderr') or ''}".splitlines() if ln.strip()]
        return f"failed to validate: {said[-1]}" if said else "failed to validate"
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


def ansible_tool(name: str, env: Mapping[str, str]) -> str:
    """Where Ansible's command ``name`` (ansible-playbook, ansible-galaxy) is on ``env``'s PATH (:func:`ansible_env`'s:
    beside rigctl's Python first); ConfigError naming it, before anything is written or started, when it is not."""
    import shutil

    found = shutil.which(name, path=env.get("PATH"))
    if found is None:
        raise ConfigError(f"{name} is not installed beside rigctl's Python ({Path(sys.executable).parent}) nor on "
                          f"PATH: install rigctl with its dependencies (pipx install rigctl, or pip in a venv), "
                          f"which bring ansible-core's commands")
    return found


def check_host_keys(hosts: Iterable[Host]) -> None:
    """Connect to every SSH host once, at the same time, with rigctl's strict host-key checking; a refused
    key raises HostKeyError naming the host and its known_hosts file (several: one DeployError line
    naming each).

    Other connect failures are left to the play, which reports each unreachable host on its own.
    """
    from rigctl.connections import on_each_host
    from rigctl.ssh import SshClient

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


def rollout_serial(hosts: Iterable[Host], option: str | None = None) -> list[int | str] | None:
    """The batches a provision goes in: ``option`` (``--serial``: sizes separated by commas) when given, else
    the hosts' ``rigctl_serial``, which must be the same for all; None: every host at once."""
    if option is not None:
        try:
            return parse_serial([item.strip() for item in option.split(",")])
        except ValueError as exc:
            raise ConfigError(f"--serial: {exc}") from None
    chosen: dict[str, list[int | str] | None] = {host.name: host.serial for host in hosts}
    values = {repr(v) for v in chosen.values()}
    if len(values) > 1:
        listed = ", ".join(f"{name} {value if value is not None else '(unset)'}" for name, value in chosen.items())
        raise ConfigError(f"rigctl_serial: one rollout has one set of batches, but the hosts differ ({listed})")
    return next(iter(chosen.values()), None)


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
    serial: Sequence[int | str] | None = None,
) -> DeployResult:
    """Run ``playbooks/<playbook>`` against ``inventory`` and return every host's outcome.

    A failed host never stops the others from being reported; the caller decides whether to raise. A play
    ansible-runner ended for a Ctrl-C (status ``canceled``) raises KeyboardInterrupt.
    ``preflight``: first check the selected hosts' keys (:func:`check_host_keys`); a refused key raises
    HostKeyError and nothing runs. Off, Ansible's own strict checking refuses the host (unreachable).
    One play per host at a time: DeployBusyError names the run of this controller that holds one of the
    selected hosts (:mod:`rigctl.fleet.deploy_lock`), before anything connects; a play from elsewhere holding a host
    fails that host in the play's first task, naming its holder. The play's processes die with this one
    (:mod:`rigctl.fleet.tether`), whatever ends it.
    ``passwords`` maps a prompt (a regular expression) to its answer: ansible-runner types it at
    ansible-playbook's prompt (``--ask-pass`` in ``extra_args``), so a secret reaches no command
    line, file or event. ``serial``: roll out in batches of these sizes (counts or percentages, the last
    repeating), each only after the one before succeeded on every host.
    """
    selected = inventory.select(limit)
    if serial is not None:
        try:
            serial = parse_serial(list(serial))
        except ValueError as exc:
            raise ConfigError(f"serial: {exc}") from None
    root = project or project_root()
    playbook_path = root / "playbooks" / playbook
    if not playbook_path.is_file():
        raise ConfigError(f"playbook {playbook_path}: no such file")
    ansible_tool("ansible-playbook", ansible_env(root))
    # ansible-runner keeps its artifacts in the private data dir; rigctl reports from the events.
    with hosts_lock(selected) as lock_fds, contextlib.ExitStack() as stack:
        if preflight:
            check_host_keys(selected)
        import ansible_runner

        tether = stack.enter_context(Tether(lock_fds))
        private = stack.enter_context(tempfile.TemporaryDirectory(prefix="rigctl-runner-"))
        collector = _EventCollector((h.name for h in selected), on_event, on_task)
        log.info("running %s on %s", playbook, limit or "all hosts")
        started = time.monotonic()
        runner = ansible_runner.run(
            private_data_dir=private,
            project_dir=str(root),
            playbook=str(playbook_path),
            inventory=str(inventory.source.resolve()),
            limit=",".join(h.name for h in selected) if limit is not None else None,
            tags=",".join(tags) or None,
            cmdline=" ".join([*(["--check", "--diff"] if check else []), *map(shlex.quote, extra_args)]) or None,
            extravars={**(extravars or {}),
                       **({"rigctl_serial": serial, "rigctl_max_fail_percentage": 0} if serial else {})},
            envvars={**ansible_env(root), **holder_env(), **(env or {}), **tether.env},
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
        serial=list(serial) if serial else None,
        batches=collector.batches,
    )
    if result.status == "canceled":
        # ansible-runner took the Ctrl-C and ended the play: it goes on as the interrupt it was (a run
        # record open around the play is sealed stopped, not failed), whatever the hosts had done by then.
        raise KeyboardInterrupt
    if result.rc != 0 and not result.failures():
        # ansible-playbook stopped before any host ran (syntax error, bad option): say why.
        raise DeployError(f"{playbook}: ansible-playbook {result.status} (rc {result.rc}): {_reason(stdout)}")
    return result
