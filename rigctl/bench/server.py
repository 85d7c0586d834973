"""`rigctl bench server`: speed through a running llama-server instance of one host.

Three measurements, each optional, written to the results store as a ``server-speed`` run:

* **Prompt-length sweep** (``sweep.jsonl``): for each prompt length (tokens, built from shipped
  filler text and checked with the server's ``/tokenize``) a streamed chat request, prompt cache
  off: time to first token (client clock), prefill and decode tokens/s (server timings).
* **Model load time** (``load.jsonl``): ``systemctl restart llama-server@NAME`` until ``/health``
  answers 200, ``load_runs`` times.
* **GPU memory per context size** (``memory.jsonl``): the instance is stopped; for each context
  size a probe server with the instance's own arguments but ``-c SIZE`` (and a spare port) runs as a
  transient unit, and ``nvidia-smi``'s memory.used is read once it is healthy; the instance is
  started again after. The KV-cache growth per token is the slope of a least-squares line through
  (context size, MiB), in bytes per token.
"""

from __future__ import annotations

import json
import logging
import shlex
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from rigctl.errors import ConfigError, ServerError
from rigctl.hostside.sandbox import run_options
from rigctl.inventory import Host, Server
from rigctl.inventory.profiles import args_lines_to_argv
from rigctl.llama_http import Endpoint, ServerClient, Timeouts
from rigctl.results.record import RunRecord
from rigctl.results.stamp import collect_stamp, inventory_server, with_props
from rigctl.results.store import ResultsStore
from rigctl.servers import operator_start
from rigctl.ssh import SshClient, session

log = logging.getLogger(__name__)

SWEEP_FILE = "sweep.jsonl"
LOAD_FILE = "load.jsonl"
MEMORY_FILE = "memory.jsonl"
HEALTH_TIMEOUT_S = 600.0
_FILLER = ("The committee reviewed the quarterly figures, compared them with last year's results and noted "
           "that shipping costs had risen while the number of returned parcels had fallen slightly. ")


@dataclass(frozen=True)
class SweepPoint:
    prompt_tokens: int
    ttft_s: float
    prompt_per_s: float
    decode_per_s: float
    predicted_n: int


@dataclass(frozen=True)
class MemoryPoint:
    ctx_size: int
    memory_used_mib: int


@dataclass
class ServerBenchResult:
    host: str
    instance: str
    sweep: list[SweepPoint] = field(default_factory=list)
    load_s: list[float] = field(default_factory=list)
    memory: list[MemoryPoint] = field(default_factory=list)
    kv_bytes_per_token: float | None = None
    run_dir: Path | None = None


def kv_bytes_per_token(points: Sequence[MemoryPoint]) -> float | None:
    """Slope of memory.used over context size, in bytes per token (None with fewer than two sizes)."""
    sizes = {p.ctx_size for p in points}
    if len(sizes) < 2:
        return None
    slope, _ = np.polyfit([p.ctx_size for p in points], [p.memory_used_mib for p in points], 1)
    return float(slope * 1024 * 1024)


