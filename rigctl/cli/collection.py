"""``rigctl collection build|install``: rigctl's roles as the rigctl.fleet Ansible collection."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from rigctl.cli.common import console

app = typer.Typer(no_args_is_help=True, help="rigctl's roles as the rigctl.fleet Ansible collection, for your own "
                                              "playbooks: build the archive, or install it into a collections path.")


@app.command("build")
def collection_build(
    out: Annotated[Path, typer.Option("--out", "-o", help="Directory for the archive.")] = Path("."),
) -> None:
    """Write rigctl-fleet-VERSION.tar.gz (ansible-galaxy collection build) from the roles that came with rigctl."""
    from rigctl.fleet.collection import build

    console.print(f"wrote {build(out)}", markup=False, highlight=False)


@app.command("install")
def collection_install(
    path: Annotated[Path, typer.Option("--path", "-p", help="The collections path to install into.")],
) -> None:
    """Build rigctl.fleet and install it into PATH (ansible-galaxy collection install --force); then use it from
    a playbook run with ANSIBLE_COLLECTIONS_PATH=PATH: `roles: [rigctl.fleet.gpu_host]`."""
    from rigctl.fleet.collection import FQCN, install

    installed = install(path)
    console.print(f"installed {FQCN} in {installed}", markup=False, highlight=False)
