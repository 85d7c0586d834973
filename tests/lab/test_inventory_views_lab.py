"""The typed Server view against a real rig: a host override of ctx_size, deployed by the llama_server
role, is what the arguments file on the rig says, what llama-server reports, and what rigctl's eval
target and bench probe take; the probe runs from the view's paths and user, not hard-coded ones."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import yaml
from labrigs_support import LAB_INVENTORY, REPO, wait_healthy

from rigctl.evals.target import inventory_target
from rigctl.fleet.deploy import run_playbook
from rigctl.fleet.servers import deployed_argv, probe_server
from rigctl.forward import server_endpoint
from rigctl.inventory import Inventory
from rigctl.llama_http import ServerClient
from rigctl.ssh import SshClient, SshTarget

OVERRIDE_CTX = 1024


def _ctx(argv: list[str]) -> int:
    return int(argv[argv.index("-c") + 1])


@pytest.mark.lab
def test_a_host_ctx_override_is_what_the_rig_serves(lab_served: Inventory, tmp_path: Path) -> None:
    copy = tmp_path / "lab"
    shutil.copytree(LAB_INVENTORY, copy)
    laptop_vars = copy / "host_vars" / "laptop.yml"
    data = yaml.safe_load(laptop_vars.read_text()) or {}
    data["llama_server_profile_overrides"] = {"lab": {"ctx_size": OVERRIDE_CTX}}
    laptop_vars.write_text(yaml.safe_dump(data, sort_keys=False))
    overridden = Inventory.load(copy)
    laptop, desktop = overridden.host("laptop"), overridden.host("desktop")
    server = laptop.server("smollm2")
    assert server.profile.ctx_size == OVERRIDE_CTX and desktop.server("smollm2").profile.ctx_size == 2048
    try:
        run_playbook(overridden, "site.yml", limit="laptop", tags=["llama_server"], project=REPO).raise_for_failures()
        wait_healthy(overridden)
        with SshClient(SshTarget.from_host(laptop)) as ssh:
            deployed = deployed_argv(ssh, server)
            assert deployed == server.argv and _ctx(deployed) == OVERRIDE_CTX
            with ServerClient(server_endpoint(laptop, server)) as client:
                assert client.props().n_ctx == OVERRIDE_CTX  # what the running server took
            target = inventory_target(laptop, "smollm2", facts=False)
            assert target.flags["ctx_size"] == OVERRIDE_CTX
            # A probe beside the instance: the role's flags with only ctx and port changed, run by the
            # view's binary link as the unit's user.
            with probe_server(ssh, server, {"ctx_size": 512}, server.port + 300, "ctx 512") as probe:
                assert _ctx(probe.argv) == 512
                with ServerClient(probe.endpoint) as client:
                    assert client.props().n_ctx == 512
                user = ssh.run(f"systemctl show -p User --value {probe.unit}", timeout=30, check=True).stdout
                assert user.strip() == server.user == "llama"
        with SshClient(SshTarget.from_host(desktop)) as ssh:
            assert _ctx(deployed_argv(ssh, desktop.server("smollm2"))) == 2048  # the other host keeps the group's
    finally:
        # The lab's own inventory again: the laptop serves the group's profile.
        run_playbook(lab_served, "site.yml", limit="laptop", tags=["llama_server"]).raise_for_failures()
        wait_healthy(lab_served)
    with SshClient(SshTarget.from_host(lab_served.host("laptop"))) as ssh:
        assert _ctx(deployed_argv(ssh, lab_served.host("laptop").server("smollm2"))) == 2048
