"""Lab: desktop's stand-in GPU plays recorded faults (an nvidia-smi -q's uncorrected ECC errors, a dmesg's Xid
32 on its bus): the exporter's metrics flip over real SSH, the monitoring role's alert rules fire in the real
Prometheus from Debian's package, the drain policy drains desktop, a fan-out eval over both rigs skips it with
the reason, and once the GPU is healthy again `rigctl hosts undrain` brings it back into the next fan-out."""

from __future__ import annotations

import shutil
import socket
import subprocess
import time
from pathlib import Path

import httpx
import pytest
from benchlab import REPO, RIGCTL, cli_env, served_inventory
from exporter_support import wait_for
from hf_server import eval_fixtures_hub

from rigctl.fleet.deploy import run_playbook
from rigctl.inventory import Inventory
from rigctl.lab.gpu import health_from_capture, kernel_log_from_capture
from rigctl.lab.rigs import Lab
from rigctl.results.record import RunRecord
from rigctl.results.store import ResultsStore
from rigctl.services.exporter import Exporter

pytestmark = pytest.mark.lab

TASK = REPO / "tests" / "fixtures" / "evals" / "tasks" / "fixture-gsm8k.yaml"
FANOUT = ["--host", "desktop", "--server", "smollm2", "--host", "laptop", "--server", "smollm2"]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _query(api: str, promql: str) -> list[dict]:
    try:
        return httpx.get(f"{api}/api/v1/query", params={"query": promql}, timeout=5).json()["data"]["result"]
    except (httpx.HTTPError, KeyError, ValueError):
        return []


def _firing(api: str) -> set[tuple[str, str]]:
    try:
        alerts = httpx.get(f"{api}/api/v1/alerts", timeout=5).json()["data"]["alerts"]
    except (httpx.HTTPError, KeyError, ValueError):
        return set()
    return {(a["labels"]["alertname"], a["labels"].get("host", "")) for a in alerts if a["state"] == "firing"}



def _eval(inventory: Path, results: Path, hub: str) -> subprocess.CompletedProcess[str]:
    env = {**cli_env(results), "RIGCTL_INVENTORY": str(inventory), "HF_ENDPOINT": hub,
           "RIGCTL_CACHE_DIR": str(results.parent / "cache")}
    return subprocess.run([*RIGCTL, "eval", "run", *FANOUT, "--task", str(TASK), "--limit", "2", "--concurrency", "1"],
                          capture_output=True, text=True, timeout=900, env=env, cwd=REPO, check=False)


def _servers(results: Path, before: set[Path]) -> set[str]:
    (path,) = sorted(set(results.glob("*/eval-*")) - before)
    return {f"{s.host}/{s.name}" for s in RunRecord.load(path).servers}


