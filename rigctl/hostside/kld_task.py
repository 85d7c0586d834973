"""The task of a KLD job, run on the host by :mod:`rigctl.hostside.jobrun`. Stdlib only.

Quantised models against their reference over one fixed text, with llama.cpp's own instrument
(``llama-perplexity``, :mod:`rigctl.hostside.kld` says how it computes), three passes per model after one for
the reference:

1. the reference: ``llama-perplexity -m REF -f TEXT -c CTX --kl-divergence-base .reference.logits`` writes
   every scored position's log-probabilities (and prints the reference's perplexity);
2. each quantised model: ``--kl-divergence`` against that file: llama.cpp's statistics, which the record
   carries as printed (mean KLD and its standard error, the 99th percentile, same top p);
3. the same model writing a logits file of its own into a FIFO, read here beside the reference's as it comes:
   the per-token KLD and top-1 agreement (``kld/<model>.tokens.jsonl``) that the controller's intervals
   resample, and their summary beside llama.cpp's (``extra.kld.models[m].recomputed``, ``difference``).

The reference's file is the one large thing written: ``n_chunk * (CTX - 1 - CTX/2) * (n_vocab + 4) * 2``
bytes (:func:`rigctl.hostside.kld.logits_file_bytes`). Before the first pass that bound is computed from the
reference's vocabulary and the text's size (a token is at least one byte), and the run is refused when it
exceeds ``max_logits_bytes`` or the free space of the run directory's file system; the file is hidden from the
record (a dot name), never pulled, and deleted however the job ends.

Raw files (``kld/``): ``reference.txt``/``.log`` (pass 1's stdout and stderr), ``<model>.txt``/``.log``
(pass 2's: the statistics), ``<model>.ppl.txt``/``.ppl.log`` (pass 3's), ``<model>.tokens.jsonl`` (one line
per chunk: ``chunk``, and per scored token ``kld``, ``same_top`` 0/1, ``nll``, ``nll_base``).

Params (from :func:`rigctl.evals.kld.kld_job_spec`): ``llama_perplexity`` (binary), ``reference`` {name,
path}, ``models`` [{name, path}], ``corpus`` {file (shipped into the job directory), name, sha256, bytes},
``ctx``, ``chunks`` (null: all the text has), ``batch``, ``threads``, ``ngl`` (null each: llama.cpp's
default), ``max_logits_bytes``, ``pass_timeout_s``.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import re
import select
import shutil
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from rigctl.hostside import gguf, kld

RAW_DIR = "kld"
REFERENCE_LOGITS = ".reference.logits"
FIFO = ".quantised.logits"
#: Free space kept beside the reference's logits file (the raw files, the record).
SPARE_BYTES = 64 << 20
#: How long the FIFO waits for llama-perplexity to open it (loading a model from a cold disk).
OPEN_TIMEOUT_S = 600.0
_PPL_FINAL = re.compile(r"Final estimate: PPL = (?P<ppl>[\d.]+) \+/- (?P<se>[\d.]+)")
#: llama.cpp's log lines: ``<time> <level> <text>``; an error's level is E.
_LOGGED_ERROR = re.compile(r"^\s*[\d.]+ E (?P<text>.+)$")
_PLAIN_ERROR = re.compile(r"(?:failed|error|unable)\b.*", re.IGNORECASE)


def vocab_size(path: str, error: type[Exception]) -> int:
    """The model's vocabulary size (its token list's length in the GGUF header)."""
    try:
        tokens = gguf.read_header(path, tensors=False)["meta"].get("tokenizer.ggml.tokens")
    except gguf.GGUFError as exc:
        raise error(f"{path}: {exc}") from None
    count = tokens.get("length") if isinstance(tokens, dict) else len(tokens) if isinstance(tokens, list) else None
    if not isinstance(count, int) or count < 1:
        raise error(f"{path}: no tokenizer.ggml.tokens in its GGUF header")
    return count


def common_argv(p: dict[str, Any], model: str) -> list[str]:
    argv = [p["llama_perplexity"], "-m", model, "-c", str(p["ctx"])]
    for key, flag in (("batch", "-b"), ("threads", "-t"), ("ngl", "-ngl")):
        if p.get(key) is not None:
            argv += [flag, str(p[key])]
    return argv


def text_argv(p: dict[str, Any], corpus: Path) -> list[str]:
    """The text and how much of it: what the passes that tokenize it (1 and 3) must agree on."""
    return ["-f", str(corpus), *(["--chunks", str(p["chunks"])] if p.get("chunks") else [])]


def last_error(log: Path) -> str:
    """The last line of llama.cpp's log that says what went wrong (it exits 0 after some failures)."""
    try:
        lines = log.read_text(errors="replace").splitlines()
    except OSError:
        return ""
    for line in reversed(lines):
        match = _LOGGED_ERROR.match(line) or _PLAIN_ERROR.search(line)
        if match:
            return (match.groupdict().get("text") or match[0]).strip()[:300]
    return lines[-1].strip()[:300] if lines else ""


