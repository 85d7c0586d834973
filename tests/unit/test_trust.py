"""The trust boundary without the lab: path checks, secret masking, token origins (local HTTP servers on
loopback), what a pull accepts from a rig's records, MCP run and task references."""

from __future__ import annotations

import dataclasses
import json
import logging
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
import role_modules
from labrigs_support import LAB_INVENTORY, REPO

from rigctl import jobs
from rigctl.errors import ConfigError, TrustError
from rigctl.evals import datasets
from rigctl.fleet.deploy import ansible_env
from rigctl.hostside import stamp as host_stamp
from rigctl.inventory import Inventory
from rigctl.inventory.check import check_host
from rigctl.inventory.schema import SCHEMA
from rigctl.llama_http import Endpoint
from rigctl.results.record import RUN_ID, RawFile, RunRecord, new_run_id
from rigctl.trust import (
    RedactingFilter,
    inside,
    is_secret_name,
    redact_argv,
    register_secret,
    relative_path,
    same_origin,
)

TOKEN = "hf_test_token_9c2e71"


# ----------------------------------------------------------------------------------------------- paths


@pytest.mark.parametrize("bad", ["/etc/hostname", "../x", "a/../../x", "", ".", "a\\b", "a\0b", None, 3])
def test_relative_path_refuses_what_leaves_its_directory(bad) -> None:
    with pytest.raises(TrustError, match=r"^raw file: "):
        relative_path(bad, "raw file")


def test_inside_follows_symlinks_out_of_the_root(tmp_path: Path) -> None:
    root = tmp_path / "store"
    (root / "desktop").mkdir(parents=True)
    outside = tmp_path / "elsewhere"
    outside.mkdir()
    (root / "link").symlink_to(outside)
    assert inside(root, "desktop/run", "run") == (root / "desktop" / "run").resolve()
    with pytest.raises(TrustError, match="outside"):
        inside(root, "link/run", "run")


def test_run_ids_have_the_shape_rigctl_makes() -> None:
    for kind in ("bench", "eval", "spec", "server-speed"):
        assert RUN_ID.match(new_run_id(kind))
    for bad in ("../ESCAPED", "/tmp/x", "eval-20261130T051200Z-3f9a/..", "eval-x", "other-20261130T051200Z-3f9a"):
        assert not RUN_ID.match(bad)


# ----------------------------------------------------------------------------------------------- secrets


def test_secret_names() -> None:
    assert all(map(is_secret_name, ["llama_server_api_key", "--api-key", "models_hf_token", "HF_TOKEN",
                                    "ansible_become_password"]))
    assert not any(map(is_secret_name, ["--api-key-file", "max_tokens", "tokenizer", "vault_password_file",
                                        "rigctl_known_hosts"]))


def test_the_controller_masks_a_command_line_as_the_host_does() -> None:
    # One rule (rigctl/hostside/masking.py): llama.cpp's short -hft is --hf-token, which no name rule tells.
    argv = ["llama-server", "-hft", "hf_abcd", "--hf-token=hf_efgh", "--api-key", "sk-1234", "--api-key-file", "/k",
            "--password=pw-5678", "-c", "4096"]
    masked = ["llama-server", "-hft", "***", "--hf-token=***", "--api-key", "***", "--api-key-file", "/k",
              "--password=***", "-c", "4096"]
    assert redact_argv(argv) == host_stamp.mask_argv(argv) == masked


def test_command_lines_in_records_are_masked() -> None:
    assert redact_argv(["rigctl", "eval", "run", "--api-key", "k-81f2a", "--hf-token=t-9a0c", "-n", "3"]) == \
        ["rigctl", "eval", "run", "--api-key", "***", "--hf-token=***", "-n", "3"]
    register_secret("sk-registered-42")
    assert redact_argv(["x", "--url=http://h/?key=sk-registered-42"]) == ["x", "--url=http://h/?key=***"]


def test_endpoint_repr_and_log_lines_never_show_the_key(caplog: pytest.LogCaptureFixture) -> None:
    endpoint = Endpoint("http://127.0.0.1:8080", "sk-endpoint-7d1e", "desktop/smollm2")
    assert "sk-endpoint-7d1e" not in repr(endpoint) and "***" in repr(endpoint)
    assert "sk-endpoint-7d1e" not in repr(dataclasses.replace(endpoint, label="x"))
    logger = logging.getLogger("rigctl.test_trust")
    handler = logging.StreamHandler()
    handler.addFilter(RedactingFilter())
    records: list[str] = []
    handler.emit = lambda record: records.append(record.getMessage())  # type: ignore[method-assign]
    logger.addHandler(handler)
    try:
        logger.warning("asked %s with %s", endpoint.url, endpoint.headers())
    finally:
        logger.removeHandler(handler)
    assert records and "sk-endpoint-7d1e" not in records[0] and "Bearer ***" in records[0]


