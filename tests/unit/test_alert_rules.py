"""The alert rules the monitoring role installs (roles/monitoring/files/rigctl-alerts.yml), held to Debian's
promtool: the file passes ``promtool check rules``, its unit tests (tests/unit/alerts/) pass ``promtool test
rules``, every alert has a case where it fires and one where it does not, and every metric a rule reads is one
the exporter exports (or Prometheus' own ``up``, or the upgrade watch's, which `rigctl build watch` is to
export)."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest
import yaml
from exporter_support import PROMTOOL, dashboard_metric_names

from rigctl.services.exporter import metric_families

REPO = Path(__file__).resolve().parents[2]
RULES = REPO / "roles" / "monitoring" / "files" / "rigctl-alerts.yml"
TESTS = REPO / "tests" / "unit" / "alerts" / "rigctl-alerts.test.yml"
#: Not the exporter's: Prometheus' per-target `up`, and the upgrade watch's metrics (not exported yet).
OTHER_METRICS = {"up", "rigctl_upgrade_watch_last_run_timestamp", "rigctl_upgrade_watch_refused_builds"}

needs_promtool = pytest.mark.skipif(PROMTOOL is None, reason="promtool comes with Debian's prometheus package")


def _alerts() -> dict[str, str]:
    return {rule["alert"]: rule["expr"] for group in yaml.safe_load(RULES.read_text())["groups"]
            for rule in group["rules"] if "alert" in rule}


@needs_promtool
def test_the_shipped_rules_pass_promtool_check_rules():
    done = subprocess.run([PROMTOOL, "check", "rules", str(RULES)], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stdout + done.stderr
    assert f"SUCCESS: {len(_alerts())} rules found" in done.stdout


@needs_promtool
def test_the_rules_unit_tests_pass_promtool_test_rules():
    done = subprocess.run([PROMTOOL, "test", "rules", TESTS.name], cwd=TESTS.parent, capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0 and "SUCCESS" in done.stdout, done.stdout + done.stderr


def test_every_alert_has_a_firing_and_a_quiet_case():
    cases = [case for test in yaml.safe_load(TESTS.read_text())["tests"] for case in test.get("alert_rule_test", [])]
    fires = {c["alertname"] for c in cases if c.get("exp_alerts")}
    quiet = {c["alertname"] for c in cases if not c.get("exp_alerts")}
    alerts = set(_alerts())
    assert alerts - fires == set(), "alerts no test makes fire"
    assert alerts - quiet == set(), "alerts no test keeps quiet"
    assert (fires | quiet) <= alerts, "tests of alerts the rules do not have"


def test_every_rule_reads_metrics_that_exist():
    exported = set()
    for family in metric_families(None, {}):
        exported |= {family.name, f"{family.name}_total", f"{family.name}_info"}
    for name, expr in _alerts().items():
        unknown = dashboard_metric_names(expr) - exported - OTHER_METRICS - {"time", "increase"}
        assert not unknown, f"{name}: {expr} reads {sorted(unknown)}"


@needs_promtool
def test_a_rules_override_promtool_rejects_is_one_error_and_nothing_is_installed(tmp_path: Path,
                                                                                monkeypatch: pytest.MonkeyPatch):
    import shutil

    from rigctl.errors import DeployError
    from rigctl.fleet.deploy import run_playbook
    from rigctl.inventory import Inventory

    monkeypatch.setenv("RIGCTL_LAB_SLOT", "0")
    shutil.copytree(REPO / "inventory" / "lab", tmp_path / "inv")
    bad = tmp_path / "rules.yml"
    bad.write_text("groups:\n  - name: bad\n    rules:\n      - alert: Broken\n        expr: rigctl_host_up == == 0\n")
    config = tmp_path / "prometheus"
    deployed = run_playbook(Inventory.load(tmp_path / "inv"), "monitoring.yml", extravars={
        "monitoring_install": False, "monitoring_manage_service": False, "monitoring_config_dir": str(config),
        "monitoring_alert_rules_file": str(bad)})
    with pytest.raises(DeployError) as refused:
        deployed.raise_for_failures()
    message = str(refused.value)
    assert len(message.splitlines()) == 1
    assert message.startswith("localhost failed at 'Install the alert rules': failed to validate: ")
    assert "could not parse expression" in message or "parse error" in message, message
    # Nothing of the configuration is there: the rules come first, and the play stopped at them.
    assert [p.relative_to(config).as_posix() for p in sorted(config.rglob("*"))] == ["rules"]
