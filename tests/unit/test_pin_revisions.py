"""``rigctl models pin-revisions`` on a copy of the reference inventory, against the local server in Hugging
Face's layout (tests/fixtures/hf_server.py) on HF_ENDPOINT, and against endpoints that lie or stall: every
branch pinned round trip (nothing else in the file changes), or one ``error:`` line and no file touched."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from hf_server import HfRepo, HfServer
from local_http import Handler, LocalServer

from rigctl.inventory import Inventory
from rigctl.inventory.check import check

REPO = Path(__file__).resolve().parents[2]
RIGCTL = str(Path(sys.executable).parent / "rigctl")
#: The reference catalog's four sources, each served at a commit of its own.
SOURCES = ["Qwen/Qwen3.5-2B", "google/gemma-4-E2B-it-qat-q4_0-gguf", "google/gemma-4-E2B-it",
           "google/gemma-4-E2B-it-assistant"]
COMMITS = {repo: hashlib.sha1(repo.encode()).hexdigest() for repo in SOURCES}


@pytest.fixture
def inv(tmp_path) -> Path:
    shutil.copytree(REPO / "inventory" / "rigs", tmp_path / "rigs")
    return tmp_path / "rigs"


@pytest.fixture
def hub(tmp_path) -> Iterator[HfServer]:
    repos = []
    for repo, commit in COMMITS.items():
        root = tmp_path / "hub" / repo
        root.mkdir(parents=True)
        (root / "config.json").write_text("{}")
        repos.append(HfRepo(repo, commit, root))
    with HfServer(repos[0], also=repos[1:]) as server:
        yield server


def rigctl(inv: Path, endpoint: str, *args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "HF_ENDPOINT": endpoint}
    env.pop("HF_TOKEN", None)
    return subprocess.run([RIGCTL, "-i", str(inv), "models", "pin-revisions", *args], cwd=REPO,
                          capture_output=True, text=True, timeout=120, env=env)


def snapshot(inv: Path) -> dict[str, bytes]:
    return {str(p.relative_to(inv)): p.read_bytes() for p in sorted(inv.rglob("*")) if p.is_file()}


def test_every_branch_is_pinned_round_trip(inv, hub):
    catalog = inv / "group_vars" / "all" / "models.yml"
    before, others = catalog.read_text().splitlines(), {k: v for k, v in snapshot(inv).items()
                                                        if k != "group_vars/all/models.yml"}
    done = rigctl(inv, hub.endpoint)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip().splitlines()[-1] == "pinned 4 sources"
    assert f"qwen3.5-2b: Qwen/Qwen3.5-2B@main -> {COMMITS['Qwen/Qwen3.5-2B']}" in done.stdout
    assert {f"/api/models/{repo}/revision/main" for repo in SOURCES} <= set(hub.requests)
    after = catalog.read_text().splitlines()
    # Only the four revision lines changed, each to its repository's commit with the branch as a comment.
    changed = [(old, new) for old, new in zip(before, after, strict=True) if old != new]
    assert len(changed) == 4 and all(old.strip() == "revision: main" for old, _ in changed)
    for (old, new), commit in zip(changed, COMMITS.values(), strict=True):
        indent = old[: len(old) - len(old.lstrip())]
        assert new.startswith(f"{indent}revision: {commit}  # main on ") and \
            new.endswith(" (rigctl models pin-revisions)")
    assert {k: v for k, v in snapshot(inv).items() if k != "group_vars/all/models.yml"} == others
    problems = [str(p) for p in check(Inventory.load(inv), [REPO / "roles"]) if "not a pinned commit" in str(p)]
    assert problems == []
    # Once pinned, a second run has nothing to do and leaves the file byte for byte.
    pinned = catalog.read_bytes()
    again = rigctl(inv, hub.endpoint)
    assert again.returncode == 0 and "already" in again.stdout and catalog.read_bytes() == pinned


class Liar(LocalServer):
    """An endpoint whose every API answer is ``body`` with ``status``, after ``delay`` seconds."""

    def __init__(self, body: bytes, status: int = 200, delay: float = 0.0, honest: str | None = None):
        self.body, self.status, self.delay, self.honest = body, status, delay, honest
        super().__init__()

    def handler(self) -> type[Handler]:
        server = self

        class Lies(Handler):
            server_requests = server.requests

            def do_GET(self) -> None:  # noqa: N802 (http.server's name)
                if server.honest and self.path.startswith(f"/api/models/{server.honest}/"):
                    self.send_body(json.dumps({"sha": "a" * 40}).encode(), "application/json")
                    return
                time.sleep(server.delay)
                self.send_response(server.status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(server.body)))
                self.end_headers()
                self.wfile.write(server.body)

        return Lies


@pytest.mark.parametrize(("lies", "args", "needle"), [
    (dict(body=b'{"sha": "abc123"}'), (), "sha 'abc123'"),
    (dict(body=json.dumps({"sha": "A" * 40}).encode()), (), "40 lower-case hex digits"),
    (dict(body=json.dumps({"sha": "a" * 40 + "\n"}).encode()), (), "names no commit"),
    (dict(body=json.dumps({"sha": ["a" * 40]}).encode()), (), "names no commit"),
    (dict(body=b'["not", "an", "object"]'), (), "a JSON list"),
    (dict(body=b"<html>rate limited</html>"), (), "the answer is not JSON"),
    (dict(body=b'{"error": "Repository not found"}', status=404), (), "HTTP 404"),
    (dict(body=b"{}", status=401), (), "needs HF_TOKEN"),
    (dict(body=b'{"sha": "' + b"a" * 40 + b'"}', delay=3.0), ("--timeout", "0.5"), "no answer within 0.5 s"),
    # The first source resolves, the second lies: nothing is written, not even the first.
    (dict(body=b'{"sha": null}', honest="Qwen/Qwen3.5-2B"), (), "gemma"),
], ids=["short-sha", "upper-case", "trailing-newline", "sha-list", "json-list", "not-json", "404", "401",
        "timeout", "first-honest"])
def test_an_endpoint_that_lies_or_stalls_is_one_error_and_writes_nothing(inv, lies, args, needle):
    before = snapshot(inv)
    with Liar(**lies) as liar:
        done = rigctl(inv, liar.base_url, *args)
    lines = [line for line in done.stderr.splitlines() if line.strip()]
    assert done.returncode == 1 and len(lines) == 1 and lines[0].startswith("error: "), done.stderr
    assert needle in lines[0] and "/api/models/" in lines[0] and "Traceback" not in done.stderr
    assert snapshot(inv) == before  # nothing written, no temporary file left


def test_a_templated_revision_is_refused_before_anything_is_asked(inv, hub):
    catalog = inv / "group_vars" / "all" / "models.yml"
    templated = catalog.read_text().replace("revision: main", 'revision: "{{ qwen_rev }}"', 1)
    catalog.write_text("qwen_rev: main\n" + templated)
    before = snapshot(inv)
    done = rigctl(inv, hub.endpoint)
    assert done.returncode == 2 and done.stderr.count("\n") == 1  # 2: the inventory is at fault
    assert "models_catalog.qwen3.5-2b.source.revision" in done.stderr and "is a template" in done.stderr
    assert snapshot(inv) == before and not hub.requests