def test_inventory_check_never_echoes_a_secret() -> None:
    inventory = Inventory.load(LAB_INVENTORY)
    host = inventory.host("desktop")
    bad = dataclasses.replace(host, vars={**host.vars, "llama_server_api_key": 987654321})
    problems = [str(p) for p in check_host(bad, set(SCHEMA))]
    assert "host desktop: llama_server_api_key: Input should be a valid string (got ***)" in problems
    assert not [p for p in problems if "987654321" in p]


def test_inventory_check_warns_for_a_server_open_beyond_loopback_without_a_key() -> None:
    host = Inventory.load(LAB_INVENTORY).host("desktop")
    assert host.vars["llama_server_api_key"]  # the shipped lab carries a key: no warning
    assert not [p for p in check_host(host, set()) if "without llama_server_api_key" in p.message]
    open_host = dataclasses.replace(host, vars={**host.vars, "llama_server_api_key": ""})
    warned = [p for p in check_host(open_host, set()) if "without llama_server_api_key" in p.message]
    assert warned and all(p.severity == "warning" and "0.0.0.0" in p.message for p in warned)
    loopback = dataclasses.replace(open_host, vars={**open_host.vars, "llama_server_bind_address": "127.0.0.1"})
    assert not [p for p in check_host(loopback, set()) if "without llama_server_api_key" in p.message]


def test_rigs_inventory_serves_on_loopback() -> None:
    for host in Inventory.load(REPO / "inventory" / "rigs").hosts.values():
        assert not [p for p in check_host(host, set()) if "without llama_server_api_key" in p.message]


def test_ansible_runs_check_host_keys_whatever_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ANSIBLE_HOST_KEY_CHECKING", "False")
    assert ansible_env(REPO)["ANSIBLE_HOST_KEY_CHECKING"] == "True"


# ----------------------------------------------------------------------------------------------- token origins


class _Recorder(BaseHTTPRequestHandler):
    """Answers GET with a body, or a redirect to ``server.redirect``; keeps each request's Authorization."""

    def do_GET(self) -> None:  # noqa: N802
        self.server.seen.append(self.headers.get("Authorization"))  # type: ignore[attr-defined]
        redirect = self.server.redirect  # type: ignore[attr-defined]
        if redirect:
            self.send_response(302)
            self.send_header("Location", redirect + self.path)
            self.send_header("Content-Length", "0")
            self.end_headers()
            return
        body = b'{"id": 1}\n'
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args: object) -> None:
        pass


def _serve(port: int = 0) -> ThreadingHTTPServer:
    server = ThreadingHTTPServer(("127.0.0.1", port), _Recorder)
    server.seen = []  # type: ignore[attr-defined]
    server.redirect = None  # type: ignore[attr-defined]
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server


def _url(server: ThreadingHTTPServer) -> str:
    return f"http://127.0.0.1:{server.server_address[1]}"


@pytest.fixture
def lookalike() -> Iterator[tuple[ThreadingHTTPServer, ThreadingHTTPServer]]:
    """Two servers whose URLs share a prefix: the endpoint on port P, the lookalike on port P*10+d."""
    for port in range(1100, 6553):
        try:
            endpoint = _serve(port)
        except OSError:
            continue
        for digit in range(10):
            try:
                other = _serve(port * 10 + digit)
            except OSError:
                continue
            try:
                yield endpoint, other
            finally:
                for server in (endpoint, other):
                    server.shutdown()
                    server.server_close()
            return
        endpoint.shutdown()
        endpoint.server_close()
    pytest.skip("no pair of free loopback ports sharing a prefix")


@pytest.fixture
def pair() -> Iterator[tuple[ThreadingHTTPServer, ThreadingHTTPServer]]:
    endpoint, other = _serve(), _serve()
    yield endpoint, other
    for server in (endpoint, other):
        server.shutdown()
        server.server_close()


def test_origin_is_scheme_host_and_port_exactly() -> None:
    assert same_origin("http://127.0.0.1:1810/x", "http://127.0.0.1:1810")
    assert same_origin("https://hub.example/x", "https://HUB.example:443/")
    assert not same_origin("http://127.0.0.1:18100/x", "http://127.0.0.1:1810")
    assert not same_origin("https://127.0.0.1:1810/x", "http://127.0.0.1:1810")
    assert not same_origin("http://127.0.0.1.evil:1810/x", "http://127.0.0.1:1810")


