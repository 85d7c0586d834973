#!/usr/bin/env python3
"""The reference study's full-size evals through `rigctl eval run` and `rigctl compare`: does the client's
memory and time per question stay flat from the first question to the last?

Runs the CLI itself (`.venv/bin/rigctl eval run` in a subprocess, under a pseudo-terminal so its progress bar
draws as it does for a person): what a user runs, progress bar, answers file and summary included, and the
only way to stop it as Ctrl-C does (SIGINT). While it runs, this script reads the process's RSS
(/proc/<pid>/status) and the answers file's line count every 20 ms, and prints per task:

    RSS @100 / end    the CLI's resident memory when the 100th answer was written and at the last one:
                      the aim is end - @100 <= 50 MB for a 1,319-question GSM8K run
    peak RSS          the process's high-water mark (wait4's ru_maxrss)
    s/q first, last   wall seconds per answer over the first and the last tenth of the answers; their
                      ratio is ~1.0x when the time per question stays flat (and the machine's load does)
    CPU first, last   the CLI's own CPU milliseconds per answer over the same tenths (/proc/<pid>/stat):
                      what the client costs per question; its progress bar redraws ten times a second
                      (`bar` measures that alone, in CPU ms per second), so a slower stretch of answers
                      also costs more CPU each
    CPU ms/q          the CLI's CPU time per question over the whole run, start-up included

Tasks, each at the reference study's full size, made here (only PyPI, Debian and npm are reachable from this
machine, so the real GSM8K test split and suite sets are not):

    gsm8k   1,319 distinct questions made from the eval fixtures' ten (perf/gsm8k_load.py), max_tokens 2
    suite   3,880 questions in 13 classification sets of the fixtures' three shapes (yes/no, three-way NLI,
            toxic or not), scored from next-token probabilities (the choice scorer: /apply-template, then
            one token from /completion with the top 100 probabilities)
    bfcl    BFCL simple (python), its 400 real questions and possible answers, read from the bfcl-eval
            wheel (pinned by sha256; `pip download --no-deps`), max_tokens 8; `--no-bfcl` leaves it out

GSM8K and suite questions differ only at their end, in runs that share their text, so the server's prompt
cache leaves it a few new tokens per question (BFCL's are its own), and generation is cut to a few tokens:
the server's cost per question stays small and constant, and what could grow is the client's. Then a second
GSM8K run is stopped with SIGINT halfway and resumed with `--resume` (each question must be answered exactly
once), and `rigctl compare` pairs the two full GSM8K runs, with its wall time and peak memory.

Server: `--url` takes any llama-server; by default one is started on loopback from the lab's prepared
llama.cpp build (`<cache>/builds/`, checked against the sha256 `rigctl lab prepare` recorded) serving SmolLM2
(`<cache>/models/`, as `make prepare` leaves them), with one thread at nice 10 and 8 slots, and stopped at the
end.

    .venv/bin/python perf/eval_full_size.py [--url URL] [--only gsm8k,suite,bfcl,bar] [--no-bfcl]
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import pty
import signal
import socket
import subprocess
import sys
import tarfile
import tempfile
import threading
import time
import zipfile
from dataclasses import dataclass, field
from pathlib import Path

from gsm8k_load import QUESTIONS, distinct, gsm8k_task

from rigctl.errors import RigctlError
from rigctl.evals.datasets import read_records
from rigctl.files import cache_dir
from rigctl.inventory import Inventory
from rigctl.lab.prepare import Prepared, file_sha256
from rigctl.lab.rigs import Lab
from rigctl.llama_http import Endpoint, ServerClient
from rigctl.results.store import iter_jsonl

REPO = Path(__file__).resolve().parent.parent
RIGCTL = Path(sys.executable).parent / "rigctl"
AIM_FLAT_MB = 50.0
GSM8K_SIZE, SUITE_SIZE, SUITE_SETS, BFCL_SIZE = 1319, 3880, 13, 400
MODEL = "SmolLM2-135M-Instruct.Q4_1.gguf"
BFCL_WHEEL = "bfcl-eval==2026.3.23"
BFCL_WHEEL_SHA256 = "3bb6dfa5f0c68ad403c9ec50b00db2bb3b4cc9b38ab1ff33f48fe30d853d3a0a"
BFCL_FILES = ("bfcl_eval/data/BFCL_v4_simple_python.json", "bfcl_eval/data/possible_answer/BFCL_v4_simple_python.json")
SAMPLE_S = 0.02
TICKS = os.sysconf("SC_CLK_TCK")
GSM8K_MAX_TOKENS, BFCL_MAX_TOKENS = 2, 8


# ----------------------------------------------------------------------------------------------- server


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def loopback_server(workdir: Path) -> tuple[subprocess.Popen, str]:
    """llama-server from the lab's prepared build on 127.0.0.1, serving SmolLM2; (process, URL)."""
    config = Lab.from_inventory(Inventory.load(REPO / "inventory" / "lab")).config
    prepared = Prepared.load(config.image_dir / "prepared.json")
    if prepared is None:
        sys.exit("no lab build prepared: run `make prepare` (or give --url)")
    archive = config.cache_dir / prepared.artifact
    if file_sha256(archive) != prepared.artifact_sha256:
        sys.exit(f"{archive}: sha256 differs from the one `rigctl lab prepare` recorded; not running it")
    model = cache_dir() / "models" / MODEL
    if not model.is_file():
        sys.exit(f"{model} missing: run `make prepare` (or give --url)")
    build = workdir / "build"
    with tarfile.open(archive) as tar:
        tar.extractall(build, filter="data")
    port = free_port()
    log = (workdir / "llama-server.log").open("w")
    server = subprocess.Popen(
        ["nice", "-n", "10", str(build / "bin" / "llama-server"), "-m", str(model), "--host", "127.0.0.1",
         "--port", str(port), "-t", "1", "-tb", "1", "-np", "8", "-c", "8192", "--metrics"],
        stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        if server.poll() is not None:
            sys.exit(f"llama-server exited ({server.returncode}); see {log.name}")
        try:
            with ServerClient(Endpoint(url)) as client:
                client.props()
            return server, url
        except Exception:  # noqa: BLE001 (loading: any failure means not yet)
            time.sleep(0.5)
    server.terminate()
    sys.exit("llama-server not ready after 120 s")


# ----------------------------------------------------------------------------------------------- tasks


def suite_task(workdir: Path, total: int = SUITE_SIZE) -> Path:
    """13 choice sets of the fixtures' three shapes, ``total`` distinct questions in all."""
    # The question's number ends the prompt (instructions first), so the prompt cache keeps all before it.
    shapes = [
        ("boolq.jsonl", "question", "Answer with yes or no.\n{passage}\nQuestion: {question}?", "answer",
         {"true": "yes", "false": "no"}),
        ("nli.jsonl", "text2", "Does the premise entail the hypothesis? Answer with one word: entailment, neutral "
         "or contradiction.\nPremise: {text1}\nHypothesis: {text2}", "label_text",
         {"entailment": "entailment", "neutral": "neutral", "contradiction": "contradiction"}),
        ("toxic.jsonl", "text", "Is this comment toxic? Answer with yes or no.\nComment: {text}", "gold",
         {"true": "yes", "false": "no"}),
    ]
    lines = ["name: suite-full", "scorer: choice", "n_probs: 100", "sets:"]
    for k in range(SUITE_SETS):
        size = total // SUITE_SETS + (k < total % SUITE_SETS)
        source, numbered, prompt, gold, labels = shapes[k % len(shapes)]
        rows = distinct(read_records(QUESTIONS / source), size, numbered, shared_prefix=True)
        data = workdir / f"set{k:02d}.jsonl"
        data.write_text("".join(json.dumps({key: v for key, v in r.items() if key != "id"}) + "\n" for r in rows))
        lines += [f"  - name: set{k:02d}", f"    dataset: {{path: {data.name}}}", f"    prompt: {json.dumps(prompt)}",
                  f"    gold: {gold}", f"    labels: {json.dumps(labels)}"]
    path = workdir / "suite-full.yaml"
    path.write_text("\n".join(lines) + "\n")
    return path


def bfcl_task(workdir: Path, wheel: Path | None, limit: int = BFCL_SIZE) -> Path:
    """BFCL simple (python) from the bfcl-eval wheel: its 400 questions and possible answers as they are."""
    if wheel is None:
        subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", BFCL_WHEEL, "-d", str(workdir)],
                       check=True, timeout=300)
        wheel = next(workdir.glob("bfcl_eval-*.whl"))
    digest = hashlib.sha256(wheel.read_bytes()).hexdigest()
    if digest != BFCL_WHEEL_SHA256:
        sys.exit(f"{wheel}: sha256 {digest}, expected {BFCL_WHEEL_SHA256} ({BFCL_WHEEL})")
    names = []
    with zipfile.ZipFile(wheel) as archive:
        for member, name in zip(BFCL_FILES, ("questions.json", "answers.json"), strict=True):
            (workdir / name).write_bytes(archive.read(member))
            names.append(name)
    path = workdir / "bfcl-full.yaml"
    path.write_text(
        f"name: bfcl-full\nscorer: bfcl_simple\ndataset: {{path: {names[0]}}}\nanswers: {{path: {names[1]}}}\n"
        f"max_tokens: {BFCL_MAX_TOKENS}\ndeviation: a client-cost benchmark; generation is cut short\n"
        f"allow_template_without_tools: true\nlimit: {limit}\n")
    return path


