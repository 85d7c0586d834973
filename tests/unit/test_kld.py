"""KL divergence: llama-perplexity's output parsed (captured from the lab's b11434 build), its statistics
recomputed with numpy, the host-side per-token computation against an independent numpy one over logits files
written as llama.cpp writes them, the chunk bootstrap, and what a pulled run says.

The captured files (tests/unit/data/kld/) come from the lab build's llama-perplexity (b11434, portable CPU
build), SmolLM2-135M-Instruct bf16 (converted from the HF checkout tests/fixtures/make_hf_checkout.py makes)
against the Q4_0 rounded from it, over tests/fixtures/corpus/apache-2.0.txt at ``-c 128 -t 2``:
``smollm2-q4_0.kld.txt`` is ``--kl-divergence``'s stdout, ``smollm2-q4_0.tokens.jsonl`` the KLD job's
per-token values of the same run; ``few-tokens.kld.txt`` is one chunk of 63 tokens (no statistics),
``missing-base.kld.log`` the log of a run whose base file does not exist (llama-perplexity exits 0).
"""

from __future__ import annotations

import io
import json
import math
import os
import shutil
import struct
import subprocess
from pathlib import Path

import numpy as np
import pytest
import yaml

from rigctl.analysis.kld import kld_gap, kld_results, load_tokens, result_cells
from rigctl.errors import ConfigError, TrustError
from rigctl.evals.kld import corpus_identity, kld_job_spec, parse_spec
from rigctl.hostside import kld
from rigctl.hostside.kld_task import bound_or_refuse, last_error, open_fifo
from rigctl.results.record import Artifact, Provenance, RunRecord
from rigctl.results.store import ResultsStore
from rigctl.stats import bootstrap_clusters

DATA = Path(__file__).parent / "data" / "kld"
CORPUS = Path(__file__).parents[1] / "fixtures" / "corpus" / "apache-2.0.txt"


def _tokens() -> list[dict]:
    return [json.loads(line) for line in (DATA / "smollm2-q4_0.tokens.jsonl").read_text().splitlines()]


# ----------------------------------------------------------------------------------------------- the parser


def test_the_parser_reads_llama_perplexitys_own_output():
    parsed = kld.parse_output((DATA / "smollm2-q4_0.kld.txt").read_text())
    assert kld.headline(parsed) == {"kld_mean": 0.484414, "kld_mean_se": 0.019454, "kld_p99": 3.048019,
                                    "same_top": pytest.approx(0.63959), "same_top_se": pytest.approx(0.01468),
                                    "ppl_ratio": 1.40999}
    assert [c["chunk"] for c in parsed["chunks"]] == list(range(1, 18))
    # The running table's last row is the whole run.
    assert parsed["chunks"][-1]["kld"][0] == pytest.approx(0.48441, abs=1e-5)
    kl_section = parsed["statistics"]["KL divergence statistics"]
    assert kl_section["Maximum KLD"] == {"value": 7.9531, "uncertainty": None, "percent": False}
    assert kl_section["Median KLD"]["value"] == 0.315187
    probability = parsed["statistics"]["Token probability statistics"]
    assert probability["Same top p"] == {"value": 63.959, "uncertainty": 1.468, "percent": True}
    assert probability["RMS Δp"]["percent"] and probability["Mean Δp"]["uncertainty"] == 0.52


def test_a_run_without_statistics_is_an_error_not_a_number():
    # One chunk of 63 tokens: llama-perplexity prints its table, then nothing (it needs 100), and exits 0.
    with pytest.raises(ValueError, match=r"no 'Mean KLD' statistic .*1 chunks scored, but fewer than 100"):
        kld.parse_output((DATA / "few-tokens.kld.txt").read_text())
    with pytest.raises(ValueError, match="no chunk scored"):
        kld.parse_output("")
    table = (DATA / "smollm2-q4_0.kld.txt").read_text().replace("\n   2  ", "\n   5  ")
    with pytest.raises(ValueError, match="not numbered"):
        kld.parse_output(table)


def test_the_last_error_of_a_log_names_what_went_wrong(tmp_path):
    assert last_error(DATA / "missing-base.kld.log") == "kl_divergence: failed to open /nonexistent"
    assert last_error(tmp_path / "absent.log") == ""


