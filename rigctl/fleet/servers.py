"""The llama-server instances of the fleet: state, restart and logs (`rigctl servers`), and the one server
lifecycle around a run.

Each instance is the systemd unit ``llama-server@<name>.service`` that roles/llama_server installs from
the inventory's ``llama_server_instances``. This module asks systemd over SSH (``systemctl show``,
``journalctl``) and the server itself over HTTP (``/health``, ``/props``, through
:mod:`rigctl.llama_http`, at :func:`rigctl.forward.server_endpoint`: an SSH forward for an instance that listens
on loopback); the parsers of what systemd prints are pure functions.

Fleet calls return one record per instance and keep going when a host cannot be reached: that host's
instances come back with ``state="unreachable"`` and the reason in ``error``.

**Around a run** (bench, drafting, campaign, evals, upgrades): :func:`running` starts the instances that are down and
stops them after, :func:`stopped` frees an instance's card and port and starts it again after,
:func:`probe_server` runs a probe of an instance (its own arguments with a few settings changed) as a
transient unit, :func:`restart_instance` restarts one. Each waits with :func:`wait_ready`: ``/health``
until 200, while the unit's state says it is still coming up; a unit that fails (or falls into
auto-restart) ends the wait at once with its journal's last line. The rule and the timeouts are
:mod:`rigctl.hostside.units`', which the host's job runtime uses for the servers a bench stops.
"""

from __future__ import annotations

import json
import logging
import re
import shlex
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

from rigctl.connections import on_each_host
from rigctl.errors import ConfigError, RemoteCommandError, RigctlError, ServerError
from rigctl.forward import server_endpoint
from rigctl.hostside import ship
from rigctl.hostside import units as host_units
from rigctl.hostside.sandbox import clean_exec, config_files_command, parse_config_files, run_options
from rigctl.inventory import Host, Inventory, Server
from rigctl.inventory.profiles import args_lines_to_argv, unit_name
from rigctl.llama_http import NO_RETRY, Endpoint, Retry, ServerClient, Timeouts
from rigctl.ssh import SshClient, session

log = logging.getLogger(__name__)

#: Seconds for one systemctl/journalctl call over SSH that does not wait on a unit.
SSH_TIMEOUT = 30.0
#: Seconds for one /health or /props request when listing.
HTTP_TIMEOUT = 5.0
#: The properties `systemctl show` is asked for.
UNIT_PROPERTIES = ("Id", "ActiveState", "SubState", "MainPID", "NRestarts")
#: One set of timeouts for every start, stop and wait around a run (:mod:`rigctl.hostside.units`).
SYSTEMCTL_TIMEOUT_S = host_units.SYSTEMCTL_TIMEOUT_S
HEALTH_TIMEOUT_S = host_units.HEALTH_TIMEOUT_S


def operator_start(units: Sequence[str], action: str = "start") -> str:
    """The shell command for an operator's ``systemctl start|restart`` of ``units``: their failure counters
    cleared first (:mod:`rigctl.hostside.units`)."""
    return host_units.shell(action, units)


@dataclass(frozen=True)
class UnitState:
    """One unit as systemd reports it."""

    unit: str
    active_state: str  # active, inactive, failed, activating, ...
    sub_state: str  # running, dead, auto-restart, ...
    main_pid: int  # 0 when not running
    n_restarts: int  # automatic restarts since the unit was last started by hand


@dataclass(frozen=True)
class ServerStatus:
    """One instance: what the inventory says, what systemd says, what the server answers."""

    host: str
    name: str
    port: int
    artifact: str
    profile: str
    enabled: bool
    state: str  # systemd ActiveState, or "unreachable" when the host did not answer
    main_pid: int
    healthy: bool
    health: str  # "ok", "loading model", or why not
    model: str | None = None  # /props model_path
    build: str | None = None  # /props build_info
    error: str | None = None
    #: What of the running process differs from the instance's files now (arguments, binary, environment):
    #: files written by a play that did not get to restart it. Empty when it runs its files or does not run.
    pending_restart: tuple[str, ...] = ()
    #: The llama.cpp config files on the instance's host (rigctl/hostside/sandbox.py's fact): hidden from it by its
    #: sandbox, read by any llama.cpp started there by hand; drift unless the inventory adopts them.
    config_files: tuple[str, ...] = ()


