"""``rigctl hosts``: the fleet (list it); ``hosts add|remove|probe``: a GPU host joins (or leaves) the
fleet's inventory."""

from __future__ import annotations

import shlex
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer
from rich.table import Table

from rigctl.cli.common import console, err_console, load_inventory, load_inventory_to_write, state
from rigctl.cli.render import outside_text, print_deploy_summary, print_event, print_task
from rigctl.errors import ConfigError

if TYPE_CHECKING:
    from rigctl.fleet.host_facts import HostFacts

app = typer.Typer(invoke_without_command=True, help="The fleet: list it (no subcommand); add, probe or remove a host.")


@app.callback()
def hosts(ctx: typer.Context) -> None:
    """The fleet: each host's address, GPU, llama.cpp pin and servers."""
    if ctx.invoked_subcommand is not None:
        return
    inv = load_inventory()
    table = Table(title=f"fleet ({inv.source})")
    for column in ("host", "address", "GPU", "CC", "VRAM", "llama.cpp", "servers"):
        table.add_column(column)
    for host in inv.hosts.values():
        gpu = host.gpu
        servers = "\n".join(
            f"{s.name}: {s.artifact} :{s.port}" + ("" if s.enabled else " (disabled)") for s in host.servers
        )
        table.add_row(
            host.name,
            f"{host.address}:{host.port}" if host.port != 22 else host.address,
            outside_text(gpu.name) if gpu else "-",
            gpu.compute_capability if gpu else "-",
            f"{gpu.vram_mib / 1024:g} GiB" if gpu else "-",
            str(host.llama_cpp) if "llama_cpp_source" in host.vars else "-",
            servers or "-",
        )
    console.print(table)


def _print_facts(name: str, facts: HostFacts) -> None:
    table = Table(title=outside_text(f"{name}: {facts.os}, {facts.cpu_model}, {facts.cpus} CPUs, "
                                     f"{facts.memory_mib / 1024:.1f} GiB, {facts.disk_free_mib / 1024:.1f} GiB free"))
    for column in ("GPU", "name", "VRAM", "CC", "arch", "uuid"):
        table.add_column(column)
    for gpu in facts.gpus:
        # A unified-memory GPU reports no memory of its own: it uses the host's (shown in the title).
        vram = "unified" if gpu.vram_mib is None else f"{gpu.vram_mib / 1024:g} GiB"
        table.add_row(str(gpu.index), outside_text(gpu.name), vram,
                      gpu.compute_capability, gpu.cuda_arch, outside_text(gpu.uuid))
    console.print(table)
    console.print(f"driver {facts.driver_version}, CUDA {facts.cuda_version}; "
                  f"CPU flags: {' '.join(facts.cpu_flags) or 'none of note'}", highlight=False)


def _provision_command(name: str) -> str:
    inventory = ["-i", str(state.inventory_source)] if state.inventory_source else []
    return shlex.join(["rigctl", *inventory, "provision", "--limit", name])


@app.command("add")
def hosts_add(
    name: Annotated[str, typer.Argument(help="The host's name in the inventory.")],
    address: Annotated[str, typer.Argument(help="Where to reach it (address or DNS name).")],
    user: Annotated[str, typer.Option("--user", help="Who logs in for the bootstrap (root or a sudoer).")] = "root",
    ask_pass: Annotated[bool, typer.Option("--ask-pass", help="Log in with a password (prompted, never echoed).")]
    = False,
    key: Annotated[Path | None, typer.Option("--key", help="Log in with this existing private key.")] = None,
    port: Annotated[int, typer.Option("--port", min=1, max=65535, help="SSH port.")] = 22,
    fingerprint: Annotated[str | None, typer.Option(
        "--fingerprint", help="The host key's expected SHA256 fingerprint (for scripts; else asked).")] = None,
    group: Annotated[str, typer.Option("--group", help="The inventory group to add it to.")] = "gpu_hosts",
    provision: Annotated[bool, typer.Option("--provision", help="Then run `provision --limit NAME`.")] = False,
) -> None:
    """First contact, bootstrap, facts into the inventory: a new GPU host joins the fleet.

    The host key is shown and must be confirmed (or match --fingerprint) before anything is sent;
    playbooks/bootstrap.yml makes the fleet user with the controller's key and sudo; one probe writes
    host_vars/NAME.yml and adds NAME to hosts.yml; inventory check must pass. Run again: no change.
    """
    from rigctl.fleet.deploy import run_playbook
    from rigctl.fleet.enroll import AddOptions, add_host, check_fingerprint_option, check_host_name
    from rigctl.inventory import Inventory

    check_host_name(name)
    if ask_pass == (key is not None):
        raise ConfigError("give exactly one of --ask-pass or --key FILE")
    if fingerprint is not None:
        check_fingerprint_option(fingerprint)
    inv = load_inventory_to_write("hosts add")

    def ask_password() -> str:
        return typer.prompt(f"SSH password for {user}@{address}", hide_input=True, err=True)

    def confirm(key_type: str, presented: str) -> bool:
        err_console.print(f"{name} ({address}:{port}) presents {key_type} {presented}", highlight=False)
        return typer.confirm("Is this the host's key? (compare with `ssh-keygen -lf` on its console)",
                             default=False, err=True)

    options = AddOptions(name=name, address=address, port=port, login_user=user, ask_pass=ask_pass,
                         login_key=key, fingerprint=fingerprint, group=group)
    result = add_host(inv, options, confirm=confirm, ask_password=ask_password, on_event=print_event,
                      on_task=print_task)
    console.print(f"{name}: host key {result.contact.key_type} {result.contact.fingerprint}"
                  + (" written to known_hosts" if result.contact.written else " (known already)"), highlight=False)
    print_deploy_summary(result.bootstrap, "bootstrap.yml")
    _print_facts(name, result.facts)
    if result.changed_files:
        for path in result.changed_files:
            console.print(f"wrote {path}", highlight=False)
    else:
        console.print(f"{name}: the inventory has it exactly so already; nothing changed", highlight=False)
    console.print(f"{inv.source}: inventory check passed", highlight=False)
    if not provision:
        console.print(f"next: {_provision_command(name)}", highlight=False)
        return
    reloaded = Inventory.load(inv.source)
    deployed = run_playbook(reloaded, "site.yml", limit=name, on_event=print_event, on_task=print_task)
    print_deploy_summary(deployed, "site.yml")
    deployed.raise_for_failures()


