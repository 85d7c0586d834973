"""The llama-server instances of the fleet: state, restart and logs (`rigctl servers`).

Each instance is the systemd unit ``llama-server@<name>.service`` that roles/llama_server installs from
the inventory's ``llama_server_instances``. This module asks systemd over SSH (``systemctl show``,
``journalctl``) and the server itself over HTTP (``/health``, ``/props``, through
:mod:`rigctl.llama_http`); the parsers of what systemd prints are pure functions.

Fleet calls return one record per instance and keep going when a host cannot be reached: that host's
instances come back with ``state="unreachable"`` and the reason in ``error``.
"""

from __future__ import annotations

import logging
import shlex
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from rigctl.errors import ConfigError, RigctlError, ServerError
from rigctl.inventory import Host, Inventory, Server
from rigctl.inventory.profiles import unit_name
from rigctl.llama_http import NO_RETRY, ServerClient, Timeouts
from rigctl.ssh import session

log = logging.getLogger(__name__)

#: Seconds for one systemctl/journalctl call over SSH.
SSH_TIMEOUT = 30.0
#: Seconds for one /health or /props request when listing.
HTTP_TIMEOUT = 5.0
#: The properties `systemctl show` is asked for.
UNIT_PROPERTIES = ("Id", "ActiveState", "SubState", "MainPID", "NRestarts")


def operator_start(units: Sequence[str], action: str = "start") -> str:
    """The shell command for an operator's ``systemctl start|restart`` of ``units``. systemd's
    StartLimitBurst counts every start, so benches and restarts in quick succession would trip it like
    a crash loop: the units' counters are cleared first, leaving the limit to crash loops."""
    names = shlex.join(units)
    return f"systemctl reset-failed {names}; systemctl {action} {names}"


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


def unit_states(host: Host, servers: Iterable[str]) -> dict[str, UnitState]:
    """systemd's view of ``servers`` on ``host``, by instance name (RemoteCommandError, ConnectError)."""
    names = list(servers)
    if not names:
        return {}
    with session(host) as ssh:
        out = ssh.run(show_command(names), timeout=SSH_TIMEOUT, check=True).stdout
    by_unit = parse_unit_show(out)
    return {name: by_unit[unit_name(name)] for name in names if unit_name(name) in by_unit}


def probe(server: Server, timeout: float = HTTP_TIMEOUT) -> tuple[bool, str, str | None, str | None]:
    """(healthy, health text, model_path, build_info) from the instance's /health and /props."""
    timeouts = Timeouts(connect=timeout, read=timeout, write=timeout, pool=timeout)
    with ServerClient(server.endpoint, timeouts=timeouts, retry=NO_RETRY) as client:
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
        error = None
    except RigctlError as exc:
        states, error = {}, str(exc)
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
        healthy, health, model, build = probe(inst)
        rows.append(ServerStatus(host.name, inst.name, inst.port, inst.artifact, inst.profile.name, inst.enabled,
                                 state, unit.main_pid if unit else 0,
                                 healthy, health, model, build))
    return rows


def list_servers(inventory: Inventory, limit: str | None = None) -> list[ServerStatus]:
    """Every instance of the selected hosts, host by host, in inventory order."""
    rows: list[ServerStatus] = []
    for host in inventory.select(limit):
        rows.extend(host_status(host))
    return rows


def restart(inventory: Inventory, host_name: str, server: str, timeout: float = 120.0) -> ServerStatus:
    """Restart instance ``server`` on ``host_name`` and wait until it answers /health 200.

    ServerError when it is not healthy within ``timeout`` seconds (the unit's state is in the message).
    """
    host = inventory.host(host_name)
    instance = host.server(server)
    with session(host) as ssh:
        ssh.run(operator_start([instance.unit], "restart"), timeout=SSH_TIMEOUT, check=True)
    deadline = time.monotonic() + timeout
    while True:
        healthy, health, model, build = probe(instance)
        if healthy:
            break
        if time.monotonic() > deadline:
            state = unit_states(host, [server]).get(server)
            raise ServerError(f"{host.name}/{server}", "restart",
                              f"not healthy within {timeout:.0f} s ({health}; systemd: "
                              f"{state.active_state if state else 'unknown'})")
        time.sleep(0.5)
    state = unit_states(host, [server])[server]
    return ServerStatus(host.name, server, instance.port, instance.artifact, instance.profile.name, instance.enabled,
                        state.active_state, state.main_pid, healthy, health, model, build)


def logs(inventory: Inventory, host_name: str, server: str, lines: int = 50) -> str:
    """The last ``lines`` journal lines of instance ``server`` on ``host_name``."""
    if lines < 1:
        raise ConfigError(f"-n {lines}: give at least 1 line")
    host = inventory.host(host_name)
    unit = host.server(server).unit
    command = f"journalctl --no-pager -o short-iso -n {int(lines)} -u {shlex.quote(unit)}"
    with session(host) as ssh:
        return ssh.run(command, timeout=SSH_TIMEOUT, check=True).stdout