def parse_unit_show(text: str) -> dict[str, UnitState]:
    """``systemctl show -p Id,ActiveState,SubState,MainPID,NRestarts UNIT...`` output, by unit.

    systemctl prints one ``Key=value`` block per unit, blocks separated by a blank line.
    """
    states: dict[str, UnitState] = {}
    for block in text.strip().split("\n\n"):
        fields = dict(line.split("=", 1) for line in block.splitlines() if "=" in line)
        if not fields.get("Id"):
            continue
        states[fields["Id"]] = UnitState(
            unit=fields["Id"],
            active_state=fields.get("ActiveState", "unknown"),
            sub_state=fields.get("SubState", "unknown"),
            main_pid=int(fields.get("MainPID") or 0),
            n_restarts=int(fields.get("NRestarts") or 0),
        )
    return states


def show_command(servers: Iterable[str]) -> str:
    """The remote command whose output :func:`parse_unit_show` reads."""
    units = " ".join(shlex.quote(unit_name(s)) for s in servers)
    return f"systemctl show -p {','.join(UNIT_PROPERTIES)} {units}"


def parse_pending_restarts(data: object, host: str) -> dict[str, tuple[str, ...]]:
    """:mod:`rigctl.hostside.server_drift`'s answer, decoded: instance -> what differs. ConfigError naming the
    host when it is not that."""
    if not isinstance(data, dict) or not all(
        isinstance(what, list) and all(isinstance(w, str) for w in what) for what in data.values()
    ):
        raise ConfigError(f"{host}: the running-process check answered a {type(data).__name__}, not instance -> "
                          "list of differences")
    return {str(name): tuple(what) for name, what in data.items()}


def pending_restarts(host: Host, servers: Iterable[Server]) -> dict[str, tuple[str, ...]]:
    """The running instances of ``servers`` on ``host`` whose process differs from their files now, with what
    differs (:mod:`rigctl.hostside.server_drift`)."""
    by_dir: dict[str, list[str]] = {}
    for server in servers:
        by_dir.setdefault(server.config_dir, []).append(server.name)
    pending: dict[str, tuple[str, ...]] = {}
    with session(host) as ssh:
        for config_dir, names in by_dir.items():
            cmd = ship.python_command("server_drift", json.dumps({"config_dir": config_dir, "names": names}))
            answer = ssh.run(cmd, timeout=SSH_TIMEOUT, check=True).stdout
            try:
                decoded = json.loads(answer)
            except ValueError:
                raise ConfigError(f"{host.name}: the running-process check answered {answer[:80]!r}, "
                                  "not JSON") from None
            pending.update(parse_pending_restarts(decoded, host.name))
    return pending


def unit_states(host: Host, servers: Iterable[str]) -> dict[str, UnitState]:
    """systemd's view of ``servers`` on ``host``, by instance name (RemoteCommandError, ConnectError)."""
    names = list(servers)
    if not names:
        return {}
    with session(host) as ssh:
        out = ssh.run(show_command(names), timeout=SSH_TIMEOUT, check=True).stdout
    by_unit = parse_unit_show(out)
    return {name: by_unit[unit_name(name)] for name in names if unit_name(name) in by_unit}


def config_files(host: Host) -> tuple[str, ...]:
    """The llama.cpp config files on ``host`` (:func:`rigctl.hostside.sandbox.config_files_command`)."""
    with session(host) as ssh:
        out = ssh.run(shlex.join(config_files_command()), timeout=SSH_TIMEOUT, check=False).stdout
    return tuple(parse_config_files(out))


