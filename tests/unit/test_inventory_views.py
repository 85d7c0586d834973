"""The typed Server / Profile / Artifact views against what the llama_server role itself renders.

One temporary inventory: a group profile chain and, on the laptop only, a host override of ``ctx_size``
(and of the drafter's ``draft_n_max``). The role's own Jinja (defaults, vars, the arguments-file template,
the filter plugin) is rendered by a real ``ansible-playbook`` run on the controller, and every consumer
that serves or records a server (eval target, bench server probe, drafter race) must carry the same
values the role wrote.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from rigctl.bench.drafting import contenders
from rigctl.errors import ConfigError
from rigctl.evals.target import inventory_target
from rigctl.forward import server_endpoint
from rigctl.inventory import Inventory
from rigctl.inventory.check import check
from rigctl.inventory.profiles import args_lines_to_argv

REPO = Path(__file__).resolve().parents[2]
ROLE = REPO / "roles" / "llama_server"
OVERRIDE_CTX = 1536

GROUP_VARS = {
    "llama_cpp_source": "archive",
    "llama_cpp_version": "b11434",
    "llama_cpp_archive": {"path": "/src/llama.cpp.tar.gz", "sha256": "0" * 64},
    "models_catalog": {"smollm2": {"source": {"type": "controller", "path": "/m/s.gguf"}, "artifacts": {
        "smollm2-q4_1": {"type": "file", "file": "s.gguf"},
        "smollm2-q4_0": {"type": "quantize", "from": "smollm2-q4_1", "qtype": "Q4_0"}}}},
    "llama_server_api_key": "test-key-1",
    "llama_server_profiles": {
        "base": {"host": "0.0.0.0", "n_gpu_layers": 0, "ctx_size": 2048, "threads": 2, "metrics": True},
        "spec": {"extends": "base", "threads": 1},
        "draft": {"extends": "spec", "spec": {"type": "draft-simple", "draft_n_max": 3,
                                              "draft_model": "smollm2-q4_1"}},
    },
    "llama_server_instances": {
        "main": {"artifact": "smollm2-q4_1", "profile": "base", "port": 8080},
        "plain": {"artifact": "smollm2-q4_0", "profile": "spec", "port": 8090, "enabled": False},
        "drafted": {"artifact": "smollm2-q4_0", "profile": "draft", "port": 8091, "enabled": False, "gpu": 0},
    },
}
HOST_VARS = {
    "desktop": {"ansible_host": "192.0.2.11"},
    # The laptop: a smaller context for every profile it serves, its own drafter depth, its own paths.
    "laptop": {"ansible_host": "192.0.2.12", "gpu_host_user": "svc", "models_dir": "/srv/models",
               "llama_server_config_dir": "/etc/ls",
               "llama_server_profile_overrides": {"base": {"ctx_size": OVERRIDE_CTX},
                                                  "spec": {"ctx_size": OVERRIDE_CTX},
                                                  "draft": {"ctx_size": OVERRIDE_CTX, "spec": {"draft_n_max": 2}}}},
}

# The role's derivations, rendered by Ansible from the role's own files.
PLAY = """
- hosts: all
  connection: local
  gather_facts: false
  vars_files: ["{role}/vars/main.yml"]
  tasks:
    - name: Render each instance's arguments file with the role's template
      ansible.builtin.template:
        src: "{role}/templates/etc/llama-server/instance.args.j2"
        dest: "{{{{ out }}}}/{{{{ inventory_hostname }}}}-{{{{ item.name }}}}.args"
        mode: "0600"
      loop: "{{{{ _llama_server_plan }}}}"
      loop_control:
        label: "{{{{ item.name }}}}"
    - name: Render the llama-server@ unit with the role's template
      ansible.builtin.template:
        src: "{role}/templates/etc/systemd/system/llama-server@.service.j2"
        dest: "{{{{ out }}}}/{{{{ inventory_hostname }}}}.service"
        mode: "0600"
    - name: Write what the role derives
      ansible.builtin.copy:
        content: "{{{{ {{'user': llama_server_user, 'group': llama_server_group, 'config_dir': llama_server_config_dir,
                     'state_dir': llama_server_state_dir,
                     'models_dir': llama_server_models_dir, 'key_file': _llama_server_key_file,
                     'plan': _llama_server_plan}} | to_json }}}}"
        dest: "{{{{ out }}}}/{{{{ inventory_hostname }}}}.json"
        mode: "0600"
