"""Fan-out without a lab: which servers may share one run (same artifact sha256, same build), the campaign's
``servers`` targets, and which pulled runs answer them."""

from __future__ import annotations

import shutil
import threading
from pathlib import Path

import pytest
import yaml
from handmade_runs import eval_run

from rigctl.analysis.campaign import EvalTarget, eval_matches, load_campaign
from rigctl.errors import ConfigError
from rigctl.evals.fanout import FanOut
from rigctl.evals.target import Target
from rigctl.llama_http import Endpoint
from rigctl.results.record import Artifact, Gpu, LlamaCppBuild, Provenance, RunRecord, Server
from rigctl.results.store import ResultsStore

SHA = "5" * 64
BUILD = {"commit": "7182ef71e", "version": "b7100", "build_key": "cpu-avx2"}


def _target(host: str, name: str = "smollm2", *, artifact: str = "smollm2-135m-q4_1", sha256: str | None = SHA,
            build: dict | None = None) -> Target:
    llama_cpp = LlamaCppBuild(**(BUILD if build is None else build))
    stamp = Provenance(host=host, gpu=Gpu(name=f"{host} gpu"), llama_cpp=llama_cpp,
                       artifacts=[Artifact(name=artifact, sha256=sha256)])
    return Target(host=host, endpoint=Endpoint(f"http://10.0.0.{len(host)}:8080", None, f"{host}/{name}"),
                  name=name, artifact=artifact, stamp=stamp)


def test_same_artifact_and_build_fan_out():
    fanout = FanOut.of([_target("desktop"), _target("laptop")])
    assert [str(e) for e in fanout.endpoints] == ["desktop/smollm2", "laptop/smollm2"]
    assert [t.host for t in fanout.targets] == ["desktop", "laptop"]


@pytest.mark.parametrize(("other", "message"), [
    (_target("laptop", artifact="smollm2-135m-q4_0", sha256="6" * 64),
     "different artifacts: desktop/smollm2 serves smollm2-135m-q4_1 (sha256 555555555555), laptop/smollm2 serves "
     "smollm2-135m-q4_0 (sha256 666666666666)"),
    (_target("laptop", build={**BUILD, "commit": "0000000aa"}),
     "different llama.cpp builds: desktop/smollm2 runs 7182ef71e (build cpu-avx2), laptop/smollm2 runs 0000000aa"),
    (_target("laptop", build={**BUILD, "build_key": "cuda-sm75"}), "different llama.cpp builds"),
    (_target("laptop", sha256=None), "laptop/smollm2: the sha256 of artifact 'smollm2-135m-q4_1' could not be read"),
    (_target("laptop", build={}), "laptop/smollm2: the llama.cpp build (commit and build key) could not be read"),
    (_target("desktop"), "lists desktop/smollm2 more than once"),
])
def test_mixed_artifacts_or_builds_are_refused(other, message):
    with pytest.raises(ConfigError) as info:
        FanOut.of([_target("desktop"), other])
    assert message in str(info.value)


def test_campaign_fan_out_targets(tmp_path):
    (tmp_path / "t.yaml").write_text("name: t\nscorer: gsm8k\ndataset: {path: d.jsonl}\n")
    data = {"name": "c", "title": "c", "hosts": ["desktop", "laptop"],
            "evals": [{"name": "e", "task": "t.yaml", "runs": [
                {"servers": [{"host": "desktop", "server": "smollm2"}, {"host": "laptop", "server": "smollm2"}],
                 "artifact": "smollm2-135m-q4_1"},
                {"host": "desktop", "server": "smollm2", "artifact": "smollm2-135m-q4_1"}]}],
            "comparisons": [{"name": "fan-out vs one", "a": "smollm2-135m-q4_1@desktop",
                             "b": "smollm2-135m-q4_1@desktop+laptop", "equivalence_margin": 5}],
            "equivalence_margin": 2}
    path = tmp_path / "c.yml"
    path.write_text(yaml.safe_dump(data))
    campaign = load_campaign(path).campaign
    fanned, single = campaign.evals[0].runs
    assert fanned.fanout and fanned.id == "smollm2-135m-q4_1@desktop+laptop" and fanned.host == "desktop"
    assert not single.fanout and single.id == "smollm2-135m-q4_1@desktop"
    assert campaign.margin(campaign.comparisons[0]) == 5
    for change, message in (
            ({"hosts": ["desktop"]}, "hosts not listed under hosts: laptop"),
            ({"evals": [{"name": "e", "task": "t.yaml", "runs": [
                {"servers": [{"host": "desktop", "server": "smollm2"}], "artifact": "a"}]}], "comparisons": []},
             "a fan-out needs a list of at least two"),
            ({"evals": [{"name": "e", "task": "t.yaml", "runs": [
                {"host": "desktop", "server": "x", "servers": [{"host": "desktop", "server": "smollm2"},
                                                               {"host": "laptop", "server": "smollm2"}],
                 "artifact": "a"}]}], "comparisons": []}, "give host and server, or servers, not both"),
            ({"equivalence_margin": 0}, "equivalence_margin: Input should be greater than 0")):
        path.write_text(yaml.safe_dump({**data, **change}))
        with pytest.raises(ConfigError, match=f"campaign {path}") as info:
            load_campaign(path)
        assert message in str(info.value), (message, str(info.value))