def test_an_unhealthy_gpu_alerts_drains_and_undrain_brings_it_back(request, tmp_path: Path) -> None:
    if shutil.which("prometheus") is None:
        pytest.skip("Prometheus is not installed (apt-get install prometheus)")
    served = served_inventory(request)
    inv_dir = tmp_path / "inventory"
    shutil.copytree(Path(served.source), inv_dir)
    with (inv_dir / "host_vars" / "desktop.yml").open("a") as handle:
        handle.write("rigctl_drain_policy: {unhealthy_gpu: drain}\n")
    inventory = Inventory.load(inv_dir)
    lab = Lab.from_inventory(served)
    results = tmp_path / "results"
    exporter = Exporter(inventory, results=ResultsStore(results), interval=1.0, host_timeout=8.0,
                        apply_drain_policy=True)
    port = _free_port()
    server, _ = exporter.serve(f"127.0.0.1:{port}")
    exporter.start()
    config = tmp_path / "prometheus"
    (tmp_path / "units").mkdir()
    run_playbook(inventory, "monitoring.yml", extravars={
        "monitoring_install": False, "monitoring_manage_service": False, "monitoring_config_dir": str(config),
        "monitoring_scrape_interval": "1s", "monitoring_scrape_timeout": "1s", "monitoring_evaluation_interval": "1s",
        "monitoring_exporter_enabled": True, "monitoring_exporter_address": f"127.0.0.1:{port}",
        "monitoring_exporter_unit_dir": str(tmp_path / "units")}).raise_for_failures()
    prom_port = _free_port()
    prometheus = subprocess.Popen(
        ["prometheus", f"--config.file={config / 'prometheus.yml'}", f"--storage.tsdb.path={tmp_path / 'data'}",
         f"--web.listen-address=127.0.0.1:{prom_port}"],
        stdout=subprocess.DEVNULL, stderr=open(tmp_path / "prometheus.log", "wb"))  # noqa: SIM115
    api = f"http://127.0.0.1:{prom_port}"
    hub = eval_fixtures_hub(tmp_path / "hub")
    endpoint = hub.__enter__().endpoint
    try:
        # Healthy first: the rules are loaded, desktop's GPU reads healthy, nothing of it fires.
        wait_for(lambda: _query(api, 'rigctl_gpu_unhealthy{host="desktop"} == 0'), 60, "desktop's GPU healthy", poll=1)
        rules = httpx.get(f"{api}/api/v1/rules", timeout=5).json()["data"]["groups"]
        assert {r["name"] for g in rules for r in g["rules"]} >= {"GpuXidError", "GpuUncorrectedEccErrors"}
        assert not {a for a in _firing(api) if a[0].startswith("Gpu")}

        lab.set_gpu("desktop", health=health_from_capture("sram-uncorrectable"),
                    kernel_log=list(kernel_log_from_capture("xid-32-31-bus-01")))
        flipped = time.monotonic()
        wait_for(lambda: _query(api, 'rigctl_gpu_unhealthy{host="desktop", gpu="0"} == 1'), 60, "the metric flips",
                 poll=1)
        metric_s = time.monotonic() - flipped
        assert _query(api, 'rigctl_gpu_ecc_errors{host="desktop", error="uncorrected", scope="volatile"} == 1')
        assert _query(api, 'rigctl_gpu_xid_errors{host="desktop", gpu="0", xid="32", blame="gpu"} == 2')
        # The rules' `for: 1m`, a scrape and an evaluation of 1s each, and the exporter's collection.
        wait_for(lambda: {("GpuXidError", "desktop"), ("GpuUncorrectedEccErrors", "desktop")} <= _firing(api),
                 90, "the GPU alerts fire", poll=1)
        alert_s = time.monotonic() - flipped
        assert alert_s < 90
        print(f"desktop's fault played: in Prometheus after {metric_s:.1f} s, its alerts firing after {alert_s:.1f} s "
              "(for: 1m)")
        assert not {a for a in _firing(api) if a[0].startswith("Gpu") and a[1] == "laptop"}
        # The policy drained desktop, and the exporter shows it.
        wait_for(lambda: _query(api, 'rigctl_host_drained{host="desktop", by="policy"} == 1'), 30, "desktop drained",
                 poll=1)
        assert "rigctl_drain:" in (inv_dir / "host_vars" / "desktop.yml").read_text()

        before = set(results.glob("*/eval-*"))
        skipped = _eval(inv_dir, results, endpoint)
        assert skipped.returncode == 0, skipped.stderr
        assert ("skipped desktop: drained since " in skipped.stderr
                and "by policy: unhealthy GPU: GPU 0: 1 uncorrected ECC errors" in skipped.stderr), skipped.stderr
        assert _servers(results, before) == {"laptop/smollm2"}

        # The GPU reset (the fault gone), the operator puts desktop back.
        lab.set_gpu("desktop", health={}, kernel_log=[])
        wait_for(lambda: _query(api, 'rigctl_gpu_unhealthy{host="desktop", gpu="0"} == 0'), 60, "healthy again", poll=1)
        undrained = subprocess.run([*RIGCTL, "-i", str(inv_dir), "hosts", "undrain", "desktop"], capture_output=True,
                                   text=True, timeout=120, env=cli_env(results), cwd=REPO, check=False)
        assert undrained.returncode == 0 and "desktop: back in service" in undrained.stdout, undrained.stderr
        wait_for(lambda: _query(api, 'rigctl_host_drained{host="desktop"} == 0'), 30, "the exporter shows it back",
                 poll=1)
        before = set(results.glob("*/eval-*"))
        both = _eval(inv_dir, results, endpoint)
        assert both.returncode == 0 and "skipped" not in both.stderr, both.stderr
        assert _servers(results, before) == {"desktop/smollm2", "laptop/smollm2"}
    finally:
        hub.__exit__(None, None, None)
        lab.set_gpu("desktop", health={}, kernel_log=[])
        prometheus.terminate()
        prometheus.wait(timeout=30)
        server.shutdown()
        exporter.stop()