def bound_or_refuse(job: Any, p: dict[str, Any], corpus: Path, n_vocab: int) -> dict[str, int]:
    """The reference logits file's largest size for this text and these settings, checked against the
    job's limit and the run directory's free space."""
    n_ctx = int(p["ctx"])
    most_chunks = (corpus.stat().st_size + 1) // n_ctx  # a token is at least one byte (BOS aside)
    n_chunk = min(most_chunks, int(p["chunks"])) if p.get("chunks") else most_chunks
    if n_chunk < 1:
        raise job.TaskError(f"the text ({corpus.stat().st_size} bytes) is shorter than one chunk of {n_ctx} tokens")
    bound = kld.logits_file_bytes(n_ctx, n_vocab, n_chunk)
    limit = int(p["max_logits_bytes"])
    if bound > limit:
        raise job.TaskError(f"the reference's logits for up to {n_chunk} chunks of {n_ctx} tokens over a "
                            f"{n_vocab}-token vocabulary could take {bound / 2**30:.2f} GiB, over the limit of "
                            f"{limit / 2**30:.2f} GiB (fewer chunks, or a higher limit)")
    free = shutil.disk_usage(job.run_dir).free
    if bound + SPARE_BYTES > free:
        raise job.TaskError(f"the reference's logits could take {bound / 2**30:.2f} GiB but {job.run_dir}'s "
                            f"file system has {free / 2**30:.2f} GiB free")
    return {"chunks_at_most": n_chunk, "bytes_at_most": bound}


def open_fifo(path: Path, proc: Any) -> Any:
    """The FIFO's read end once ``proc`` has opened its write end; LogitsFileError when it exits first (a model
    that does not load never opens it)."""
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
    try:
        poller = select.poll()
        poller.register(fd, select.POLLIN | select.POLLHUP)
        deadline = time.monotonic() + OPEN_TIMEOUT_S
        while not poller.poll(500):
            if proc.poll() is not None:
                raise kld.LogitsFileError(f"llama-perplexity exited {proc.returncode} before writing its logits")
            if time.monotonic() > deadline:
                raise kld.LogitsFileError(f"llama-perplexity did not start writing its logits within "
                                          f"{OPEN_TIMEOUT_S:g} s")
        os.set_blocking(fd, True)
        return os.fdopen(fd, "rb", buffering=1 << 20)
    except BaseException:
        os.close(fd)
        raise


def token_pass(job: Any, p: dict[str, Any], model: dict[str, str], corpus: Path, raw: Path,
               progress: Callable[[str], None]) -> dict[str, Any]:
    """Pass 3: the model's logits through a FIFO beside the reference's; per-token values to
    ``<model>.tokens.jsonl``; their summary and the token stream's hash."""
    fifo = job.run_dir / FIFO
    fifo.unlink(missing_ok=True)
    os.mkfifo(fifo, 0o600)
    name = model["name"]
    log = raw / f"{name}.ppl.log"
    kld_values: list[float] = []
    same_top: list[int] = []
    argv = [*common_argv(p, model["path"]), *text_argv(p, corpus), "--kl-divergence-base", str(fifo)]
    try:
        with job.spawn(argv, stdout=raw / f"{name}.ppl.txt", stderr=log) as proc, \
                open(job.run_dir / REFERENCE_LOGITS, "rb", buffering=1 << 20) as reference, \
                open_fifo(fifo, proc) as quantised, open(raw / f"{name}.tokens.jsonl", "w") as out:
            header, chunks = kld.paired_chunks(reference, quantised, f"{name}'s logits")
            for chunk, values in chunks:
                progress(f"{name}: per-token values, chunk {chunk + 1}/{header.n_chunk}")
                row = {"chunk": chunk, "kld": [v.kld for v in values], "same_top": [int(v.same_top) for v in values],
                       "nll": [v.nll for v in values], "nll_base": [v.nll_base for v in values]}
                out.write(json.dumps(row) + "\n")
                kld_values += row["kld"]
                same_top += row["same_top"]
            if proc.wait() != 0:
                raise job.TaskError(f"{name}: llama-perplexity exited {proc.returncode}: {last_error(log)}")
    except kld.LogitsFileError as exc:
        raise job.TaskError(f"{name}: {exc}; llama-perplexity: {last_error(log)}") from None
    finally:
        fifo.unlink(missing_ok=True)
    return {"summary": kld.summarise(kld_values, same_top),
            "tokens_sha256": hashlib.sha256(header.tokens.tobytes()).hexdigest(), "n_vocab": header.n_vocab,
            "n_chunk": header.n_chunk}