def test_the_token_origin_rule_has_one_home() -> None:
    """The controller's downloads and the models role's fetch module take the rule from one host-side module."""
    import ast

    from rigctl import trust
    from rigctl.evals import datasets as datasets_module
    from rigctl.hostside import token_origin

    assert trust.same_origin is token_origin.same_origin
    assert datasets_module.bearer_header is token_origin.bearer_header
    source = (REPO / "roles" / "models" / "library" / "models_fetch.py").read_text()
    tree = ast.parse(source)
    assert any(isinstance(n, ast.ImportFrom) and n.module == "ansible.module_utils.token_origin" for n in tree.body)
    own = [n.name for n in ast.walk(tree)
           if isinstance(n, ast.FunctionDef | ast.ClassDef) and "origin" in n.name.lower()]
    assert not own, f"models_fetch defines its own origin rule: {own}"


def test_dataset_token_never_goes_to_a_lookalike_endpoint(lookalike, tmp_path, monkeypatch) -> None:
    endpoint, other = lookalike
    monkeypatch.setenv("HF_ENDPOINT", _url(endpoint))
    monkeypatch.setenv("HF_TOKEN", TOKEN)
    assert _url(other).startswith(_url(endpoint))
    datasets._download("k", f"{_url(other)}/datasets/r/resolve/x/f.jsonl", tmp_path / "f.jsonl", 10)
    datasets._download("k", f"{_url(endpoint)}/datasets/r/resolve/x/f.jsonl", tmp_path / "g.jsonl", 10)
    assert other.seen == [None]
    assert endpoint.seen == [f"Bearer {TOKEN}"]  # the endpoint itself still gets it


def test_dataset_token_dropped_on_a_cross_origin_redirect(pair, tmp_path, monkeypatch) -> None:
    endpoint, other = pair
    endpoint.redirect = _url(other)
    monkeypatch.setenv("HF_ENDPOINT", _url(endpoint))
    monkeypatch.setenv("HF_TOKEN", TOKEN)
    digest = datasets._download("k", f"{_url(endpoint)}/datasets/r/resolve/x/f.jsonl", tmp_path / "f.jsonl", 10)
    assert (tmp_path / ".f.jsonl.part").read_bytes() == b'{"id": 1}\n' and len(digest) == 64
    assert endpoint.seen == [f"Bearer {TOKEN}"]
    assert other.seen == [None]


def _models_fetch():
    return role_modules.load(REPO / "roles" / "models" / "library" / "models_fetch.py", "models_fetch")


def test_models_downloader_token_only_to_its_endpoint(lookalike, pair, tmp_path) -> None:
    fetch = _models_fetch()
    endpoint, other = lookalike
    fetch.download(f"{_url(other)}/r/resolve/c/m.gguf", str(tmp_path / "a"), TOKEN, _url(endpoint), 10, None, "")
    fetch.download(f"{_url(endpoint)}/r/resolve/c/m.gguf", str(tmp_path / "b"), TOKEN, _url(endpoint), 10, None, "")
    assert other.seen == [None] and endpoint.seen == [f"Bearer {TOKEN}"]

    hub, cdn = pair
    hub.redirect = _url(cdn)
    fetch.download(f"{_url(hub)}/r/resolve/c/m.gguf", str(tmp_path / "c"), TOKEN, _url(hub), 10, None, "")
    assert (tmp_path / "c").read_bytes() == b'{"id": 1}\n'
    assert hub.seen == [f"Bearer {TOKEN}"] and cdn.seen == [None]


# ----------------------------------------------------------------------------------------------- pull vetting


def _record(**changes) -> dict:
    record = RunRecord(id="bench-20261201T101500Z-0a1b", kind="bench", host="desktop", started="2026-12-01T10:15:00Z",
                       status="done", files=[RawFile("cells.jsonl", "0" * 64, 10)])
    return {**record.to_dict(), **changes}


@pytest.mark.parametrize(("changes", "message"), [
    ({"id": "bench-20261201T101500Z-ffff"}, "has id"),
    ({"host": "laptop"}, "names host"),
    ({"files": [{"path": "/etc/hostname", "sha256": "0" * 64, "bytes": 1}]}, "is not a relative path|leaves"),
    ({"files": [{"path": "../../x", "sha256": "0" * 64, "bytes": 1}]}, "leaves its directory"),
    ({"files": [{"path": "run.json", "sha256": "0" * 64, "bytes": 1}]}, "the record itself"),
    ({"surprise": 1}, "unknown keys"),
])
def test_a_record_that_lies_is_refused(changes, message) -> None:
    with pytest.raises((TrustError, ConfigError), match=message):
        jobs._vetted_record("desktop", "bench-20261201T101500Z-0a1b", _record(**changes))


