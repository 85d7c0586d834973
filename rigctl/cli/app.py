"""The ``rigctl`` app: the command groups put together, the global options, logging and exit codes.
:func:`rigctl.cli.main.main` imports this once it has started what may start before it."""

from __future__ import annotations

import gc
import logging
import sys
from typing import TYPE_CHECKING, Annotated

import typer

from rigctl.cli import (
    bench,
    build,
    campaign,
    check,
    collection,
    compare,
    eval,
    exporter,
    hosts,
    inventory,
    jobs,
    lab,
    mcp,
    models,
    provision,
    report,
    servers,
)
from rigctl.cli.common import close_preload, err_console, state
from rigctl.cli.render import outside_text
from rigctl.connections import connections
from rigctl.errors import RigctlError

if TYPE_CHECKING:
    from rigctl.inventory.preload import InventoryPreload


def _click_exception(name: str) -> type[Exception]:
    """The click exception class ``name`` of the click typer parses with: a copy of its own in newer typers
    (``typer._click``, not the click package), the click package in older ones. Reached through typer's public
    BadParameter, whichever it is."""
    return next(cls for cls in typer.BadParameter.__mro__ if cls.__name__ == name)


ClickException = _click_exception("ClickException")
UsageError = _click_exception("UsageError")

app = typer.Typer(no_args_is_help=True, add_completion=False, pretty_exceptions_enable=False,
                  help="Provision, serve, bench and evaluate a llama.cpp fleet from one inventory.")
app.add_typer(inventory.app, name="inventory")
app.add_typer(lab.app, name="lab")
app.add_typer(build.app, name="build")
app.add_typer(models.app, name="models")
app.add_typer(hosts.app, name="hosts")
app.add_typer(servers.app, name="servers")
app.add_typer(bench.app, name="bench")
app.add_typer(eval.app, name="eval")
app.add_typer(check.app, name="check")
app.add_typer(campaign.app, name="campaign")
app.add_typer(collection.app, name="collection")
app.command("init")(inventory.init)
app.command("provision")(provision.provision)
app.command("jobs")(jobs.jobs_list)
app.command("pull")(jobs.pull)
app.command("compare")(compare.compare)
app.command("report")(report.report)
app.command("exporter")(exporter.exporter)
app.command("mcp")(mcp.mcp)

#: Services that run until stopped: they connect per use, never through the command's connection scope.
_SERVICES = frozenset({"exporter", "mcp"})


class _PlainFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        return f"{record.levelname.lower()}: {record.getMessage()}"


def version_line() -> str:
    """``rigctl --version``: the package's version (SemVer), and the commit when run from a checkout."""
    import rigctl

    commit = rigctl.__commit__
    return f"rigctl {rigctl.__version__}" + (f" (commit {commit})" if commit else "")


def _print_version(value: bool) -> None:
    if value:
        typer.echo(version_line())
        raise typer.Exit()


@app.callback()
def main_options(
    ctx: typer.Context,
    inventory: Annotated[str | None, typer.Option("-i", "--inventory", envvar="RIGCTL_INVENTORY",
                                                  help="Inventory directory or file (default: ansible.cfg's).")] = None,
    verbose: Annotated[int, typer.Option("-v", "--verbose", count=True, help="More log output (-vv: debug).")] = 0,
    debug: Annotated[bool, typer.Option("--debug", help="Show tracebacks on errors.")] = False,
    version: Annotated[bool, typer.Option("--version", is_eager=True, callback=_print_version,
                                          help="Print rigctl's version (and commit, in a checkout) and exit.")] = False,
) -> None:
    from rich.logging import RichHandler

    from rigctl.trust import RedactingFilter

    state.inventory_source = inventory
    state.debug = debug
    ctx.call_on_close(close_preload)
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
    if ctx.invoked_subcommand not in _SERVICES:
        # One SSH connection per host for the whole command, however often it talks to the host.
        ctx.with_resource(connections())


def usage_message(exc: ClickException) -> str:
    """One line for a usage error: what is wrong, naming the option, and where to find the usage."""
    message = " ".join(exc.format_message().split())
    ctx = getattr(exc, "ctx", None)
    if isinstance(exc, UsageError) and ctx is not None:
        message += f" (see '{ctx.command_path} --help')"
    return message


def run(preload: InventoryPreload | None = None) -> None:
    """Run the command line in ``sys.argv``; ``preload``: the inventory :func:`rigctl.cli.main.main` started
    loading before this module was imported."""
    state.preload = preload
    try:
        _run_app()
    finally:
        close_preload()  # a preload the command never reached (a usage error before its group's callback)
        # The objects of a finished command are left to the exit: without this, a last collection over
        # all of them takes a sixth of a second of every run (the modules of pydantic, paramiko, rich).
        gc.freeze()


def _run_app() -> None:
    from rigctl.trust import mask_registered

    try:
        # Without standalone mode click hands back typer.Exit's code instead of exiting.
        rc = app(standalone_mode=False)
    except RigctlError as exc:
        if state.debug:
            raise
        # An error may quote what a host or a server said: one line of text, whatever it holds.
        for line in getattr(exc, "problems", None) or [str(exc)]:
            err_console.print(outside_text(f"error: {mask_registered(line)}"), soft_wrap=True)
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
        err_console.print(outside_text(f"error: {type(exc).__name__}: {mask_registered(str(exc))} "
                                       "(run with --debug for the traceback)"), soft_wrap=True)
        sys.exit(1)
    sys.exit(rc if isinstance(rc, int) else 0)
