"""``rigctl lab up|down|status|image|ssh``: the local lab rigs."""

from __future__ import annotations

import os
import sys
import time
from typing import Annotated, NoReturn

import typer
from rich.table import Table
from rich.text import Text

from rigctl.cli.common import console, load_inventory

app = typer.Typer(no_args_is_help=True, help="Local lab rigs (systemd-nspawn containers) for tests and demos.")


def _lab():
    from rigctl.lab.rigs import Lab

    return Lab.from_inventory(load_inventory())


def _print_lab_status(rigs) -> None:
    table = Table(title="lab rigs")
    for column in ("rig", "address", "running", "sshd", "systemd"):
        table.add_column(column)
    for rig in rigs:
        table.add_row(rig.name, rig.address, _yes(rig.running), _yes(rig.sshd), rig.systemd or "-")
    console.print(table)


def _yes(flag: bool) -> str:
    return "[green]yes[/green]" if flag else "[red]no[/red]"


@app.command("up")
def lab_up() -> None:
    """Bring the lab rigs up (idempotent): boot each container, wait for sshd, write known_hosts."""
    lab = _lab()
    with console.status("bringing the lab rigs up"):
        rigs = lab.up()
    _print_lab_status(rigs)


@app.command("down")
def lab_down() -> None:
    """Stop the lab rigs and remove everything they used (processes, namespaces, links, files)."""
    _lab().down()
    console.print("lab: down")


@app.command("status")
def lab_status() -> None:
    """Each rig: running, sshd answering, systemd state."""
    _print_lab_status(_lab().status())


@app.command("prepare")
def lab_prepare() -> None:
    """Make the lab's slow one-time things into the cache now: the base image and the lab's llama.cpp build
    (compiled on a rig brought up for it and left as found). Seconds when the cache has them; `make test`
    and `make demo` run this first, so no test's time limit pays for a cold compile."""
    from rigctl.cli.render import print_event, print_task
    from rigctl.lab.prepare import prepare

    started = time.monotonic()
    with console.status("lab prepare: base image") as status:
        def on_task(task: str) -> None:
            # A terminal sees the task in the spinner; a log (CI) gets one line per task.
            if console.is_terminal:
                status.update(f"lab prepare: llama.cpp build: {task} ({time.monotonic() - started:.0f} s)")
            else:
                print_task(task)

        def on_step(step) -> None:
            console.print(f"lab prepare: {step.name} {'made' if step.made else 'cached'} in {step.seconds:.1f} s",
                          highlight=False)
            status.update("lab prepare: llama.cpp build")

        steps = prepare(load_inventory(), on_step=on_step, on_task=on_task,
                        on_event=None if console.is_terminal else print_event)
    table = Table(title=f"lab prepare: {time.monotonic() - started:.1f} s")
    for column in ("step", "", "seconds", "what"):
        table.add_column(column)
    for step in steps:
        table.add_row(step.name, "made" if step.made else "cached", f"{step.seconds:.1f}", Text(step.detail))
    console.print(table)


@app.command("image")
def lab_image() -> None:
    """Build the lab's Debian base image into the cache now (done by `up` when missing)."""
    image = _lab().ensure_base_image()
    origin = "built" if image.built else "cached"
    console.print(f"lab image: {image.path} ({image.size_bytes / 1e6:.0f} MB, {origin})", highlight=False)


# Options after the host (`--query-gpu=...`) belong to the remote command, not to rigctl.
@app.command("ssh", context_settings={"allow_extra_args": True, "ignore_unknown_options": True})
def lab_ssh(
    host: Annotated[str, typer.Argument(help="Rig name from the lab inventory.")],
    command: Annotated[list[str] | None, typer.Argument(help="Command to run instead of a shell.")] = None,
) -> NoReturn:
    """Open a shell (or run a command) on a rig over SSH with strict host-key checking."""
    argv = _lab().ssh_argv(host, " ".join(command) if command else None)
    sys.stdout.flush()
    os.execvp(argv[0], argv)
