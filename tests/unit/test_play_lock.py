"""The host-side play lock against a local user (issue 39, item 2) and a failed play's release (issue 42,
item 2): the code the play_lock role runs as root on a host, run here on this machine."""

from __future__ import annotations

import json
import os
import subprocess
import time
from pathlib import Path

import pytest

from rigctl.hostside import play_lock

needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="making a directory another uid owns needs root")
#: What a local user without privileges is on a Debian host.
NOBODY = 65534


def _start_time(pid: int) -> str:
    found = play_lock._stat(pid)
    assert found is not None
    return found[2]


def _link() -> tuple[int, str]:
    """This test process as the controller's connection: the keeper lives as long as pytest does."""
    return os.getpid(), _start_time(os.getpid())


def _running(pid: int) -> bool:
    found = play_lock._stat(pid)
    return found is not None and Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"


def _wait_gone(pid: int, timeout: float = 5) -> None:
    deadline = time.monotonic() + timeout
    while _running(pid):
        assert time.monotonic() < deadline, f"pid {pid} still runs"
        time.sleep(0.05)


@pytest.fixture
def victim(tmp_path: Path) -> Path:
    """A file root must not write through a link: its content, owner and mode are checked after."""
    path = tmp_path / "victim"
    path.write_text("root's secret\n")
    path.chmod(0o600)
    return path


def _plant_links(directory: Path, victim: Path) -> None:
    """What a local user who made the directory first leaves in it: the holder record and the temporary
    name it used to be written through (``play.json.<pid>.tmp``) as links to a file of root's."""
    for name in (play_lock.HOLDER_FILE, f"{play_lock.HOLDER_FILE}.{os.getpid()}.tmp", play_lock.LOCK_FILE):
        (directory / name).symlink_to(victim)


@needs_root
def test_a_lock_directory_another_user_made_is_refused_and_nothing_written_through_it(
        tmp_path: Path, victim: Path) -> None:
    lock_dir = tmp_path / "rigctl"
    lock_dir.mkdir(mode=0o777)
    lock_dir.chmod(0o777)
    _plant_links(lock_dir, victim)
    os.chown(lock_dir, NOBODY, NOBODY)
    with pytest.raises(play_lock.LockDirRefused, match=rf"{lock_dir}: owned by uid {NOBODY}, not 0; refused"):
        play_lock.acquire({"controller": "laptop", "command": "rigctl provision"}, lock_dir=str(lock_dir),
                          link=_link())
    with pytest.raises(play_lock.LockDirRefused):
        play_lock.holder(str(lock_dir))
    with pytest.raises(play_lock.LockDirRefused):
        play_lock.release("any", lock_dir=str(lock_dir))
    assert victim.read_text() == "root's secret\n"
    assert victim.stat().st_mode & 0o777 == 0o600
    assert sorted(p.name for p in lock_dir.iterdir()) == sorted(
        [play_lock.HOLDER_FILE, f"{play_lock.HOLDER_FILE}.{os.getpid()}.tmp", play_lock.LOCK_FILE])


def test_a_lock_directory_others_may_write_or_a_link_to_one_is_refused(tmp_path: Path) -> None:
    open_dir = tmp_path / "open"
    open_dir.mkdir()
    open_dir.chmod(0o1777)
    with pytest.raises(play_lock.LockDirRefused, match=r"mode 1777 lets others in \(0700 expected\); refused"):
        play_lock.acquire({"command": "x"}, lock_dir=str(open_dir), link=_link())
    real = tmp_path / "real"
    real.mkdir(mode=0o700)
    linked = tmp_path / "linked"
    linked.symlink_to(real)
    with pytest.raises(play_lock.LockDirRefused, match="not a directory of its own"):
        play_lock.acquire({"command": "x"}, lock_dir=str(linked), link=_link())
    assert list(real.iterdir()) == []


def test_the_lock_directory_is_made_0700_and_the_holder_record_never_written_through_a_link(
        tmp_path: Path, victim: Path) -> None:
    lock_dir = tmp_path / "run" / "rigctl"
    first = play_lock.acquire({"controller": "laptop", "command": "rigctl provision"}, lock_dir=str(lock_dir),
                              link=_link())
    try:
        assert lock_dir.stat().st_mode & 0o777 == 0o700
        assert json.loads((lock_dir / play_lock.HOLDER_FILE).read_text())["token"] == first["token"]
    finally:
        assert play_lock.release(first["token"], lock_dir=str(lock_dir))
        _wait_gone(first["keeper_pid"])
    # Links where the records go (made by root's own mistake or a restored backup): replaced, not followed.
    for name in (play_lock.HOLDER_FILE, f"{play_lock.HOLDER_FILE}.{os.getpid()}.tmp", play_lock.LAST_FILE):
        (lock_dir / name).unlink(missing_ok=True)
        (lock_dir / name).symlink_to(victim)
    second = play_lock.acquire({"command": "again"}, lock_dir=str(lock_dir), link=_link())
    assert play_lock.release(second["token"], lock_dir=str(lock_dir))
    _wait_gone(second["keeper_pid"])
    assert victim.read_text() == "root's secret\n" and victim.stat().st_mode & 0o777 == 0o600
    assert not (lock_dir / play_lock.LAST_FILE).is_symlink()
    assert json.loads((lock_dir / play_lock.LAST_FILE).read_text())["token"] == second["token"]


