"""roles/models and rigctl.fleet.models without rigs: manifests against the gguf package's reader, pins."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
import role_modules
import yaml
from hf_server import HfRepo, HfServer
from make_hf_checkout import gguf_file
from models_support import gguf_reader_summary

from rigctl.fleet.models import parse_manifest
from rigctl.hostside.model_checkout import CheckoutError, confined_name, remote_code
from rigctl.inventory import Inventory
from rigctl.inventory.check import check

REPO = Path(__file__).resolve().parents[2]

LIBRARY = REPO / "roles" / "models" / "library"
COMMIT = "0123456789abcdef0123456789abcdef01234567"
REPO_ID = "owner/model"


def _artifact_module():
    return role_modules.load(REPO / "roles/models/library/models_artifact.py", "models_artifact")


# ------------------------------------------------------------------------------------------- no lab


def test_gguf_summary_matches_the_gguf_reader():
    path = gguf_file(Path(__import__("make_hf_checkout").cache_dir()))
    ours = _artifact_module().gguf_summary(str(path))
    theirs = gguf_reader_summary(path)
    assert ours["tensor_count"] == theirs["tensor_count"] == 272
    assert ours["types"] == dict(sorted(theirs["types"].items()))


def test_gguf_summary_refuses_a_truncated_file(tmp_path):
    path = gguf_file(Path(__import__("make_hf_checkout").cache_dir()))
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(path.read_bytes()[: path.stat().st_size // 2])
    module = _artifact_module()
    with pytest.raises(module.GGUFError, match="truncated"):
        module.gguf_summary(str(cut))


def test_parse_manifest_quant_mix():
    m = parse_manifest(json.dumps({
        "artifact": "q", "path": "/m/q.gguf", "bytes": 10, "sha256": "a" * 64, "tensor_count": 335,
        "types": {"Q4_0": {"tensors": 194, "bytes": 806_400_000}, "Q6_K": {"tensors": 1, "bytes": 417_200_000},
                  "F32": {"tensors": 140, "bytes": 300_000}}}))
    assert m.quant_mix == "194 Q4_0 (806.4 MB), 1 Q6_K (417.2 MB), 140 F32"


# ------------------------------------------------------------------------------------------- what a checkout holds


def _checkout(root: Path, **extra: str) -> Path:
    """A small checkout in the Hugging Face layout: configs, a tokenizer, weights; ``extra`` files on top."""
    root.mkdir(parents=True)
    (root / "config.json").write_text(json.dumps({"model_type": "llama", "hidden_size": 64}))
    (root / "tokenizer_config.json").write_text(json.dumps({"tokenizer_class": "PreTrainedTokenizerFast"}))
    (root / "model.safetensors").write_bytes(os.urandom(4096))
    for name, text in extra.items():
        (root / name).write_text(text)
    return root


def _fetch(tmp_path: Path, server: HfServer, **args) -> tuple[int, str, Path]:
    dest = tmp_path / "sources" / "m"
    dest.parent.mkdir(exist_ok=True)
    rc, out = role_modules.run(LIBRARY, "models_fetch", {
        "type": "hf", "dest": str(dest), "host": "rig", "name": "m", "endpoint": server.endpoint,
        "repo": REPO_ID, "revision": COMMIT, **args}, tmp_path)
    return rc, out, dest


def _failure(out: str) -> str:
    """The module's msg: the one line Ansible shows for a failed task."""
    return json.JSONDecoder().raw_decode(out, out.index("FAILED! => ") + len("FAILED! => "))[0]["msg"]


@pytest.mark.parametrize(("name", "why"), [
    ("../escape.txt", "leaves the directory or has an empty component"),
    ("{tmp}/absolute-escape.txt", "is absolute"),
    ("a//b", "leaves the directory or has an empty component"),
    ("./x", "leaves the directory or has an empty component"),
    ("a\\b", "has a control character or a backslash"),
    ("x\ny", "has a control character or a backslash"),
])
def test_fetch_refuses_a_listed_name_that_leaves_the_checkout(tmp_path: Path, name: str, why: str) -> None:
    name = name.format(tmp=tmp_path)
    repo = HfRepo(REPO_ID, COMMIT, _checkout(tmp_path / "served"), hostile={name: b"escaped\n"})
    with HfServer(repo) as server:
        rc, out, dest = _fetch(tmp_path, server)
    assert rc != 0
    assert _failure(out) == f"rig: model m: {REPO_ID}@{COMMIT}: listed file {name!r} {why}; refused"
    assert [r.split("?")[0] for r in server.requests] == [f"/api/models/{REPO_ID}/revision/{COMMIT}"]
    assert sorted(p.name for p in (tmp_path / "sources").iterdir()) == []
    assert not (tmp_path / "absolute-escape.txt").exists() and not (tmp_path / "escape.txt").exists()


