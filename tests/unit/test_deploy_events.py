"""The play's event stream as rigctl reads it: per-host outcomes, failure lines, what roles say."""

from __future__ import annotations

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
