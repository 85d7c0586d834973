"""The ``rigctl`` command: argument parsing and rendering only; the work is in the library."""

from __future__ import annotations

import logging
import os
import sys
from typing import Annotated, NoReturn

import typer
from rich.console import Console
from rich.logging import RichHandler
from rich.table import Table

# typer ships its own copy of click: its usage errors derive from these, not from the click package's.
from typer._click.exceptions import ClickException, UsageError

from rigctl.deploy import DeployResult, TaskEvent
from rigctl.errors import RigctlError
from rigctl.inventory import Inventory
from rigctl.trust import RedactingFilter, mask_registered

# Piped output (CI logs, `| less`) gets wide tables instead of rich's 80-column default.
console = Console(width=None if sys.stdout.isatty() else 160)
err_console = Console(stderr=True, width=None if sys.stderr.isatty() else 160)

app = typer.Typer(no_args_is_help=True, add_completion=False, pretty_exceptions_enable=False,
                  help="Provision, serve, bench and evaluate a llama.cpp fleet from one inventory.")
inventory_app = typer.Typer(no_args_is_help=True, help="The inventory: validate it.")
lab_app = typer.Typer(no_args_is_help=True, help="Local lab rigs (systemd-nspawn containers) for tests and demos.")
app.add_typer(inventory_app, name="inventory")
build_app = typer.Typer(no_args_is_help=True, help="llama.cpp builds on the hosts: status and rollback.")
app.add_typer(lab_app, name="lab")
app.add_typer(build_app, name="build")
models_app = typer.Typer(no_args_is_help=True, help="Model artifacts on the hosts: list, verify and pin hashes.")
app.add_typer(models_app, name="models")


class _State:
    inventory_source: str | None = None
    debug: bool = False


state = _State()


def _inventory() -> Inventory:
    return Inventory.load(state.inventory_source)


class _PlainFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        return f"{record.levelname.lower()}: {record.getMessage()}"


@app.callback()
def main_options(
    inventory: Annotated[str | None, typer.Option("-i", "--inventory", envvar="RIGCTL_INVENTORY",
                                                  help="Inventory directory or file (default: ansible.cfg's).")] = None,
    verbose: Annotated[int, typer.Option("-v", "--verbose", count=True, help="More log output (-vv: debug).")] = 0,
    debug: Annotated[bool, typer.Option("--debug", help="Show tracebacks on errors.")] = False,
) -> None:
    state.inventory_source = inventory
    state.debug = debug
    level = logging.WARNING - 10 * min(verbose, 2)
    if sys.stderr.isatty():
        handler: logging.Handler = RichHandler(console=err_console, show_path=False, show_time=False)
    else:  # logs, pipes and tests: one line per record, never wrapped
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(_PlainFormatter())
    handler.addFilter(RedactingFilter())  # an API key or token never reaches a log line
    logging.basicConfig(level=level, format="%(message)s", handlers=[handler])
    if level > logging.DEBUG:
        logging.getLogger("paramiko").setLevel(logging.WARNING)


# ----------------------------------------------------------------------------------------------- inventory


@inventory_app.command("check")
def inventory_check() -> None:
    """Validate the inventory: types, required keys, unique ports, models and profiles defined, pins."""
    from rigctl.deploy import project_root
    from rigctl.inventory.check import check

    inv = _inventory()
    try:
        roles = [project_root(inv) / "roles"]
    except RigctlError:
        roles = []
    problems = check(inv, roles)
    for problem in problems:
        (console if problem.severity == "warning" else err_console).print(str(problem), markup=False,
                                                                            highlight=False, soft_wrap=True)
    errors = [p for p in problems if p.severity == "error"]
    warnings = len(problems) - len(errors)
    summary = f"{inv.source}: {len(inv.hosts)} hosts, {len(errors)} errors, {warnings} warnings"
    if errors:
        err_console.print(summary, markup=False, highlight=False)
        raise typer.Exit(2)
    console.print(summary, markup=False, highlight=False)


hosts_app = typer.Typer(invoke_without_command=True,
                        help="The fleet: list it (no subcommand); add, probe or remove a host.")
app.add_typer(hosts_app, name="hosts")


@hosts_app.callback()
def hosts(ctx: typer.Context) -> None:
    """The fleet: each host's address, GPU, llama.cpp pin and servers."""
    if ctx.invoked_subcommand is not None:
        return
    inv = _inventory()
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
            gpu.name if gpu else "-",
            gpu.compute_capability if gpu else "-",
            f"{gpu.vram_mib / 1024:g} GiB" if gpu else "-",
            str(host.llama_cpp) if "llama_cpp_source" in host.vars else "-",
            servers or "-",
        )
    console.print(table)


# ----------------------------------------------------------------------------------------------- lab


