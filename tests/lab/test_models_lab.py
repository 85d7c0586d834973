"""roles/models on the lab rigs: hf over a local HF_ENDPOINT and controller sources -> bf16 -> Q4_0 on the rigs,
served by llama-server.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import time
from pathlib import Path

import pytest
import yaml
from hf_server import HfRepo, HfServer
from make_hf_checkout import make_checkout
from models_support import gguf_reader_summary

from rigctl.fleet.deploy import run_playbook
from rigctl.fleet.models import list_artifacts, parse_manifest, pin, problems, verify
from rigctl.inventory import Inventory
from rigctl.ssh import SshClient, SshTarget

REPO = Path(__file__).resolve().parents[2]

REVISION = "0123456789abcdef0123456789abcdef01234567"
CALIBRATION = Path(__file__).resolve().parents[1] / "fixtures" / "calibration.txt"
BRIDGE = f"10.213.{os.environ.get('RIGCTL_LAB_SLOT') or 0}.1"
pytestmark = pytest.mark.hf_checkout


# ------------------------------------------------------------------------------------------- lab


@pytest.fixture(scope="module")
def checkout() -> Path:
    return make_checkout()


@pytest.fixture
def inv_dir(tmp_path, lab_served, checkout) -> Path:
    """A copy of the lab inventory whose catalog has SmolLM2 as an hf and a controller checkout."""
    inv = tmp_path / "inventory"
    shutil.copytree(REPO / "inventory" / "lab", inv)
    (inv / "group_vars" / "all" / "models_test.yml").write_text(yaml.safe_dump({
        "models_catalog": {
            "smollm2-hf": {"source": {"type": "hf", "repo": "HuggingFaceTB/SmolLM2-135M-Instruct",
                                      "revision": REVISION},
                           "artifacts": {"hf-bf16": {"type": "convert", "outtype": "bf16"},
                                         "hf-q4_0": {"type": "quantize", "from": "hf-bf16", "qtype": "Q4_0"}}},
            "smollm2-ckpt": {"source": {"type": "controller", "path": str(checkout)},
                             "artifacts": {"ckpt-bf16": {"type": "convert", "outtype": "bf16"},
                                           "ckpt-q4_0": {"type": "quantize", "from": "ckpt-bf16",
                                                         "qtype": "Q4_0"},
                                           "ckpt-q4_k-im": {"type": "quantize", "from": "ckpt-bf16",
                                                            "qtype": "Q4_K_M",
                                                            "imatrix": {"calibration": str(CALIBRATION),
                                                                        "ctx_size": 128, "chunks": 2}}}},
        },
    }))
    return inv


def provision(inv_dir: Path, endpoint: str, **extravars):
    inv = Inventory.load(inv_dir)
    return run_playbook(inv, tags=["models"], extravars={"models_hf_endpoint": endpoint, **extravars},
                        timeout=1800)


def _total(result, field):
    return sum(getattr(h, field) for h in result.hosts.values())


@pytest.mark.lab
def test_pipeline_on_the_rigs(inv_dir, checkout, tmp_path):
    repo = HfRepo("HuggingFaceTB/SmolLM2-135M-Instruct", REVISION, checkout)
    with HfServer(repo, BRIDGE) as server:
        started = time.monotonic()
        first = provision(inv_dir, server.endpoint)
        first_s = time.monotonic() - started
        first.raise_for_failures()
        second = provision(inv_dir, server.endpoint)
        second.raise_for_failures()
    print(f"first run {first_s:.1f} s, no-op rerun {second.duration:.1f} s")
    assert _total(second, "changed") == 0
    inv = Inventory.load(inv_dir)
    manifests = Path(inv.hosts["desktop"].vars["models_controller_manifests"])
    for host in ("desktop", "laptop"):
        for art in ("hf-bf16", "hf-q4_0", "ckpt-bf16", "ckpt-q4_0", "ckpt-q4_k-im"):
            m = parse_manifest((manifests / host / f"{art}.json").read_text(), host)
            assert m.llama_cpp["commit"] == "b11434" and m.command and m.wall_s > 0
    # The importance matrix: made from the calibration text by llama-imatrix, passed to llama-quantize.
    imq = parse_manifest((manifests / "desktop" / "ckpt-q4_k-im.json").read_text())
    imatrix = imq.raw["imatrix"]
    assert "llama-imatrix" in imatrix["command"] and "--chunks 2" in imatrix["command"]
    assert f"--imatrix {imatrix['path']}" in imq.command and "Q4_K" in imq.types
    assert imatrix["calibration_id"] == "sha256:" + hashlib.sha256(CALIBRATION.read_bytes()).hexdigest()
    hf_q4 = parse_manifest((manifests / "desktop" / "hf-q4_0.json").read_text())
    assert hf_q4.raw["input"]["id"].startswith("sha256:")
    assert "Q4_0" in hf_q4.types and "llama-quantize" in hf_q4.command
    assert REVISION in json.dumps(parse_manifest((manifests / "desktop" / "hf-bf16.json").read_text()).raw)
    # The manifest against the gguf package's reading of the very file.
    local = tmp_path / "hf-q4_0.gguf"
    host = inv.hosts["desktop"]
    with SshClient(SshTarget.from_host(host)) as ssh:
        ssh.get(hf_q4.path, local, timeout=120, sha256=hf_q4.sha256)
        theirs = gguf_reader_summary(local)
        assert hf_q4.tensor_count == theirs["tensor_count"]
        assert {k: (v.tensors, v.bytes) for k, v in hf_q4.types.items()} == {
            k: (v["tensors"], v["bytes"]) for k, v in theirs["types"].items()}
        # The Q4_0 loads in llama-server and answers.
        ssh.run(f"systemd-run --unit=rigctl-models-test --collect /opt/llama.cpp/current/bin/llama-server "
                f"-m {hf_q4.path} --host 127.0.0.1 --port 18080 -c 512 -t 2", timeout=30)
        try:
            reply = ssh.run(
                "for i in $(seq 60); do curl -sf localhost:18080/health >/dev/null && break; sleep 1; done; "
                "curl -sf localhost:18080/completion -d '{\"prompt\": \"The capital of France is\", "
                "\"n_predict\": 8, \"temperature\": 0}'", timeout=120)
        finally:
            ssh.run("systemctl stop rigctl-models-test", timeout=30, check=False)
    answer = json.loads(reply.stdout)
    print(f"llama-server: {answer['content']!r}")
    # 135M parameters at 4 bits: coherent words, not necessarily the right fact.
    assert answer["tokens_predicted"] == 8 and answer["model"].endswith("hf-q4_0.gguf")
    assert len(re.findall(r"[A-Za-z]{2,}", answer["content"])) >= 3, answer["content"]


@pytest.mark.lab
def test_pins_fail_warn_and_pin_command(inv_dir, checkout):
    repo = HfRepo("HuggingFaceTB/SmolLM2-135M-Instruct", REVISION, checkout)
    with HfServer(repo, BRIDGE) as server:
        provision(inv_dir, server.endpoint).raise_for_failures()
        inv = Inventory.load(inv_dir)
        written = pin(inv, "laptop")
        # models_test.yml's catalog replaces the lab's (group_vars files override, they don't merge).
        assert set(written["laptop"]) == {"hf-bf16", "hf-q4_0", "ckpt-bf16", "ckpt-q4_0", "ckpt-q4_k-im"}
        inv = Inventory.load(inv_dir)
        assert problems(verify(inv)) == []
        wrong = "f" * 64
        text = (inv_dir / "host_vars" / "laptop.yml").read_text()
        (inv_dir / "host_vars" / "laptop.yml").write_text(
            text.replace(written["laptop"]["hf-q4_0"], wrong))
        inv = Inventory.load(inv_dir)
        lines = problems(verify(inv, "laptop"))
        assert lines == [f"laptop: hf-q4_0: pinned sha256 {wrong} but /var/lib/rigctl/models/hf-q4_0.gguf has "
                         f"{written['laptop']['hf-q4_0']}"]
        failed = provision(inv_dir, server.endpoint)
        assert not failed.hosts["laptop"].succeeded and failed.hosts["desktop"].succeeded
        assert wrong in (failed.hosts["laptop"].failure or "")
        warned = provision(inv_dir, server.endpoint, models_pin_policy="warn")
        warned.raise_for_failures()
        rows = list_artifacts(Inventory.load(inv_dir), "laptop")["laptop"]
        assert {r.artifact: r.status for r in rows}["hf-q4_0"] == "mismatch"


@pytest.mark.lab
def test_truncated_download_is_caught(inv_dir, checkout):
    repo = HfRepo("HuggingFaceTB/SmolLM2-135M-Instruct", "fedcba9876543210fedcba9876543210fedcba98", checkout,
                  truncate={"model.safetensors"})
    with HfServer(repo, BRIDGE) as server:
        # A directory of its own: where the pinned file already exists, nothing is downloaded at all.
        result = provision(inv_dir, server.endpoint, models_artifacts=["hf-q4_0"],
                           models_dir="/var/lib/rigctl/models-truncated",
                           models_catalog=_catalog_with_revision(inv_dir, repo.commit))
    assert not result.succeeded
    for outcome in result.hosts.values():
        assert "model.safetensors" in (outcome.failure or "")
        assert "smollm2-hf" in (outcome.failure or "")


@pytest.mark.lab
def test_missing_calibration_text_is_refused(inv_dir, tmp_path):
    catalog = yaml.safe_load((inv_dir / "group_vars" / "all" / "models_test.yml").read_text())["models_catalog"]
    missing = tmp_path / "no-such-calibration.txt"
    catalog["smollm2-ckpt"]["artifacts"]["ckpt-q4_k-im"]["imatrix"]["calibration"] = str(missing)
    result = provision(inv_dir, "http://127.0.0.1:9", models_catalog=catalog, models_artifacts=["ckpt-q4_k-im"])
    assert not result.succeeded
    for outcome in result.hosts.values():
        assert f"ckpt-q4_k-im: imatrix calibration file {missing} does not exist" in (outcome.failure or "")


def _catalog_with_revision(inv_dir: Path, revision: str) -> dict:
    catalog = yaml.safe_load((inv_dir / "group_vars" / "all" / "models_test.yml").read_text())["models_catalog"]
    catalog["smollm2-hf"]["source"]["revision"] = revision
    return catalog


@pytest.mark.lab
def test_build_once_gives_identical_files(inv_dir, checkout):
    # The Hugging Face chain alone (fetched, converted, quantised on the builder, shipped to the other rig):
    # test_pipeline_on_the_rigs builds the whole catalog, per host.
    catalog = {"smollm2-hf": _catalog_with_revision(inv_dir, REVISION)["smollm2-hf"]}
    repo = HfRepo("HuggingFaceTB/SmolLM2-135M-Instruct", REVISION, checkout)
    with HfServer(repo, BRIDGE) as server:
        provision(inv_dir, server.endpoint, models_placement="build_once", models_build_host="desktop",
                  models_dir="/var/lib/rigctl/models-once", models_catalog=catalog).raise_for_failures()
    inv = Inventory.load(inv_dir)
    for host in inv.hosts.values():
        host.vars["models_dir"] = "/var/lib/rigctl/models-once"  # type: ignore[index]
        host.vars["models_catalog"] = catalog  # type: ignore[index]
    results = verify(inv)
    by_host = {h: {s.artifact: s.sha256 for s in r} for h, r in results.items()}  # type: ignore[union-attr]
    assert set(by_host["desktop"]) == {"hf-bf16", "hf-q4_0"}
    assert by_host["desktop"] == by_host["laptop"]
    assert all(by_host["desktop"].values())
    # The laptop's copy says what it was made from: the builder's command and the sha256 of the bf16 it rounded.
    copy = {s.artifact: s.manifest for s in results["laptop"]}["hf-q4_0"]  # type: ignore[union-attr]
    assert copy is not None and copy.raw["kind"] == "copy", copy
    recipe = copy.raw["recipe"]
    assert recipe["copied_from"] == "desktop" and "llama-quantize" in recipe["command"], recipe
    assert recipe["input"]["id"] == f"sha256:{by_host['desktop']['hf-bf16']}", recipe


HOSTILE = "fedcba9876543210fedcba9876543210fedcba01"
#: Written on a rig if anything imports the repository's own tokenizer code.
CODE_MARKER = "/tmp/rigctl-remote-code-ran"


def _with_code(checkout: Path, root: Path) -> Path:
    """A copy of the checkout whose tokenizer is the repository's own Python (auto_map), which leaves a marker.
    Its weights are a stub: it is refused for its code before anything reads them, and a real 270 MB file
    would only cost copying it to each rig."""
    shutil.copytree(checkout, root, ignore=shutil.ignore_patterns("*.safetensors"))
    (root / "model.safetensors").write_bytes(b"not weights: refused before any read\n")
    (root / "tokenization_evil.py").write_text(f"open({CODE_MARKER!r}, 'w').write('ran')\n")
    config = json.loads((root / "tokenizer_config.json").read_text())
    config["auto_map"] = {"AutoTokenizer": ["tokenization_evil.EvilTokenizer", None]}
    (root / "tokenizer_config.json").write_text(json.dumps(config))
    return root


@pytest.mark.lab
def test_a_hostile_mirror_and_checkouts_with_code_are_refused(inv_dir, checkout, tmp_path):
    work = "/var/cache/rigctl/models-hostile"
    escape = f"/tmp/rigctl-escape-{os.getpid()}.txt"
    repo = HfRepo("HuggingFaceTB/SmolLM2-135M-Instruct", HOSTILE, checkout,
                  hostile={"../escape.txt": b"escaped\n", escape: b"escaped\n"})
    hf = {"smollm2-hf": {"source": {"type": "hf", "repo": repo.repo, "revision": HOSTILE},
                         "artifacts": {"hostile-bf16": {"type": "convert", "outtype": "bf16"}}}}
    with HfServer(repo, BRIDGE) as server:
        names = provision(inv_dir, server.endpoint, models_catalog=hf, models_work_dir=work)
        repo.hostile.clear()
        coded = _with_code(checkout, tmp_path / "coded")
        repo.root = coded
        code = provision(inv_dir, server.endpoint, models_catalog=hf, models_work_dir=work)
    controller = {"smollm2-ckpt": {"source": {"type": "controller", "path": str(coded)},
                                   "artifacts": {"coded-bf16": {"type": "convert", "outtype": "bf16"}}}}
    copied = provision(inv_dir, "http://127.0.0.1:9", models_catalog=controller, models_work_dir=work)
    for host in ("desktop", "laptop"):
        assert names.hosts[host].failure == (
            f"{host}: model smollm2-hf: {repo.repo}@{HOSTILE}: listed file '../escape.txt' leaves the directory or "
            "has an empty component; refused"), names.hosts[host].failure
        assert code.hosts[host].failure == (
            f"{host}: model smollm2-hf: {repo.repo}@{HOSTILE} carries Python the converter would run "
            "(tokenization_evil.py); refused (models_catalog.smollm2-hf.trust_remote_code: true accepts it)")
        assert copied.hosts[host].failure == (
            f"{host}: coded-bf16: checkout {work}/sources/smollm2-ckpt carries code the converter would run "
            "(tokenization_evil.py, tokenizer_config.json auto_map); refused "
            "(models_catalog.smollm2-ckpt.trust_remote_code: true accepts it)")
    inv = Inventory.load(inv_dir)
    for host in inv.hosts.values():
        with SshClient(SshTarget.from_host(host)) as ssh:
            left = ssh.run(f"ls -A {work}/sources; ls {escape} {work}/escape.txt {CODE_MARKER} /var/lib/rigctl/models "
                           "2>&1 | grep -v 'No such file' || true", timeout=60).stdout.split()
            # The converter's venv stays for the next run; the sources go.
            ssh.run(f"rm -rf {work}/sources", timeout=300)
        # The controller checkout was copied (then refused); nothing of the mirror's, nothing outside.
        assert "smollm2-ckpt" in left and "smollm2-hf" not in left and "smollm2-hf.partial" not in left, left
        assert escape not in left and f"{work}/escape.txt" not in left and CODE_MARKER not in left, left
        assert not any(name.startswith(("coded-bf16", "hostile-bf16")) for name in left), left


_ESCAPES = ("/root/rigctl-sandbox-escape", "/etc/rigctl-sandbox-escape", "/var/lib/rigctl/rigctl-sandbox-escape",
            "/var/cache/rigctl/models/rigctl-sandbox-escape")
# What a hostile converter would try: say who it is, write outside its output, reach the network (the
# rig's own sshd: reachable from anything not cut off), open a Unix socket (the host's daemons: D-Bus, systemd
# and journald listen on them). It reports on its last line and fails.
_PROBE = ("out=$1; wrote=; for f in " + " ".join(_ESCAPES) + "; do touch $f 2>/dev/null && wrote=\"$wrote $f\"; done; "
          "echo ok > $out && own=yes; (exec 3<>/dev/tcp/$2/22) 2>/dev/null && net=reached || net=none; "
          "python3 -c 'import socket; socket.socket(socket.AF_UNIX)' 2>/dev/null && unix=reached || unix=none; "
          "echo \"uid=$(id -u) own=${own:-no} wrote=[${wrote# }] net=$net unix=$unix\"; exit 3")


def _module_project(tmp_path: Path, task: dict) -> Path:
    """A project whose one play runs ``task`` on desktop with the repository's roles and module_utils."""
    project = tmp_path / "project"
    (project / "playbooks").mkdir(parents=True)
    config = (REPO / "ansible.cfg").read_text()
    config = config.replace("roles_path = roles", f"roles_path = {REPO / 'roles'}\n"
                                                  f"library = {REPO / 'roles/models/library'}")
    (project / "ansible.cfg").write_text(config.replace("module_utils = rigctl/hostside",
                                                        f"module_utils = {REPO / 'rigctl/hostside'}"))
    (project / "playbooks" / "probe.yml").write_text(yaml.safe_dump([{
        "hosts": "desktop", "gather_facts": False, "become": True, "tasks": [task]}]))
    return project


