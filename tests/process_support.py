"""This machine's processes as tests follow them: a process tree taken before a kill, and which of it still runs
after (the same processes: a pid with the same start time)."""

from __future__ import annotations

from pathlib import Path


def descendants(pid: int, *, but: str = "") -> dict[int, str]:
    """Every process under ``pid`` now (children of children...), by pid with its start time; ``but``: not those
    whose command line holds it."""
    found: dict[int, str] = {}
    todo = [pid]
    while todo:
        current = todo.pop()
        try:
            children = Path(f"/proc/{current}/task/{current}/children").read_text().split()
        except OSError:
            continue
        for child in map(int, children):
            try:
                found[child] = Path(f"/proc/{child}/stat").read_text().rsplit(")", 1)[1].split()[19]
            except (OSError, IndexError):
                continue
            todo.append(child)
    return {child: start for child, start in found.items() if not but or but not in cmdline(child)}


def cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


def still_running(pids: dict[int, str]) -> dict[int, str]:
    """Those of ``pids`` (pid: start time) that still run, each with its command line; zombies do not count."""
    running = {}
    for pid, start in pids.items():
        try:
            fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if fields[19] == start and fields[0] != "Z":
            running[pid] = cmdline(pid)
    return running