"""


def _write(path: Path, data: object) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(yaml.safe_dump(data, sort_keys=False))


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory) -> tuple[Inventory, Path]:
    """The temporary inventory, loaded, and the directory the role rendered it into."""
    root = tmp_path_factory.mktemp("views")
    inv = root / "inv"
    _write(inv / "hosts.yml", {"all": {"children": {"gpu_hosts": {"hosts": {name: None for name in HOST_VARS}}}}})
    _write(inv / "group_vars" / "gpu_hosts" / "main.yml", GROUP_VARS)
    for name, values in HOST_VARS.items():
        _write(inv / "host_vars" / f"{name}.yml", values)
    out = root / "rendered"
    out.mkdir()
    (root / "play.yml").write_text(PLAY.format(role=ROLE))
    # The role's defaults, below every inventory variable as in a play of the role: a copy for group all
    # of the rendering inventory only (rigctl reads the inventory without them).
    rendering = root / "rendering"
    shutil.copytree(inv, rendering)
    shutil.copy(ROLE / "defaults" / "main.yml", rendering / "group_vars" / "all.yml")
    (root / "ansible.cfg").write_text("[defaults]\n")  # not the repository's (mitogen, the lab inventory)
    env = {**os.environ, "ANSIBLE_FILTER_PLUGINS": str(ROLE / "filter_plugins"),
           "ANSIBLE_CONFIG": str(root / "ansible.cfg"), "ANSIBLE_NOCOLOR": "1"}
    playbook = Path(sys.executable).with_name("ansible-playbook")
    done = subprocess.run([str(playbook), "-i", str(rendering), str(root / "play.yml"), "-e", f"out={out}",
                           "-e", f"ansible_python_interpreter={sys.executable}"], cwd=root,
                          env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return Inventory.load(inv), out


def _rendered_argv(out: Path, host: str, instance: str) -> list[str]:
    return args_lines_to_argv((out / f"{host}-{instance}.args").read_text().splitlines())


def _ctx(argv: list[str]) -> int:
    return int(argv[argv.index("-c") + 1])


def test_the_inventory_is_valid(fleet: tuple[Inventory, Path]) -> None:
    inventory, _ = fleet
    assert [str(p) for p in check(inventory, [REPO / "roles"]) if p.severity == "error"] == []


def test_servers_are_what_the_role_renders(fleet: tuple[Inventory, Path]) -> None:
    """Every derived value of every instance equals the role's: flags, paths, unit, user, key file."""
    inventory, out = fleet
    for host in inventory.hosts.values():
        role = json.loads((out / f"{host.name}.json").read_text())
        servers = host.servers
        assert [s.name for s in servers] == [p["name"] for p in role["plan"]]
        for server, plan in zip(servers, role["plan"], strict=True):
            assert server.argv == _rendered_argv(out, host.name, server.name)
            assert list(server.flags) == plan["flags"]
            assert dict(server.profile.settings) == plan["profile"]
            assert (server.unit, server.model.path, server.draft_model.path if server.draft_model else "",
                    server.port, server.enabled, server.gpu, server.bind) == \
                   (plan["unit"], plan["model"], plan["draft_model"], plan["port"], plan["enabled"], plan["gpu"],
                    plan["bind"])
            assert (server.user, server.group, server.config_dir, server.models_dir, server.key_file) == \
                   (role["user"], role["group"], role["config_dir"], role["models_dir"], role["key_file"])
            assert server.args_file == f"{role['config_dir']}/{server.name}.args"
            assert server.binary == f"{role['config_dir']}/{server.name}.bin"
    laptop = inventory.host("laptop").server("main")
    assert (laptop.user, laptop.key_file, laptop.model.path) == \
           ("svc", "/etc/ls/api-key", "/srv/models/smollm2-q4_1.gguf")
    endpoint = server_endpoint(inventory.host("laptop"), laptop)  # bound to 0.0.0.0: asked at the host's address
    assert endpoint.url == "http://192.0.2.12:8080" and endpoint.api_key == "test-key-1" and endpoint.via is None


def test_jobs_and_probes_get_the_account_and_sandbox_the_role_gives_the_unit(fleet: tuple[Inventory, Path]) -> None:
    """The rendered unit's User=, Group=, SupplementaryGroups= and every hardening line, in its order, are what
    a job and a probe server run with (their one home, rigctl/hostside/sandbox.py): the laptop's own user too."""
    inventory, out = fleet
    for host in inventory.hosts.values():
        role = json.loads((out / f"{host.name}.json").read_text())
        unit = (out / f"{host.name}.service").read_text().splitlines()
        service = [line for line in unit[unit.index("[Service]") + 1: unit.index("[Install]")]
                   if line and not line.startswith("#")]
        expected = host.service_account.unit_properties([role["state_dir"]])
        account = [line for line in service if line.split("=")[0] in ("User", "Group", "SupplementaryGroups")]
        assert account == expected[:3] == [f"User={role['user']}", f"Group={role['group']}",
                                           "SupplementaryGroups=video"]
        assert service[service.index("DevicePolicy=closed"):] == expected[3:]
        assert all(server.account == host.service_account for server in host.servers)
    assert inventory.host("laptop").service_account.user == "svc"