def probe(host: Host, server: Server, timeout: float = HTTP_TIMEOUT) -> tuple[bool, str, str | None, str | None]:
    """(healthy, health text, model_path, build_info) from the instance's /health and /props."""
    timeouts = Timeouts(connect=timeout, read=timeout, write=timeout, pool=timeout)
    with ServerClient(server_endpoint(host, server), timeouts=timeouts, retry=NO_RETRY) as client:
        health = client.health()
        if not health.ok:
            return False, health.status, None, None
        try:
            props = client.props()
        except ServerError as exc:
            return True, f"{health.status} (/props: {str(exc).split(': ', 2)[-1]})", None, None
        return True, health.status, props.model_path, props.build_info


def host_status(host: Host) -> list[ServerStatus]:
    """Every instance of ``host``; an unreachable host gives rows with state ``unreachable``."""
    instances = host.servers
    try:
        states = unit_states(host, (s.name for s in instances))
        pending = pending_restarts(host, instances)
        found = config_files(host)
        error = None
    except RigctlError as exc:
        states, pending, found, error = {}, {}, (), str(exc)
    rows = []
    for inst in instances:
        unit = states.get(inst.name)
        if error is not None:
            rows.append(ServerStatus(host.name, inst.name, inst.port, inst.artifact, inst.profile.name, inst.enabled,
                                     "unreachable", 0, False, "-", error=error))
            continue
        state = unit.active_state if unit else "unknown"
        if not inst.enabled and state != "active":
            rows.append(ServerStatus(host.name, inst.name, inst.port, inst.artifact, inst.profile.name, inst.enabled,
                                     state, 0, False, "disabled"))
            continue
        healthy, health, model, build = probe(host, inst)
        rows.append(ServerStatus(host.name, inst.name, inst.port, inst.artifact, inst.profile.name, inst.enabled,
                                 state, unit.main_pid if unit else 0,
                                 healthy, health, model, build, pending_restart=pending.get(inst.name, ()),
                                 config_files=found))
    return rows


def list_servers(inventory: Inventory, limit: str | None = None) -> list[ServerStatus]:
    """Every instance of the selected hosts, asked of every host at once (a host by host walk grew with the
    fleet: perf/fleet_scale.py), in inventory order."""
    hosts = inventory.select(limit)
    instances = {host.name: host.servers for host in hosts}  # a bad inventory is the caller's error, as before
    outcomes = on_each_host(hosts, host_status, thread_name_prefix="rigctl-servers")
    rows: list[ServerStatus] = []
    for host in hosts:
        outcome = outcomes[host.name]
        if isinstance(outcome, RigctlError):  # what host_status does not keep as its rows: that host's alone
            rows += [ServerStatus(host.name, inst.name, inst.port, inst.artifact, inst.profile.name, inst.enabled,
                                  "unreachable", 0, False, "-", error=str(outcome)) for inst in instances[host.name]]
        else:
            rows += outcome
    return rows


def restart(inventory: Inventory, host_name: str, server: str, timeout: float = HEALTH_TIMEOUT_S) -> ServerStatus:
    """Restart instance ``server`` on ``host_name`` and wait until it answers /health 200.

    ServerError when it is not healthy within ``timeout`` seconds, or its unit fails first (the unit's state
    and its journal's last line are in the message).
    """
    host = inventory.host(host_name)
    instance = host.server(server)
    with session(host) as ssh:
        restart_instance(ssh, instance, timeout=timeout)
    healthy, health, model, build = probe(host, instance)
    state = unit_states(host, [server])[server]
    return ServerStatus(host.name, server, instance.port, instance.artifact, instance.profile.name, instance.enabled,
                        state.active_state, state.main_pid, healthy, health, model, build)