def filler_prompt(tokens: int, count: Callable[[str], int]) -> str:
    """Filler text of about ``tokens`` tokens as ``count`` (the server's tokenizer) measures it."""
    text = _FILLER * max(1, tokens // max(1, count(_FILLER)))
    while count(text) < tokens:
        text += _FILLER
    words = text.split(" ")
    while len(words) > 1 and count(" ".join(words)) > tokens:
        words = words[: max(1, len(words) - max(1, (count(" ".join(words)) - tokens) // 2))]
    return " ".join(words)


def measure_prompt(server: ServerClient, prompt: str, max_tokens: int) -> SweepPoint:
    """One streamed chat request of ``prompt``, prompt cache off: TTFT on the client's clock, prefill and
    decode tokens/s from the server's timings."""
    tokens = len(server.tokenize(prompt))
    reply = server.chat_stream([{"role": "user", "content": prompt}], max_tokens=max_tokens,
                               extra={"cache_prompt": False})
    timings = reply.timings
    return SweepPoint(tokens, reply.ttft_s or 0.0, timings.prompt_per_second if timings else 0.0,
                      timings.predicted_per_second if timings else 0.0, timings.predicted_n if timings else 0)


def _memory_used(ssh: SshClient) -> int:
    result = ssh.run("nvidia-smi --query-gpu=memory.used --format=csv,noheader,nounits", timeout=30, check=True)
    return int(float(result.stdout.strip().splitlines()[0]))


def run_server_bench(
    host: Host,
    instance: str,
    *,
    prompt_lengths: Sequence[int] = (128, 512, 1024),
    max_tokens: int = 64,
    load_runs: int = 1,
    ctx_sizes: Sequence[int] = (),
    probe_port: int | None = None,
    store: ResultsStore | None = None,
    on_step: Callable[[str], None] | None = None,
) -> ServerBenchResult:
    """Measure ``instance`` on ``host``; the run is saved to ``store``."""
    served = host.server(instance)
    say = on_step or (lambda message: None)
    endpoint = served.endpoint
    unit = served.unit
    result = ServerBenchResult(host=host.name, instance=instance)
    with session(host) as ssh, ServerClient(endpoint, timeouts=Timeouts(read=900)) as server:
        server.wait_healthy(HEALTH_TIMEOUT_S)
        props = server.props()
        stamp = collect_stamp(host, ssh, [inventory_server(host, instance)], artifacts=[served.artifact],
                              concurrency=1)
        record = RunRecord.begin("server-speed", stamp, host=host.name)
        with_props(record.servers[0], props, endpoint)
        for length in prompt_lengths:
            point = measure_prompt(server, filler_prompt(length, lambda text: len(server.tokenize(text))), max_tokens)
            result.sweep.append(point)
            say(f"prompt {point.prompt_tokens} tokens: ttft {point.ttft_s:.3f} s, "
                f"decode {point.decode_per_s:.2f} tok/s")
        for _ in range(load_runs):
            began = time.monotonic()
            ssh.run(operator_start([unit], "restart"), timeout=300, check=True)
            server.wait_healthy(HEALTH_TIMEOUT_S)
            result.load_s.append(time.monotonic() - began)
            say(f"load (restart to /health 200): {result.load_s[-1]:.2f} s")
        if ctx_sizes:
            port = probe_port or served.port + 100
            result.memory = _memory_sweep(ssh, served, ctx_sizes, port, say)
            server.wait_healthy(HEALTH_TIMEOUT_S)
            result.kv_bytes_per_token = kv_bytes_per_token(result.memory)
    store = store or ResultsStore()
    run_dir = store.run_dir(host.name, record.id)
    run_dir.mkdir(parents=True, exist_ok=True)
    for name, rows in ((SWEEP_FILE, result.sweep), (MEMORY_FILE, result.memory),
                       (LOAD_FILE, [{"load_s": s} for s in result.load_s])):
        (run_dir / name).write_text("".join(json.dumps(r if isinstance(r, dict) else asdict(r)) + "\n" for r in rows))
    record.extra = {"prompt_lengths": list(prompt_lengths), "max_tokens": max_tokens, "ctx_sizes": list(ctx_sizes),
                    "kv_bytes_per_token": result.kv_bytes_per_token}
    record.seal(run_dir)
    result.run_dir = run_dir
    return result


@dataclass(frozen=True)
class Probe:
    """A running probe server: its transient unit, endpoint and command-line arguments."""

    unit: str
    endpoint: Endpoint
    argv: list[str]


@contextmanager
def instance_stopped(ssh: SshClient, server: Server) -> Iterator[None]:
    """``server``'s unit stopped (its card and port free for probes); on exit, when it was running
    before, started again and waited for until it answers /health (what follows finds it as it was)."""
    running = ssh.run(f"systemctl is-active --quiet {shlex.quote(server.unit)}", timeout=30, check=False).ok
    ssh.run(f"systemctl stop {shlex.quote(server.unit)}", timeout=300, check=True)
    try:
        yield
    finally:
        if running:
            ssh.run(operator_start([server.unit]), timeout=300, check=True)
            with ServerClient(server.endpoint) as client:
                client.wait_healthy(HEALTH_TIMEOUT_S)


def deployed_argv(ssh: SshClient, server: Server) -> list[str]:
    """The arguments ``server``'s unit starts llama-server with: its arguments file on the host, split as
    the role's launcher splits it."""
    text = ssh.run(f"cat {shlex.quote(server.args_file)}", timeout=30, check=True).stdout
    return args_lines_to_argv(text.splitlines())


def probe_command(server: Server, unit: str, argv: Sequence[str], binary: str | None = None) -> list[str]:
    """The ``systemd-run`` command line of a probe of ``server``: its llama-server (or ``binary``, another
    build's) with ``argv`` as the transient unit ``unit``, with the ``llama-server@`` unit's account, sandbox
    and GPU pin (the probe sees the card the instance sees), writable nothing but a private /tmp (the
    instance's state directory is its own)."""
    properties = [*server.account.unit_properties(), f"EnvironmentFile={server.env_file}", "UMask=0077"]
    return ["systemd-run", "--unit", unit, "--collect", "--quiet", *run_options(properties),
            binary or server.binary, *argv]


def probe_unit_name(server: Server, purpose: str) -> str:
    """The transient unit a probe of ``server`` for ``purpose`` runs as: ``rigctl-<first word>probe-<instance>``."""
    return f"rigctl-{purpose.split()[0]}probe-{server.name}"


@contextmanager
def probe_server(ssh: SshClient, server: Server, settings: Mapping[str, Any], port: int,
                 purpose: str, binary: str | None = None) -> Iterator[Probe]:
    """A probe of ``server`` with ``settings`` over its profile (``{"ctx_size": 4096}``) on ``port``, as the
    transient unit ``rigctl-<purpose>probe-<instance>`` as the unit's user, with its sandbox and GPU pin, once
    it is healthy; stopped on exit. ``binary``: another build's llama-server (an upgrade's candidate, served
    beside the instance on the same artifact and profile). Refused when the host's arguments file is not what
    the inventory plans (the probe would measure flags the instance does not run): deploy first."""
    deployed = deployed_argv(ssh, server)
    if deployed != server.argv:
        extra = sorted(set(deployed) - set(server.argv)) or sorted(set(server.argv) - set(deployed))
        raise ConfigError(f"{server.host}/{server.name}: {server.args_file} on the host differs from the inventory "
                          f"({' '.join(extra[:4]) or 'order'}); deploy before probing it")
    argv = server.argv_with(port=port, **settings)
    probe = probe_unit_name(server, purpose)
    endpoint = Endpoint(f"http://{server.address}:{port}", api_key=server.api_key, label=f"{server.host}/{probe}")
    ssh.run(shlex.join(probe_command(server, probe, argv, binary)), timeout=60, check=True)
    try:
        try:
            with ServerClient(endpoint) as client:
                client.wait_healthy(HEALTH_TIMEOUT_S)
        except ServerError:
            tail = ssh.run(f"journalctl -u {probe} -n 5 --no-pager", timeout=30, check=False).stdout
            raise ServerError(f"{server.host}/{probe}", purpose, tail.strip().splitlines()[-1] if tail else
                              "not healthy") from None
        yield Probe(probe, endpoint, argv)
    finally:
        ssh.run(f"systemctl stop {probe}", timeout=120, check=False)


def _memory_sweep(ssh: SshClient, server: Server, ctx_sizes: Sequence[int], port: int,
                  say: Callable[[str], None]) -> list[MemoryPoint]:
    points = []
    with instance_stopped(ssh, server):
        for size in ctx_sizes:
            with probe_server(ssh, server, {"ctx_size": int(size)}, port, f"ctx {size}"):
                points.append(MemoryPoint(size, _memory_used(ssh)))
                say(f"ctx {size}: {points[-1].memory_used_mib} MiB")
    return points


def to_markdown(result: ServerBenchResult) -> str:
    out = [f"### {result.host}/{result.instance}", "", "| prompt tokens | TTFT s | prefill tok/s | decode tok/s |",
           "|---|---|---|---|"]
    out += [f"| {p.prompt_tokens} | {p.ttft_s:.3f} | {p.prompt_per_s:.2f} | {p.decode_per_s:.2f} |"
            for p in result.sweep]
    if result.load_s:
        out += ["", f"model load (restart to /health 200): {', '.join(f'{s:.2f} s' for s in result.load_s)}"]
    if result.memory:
        out += ["", "| ctx size | GPU memory used MiB |", "|---|---|"]
        out += [f"| {p.ctx_size} | {p.memory_used_mib} |" for p in result.memory]
        if result.kv_bytes_per_token is not None:
            out += ["", f"KV cache growth: {result.kv_bytes_per_token:.0f} bytes per token"]
    return "\n".join(out) + "\n"

