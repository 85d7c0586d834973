"""Lab: KL divergence of SmolLM2 Q4_0 against its bf16 on both rigs, the reference study's recipe: bf16 converted
from the HF checkout (tests/fixtures/make_hf_checkout.py) by the models role, Q4_0 rounded from that bf16; scored
by llama-perplexity as a KLD job on each rig, run as a campaign step, pulled, and reported with intervals.

The text is the Apache License 2.0 as Debian ships it (/usr/share/common-licenses/Apache-2.0, copied into
tests/fixtures/corpus/: real prose, pinned by its sha256 in the run record): at ``-c 128`` it gives 17 chunks of
63 scored tokens, about four minutes a rig on this machine's two shared cores.
"""

from __future__ import annotations

import json
import os
import shutil
import struct
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import yaml
from make_hf_checkout import make_checkout

from rigctl.fleet.deploy import run_playbook
from rigctl.inventory import Inventory
from rigctl.results.store import ResultsStore
from rigctl.ssh import SshClient, SshTarget

REPO = Path(__file__).resolve().parents[2]

CORPUS = REPO / "tests" / "fixtures" / "corpus" / "apache-2.0.txt"
# The first test also pays for the models: on a fresh lab, the converter's venv on both rigs (about 8 minutes
# on this machine), then the conversion and the quantisation.
pytestmark = [pytest.mark.lab, pytest.mark.hf_checkout, pytest.mark.timeout(1800)]


@pytest.fixture(scope="module")
def kld_inventory(lab_served, tmp_path_factory) -> Path:
    """A copy of the lab inventory whose catalog adds SmolLM2's checkout converted to bf16 and Q4_0 rounded
    from it, provisioned on both rigs."""
    inv = tmp_path_factory.mktemp("kld") / "inventory"
    shutil.copytree(REPO / "inventory" / "lab", inv)
    catalog = yaml.safe_load((inv / "group_vars" / "all" / "models.yml").read_text())["models_catalog"]
    catalog["smollm2-ckpt"] = {"source": {"type": "controller", "path": str(make_checkout())},
                               "artifacts": {"ckpt-bf16": {"type": "convert", "outtype": "bf16"},
                                             "ckpt-q4_0": {"type": "quantize", "from": "ckpt-bf16",
                                                           "qtype": "Q4_0"}}}
    (inv / "group_vars" / "all" / "models_kld.yml").write_text(yaml.safe_dump({"models_catalog": catalog}))
    started = time.monotonic()
    run_playbook(Inventory.load(inv), tags=["models"], timeout=1800).raise_for_failures()
    print(f"bf16 and Q4_0 on both rigs: {time.monotonic() - started:.0f} s")
    return inv


