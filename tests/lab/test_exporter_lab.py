"""rigctl exporter against both lab rigs over real SSH, scraped by the real Prometheus from Debian's package."""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from importlib import resources
from pathlib import Path

import httpx
import pytest
from exporter_support import (
    PROMTOOL,
    dashboard_metric_names,
    parse_samples,
    promtool_check,
    sample_value,
    seed_results,
    wait_for,
)

from rigctl.inventory import Inventory
from rigctl.results.store import ResultsStore
from rigctl.services.exporter import (
    Exporter,
)
from rigctl.services.health_metrics import REPORTED_ONLY

REPO = Path(__file__).resolve().parents[2]


# ------------------------------------------------------------------------------------------------ dashboard

# ------------------------------------------------------------------------------------------------ lab


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def lab(lab_served: Inventory) -> Inventory:
    return lab_served


@pytest.fixture
def exporter(lab: Inventory, tmp_path: Path) -> Iterator[tuple[Exporter, str]]:
    exp = Exporter(lab, results=ResultsStore(tmp_path / "results"), interval=1.0, host_timeout=4.0)
    port = _free_port()
    server, _ = exp.serve(f"127.0.0.1:{port}")
    exp.start()
    try:
        yield exp, f"http://127.0.0.1:{port}/metrics"
    finally:
        server.shutdown()
        exp.stop()


def _scrape(url: str) -> dict:
    return parse_samples(httpx.get(url, timeout=5).text)


def _scraped(url: str, metric: str, **labels: str) -> float | None:
    """The one sample of ``metric`` with ``labels`` in a scrape now, None while there is none."""
    matches = [v for lab, v in _scrape(url).get(metric, []) if all(lab.get(k) == w for k, w in labels.items())]
    return matches[0] if len(matches) == 1 else None



def _lab_obj(inv: Inventory):
    from rigctl.lab.rigs import Lab

    return Lab.from_inventory(inv)


@pytest.mark.lab
def test_exporter_reports_both_rigs_with_their_labels(lab: Inventory, exporter):
    exp, url = exporter
    lab_rigs = _lab_obj(lab)
    lab_rigs.set_gpu("desktop", temperature=63, memory_used_mib=1500, utilization_gpu=40)
    lab_rigs.set_gpu("laptop", temperature=48, memory_used_mib=700, utilization_gpu=5)
    start = exp.collections
    wait_for(lambda: exp.collections >= start + 2, 15, "two collections")
    exp.settle_hashes(60)
    wait_for(lambda: exp.collections >= start + 3, 15, "a collection after the model hashes")
    body = httpx.get(url, timeout=5).text
    samples = parse_samples(body)
    for host, temp, used in (("desktop", 63, 1500), ("laptop", 48, 700)):
        assert sample_value(samples, "rigctl_host_up", host=host) == 1.0
        assert sample_value(samples, "rigctl_gpu_temperature_celsius", host=host, gpu="0") == temp
        assert sample_value(samples, "rigctl_gpu_memory_used_bytes", host=host, gpu="0") == used * 2**20
        assert sample_value(samples, "rigctl_llama_cpp_build_info", host=host, running_version="b11434",
                      pinned_version="b11434") == 1.0
        assert sample_value(samples, "rigctl_llama_cpp_build_drift", host=host) == 0.0
        for instance in lab.host(host).servers:
            active = sample_value(samples, "rigctl_server_state", host=host, server=instance.name, state="active")
            pid = sample_value(samples, "rigctl_server_main_pid", host=host, server=instance.name)
            assert (active, pid > 0) == ((1.0, True) if instance.enabled else (0.0, False)), instance
        drifts = [(lab_, v) for lab_, v in samples["rigctl_model_drift"] if lab_["host"] == host]
        assert drifts and all(v == 0.0 for _, v in drifts), drifts
    assert sample_value(samples, "rigctl_gpu_utilization_ratio", host="desktop", gpu="0") == pytest.approx(0.40)
    assert sample_value(samples, "rigctl_collection_age_seconds") < 5
    if PROMTOOL:
        promtool_check(body.encode())


