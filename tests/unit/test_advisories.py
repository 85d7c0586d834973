"""The CVE floor: the vendored advisory table, which builds each advisory covers, a fleet's accepted
advisories, and where the floor is enforced (inventory check, provision, the exporter's metric)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import yaml
from inventory_support import edit_yaml

from rigctl.errors import BuildError, ConfigError
from rigctl.fleet.build import Build, Builds
from rigctl.fleet.state import HostPlan, HostState
from rigctl.inventory import Inventory, advisories
from rigctl.inventory.advisories import Advisory, check_build, covering, parse_table
from rigctl.inventory.check import check
from rigctl.services.exporter import Snapshot, exposition, metric_families

REPO = Path(__file__).resolve().parents[2]


def ids(build: int) -> list[str]:
    return [a.id for a in covering(build)]


def test_the_vendored_table_is_real_advisories_each_citing_its_source():
    table = advisories.table()
    assert len(table) >= 8
    assert len({a.id for a in table}) == len(table)
    for advisory in table:
        assert advisory.id.startswith(("GHSA-", "CVE-", "ggml-org/llama.cpp#")) and advisory.sources
        assert advisory.summary and advisory.cve is None or advisory.cve.startswith("CVE-")
        assert advisory.url.startswith(("https://github.com/ggml-org/llama.cpp/security/advisories/GHSA-",
                                        "https://nvd.nist.gov/vuln/detail/CVE-",
                                        "https://github.com/ggml-org/llama.cpp/issues/"))
    # The 2026-08 and 2026-09 advisories, each with the range its source states (or none), and the RPC
    # reports upstream closed unfixed.
    by_id = {a.id: a for a in table}
    assert [by_id[i].range_text for i in ("CVE-2026-43627", "CVE-2026-43628", "CVE-2026-43629", "CVE-2026-43632",
                                          "CVE-2026-52130", "CVE-2026-52131", "CVE-2026-52132")] == [
        "b1283-b9058", "b3978-b9058", "b4882-b9058", "b7492-b9060", "no range stated", "<= b5693",
        "through commit 97f06e9"]
    assert by_id["CVE-2026-52132"].flags == ("--rerank", "--reranking")
    assert by_id["ggml-org/llama.cpp#25289"].flags == ("--rpc",)
    assert by_id["ggml-org/llama.cpp#25289"].url == "https://github.com/ggml-org/llama.cpp/issues/25289"
    assert all(any(s.startswith("https://") for s in by_id[i].sources) for i in by_id if not i.startswith("GHSA-"))


def test_ranges_by_build_number_at_their_edges():
    # CVE-2026-27940: affected up to b8145, patched in b8146.
    assert "GHSA-3p4r-fq3f-q74v" in ids(8145) and "GHSA-3p4r-fq3f-q74v" not in ids(8146)
    # CVE-2026-43631: builds b7492 through b9060, no patched build named.
    assert "GHSA-6hc7-9rph-cm99" not in ids(7491)
    assert "GHSA-6hc7-9rph-cm99" in ids(7492) and "GHSA-6hc7-9rph-cm99" in ids(9060)
    assert ids(9061) == []
    # CVE-2026-34159: named affected up to b7991, patched in b8492: the gap between is covered too.
    assert "GHSA-j8rj-fmpv-wcxw" in ids(8200) and "GHSA-j8rj-fmpv-wcxw" not in ids(8492)
    # CVE-2026-43627..43629: through b9058; CVE-2026-43632: b7492 through b9060; CVE-2026-52131: b5693 and earlier.
    assert {"CVE-2026-43627", "CVE-2026-43628", "CVE-2026-43629", "CVE-2026-43632"} <= set(ids(9058))
    assert ids(9059) == ["GHSA-6hc7-9rph-cm99", "CVE-2026-43632"] == ids(9060)
    assert "CVE-2026-43627" not in ids(1282) and "CVE-2026-43627" in ids(1283)
    assert "CVE-2026-52131" in ids(5693) and "CVE-2026-52131" not in ids(5694)
    # An advisory that names a commit or no range refuses no build: the flag policy covers it.
    assert not [i for b in (1, 9000, 11434, 99999) for i in ids(b) if i in ("CVE-2026-52132", "CVE-2026-52130")]
    # Every build the package index offers (b9093 to b11434) is clear of the table.
    assert ids(9093) == [] and ids(11434) == []


def test_a_table_entry_that_cannot_be_checked_is_refused_naming_it():
    good = {"id": "GHSA-3p4r-fq3f-q74v", "severity": "high", "summary": "s", "fixed": 8146, "sources": ["x"]}
    assert parse_table({"advisories": [good]}, "t")[0].covers(8145)
    for bad, message in (({**good, "id": "CVE-2026-1"}, "not a GHSA id"),
                         ({**good, "sources": []}, "cites where"),
                         ({**good, "fixed": "b8146"}, "expected a build number"),
                         ({**good, "fixed": None, "introduced": 5}, "introduced needs last_affected or fixed"),
                         ({**good, "through_commit": "97f06e9"}, "for an advisory that names no build"),
                         ({**good, "fixed": None, "through_commit": "HEAD~1"}, "expected a commit hash"),
                         ({**good, "flags": ["rpc"]}, "expected a list of llama-server flags"),
                         ({**good, "introduced": 9000}, "covers no build"),
                         ({**good, "affects": 1}, "unknown key affects")):
        with pytest.raises(ConfigError, match=message) as raised:
            parse_table({"advisories": [bad]}, "t")
        assert "advisories[0]" in str(raised.value)
    with pytest.raises(ConfigError, match="listed twice"):
        parse_table({"advisories": [good, good]}, "t")


def test_an_accepted_advisory_no_longer_refuses_but_is_kept_with_its_reason():
    refused = check_build(9060)
    assert refused.vulnerable and [a.id for a in refused.refused] == ["GHSA-6hc7-9rph-cm99", "CVE-2026-43632"]
    line = refused.refusal("pin b9060")
    assert "GHSA-6hc7-9rph-cm99" in line and "CVE-2026-43631" in line and "rigctl_allowed_advisories" in line
    assert "CVE-2026-43632 (high, builds b7492-b9060, no fixed build named)" in line
    assert "\n" not in line
    partly = check_build(9060, {"GHSA-6hc7-9rph-cm99": "no instance runs --sleep-idle-seconds"})
    assert [a.id for a in partly.refused] == ["CVE-2026-43632"]
    accepted = check_build(9060, {"GHSA-6hc7-9rph-cm99": "no instance runs --sleep-idle-seconds",
                                  "CVE-2026-43632": "no instance runs --sleep-idle-seconds"})
    assert not accepted.vulnerable
    assert [(a.id, why) for a, why in accepted.accepted] == [
        ("GHSA-6hc7-9rph-cm99", "no instance runs --sleep-idle-seconds"),
        ("CVE-2026-43632", "no instance runs --sleep-idle-seconds")]
    with pytest.raises(ConfigError, match="not an advisory of the table"):
        advisories.allowed_advisories({"GHSA-2222-3333-4444": "x"}, "host h")
    with pytest.raises(ConfigError, match="give the reason"):
        advisories.allowed_advisories({"GHSA-6hc7-9rph-cm99": " "}, "host h")


def test_build_labels():
    assert advisories.build_number("b11434") == 11434
    assert advisories.build_number("7182ef71e") is None
    assert Advisory("GHSA-2222-3333-4444", None, "high", "s", fixed=10).range_text == "< b10"
    assert Advisory("GHSA-2222-3333-4444", None, "high", "s", introduced=5, last_affected=9).range_text == "b5-b9"


def test_inventory_check_names_a_pin_inside_a_range_until_it_is_accepted(lab_copy: Path):
    pins = lab_copy / "group_vars" / "all" / "llama_cpp.yml"
    assert not [p for p in check(Inventory.load(lab_copy)) if p.key == "llama_cpp_version"]
    edit_yaml(pins, lambda d: d.update(llama_cpp_version="b9060"))
    found = [p for p in check(Inventory.load(lab_copy)) if p.key == "llama_cpp_version"]
    assert len(found) == 1 and found[0].where == "group all" and "GHSA-6hc7-9rph-cm99" in found[0].message
    with pytest.raises(BuildError, match=r"host desktop: pin b9060 \(build 9060\) is inside GHSA-6hc7"):
        advisories.refuse_vulnerable_pins(Inventory.load(lab_copy).select(None))
    edit_yaml(pins, lambda d: d.update(rigctl_allowed_advisories={"GHSA-6hc7-9rph-cm99": "no idle sleep here"}))
    # One of the two advisories accepted: the other (CVE-2026-43632, a CVE without a GHSA) still refuses.
    with pytest.raises(BuildError, match=r"host desktop: pin b9060 \(build 9060\) is inside CVE-2026-43632"):
        advisories.refuse_vulnerable_pins(Inventory.load(lab_copy).select(None))
    edit_yaml(pins, lambda d: d.update(rigctl_allowed_advisories={"GHSA-6hc7-9rph-cm99": "no idle sleep here",
                                                                  "CVE-2026-43632": "no idle sleep here"}))
    assert not [p for p in check(Inventory.load(lab_copy)) if "llama_cpp_version" in p.key or "advisor" in p.key]
    advisories.refuse_vulnerable_pins(Inventory.load(lab_copy).select(None))
    edit_yaml(pins, lambda d: d.update(rigctl_allowed_advisories={"GHSA-2222-3333-4444": "typo"}))
    bad = [p for p in check(Inventory.load(lab_copy)) if p.key.startswith("rigctl_allowed_advisories")]
    assert bad and "not an advisory" in bad[0].message


def _running(build_number: int) -> Builds:
    build = Build(name=f"b{build_number}-k", dir="/opt/x", key="k", version=f"b{build_number}", commit="c",
                  build_number=build_number, source="archive", cuda=False, cuda_architectures="", cuda_version="",
                  built_on="h", built_at="t")
    return Builds("h", build, None)


def _vulnerable_lines(plans: dict[str, HostPlan], facts: HostState) -> list[str]:
    snapshot = Snapshot(completed_at=1.0, duration_seconds=0.1, hosts={"h": facts})
    text = exposition(metric_families(snapshot, plans)).decode()
    return sorted(line for line in text.splitlines() if line.startswith("rigctl_build_vulnerable{"))


def test_the_exporter_shows_the_pinned_and_the_running_build_against_the_floor():
    clear = _vulnerable_lines({"h": HostPlan("h", "b11434", "archive", {})},
                              HostState("h", True, builds=_running(11434)))
    assert clear == ['rigctl_build_vulnerable{advisories="",build="pinned",host="h",version="b11434"} 0.0',
                     'rigctl_build_vulnerable{advisories="",build="running",host="h",version="b11434"} 0.0']
    flipped = _vulnerable_lines({"h": HostPlan("h", "b9060", "archive", {})},
                                HostState("h", True, builds=_running(9059)))
    assert flipped == [
        'rigctl_build_vulnerable{advisories="GHSA-6hc7-9rph-cm99,CVE-2026-43632",build="pinned",host="h",'
        'version="b9060"} 1.0',
        'rigctl_build_vulnerable{advisories="GHSA-6hc7-9rph-cm99,CVE-2026-43632",build="running",host="h",'
        'version="b9059"} 1.0']
    accepted = HostPlan("h", "b9060", "archive", {}, allowed_advisories={"GHSA-6hc7-9rph-cm99": "reviewed",
                                                                         "CVE-2026-43632": "reviewed"})
    assert all(line.endswith(" 0.0") for line in _vulnerable_lines({"h": accepted}, HostState("h", False)))
    # A git pin says no build number: only the running build is judged.
    git = _vulnerable_lines({"h": HostPlan("h", "7182ef71e", "git", {})}, HostState("h", True, builds=_running(9000)))
    assert [line.split("build=")[1][:9] for line in git] == ['"running"']


def test_the_table_file_is_yaml_with_a_header_that_explains_its_semantics():
    text = (REPO / "rigctl" / "inventory" / "data" / "llama_cpp_advisories.yaml").read_text()
    assert "last_affected" in text.split("advisories:")[0] and "GHSA-8947-pfff-2f3c" in text.split("advisories:")[0]
    assert isinstance(yaml.safe_load(text)["advisories"], list)


def test_build_advisories_lists_the_new_advisories_with_their_sources():
    """`rigctl build advisories`: every entry with its range, flags and sources (the lab's hosts are down here:
    their running build is unknown, the listing still completes)."""
    import os
    import subprocess

    done = subprocess.run([sys.executable, "-m", "rigctl.cli", "-i", str(REPO / "inventory" / "lab"), "build",
                           "advisories"], capture_output=True, text=True, timeout=300, cwd=REPO,
                          env={**os.environ, "RIGCTL_LAB_SLOT": "5", "COLUMNS": "4000"})
    assert done.returncode == 0, done.stderr
    rows = {line.split("│")[1].strip(): line for line in done.stdout.splitlines()
            if line.count("│") == 8 and line.split("│")[1].strip()}
    for ident, builds, source in (
            ("CVE-2026-43627", "b1283-b9058", "https://nvd.nist.gov/vuln/detail/CVE-2026-43627"),
            ("CVE-2026-43628", "b3978-b9058", "https://nvd.nist.gov/vuln/detail/CVE-2026-43628"),
            ("CVE-2026-43629", "b4882-b9058", "https://nvd.nist.gov/vuln/detail/CVE-2026-43629"),
            ("CVE-2026-43632", "b7492-b9060", "https://nvd.nist.gov/vuln/detail/CVE-2026-43632"),
            ("CVE-2026-52130", "no range stated", "https://nvd.nist.gov/vuln/detail/CVE-2026-52130"),
            ("CVE-2026-52131", "<= b5693", "https://github.com/advisories/GHSA-jfjx-j76r-xrpf"),
            ("CVE-2026-52132", "through commit 97f06e9", "https://osv.dev/vulnerability/CVE-2026-52132"),
            ("ggml-org/llama.cpp#25288", "no range stated", "https://github.com/ggml-org/llama.cpp/issues/25288")):
        assert builds in rows[ident] and f"  {ident}: {source}" in done.stdout.split("\nsources:\n")[1], ident
    assert "--rerank, --reranking" in rows["CVE-2026-52132"] and "--rpc" in rows["ggml-org/llama.cpp#25289"]