def test_kld_of_q4_0_against_its_bf16_on_both_rigs(kld_inventory, tmp_path):
    from rigctl.analysis.campaign import load_campaign, run_campaign
    from rigctl.analysis.kld import kld_results, result_cells
    from rigctl.analysis.report import build_report

    campaign = tmp_path / "kld.yml"
    campaign.write_text(yaml.safe_dump({
        "name": "kld-lab", "title": "SmolLM2 Q4_0 against its bf16", "hosts": ["desktop", "laptop"],
        "artifacts": {"ckpt-bf16": {"label": "SmolLM2 bf16"}, "ckpt-q4_0": {"label": "SmolLM2 Q4_0"}},
        "klds": [{"name": "q4_0", "hosts": ["desktop", "laptop"], "reference": "ckpt-bf16", "models": ["ckpt-q4_0"],
                  "text": str(CORPUS), "ctx": 128, "threads": 2}],
    }))
    store = ResultsStore(tmp_path / "results")
    loaded = load_campaign(campaign)
    inventory = Inventory.load(kld_inventory)
    for host in inventory.hosts.values():  # KLD runs an earlier session left would answer the campaign
        with SshClient(SshTarget.from_host(host)) as ssh:
            ssh.run(f"rm -rf /var/lib/rigctl/results/{host.name}/kld-*", timeout=60)
    started = time.monotonic()
    outcomes = run_campaign(loaded, inventory, store, on_step=print)
    took = time.monotonic() - started
    assert [(o.step, o.status) for o in outcomes] == [("kld q4_0 on desktop", "ran"), ("kld q4_0 on laptop", "ran")], \
        outcomes
    runs = {o.run.split("/")[0]: store.find(o.run) for o in outcomes if o.run}
    for host, run in runs.items():
        record = run.record
        extra = record.extra["kld"]
        assert record.kind == "kld" and record.status == "done", record.extra.get("error")
        # The reference study's recipe: bf16 converted from the checkout, Q4_0 rounded from that bf16.
        bf16, q4_0 = record.artifacts
        assert (bf16.name, q4_0.name) == ("ckpt-bf16", "ckpt-q4_0") and bf16.sha256 and q4_0.sha256
        assert "convert_hf_to_gguf.py" in bf16.manifest["command"] and "--outtype bf16" in bf16.manifest["command"]
        assert "BF16" in bf16.manifest["types"] and "Q4_0" in q4_0.manifest["types"]
        assert "llama-quantize" in q4_0.manifest["command"] and q4_0.manifest["input"]["id"] == f"sha256:{bf16.sha256}"
        assert extra["corpus"]["sha256"] == "cfc7749b96f63bd31c3c42b5c471bf756814053e847c10f3eb003417bc523d30"
        assert (extra["chunks_scored"], extra["scored_per_chunk"], extra["tokens"]) == (17, 63, 1071)
        # llama.cpp's statistics, and the per-token values recomputed beside them.
        model = extra["models"]["ckpt-q4_0"]
        printed, difference = model["llama_perplexity"], model["difference"]
        assert 0.05 < printed["kld_mean"] < 2 and printed["kld_p99"] > printed["kld_mean"]
        assert 0.3 < printed["same_top"] < 1 and printed["ppl_ratio"] > 1
        assert abs(difference["kld_mean"]) < 1e-3 and abs(difference["same_top"]) < 1e-3
        assert abs(difference["kld_p99"]) < 0.01 * printed["kld_p99"]
        assert any("--kl-divergence-base" in c and "--kl-divergence" in c.split() for c in record.commands)
        # The reference's logits (105 MB here) were bounded, written in the run directory, and deleted.
        assert extra["logits"]["bytes"] <= extra["logits"]["bytes_at_most"]
        assert not any(f.path.startswith(".") or "logits" in f.path for f in record.files)
        with SshClient(SshTarget.from_host(inventory.host(host))) as ssh:
            left = ssh.run(f"ls -A /var/lib/rigctl/results/{host}/{record.id}", timeout=30).stdout.split()
        assert ".reference.logits" not in left and ".quantised.logits" not in left, left
        (result,) = kld_results(run)
        print(" | ".join(result_cells(result)), f"(llama.cpp's SE of the mean {printed['kld_mean_se']}; "
              f"recomputed - llama.cpp: {difference})")
    # One build, one CPU, the same files: both rigs score the same tokens alike.
    desktop, laptop = (runs[h].record.extra["kld"] for h in ("desktop", "laptop"))
    assert desktop["tokens_sha256"] == laptop["tokens_sha256"]
    print(f"campaign: {took:.0f} s for both rigs")

    report = build_report(loaded, store, tmp_path / "report")
    text = report.markdown
    section = text[text.index("## KL divergence"):]
    assert "| desktop | SmolLM2 Q4_0 | SmolLM2 bf16 | 17 × 63 |" in section, section[:2000]
    assert "| laptop | SmolLM2 Q4_0 | SmolLM2 bf16 | 17 × 63 |" in section
    mean = f"{desktop['models']['ckpt-q4_0']['llama_perplexity']['kld_mean']:.4f} ("
    assert mean in section and "same top-1" in section and "p99 KLD" in section
    assert "laptop - desktop" in section
    print(section[:3000])
    # A second campaign run finds what it asked for and runs nothing.
    again = run_campaign(loaded, inventory, store)
    assert [o.status for o in again] == ["pulled", "pulled"]


def test_eval_kld_on_the_command_line(kld_inventory, tmp_path):
    env = {**os.environ, "RIGCTL_RESULTS": str(tmp_path / "results"), "COLUMNS": "250"}
    base = [str(Path(sys.executable).parent / "rigctl"), "-i", str(kld_inventory), "eval", "kld", "-H", "desktop",
            "-r", "ckpt-bf16", "-m", "ckpt-q4_0", "--text", str(CORPUS), "-c", "128", "-t", "2"]
    # Two chunks: 126 scored tokens, enough for llama-perplexity's statistics.
    done = subprocess.run([*base, "--chunks", "2", "--wait"], capture_output=True, text=True, timeout=800, env=env)
    print(done.stdout[-3000:], done.stderr[-2000:])
    assert done.returncode == 0, done.stderr
    assert "desktop: copied 1 run(s)" in done.stdout
    row = next(line for line in done.stdout.splitlines() if line.startswith("│ desktop │ ckpt-q4_0 │ ckpt-bf16 │"))
    assert "│          2 × 63 │" in row and " % (" in row, row
    _numpy_agrees_from_the_logits(kld_inventory, ResultsStore(tmp_path / "results"), tmp_path)
    # The bound: 2 chunks of the reference's logits are 12 MB; a smaller limit is refused before any pass.
    refused = subprocess.run([*base, "--chunks", "2", "--max-logits-gib", "0.001", "--wait"], capture_output=True,
                             text=True, timeout=300, env=env)
    assert refused.returncode == 1
    assert "over the limit of 0.00 GiB (fewer chunks, or a higher limit)" in refused.stdout + refused.stderr
    unknown = subprocess.run([*base[:-4], "--text", str(tmp_path / "absent.txt")], capture_output=True, text=True,
                             timeout=120, env=env)
    assert unknown.returncode == 2 and unknown.stderr.strip().startswith("error: KLD text"), unknown.stderr


