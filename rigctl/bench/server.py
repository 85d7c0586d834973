"""`rigctl bench server`: speed through a running llama-server instance of one host.

Three measurements, each optional, written to the results store as a ``server-speed`` run:

* **Prompt-length sweep** (``sweep.jsonl``): for each prompt length (tokens, built from shipped
  filler text and checked with the server's ``/tokenize``) a streamed chat request, prompt cache
  off: time to first token (client clock), prefill and decode tokens/s (server timings).
* **Model load time** (``load.jsonl``): ``systemctl restart llama-server@NAME`` until ``/health``
  answers 200, ``load_runs`` times.
* **GPU memory per context size** (``memory.jsonl``): the instance is stopped; for each context
  size a probe server with the instance's own arguments file but ``-c SIZE`` (and a spare port) runs
  as a transient unit, and ``nvidia-smi``'s memory.used is read once it is healthy; the instance is
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

import numpy as np

from rigctl.errors import ConfigError, ServerError
from rigctl.inventory import Host
from rigctl.jobs import rigctl_version
from rigctl.results import ResultsStore, RunRecord, new_run_id, utc_now
from rigctl.server import Endpoint, ServerClient, Timeouts
from rigctl.servers import operator_start, unit_name
from rigctl.ssh import SshClient, session

log = logging.getLogger(__name__)

CONFIG_DIR = "/etc/llama-server"
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


def parse_args_file(text: str) -> list[str]:
    """The llama_server role's arguments file as argv: one flag per line, its value after the first space."""
    argv: list[str] = []
    for line in text.splitlines():
        if not line.strip() or line.startswith("#"):
            continue
        flag, sep, value = line.partition(" ")
        argv += [flag, value] if sep else [flag]
    return argv


def with_flag(argv: Sequence[str], names: Sequence[str], value: str) -> list[str]:
    """``argv`` with the flag ``names[0]`` (any spelling in ``names``) set to ``value``."""
    out = list(argv)
    for i, arg in enumerate(out[:-1]):
        if arg in names:
            out[i + 1] = value
            return out
    return [*out, names[0], value]


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
    servers = {s.name: s for s in host.servers}
    if instance not in servers:
        raise ConfigError(f"host {host.name}: no llama_server instance {instance!r} "
                          f"(instances: {', '.join(servers) or 'none'})")
    say = on_step or (lambda message: None)
    endpoint = Endpoint.from_inventory(host, instance)
    unit = unit_name(instance)
    record = RunRecord(id=new_run_id("server-speed"), kind="server-speed", host=host.name, started=utc_now(),
                       rigctl_version=rigctl_version(), concurrency=1)
    result = ServerBenchResult(host=host.name, instance=instance)
    with session(host) as ssh, ServerClient(endpoint, timeouts=Timeouts(read=900)) as server:
        server.wait_healthy(HEALTH_TIMEOUT_S)
        props = server.props()
        for length in prompt_lengths:
            prompt = filler_prompt(length, lambda text: len(server.tokenize(text)))
            tokens = len(server.tokenize(prompt))
            reply = server.chat_stream([{"role": "user", "content": prompt}], max_tokens=max_tokens,
                                       extra={"cache_prompt": False})
            timings = reply.timings
            point = SweepPoint(tokens, reply.ttft_s or 0.0, timings.prompt_per_second if timings else 0.0,
                               timings.predicted_per_second if timings else 0.0, timings.predicted_n if timings else 0)
            result.sweep.append(point)
            say(f"prompt {tokens} tokens: ttft {point.ttft_s:.3f} s, decode {point.decode_per_s:.2f} tok/s")
        for _ in range(load_runs):
            began = time.monotonic()
            ssh.run(operator_start([unit], "restart"), timeout=300, check=True)
            server.wait_healthy(HEALTH_TIMEOUT_S)
            result.load_s.append(time.monotonic() - began)
            say(f"load (restart to /health 200): {result.load_s[-1]:.2f} s")
        if ctx_sizes:
            port = probe_port or servers[instance].port + 100
            result.memory = _memory_sweep(ssh, host, instance, ctx_sizes, port, say)
            server.wait_healthy(HEALTH_TIMEOUT_S)
            result.kv_bytes_per_token = kv_bytes_per_token(result.memory)
    store = store or ResultsStore()
    run_dir = store.run_dir(host.name, record.id)
    run_dir.mkdir(parents=True, exist_ok=True)
    for name, rows in ((SWEEP_FILE, result.sweep), (MEMORY_FILE, result.memory),
                       (LOAD_FILE, [{"load_s": s} for s in result.load_s])):
        (run_dir / name).write_text("".join(json.dumps(r if isinstance(r, dict) else asdict(r)) + "\n" for r in rows))
    spec = servers[instance]
    record.server = {"name": instance, "profile": spec.profile, "endpoint": endpoint.url,
                     "build_info": props.build_info, "model_path": props.model_path, "n_ctx": props.n_ctx}
    record.artifacts = [{"name": spec.artifact}]
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
def instance_stopped(ssh: SshClient, host: Host, instance: str) -> Iterator[None]:
    """``instance``'s unit stopped (its card and port free for probes); on exit, when it was running
    before, started again and waited for until it answers /health (what follows finds it as it was)."""
    unit = unit_name(instance)
    running = ssh.run(f"systemctl is-active --quiet {shlex.quote(unit)}", timeout=30, check=False).ok
    ssh.run(f"systemctl stop {shlex.quote(unit)}", timeout=300, check=True)
    try:
        yield
    finally:
        if running:
            ssh.run(operator_start([unit]), timeout=300, check=True)
            with ServerClient(Endpoint.from_inventory(host, instance)) as client:
                client.wait_healthy(HEALTH_TIMEOUT_S)