@pytest.mark.lab
def test_a_models_command_runs_unprivileged_offline_and_writes_only_its_output(lab_up, tmp_path):
    """The models role's module running a command as it runs the converter and llama-quantize."""
    project = _module_project(tmp_path, {
        "name": "Run the probe as a models command", "models_artifact": {
            "name": "sandbox-probe", "model": "probe", "host": "{{ inventory_hostname }}", "kind": "quantize",
            "input": "/etc/hostname", "path": "/var/lib/rigctl/models-sandbox/probe.gguf",
            "argv": ["/bin/bash", "-c", _PROBE, "probe", "{output}", "{{ ansible_host }}"]}})
    result = run_playbook(lab_up, "probe.yml", project=project, timeout=600)
    failure = result.hosts["desktop"].failure or ""
    last = failure.rsplit(": ", 1)[-1]
    assert re.fullmatch(r"uid=(\d+) own=yes wrote=\[\] net=none unix=none", last), failure
    assert int(last.split()[0].removeprefix("uid=")) != 0
    with SshClient(SshTarget.from_host(lab_up.host("desktop"))) as ssh:
        left = ssh.run(f"ls -d {' '.join(_ESCAPES)} /var/lib/private/rigctl-models-* /var/lib/rigctl-models-* "
                       "/var/lib/rigctl/models-sandbox/* 2>/dev/null; true", timeout=30).stdout.split()
        ssh.run("rm -rf /var/lib/rigctl/models-sandbox", timeout=60)
    assert left == []  # nothing escaped; the unit's state directory and the partial output are gone


