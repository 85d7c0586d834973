"""rigctl.become: what a login that is not root sends to act as root, held to what a real ``sh`` makes of it."""

from __future__ import annotations

import os
import shlex
import subprocess
from pathlib import Path

import pytest

from rigctl.become import SFTP_SERVER_COMMAND, SUDO_CHECK, as_root
from rigctl.errors import ConnectError, SudoRefusedError
from rigctl.ssh import SshTarget

TRICKY = [
    "echo plain",
    "printf '%s\\n' \"it's\" 'a \"quote\"'",
    "export A='x y' B=\"$(printf 'z')\"; echo \"$A|$B\"",
    "cat; echo done >&2; exit 3",
    "echo '$HOME stays literal' && echo `echo backticks`\necho second line",
]
FALLBACKS = ("/usr/lib/openssh/sftp-server", "/usr/libexec/openssh/sftp-server", "/usr/lib/ssh/sftp-server",
             "/usr/libexec/sftp-server")


def fake_sudo(tmp_path: Path) -> dict[str, str]:
    """An environment whose ``sudo`` insists on ``-n --`` as rigctl sends them, then runs the rest as given."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    sudo = bin_dir / "sudo"
    sudo.write_text('#!/bin/sh\n[ "$1" = -n ] && [ "$2" = -- ] || { echo "sudo: bad options" >&2; exit 1; }\n'
                    'shift 2\nexec "$@"\n')
    sudo.chmod(0o755)
    return {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}"}


def login_shell(cmd: str, env: dict[str, str] | None = None, stdin: str = "") -> subprocess.CompletedProcess[str]:
    """``cmd`` as sshd runs an exec request: the login shell's ``-c``."""
    return subprocess.run(["sh", "-c", cmd], input=stdin, capture_output=True, text=True, env=env, timeout=30)


def test_as_root_is_sudo_without_a_prompt_around_sh() -> None:
    for cmd in TRICKY:
        wrapped = as_root(cmd)
        assert wrapped.startswith("sudo -n -- sh -c ")
        assert shlex.split(wrapped) == ["sudo", "-n", "--", "sh", "-c", cmd]


@pytest.mark.parametrize("cmd", TRICKY)
def test_as_root_runs_the_command_unchanged_with_stdin_passing_through(cmd: str, tmp_path: Path) -> None:
    direct = login_shell(cmd, stdin="from the controller\n")
    wrapped = login_shell(as_root(cmd), env=fake_sudo(tmp_path), stdin="from the controller\n")
    assert (wrapped.returncode, wrapped.stdout, wrapped.stderr) == (direct.returncode, direct.stdout, direct.stderr)
    assert direct.stdout  # each command prints something, so equality above compares what ran


def test_the_sudo_check_runs_nothing_but_sudo() -> None:
    assert shlex.split(SUDO_CHECK) == ["sudo", "-n", "--", "true"]


def sftp_command(config: Path) -> str:
    assert SFTP_SERVER_COMMAND.count("/etc/ssh/sshd_config") == 1
    return SFTP_SERVER_COMMAND.replace("/etc/ssh/sshd_config", shlex.quote(str(config)))


def test_the_sftp_server_is_the_one_sshd_config_names(tmp_path: Path) -> None:
    server = tmp_path / "libexec" / "sftp-server"
    server.parent.mkdir()
    server.write_text('#!/bin/sh\necho "started $0"\n')
    server.chmod(0o755)
    config = tmp_path / "sshd_config"
    config.write_text(f"# Subsystem sftp /nowhere\nPort 22\n  subsystem   sftp\t{server} -l INFO\n")
    done = login_shell(sftp_command(config))
    assert (done.returncode, done.stdout) == (0, f"started {server}\n"), done.stderr


def test_internal_sftp_falls_back_to_where_distributions_install_it(tmp_path: Path) -> None:
    if any(os.access(path, os.X_OK) for path in FALLBACKS):
        pytest.skip("this machine has an sftp-server in a fallback path")
    config = tmp_path / "sshd_config"
    config.write_text("Subsystem sftp internal-sftp\n")
    done = login_shell(sftp_command(config))
    assert (done.returncode, done.stdout, done.stderr) == (127, "", "no sftp-server found\n")
    missing = login_shell(sftp_command(tmp_path / "absent"))
    assert (missing.returncode, missing.stderr) == (127, "no sftp-server found\n")


def test_root_logs_in_as_it_is_and_any_other_user_through_sudo(tmp_path: Path) -> None:
    root = SshTarget("gpu3", "192.0.2.7", 22, "root", None, tmp_path / "known_hosts")
    assert not root.sudo
    assert SshTarget("gpu3", "192.0.2.7", 22, "rigctl", None, tmp_path / "known_hosts").sudo


def test_a_sudo_refusal_is_one_line_naming_host_user_and_the_fix() -> None:
    exc = SudoRefusedError("mixed", "rigctl", "sudo: a password is required")
    assert isinstance(exc, ConnectError)
    assert str(exc) == ("mixed: rigctl logs in but cannot act as root: the fleet user needs passwordless sudo "
                        "(sudo -n said: sudo: a password is required)")