@contextmanager
def probe_server(ssh: SshClient, host: Host, instance: str, flags: Mapping[tuple[str, ...], str], port: int,
                 purpose: str) -> Iterator[Probe]:
    """A probe with ``instance``'s arguments file but ``flags`` (spellings -> value) on ``port``, as the
    transient unit ``rigctl-<purpose>probe-<instance>``, once it is healthy; stopped on exit."""
    argv = parse_args_file(ssh.run(f"cat {CONFIG_DIR}/{shlex.quote(instance)}.args", timeout=30, check=True).stdout)
    for names, value in {**flags, ("--port",): str(port)}.items():
        argv = with_flag(argv, names, value)
    binary = f"{CONFIG_DIR}/{instance}.bin"
    probe = f"rigctl-{purpose.split()[0]}probe-{instance}"
    key = Endpoint.from_inventory(host, instance).api_key
    endpoint = Endpoint(f"http://{host.address}:{port}", api_key=key, label=f"{host.name}/{probe}")
    ssh.run(f"systemd-run --unit {probe} --collect --quiet -p User=llama {shlex.join([binary, *argv])}",
            timeout=60, check=True)
    try:
        try:
            with ServerClient(endpoint) as client:
                client.wait_healthy(HEALTH_TIMEOUT_S)
        except ServerError:
            tail = ssh.run(f"journalctl -u {probe} -n 5 --no-pager", timeout=30, check=False).stdout
            raise ServerError(f"{host.name}/{probe}", purpose, tail.strip().splitlines()[-1] if tail else
                              "not healthy") from None
        yield Probe(probe, endpoint, argv)
    finally:
        ssh.run(f"systemctl stop {probe}", timeout=120, check=False)


def _memory_sweep(ssh: SshClient, host: Host, instance: str, ctx_sizes: Sequence[int], port: int,
                  say: Callable[[str], None]) -> list[MemoryPoint]:
    points = []
    with instance_stopped(ssh, host, instance):
        for size in ctx_sizes:
            with probe_server(ssh, host, instance, {("-c", "--ctx-size"): str(size)}, port, f"ctx {size}"):
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