def _lab():
    from rigctl.lab import Lab

    return Lab.from_inventory(_inventory())


def _print_lab_status(rigs) -> None:
    table = Table(title="lab rigs")
    for column in ("rig", "address", "running", "sshd", "systemd"):
        table.add_column(column)
    for rig in rigs:
        table.add_row(rig.name, rig.address, _yes(rig.running), _yes(rig.sshd), rig.systemd or "-")
    console.print(table)


def _yes(flag: bool) -> str:
    return "[green]yes[/green]" if flag else "[red]no[/red]"


@lab_app.command("up")
def lab_up() -> None:
    """Bring the lab rigs up (idempotent): boot each container, wait for sshd, write known_hosts."""
    lab = _lab()
    with console.status("bringing the lab rigs up"):
        rigs = lab.up()
    _print_lab_status(rigs)


@lab_app.command("down")
def lab_down() -> None:
    """Stop the lab rigs and remove everything they used (processes, namespaces, links, files)."""
    _lab().down()
    console.print("lab: down")


@lab_app.command("status")
def lab_status() -> None:
    """Each rig: running, sshd answering, systemd state."""
    _print_lab_status(_lab().status())


@lab_app.command("image")
def lab_image() -> None:
    """Build the lab's Debian base image into the cache now (done by `up` when missing)."""
    image = _lab().ensure_base_image()
    origin = "built" if image.built else "cached"
    console.print(f"lab image: {image.path} ({image.size_bytes / 1e6:.0f} MB, {origin})", highlight=False)


# Options after the host (`--query-gpu=...`) belong to the remote command, not to rigctl.
@lab_app.command("ssh", context_settings={"allow_extra_args": True, "ignore_unknown_options": True})
def lab_ssh(
    host: Annotated[str, typer.Argument(help="Rig name from the lab inventory.")],
    command: Annotated[list[str] | None, typer.Argument(help="Command to run instead of a shell.")] = None,
) -> NoReturn:
    """Open a shell (or run a command) on a rig over SSH with strict host-key checking."""
    argv = _lab().ssh_argv(host, " ".join(command) if command else None)
    sys.stdout.flush()
    os.execvp(argv[0], argv)


# ----------------------------------------------------------------------------------------------- provision


_MARKS = {"ok": "[green]ok[/green]", "changed": "[yellow]changed[/yellow]", "failed": "[red]failed[/red]",
          "unreachable": "[red]unreachable[/red]", "skipped": "[dim]skipped[/dim]"}


def _print_event(event: TaskEvent) -> None:
    line = f"  {_MARKS[event.status]} {event.host}"
    if event.message:
        line += f": {event.message}"
    console.print(line, highlight=False)


def _print_task(task: str) -> None:
    console.print(f"[bold]TASK[/bold] {task}", highlight=False)


def _print_deploy_summary(result: DeployResult, title: str) -> None:
    table = Table(title=f"{title}: {result.duration:.1f} s")
    for column in ("host", "ok", "changed", "failed", "unreachable", "skipped", "failed task"):
        table.add_column(column)
    for outcome in result.hosts.values():
        table.add_row(outcome.host, str(outcome.ok), str(outcome.changed), str(outcome.failed),
                      str(outcome.unreachable), str(outcome.skipped),
                      f"{outcome.failed_task}: {outcome.failure}" if outcome.failed_task else "")
    console.print(table)


@app.command("provision")
def provision(
    limit: Annotated[str | None, typer.Option("--limit", "-l", help="Hosts or groups, comma-separated.")] = None,
    tags: Annotated[list[str] | None, typer.Option("--tags", "-t", help="Only tasks with these tags.")] = None,
    check: Annotated[bool, typer.Option("--check", help="Report what would change; change nothing.")] = False,
    playbook: Annotated[str, typer.Option(help="Playbook under playbooks/.")] = "site.yml",
) -> None:
    """Run playbooks/site.yml through ansible-runner; per-task progress, then a per-host summary."""
    from rigctl.deploy import run_playbook

    result = run_playbook(_inventory(), playbook, limit=limit, tags=tags or (), check=check,
                          on_event=_print_event, on_task=_print_task)
    _print_deploy_summary(result, f"{playbook}{' (check mode)' if check else ''}")
    result.raise_for_failures()


# ----------------------------------------------------------------------------------------------- build


