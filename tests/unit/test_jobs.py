"""rigctl jobs without rigs: a running job whose unit is gone is lost; only host-side modules ship as tasks."""

from __future__ import annotations

import pytest

from rigctl import jobs
from rigctl.errors import ConfigError
from rigctl.hostside import ship

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


