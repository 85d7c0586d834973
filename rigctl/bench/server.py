"""`rigctl bench server`: speed through a running llama-server instance of one host.

Three measurements, each optional, written to the results store as a ``server-speed`` run:

* **Prompt-length sweep** (``sweep.jsonl``): for each prompt length (tokens, built from shipped
  filler text and checked with the server's ``/tokenize``) a streamed chat request, prompt cache
  off: time to first token (client clock), prefill and decode tokens/s (server timings).
* **Model load time** (``load.jsonl``): ``systemctl restart llama-server@NAME`` until ``/health``
  answers 200, ``load_runs`` times (:func:`rigctl.fleet.servers.restart_instance`).
* **GPU memory per context size** (``memory.jsonl``): the instance is stopped; for each context
  size a probe server with the instance's own arguments but ``-c SIZE`` (and a spare port) runs as a
  transient unit (:func:`rigctl.fleet.servers.probe_server`), and ``nvidia-smi``'s memory.used is read once it
  is healthy; the instance is started again after. The KV-cache growth per token is the slope of a
  least-squares line through (context size, MiB), in bytes per token.

The run directory and its record are made before anything is measured (:func:`rigctl.results.run.open_run`):
a run that fails part-way is sealed ``failed`` with the reason, beside the files it finished.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field

import numpy as np

from rigctl.errors import ServerError
from rigctl.fleet.servers import probe_server, restart_instance, stopped, wait_ready
from rigctl.forward import server_endpoint
from rigctl.hostside import nvidia_smi
from rigctl.inventory import Host, Server
from rigctl.llama_http import ServerClient, Timeouts
from rigctl.llama_http.api import FIGURE_DEFINITIONS
from rigctl.results.run import RunResult, open_run
from rigctl.results.stamp import inventory_server, inventory_stamp, with_props
from rigctl.results.store import ResultsStore
from rigctl.ssh import SshClient, session

log = logging.getLogger(__name__)

SWEEP_FILE = "sweep.jsonl"
LOAD_FILE = "load.jsonl"
MEMORY_FILE = "memory.jsonl"
_FILLER = ("The committee reviewed the quarterly figures, compared them with last year's results and noted "
           "that shipping costs had risen while the number of returned parcels had fallen slightly. ")


@dataclass(frozen=True)
class SweepPoint:
    prompt_tokens: int
    ttft_s: float
    prompt_per_s: float
    decode_per_s: float
    predicted_n: int
    decode_tokens: str | None = None  # the token count decode_per_s is over, as the build counts it


@dataclass(frozen=True)
class MemoryPoint:
    ctx_size: int
    memory_used_mib: int | None  # None where the driver reports none (a unified-memory GPU)


@dataclass
class ServerBenchResult(RunResult):
    instance: str
    sweep: list[SweepPoint] = field(default_factory=list)
    load_s: list[float] = field(default_factory=list)
    memory: list[MemoryPoint] = field(default_factory=list)
    kv_bytes_per_token: float | None = None


def kv_bytes_per_token(points: Sequence[MemoryPoint]) -> float | None:
    """Slope of memory.used over context size, in bytes per token (None with fewer than two sizes)."""
    points = [p for p in points if p.memory_used_mib is not None]
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
    decode tokens/s from the server's timings (as :mod:`rigctl.llama_http.api` defines them). ServerError
    where the server failed the request, in its status or inside the stream, or sent no token at all: a
    reply without a first token has no TTFT to record."""
    tokens = len(server.tokenize(prompt))
    reply = server.chat_stream([{"role": "user", "content": prompt}], max_tokens=max_tokens,
                               extra={"cache_prompt": False})
    timings = reply.timings
    if reply.ttft_s is None:
        raise ServerError(str(server.endpoint), "POST /v1/chat/completions",
                          f"the streamed reply carried no token (finish_reason {reply.finish_reason or 'none'!r})")
    return SweepPoint(tokens, reply.ttft_s, timings.prompt_per_second if timings else 0.0,
                      timings.predicted_per_second if timings else 0.0, timings.predicted_n if timings else 0,
                      timings.decode_tokens if timings else None)


def _memory_used(ssh: SshClient, gpu: int | str | None) -> int | None:
    """GPU memory in use (MiB) on the instance's GPU, or summed over every GPU when it is not pinned to one
    by index (unpinned it uses them all; a MIG instance's use shows on its whole GPU, and the sweep needs
    only the change); None where the driver reports none (a unified-memory GPU's is ``[N/A]``)."""
    selection = f" -i {gpu}" if isinstance(gpu, int) else ""
    result = ssh.run(f"nvidia-smi --query-gpu=memory.used --format=csv,noheader,nounits{selection}", timeout=30,
                     check=True)
    used = [nvidia_smi.whole(row["memory.used"]) for row in nvidia_smi.query_rows(result.stdout, ["memory.used"])]
    return None if not used or None in used else sum(u for u in used if u is not None)


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
    """Measure ``instance`` on ``host``; the run is saved to ``store`` (sealed failed, with the reason, when a
    step fails)."""
    served = host.server(instance)
    say = on_step or (lambda message: None)
    endpoint = server_endpoint(host, served)  # a forward the host refuses fails here, before the run starts
    result = ServerBenchResult(host=host.name, instance=instance)
    stamp = inventory_stamp(host, [inventory_server(host, instance)], artifacts=[served.artifact], concurrency=1)
    extra = {"prompt_lengths": list(prompt_lengths), "max_tokens": max_tokens, "ctx_sizes": list(ctx_sizes),
             "definitions": FIGURE_DEFINITIONS}
    with open_run("server-speed", stamp, store or ResultsStore(), extra=extra) as run, session(host) as ssh, \
            ServerClient(endpoint, timeouts=Timeouts(read=900)) as server:
        result.run_dir = run.path
        wait_ready(ssh, served.unit, endpoint)
        props = server.props()
        run.complete_stamp(ssh)
        with_props(run.record.servers[0], props, endpoint)
        run.save()
        for length in prompt_lengths:
            point = measure_prompt(server, filler_prompt(length, lambda text: len(server.tokenize(text))), max_tokens)
            result.sweep.append(point)
            say(f"prompt {point.prompt_tokens} tokens: ttft {point.ttft_s:.3f} s, "
                f"decode {point.decode_per_s:.2f} tok/s")
        run.write_jsonl(SWEEP_FILE, map(asdict, result.sweep))
        for _ in range(load_runs):
            result.load_s.append(restart_instance(ssh, served))
            say(f"load (restart to /health 200): {result.load_s[-1]:.2f} s")
        run.write_jsonl(LOAD_FILE, [{"load_s": s} for s in result.load_s])
        if ctx_sizes:
            port = probe_port or served.port + 100
            result.memory = _memory_sweep(ssh, served, ctx_sizes, port, say)
            result.kv_bytes_per_token = kv_bytes_per_token(result.memory)
        run.write_jsonl(MEMORY_FILE, map(asdict, result.memory))
        run.record.extra["kv_bytes_per_token"] = result.kv_bytes_per_token
    return result


def _memory_sweep(ssh: SshClient, server: Server, ctx_sizes: Sequence[int], port: int,
                  say: Callable[[str], None]) -> list[MemoryPoint]:
    points = []
    with stopped(ssh, server):
        for size in ctx_sizes:
            with probe_server(ssh, server, {"ctx_size": int(size)}, port, f"ctx {size}"):
                points.append(MemoryPoint(size, _memory_used(ssh, server.gpu)))
                used = points[-1].memory_used_mib
                say(f"ctx {size}: {used} MiB" if used is not None else f"ctx {size}: the driver reports no memory use")
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