# ----------------------------------------------------------------------------------------------- watching


@dataclass
class Watch:
    """One CLI run: (seconds since start, answers, RSS MB) samples, its exit, peak RSS and CPU."""

    samples: list[tuple[float, int, float]] = field(default_factory=list)
    #: answers -> when that many were first seen written: (wall s, RSS MB, CPU s of the process)
    at_answer: dict[int, tuple[float, float, float]] = field(default_factory=dict)
    code: int | None = None
    peak_mb: float = 0.0
    cpu_s: float = 0.0
    wall_s: float = 0.0
    output: str = ""
    run_dir: Path | None = None


def rss_mb(pid: int) -> float | None:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    except OSError:
        return None
    return None


def cpu_s(pid: int) -> float | None:
    """User + system CPU seconds of ``pid`` so far (/proc/<pid>/stat)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None
    return (int(fields[11]) + int(fields[12])) / TICKS


def new_run(results: Path, known: set[Path]) -> Path | None:
    found = [p for p in results.glob("*/*") if p.is_dir() and p not in known]
    return found[0] if found else None


@dataclass
class OnPty:
    """A process whose stdout and stderr are a pseudo-terminal, drained by a thread as a terminal would."""

    proc: subprocess.Popen
    master: int
    chunks: list[bytes]
    reader: threading.Thread

    @classmethod
    def start(cls, argv: list[str], env: dict[str, str]) -> OnPty:
        master, slave = pty.openpty()
        proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=slave, stderr=slave,
                                env={**env, "COLUMNS": "120"})
        os.close(slave)
        chunks: list[bytes] = []

        def drain() -> None:
            while True:
                try:
                    data = os.read(master, 65536)
                except OSError:
                    return
                if not data:
                    return
                chunks.append(data)

        reader = threading.Thread(target=drain, daemon=True)
        reader.start()
        return cls(proc, master, chunks, reader)

    def output(self) -> str:
        self.reader.join(timeout=2)
        os.close(self.master)
        return b"".join(self.chunks).decode("utf-8", "replace")


def bar_cpu_per_second(workdir: Path, seconds: float = 20.0) -> float:
    """CPU ms per wall second of the CLI's progress bar alone (``rigctl.cli.eval``'s, drawn on a pseudo-terminal,
    no answers coming): the part of the CLI's CPU per answer that follows the wall time, not the answers."""
    out = workdir / "bar-cpu.txt"
    code = ("import resource, sys, time\nfrom rigctl.cli.eval import _Bar\n"
            f"bar = _Bar({GSM8K_SIZE}, 0)\nbefore = resource.getrusage(resource.RUSAGE_SELF)\n"
            f"with bar.progress:\n    time.sleep({seconds})\n"
            "after = resource.getrusage(resource.RUSAGE_SELF)\n"
            "used = after.ru_utime + after.ru_stime - before.ru_utime - before.ru_stime\n"
            f"open(sys.argv[1], 'w').write(str(1000 * used / {seconds}))\n")
    probe = OnPty.start([sys.executable, "-c", code, str(out)], dict(os.environ))
    probe.proc.wait(timeout=seconds + 60)
    probe.output()
    return float(out.read_text())


