"""The play's event stream as rigctl reads it: per-host outcomes, failure lines, what roles say, rolling
rollouts' batches (real ansible-playbook over local hosts)."""

from __future__ import annotations

from pathlib import Path

import pytest

from rigctl.fleet.deploy import TaskEvent, _EventCollector


def _ok(host: str, task: str, action: str, res: dict) -> dict:
    return {"event": "runner_on_ok", "event_data": {"host": host, "task": task, "task_action": action, "res": res}}


def test_a_debug_task_says_its_message_once_on_one_line_without_the_host() -> None:
    events: list[TaskEvent] = []
    collector = _EventCollector(["desktop"], events.append, None)
    said = "desktop: removed what an interrupted llama.cpp build left:\n /var/cache/x"
    collector(_ok("desktop", "Say what was removed", "ansible.builtin.debug", {"msg": said, "changed": False}))
    collector(_ok("desktop", "Report", "debug", {"msg": "laptop: named another host"}))
    assert [e.message for e in events] == ["removed what an interrupted llama.cpp build left: /var/cache/x",
                                           "laptop: named another host"]
    assert [e.status for e in events] == ["ok", "ok"]


def test_other_tasks_say_nothing_when_they_succeed_and_their_last_line_when_they_fail() -> None:
    events: list[TaskEvent] = []
    collector = _EventCollector(["desktop"], events.append, None)
    collector(_ok("desktop", "Copy", "ansible.builtin.copy", {"msg": "copied", "changed": True}))
    collector({"event": "runner_on_failed", "event_data": {
        "host": "desktop", "task": "Compile", "task_action": "ansible.builtin.command",
        "res": {"msg": "non-zero return code", "stderr": "a\nerror: it broke\n"}}})
    assert [(e.status, e.message) for e in events] == [("changed", ""), ("failed", "non-zero return code")]
    assert collector.outcome("desktop").failed_task == "Compile"


# ----------------------------------------------------------------------------------------------- rolling


def _project(tmp_path, hosts: dict[str, dict]) -> tuple:
    """A project whose site.yml is the real one's play (its hosts, serial and max_fail_percentage) with one
    task that fails where a host sets ``fail_here``, and an inventory of local hosts: real Ansible, no rigs."""
    import sys

    import yaml

    from rigctl.inventory import Inventory

    repo = Path(__file__).resolve().parents[2]
    (play,) = yaml.safe_load((repo / "playbooks" / "site.yml").read_text())
    play = {key: play[key] for key in ("name", "hosts", "serial", "max_fail_percentage")}
    play.update(gather_facts=False, tasks=[{"name": "Converge", "ansible.builtin.fail": {"msg": "broken on purpose"},
                                           "when": "fail_here | default(false)"},
                                          {"name": "Answer", "ansible.builtin.ping": {}}])
    (tmp_path / "playbooks").mkdir(parents=True)
    (tmp_path / "playbooks" / "site.yml").write_text(yaml.safe_dump([play], sort_keys=False))
    (tmp_path / "ansible.cfg").write_text("[defaults]\nretry_files_enabled = False\nhost_key_checking = True\n")
    local = {"ansible_connection": "local", "ansible_python_interpreter": sys.executable}
    members = {name: {**local, **spec} for name, spec in hosts.items()}
    inventory = {"all": {"children": {"gpu_hosts": {"hosts": members}}}}
    (tmp_path / "inventory").mkdir()
    (tmp_path / "inventory" / "hosts.yml").write_text(yaml.safe_dump(inventory))
    return Inventory.load(tmp_path / "inventory"), tmp_path


def test_a_failed_batch_stops_the_later_ones_and_is_named(tmp_path) -> None:
    from rigctl.errors import DeployError
    from rigctl.fleet.deploy import run_playbook

    inventory, project = _project(tmp_path, {"a": {}, "b": {"fail_here": True}, "c": {}})
    result = run_playbook(inventory, project=project, serial=[1])
    assert result.batches == [["a"], ["b"]] and result.stopped_batch == 2 and result.not_run() == ["c"]
    assert [result.hosts[h].batch for h in "abc"] == [1, 2, None]
    assert result.hosts["a"].succeeded and result.hosts["a"].ok == 1 and result.hosts["b"].failed == 1
    assert (result.hosts["c"].ok, result.hosts["c"].skipped) == (0, 0)
    with pytest.raises(DeployError, match=r"^batch 2 of the rollout \(b\) stopped it; b failed at 'Converge': "
                                          r"broken on purpose; not run: c$"):
        result.raise_for_failures()


def test_without_batches_one_host_failing_never_stops_the_others(tmp_path) -> None:
    from rigctl.fleet.deploy import run_playbook

    inventory, project = _project(tmp_path, {"a": {}, "b": {"fail_here": True}, "c": {}})
    result = run_playbook(inventory, project=project)
    assert result.batches == [["a", "b", "c"]] and result.stopped_batch is None and result.not_run() == []
    assert result.hosts["c"].succeeded and result.hosts["c"].ok == 1 and not result.succeeded


def test_percentage_batches_run_in_turn(tmp_path) -> None:
    from rigctl.fleet.deploy import run_playbook

    inventory, project = _project(tmp_path, {name: {} for name in "abcde"})
    result = run_playbook(inventory, project=project, serial=[1, "50%"])
    # One host first, then half of the five (two) at a time: Ansible's own arithmetic.
    assert result.succeeded and result.batches == [["a"], ["b", "c"], ["d", "e"]]


def test_the_batches_come_from_the_option_or_the_inventory_and_are_checked(tmp_path) -> None:
    from rigctl.errors import ConfigError
    from rigctl.fleet.deploy import rollout_serial

    inventory, _ = _project(tmp_path, {"a": {"rigctl_serial": "25%"}, "b": {"rigctl_serial": "25%"}})
    hosts = list(inventory.hosts.values())
    assert rollout_serial(hosts) == ["25%"] and rollout_serial(hosts, "1, 50%") == [1, "50%"]
    for bad in ("0", "150%", "one", ""):
        with pytest.raises(ConfigError, match=r"^--serial: .* is not a batch size"):
            rollout_serial(hosts, bad)
    mixed, _ = _project(tmp_path / "mixed", {"a": {"rigctl_serial": 1}, "b": {}})
    with pytest.raises(ConfigError, match=r"^rigctl_serial: .* the hosts differ \(a \[1\], b \(unset\)\)$"):
        rollout_serial(list(mixed.hosts.values()))
    with pytest.raises(ConfigError, match=r"rigctl_serial: 'x' is not a batch size"):
        rollout_serial(list(_project(tmp_path / "bad", {"a": {"rigctl_serial": ["x"]}})[0].hosts.values()))
