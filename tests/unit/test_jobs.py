"""rigctl jobs without rigs: a running job whose unit is gone is lost; only host-side modules ship as tasks; a job
and a probe server run as the service account with the server unit's sandbox."""

from __future__ import annotations

import pytest

from rigctl import jobs
from rigctl.errors import ConfigError
from rigctl.fleet.servers import probe_server_argv
from rigctl.hostside import jobfiles, jobhost, sandbox, ship
from rigctl.inventory import Host, Inventory
from rigctl.inventory.model import ServiceAccount

# ----------------------------------------------------------------------------------------------- pure


def test_a_running_job_without_its_unit_is_lost() -> None:
    entry = {"spec": {"id": "bench-1", "kind": "bench", "unit": "rigctl-bench-1", "lock": "gpu"},
             "state": {"state": "running", "done": 1, "total": 4, "message": "cell 2/4"}, "active": False}
    assert jobs.parse_job("desktop", entry).state == "lost"
    assert jobs.parse_job("desktop", {**entry, "active": True}).state == "running"
    done = {**entry, "state": {**entry["state"], "state": "done"}}
    info = jobs.parse_job("desktop", done)
    assert info.finished and info.describe() == "desktop: bench-1 done [1/4] cell 2/4"


def test_task_sources_ship_only_remote_modules() -> None:
    assert "def main(job_dir" in ship.source("jobrun")
    assert "def run(job" in ship.source("bench_task")
    for bad in ("../jobs", "no_such_task"):
        with pytest.raises(ConfigError, match="task"):
            ship.source(bad)




# ----------------------------------------------------------------------------------------------- privileges

JOB_ID = "bench-20261201T000000Z-abcd"


def _properties(argv: list[str]) -> list[str]:
    return [argv[i + 1] for i, arg in enumerate(argv) if arg == "-p"]


def _contains_in_order(lines: list[str], part: list[str]) -> bool:
    return any(lines[i:i + len(part)] == part for i in range(len(lines) - len(part) + 1))


def test_a_job_runs_as_the_service_account_writable_only_its_run_directory(lab_inventory: Inventory) -> None:
    host = lab_inventory.host("desktop")
    spec = jobs.JobSpec(kind="bench", task="bench_task", params={}, stop_servers=True,
                        artifacts=("/var/lib/rigctl/models/m.gguf",))
    remote = jobs.job_host_spec(host, spec, JOB_ID)
    job_dir, run_dir = f"{jobs.JOBS_DIR}/{JOB_ID}", f"{jobs.RESULTS_DIR}/desktop/{JOB_ID}"
    assert jobfiles.run_dir(remote) == run_dir and remote["account"] == {"user": "llama", "group": "llama"}
    assert remote["stop_servers"] is True and remote["artifacts"] == ["/var/lib/rigctl/models/m.gguf"]
    argv = jobhost.unit_argv(remote)
    assert argv[:2] == ["systemd-run", "--unit"] and "--no-block" in argv
    assert argv[-5:] == ["/usr/bin/python3", "-E", "-s", f"{job_dir}/jobrun.py", job_dir]
    props = _properties(argv)
    assert props[:3] == ["User=llama", "Group=llama", "SupplementaryGroups=video"]
    # The llama-server@ unit's whole sandbox, in its order, with the run directory its one writable path.
    assert _contains_in_order(props, sandbox.properties([run_dir]))
    assert [p for p in props if p.startswith("ReadWritePaths=")] == [f"ReadWritePaths={run_dir}"]
    assert not [p for p in props if p.startswith(("PrivateDevices", "AmbientCapabilities=C", "User=root"))]
    # Root's steps, from the root-owned job directory, on the spec alone.
    assert f"ExecStartPre=+/usr/bin/python3 -E -s {job_dir}/jobrun.py --prepare {job_dir}" in props
    assert f"ExecStopPost=+/usr/bin/python3 -E -s {job_dir}/jobrun.py --finish {job_dir}" in props
    assert [p for p in props if "=+" in p] == [p for p in props if p.startswith(("ExecStartPre=", "ExecStopPost="))]


def test_a_probe_server_runs_with_the_units_account_and_sandbox(lab_inventory: Inventory) -> None:
    server = lab_inventory.host("desktop").server("smollm2")
    argv = probe_server_argv(server, "rigctl-ctxprobe-smollm2", ["--port", "8180"])
    assert argv[-3:] == [server.binary, "--port", "8180"]
    props = _properties(argv)
    assert props[:3] == ["User=llama", "Group=llama", "SupplementaryGroups=video"]
    assert _contains_in_order(props, sandbox.properties([]))
    assert not [p for p in props if p.startswith("ReadWritePaths=")]  # not even the instance's state directory
    assert f"EnvironmentFile={server.env_file}" in props and "UMask=0077" in props


def test_the_service_account_comes_from_the_inventory_and_a_bad_one_is_one_line() -> None:
    def account(**values: object) -> ServiceAccount:
        return Host("h", "192.0.2.1", "root", (), values).service_account

    assert account() == ServiceAccount("llama", "llama", ("video",), sandbox.DEVICE_ALLOW)
    assert account(gpu_host_user="svc", llama_server_group="gpu", llama_server_supplementary_groups=[],
                   llama_server_device_allow=["char-nvidia-frontend rw"]) == \
        ServiceAccount("svc", "gpu", (), ("char-nvidia-frontend rw",))
    assert account(llama_server_supplementary_groups=[]).unit_properties()[:3] == \
        ["User=llama", "Group=llama", "DevicePolicy=closed"]
    with pytest.raises(ConfigError, match=r"^host h: llama_server_device_allow: expected a list of strings$"):
        account(llama_server_device_allow="char-nvidia-frontend rw")
    with pytest.raises(ConfigError, match=r"^host h: 'llama -p User=root' is not a user or group name$"):
        account(gpu_host_user="llama -p User=root")
    with pytest.raises(ValueError, match="must be absolute"):
        sandbox.properties(["relative/dir"])