def stop_servers(host: Host) -> None:
    """Stop every llama-server instance of ``host`` (a drain whose policy says stop; RemoteCommandError)."""
    if host.servers:
        with session(host) as ssh:
            systemctl(ssh, "stop", [unit_name(s.name) for s in host.servers])


def logs(inventory: Inventory, host_name: str, server: str, lines: int = 50) -> str:
    """The last ``lines`` journal lines of instance ``server`` on ``host_name``."""
    if lines < 1:
        raise ConfigError(f"-n {lines}: give at least 1 line")
    host = inventory.host(host_name)
    unit = host.server(server).unit
    command = f"journalctl --no-pager -o short-iso -n {int(lines)} -u {shlex.quote(unit)}"
    with session(host) as ssh:
        return ssh.run(command, timeout=SSH_TIMEOUT, check=True).stdout


def restart_retry(host: Host, server: str) -> Retry | None:
    """Enough retries for a client of ``server`` to ride through one restart of it (systemd's restart delay
    and the load time its last rollout measured: :func:`rigctl.hostside.units.fact_restart_wait_s`); None,
    logged, when the host cannot be read or its fact does not say."""
    try:
        with session(host) as ssh:
            fact = ssh.run(f"cat {host_units.SERVER_FACT}", timeout=SSH_TIMEOUT, check=False).stdout
    except RigctlError as exc:
        log.warning("%s: llama_server fact not read (default retries): %s", host.name, exc)
        return None
    wait_s = host_units.fact_restart_wait_s(fact, server)
    if wait_s is None:
        log.info("%s: no measured load time for %s in %s (default retries)", host.name, server,
                 host_units.SERVER_FACT)
        return None
    return Retry.within(wait_s)


# ----------------------------------------------------------------------------------------------- around a run


def systemctl(ssh: SshClient, action: str, units: Sequence[str]) -> None:
    """``systemctl ACTION UNITS`` on the host as :mod:`rigctl.hostside.units` says (RemoteCommandError)."""
    result = ssh.run(host_units.shell(action, units), timeout=SYSTEMCTL_TIMEOUT_S, check=False)
    if result.rc != 0:
        raise RemoteCommandError(ssh.host, f"systemctl {action} {' '.join(units)}", result.rc, result.stderr)


def unit_state(ssh: SshClient, unit: str) -> UnitState | None:
    """systemd's view of one unit (None when systemctl says nothing of it)."""
    out = ssh.run(f"systemctl show -p {','.join(UNIT_PROPERTIES)} {shlex.quote(unit)}", timeout=SSH_TIMEOUT,
                  check=False).stdout
    return parse_unit_show(out).get(unit if "." in unit else f"{unit}.service")


def active_units(ssh: SshClient, units: Sequence[str]) -> list[str]:
    """Those of ``units`` that are active (running, or starting: a server loading its model)."""
    states = ssh.run(f"systemctl is-active {shlex.join(units)}", timeout=SSH_TIMEOUT, check=False).stdout.split()
    return [u for u, state in zip(units, states, strict=False) if state in ("active", "activating", "reloading")]


def journal_tail(ssh: SshClient, unit: str) -> str:
    """The last lines ``unit``'s own process wrote to the journal (why it failed, mostly); "" when none."""
    out = ssh.run(f"journalctl -u {shlex.quote(unit)} -n 40 --no-pager -o json", timeout=SSH_TIMEOUT,
                  check=False).stdout
    return last_own_messages(out)


#: A line that says what went wrong: llama.cpp's log level E after its timestamp, or an "error:" line (its
#: argument parser's).
_ERROR_LINE = re.compile(r"^(?:[0-9.]+ E |error\b)", re.IGNORECASE)


