"""``rigctl build status|rollback|upgrade|bisect|advisories``: the llama.cpp builds on the hosts."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer
from rich.table import Table
from rich.text import Text

from rigctl.cli.common import (
    LimitOption,
    ResultsOption,
    console,
    load_inventory,
    load_inventory_to_write,
    results_store,
)
from rigctl.cli.render import about_host, outside_text, print_event, print_task
from rigctl.errors import ConfigError, RigctlError

if TYPE_CHECKING:  # the fleet's modules load SSH clients: imported where used
    from rigctl.fleet.build import Builds

app = typer.Typer(no_args_is_help=True, help="llama.cpp builds on the hosts: status, rollback, gated upgrades, "
                                             "bisects and the CVE floor.")


@app.command("status")
def build_status(limit: LimitOption = None) -> None:
    """The llama.cpp build each host runs (current) and keeps for rollback (previous); a host that cannot be
    read gets a row saying why, and the command exits 1."""
    from rigctl.connections import on_each_host
    from rigctl.fleet.build import read_builds

    found = on_each_host(load_inventory().select(limit), read_builds, thread_name_prefix="rigctl-builds")
    console.print(builds_table(found))
    if any(isinstance(builds, RigctlError) for builds in found.values()):
        raise typer.Exit(1)


def builds_table(found: dict[str, Builds | RigctlError]) -> Table:
    """Each host's builds, or why they could not be read. Every cell but the host's name is what the host's
    build manifests (or its error) say: shown as text, never read as markup."""
    table = Table(title="llama.cpp builds")
    for column in ("host", "current", "key", "CPU", "CUDA", "built on", "previous", "candidate"):
        table.add_column(column)
    for name, builds in found.items():
        if isinstance(builds, RigctlError):
            table.add_row(name, Text.assemble(("unreadable: ", "red"), about_host(name, builds)),
                          "-", "-", "-", "-", "-", "-")
            continue
        cur = builds.current
        table.add_row(name, *(outside_text(cell) for cell in (
            cur if cur else "-", cur.key if cur else "-", cur.cpu if cur else "-",
            (cur.cuda_architectures or "on") if cur and cur.cuda else "off",
            cur.built_on if cur else "-", builds.previous or "-", builds.candidate or "-")))
    return table


@app.command("rollback")
def build_rollback(host: Annotated[str, typer.Argument(help="Host from the inventory.")]) -> None:
    """Make HOST's previous llama.cpp build current again. The next `rigctl provision` restores the
    inventory's pin."""
    from rigctl.fleet.build import rollback

    result = rollback(load_inventory(), host, on_event=print_event, on_task=print_task)
    console.print(f"{result.host}: current is now {result.after} (was {result.before})", highlight=False)


def _say(message: str) -> None:
    console.print(outside_text(f"  {message}"))


def _event(event) -> None:  # only what a role says (the build plan) and failures: a build prints hundreds of tasks
    if event.message and event.status in ("ok", "changed", "failed", "unreachable"):
        print_event(event)


def _named(values: list[str] | None, option: str) -> dict[str, str]:
    out = {}
    for value in values or []:
        name, sep, reason = value.partition("=")
        if not sep or not reason.strip():
            raise ConfigError(f"{option} {value!r}: expected ID=REASON (the reason is recorded with the pin)")
        out[name.strip()] = reason.strip()
    return out


def _gate_table(results) -> Table:
    table = Table(title="gates (candidate against current)")
    for column in ("gate", "verdict", "figures"):
        table.add_column(column)
    for result in results:
        table.add_row(result.gate, result.verdict, outside_text(result.figures))
    return table


@app.command("upgrade")
def build_upgrade(
    to: Annotated[str, typer.Option("--to", help="The llama.cpp version to upgrade to (b11434, or a commit).")],
    canary: Annotated[str | None, typer.Option("--canary", help="Host that builds and measures the candidate "
                                                                "first (default: the first host pinning it).")] = None,
    gates: Annotated[Path | None, typer.Option("--gates", help="YAML laid over the inventory's "
                                                               "rigctl_upgrade_gates.")] = None,
    cmake: Annotated[list[str] | None, typer.Option("--cmake", help="A CMake cache entry for the candidate, "
                                                                   "NAME=VALUE (joins its build key; repeat).")] = None,
    allow_advisory: Annotated[list[str] | None, typer.Option(
        "--allow-advisory", help="Accept a build inside this advisory's range, ID=REASON (written with the pin).")
    ] = None,
    sha256: Annotated[str | None, typer.Option("--sha256", help="The archive's sha256, known from elsewhere: "
                                                               "its first fetch is held to it instead of to the "
                                                               "index's own hash.")] = None,
    results: ResultsOption = None,
) -> None:
    """Upgrade llama.cpp behind gates: the candidate built on the canary beside the current build, checked against
    the CVE floor and every profile's flags, measured paired (llama-bench, server TTFT and decode, greedy identity,
    an eval slice); every gate passed, the pin is written and rolled out host by host, else refused in one line."""
    from rigctl.fleet.candidate import parse_cmake_options
    from rigctl.upgrade.upgrade import upgrade

    result = upgrade(load_inventory_to_write("build upgrade"), to, canary=canary, gates_file=gates,
                     cmake_options=parse_cmake_options(cmake or []), allow=_named(allow_advisory, "--allow-advisory"),
                     store=results_store(results), say=_say, on_event=_event, sha256=sha256)
    console.print(_gate_table(result.results))
    for host in result.rollout:
        console.print(outside_text(f"{host.host}: {host.current} ({host.seconds:.0f} s); "
                                   + ", ".join(f"{s['server']} answers" for s in host.servers)))
    console.print(outside_text(f"upgraded to {result.version}: pin written to "
                               f"{', '.join(str(p) for p in result.written)}; record {result.run}"))


