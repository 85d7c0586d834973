"""The lab's dealings with this machine: root's tools run with a time limit, processes found by their
command line, mounts read from mountinfo, links, files. Errors are :class:`~rigctl.errors.LabError` naming the
command."""

from __future__ import annotations

import contextlib
import json
import logging
import os
import re
import shlex
import shutil
import signal
import socket
import subprocess
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

from rigctl.errors import LabError

log = logging.getLogger(__name__)

#: Host tool -> the Debian package that provides it.
REQUIRED_TOOLS: dict[str, str] = {
    "systemd-nspawn": "systemd-container",
    "debootstrap": "debootstrap",
    "ip": "iproute2",
    "ssh-keygen": "openssh-client",
    "ssh": "openssh-client",
    "zstd": "zstd",
    "tar": "tar",
    "mount": "mount",
    "nsenter": "util-linux",
}
NETNS_DIR = Path("/run/netns")
COMMAND_TIMEOUT_S = 30
TCP_PROBE_TIMEOUT_S = 0.5
REMOVE_TREE_TIMEOUT_S = 900
POLL_S = 0.1
_ANSI_ESCAPE = re.compile(r"\x1b\[[0-9;]*[A-Za-z]")
# Supervisors this process started, kept so their exit status is collected (no zombies) even when
# the lab that started them was a different Lab object.
SUPERVISORS: dict[int, subprocess.Popen[bytes]] = {}


def cgroup_roots(mountinfo: str) -> list[Path]:
    """Mount points of the hierarchies nspawn's guest needs a cgroup in: systemd's named v1
    hierarchy and the v2 (unified) one."""
    roots = []
    for line in mountinfo.splitlines():
        before, _, after = line.partition(" - ")
        fields = before.split()
        fstype, _source, *rest = after.split()
        options = rest[0].split(",") if rest else []
        if fstype == "cgroup2" or (fstype == "cgroup" and "name=systemd" in options):
            roots.append(Path(_unescape_mount_path(fields[4])))
    return roots


def mounts_under(mountinfo: str, path: Path) -> list[Path]:
    """Mount points at or below ``path``, deepest first."""
    found = []
    for line in mountinfo.splitlines():
        point = Path(_unescape_mount_path(line.split()[4]))
        if point == path or path in point.parents:
            found.append(point)
    return sorted(found, key=lambda p: len(p.parts), reverse=True)


def _unescape_mount_path(text: str) -> str:
    return text.encode().decode("unicode_escape") if "\\" in text else text


def check_root() -> None:
    if os.geteuid() != 0:
        raise LabError("the lab rigs need root (network namespaces, systemd-nspawn, debootstrap); run as root")


def check_tools(tools: Sequence[str]) -> None:
    for tool in tools:
        if shutil.which(tool) is None:
            raise LabError(f"{tool} not found; install the {REQUIRED_TOOLS[tool]} package")


def run_command(argv: Sequence[str], *, timeout: float) -> subprocess.CompletedProcess[str]:
    try:
        done = subprocess.run(list(argv), capture_output=True, text=True, timeout=timeout, stdin=subprocess.DEVNULL)
    except subprocess.TimeoutExpired:
        raise LabError(f"`{shlex.join(argv)}` ran past {timeout:.0f}s") from None
    except FileNotFoundError:
        package = REQUIRED_TOOLS.get(argv[0])
        raise LabError(f"{argv[0]} not found" + (f"; install the {package} package" if package else "")) from None
    if done.returncode != 0:
        raise LabError(f"`{shlex.join(argv)}` exited {done.returncode}: {last_line(done.stderr or done.stdout)}")
    return done


def last_line(text: str) -> str:
    """The last non-empty line, without the terminal colours a guest's console carries."""
    lines = [_ANSI_ESCAPE.sub("", line).strip() for line in text.splitlines()]
    lines = [line for line in lines if line]
    return lines[-1] if lines else "no output"


def console_tail(path: Path) -> str:
    """The console's last line from nspawn or the guest (the supervisor's own notes say less)."""
    try:
        text = path.read_text(errors="replace")
    except OSError:
        return f"no {path.name}"
    return last_line("\n".join(line for line in text.splitlines() if not line.startswith("rig-supervisor:")))


@contextlib.contextmanager
def in_step(rig: str, step: str) -> Iterator[None]:
    """Names the rig and step in whatever goes wrong inside."""
    log.info("%s: %s", rig, step)
    try:
        yield
    except LabError as exc:
        raise LabError(f"{rig}: {step}: {exc}") from exc
    except (OSError, subprocess.SubprocessError) as exc:
        raise LabError(f"{rig}: {step}: {exc}") from exc


