"""A running server against its files (rigctl/hostside/server_drift.py): a real process started by the role's
real launcher, its files then changed the way a play killed before its restart leaves them."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from rigctl.errors import ConfigError
from rigctl.fleet.servers import parse_pending_restarts
from rigctl.hostside import sandbox, stamp
from rigctl.hostside.server_drift import (
    ARGUMENTS,
    BINARY,
    ENVIRONMENT,
    differences,
    launcher_argv,
    process_view,
)

REPO = Path(__file__).resolve().parents[2]
LAUNCHER_TEMPLATE = REPO / "roles/llama_server/templates/usr/local/libexec/rigctl/llama-server-exec.j2"


def _launcher(config_dir: Path, dest: Path) -> Path:
    """The role's launcher as its template renders for ``config_dir`` (the two variables it uses)."""
    text = LAUNCHER_TEMPLATE.read_text()
    text = text.replace("{{ ansible_managed | comment }}", "# rendered by the test")
    text = text.replace("{{ llama_server_config_dir }}", str(config_dir))
    text = text.replace("{{ none | llama_server_clean_env }}", sandbox.CLEAN_ENV_SH)
    assert "{{" not in text and "{%" not in text, "the launcher template uses more than the test renders"
    dest.write_text(text)
    dest.chmod(0o755)
    return dest


@pytest.fixture
def started(tmp_path: Path) -> Iterator[tuple[Path, int]]:
    """Instance ``smollm2`` started by the launcher: its binary is sleep, its one argument how long."""
    config = tmp_path / "etc"
    config.mkdir()
    (config / "smollm2.args").write_text("# llama-server@smollm2\n\n3600\n")
    (config / "smollm2.env").write_text("CUDA_VISIBLE_DEVICES=0\n")
    sleep = shutil.which("sleep")
    assert sleep is not None
    (config / "smollm2.bin").symlink_to(sleep)
    launcher = _launcher(config, tmp_path / "llama-server-exec")
    # A variable from outside (a drop-in's) that llama.cpp would read as -n 5: the launcher drops it.
    proc = subprocess.Popen(["/bin/sh", str(launcher), "smollm2"],
                            env={**os.environ, "LLAMA_ARG_N_PREDICT": "5", "HF_TOKEN": "hf_x"})
    try:
        deadline = time.monotonic() + 10
        while (view := process_view(proc.pid)) is None or view["argv"] != ["3600"]:
            assert proc.poll() is None and time.monotonic() < deadline, "the launcher did not exec the binary"
            time.sleep(0.05)
        yield config, proc.pid
    finally:
        proc.kill()
        proc.wait()


def test_a_server_started_from_its_files_runs_them(started: tuple[Path, int]) -> None:
    config, pid = started
    view = process_view(pid)
    assert view is not None
    assert view["exe"] == os.path.realpath(config / "smollm2.bin")
    assert differences(str(config), "smollm2", view) == []


def test_the_launcher_lets_no_llama_cpp_variable_through(started: tuple[Path, int]) -> None:
    _, pid = started
    environ = Path(f"/proc/{pid}/environ").read_bytes()
    assert stamp.parse_environ(environ) == []
    assert b"RIGCTL_LLAMA_SERVER_ENV_SHA256=" in environ  # what the launcher itself sets is there


def test_each_file_changed_after_the_start_is_named(started: tuple[Path, int], tmp_path: Path) -> None:
    """What a provision killed between writing the files and restarting leaves: each file is told apart."""
    config, pid = started
    view = process_view(pid)
    assert view is not None
    (config / "smollm2.args").write_text("3600\n-c 1024\n")
    assert differences(str(config), "smollm2", view) == [ARGUMENTS]
    (config / "smollm2.args").write_text("3600\n")
    assert differences(str(config), "smollm2", view) == []  # the same arguments, written anew
    (config / "smollm2.env").write_text("CUDA_VISIBLE_DEVICES=1\n")
    assert differences(str(config), "smollm2", view) == [ENVIRONMENT]
    other_build = tmp_path / "build-2" / "bin"
    other_build.mkdir(parents=True)
    shutil.copy2(os.path.realpath(config / "smollm2.bin"), other_build / "sleep")
    (config / "smollm2.bin").unlink()
    (config / "smollm2.bin").symlink_to(other_build / "sleep")
    assert differences(str(config), "smollm2", view) == [BINARY, ENVIRONMENT]


def test_a_process_the_launcher_did_not_mark_differs(tmp_path: Path) -> None:
    """A server an older launcher started carries no environment hash: it is restarted once, not trusted."""
    config = tmp_path
    (config / "x.args").write_text("3600\n")
    (config / "x.env").write_text("")
    sleep = shutil.which("sleep")
    assert sleep is not None
    (config / "x.bin").symlink_to(sleep)
    view = {"argv": ["3600"], "exe": os.path.realpath(sleep), "env_sha256": None}
    assert differences(str(config), "x", view) == [ENVIRONMENT]


def test_launcher_argv_follows_the_launchers_rules() -> None:
    assert launcher_argv("# c\n\n--port 8080\n-a  two  spaces\n--no-mmap\n-p a#b") == [
        "--port", "8080", "-a", " two  spaces", "--no-mmap", "-p", "a#b"]


def test_a_gone_process_has_no_view() -> None:
    gone = subprocess.Popen(["true"])
    gone.wait()
    assert process_view(gone.pid) is None


def test_the_hosts_answer_is_checked() -> None:
    assert parse_pending_restarts(json.loads('{"a": ["arguments", "binary"]}'), "desktop") == {
        "a": ("arguments", "binary")}
    with pytest.raises(ConfigError, match="^desktop: the running-process check answered a list"):
        parse_pending_restarts(["a"], "desktop")
    with pytest.raises(ConfigError, match="^desktop: the running-process check answered a dict"):
        parse_pending_restarts({"a": "arguments"}, "desktop")