def last_own_messages(journal_json: str) -> str:
    """What a unit's own process said in its last run (its ``_SYSTEMD_INVOCATION_ID``), from ``journalctl -o
    json`` output: the first error line (the cause: "couldn't bind ...", "invalid argument ...") and the last
    line (the exit), joined by " / "; systemd's own lines about the unit ("Main process exited") are left
    out. Pure."""
    own: list[tuple[object, str]] = []
    for line in journal_json.splitlines():
        try:
            entry = json.loads(line)
        except ValueError:
            continue
        if not isinstance(entry, dict) or entry.get("SYSLOG_IDENTIFIER") == "systemd" or entry.get("_PID") == "1":
            continue
        message = entry.get("MESSAGE")
        if isinstance(message, list):  # bytes that are not UTF-8, as journalctl sends them
            message = bytes(b for b in message if isinstance(b, int) and 0 <= b < 256).decode(errors="replace")
        if isinstance(message, str) and message.strip():  # data from the host: one printable line each
            text = "".join(c for c in " ".join(message.split()) if c.isprintable())[:300]
            own.append((entry.get("_SYSTEMD_INVOCATION_ID"), text))
    said = [text for run, text in own if run == own[-1][0]] if own else []
    cause = next((m for m in said if _ERROR_LINE.match(m)), None)
    return " / ".join(dict.fromkeys(([cause] if cause else []) + said[-1:]))


def wait_ready(ssh: SshClient, unit: str, endpoint: Endpoint, *, purpose: str = "start",
               timeout: float = HEALTH_TIMEOUT_S) -> None:
    """Until ``endpoint`` answers /health 200. ServerError after ``timeout`` seconds, or as soon as ``unit``
    has failed, stopped or fallen into auto-restart (a flag its build refuses, a port it cannot bind, a model
    it cannot load), with what the server said last (:func:`journal_tail`)."""
    deadline = time.monotonic() + timeout
    timeouts = Timeouts(connect=HTTP_TIMEOUT, read=HTTP_TIMEOUT, write=HTTP_TIMEOUT, pool=HTTP_TIMEOUT)
    with ServerClient(endpoint, timeouts=timeouts, retry=NO_RETRY) as client:
        while True:
            health = client.health()
            if health.ok:
                return
            state = unit_state(ssh, unit)
            if state is None or state.active_state in ("failed", "inactive") or state.sub_state == "auto-restart":
                said = f"{state.active_state} ({state.sub_state})" if state else "unknown to systemd"
                why = journal_tail(ssh, unit)
                raise ServerError(str(endpoint), purpose, f"{unit} is {said}" + (f": {why}" if why else ""))
            if time.monotonic() > deadline:
                raise ServerError(str(endpoint), purpose, f"not healthy after {timeout:g} s ({health.status}; "
                                  f"systemd: {state.active_state} ({state.sub_state}))")
            time.sleep(host_units.POLL_S)


def restart_instance(ssh: SshClient, server: Server, *, timeout: float = HEALTH_TIMEOUT_S) -> float:
    """Restart ``server``'s unit and wait until it is ready; the seconds that took."""
    began = time.monotonic()
    systemctl(ssh, "restart", [server.unit])
    wait_ready(ssh, server.unit, server_endpoint(ssh, server), purpose="restart", timeout=timeout)
    return time.monotonic() - began


@contextmanager
def running(host: Host, names: Sequence[str], *, start: bool = True,
            on_step: Callable[[str], None] | None = None) -> Iterator[list[str]]:
    """Every instance ``names`` of ``host`` ready: those that are down started (unless ``start`` is false)
    and stopped again on exit, however the block ends. Yields the names started here."""
    say = on_step or (lambda message: None)
    servers = [host.server(name) for name in names]
    with session(host) as ssh:
        active = active_units(ssh, [s.unit for s in servers])
        started = [s for s in servers if s.unit not in active] if start else []
        try:
            if started:
                say(f"{host.name}: starting {', '.join(s.name for s in started)}")
                systemctl(ssh, "start", [s.unit for s in started])
            for server in servers:
                wait_ready(ssh, server.unit, server_endpoint(ssh, server))
            yield [s.name for s in started]
        finally:
            if started:
                systemctl(ssh, "stop", [s.unit for s in started])