def test_release_signals_only_the_keeper_it_started(tmp_path: Path) -> None:
    """A holder record naming another process (its pid and true start time) gets no signal sent to it: that
    process does not hold the lock file."""
    lock_dir = tmp_path / "rigctl"
    taken = play_lock.acquire({"command": "rigctl provision"}, lock_dir=str(lock_dir), link=_link())
    bystander = subprocess.Popen(["sleep", "300"])
    try:
        record = json.loads((lock_dir / play_lock.HOLDER_FILE).read_text())
        record.update(keeper_pid=bystander.pid, keeper_start=_start_time(bystander.pid))
        (lock_dir / play_lock.HOLDER_FILE).write_text(json.dumps(record))
        assert play_lock.release(taken["token"], lock_dir=str(lock_dir)) is True
        time.sleep(0.3)
        assert bystander.poll() is None, "release signalled a process it did not start"
    finally:
        bystander.kill()
        bystander.wait()
        os.kill(taken["keeper_pid"], 15)
        _wait_gone(taken["keeper_pid"])


def test_a_failed_play_releases_its_lock_saying_so_and_only_a_dead_holder_is_taken_over(tmp_path: Path) -> None:
    lock_dir = str(tmp_path / "rigctl")
    failed = play_lock.acquire({"controller": "laptop-a", "pid": 11, "command": "rigctl provision"},
                               lock_dir=lock_dir, link=_link())
    assert play_lock.release(failed["token"], lock_dir=lock_dir, outcome="failed") is True
    _wait_gone(failed["keeper_pid"])
    assert play_lock.holder(lock_dir) is None
    last = json.loads((Path(lock_dir) / play_lock.LAST_FILE).read_text())
    assert last["outcome"] == "failed" and last["token"] == failed["token"] and last["released"]

    after_failure = play_lock.acquire({"controller": "laptop-b", "command": "again"}, lock_dir=lock_dir, link=_link())
    assert after_failure["stale"] is None
    assert after_failure["previous"]["outcome"] == "failed"
    assert after_failure["previous"]["controller"] == "laptop-a"

    # Its holder dies without releasing (the keeper ends as it does when the connection goes): taken over.
    os.kill(after_failure["keeper_pid"], 15)
    _wait_gone(after_failure["keeper_pid"])
    taken_over = play_lock.acquire({"controller": "laptop-c", "command": "third"}, lock_dir=lock_dir, link=_link())
    assert taken_over["stale"]["token"] == after_failure["token"]
    assert play_lock.release(taken_over["token"], lock_dir=lock_dir) is True
    _wait_gone(taken_over["keeper_pid"])
    assert json.loads((Path(lock_dir) / play_lock.LAST_FILE).read_text())["outcome"] == "ok"


def test_the_site_playbook_frees_a_host_it_failed_on_saying_so(tmp_path: Path) -> None:
    """The real playbooks/site.yml on this machine as its one host (only the tasks every run has: the lock,
    the facts, the roles' argument checks): a run that fails inside the roles' block (the models role's
    arguments: a models_fetch_timeout that is no number) still releases the lock, outcome failed; the next run
    names that failure instead of taking anything over, and ends with outcome ok."""
    import sys

    import yaml

    repo = Path(__file__).resolve().parents[2]
    lock_dir = tmp_path / "lock"
    rig = {"ansible_connection": "local", "ansible_python_interpreter": sys.executable, "ansible_become": False,
           "play_lock_dir": str(lock_dir), "play_lock_client_alive_interval": 0}

    def play(extra: dict[str, str]) -> subprocess.CompletedProcess[str]:
        (tmp_path / "hosts.yml").write_text(yaml.safe_dump({"gpu_hosts": {"hosts": {"rig": {**rig, **extra}}}}))
        return subprocess.run([str(Path(sys.executable).with_name("ansible-playbook")), "-i",
                               str(tmp_path / "hosts.yml"), "playbooks/site.yml", "--tags", "none_such"],
                              cwd=repo, env={**os.environ, "ANSIBLE_NOCOLOR": "1"}, capture_output=True, text=True,
                              timeout=300, check=False)

    failed = play({"models_fetch_timeout": "soon"})
    assert failed.returncode != 0 and "models_fetch_timeout" in failed.stdout, failed.stdout[-3000:]
    assert sorted(p.name for p in lock_dir.iterdir()) == [play_lock.LAST_FILE, play_lock.LOCK_FILE]
    assert json.loads((lock_dir / play_lock.LAST_FILE).read_text())["outcome"] == "failed"
    assert lock_dir.stat().st_mode & 0o777 == 0o700

    done = play({"models_fetch_timeout": "60"})
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "took over" not in done.stdout
    assert "play lock taken; the last play, pid ? on ? (`ansible-playbook`, since ?), ended by failure here" \
        in done.stdout, done.stdout[-3000:]
    assert json.loads((lock_dir / play_lock.LAST_FILE).read_text())["outcome"] == "ok"