@build_app.command("status")
def build_status(
    limit: Annotated[str | None, typer.Option("--limit", "-l", help="Hosts or groups, comma-separated.")] = None,
) -> None:
    """The llama.cpp build each host runs (current) and keeps for rollback (previous)."""
    from rigctl.build import read_builds

    table = Table(title="llama.cpp builds")
    for column in ("host", "current", "key", "CPU", "CUDA", "built on", "previous"):
        table.add_column(column)
    for host in _inventory().select(limit):
        builds = read_builds(host)
        cur = builds.current
        table.add_row(host.name, str(cur) if cur else "-", cur.key if cur else "-", cur.cpu if cur else "-",
                      (cur.cuda_architectures or "on") if cur and cur.cuda else "off",
                      cur.built_on if cur else "-", str(builds.previous) if builds.previous else "-")
    console.print(table)


@build_app.command("rollback")
def build_rollback(host: Annotated[str, typer.Argument(help="Host from the inventory.")]) -> None:
    """Make HOST's previous llama.cpp build current again. The next `rigctl provision` restores the
    inventory's pin."""
    from rigctl.build import rollback

    result = rollback(_inventory(), host, on_event=_print_event, on_task=_print_task)
    console.print(f"{result.host}: current is now {result.after} (was {result.before})", highlight=False)


# ----------------------------------------------------------------------------------------------- models

LimitOption = Annotated[str | None, typer.Option("--limit", "-l", help="Hosts or groups, comma-separated.")]


@models_app.command("list")
def models_list(limit: LimitOption = None) -> None:
    """Per host: artifact, size, quantisation mix, sha256 and pin status (from the manifests)."""
    from rigctl.models import list_artifacts, rows

    table = Table(title="model artifacts")
    for column in ("host", "artifact", "size", "quant mix", "sha256", "pin"):
        table.add_column(column)
    results = list_artifacts(_inventory(), limit)
    for row in rows(results):
        table.add_row(*row)
    console.print(table)
    failed = {host: outcome for host, outcome in results.items() if isinstance(outcome, RigctlError)}
    for host, outcome in failed.items():
        text = str(outcome)
        err_console.print(f"error: {text if text.startswith(host) else f'{host}: {text}'}", markup=False,
                          highlight=False, soft_wrap=True)
    if failed:  # a listing that could not see a host is not a clean listing
        raise typer.Exit(1)


@models_app.command("verify")
def models_verify(limit: LimitOption = None) -> None:
    """Re-hash every host's model files against their pins; rebuild nothing."""
    from rigctl.models import problems, verify

    results = verify(_inventory(), limit)
    found = problems(results)
    for line in found:
        err_console.print(line, markup=False, highlight=False, soft_wrap=True)
    checked = sum(len(r) for r in results.values() if isinstance(r, list))
    summary = f"{checked} artifacts on {len(results)} hosts, {len(found)} problems"
    (err_console if found else console).print(summary, highlight=False)
    if found:
        raise typer.Exit(1)


@models_app.command("pin")
def models_pin(limit: LimitOption = None) -> None:
    """Write the hashes observed on each host into its host_vars (models_pins), for review with git diff."""
    from rigctl.models import pin

    for host, pins in pin(_inventory(), limit).items():
        console.print(f"{host}: pinned {len(pins)} artifacts", highlight=False)


# Each of these modules registers its command group on `app` when imported.
from rigctl import cli_bench, cli_compare, cli_eval, cli_exporter, cli_hosts, cli_servers  # noqa: E402,F401


def usage_message(exc: ClickException) -> str:
    """One line for a usage error: what is wrong, naming the option, and where to find the usage."""
    message = " ".join(exc.format_message().split())
    ctx = getattr(exc, "ctx", None)
    if isinstance(exc, UsageError) and ctx is not None:
        message += f" (see '{ctx.command_path} --help')"
    return message


def main() -> None:
    try:
        # Without standalone mode click hands back typer.Exit's code instead of exiting.
        rc = app(standalone_mode=False)
    except RigctlError as exc:
        if state.debug:
            raise
        err_console.print(f"error: {mask_registered(str(exc))}", markup=False, highlight=False, soft_wrap=True)
        sys.exit(exc.exit_code)
    except typer.Abort:
        err_console.print("aborted", markup=False)
        sys.exit(130)
    except ClickException as exc:  # a usage error names the option or argument: exit 2, like click's own
        err_console.print(f"error: {usage_message(exc)}", markup=False, highlight=False, soft_wrap=True)
        sys.exit(exc.exit_code)
    except Exception as exc:  # anything unexpected, still one line
        if state.debug:
            raise
        err_console.print(f"error: {type(exc).__name__}: {mask_registered(str(exc))} "
                          "(run with --debug for the traceback)", markup=False, highlight=False, soft_wrap=True)
        sys.exit(1)
    sys.exit(rc if isinstance(rc, int) else 0)


if __name__ == "__main__":
    # `python -m rigctl.cli` runs this file as __main__, a second copy of the module: the command modules
    # register on rigctl.cli's app, so run that one.
    from rigctl.cli import main as _main

    _main()