@app.command("remove")
def hosts_remove(name: Annotated[str, typer.Argument(help="Host in the inventory.")]) -> None:
    """Take NAME out of hosts.yml, its host_vars file and known_hosts; nothing on the host changes."""
    from rigctl.fleet.enroll import remove_host

    result = remove_host(load_inventory_to_write("hosts remove"), name)
    parts = [what for what, done in (("hosts.yml", result.hosts_file), ("host_vars", result.host_vars),
                                     ("known_hosts", result.known_hosts)) if done]
    console.print(f"{name}: removed from {', '.join(parts) or 'nothing (it held no entries)'}", highlight=False)


@app.command("probe")
def hosts_probe(
    name: Annotated[str, typer.Argument(help="Host in the inventory.")],
    write: Annotated[bool, typer.Option("--write", help="Update host_vars/NAME.yml with what was found.")] = False,
) -> None:
    """Read NAME's GPUs, CPU, memory, disk and OS again; show drift against its host_vars.

    Exits 1 when there is drift, unless --write updates host_vars/NAME.yml.
    """
    from rigctl.fleet.enroll import probe_host

    inventory = load_inventory_to_write("hosts probe --write") if write else load_inventory()
    result = probe_host(inventory, name, write=write)
    _print_facts(name, result.facts)
    if not result.drift:
        console.print(f"{name}: host_vars agree with the host", highlight=False)
    else:
        table = Table(title=f"{name}: drift (host_vars → host)")
        for column in ("key", "host_vars", "host"):
            table.add_column(column)
        for key, recorded, observed in result.drift:
            table.add_row(key, "-" if recorded is None else outside_text(recorded), outside_text(observed))
        console.print(table)
    if write:
        console.print(f"{name}: host_vars " + ("updated" if result.written else "unchanged"), highlight=False)
    elif result.drift:
        raise typer.Exit(1)


@app.command("drain")
def hosts_drain(
    name: Annotated[str, typer.Argument(help="Host in the inventory.")],
    reason: Annotated[str, typer.Option("--reason", help="Why, in plain words (shown wherever the host is skipped).")],
) -> None:
    """Take NAME out of campaigns, fan-out evals, benches and canaries (rigctl_drain in its host_vars); its
    servers keep serving."""
    from rigctl.fleet.drain import check_reason, drain

    found = drain(load_inventory_to_write("hosts drain"), name, check_reason(reason))
    console.print(f"{name}: drained since {found.since}: {found.reason}", markup=False, highlight=False)


@app.command("undrain")
def hosts_undrain(name: Annotated[str, typer.Argument(help="Host in the inventory.")]) -> None:
    """Put NAME back in service."""
    from rigctl.fleet.drain import undrain

    before = undrain(load_inventory_to_write("hosts undrain"), name)
    console.print(f"{name}: " + (f"back in service (drained since {before.since} by {before.by}: {before.reason})"
                                 if before else "was not drained; nothing changed"), markup=False, highlight=False)


@app.command("health")
def hosts_health(
    limit: Annotated[str | None, typer.Option("--limit", help="Hosts or groups (Ansible's pattern).")] = None,
    apply: Annotated[bool, typer.Option("--apply", help="Drain the unhealthy hosts whose rigctl_drain_policy "
                                                      "says so (stop: their servers too).")] = False,
) -> None:
    """Each GPU's health now (driver and kernel log) and each host's drain. Exits 1 when a GPU is unhealthy."""
    from rigctl.fleet.drain import apply_policy, host_drain
    from rigctl.fleet.health import host_problems, verdicts
    from rigctl.fleet.state import FleetState

    inv = load_inventory()
    fleet = FleetState(inv, limit=limit)
    try:
        hosts = fleet.read()
    finally:
        fleet.close()
    table = Table(title="GPU health")
    for column in ("host", "GPU", "Xids since boot", "problems", "drained"):
        table.add_column(column)
    problems: dict[str, list[str]] = {}
    for name, facts in sorted(hosts.items()):
        drained = host_drain(inv.hosts[name])
        shown = f"{drained.by}: {drained.reason}" if drained else "-"
        if not facts.up:
            table.add_row(name, "-", "-", outside_text(f"down: {facts.error}"), outside_text(shown))
            continue
        found = verdicts(facts.health, facts.xids)
        problems[name] = host_problems(found)
        for verdict in found or []:
            xids = ", ".join(f"{code}: {n}" for code, n in verdict.xids.items()) or (
                "-" if facts.xids is not None else f"unread ({facts.xid_error})")
            table.add_row(name, "?" if verdict.index is None else str(verdict.index), outside_text(xids),
                          outside_text("; ".join(verdict.problems) or "healthy"), outside_text(shown))
        if not found:
            table.add_row(name, "-", "-", outside_text(facts.health_error or "no GPU answered"), outside_text(shown))
    console.print(table)
    if apply:
        for name, done in apply_policy(inv, problems).items():
            console.print(f"{name}: drained by policy: {done.reason}", markup=False, highlight=False)
    if any(problems.values()):
        raise typer.Exit(1)
