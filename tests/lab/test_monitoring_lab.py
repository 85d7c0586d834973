"""roles/monitoring: a real Prometheus (Debian's package) with the configuration the role generates
from the lab inventory scrapes both rigs' llama-servers, with the inventory's labels."""

from __future__ import annotations

import shutil
import socket
import subprocess
import time
from pathlib import Path

import httpx
import pytest
import yaml

from rigctl.fleet.deploy import run_playbook
from rigctl.forward import server_endpoint
from rigctl.inventory import Inventory
from rigctl.llama_http import ServerClient

SCRAPE = {"monitoring_install": False, "monitoring_manage_service": False, "monitoring_scrape_interval": "2s",
          "monitoring_scrape_timeout": "2s"}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _expected_labels(inv: Inventory) -> list[dict[str, str]]:
    out = []
    for host in inv.hosts.values():
        for server in host.servers:
            if server.enabled:
                catalog = host.vars["models_catalog"]
                model = next(name for name, m in catalog.items() if server.artifact in m["artifacts"])
                out.append({"host": host.name, "gpu": host.gpu.name if host.gpu else "none", "server": server.name,
                            "model": model, "artifact": server.artifact, "profile": server.profile.name})
    return sorted(out, key=lambda d: (d["host"], d["server"]))


@pytest.mark.lab
def test_prometheus_scrapes_every_server_with_inventory_labels(lab_served: Inventory, tmp_path: Path) -> None:
    if shutil.which("prometheus") is None:
        pytest.skip("Prometheus is not installed (apt-get install prometheus)")
    config = tmp_path / "prometheus"
    run_playbook(lab_served, "monitoring.yml",
                 extravars={**SCRAPE, "monitoring_config_dir": str(config)}).raise_for_failures()
    assert subprocess.run(["promtool", "check", "config", str(config / "prometheus.yml")],
                          capture_output=True, timeout=60).returncode == 0
    port = _free_port()
    prometheus = subprocess.Popen(
        ["prometheus", f"--config.file={config / 'prometheus.yml'}", f"--storage.tsdb.path={tmp_path / 'data'}",
         f"--web.listen-address=127.0.0.1:{port}"],
        stdout=subprocess.DEVNULL, stderr=open(tmp_path / "prometheus.log", "wb"))  # noqa: SIM115
    try:
        api = f"http://127.0.0.1:{port}"
        # Requests on every server, so their prompt token counters have moved.
        for host in lab_served.hosts.values():
            for server in host.servers:
                if server.enabled:
                    with ServerClient(server_endpoint(host, server)) as client:
                        assert client.chat([{"role": "user", "content": "Say hi."}], max_tokens=4).content
        expected = _expected_labels(lab_served)
        found: list[dict[str, str]] = []
        deadline = time.monotonic() + 90
        while time.monotonic() < deadline:
            try:
                answer = httpx.get(f"{api}/api/v1/query", params={"query": "llamacpp:prompt_tokens_total > 0"},
                                   timeout=5).json()
            except httpx.HTTPError:
                answer = {"data": {"result": []}}
            found = sorted(({k: r["metric"][k] for k in ("host", "gpu", "server", "model", "artifact", "profile")}
                            for r in answer["data"]["result"]), key=lambda d: (d["host"], d["server"]))
            if found == expected:
                break
            time.sleep(1)
        assert found == expected, (tmp_path / "prometheus.log").read_text()[-2000:]
        targets = httpx.get(f"{api}/api/v1/targets", timeout=5).json()["data"]["activeTargets"]
        assert {t["health"] for t in targets} == {"up"}
    finally:
        prometheus.terminate()
        prometheus.wait(timeout=30)


@pytest.mark.lab
def test_hosts_with_an_api_key_are_scraped_with_bearer_auth(lab_up: Inventory, tmp_path: Path) -> None:
    if shutil.which("promtool") is None:
        pytest.skip("Prometheus is not installed (apt-get install prometheus)")
    config = tmp_path / "prometheus"
    # Only the files: the servers themselves keep running without a key.
    run_playbook(lab_up, "monitoring.yml", extravars={**SCRAPE, "monitoring_config_dir": str(config),
                                                      "llama_server_api_key": "k-123"}).raise_for_failures()
    jobs = {j["job_name"]: j for j in yaml.safe_load((config / "prometheus.yml").read_text())["scrape_configs"]}
    assert set(jobs) == {f"llama-server-{h}" for h in lab_up.hosts}
    for host in lab_up.hosts:
        auth = jobs[f"llama-server-{host}"]["authorization"]
        key = Path(auth["credentials_file"])
        assert auth["type"] == "Bearer" and key.read_text() == "k-123" and oct(key.stat().st_mode & 0o777) == "0o640"