@contextmanager
def stopped(ssh: SshClient, server: Server) -> Iterator[None]:
    """``server``'s unit stopped (its card and port free for probes); on exit, when it was running
    before, started again and waited for until it is ready (what follows finds it as it was)."""
    was_running = bool(active_units(ssh, [server.unit]))
    systemctl(ssh, "stop", [server.unit])
    try:
        yield
    finally:
        if was_running:
            systemctl(ssh, "start", [server.unit])
            wait_ready(ssh, server.unit, server_endpoint(ssh, server))


@dataclass(frozen=True)
class Probe:
    """A running probe server: its transient unit, endpoint and command-line arguments."""

    unit: str
    endpoint: Endpoint
    argv: list[str]


def deployed_argv(ssh: SshClient, server: Server) -> list[str]:
    """The arguments ``server``'s unit starts llama-server with: its arguments file on the host, split as
    the role's launcher splits it."""
    text = ssh.run(f"cat {shlex.quote(server.args_file)}", timeout=SSH_TIMEOUT, check=True).stdout
    return args_lines_to_argv(text.splitlines())


def probe_server_argv(server: Server, unit: str, argv: Sequence[str], binary: str | None = None) -> list[str]:
    """The ``systemd-run`` command line of a probe of ``server``: its llama-server (or ``binary``, another
    build's) with ``argv`` as the transient unit ``unit``, with the ``llama-server@`` unit's account, sandbox and
    GPU pin (the probe sees the card the instance sees), writable nothing but a private /tmp (the instance's
    state directory is its own); no llama.cpp variable from outside reaches it (the shell execs the server: its
    pid is the unit's main process)."""
    properties = [*server.account.unit_properties(), f"EnvironmentFile={server.env_file}", "UMask=0077"]
    return ["systemd-run", "--unit", unit, "--collect", "--quiet", *run_options(properties),
            *clean_exec([binary or server.binary, *argv])]


def probe_unit(server: Server, purpose: str) -> str:
    """The transient unit of a probe of ``server`` for ``purpose`` ("load", "ctx 4096")."""
    return f"rigctl-{purpose.split()[0]}probe-{server.name}"


@contextmanager
def probe_server(ssh: SshClient, server: Server, settings: Mapping[str, Any], port: int,
                 purpose: str, binary: str | None = None) -> Iterator[Probe]:
    """A probe of ``server`` with ``settings`` over its profile (``{"ctx_size": 4096}``) on ``port``, as the
    transient unit ``rigctl-<purpose>probe-<instance>`` as the unit's user, with its sandbox and GPU pin, once
    it is ready; stopped on exit. ``binary``: another build's llama-server (an upgrade's candidate, served
    beside the instance on the same artifact and profile). Refused when the host's arguments file is not what
    the inventory plans (the probe would measure flags the instance does not run): deploy first."""
    deployed = deployed_argv(ssh, server)
    if deployed != server.argv:
        extra = sorted(set(deployed) - set(server.argv)) or sorted(set(server.argv) - set(deployed))
        raise ConfigError(f"{server.host}/{server.name}: {server.args_file} on the host differs from the inventory "
                          f"({' '.join(extra[:4]) or 'order'}); deploy before probing it")
    argv = server.argv_with(port=port, **settings)
    probe = probe_unit(server, purpose)
    endpoint = server_endpoint(ssh, server, port=port, label=f"{server.host}/{probe}")
    ssh.run(shlex.join(probe_server_argv(server, probe, argv, binary)), timeout=SSH_TIMEOUT * 2, check=True)
    try:
        wait_ready(ssh, probe, endpoint, purpose=purpose)
        yield Probe(probe, endpoint, argv)
    finally:
        ssh.run(f"systemctl stop {shlex.quote(probe)}", timeout=SYSTEMCTL_TIMEOUT_S, check=False)