def test_fetch_refuses_python_in_the_listing_before_downloading_anything(tmp_path: Path) -> None:
    served = _checkout(tmp_path / "served", **{"tokenization_evil.py": "open('/tmp/pwned', 'w')\n"})
    with HfServer(HfRepo(REPO_ID, COMMIT, served)) as server:
        rc, out, dest = _fetch(tmp_path, server)
    assert rc != 0
    assert _failure(out) == (f"rig: model m: {REPO_ID}@{COMMIT} carries Python the converter would run "
                             "(tokenization_evil.py); refused (models_catalog.m.trust_remote_code: true accepts it)")
    assert len(server.requests) == 1 and not (tmp_path / "sources" / "m").exists()


def test_fetch_refuses_an_auto_map_before_fetching_the_weights(tmp_path: Path) -> None:
    served = _checkout(tmp_path / "served")
    auto_map = {"auto_map": {"AutoTokenizer": ["other/repo--t.T", None]}}
    (served / "tokenizer_config.json").write_text(json.dumps(auto_map))
    with HfServer(HfRepo(REPO_ID, COMMIT, served)) as server:
        rc, out, dest = _fetch(tmp_path, server)
    assert rc != 0
    assert _failure(out) == (f"rig: model m: {REPO_ID} carries code the converter would run "
                             "(tokenizer_config.json auto_map); refused "
                             "(models_catalog.m.trust_remote_code: true accepts it)")
    assert not any(r.endswith("model.safetensors") for r in server.requests)
    assert sorted(p.name for p in (tmp_path / "sources").iterdir()) == []  # no checkout, no .partial


def test_fetch_takes_code_the_catalog_entry_trusts(tmp_path: Path) -> None:
    served = _checkout(tmp_path / "served", **{"modeling_x.py": "pass\n"})
    (served / "config.json").write_text(json.dumps({"auto_map": {"AutoModel": "modeling_x.X"}}))
    with HfServer(HfRepo(REPO_ID, COMMIT, served)) as server:
        rc, out, dest = _fetch(tmp_path, server, trust_remote_code=True)
    assert rc == 0, out
    assert sorted(p.name for p in dest.iterdir()) == [".rigctl-source.json", "config.json", "model.safetensors",
                                                      "modeling_x.py", "tokenizer_config.json"]


class _OtherCommitRepo(HfRepo):
    """Answers for the pinned commit with the listing of another one (a mirror serving what it likes)."""

    def listing(self) -> dict:
        return {**super().listing(), "sha": "f" * 40}


def test_fetch_refuses_a_listing_for_another_commit(tmp_path: Path) -> None:
    with HfServer(_OtherCommitRepo(REPO_ID, COMMIT, _checkout(tmp_path / "served"))) as server:
        rc, out, _ = _fetch(tmp_path, server)
    assert rc != 0
    assert _failure(out) == f"rig: model m: the listing of {REPO_ID}@{COMMIT} is for commit {'f' * 40}; refused"


@pytest.mark.parametrize("name", ["a.gguf", "sub/dir/model-00001-of-00002.safetensors", ".gitattributes"])
def test_plain_names_stay_as_they_are(name: str) -> None:
    assert confined_name(name) == name


@pytest.mark.parametrize("name", [None, 3, "", "..", "a/..", "a/../../b", "/etc/passwd", "a/", "a\0b", "\x7f"])
def test_names_that_are_not_plain_relative_paths_are_refused(name: object) -> None:
    with pytest.raises(CheckoutError):
        confined_name(name)


def test_remote_code_finds_python_and_any_json_auto_map(tmp_path: Path) -> None:
    root = _checkout(tmp_path / "c")
    assert remote_code(str(root)) == []
    (root / "processor").mkdir()
    (root / "processor" / "preprocessor_config.json").write_text(json.dumps({"auto_map": {"AutoProcessor": "p.P"}}))
    (root / "custom.PY").write_text("")
    (root / "broken.json").write_text("{not json")
    assert remote_code(str(root)) == ["custom.PY", "processor/preprocessor_config.json auto_map"]