@pytest.mark.lab
def test_stopped_sshd_shows_down_within_one_timeout_while_the_other_rig_stays_fresh(lab: Inventory, exporter):
    from rigctl.ssh import SshClient, SshTarget

    exp, url = exporter
    lab_rigs = _lab_obj(lab)
    wait_for(lambda: _scraped(url, "rigctl_host_up", host="laptop") == 1.0, 15, "laptop up")
    # This session outlives sshd (KillMode=process) and brings it back; a timer does if the test dies.
    with SshClient(SshTarget.from_host(lab.host("laptop"))) as laptop:
        laptop.run("systemd-run --unit=rigctl-test-sshd-back --on-active=180 systemctl start ssh.service",
                   timeout=30)
        try:
            laptop.run("systemctl stop ssh.service", timeout=30)
            stopped = time.monotonic()
            down = wait_for(lambda: _scraped(url, "rigctl_host_up", host="laptop") == 0.0,
                         exp.interval + exp.host_timeout + 2, "laptop down")
            assert down
            took = time.monotonic() - stopped
            assert took <= exp.interval + exp.host_timeout + 2
            lab_rigs.set_gpu("desktop", temperature=71)
            wait_for(lambda: _scraped(url, "rigctl_gpu_temperature_celsius", host="desktop", gpu="0") == 71,
                  exp.interval + exp.host_timeout + 2, "desktop's new temperature while laptop is down")
            samples = _scrape(url)
            assert sample_value(samples, "rigctl_host_up", host="desktop") == 1.0
            assert sample_value(samples, "rigctl_collection_age_seconds") < exp.interval + exp.host_timeout
            assert not [lab_ for lab_, _ in samples.get("rigctl_gpu_temperature_celsius", [])
                        if lab_["host"] == "laptop"]
        finally:
            laptop.run("systemctl start ssh.service; systemctl stop rigctl-test-sshd-back.timer", timeout=30,
                       check=False)
    wait_for(lambda: _scraped(url, "rigctl_host_up", host="laptop") == 1.0, 15, "laptop back up")


@pytest.mark.lab
def test_replaced_model_file_shows_as_drift(lab: Inventory, exporter):
    from rigctl.ssh import SshClient, SshTarget

    exp, url = exporter
    host = lab.host("desktop")
    artifact = host.servers[0].artifact
    path = host.artifact(artifact).path
    keep = f"{path}.rigctl-test-original"

    def drift() -> float | None:
        rows = [v for lab_, v in _scrape(url).get("rigctl_model_drift", [])
                if lab_["host"] == "desktop" and lab_["artifact"] == artifact]
        return rows[0] if rows else None

    wait_for(lambda: drift() == 0.0, 60, "no drift before the change")
    with SshClient(SshTarget.from_host(host)) as ssh:
        # A new file in place (as a stray copy or a re-download would leave); the running server keeps the old one.
        ssh.run(f"cp {path} {path}.new && printf x >> {path}.new && ln {path} {keep} && mv -f {path}.new {path}",
                timeout=60)
        try:
            wait_for(lambda: drift() == 1.0, 60, "drift after replacing the file")
            rows = [lab_ for lab_, _ in _scrape(url)["rigctl_model_info"]
                    if lab_["host"] == "desktop" and lab_["artifact"] == artifact]
            assert rows and rows[0]["sha256"] != rows[0]["expected_sha256"]
        finally:
            ssh.run(f"mv -f {keep} {path}", timeout=60)
    wait_for(lambda: drift() == 0.0, 60, "no drift once the file is restored")