@app.command("bisect")
def build_bisect(
    good: Annotated[str, typer.Option("--good", help="A build without the regression.")],
    bad: Annotated[str, typer.Option("--bad", help="A build with it.")],
    host: Annotated[str, typer.Option("--host", help="Host that builds and measures.")],
    metric: Annotated[str, typer.Option("--metric", help="tg128, pp512 (a llama-bench test of the gates' "
                                                         "matrix), decode, ttft or identity.")] = "tg128",
    candidates: Annotated[Path | None, typer.Option("--candidates", help="YAML list of builds in order, good end "
                                                    "first (a version, or {version, cmake: {NAME: VALUE}}); default: "
                                                    "the versions the package index offers.")] = None,
    gates: Annotated[Path | None, typer.Option("--gates", help="YAML laid over the inventory's gates.")] = None,
    results: ResultsOption = None,
) -> None:
    """Find the first build worse than --good on --metric: each midpoint built on --host (cached by build key) and
    measured paired against the good end; rerun to continue an interrupted bisect."""
    from rigctl.inputs import parse_yaml, read_text
    from rigctl.upgrade.bisect import bisect, parse_candidates

    listed = None
    if candidates is not None:
        origin = f"--candidates {candidates}"
        listed = parse_candidates(parse_yaml(read_text(candidates, "--candidates"), origin), origin)
    result = bisect(load_inventory(), host, good, bad, metric=metric, candidates=listed, gates_file=gates,
                    store=results_store(results), say=_say, on_event=_event)
    table = Table(title=f"bisect {result.run} ({result.resumed} step(s) from before)")
    for column in ("build", "verdict", "how built", "figures"):
        table.add_column(column)
    for step in result.steps:
        table.add_row(step.label, step.verdict, f"{step.plan} {step.build_s:.0f} s", outside_text(step.gate["figures"]))
    console.print(table)
    if result.first_bad:
        console.print(outside_text(f"first bad build: {result.first_bad} (last good: {result.last_good})"))
    else:
        console.print("no first bad build named: a midpoint could not be decided within the gates' budget",
                      highlight=False)
        raise typer.Exit(1)


@app.command("advisories")
def build_advisories(limit: LimitOption = None) -> None:
    """The CVE floor: llama.cpp's published advisories by build number, and each host's pinned and running
    build against them."""
    from rigctl.errors import RigctlError
    from rigctl.fleet.build import read_builds
    from rigctl.inventory import advisories

    table = Table(title="llama.cpp advisories (rigctl/inventory/data/llama_cpp_advisories.yaml)")
    for column in ("advisory", "CVE", "severity", "builds", "fixed in", "flags", "summary"):
        table.add_column(column)
    for advisory in advisories.table():
        table.add_row(advisory.id, advisory.cve or "-", advisory.severity, advisory.range_text,
                      f"b{advisory.fixed}" if advisory.fixed is not None else "-", ", ".join(advisory.flags) or "-",
                      Text(advisory.summary))
    console.print(table)
    # Where each range was read, in full: a URL cut to a table column's width cites nothing.
    console.print("sources:", highlight=False)
    for advisory in advisories.table():
        for source in (advisory.url, *advisory.sources):
            console.print(Text(f"  {advisory.id}: {source}"), soft_wrap=True, highlight=False)
    hosts = Table(title="hosts against the floor")
    for column in ("host", "pinned", "running", "accepted"):
        hosts.add_column(column)
    for host in load_inventory().select(limit):
        allowed = advisories.host_allowed(host)
        pin = host.llama_cpp
        number = advisories.build_number(pin.version) if pin.source == "archive" else None
        pinned = "no build number" if number is None else (
            ", ".join(a.id for a in advisories.check_build(number, allowed).refused) or "clear")
        try:
            current = read_builds(host).current
            running = "none" if current is None else (
                f"{current.version}: " + (", ".join(a.id for a in advisories.check_build(current.build_number,
                                                                                          allowed).refused) or "clear"))
        except RigctlError as exc:
            running = f"unknown ({exc})"
        hosts.add_row(host.name, f"{pin.version}: {pinned}", outside_text(running), ", ".join(allowed) or "-")
    console.print(hosts)