def cli(args: list[str], results: Path, *, stop_at: int | None = None) -> Watch:
    """Run `rigctl ARGS` under a pseudo-terminal, sampling it; SIGINT once ``stop_at`` answers are written."""
    known = set(results.glob("*/*"))
    watch = Watch()
    started = time.monotonic()
    running = OnPty.start([str(RIGCTL), *args], {**os.environ, "RIGCTL_RESULTS": str(results)})
    proc = running.proc
    offset, count, signalled, rss, cpu = 0, 0, False, 0.0, 0.0

    def read_answers() -> None:
        nonlocal offset, count
        if watch.run_dir is None:
            watch.run_dir = new_run(results, known)
        answers = watch.run_dir / "answers.jsonl" if watch.run_dir else None
        if answers is not None and answers.is_file():
            with answers.open("rb") as handle:
                handle.seek(offset)
                data = handle.read()
            offset += len(data)
            count += data.count(b"\n")

    while True:
        # wait4, not Popen.poll: it reaps the process with its own peak RSS and CPU time.
        pid, wait_status, usage = os.wait4(proc.pid, os.WNOHANG)
        if pid:
            break
        read_answers()
        now, rss, cpu = time.monotonic() - started, rss_mb(proc.pid) or rss, cpu_s(proc.pid) or cpu
        watch.samples.append((now, count, rss))
        watch.at_answer.setdefault(count, (now, rss, cpu))
        if stop_at is not None and count >= stop_at and not signalled:
            proc.send_signal(signal.SIGINT)
            signalled = True
        time.sleep(SAMPLE_S)
    watch.wall_s = time.monotonic() - started
    read_answers()  # the last answers, when the process wrote them and exited between two samples
    watch.at_answer.setdefault(count, (watch.wall_s, rss, cpu))
    proc.returncode = watch.code = os.waitstatus_to_exitcode(wait_status)
    watch.peak_mb, watch.cpu_s = usage.ru_maxrss / 1024, usage.ru_utime + usage.ru_stime
    watch.output = running.output()
    return watch