def test_convert_refuses_a_checkout_with_code_before_the_converter_runs(tmp_path: Path) -> None:
    """A controller checkout (or one fetched before the rule) meets the same refusal at the last step."""
    checkout = _checkout(tmp_path / "ckpt")
    (checkout / "config.json").write_text(json.dumps({"auto_map": {"AutoConfig": "configuration_x.C"}}))
    marker = tmp_path / "converter-ran"
    args = {"name": "m-bf16", "model": "m", "path": str(tmp_path / "out" / "m-bf16.gguf"), "kind": "convert",
            "input": str(checkout), "argv": ["/bin/sh", "-c", f"touch {marker}"], "host": "rig"}
    rc, out = role_modules.run(LIBRARY, "models_artifact", args, tmp_path)
    assert rc != 0
    assert _failure(out) == (f"rig: m-bf16: checkout {checkout} carries code the converter would run "
                             "(config.json auto_map); refused (models_catalog.m.trust_remote_code: true accepts it)")
    assert not marker.exists()
    rc, out = role_modules.run(LIBRARY, "models_artifact", {**args, "trust_remote_code": True}, tmp_path)
    # Trusted, it goes on to run the converter (in its systemd sandbox, which this machine may not have).
    assert rc != 0 and "carries code" not in _failure(out) and "touch" in _failure(out)


def test_the_command_runs_as_a_sandboxed_transient_unit() -> None:
    module = _artifact_module()
    sandbox = module.Sandbox("rigctl-models-m-bf16-0123abcd")
    argv = sandbox.argv(["/venv/bin/python", "convert.py", "--outfile", sandbox.output("m.gguf")], {"X": "1"}, 60)
    assert argv[:2] == ["systemd-run", "--unit=rigctl-models-m-bf16-0123abcd"] and "--wait" in argv
    properties = {a.removeprefix("--property=") for a in argv if a.startswith("--property=")}
    assert {"DynamicUser=yes", "PrivateNetwork=yes", "ProtectSystem=strict", "ProtectHome=yes",
            "NoNewPrivileges=yes", "CapabilityBoundingSet=", "StateDirectory=rigctl-models-m-bf16-0123abcd",
            "RuntimeMaxSec=60"} <= properties
    assert not any(p.startswith(("ReadWritePaths", "User=")) for p in properties)  # its state directory only
    # Through the shell that drops the variables llama.cpp reads, then execs the command itself.
    command = argv[argv.index("--") + 1:]
    assert command[:2] == ["/bin/sh", "-c"] and command[4:] == [
        "/venv/bin/python", "convert.py", "--outfile", "/var/lib/rigctl-models-m-bf16-0123abcd/m.gguf"]
    from rigctl.hostside.sandbox import CONFIG_HOME

    assert {"InaccessiblePaths=-/etc/llama.cpp", f"Environment=XDG_CONFIG_HOME={CONFIG_HOME}"} <= properties
    assert "--setenv=X=1" in argv


# ------------------------------------------------------------------------------------------- the catalog


def _catalog_inventory(tmp_path: Path, entry: dict) -> Inventory:
    inv = tmp_path / "inventory"
    shutil.copytree(REPO / "inventory" / "lab", inv)
    (inv / "group_vars" / "all" / "models_test.yml").write_text(yaml.safe_dump({"models_catalog": {"m": entry}}))
    return Inventory.load(inv)


_CONVERTED = {"source": {"type": "hf", "repo": REPO_ID, "revision": COMMIT},
              "artifacts": {"m-bf16": {"type": "convert", "outtype": "bf16"}}}


def test_trust_remote_code_is_a_boolean_in_the_schema(tmp_path: Path) -> None:
    ok = check(_catalog_inventory(tmp_path / "a", {**_CONVERTED, "trust_remote_code": True}), [REPO / "roles"])
    assert [p for p in ok if p.severity == "error" and "models_catalog" in p.key] == []
    bad = check(_catalog_inventory(tmp_path / "b", {**_CONVERTED, "trust_remote_code": "sure"}), [REPO / "roles"])
    assert [str(p) for p in bad if "models_catalog" in p.key] == [
        "group all: models_catalog.m.trust_remote_code: Input should be a valid boolean (got 'sure')"]