def attempt(action: Callable[[], object], what: str) -> list[str]:
    """Run one teardown step; its failure as a message, so the next steps still run."""
    try:
        action()
    except (LabError, OSError, subprocess.SubprocessError) as exc:
        log.warning("%s: %s", what, exc)
        return [f"{what}: {exc}"]
    return []


def wait_until(condition: Callable[[], bool], timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while True:
        if condition():
            return True
        if time.monotonic() > deadline:
            return False
        time.sleep(POLL_S)


def tcp_answers(address: str, port: int) -> bool:
    try:
        with socket.create_connection((address, port), timeout=TCP_PROBE_TIMEOUT_S):
            return True
    except OSError:
        return False


def alive(pid: int) -> bool:
    """True while ``pid`` runs; collects it first if it is a supervisor this process started."""
    supervisor = SUPERVISORS.get(pid)
    if supervisor is not None and supervisor.poll() is not None:
        del SUPERVISORS[pid]
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except (FileNotFoundError, ProcessLookupError):
        return False
    # A zombie has exited; only its parent's wait (PID 1 reaps orphans late here) is missing.
    return stat.rpartition(")")[2].split()[0] not in {"Z", "X"}


def _cmdline(pid: int) -> list[str]:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace").split("\0")
    except OSError:
        return []


def live_pid(pid_file: Path, argument: str) -> int | None:
    """The pid in ``pid_file`` if that process runs and has ``argument`` on its command line (a
    recycled pid does not)."""
    try:
        pid = int(pid_file.read_text().strip())
    except (OSError, ValueError):
        return None
    return pid if alive(pid) and argument in _cmdline(pid) else None


def pids_with_argument(arguments: set[str]) -> set[int]:
    found = set()
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit() and arguments.intersection(_cmdline(int(entry.name))):
            found.add(int(entry.name))
    return found


def kill_all(pids: set[int]) -> bool:
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    return not any(alive(pid) for pid in pids)


def rmdir_tree(top: Path) -> bool:
    """Remove an (empty of processes) cgroup tree; False while the kernel still holds part of it."""
    try:
        for directory, _dirs, _files in os.walk(top, topdown=False):
            os.rmdir(directory)
    except OSError:
        return False
    return True


def read_mountinfo() -> str:
    return Path("/proc/self/mountinfo").read_text()


def unmount_under(path: Path) -> None:
    for point in mounts_under(read_mountinfo(), path):
        log.info("unmounting %s", point)
        try:
            run_command(["umount", str(point)], timeout=COMMAND_TIMEOUT_S)
        except LabError:
            run_command(["umount", "--lazy", str(point)], timeout=COMMAND_TIMEOUT_S)


def remove_tree(path: Path) -> None:
    """Remove ``path`` without ever crossing into a mounted file system."""
    if not path.exists() and not path.is_symlink():
        return
    unmount_under(path)
    run_command(["rm", "-rf", "--one-file-system", "--", str(path)], timeout=REMOVE_TREE_TIMEOUT_S)


def remove_empty_dirs_up_to(path: Path, stop_at: Path) -> None:
    if not path.is_dir():
        return
    for directory, _dirs, _files in os.walk(path, topdown=False):
        with contextlib.suppress(OSError):
            os.rmdir(directory)
    while path != stop_at and path.is_dir():
        try:
            path.rmdir()
        except OSError:
            return
        path = path.parent


def release_netns_dir() -> None:
    """`ip netns add` makes /run/netns a mount point; once the last namespace is gone, undo that."""
    if not NETNS_DIR.is_dir() or any(NETNS_DIR.iterdir()):
        return
    unmount_under(NETNS_DIR)
    with contextlib.suppress(OSError):
        NETNS_DIR.rmdir()


def link_exists(name: str, marker: str | None = None) -> bool:
    """Whether link ``name`` exists (and, given ``marker``, carries it as its alias)."""
    done = subprocess.run(
        ["ip", "-j", "link", "show", "dev", name],
        capture_output=True,
        text=True,
        timeout=COMMAND_TIMEOUT_S,
        stdin=subprocess.DEVNULL,
    )
    if done.returncode != 0:
        return False
    links = json.loads(done.stdout or "[]")
    return bool(links) and (marker is None or links[0].get("ifalias") == marker)


def write_file(path: Path, text: str, mode: int) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    path.chmod(mode)


def is_namespace_init(pid: int) -> bool:
    """Whether ``pid`` is PID 1 of a PID namespace below this one (a container's init)."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return False
    for line in status.splitlines():
        if line.startswith("NSpid:"):
            ids = line.split()[1:]
            return len(ids) > 1 and ids[-1] == "1"
    return False