def test_the_reference_perplexity_line_is_in_its_log():
    from rigctl.hostside.kld_task import _PPL_FINAL

    match = _PPL_FINAL.search((DATA / "smollm2-bf16.reference.log").read_text())
    assert match and float(match["ppl"]) == 16.4898 and float(match["se"]) == 1.43814


# ----------------------------------------------------------------------------------------------- recomputed


def test_numpy_recomputes_llama_cpps_statistics_from_the_per_token_values():
    """llama.cpp's mean (with its standard error), percentiles, median, maximum and same-top share, computed
    independently with numpy from the job's per-token values, against what llama-perplexity printed."""
    rows = _tokens()
    values = np.concatenate([np.asarray(r["kld"], dtype=np.float64) for r in rows])
    same = np.concatenate([np.asarray(r["same_top"]) for r in rows])
    printed = kld.parse_output((DATA / "smollm2-q4_0.kld.txt").read_text())["statistics"]
    kl = printed["KL divergence statistics"]
    assert values.size == 17 * 63 == 1071
    assert values.mean() == pytest.approx(kl["Mean KLD"]["value"], abs=5e-4)
    se = math.sqrt((np.mean(values**2) - values.mean() ** 2) / (values.size - 1))
    assert se == pytest.approx(kl["Mean KLD"]["uncertainty"], abs=1e-4)
    assert np.median(values) == pytest.approx(kl["Median KLD"]["value"], abs=1e-3)
    for label, q in (("90.0% KLD", 90), ("95.0% KLD", 95), ("10.0% KLD", 10), ("1.0% KLD", 1)):
        assert np.percentile(values, q) == pytest.approx(kl[label]["value"], rel=2e-3, abs=1e-4), label
    # The tail is where the quantised side's floor (16 nats below its top) shows: within half a percent.
    assert np.percentile(values, 99) == pytest.approx(kl["99.0% KLD"]["value"], rel=5e-3)
    assert values.max() == pytest.approx(kl["Maximum KLD"]["value"], rel=5e-3)
    assert 100 * same.mean() == pytest.approx(printed["Token probability statistics"]["Same top p"]["value"],
                                              abs=1e-3)
    # The host-side summary is numpy's, to the last digit.
    mine = kld.summarise(list(values), list(same))
    assert mine["kld_mean"] == pytest.approx(values.mean(), rel=1e-12)
    assert mine["kld_p99"] == pytest.approx(np.percentile(values, 99), rel=1e-12)
    assert mine["kld_median"] == pytest.approx(np.median(values), rel=1e-12)
    assert mine["kld_mean_se"] == pytest.approx(se, rel=1e-9)


