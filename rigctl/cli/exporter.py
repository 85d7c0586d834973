"""``rigctl exporter``: the fleet as Prometheus metrics (a long-running service)."""

from __future__ import annotations

import dataclasses
import signal
import threading
from pathlib import Path
from typing import Annotated

import typer

from rigctl.cli.common import LimitOption, ResultsOption, err_console, finite, load_inventory, results_store


def exporter(
    listen: Annotated[str, typer.Option("--listen", help="ADDRESS:PORT to serve /metrics on (':PORT' is loopback; "
                                        "every interface only as 0.0.0.0:PORT).")] = "127.0.0.1:9840",
    interval: Annotated[float, typer.Option("--interval", min=1.0, callback=finite,
                                            help="Seconds between collections.")] = 15.0,
    host_timeout: Annotated[float, typer.Option("--host-timeout", min=1.0,
                                                callback=finite,
                                                help="Seconds one host may take before it shows as down.")] = 10.0,
    results: ResultsOption = None,
    limit: LimitOption = None,
    ssh_key: Annotated[Path | None, typer.Option(
        "--ssh-key", help="SSH private key for every host, over the inventory's (a service's credential).")] = None,
    known_hosts: Annotated[Path | None, typer.Option(
        "--known-hosts", help="known_hosts for every host, over the inventory's rigctl_known_hosts.")] = None,
    apply_drain_policy: Annotated[bool, typer.Option(
        "--apply-drain-policy", help="Drain a host whose GPU turns unhealthy where its rigctl_drain_policy says so "
        "(writes its host_vars).")] = False,
) -> None:
    """Serve the fleet's state as Prometheus metrics: reachability, builds and model pins against the
    inventory, llama-server units, GPUs, and the latest pulled bench and eval results."""
    from rigctl.services.exporter import Exporter

    inventory = load_inventory()
    overrides = {**({"ansible_ssh_private_key_file": str(ssh_key)} if ssh_key else {}),
                 **({"rigctl_known_hosts": str(known_hosts)} if known_hosts else {})}
    if overrides:
        # The service runs as its own user and gets the key and known_hosts from systemd (LoadCredential=).
        inventory = dataclasses.replace(inventory, hosts={
            name: dataclasses.replace(host, vars={**host.vars, **overrides}) for name, host in inventory.hosts.items()})
    exp = Exporter(inventory, limit=limit, results=results_store(results), interval=interval,
                   host_timeout=host_timeout, apply_drain_policy=apply_drain_policy)
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
