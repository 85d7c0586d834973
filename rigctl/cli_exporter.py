"""`rigctl exporter` and `rigctl mcp`: the two long-running faces of rigctl."""

from __future__ import annotations

import dataclasses
import signal
import threading
from pathlib import Path
from typing import Annotated

import typer

from rigctl.cli import _inventory, app, err_console


@app.command("exporter")
def exporter(
    listen: Annotated[str, typer.Option("--listen", help="ADDRESS:PORT to serve /metrics on (':PORT' is loopback; "
                                        "every interface only as 0.0.0.0:PORT).")] = "127.0.0.1:9840",
    interval: Annotated[float, typer.Option("--interval", min=1.0, help="Seconds between collections.")] = 15.0,
    host_timeout: Annotated[float, typer.Option("--host-timeout", min=1.0,
                                                help="Seconds one host may take before it shows as down.")] = 10.0,
    results: Annotated[Path | None, typer.Option("--results", envvar="RIGCTL_RESULTS",
                                                 help="Results store of pulled runs (default ./results).")] = None,
    limit: Annotated[str | None, typer.Option("--limit", "-l", help="Hosts or groups, comma-separated.")] = None,
    ssh_key: Annotated[Path | None, typer.Option(
        "--ssh-key", help="SSH private key for every host, over the inventory's (a service's credential).")] = None,
    known_hosts: Annotated[Path | None, typer.Option(
        "--known-hosts", help="known_hosts for every host, over the inventory's rigctl_known_hosts.")] = None,
) -> None:
    """Serve the fleet's state as Prometheus metrics: reachability, builds and model pins against the
    inventory, llama-server units, GPUs, and the latest pulled bench and eval results."""
    from rigctl.exporter import Exporter
    from rigctl.results.store import ResultsStore

    inventory = _inventory()
    overrides = {**({"ansible_ssh_private_key_file": str(ssh_key)} if ssh_key else {}),
                 **({"rigctl_known_hosts": str(known_hosts)} if known_hosts else {})}
    if overrides:
        # The service runs as its own user and gets the key and known_hosts from systemd (LoadCredential=).
        inventory = dataclasses.replace(inventory, hosts={
            name: dataclasses.replace(host, vars={**host.vars, **overrides}) for name, host in inventory.hosts.items()})
    exp = Exporter(inventory, limit=limit, results=ResultsStore(results), interval=interval,
                   host_timeout=host_timeout)
    server, _thread = exp.serve(listen)
    exp.start()
    err_console.print(f"rigctl exporter: {len(exp.hosts)} hosts, /metrics on {listen}, every {interval:g}s",
                      markup=False, highlight=False)
    stopped = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stopped.set())
    stopped.wait()
    server.shutdown()
    exp.stop()


@app.command("mcp")
def mcp(
    allow_actions: Annotated[bool, typer.Option("--allow-actions",
                                                help="Allow the tools that change things: restart a server, "
                                                     "start a bench or an eval, pull results.")] = False,
    results: Annotated[Path | None, typer.Option("--results", envvar="RIGCTL_RESULTS",
                                                 help="Results store (default ./results).")] = None,
    task_dirs: Annotated[list[Path] | None, typer.Option(
        "--task-dir", help="A directory start_eval may take task files from (besides the shipped tasks).")] = None,
) -> None:
    """Serve the fleet as MCP tools over stdio (for Claude Code or any MCP client); read-only unless
    --allow-actions."""
    from rigctl.mcp_server import build_server

    build_server(_inventory(), allow_actions=allow_actions, results_root=results,
                 task_dirs=task_dirs or ()).run("stdio")
