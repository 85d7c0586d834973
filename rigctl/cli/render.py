"""Rendering shared by several command groups: text from outside shown as text, playbook progress and
summaries, pull outcomes."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from rich.table import Table
from rich.text import Text

from rigctl.cli.common import console, err_console
from rigctl.errors import RigctlError
from rigctl.trust import printable

if TYPE_CHECKING:
    from rigctl.fleet.deploy import DeployResult, TaskEvent


def outside_text(value: object, *, lines: bool = False) -> Text:
    """Text from outside rigctl (a host's answer, a server's reply, a record, an error quoting them) as the
    terminal must show it: a rich ``Text``, so no markup or emoji code in it is interpreted, with every
    unprintable character (a terminal escape, a carriage return, a line break unless ``lines``) escaped
    (:func:`rigctl.trust.printable`), so none reaches the terminal as a control.

    Print it, put it in a table cell or title, or join it with ``Text.assemble``: formatted into a string
    it is plain text again, which markup would read."""
    return Text(printable(str(value), lines=lines))


_MARKS = {"ok": "[green]ok[/green]", "changed": "[yellow]changed[/yellow]", "failed": "[red]failed[/red]",
          "unreachable": "[red]unreachable[/red]", "skipped": "[dim]skipped[/dim]"}


def print_event(event: TaskEvent) -> None:
    said = f"{event.host}: {event.message}" if event.message else event.host
    console.print(Text.assemble("  ", Text.from_markup(_MARKS[event.status]), " ", outside_text(said)))


def print_task(task: str) -> None:
    console.print(f"[bold]TASK[/bold] {task}", highlight=False)


def print_deploy_summary(result: DeployResult, title: str) -> None:
    table = Table(title=f"{title}: {result.duration:.1f} s")
    for column in ("host", "ok", "changed", "failed", "unreachable", "skipped", "failed task"):
        table.add_column(column)
    for outcome in result.hosts.values():
        table.add_row(outcome.host, str(outcome.ok), str(outcome.changed), str(outcome.failed),
                      str(outcome.unreachable), str(outcome.skipped),
                      outside_text(f"{outcome.failed_task}: {outcome.failure}") if outcome.failed_task else "")
    console.print(table)


def print_progress(info: Any) -> None:
    """One line per change of a job's state (a :class:`rigctl.jobs.JobInfo`)."""
    progress = f"{info.done}/{info.total}" if info.total else "-"
    console.print(outside_text(f"{info.host}: {info.id} {info.state} [{progress}] {info.message}"))


def print_pull(results: dict[str, Any]) -> bool:
    """Per host what a pull copied, skipped and refused (or why it failed); False when anything failed."""
    ok = True
    for host, outcome in results.items():
        if isinstance(outcome, RigctlError):
            err_console.print(outside_text(f"{host}: pull failed: {outcome}"), soft_wrap=True)
            ok = False
            continue
        line = (f"{host}: copied {len(outcome.copied)} run(s) ({outcome.files} files, {outcome.bytes} bytes), "
                f"{len(outcome.skipped)} already here, {len(outcome.running)} still running"
                + (f", {len(outcome.refused)} refused" if outcome.refused else ""))
        console.print(line, markup=False, highlight=False)
        for run_id in outcome.copied:
            lost = " (lost: its job died without sealing it; partial)" if run_id in outcome.lost else ""
            console.print(outside_text(f"  + {host}/{run_id}{lost}"))
        for line in outcome.refused:
            err_console.print(outside_text(line), soft_wrap=True)
            ok = False
    return ok


def follow_started(inventory: Any, started: dict[str, Any], store: Any | None) -> tuple[bool, list[Any]]:
    """Each host's started job (a :class:`rigctl.jobs.JobInfo`) or why it did not start; with ``store``, every
    job followed to its end (its progress printed), its host pulled and the pull printed. Returns whether all
    of it went well, and the jobs followed that ended done (:class:`rigctl.jobs.Followed`)."""
    from rigctl import jobs

    ok = True
    for host, outcome in started.items():
        if isinstance(outcome, RigctlError):
            err_console.print(outside_text(f"error: {outcome}"), soft_wrap=True)
            ok = False
        else:
            console.print(f"{host}: started {outcome.id} (unit {outcome.unit})", markup=False, highlight=False)
    if store is None:
        return ok, []
    followed = jobs.follow_and_pull(
        inventory, {host: info.id for host, info in started.items() if not isinstance(info, RigctlError)}, store,
        on_progress=print_progress)
    done = [f for f in followed.values() if isinstance(f, jobs.Followed) and f.done]
    for host, outcome in followed.items():
        if isinstance(outcome, jobs.Followed) and not outcome.done:
            err_console.print(outside_text(f"error: {host}: job {outcome.job.id} ended {outcome.job.state}"
                                           + (f": {outcome.job.error}" if outcome.job.error else "")), soft_wrap=True)
    ok &= len(done) == len(followed)
    ok &= print_pull({host: f.pulled if isinstance(f, jobs.Followed) else f for host, f in followed.items()})
    return ok, done