def run(job: Any) -> None:
    p = job.params
    reference, models = p["reference"], p["models"]
    corpus = job.dir / p["corpus"]["file"]
    raw = job.run_dir / RAW_DIR
    raw.mkdir(parents=True, exist_ok=True)
    passes = 1 + 3 * len(models)
    timeout = float(p.get("pass_timeout_s", 3600))
    job.progress(0, passes, "hashing the model files")
    job.record.artifacts = [job.artifact(reference["name"], reference["path"]),
                               *(job.artifact(m["name"], m["path"]) for m in models)]
    n_vocab = vocab_size(reference["path"], job.TaskError)
    for model in models:
        theirs = vocab_size(model["path"], job.TaskError)
        if theirs != n_vocab:
            raise job.TaskError(f"{model['name']} has another vocabulary than {reference['name']} "
                                f"({theirs} vs {n_vocab} tokens): no KLD between them")
    settings = {key: p.get(key) for key in ("ctx", "chunks", "batch", "threads", "ngl")}
    result: dict[str, Any] = {"reference": reference["name"], "corpus": {k: v for k, v in p["corpus"].items()
                                                                          if k != "file"},
                              **settings, "n_vocab": n_vocab, "scored_per_chunk": kld.scored_per_chunk(int(p["ctx"])),
                              "logits": bound_or_refuse(job, p, corpus, n_vocab), "models": {}}
    job.record.matrix = settings
    job.record.extra["kld"] = result
    job.save_record()
    logits = job.run_dir / REFERENCE_LOGITS
    try:
        job.progress(0, passes, f"{reference['name']}: the reference's log-probabilities")
        done = job.run([*common_argv(p, reference["path"]), *text_argv(p, corpus), "--kl-divergence-base",
                        str(logits)], timeout=timeout, stdout=raw / "reference.txt", stderr=raw / "reference.log")
        final = _PPL_FINAL.search((raw / "reference.log").read_text(errors="replace"))
        if done.returncode != 0 or final is None or not logits.is_file():
            raise job.TaskError(f"{reference['name']}: llama-perplexity exited {done.returncode} without the "
                                f"reference's logits: {last_error(raw / 'reference.log')}")
        result["reference_ppl"] = {"value": float(final["ppl"]), "uncertainty": float(final["se"])}
        result["logits"]["bytes"] = logits.stat().st_size
        job.save_record()
        for index, model in enumerate(models):
            name = model["name"]
            job.progress(1 + 3 * index, passes, f"{name}: llama-perplexity --kl-divergence")
            done = job.run([*common_argv(p, model["path"]), "--kl-divergence-base", str(logits), "--kl-divergence"],
                           timeout=timeout, stdout=raw / f"{name}.txt", stderr=raw / f"{name}.log")
            try:
                printed = kld.parse_output((raw / f"{name}.txt").read_text(errors="replace"))
            except ValueError as exc:
                raise job.TaskError(f"{name}: {exc}; llama-perplexity exited {done.returncode}: "
                                    f"{last_error(raw / f'{name}.log')}") from None
            step = 2 + 3 * index
            job.progress(step, passes, f"{name}: per-token values")
            tokens = token_pass(job, p, model, corpus, raw,
                                lambda message, step=step: job.progress(step, passes, message))
            mine, theirs = tokens["summary"], kld.headline(printed)
            result["tokens"] = mine["tokens"]
            result["chunks_scored"] = tokens["n_chunk"]
            result["tokens_sha256"] = tokens["tokens_sha256"]
            result["models"][name] = {
                "llama_perplexity": theirs, "recomputed": mine,
                "difference": {key: mine[key] - theirs[key] for key in ("kld_mean", "kld_p99", "same_top")},
            }
            job.save_record()
            job.progress(3 + 3 * index, passes, f"{name}: mean KLD {theirs['kld_mean']:.6f}, "
                                                f"same top {100 * theirs['same_top']:.2f} %")
    finally:
        with contextlib.suppress(OSError):
            logits.unlink()
