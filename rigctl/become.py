"""Acting as root from a login that is not: the commands :mod:`rigctl.ssh` sends through passwordless sudo.

An enrolled host's fleet user is a sudoer, not root (see :mod:`rigctl.fleet.enroll`), while what rigctl does on
a host (the job tree under /var/lib/rigctl, systemd units, root-only files) is root's, as Ansible's ``become``
makes it for the roles. ``sudo -n`` never prompts: without a NOPASSWD rule it fails at once, and the caller says
so. Standard library only: these are strings, and the unit tests hold them to what a shell makes of them.
"""

from __future__ import annotations

import shlex

ROOT = "root"

#: What tells a refusal from a command that failed on its own: sudo running nothing as root.
SUDO_CHECK = "sudo -n -- true"

#: OpenSSH's sftp-server started by root for a login that is not root: the one sshd_config names, else where
#: Debian, RHEL, Arch and SUSE install it (``internal-sftp`` is sshd's own and cannot be started apart from it).
SFTP_SERVER_COMMAND = (
    "for p in $(awk 'tolower($1) == \"subsystem\" && $2 == \"sftp\" && $3 ~ /^\\// {print $3}' "
    "/etc/ssh/sshd_config 2>/dev/null) /usr/lib/openssh/sftp-server /usr/libexec/openssh/sftp-server "
    "/usr/lib/ssh/sftp-server /usr/libexec/sftp-server; do [ -x \"$p\" ] && exec \"$p\"; done; "
    "echo 'no sftp-server found' >&2; exit 127"
)


def as_root(cmd: str) -> str:
    """``cmd`` run by root's ``sh`` through passwordless sudo; its stdin, stdout, stderr and exit status pass
    through (sudo's own refusal exits 1 with a ``sudo:`` line on stderr)."""
    return f"sudo -n -- sh -c {shlex.quote(cmd)}"