def _write_logits(path: Path, logits: np.ndarray, tokens: np.ndarray, n_ctx: int) -> None:
    """A logits file as llama-perplexity's ``log_softmax(..., uint16_t * log_prob, ...)`` writes it, in numpy:
    per row, log-probabilities within 16 of the top stored as uint16 steps of (max - min) / 65535."""
    chunks, scored, n_vocab = logits.shape
    nv = 2 * ((n_vocab + 1) // 2) + 4
    with path.open("wb") as out:
        out.write(b"_logits_" + struct.pack("<Iii", n_ctx, n_vocab, chunks) + tokens.astype("<i4").tobytes())
        for row in logits.reshape(-1, n_vocab).astype(np.float32):
            top = row.max()
            floor = max(row.min(), top - np.float32(16))
            log_sum = np.float32(np.log(np.exp(row - top, dtype=np.float64).sum()))
            scale = np.float32((top - floor) / np.float32(65535))
            stored = np.zeros(nv, dtype="<u2")
            head = np.array([scale, floor - top - log_sum], dtype="<f4")
            stored[:4] = np.frombuffer(head.tobytes() + b"\0" * 8, dtype="<u2")[:4]
            q = np.where(row > floor, np.rint((row - floor) / scale), 0) if scale else np.zeros(n_vocab)
            stored[4:4 + n_vocab] = q.astype("<u2")
            out.write(stored.tobytes())


def test_the_host_side_values_agree_with_numpy_from_the_float_logits(tmp_path):
    """Logits files written as llama.cpp writes them; llama.cpp's formula applied in numpy to the reference's
    stored log-probabilities and the quantised side's *float* logits (what llama-perplexity has), against the
    host-side stdlib path, which sees only the quantised side's stored values."""
    rng = np.random.default_rng(7)
    n_ctx, chunks, n_vocab = 16, 6, 3001  # odd: the row is padded
    scored = n_ctx - 1 - n_ctx // 2
    tokens = rng.integers(0, n_vocab, size=chunks * n_ctx)
    base = (rng.standard_normal((chunks, scored, n_vocab)) * 4).astype(np.float32)
    base[:, :, 0] -= 30  # a token far below every floor
    quant = (base + rng.standard_normal(base.shape).astype(np.float32) * 0.3).astype(np.float32)
    _write_logits(tmp_path / "ref", base, tokens, n_ctx)
    _write_logits(tmp_path / "q", quant, tokens, n_ctx)

    expected_kld, expected_same = [], []
    for c in range(chunks):
        for i in range(scored):
            row_b, row_q = base[c, i].astype(np.float64), quant[c, i].astype(np.float64)
            top, floor = row_b.max(), max(row_b.min(), row_b.max() - 16)
            log_sum = np.log(np.exp(row_b - top).sum())
            scale = (top - floor) / 65535
            log_b = np.where(row_b > floor, np.rint((row_b - floor) / scale), 0) * scale + (floor - top - log_sum)
            log_q = row_q - row_q.max() - np.log(np.exp(row_q - row_q.max()).sum())
            kept = log_b > -16
            expected_kld.append(float(np.sum(np.exp(log_b[kept]) * (log_b[kept] - log_q[kept]))))
            expected_same.append(int(np.argmax(log_b) == np.argmax(row_q)))

    with (tmp_path / "ref").open("rb") as ref, (tmp_path / "q").open("rb") as q:
        header, values = kld.paired_chunks(ref, q, "q")
        got = [v for _, chunk in values for v in chunk]
    assert header.n_chunk == chunks and header.scored == scored and header.n_vocab == n_vocab
    assert [v.kld for v in got] == pytest.approx(expected_kld, abs=2e-4)
    assert [int(v.same_top) for v in got] == expected_same
    assert kld.summarise([v.kld for v in got], expected_same)["kld_p99"] == pytest.approx(
        float(np.percentile(expected_kld, 99)), abs=2e-4)
    # The scored token's probability under each model.
    first = tokens[n_ctx // 2 + 1]
    log_q0 = quant[0, 0] - np.log(np.exp(quant[0, 0].astype(np.float64)).sum())
    assert got[0].nll == pytest.approx(-log_q0[first], abs=1e-3)


def test_logits_files_that_do_not_pair_are_refused(tmp_path):
    rng = np.random.default_rng(1)
    logits = rng.standard_normal((2, 7, 50)).astype(np.float32)
    _write_logits(tmp_path / "a", logits, np.arange(32), 16)
    _write_logits(tmp_path / "b", logits, np.arange(32)[::-1], 16)
    with (tmp_path / "a").open("rb") as a, (tmp_path / "b").open("rb") as b, \
            pytest.raises(kld.LogitsFileError, match="tokenizes differently"):
        kld.paired_chunks(a, b, "b")
    with pytest.raises(kld.LogitsFileError, match="no _logits_ magic"):
        kld.read_header(io.BytesIO(b"GGUF" * 8), "x")
    cut = (tmp_path / "a").read_bytes()[:-100]
    with (tmp_path / "a").open("rb") as a, pytest.raises(kld.LogitsFileError, match="writer stopped early"):
        _, chunks = kld.paired_chunks(a, io.BytesIO(cut), "cut")
        list(chunks)


def test_the_logits_bound_is_the_files_size(tmp_path):
    logits = np.zeros((3, 7, 51), dtype=np.float32)
    _write_logits(tmp_path / "a", logits, np.zeros(48, dtype=int), 16)
    assert kld.logits_file_bytes(16, 51, 3) == (tmp_path / "a").stat().st_size
    # SmolLM2 at llama-perplexity's default context: 98 KB a token, 25 MB a chunk.
    assert kld.logits_file_bytes(512, 49152, 1) == pytest.approx(25.1e6, rel=0.01)


def test_percentile_is_llama_cpps():
    values = sorted(np.random.default_rng(3).exponential(size=101))
    for fraction in (0.0, 0.001, 0.5, 0.9, 0.99, 0.999, 1.0):
        assert kld.percentile(values, fraction) == pytest.approx(np.percentile(values, fraction * 100), rel=1e-12)


# ----------------------------------------------------------------------------------------------- the task


class _Job:
    TaskError = RuntimeError

    def __init__(self, run_dir: Path):
        self.run_dir = run_dir


def test_the_reference_logits_are_bounded_before_anything_runs(tmp_path):
    text = tmp_path / "text.txt"
    text.write_text("word " * 2000)  # 10,000 bytes: at most 19 chunks of 512 tokens
    params = {"ctx": 512, "chunks": None, "max_logits_bytes": 10 << 30}
    bound = bound_or_refuse(_Job(tmp_path), params, text, 49152)
    assert bound == {"chunks_at_most": 19, "bytes_at_most": kld.logits_file_bytes(512, 49152, 19)}
    assert bound_or_refuse(_Job(tmp_path), {**params, "chunks": 4}, text, 49152)["chunks_at_most"] == 4
    with pytest.raises(RuntimeError, match=r"could take 0\.44 GiB, over the limit of 0\.10 GiB"):
        bound_or_refuse(_Job(tmp_path), {**params, "max_logits_bytes": int(0.1 * 2**30)}, text, 49152)
    with pytest.raises(RuntimeError, match="free"):
        bound_or_refuse(_Job(tmp_path), {**params, "max_logits_bytes": 1 << 60}, text, 1 << 30)
    with pytest.raises(RuntimeError, match="shorter than one chunk"):
        bound_or_refuse(_Job(tmp_path), {**params, "ctx": 1 << 20}, text, 49152)


def test_a_writer_that_exits_before_opening_the_fifo_is_an_error(tmp_path):
    import os

    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    proc = subprocess.Popen(["false"])
    with pytest.raises(kld.LogitsFileError, match="exited 1 before writing its logits"):
        open_fifo(fifo, proc)
    writer = subprocess.Popen(["sh", "-c", f"printf _logits_ > {fifo}"])
    with open_fifo(fifo, writer) as stream:
        assert stream.read() == b"_logits_"
    writer.wait()


# ----------------------------------------------------------------------------------------------- the spec


def test_the_spec_and_the_job(tmp_path, lab_inventory):
    with pytest.raises(ConfigError, match="the reference 'a' is also one of the models"):
        parse_spec({"hosts": ["desktop"], "reference": "a", "models": ["a"], "text": CORPUS}, "command line")
    with pytest.raises(ConfigError, match="command line: ctx: Input should be greater than or equal to 16"):
        parse_spec({"hosts": ["desktop"], "reference": "a", "models": ["b"], "text": CORPUS, "ctx": 8},
                   "command line")
    with pytest.raises(ConfigError, match=r"KLD text .*absent\.txt: No such file"):
        corpus_identity(tmp_path / "absent.txt")
    host = lab_inventory.host("desktop")
    spec = parse_spec({"hosts": ["desktop"], "reference": "smollm2-135m-q4_1", "models": ["smollm2-135m-q4_0"],
                       "text": CORPUS, "ctx": 128, "threads": 2}, "command line")
    job = kld_job_spec(host, spec)
    assert job.kind == "kld" and job.task == "kld_task" and job.lock == "gpu" and job.stop_servers
    assert job.files == {"corpus.txt": CORPUS}
    assert job.params["corpus"] == {"file": "corpus.txt", "name": "apache-2.0.txt", "bytes": 11358,
                                    "sha256": "cfc7749b96f63bd31c3c42b5c471bf756814053e847c10f3eb003417bc523d30"}
    assert job.params["llama_perplexity"] == "/opt/llama.cpp/current/bin/llama-perplexity"
    missing = parse_spec({"hosts": ["desktop"], "reference": "smollm2-135m-bf16", "models": ["smollm2-135m-q4_0"],
                          "text": CORPUS}, "command line")
    with pytest.raises(ConfigError, match="host desktop: KLD artifact 'smollm2-135m-bf16' is not an artifact"):
        kld_job_spec(host, missing)


# ----------------------------------------------------------------------------------------------- a pulled run


def _run(store: ResultsStore, host: str, run_id: str, *, tokens_sha: str = "t" * 64, ref_sha: str = "r" * 64,
         rows: list[dict] | None = None):
    printed = kld.headline(kld.parse_output((DATA / "smollm2-q4_0.kld.txt").read_text()))
    rows = _tokens() if rows is None else rows
    record = RunRecord.begin("kld", Provenance(host=host, artifacts=[
        Artifact(name="ckpt-bf16", sha256=ref_sha), Artifact(name="ckpt-q4_0", sha256="q" * 64)]), id=run_id)
    record.extra["kld"] = {
        "reference": "ckpt-bf16", "corpus": corpus_identity(CORPUS), "ctx": 128, "chunks": None, "batch": None,
        "scored_per_chunk": 63,
        "chunks_scored": len(rows), "tokens_sha256": tokens_sha,
        "models": {"ckpt-q4_0": {"llama_perplexity": printed, "difference": {"kld_mean": -2e-4}}}}
    run_dir = store.run_dir(host, run_id)
    (run_dir / "kld").mkdir(parents=True)
    (run_dir / "kld" / "ckpt-q4_0.tokens.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    record.seal(run_dir)
    return store.find(f"{host}/{run_id}")


def test_a_pulled_run_has_llama_cpps_numbers_with_intervals_over_chunks(tmp_path):
    store = ResultsStore(tmp_path)
    run = _run(store, "desktop", "kld-20261203T100000Z-0001")
    (result,) = kld_results(run, resamples=2000)
    assert (result.chunks, result.tokens) == (17, 1071)
    assert result.mean.n == 17 and result.mean.method == "clusters"
    cells = result_cells(result)
    assert cells[:4] == ["desktop", "ckpt-q4_0", "ckpt-bf16", "17 × 63"]
    mean = result.interval(0.484414, result.mean)
    assert mean.low < 0.484414 < mean.high and mean.high - mean.low > 0.05  # 17 chunks: a wide interval
    assert cells[4].startswith("0.4844 (") and cells[6].startswith("64.0 % (")
    p99 = result.interval(3.048019, result.p99)
    assert p99.low < 3.048019 < p99.high
    # The same tokens on another host: paired, token by token.
    other = _run(store, "laptop", "kld-20261203T100000Z-0002")
    (twin,) = kld_results(other, resamples=500)
    same = kld_gap(run, result, other, twin, resamples=500)
    assert same.mean.estimate == 0 and same.mean.low == 0 == same.mean.high and same.same_top.estimate == 0


def test_runs_of_other_tokens_or_references_are_not_paired(tmp_path):
    store = ResultsStore(tmp_path)
    a = _run(store, "desktop", "kld-20261203T100000Z-0001")
    b = _run(store, "laptop", "kld-20261203T100000Z-0002", tokens_sha="u" * 64)
    c = _run(store, "laptop", "kld-20261203T100000Z-0003", ref_sha="s" * 64)
    (ra,), (rb,), (rc,) = (kld_results(r, resamples=100) for r in (a, b, c))
    with pytest.raises(ConfigError, match="scored different tokens"):
        kld_gap(a, ra, b, rb)
    with pytest.raises(ConfigError, match="against different references"):
        kld_gap(a, ra, c, rc)


def test_a_bad_token_file_is_the_runs_error(tmp_path):
    store = ResultsStore(tmp_path)
    rows = _tokens()
    rows[3]["kld"] = rows[3]["kld"][:-1]
    run = _run(store, "desktop", "kld-20261203T100000Z-0001", rows=rows)
    with pytest.raises(ConfigError, match=r"ckpt-q4_0\.tokens\.jsonl: line 4: not chunk 3 with 63"):
        load_tokens(run, "ckpt-q4_0")
    rows = _tokens()
    rows[0]["kld"][0] = "NaN"
    bad = _run(store, "laptop", "kld-20261203T100000Z-0002", rows=rows)
    with pytest.raises(ConfigError, match="not finite"):
        load_tokens(bad, "ckpt-q4_0")
    shutil.rmtree(bad.path / "kld")
    with pytest.raises(ConfigError, match=r"no kld/ckpt-q4_0\.tokens\.jsonl"):
        load_tokens(bad, "ckpt-q4_0")


def test_a_kld_model_name_cannot_reach_another_run_s_tokens(tmp_path):
    """The record's model names are the host's words: ``../../<other run>/kld/<model>`` must not read the
    tokens another host pulled, nor may a link in the run's kld directory."""
    store = ResultsStore(tmp_path)
    _run(store, "laptop", "kld-20261203T100000Z-0002")  # the other host's run, whose tokens must stay unread
    run = _run(store, "desktop", "kld-20261203T100000Z-0001")
    escape = "../../../laptop/kld-20261203T100000Z-0002/kld/ckpt-q4_0"
    run.record.extra["kld"]["models"] = {escape: run.record.extra["kld"]["models"]["ckpt-q4_0"]}
    with pytest.raises(TrustError, match="leaves its directory"):
        kld_results(run, resamples=100)
    link = run.path / "kld" / "linked.tokens.jsonl"
    link.symlink_to(store.root / "laptop" / "kld-20261203T100000Z-0002" / "kld" / "ckpt-q4_0.tokens.jsonl")
    with pytest.raises(ConfigError, match="link"):
        load_tokens(run, "linked")


# ----------------------------------------------------------------------------------------------- the bootstrap


def test_the_cluster_bootstrap():
    rng = np.random.default_rng(0)
    values = rng.exponential(0.3, size=(20, 50))
    mean = bootstrap_clusters(values, lambda d: d.mean(axis=1), resamples=2000, seed=1)
    assert mean.estimate == pytest.approx(values.mean()) and mean.low < mean.estimate < mean.high
    assert mean == bootstrap_clusters(values, lambda d: d.mean(axis=1), resamples=2000, seed=1)
    assert (mean.n, mean.method) == (20, "clusters")
    # Resampling whole chunks: chunks that differ from each other widen the interval over resampling tokens.
    shifted = values + np.linspace(0, 1, 20)[:, None]
    wide = bootstrap_clusters(shifted, lambda d: d.mean(axis=1), resamples=2000)
    assert wide.high - wide.low > 3 * (mean.high - mean.low)
    tail = bootstrap_clusters(values, lambda d: np.percentile(d, 99, axis=1), resamples=500)
    assert tail.estimate == pytest.approx(np.percentile(values, 99))
    paired = bootstrap_clusters(np.stack([values, values + 0.1], axis=-1),
                                lambda d: d[..., 1].mean(axis=1) - d[..., 0].mean(axis=1), resamples=500)
    assert paired.estimate == pytest.approx(0.1) and paired.low == pytest.approx(0.1)
    assert bootstrap_clusters(np.zeros((0, 5)), lambda d: d.mean(axis=1)).empty
    with pytest.raises(ValueError, match="clustered values"):
        bootstrap_clusters(np.zeros(5), lambda d: d.mean(axis=1))


# ----------------------------------------------------------------------------------------------- campaign


def _campaign(tmp_path: Path, **kld) -> Path:
    path = tmp_path / "campaign.yml"
    step = {"name": "q4_0", "hosts": ["desktop", "laptop"], "reference": "ckpt-bf16", "models": ["ckpt-q4_0"],
            "text": os.path.relpath(CORPUS, tmp_path), "ctx": 128, **kld}
    path.write_text(yaml.safe_dump({"name": "kld", "title": "KLD", "hosts": ["desktop", "laptop"],
                                    "artifacts": {"ckpt-bf16": {"label": "bf16"}, "ckpt-q4_0": {"label": "Q4_0"}},
                                    "klds": [step]}))
    return path


def test_a_campaign_finds_its_kld_runs_and_reports_them(tmp_path):
    from rigctl.analysis.campaign import load_campaign, locate
    from rigctl.analysis.report import build_report

    store = ResultsStore(tmp_path / "results")
    desktop = _run(store, "desktop", "kld-20261203T100000Z-0001")
    loaded = load_campaign(_campaign(tmp_path))
    found = locate(loaded, store)
    assert found.klds == {("q4_0", "desktop"): desktop, ("q4_0", "laptop"): None}
    # Another context is another measurement: not this step's.
    assert locate(load_campaign(_campaign(tmp_path, ctx=256)), store).klds[("q4_0", "desktop")] is None
    report = build_report(loaded, store, tmp_path / "report")
    assert "Not pulled yet: kld q4_0 on laptop." in report.markdown
    _run(store, "laptop", "kld-20261203T100000Z-0002")
    text = build_report(loaded, store, tmp_path / "report").markdown
    section = text[text.index("## KL divergence"):]
    assert "### q4_0: Q4_0 against bf16" in section and "Text: apache-2.0.txt, `-c 128`." in section
    row = next(line for line in section.splitlines() if line.startswith("| desktop | Q4_0 | bf16 | 17 × 63 |"))
    assert "[0.4844 (" in row and "[3.0480 (" in row and "[64.0 % (" in row and "| 1.4100 |" in row
    assert "../results/desktop/kld-20261203T100000Z-0001/kld/ckpt-q4_0.txt" in row
    assert "| laptop - desktop (Q4_0) | +0.0000 (+0.0000 to +0.0000) |" in section


def test_a_campaigns_kld_steps_are_checked(tmp_path):
    from rigctl.analysis.campaign import load_campaign

    with pytest.raises(ConfigError, match="hosts not listed under hosts: gpu9"):
        load_campaign(_campaign(tmp_path, hosts=["gpu9"]))
    with pytest.raises(ConfigError, match="artifact 'ckpt-q8_0' is not listed under artifacts"):
        load_campaign(_campaign(tmp_path, models=["ckpt-q8_0"]))
    with pytest.raises(ConfigError, match=r"klds\.0: the reference 'ckpt-bf16' is also one of the models"):
        load_campaign(_campaign(tmp_path, models=["ckpt-bf16"]))


# ----------------------------------------------------------------------------------------------- the CLI


def _cli(*args: str, results: Path) -> subprocess.CompletedProcess[str]:
    import sys

    return subprocess.run([str(Path(sys.executable).parent / "rigctl"), *args], capture_output=True, text=True,
                          timeout=120, env={**os.environ, "RIGCTL_RESULTS": str(results), "COLUMNS": "220"})


def test_compare_prints_kld_runs_and_their_paired_gap(tmp_path):
    store = ResultsStore(tmp_path / "results")
    _run(store, "desktop", "kld-20261203T100000Z-0001")
    _run(store, "laptop", "kld-20261203T100000Z-0002")
    done = _cli("compare", "desktop/kld-20261203T100000Z-0001", "kld-20261203T100000Z-0002",
                "--resamples", "500", results=store.root)
    assert done.returncode == 0, done.stderr
    rows = [line for line in done.stdout.splitlines() if "ckpt-q4_0" in line]
    assert len(rows) == 3 and rows[0].startswith("│ desktop │ ckpt-q4_0 │ ckpt-bf16 │"), done.stdout
    assert "0.4844 (" in rows[0] and "3.0480 (" in rows[0] and "64.0 % (" in rows[0]
    assert "laptop - desktop (ckpt-q4_0)" in rows[2] and "+0.0000 (+0.0000 to +0.0000)" in rows[2]


def test_eval_kld_refuses_bad_input_in_one_line(tmp_path):
    base = ["-i", str(Path(__file__).parents[2] / "inventory" / "lab"), "eval", "kld", "-H", "desktop",
            "-r", "smollm2-135m-q4_1", "-m", "smollm2-135m-q4_0"]
    for args, needle in (
        (["--text", str(tmp_path / "absent.txt")], "error: KLD text"),
        (["--text", str(CORPUS), "--ctx", "8"], "error: command line: ctx: Input should be greater than or equal"),
        (["-m", "smollm2-135m-q4_1", "--text", str(CORPUS)], "error: command line: the reference"),
    ):
        done = _cli(*base, *args, results=tmp_path)
        lines = [line for line in done.stderr.splitlines() if line.strip()]
        assert done.returncode == 2 and len(lines) == 1 and lines[0].startswith(needle), (args, done.stderr)