@pytest.mark.lab
def test_monitoring_role_runs_the_exporter_and_its_prometheus_scrapes_it(lab: Inventory, tmp_path: Path):
    """roles/monitoring writes the exporter's unit and a prometheus.yml with its scrape job; the unit's own
    command line serves the lab's metrics and Debian's Prometheus, on the role's configuration, scrapes them
    beside every llama-server. (No systemd here to start the unit: its ExecStart runs as a process.)"""
    from rigctl.fleet.deploy import run_playbook

    prometheus = shutil.which("prometheus")
    if prometheus is None:
        pytest.skip("Debian's prometheus package is not installed")
    port, prom_port = _free_port(), _free_port()
    etc, units = tmp_path / "etc", tmp_path / "units"
    etc.mkdir()
    units.mkdir()
    slot = os.environ.get("RIGCTL_LAB_SLOT", "0")
    seed_results(tmp_path / "results")
    run_playbook(lab, "monitoring.yml", extravars={
        "monitoring_install": False, "monitoring_manage_service": False, "monitoring_config_dir": str(etc),
        "monitoring_scrape_interval": "1s", "monitoring_scrape_timeout": "1s",
        "monitoring_exporter_enabled": True, "monitoring_exporter_address": f"127.0.0.1:{port}",
        "monitoring_exporter_unit_dir": str(units), "monitoring_exporter_results": str(tmp_path / "results"),
        "monitoring_exporter_interval": 2, "monitoring_exporter_host_timeout": 4,
        "monitoring_exporter_environment": {"RIGCTL_LAB_SLOT": slot},
    }).raise_for_failures()
    unit = (units / "rigctl-exporter.service").read_text()
    # Its own user, with the inventory's SSH key and known_hosts as systemd credentials (%d below): they
    # are copied where systemd would put them, readable by that user alone.
    assert re.search(r"^DynamicUser=yes$", unit, re.MULTILINE)
    host = lab.host("desktop")
    credentials = dict(re.findall(r"^LoadCredential=([a-z-]+):(.*)$", unit, re.MULTILINE))
    assert credentials == {"ssh-key": str(host.key_file), "known-hosts": str(host.known_hosts)}
    credentials_dir = tmp_path / "credentials"
    credentials_dir.mkdir(mode=0o700)
    for name, source in credentials.items():
        shutil.copyfile(source, credentials_dir / name)
        (credentials_dir / name).chmod(0o400)
    # One flag per line in the unit: systemd joins lines ending in a backslash.
    exec_start = shlex.split(re.search(r"^ExecStart=(.*)$", unit.replace("\\\n", " "), re.MULTILINE).group(1)
                             .replace("%d", str(credentials_dir)))
    assert exec_start[0] == str(Path(sys.executable).with_name("rigctl"))
    assert exec_start[1:3] == ["--inventory", str(REPO / "inventory" / "lab")]
    environment = dict(re.findall(r'^Environment="?([A-Z_]+)=([^"\n]*)"?$', unit, re.MULTILINE))
    assert environment["RIGCTL_LAB_SLOT"] == slot
    assert "PrivateDevices=yes" in unit  # it asks the GPUs over SSH, never a local device
    config = (etc / "prometheus.yml").read_text()
    assert "job_name: rigctl-exporter" in config and f"127.0.0.1:{port}" in config
    data = tmp_path / "tsdb"
    exporter = subprocess.Popen(exec_start, env={**os.environ, **environment}, cwd=tmp_path,
                                stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    server = subprocess.Popen([prometheus, f"--config.file={etc / 'prometheus.yml'}", f"--storage.tsdb.path={data}",
                               f"--web.listen-address=127.0.0.1:{prom_port}"],
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        def query(expr: str) -> list:
            try:
                r = httpx.get(f"http://127.0.0.1:{prom_port}/api/v1/query", params={"query": expr}, timeout=5)
            except httpx.TransportError:
                return []
            return r.json()["data"]["result"] if r.status_code == 200 else []

        up = wait_for(lambda: query('up{job="rigctl-exporter"} == 1'), 60, "Prometheus scraping the exporter")
        assert up[0]["metric"]["instance"] == f"127.0.0.1:{port}"
        # Each target is scraped at its own offset within the interval: wait for the whole set, not the first.
        hosts = wait_for(lambda: len(found := query("rigctl_host_up == 1")) == 2 and found, 60,
                      "rigctl_host_up == 1 for both hosts in Prometheus")
        assert sorted(r["metric"]["host"] for r in hosts) == ["desktop", "laptop"]
        # The same Prometheus scrapes the llama-servers, labelled so the dashboard can join them by host.
        expected = [("desktop", "smollm2"), ("laptop", "smollm2")]

        def served() -> list:
            return sorted((r["metric"]["host"], r["metric"]["server"]) for r in query("llamacpp:requests_processing"))

        deadline = time.monotonic() + 60
        while served() != expected and time.monotonic() < deadline:
            time.sleep(0.5)
        targets = [(r["metric"].get("host"), r["metric"].get("instance"), r["value"][1])
                   for r in query('up{job=~"llama-server.*"}')]
        assert served() == expected, f"llama-server targets' up series: {targets}"
        # Every series the dashboard reads is in this Prometheus, under the names the dashboard uses; a GPU
        # health signal the stand-in's GeForce does not report (ECC, row remapping, Xids) has no series by
        # design (test_gpu_health_lab injects them and reads them there).
        dashboard = json.loads(resources.files("rigctl").joinpath("dashboards/fleet.json").read_text())
        exprs = [t["expr"] for panel in dashboard["panels"] for t in panel.get("targets", [])]
        wanted = set().union(*(dashboard_metric_names(e) for e in exprs)) - REPORTED_ONLY
        assert "rigctl_gpu_unhealthy" in wanted and "rigctl_host_drained" in wanted

        def missing() -> set[str]:
            names = query('count by (__name__) ({__name__=~"rigctl_.*|llamacpp:.*"})')
            return wanted - {r["metric"]["__name__"] for r in names}

        deadline = time.monotonic() + 30
        while missing() and time.monotonic() < deadline:
            time.sleep(1)
        assert not missing(), f"the dashboard reads series Prometheus does not have: {sorted(missing())}"
    finally:
        server.terminate()
        exporter.terminate()
        server.wait(timeout=30)
        _, err = exporter.communicate(timeout=30)
    assert b"Traceback" not in err, err.decode()