def test_a_converted_source_at_a_branch_is_flagged_for_the_role_to_refuse(tmp_path: Path) -> None:
    entry = {**_CONVERTED, "source": {**_CONVERTED["source"], "revision": "main"}}
    problems = check(_catalog_inventory(tmp_path, entry), [REPO / "roles"])
    problems = [str(p) for p in problems if "models_catalog" in p.key]
    assert problems == ["group all: models_catalog.m.source.revision: warning: 'main' is a branch or tag, not a pinned "
                        "commit; the models role refuses to convert it until it is one (40 hex digits)"]


def test_the_role_refuses_to_convert_a_source_at_a_branch_in_one_line(tmp_path: Path) -> None:
    """The models role's preflight, run by ansible-playbook on localhost: the refusal comes before anything."""
    catalog = {"m": {**_CONVERTED, "source": {**_CONVERTED["source"], "revision": "main"}},
               "pinned": {**_CONVERTED, "artifacts": {"p-bf16": {"type": "convert", "outtype": "bf16"}}}}
    (tmp_path / "play.yml").write_text(
        "- hosts: localhost\n  gather_facts: false\n  tasks:\n"
        "    - ansible.builtin.include_role: {name: models, tasks_from: preflight}\n")
    (tmp_path / "ansible.cfg").write_text(f"[defaults]\nroles_path = {REPO / 'roles'}\n")
    done = subprocess.run(
        [str(Path(sys.executable).with_name("ansible-playbook")), "-i", "localhost,", "-c", "local",
         str(tmp_path / "play.yml"), "-e", json.dumps({"models_catalog": catalog, "models_work_dir": str(tmp_path),
                                                       "ansible_python_interpreter": sys.executable})],
        cwd=tmp_path, capture_output=True, text=True, timeout=300, check=False,
        env={**os.environ, "ANSIBLE_CONFIG": str(tmp_path / "ansible.cfg"), "ANSIBLE_NOCOLOR": "1",
             "ANSIBLE_LOCALHOST_WARNING": "0"})
    out = done.stdout + done.stderr
    assert done.returncode != 0, out
    assert ('"msg": "localhost: models_catalog.m.source.revision is \\"main\\", a branch or tag: a source that is '
            'converted must pin a commit (40 hex digits)"') in out, out


# ----------------------------------------------------------------- what the sandbox leaves (issue 39, item 1)


def _left_in(tmp_path: Path) -> tuple:
    """A Sandbox whose state directory is a temporary one, and a file of root's it must never touch."""
    module = _artifact_module()
    sandbox = module.Sandbox("rigctl-models-m-q4_0-0123abcd")
    state = tmp_path / "private" / sandbox.state
    state.mkdir(parents=True)
    sandbox.dir = sandbox.private = str(state)
    key = tmp_path / "etc" / "api-key"
    key.parent.mkdir()
    key.write_text("sk-secret\n")
    key.chmod(0o640)
    (tmp_path / "models").mkdir()
    return module, sandbox, state, key


def test_output_left_as_a_link_to_a_file_of_roots_is_refused_and_that_file_untouched(tmp_path: Path) -> None:
    module, sandbox, state, key = _left_in(tmp_path)
    (state / "m.gguf").symlink_to(key)
    dest = tmp_path / "models" / ".m.gguf.partial"
    if os.geteuid() == 0:  # owned by someone else, so that a chown to root shows
        os.chown(key, 1234, 5678)
    before = key.stat()
    refused: OSError | None = None
    try:
        sandbox.take("m.gguf", str(dest))
    except OSError as exc:
        refused = exc
    after = key.stat()
    assert (after.st_uid, after.st_gid, oct(after.st_mode)) == (before.st_uid, before.st_gid, oct(before.st_mode))
    assert isinstance(refused, module.UnsafeOutput)
    assert str(refused.strerror).endswith("m.gguf is a symbolic link, not the command's output; refused")
    assert key.read_text() == "sk-secret\n" and not dest.exists() and not dest.is_symlink()


def test_output_left_as_a_hard_link_or_a_fifo_is_refused(tmp_path: Path) -> None:
    module, sandbox, state, key = _left_in(tmp_path)
    os.link(key, state / "linked.gguf")
    os.mkfifo(state / "fifo.gguf")
    for name, kind in (("linked.gguf", "a hard link to another file"), ("fifo.gguf", "not a regular file")):
        with pytest.raises(module.UnsafeOutput, match=kind):
            sandbox.take(name, str(tmp_path / "models" / name))
    assert key.stat().st_mode & 0o777 == 0o640