def test_fan_out_runs_answer_only_fan_out_targets(tmp_path):
    single_dir = eval_run(tmp_path, "desktop", "eval-1", "smollm2-135m-q4_1", [{"id": "q", "set": "s", "score": 1}])
    fanned_dir = eval_run(tmp_path, "desktop", "eval-2", "smollm2-135m-q4_1", [{"id": "q", "set": "s", "score": 1}])
    record = RunRecord.load(fanned_dir)
    record.servers = [Server(name="smollm2", host="desktop"), Server(name="smollm2", host="laptop")]
    record.save(fanned_dir)
    record = RunRecord.load(single_dir)
    record.servers = [Server(name="smollm2", host="desktop")]
    record.save(single_dir)
    store = ResultsStore(tmp_path)
    fanned = EvalTarget.model_validate({"servers": [{"host": "desktop", "server": "smollm2"},
                                                    {"host": "laptop", "server": "smollm2"}],
                                        "artifact": "smollm2-135m-q4_1"})
    single = EvalTarget(host="desktop", server="smollm2", artifact="smollm2-135m-q4_1")
    assert eval_matches(store.find("desktop/eval-2"), "suite", fanned)
    assert not eval_matches(store.find("desktop/eval-1"), "suite", fanned)
    assert eval_matches(store.find("desktop/eval-1"), "suite", single)
    assert not eval_matches(store.find("desktop/eval-2"), "suite", single)


def test_a_fan_outs_stamps_are_read_from_every_host_at_once(monkeypatch, tmp_path):
    """`eval run` and a campaign's fan-out read each server's stamp over SSH: N hosts wait for one round trip,
    not N in a row; a host's own servers are read one after the other, and the targets keep their order."""
    from rigctl.evals import target as target_module
    from rigctl.evals.target import inventory_targets
    from rigctl.inventory import Inventory

    # The lab's desktop with every instance on its bridge address (smollm2-q4_0 binds loopback there, and its
    # endpoint would be an SSH forward to a rig this test has not got).
    lab = tmp_path / "lab"
    shutil.copytree(Path(__file__).resolve().parents[2] / "inventory" / "lab", lab)
    with (lab / "host_vars" / "desktop.yml").open("a") as desktop:
        desktop.write("llama_server_bind_address: 0.0.0.0\n")
    inventory = Inventory.load(lab)
    both_hosts_asked = threading.Barrier(2, timeout=10)
    read: list[str] = []

    def stamp(target: Target) -> Provenance:
        if target.name == "smollm2":
            both_hosts_asked.wait()  # broken, and so raising, unless the other host is being read meanwhile
        read.append(target.label)
        return Provenance(host=target.host, artifacts=[Artifact(name=target.artifact, sha256=SHA)])

    monkeypatch.setattr(target_module, "read_stamp", stamp)
    pairs = [("desktop", "smollm2"), ("laptop", "smollm2"), ("desktop", "smollm2-q4_0")]
    targets = inventory_targets([(inventory.host(h), s) for h, s in pairs])
    assert [t.label for t in targets] == ["desktop/smollm2", "laptop/smollm2", "desktop/smollm2-q4_0"]
    assert [t.stamp.host for t in targets] == ["desktop", "laptop", "desktop"]
    assert sorted(read) == sorted(t.label for t in targets)
    assert read.index("desktop/smollm2-q4_0") > read.index("desktop/smollm2")

    read.clear()
    assert all(t.stamp is None for t in inventory_targets([(inventory.host("laptop"), "smollm2")], facts=False))
    assert read == []