def _read_logits(path: Path):
    """A llama-perplexity logits file, read with numpy alone: log-probabilities (tokens x vocabulary) and the
    token ids."""
    raw = path.read_bytes()
    assert raw[:8] == b"_logits_"
    n_ctx, n_vocab, n_chunk = struct.unpack_from("<Iii", raw, 8)
    nv, scored = 2 * ((n_vocab + 1) // 2) + 4, n_ctx - 1 - n_ctx // 2
    tokens = np.frombuffer(raw, dtype="<i4", count=n_ctx * n_chunk, offset=20)
    rows = np.frombuffer(raw, dtype="<u2", offset=20 + 4 * tokens.size).reshape(n_chunk * scored, nv)
    head = rows[:, :4].copy().view("<f4")  # scale, min_log_prob
    return rows[:, 4:4 + n_vocab].astype(np.float64) * head[:, :1] + head[:, 1:2], tokens


def _numpy_agrees_from_the_logits(inventory_dir: Path, store: ResultsStore, tmp_path: Path) -> None:
    """The two models' logits saved on the rig by llama-perplexity itself (the settings of the CLI's run: its
    text, -c 128, 2 chunks), fetched, and llama.cpp's statistics recomputed from them with numpy: they agree
    with what llama-perplexity printed, and with the job's per-token values."""
    from rigctl.hostside import kld

    (run,) = list(store.runs(kind="kld"))
    host = Inventory.load(inventory_dir).host("desktop")
    perplexity = "/opt/llama.cpp/current/bin/llama-perplexity"
    files = {}
    with SshClient(SshTarget.from_host(host)) as ssh:
        ssh.put(CORPUS, "/tmp/kld-check.txt", timeout=60)
        try:
            for artifact in run.record.artifacts:
                remote, local = f"/tmp/kld-check-{artifact.name}.logits", tmp_path / f"{artifact.name}.logits"
                ssh.run(f"{perplexity} -m {artifact.path} -f /tmp/kld-check.txt -c 128 -t 2 --chunks 2 "
                        f"--kl-divergence-base {remote}", timeout=300, check=True)
                ssh.get(remote, local, timeout=120)
                files[artifact.name] = local
        finally:
            ssh.run("rm -f /tmp/kld-check.txt /tmp/kld-check-*.logits", timeout=30)
    log_ref, tokens_ref = _read_logits(files["ckpt-bf16"])
    log_q, tokens_q = _read_logits(files["ckpt-q4_0"])
    assert (tokens_ref == tokens_q).all() and log_ref.shape == (126, 49152)
    kept = log_ref > -16
    values = np.where(kept, np.exp(log_ref) * (log_ref - log_q), 0.0).sum(axis=1)
    same = log_ref.argmax(axis=1) == log_q.argmax(axis=1)
    printed = kld.headline(kld.parse_output((run.path / "kld" / "ckpt-q4_0.txt").read_text()))
    assert values.mean() == pytest.approx(printed["kld_mean"], abs=1e-3)
    assert np.percentile(values, 99) == pytest.approx(printed["kld_p99"], rel=5e-3)
    assert same.mean() == pytest.approx(printed["same_top"], abs=1e-4)
    job = [json.loads(line) for line in (run.path / "kld" / "ckpt-q4_0.tokens.jsonl").read_text().splitlines()]
    assert np.concatenate([r["kld"] for r in job]) == pytest.approx(values, rel=1e-9, abs=1e-12)
    assert np.concatenate([r["same_top"] for r in job]).tolist() == same.astype(int).tolist()
    print(f"numpy from the saved logits: mean KLD {values.mean():.6f}, p99 {np.percentile(values, 99):.6f}, "
          f"same top {same.mean():.4f}; llama-perplexity printed {printed}")