def test_a_plain_output_is_taken_roots_0644_and_an_absent_one_is_none(tmp_path: Path) -> None:
    _, sandbox, state, _ = _left_in(tmp_path)
    (state / "m.gguf").write_bytes(b"GGUF data")
    (state / "m.gguf").chmod(0o600)
    dest = tmp_path / "models" / ".m.gguf.partial"
    dest.symlink_to(tmp_path / "etc" / "api-key")  # a stale link where the output goes: replaced, not followed
    assert sandbox.take("m.gguf", str(dest)) is True
    found = dest.lstat()
    assert dest.read_bytes() == b"GGUF data" and found.st_mode == 0o100644 and found.st_uid == 0
    assert (tmp_path / "etc" / "api-key").read_text() == "sk-secret\n"
    assert sandbox.take("none.gguf", str(tmp_path / "models" / "none.gguf")) is False


def test_output_on_another_file_system_is_copied_into_a_new_file(tmp_path: Path) -> None:
    from rigctl.hostside.sandbox import take_output

    shm = Path("/dev/shm")
    if not shm.is_dir() or os.stat(shm).st_dev == os.stat(tmp_path).st_dev:
        pytest.skip("needs /dev/shm on a file system of its own")
    with tempfile.TemporaryDirectory(dir=shm) as state:
        Path(state, "m.gguf").write_bytes(b"GGUF" * 1000)
        dest = tmp_path / "m.gguf"
        assert take_output(state, "m.gguf", str(dest), uid=os.getuid(), gid=os.getgid()) is True
        assert dest.read_bytes() == b"GGUF" * 1000 and dest.stat().st_mode == 0o100644


def test_the_models_units_have_the_server_units_hardening_and_no_sockets() -> None:
    from rigctl.hostside import sandbox as hardening

    argv = _artifact_module().Sandbox("rigctl-models-m-bf16-0123abcd").argv(["/bin/true"], {}, 60)
    properties = [a.removeprefix("--property=") for a in argv if a.startswith("--property=")]
    server = [line for line in hardening.properties(()) if not line.startswith("RestrictAddressFamilies=")]
    assert all(line in properties for line in server), set(server) - set(properties)
    families = [line for line in properties if line.startswith("RestrictAddressFamilies=")]
    assert "SystemCallFilter=@system-service" in properties and len(families) == 1
    assert families[0].startswith("RestrictAddressFamilies=~")  # a deny list: no family below is reachable
    assert {"AF_UNIX", "AF_INET", "AF_INET6", "AF_NETLINK", "AF_PACKET"} <= set(families[0].split("~")[1].split())


def test_the_conversion_requirements_pin_every_package_with_its_hashes():
    """The conversion venv is installed with --require-hashes from the file the role ships: every requirement
    is one exact version with at least one sha256, the platform wheels (x86_64 and aarch64) each hashed, and
    torch is the CPU wheel of the version the project's tools pin."""
    import re

    from make_hf_checkout import TOOLS

    text = (REPO / "roles" / "models" / "files" / "convert-requirements.txt").read_text()
    logical = [line for line in text.replace("\\\n", " ").splitlines() if line.strip() and not line.startswith("#")]
    pins = {}
    for line in logical:
        requirement, *options = line.split()
        match = re.fullmatch(r"([a-z0-9-]+)==([0-9][0-9a-z.+]*)", requirement)
        assert match, f"not one exact version: {line}"
        hashes = [option for option in options if re.fullmatch(r"--hash=sha256:[0-9a-f]{64}", option)]
        assert hashes and len(hashes) == len(options), f"an option that is not a sha256: {line}"
        pins[match[1]] = (match[2], len(hashes))
    assert len(pins) == len(logical) >= 40
    assert pins["torch"][0] == next(t.split("==")[1] for t in TOOLS if t.startswith("torch==")) + "+cpu"
    for compiled in ("numpy", "pyyaml", "regex", "safetensors", "tokenizers", "sentencepiece", "protobuf"):
        assert pins[compiled][1] == 2, f"{compiled}: one wheel per platform (x86_64, aarch64)"
    converter = (REPO / "roles" / "models" / "tasks" / "converter.yml").read_text()
    assert converter.count("--require-hashes") == 2 and "requirements-convert_hf_to_gguf" not in converter