def test_a_host_override_of_ctx_size_reaches_every_consumer(fleet: tuple[Inventory, Path]) -> None:
    """The laptop's llama_server_profile_overrides ctx_size is in its rendered arguments file, the eval target,
    the bench server's settings and probe, and the drafter race's contenders; the desktop keeps the group's."""
    inventory, out = fleet
    for name, expected in (("desktop", 2048), ("laptop", OVERRIDE_CTX)):
        host = inventory.host(name)
        for instance in ("main", "plain", "drafted"):
            assert _ctx(_rendered_argv(out, name, instance)) == expected
            server = host.server(instance)
            assert server.profile.ctx_size == expected
            # eval: the record's server flags
            target = inventory_target(host, instance, facts=False)
            assert target.flags["ctx_size"] == expected and target.inventory_server == server
            # bench server / load: the settings recorded and what a probe on a spare port runs
            assert _ctx(server.argv_with(port=9999)) == expected
            assert _ctx(server.argv_with(port=9999, ctx_size=4096)) == 4096
        # spec: the contenders the race records
        base, drafter = contenders(host, "plain")
        assert base.settings["ctx_size"] == drafter.settings["ctx_size"] == expected
        assert drafter.spec is not None and drafter.spec["draft_n_max"] == (2 if name == "laptop" else 3)
        assert drafter.settings == dict(host.server("drafted").profile.settings)


def test_probe_argv_is_the_role_flags_with_only_the_asked_change(fleet: tuple[Inventory, Path]) -> None:
    inventory, out = fleet
    server = inventory.host("laptop").server("drafted")
    deployed = _rendered_argv(out, "laptop", "drafted")
    probe = server.argv_with(port=8191, ctx_size=512, parallel=4)
    changed = {(a, b) for a, b in zip(probe, probe[1:], strict=False)} - \
        {(a, b) for a, b in zip(deployed, deployed[1:], strict=False)}
    assert ("--port", "8191") in changed and ("-c", "512") in changed and ("--parallel", "4") in changed
    assert "-md" in probe and probe[probe.index("-md") + 1] == "/srv/models/smollm2-q4_1.gguf"
    assert probe[probe.index("--api-key-file") + 1] == "/etc/ls/api-key"


def test_artifacts_as_the_models_role_names_them(fleet: tuple[Inventory, Path]) -> None:
    inventory, _ = fleet
    laptop = inventory.host("laptop")
    assert [a.name for a in laptop.artifacts] == ["smollm2-q4_1", "smollm2-q4_0"]
    artifact = laptop.artifact("smollm2-q4_0")
    assert (artifact.path, artifact.manifest_path, artifact.pin) == (
        "/srv/models/smollm2-q4_0.gguf", "/srv/models/smollm2-q4_0.gguf.manifest.json", None)


def test_a_bad_extends_chain_is_one_error_naming_the_host(fleet: tuple[Inventory, Path]) -> None:
    import dataclasses

    inventory, _ = fleet
    host = inventory.host("desktop")
    broken = dataclasses.replace(host, vars={**host.vars, "llama_server_profiles": {
        **host.vars["llama_server_profiles"], "spec": {"extends": "gone"}}})
    for view in (lambda: broken.servers, lambda: inventory_target(broken, "main", facts=False),
                 lambda: contenders(broken, "plain")):
        with pytest.raises(ConfigError, match="^host desktop: llama_server_profiles: profile 'spec' extends 'gone'"):
            view()


def test_the_role_loads_the_resolver_with_the_standard_library_only() -> None:
    """What a system ansible-playbook (no rigctl, no site-packages) gets: the plugin still loads the
    checkout's resolver and plans."""
    plugin = ROLE / "filter_plugins" / "llama_server.py"
    script = (
        "import importlib.util, sys\n"
        f"spec = importlib.util.spec_from_file_location('plugin', {str(plugin)!r})\n"
        "plugin = importlib.util.module_from_spec(spec); spec.loader.exec_module(plugin)\n"
        "plan = plugin.llama_server_plan({'a': {'artifact': 'm', 'profile': 'p', 'port': 1}},\n"
        "                                {'p': {'ctx_size': 64}}, models_dir='/m', config_dir='/c')\n"
        "assert 'rigctl' not in sys.modules and 'ansible' not in sys.modules, sorted(sys.modules)\n"
        "print(plan[0]['flags'])\n"
    )
    done = subprocess.run([sys.executable, "-I", "-S", "-c", script], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "['--model /m/m.gguf', '--alias m', '--port 1', '-c 64']"