@pytest.mark.lab
def test_a_converter_that_leaves_a_link_to_the_api_key_file_gets_nothing(lab_up, tmp_path):
    """Issue 39: the sandboxed command's output left as a symbolic link to the API key file. Root used to
    move the link into place and chown/chmod its target (the key file became root:root 0644): now the
    artifact fails naming the link, and the key file's owner, group, mode and content are what they were."""
    key = lab_up.host("desktop").server("smollm2").key_file
    assert key, "the lab's servers have an API key"
    stat_key = f"stat -c '%u %g %a %s' {key}"
    with SshClient(SshTarget.from_host(lab_up.host("desktop"))) as ssh:
        made = ssh.run(f"test -e {key} && echo have || echo none", timeout=30).stdout.strip() == "none"
        if made:  # a rig the servers' role has not run on yet: a key file like the role's (its group: not root)
            ssh.run(f"mkdir -p {os.path.dirname(key)} && printf 'k\\n' > {key} && chown root:nogroup {key} "
                    f"&& chmod 0640 {key}", timeout=30)
        before = ssh.run(stat_key, timeout=30).stdout.split()
        project = _module_project(tmp_path, {
            "name": "Run a converter that leaves a link", "models_artifact": {
                "name": "link-probe", "model": "probe", "host": "{{ inventory_hostname }}", "kind": "quantize",
                "input": "/etc/hostname", "path": "/var/lib/rigctl/models-sandbox/link.gguf",
                "argv": ["/bin/sh", "-c", 'ln -s "$2" "$1"', "converter", "{output}", key]}})
        try:
            result = run_playbook(lab_up, "probe.yml", project=project, timeout=600)
            failure = result.hosts["desktop"].failure or ""
            after = ssh.run(stat_key, timeout=30).stdout.split()
            left = ssh.run("ls -A /var/lib/rigctl/models-sandbox /var/lib/private/ 2>/dev/null | "
                           "grep -e link -e rigctl-models || true", timeout=30).stdout.split()
        finally:
            ssh.run("rm -rf /var/lib/rigctl/models-sandbox" + (f" {key}" if made else ""), timeout=60)
    assert after == before, (before, after)
    assert re.search(r"desktop: link-probe: `/bin/sh -c .*` left no plain file: "
                     r"/var/lib/private/rigctl-models-link-probe-[0-9a-f]{8}/\.link\.gguf\.partial is a symbolic "
                     r"link, not the command's output; refused$", failure), failure
    assert left == [], left
