"""``rigctl check template|logits``: a server against a transformers reference."""

from __future__ import annotations

import math
import os
import sys
from pathlib import Path
from typing import Annotated

import typer
from rich.table import Table

from rigctl.cli.common import console, load_inventory
from rigctl.cli.render import outside_text
from rigctl.errors import ConfigError

app = typer.Typer(no_args_is_help=True,
                  help="Runtime checks against a transformers reference: chat template and next-token logits.")


def _reference(hf: Path, python: Path | None):
    from rigctl.analysis.runtime_check import HfReference

    return HfReference(hf.expanduser(), python=(python or Path(os.environ.get("RIGCTL_VERIFY_PYTHON")
                                                                  or sys.executable)).expanduser())


def _endpoints(host: str | None, servers: list[str] | None, urls: list[str] | None):
    from rigctl.llama_http import Endpoint

    if urls:
        return [Endpoint(u) for u in urls]
    if not host or not servers:
        raise ConfigError("name the server: --host HOST --server NAME (repeatable), or --url URL")
    from rigctl.forward import server_endpoint

    inv_host = load_inventory().host(host)
    return [server_endpoint(inv_host, inv_host.server(name)) for name in servers]


def _prompts(path: Path | None):
    from rigctl.analysis.runtime_check import BUILTIN_PROMPTS, load_prompts

    return load_prompts(path) if path else list(BUILTIN_PROMPTS)


HostOption = Annotated[str | None, typer.Option("--host", help="Inventory host of the server.")]
ServerOption = Annotated[list[str] | None, typer.Option("--server", help="llama_server instance on --host "
                                                                         "(repeatable: one per served artifact).")]
UrlOption = Annotated[list[str] | None, typer.Option("--url", help="Server URL instead of --host/--server.")]
HfOption = Annotated[Path, typer.Option("--hf", help="The model's Hugging Face checkout (tokenizer, weights).")]
PythonOption = Annotated[Path | None, typer.Option(
    "--python", help="A Python with transformers and torch (default $RIGCTL_VERIFY_PYTHON, else rigctl's own).")]
PromptsOption = Annotated[Path | None, typer.Option(
    "--prompts", help="JSONL of {name, messages, tools} (default: built-in math and tool-calling prompts).")]


@app.command("template")
def check_template_cmd(
    hf: HfOption,
    host: HostOption = None,
    server: ServerOption = None,
    url: UrlOption = None,
    python: PythonOption = None,
    prompts: PromptsOption = None,
    chat_template: Annotated[Path | None, typer.Option(
        "--chat-template", help="Render the reference with this Jinja template instead of the tokenizer's.")] = None,
) -> None:
    """Render prompts through the server's /apply-template and transformers' apply_chat_template: how many
    are byte-identical, and the first differing position with context for the rest. Exits 1 on a difference."""
    from rigctl.analysis.runtime_check import check_template, context
    from rigctl.llama_http import ServerClient

    reference = _reference(hf, python)
    template = chat_template.read_text() if chat_template else None
    conversations = _prompts(prompts)
    failed = False
    for endpoint in _endpoints(host, server, url):
        with ServerClient(endpoint) as client, console.status(f"{endpoint}: rendering {len(conversations)} prompts"):
            result = check_template(client, reference, conversations, chat_template=template)
        for diff in result.differing:
            console.print(outside_text(f"{diff.name}: differs at character {diff.position}\n"
                                       f"  server:    {context(diff.server, diff.position)}\n"
                                       f"  reference: {context(diff.reference, diff.position)}", lines=True))
        console.print(f"{result.endpoint}: {result.identical} of {len(result.results)} prompts byte-identical "
                      f"to transformers ({result.checkout})", markup=False, highlight=False)
        failed |= bool(result.differing)
    if failed:
        raise typer.Exit(1)


@app.command("logits")
def check_logits_cmd(
    hf: HfOption,
    host: HostOption = None,
    server: ServerOption = None,
    url: UrlOption = None,
    python: PythonOption = None,
    prompts: PromptsOption = None,
    top_k: Annotated[int, typer.Option("--top-k", help="Server n_probs; the KL is taken over these tokens.")] = 20,
) -> None:
    """Next-token probabilities of each served artifact against a float32 transformers reference on the
    CPU: top-1 agreement and the KL divergence over the server's top-k."""
    from rigctl.analysis.runtime_check import check_logits
    from rigctl.llama_http import ServerClient

    reference = _reference(hf, python)
    conversations = _prompts(prompts)
    table = Table(title=f"next-token distributions vs float32 transformers ({reference.checkout})")
    for column in ("server", "model", "build", "prompts", "top-1 agree", "KL mean", "KL max", "top-k mass"):
        table.add_column(column)
    for endpoint in _endpoints(host, server, url):
        with ServerClient(endpoint) as client, console.status(f"{endpoint}: {len(conversations)} prompts"):
            result = check_logits(client, reference, conversations, top_k=top_k)
        masses = [r.server_mass for r in result.results]
        table.add_row(result.endpoint, outside_text(Path(result.model_path).name), outside_text(result.build),
                      str(len(result.results)),
                      f"{result.agreement}/{len(result.results)}", _num(result.mean_kl), _num(result.max_kl),
                      f"{min(masses):.2f}-{max(masses):.2f}" if masses else "-")
    console.print(table)


def _num(x: float) -> str:
    return "-" if math.isnan(x) else f"{x:.4f}"