# ----------------------------------------------------------------------------------------------- figures


def answered_at(watch: Watch, n: int) -> tuple[float, float, float]:
    """(wall s, RSS MB, CPU s) when the n-th answer was first seen written."""
    return next(watch.at_answer[k] for k in sorted(watch.at_answer) if k >= n)


def per_question(watch: Watch, first: int, last: int) -> tuple[float, float]:
    """(wall s, CPU ms) per answer from the ``first``-th answer to the ``last``-th."""
    (t0, _, c0), (t1, _, c1) = answered_at(watch, first), answered_at(watch, last)
    return (t1 - t0) / (last - first), 1000 * (c1 - c0) / (last - first)


@dataclass
class Figures:
    task: str
    questions: int
    rss_100: float
    rss_end: float
    peak: float
    first_tenth: float
    last_tenth: float
    cpu_first: float  # the CLI's CPU ms per answer over the first tenth: its own cost, whatever the load
    cpu_last: float
    cpu_ms: float
    wall: float

    @property
    def growth(self) -> float:
        return self.rss_end - self.rss_100

    @property
    def ratio(self) -> float:
        return self.last_tenth / self.first_tenth

    @property
    def cpu_ratio(self) -> float:
        return self.cpu_last / self.cpu_first


def figures(task: str, watch: Watch, n: int) -> Figures:
    tenth = max(2, n // 10)
    (wall_first, cpu_first), (wall_last, cpu_last) = per_question(watch, 1, tenth), per_question(watch, n - tenth, n)
    return Figures(task, n, answered_at(watch, 100)[1], answered_at(watch, n)[1], watch.peak_mb, wall_first,
                   wall_last, cpu_first, cpu_last, 1000 * watch.cpu_s / n, watch.wall_s)


def check_once(run_dir: Path, n: int) -> tuple[int, int]:
    """(answers, distinct (set, id)) of a run: equal to n each when every question was answered once."""
    keys = [(r["set"], r["id"]) for r in iter_jsonl(run_dir / "answers.jsonl")]
    return len(keys), len(set(keys))


def status(run_dir: Path) -> str:
    return json.loads((run_dir / "run.json").read_text())["status"]


def eval_run(task: Path, url: str, results: Path, n: int, *, stop_at: int | None = None) -> Watch:
    watch = cli(["eval", "run", "--task", str(task), "--url", url, "--concurrency", "8", "--results", str(results)],
                results, stop_at=stop_at)
    if stop_at is None and (watch.code != 0 or watch.run_dir is None or status(watch.run_dir) != "done"):
        sys.exit(f"eval run of {task.name} failed ({watch.code}):\n{watch.output[-3000:]}")
    if watch.run_dir is not None and stop_at is None:
        answers, distinct_keys = check_once(watch.run_dir, n)
        if answers != n or distinct_keys != n:
            sys.exit(f"{watch.run_dir}: {answers} answers, {distinct_keys} distinct, for {n} questions")
    return watch


HEADER = (f"{'task':12}{'questions':>10}{'RSS@100':>9}{'RSS end':>9}{'growth':>8}{'peak':>7}{'s/q first':>11}"
          f"{'s/q last':>10}{'ratio':>7}{'CPU first':>11}{'CPU last':>10}{'ratio':>7}{'CPU ms/q':>10}{'wall s':>8}")


def show(f: Figures) -> None:
    print(f"{f.task:12}{f.questions:>10}{f.rss_100:>9.1f}{f.rss_end:>9.1f}{f.growth:>+8.1f}{f.peak:>7.0f}"
          f"{f.first_tenth:>11.4f}{f.last_tenth:>10.4f}{f.ratio:>6.2f}x{f.cpu_first:>11.2f}{f.cpu_last:>10.2f}"
          f"{f.cpu_ratio:>6.2f}x{f.cpu_ms:>10.2f}{f.wall:>8.0f}", flush=True)


class Measured(list):
    """The rows measured so far, each printed as it comes."""

    def append(self, f: Figures) -> None:
        if not self:
            print(HEADER, flush=True)
        super().append(f)
        show(f)


def full_size(args: argparse.Namespace, only: set[str], url: str | None, work: Path) -> Figures | None:
    """Everything in ``only``, each row printed as it is measured; the GSM8K figures, when run."""
    n_gsm8k, n_suite, n_bfcl = (max(110, round(n * args.scale)) for n in (GSM8K_SIZE, SUITE_SIZE, BFCL_SIZE))
    print(f"machine     {os.cpu_count()} cores, load average {os.getloadavg()[0]:.1f} at the start")
    if url is not None:
        with ServerClient(Endpoint(url)) as client:
            props = client.props()
        print(f"server      {url} ({props.build_info}, {props.total_slots} slots, {Path(props.model_path).name})")
        print("(RSS and peak in MB; wall s and the CLI's CPU ms per answer over the first and the last tenth of "
              "the\n answers; CPU ms/q over the whole run, start-up included)")
    results = work / "results"
    results.mkdir()
    gsm8k = None
    measured = Measured()
    if "gsm8k" in only:
        task = gsm8k_task(work, "gsm8k-full", n_gsm8k, GSM8K_MAX_TOKENS, shared_prefix=True).path
        full = eval_run(task, url, results, n_gsm8k)
        gsm8k = figures("GSM8K", full, n_gsm8k)
        measured.append(gsm8k)
        half = n_gsm8k // 2
        stopped = eval_run(task, url, results, n_gsm8k, stop_at=half)
        assert stopped.run_dir is not None and full.run_dir is not None
        before, _ = check_once(stopped.run_dir, n_gsm8k)
        ref = f"{stopped.run_dir.parent.name}/{stopped.run_dir.name}"
        resumed = cli(["eval", "run", "--resume", ref, "--results", str(results)], results)
        answers, distinct_keys = check_once(stopped.run_dir, n_gsm8k)
        once = answers == distinct_keys == n_gsm8k and resumed.code == 0 and status(stopped.run_dir) == "done"
        print(f"SIGINT at {half} answers: exit {stopped.code}, {before} answers kept, run stopped; --resume: exit "
              f"{resumed.code}, {answers} answers, {distinct_keys} distinct of {n_gsm8k}: "
              f"{'each once' if once else 'NOT each once'}", flush=True)
        full_ref = f"{full.run_dir.parent.name}/{full.run_dir.name}"
        compared = cli(["compare", full_ref, ref, "--results", str(results)], results)
        if compared.code != 0:
            sys.exit(f"compare failed:\n{compared.output[-3000:]}")
        print(f"compare of the two {n_gsm8k}-question runs: {compared.wall_s:.1f} s, peak RSS "
              f"{compared.peak_mb:.0f} MB", flush=True)
    if "suite" in only:
        measured.append(figures("suite", eval_run(suite_task(work, n_suite), url, results, n_suite), n_suite))
    if "bfcl" in only:
        bfcl_dir = work / "bfcl"
        bfcl_dir.mkdir()
        bfcl = bfcl_task(bfcl_dir, args.bfcl_wheel, n_bfcl)
        measured.append(figures("BFCL simple", eval_run(bfcl, url, results, n_bfcl), n_bfcl))
    if "bar" in only:
        bar = bar_cpu_per_second(work)
        # Its redraws (10 a second) make the CLI's CPU per answer follow the wall time per answer.
        print(f"progress bar alone: {bar:.1f} ms CPU per second", flush=True)
    return gsm8k


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--url", help="llama-server base URL (default: one started here on loopback)")
    parser.add_argument("--only", default="gsm8k,suite,bfcl,bar",
                        help="what to run, comma-separated (bar: the progress bar's own CPU, no server)")
    parser.add_argument("--no-bfcl", action="store_true", help="leave BFCL out (no wheel download)")
    parser.add_argument("--bfcl-wheel", type=Path, help="a downloaded bfcl-eval wheel (default: pip download)")
    parser.add_argument("--scale", type=float, default=1.0, help="a fraction of the full sizes, to try the script")
    args = parser.parse_args()
    only = {t for t in args.only.split(",") if t} - ({"bfcl"} if args.no_bfcl else set())
    with tempfile.TemporaryDirectory(prefix="eval-full-size-") as tmp:
        work = Path(tmp)
        server, url = None, args.url
        if url is None and only & {"gsm8k", "suite", "bfcl"}:
            server, url = loopback_server(work)
        try:
            gsm8k = full_size(args, only, url, work)
        except RigctlError as exc:
            sys.exit(f"error: {exc}")
        finally:
            if server is not None:
                server.terminate()
                server.wait(timeout=30)
    print(f"machine     load average {os.getloadavg()[0]:.1f} at the end")
    if gsm8k is not None:
        met = gsm8k.growth <= AIM_FLAT_MB
        print(f"aim: GSM8K memory flat within {AIM_FLAT_MB:.0f} MB from question 100 to {gsm8k.questions}: "
              f"{gsm8k.growth:+.1f} MB, {'met' if met else 'MISSED'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