def test_cells_pointing_outside_the_run_are_refused(tmp_path: Path) -> None:
    record = RunRecord.from_dict(_record(files=[{"path": "cells.jsonl", "sha256": "0" * 64, "bytes": 1},
                                                {"path": "llama-bench/cell-001.json", "sha256": "0" * 64,
                                                 "bytes": 1}]))
    cells = tmp_path / "cells.jsonl"
    cells.write_text(json.dumps({"index": 1, "raw": "llama-bench/cell-001.json", "log": None}) + "\n")
    jobs._check_references(tmp_path, record)
    for raw in ("/etc/hostname", "../other/cell.json", "llama-bench/not-listed.json"):
        cells.write_text(json.dumps({"index": 1, "raw": raw}) + "\n")
        with pytest.raises(TrustError, match=r"cells.jsonl line 1 raw"):
            jobs._check_references(tmp_path, record)


# ----------------------------------------------------------------------------------------------- MCP references


def test_mcp_run_and_task_references_stay_inside(tmp_path: Path) -> None:
    from rigctl.services.mcp_server import FleetTools

    store = tmp_path / "results"
    run_id = "eval-20261201T101500Z-0a1b"
    RunRecord(id=run_id, kind="eval", host="desktop", started="x", status="done").save(store / "desktop" / run_id)
    outside = tmp_path / "outside" / "eval-20261201T101500Z-0c0d"
    RunRecord(id=outside.name, kind="eval", host="laptop", started="x", status="done").save(outside)
    (store / "laptop").symlink_to(outside.parent)
    tasks = tmp_path / "tasks"
    tasks.mkdir()
    (tasks / "mine.yaml").write_text("name: mine\n")
    (tmp_path / "secret.yaml").write_text("name: secret\n")
    tools = FleetTools(Inventory.load(LAB_INVENTORY), results_root=store, task_dirs=[tasks])

    assert tools.run(run_id).path == store / "desktop" / run_id
    assert tools.run(f"desktop/{run_id}").id == run_id
    for bad in (str(store / "desktop" / run_id), f"../results/desktop/{run_id}", f"desktop/../desktop/{run_id}",
                "/etc", f"laptop/{outside.name}"):
        with pytest.raises(TrustError):
            tools.run(bad)

    assert tools.task("gsm8k").endswith("rigctl/tasks/gsm8k.yaml")
    assert tools.task("mine") == str(tasks / "mine.yaml") and tools.task("mine.yaml") == str(tasks / "mine.yaml")
    for bad in (str(tmp_path / "secret.yaml"), "../secret.yaml", "/etc/passwd"):
        with pytest.raises(TrustError):
            tools.task(bad)
    with pytest.raises(ConfigError, match="no such task"):
        tools.task("nowhere")


def test_a_secret_is_masked_in_every_form_a_message_quotes_it() -> None:
    from rigctl.trust import redact

    secret = "sk-7d1e'\"é\n"
    quoted = {"raw": f"key {secret} end", "repr": f"got {secret!r}", "bytes": f"header {secret.encode()!r}",
              "json": f"body {json.dumps(secret)}", "stripped": f"Bearer {secret.strip()}"}
    for form, text in quoted.items():
        masked = redact(text, [secret])
        assert "7d1e" not in masked and "***" in masked, form


def test_inventory_check_masks_a_token_inside_a_value_it_quotes() -> None:
    """A model source that names no type is quoted whole in the error: its token is not."""
    inventory = Inventory.load(LAB_INVENTORY)
    host = inventory.host("desktop")
    catalog = {"m": {"source": {"repo": "a/b", "revision": "main", "token": "hf_Zq81ProbablyLive"},
                     "artifacts": {"x": {"type": "file", "file": "x.gguf"}}}}
    problems = [str(p) for p in check_host(dataclasses.replace(host, vars={**host.vars, "models_catalog": catalog}),
                                           set(SCHEMA))]
    quoted = [p for p in problems if p.startswith("host desktop: models_catalog.m.source: ")]
    assert quoted and "'token': '***'" in quoted[0]
    assert not [p for p in problems if "hf_Zq81" in p]
