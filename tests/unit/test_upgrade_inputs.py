"""Issue 39, item 5: every input of an upgrade, a bisect or a campaign's upgrade step is refused in one ``error:``
line before anything is fetched, built or asked over SSH.

Each case runs the real CLI on a copy of the lab inventory whose hosts point at a loopback listener that counts
connections: a case passes only when the listener saw none, the controller's cache holds no fetched source,
and every inventory file is byte-identical afterwards. The package index is a closed loopback port, so a
fetch that did start would fail with a different line.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import socket
import subprocess
import sys
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
RIGCTL = [str(Path(sys.executable).parent / "rigctl")]


class ConnectionCounter:
    """A loopback TCP listener that accepts and closes every connection, counting them."""

    def __init__(self) -> None:
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(16)
        self.sock.settimeout(0.2)
        self.port = self.sock.getsockname()[1]
        self.count = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        while not self._stop.is_set():
            try:
                conn, _ = self.sock.accept()
            except TimeoutError:
                continue
            self.count += 1
            conn.close()

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)
        self.sock.close()


@dataclass
class Fleet:
    inventory: Path
    cache: Path
    counter: ConnectionCounter
    env: dict[str, str]

    def digest(self) -> dict[str, str]:
        return {str(p.relative_to(self.inventory)): hashlib.sha256(p.read_bytes()).hexdigest()
                for p in sorted(self.inventory.rglob("*")) if p.is_file()}

    def run(self, *args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([*RIGCTL, "-i", str(self.inventory), *args], capture_output=True, text=True,
                              env=self.env, timeout=120, check=False)


@pytest.fixture
def fleet(tmp_path: Path) -> Iterator[Fleet]:
    inventory = tmp_path / "lab"
    shutil.copytree(REPO / "inventory" / "lab", inventory)
    counter = ConnectionCounter()
    for host in ("desktop", "laptop"):  # host_vars outrank the inventory file's ansible_host
        with (inventory / "host_vars" / f"{host}.yml").open("a") as out:
            out.write(f"\nansible_host: 127.0.0.1\nansible_port: {counter.port}\n")
    dead = socket.socket()
    dead.bind(("127.0.0.1", 0))
    dead_port = dead.getsockname()[1]
    dead.close()  # nothing listens there: an index fetch would fail at once, and say so
    env = {**os.environ, "RIGCTL_CACHE_DIR": str(tmp_path / "cache"),
           "PIP_INDEX_URL": f"http://127.0.0.1:{dead_port}/simple", "RIGCTL_RESULTS": str(tmp_path / "results")}
    yield Fleet(inventory, tmp_path / "cache", counter, env)
    counter.close()


def refused(fleet: Fleet, before: dict[str, str], done: subprocess.CompletedProcess[str], *needles: str) -> str:
    """The one error line, after checking nothing was asked of a host, fetched or written."""
    lines = done.stderr.strip().splitlines()
    assert done.returncode in (1, 2), (done.returncode, done.stdout, done.stderr)
    assert len(lines) == 1 and lines[0].startswith("error: "), lines
    assert "Traceback" not in done.stderr
    for needle in needles:
        assert needle in lines[0], (needle, lines[0])
    assert fleet.counter.count == 0, "a host was connected to"
    assert not (fleet.cache / "sources").exists(), "something was fetched"
    assert fleet.digest() == before, "the inventory changed"
    return lines[0]


GATES_CASES = {
    "unknown quality task": ("quality: {task: no-such-task}\n", "quality.task", "no-such-task"),
    "unknown bench model": ("bench: {models: [no-such-artifact]}\n", "bench.models.0", "no-such-artifact"),
    "unknown identity kind": ("identity: {kinds: [poetry]}\n", "identity.kinds.0", "poetry"),
    "negative prompt length": ("server: {prompt_lengths: [-5]}\n", "server.prompt_lengths.0", "greater than"),
    "a budget of 10^12": ("bench: {max_rounds: 1000000000000}\n", "bench.max_rounds", "less than"),
    "a negative matrix length": ("bench: {matrix: {p: [-1]}}\n", "bench.matrix.p.0", "greater than"),
    "nan margin": ("speed_margin: .nan\n", "speed_margin", "finite"),
    "inf cooldown": ("bench: {cooldown: {timeout_s: .inf}}\n", "bench.cooldown.timeout_s", "finite"),
    "unknown server instance": ("server: {instances: [nope]}\n", "server.instances.0", "nope"),
    "one instance standing in for the deployed": ("server: {instance: smollm2}\n", "server",
                                                  "one cannot stand in for them"),
    "dropping the deployed instances' server gates": ("server: null\n", "server: null would drop the deployed"),
    "dropping the deployed instances' bench gates": ("bench: null\n", "bench: null would drop the deployed"),
    "4,300 digits": ("new_errors: " + "9" * 5000 + "\n", "4300"),
    "nested past the stack": ("bench: " + "[" * 100_000 + "]" * 100_000 + "\n", "nested too deeply"),
    "not UTF-8": ("speed_margin: 0.9 # \xff\n", "not UTF-8"),
}


def _gates_file(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "gates.yml"
    path.write_bytes(text.encode("latin-1") if "\xff" in text else text.encode())
    return path


@pytest.mark.parametrize("case", sorted(GATES_CASES))
def test_bad_gates_are_refused_by_upgrade_and_bisect_before_any_fetch_or_ssh(fleet: Fleet, tmp_path: Path,
                                                                             case: str):
    text, *needles = GATES_CASES[case]
    path = _gates_file(tmp_path, text)
    before = fleet.digest()
    refused(fleet, before, fleet.run("build", "upgrade", "--to", "b11401", "--gates", str(path)),
            f"--gates {path}", *needles)
    candidates = tmp_path / "candidates.yml"
    candidates.write_text("[b11401, b11420, b11434]\n")
    refused(fleet, before, fleet.run("build", "bisect", "--host", "desktop", "--good", "b11401", "--bad", "b11434",
                                     "--metric", "tg16", "--candidates", str(candidates), "--gates", str(path)),
            f"--gates {path}", *needles)


def test_the_inventory_s_gates_are_held_to_the_same_schema_by_inventory_check(fleet: Fleet):
    before = fleet.digest()
    upgrade_yml = fleet.inventory / "group_vars" / "all" / "upgrade.yml"
    upgrade_yml.write_text(upgrade_yml.read_text().replace("  speed_margin: 0.9", "  speed_margni: 0.9"))
    done = fleet.run("inventory", "check")
    assert done.returncode != 0, done.stdout + done.stderr
    assert "rigctl_upgrade_gates.speed_margni: unknown key" in done.stdout + done.stderr
    assert fleet.counter.count == 0
    upgrade_yml.write_text(upgrade_yml.read_text().replace("speed_margni", "speed_margin"))
    assert fleet.digest() == before


@pytest.mark.parametrize(("candidates", "needle"), [
    ("[b11401, ../x, b11434]\n", "item 1: version '../x'"),
    ("[b11401, {version: b11420, cmake: {'X;rm': '1'}}, b11434]\n", "item 1: cmake"),
    ("[b11401, {version: b11420, cmake: {CMAKE_BUILD_TYPE: [a]}}, b11434]\n", "item 1: cmake"),
    ("[b11401, b²1420, b11434]\n", "item 1: version"),
    ("{version: b11401}\n", "expected a list"),
    ("[b11401, 0123abc, b11434]\n", "give a build label"),  # a commit, for a host that builds from an archive
])
def test_bisect_candidates_are_refused_before_ssh(fleet: Fleet, tmp_path: Path, candidates: str, needle: str):
    path = tmp_path / "candidates.yml"
    path.write_text(candidates)
    before = fleet.digest()
    refused(fleet, before, fleet.run("build", "bisect", "--host", "desktop", "--good", "b11401", "--bad", "b11434",
                                     "--metric", "tg16", "--candidates", str(path)), needle)


def test_a_bisect_metric_the_gates_do_not_measure_is_refused(fleet: Fleet, tmp_path: Path):
    path = tmp_path / "candidates.yml"
    path.write_text("[b11401, b11420, b11434]\n")
    before = fleet.digest()
    line = refused(fleet, before, fleet.run("build", "bisect", "--host", "desktop", "--good", "b11401", "--bad",
                                            "b11434", "--candidates", str(path), "--metric", "tg128"), "--metric")
    assert "it measures pp64, tg16" in line  # the lab's matrix


def test_an_allow_advisory_reason_that_is_a_template_is_refused(fleet: Fleet):
    before = fleet.digest()
    refused(fleet, before, fleet.run("build", "upgrade", "--to", "b9060", "--allow-advisory",
                                     "GHSA-6hc7-9rph-cm99={{ lookup('pipe', 'id') }}"),
            "--allow-advisory", "template marker")
    refused(fleet, before, fleet.run("build", "upgrade", "--to", "b9060", "--allow-advisory",
                                     "GHSA-6hc7-9rph-cm99=two\nlines"), "--allow-advisory", "unprintable")


def test_a_campaign_upgrade_step_s_cmake_and_version_pass_the_command_s_checks(fleet: Fleet, tmp_path: Path):
    before = fleet.digest()
    for step, needle in (("{name: u, to: b11401, canary: desktop, cmake: {'CMAKE_C_FLAGS': '$(id)'}}",
                          "upgrades.0: cmake: --cmake"),
                         ("{name: u, to: ../x, canary: desktop}", "upgrades.0: to '../x'")):
        path = tmp_path / "campaign.yml"
        path.write_text(f"name: c\ntitle: t\nhosts: [desktop]\nupgrades:\n  - {step}\n")
        refused(fleet, before, fleet.run("campaign", "run", str(path)), f"campaign {path}", needle)


def test_a_float_option_refuses_nan_and_inf(fleet: Fleet):
    before = fleet.digest()
    for value in ("nan", "inf", "-inf"):
        refused(fleet, before, fleet.run("bench", "load", "desktop", "smollm2-q4_0", "--level-timeout", value),
                "--level-timeout", "not a finite number")


def test_the_counter_sees_a_bisect_whose_inputs_are_good(fleet: Fleet, tmp_path: Path):
    """The control: the same bisect with good inputs does reach the host (and fails there, as nothing answers
    SSH), so a refusal above that left the counter at 0 came before SSH."""
    path = tmp_path / "candidates.yml"
    path.write_text("[b11401, b11420, b11434]\n")
    done = fleet.run("build", "bisect", "--host", "desktop", "--good", "b11401", "--bad", "b11434", "--metric", "tg16",
                     "--candidates", str(path))
    assert done.returncode != 0
    assert "desktop: cannot connect" in done.stderr
    assert fleet.counter.count > 0, done.stderr
