"""The sandbox of everything that runs llama.cpp code on a host: the ``llama-server@`` units, rigctl's jobs,
the bench's probe servers and the models role's units (converter, llama-quantize, llama-imatrix:
:func:`model_unit_properties`, and :func:`take_output` for what they leave). Standard library only, and no
sibling imports: the llama_server role's filter plugin loads this file by its path to render the unit's
hardening from :func:`properties`, the models role's ``models_artifact`` imports it as
``ansible.module_utils.sandbox``, and :mod:`rigctl.hostside.jobhost` (on the host) and
:func:`rigctl.fleet.servers.probe_server` (on the controller) pass the same lines to ``systemd-run -p``,
so a job or a probe is exactly as confined as the server unit.

A model file that exploits llama.cpp gets what these properties leave: the service account, no capabilities,
no new privileges, the file system read-only except ``read_write`` (a server's state directory, a job's run
directory, nothing for a probe), the GPU's device nodes and the pseudo devices only. Never
``PrivateDevices=yes``: it would hide the GPU (``DevicePolicy=closed`` with ``DeviceAllow=`` does what it
would, and leaves the GPU's driver classes). ``MemoryDenyWriteExecute`` stays off: CUDA JIT-compiles kernels
into W+X memory.
"""

from __future__ import annotations

import contextlib
import errno
import os
import shutil
import stat
from collections.abc import Sequence

#: systemd's DeviceAllow= entries of the llama_server role's default (``llama_server_device_allow``).
DEVICE_ALLOW = ("char-nvidia-frontend rw", "char-nvidia-uvm rw", "char-nvidia-caps rw")
#: The llama_server role's default ``llama_server_supplementary_groups`` (the GPU's device nodes' group).
SUPPLEMENTARY_GROUPS = ("video",)

#: The hardening before ``ReadWritePaths=`` and after it, in the unit's order.
_BEFORE_PATHS = ("NoNewPrivileges=yes", "ProtectSystem=strict")
_AFTER_PATHS = (
    "ProtectHome=yes", "PrivateTmp=yes", "ProtectKernelTunables=yes", "ProtectKernelModules=yes",
    "ProtectKernelLogs=yes", "ProtectControlGroups=yes", "ProtectClock=yes", "ProtectHostname=yes",
    "ProtectProc=invisible", "RestrictNamespaces=yes", "RestrictRealtime=yes", "RestrictSUIDSGID=yes",
    "RemoveIPC=yes", "LockPersonality=yes", "CapabilityBoundingSet=", "AmbientCapabilities=",
    "RestrictAddressFamilies=AF_UNIX AF_INET AF_INET6 AF_NETLINK", "SystemCallArchitectures=native",
    "SystemCallFilter=@system-service", "SystemCallFilter=~@privileged @resources",
)


def properties(read_write: Sequence[str], device_allow: Sequence[str] = DEVICE_ALLOW) -> list[str]:
    """The unit's hardening as ``Key=value`` lines: the devices, then the rest with ``ReadWritePaths=`` (the
    only writable paths besides a private /tmp; none when ``read_write`` is empty)."""
    for path in read_write:
        if not path.startswith("/") or any(c.isspace() for c in path):
            raise ValueError(f"read-write path {path!r}: must be absolute, without spaces")
    lines = ["DevicePolicy=closed", *(f"DeviceAllow={device}" for device in device_allow), *_BEFORE_PATHS]
    if read_write:
        lines.append("ReadWritePaths=" + " ".join(read_write))
    return lines + list(_AFTER_PATHS)


def model_unit_properties() -> list[str]:
    """The hardening of the units that make model files (the converter, llama-quantize, llama-imatrix): the
    server unit's, under a dynamic user, with no network and no sockets (they read and write files only, so
    not even AF_UNIX: no talking to the host's daemons), writing nothing but the unit's own
    state directory (systemd makes ``StateDirectory=`` writable). A system call outside the filter fails
    with EPERM rather than killing the process, so that a converter's optional call is an error it may
    handle, never a way out."""
    server = [line for line in properties(()) if not line.startswith("RestrictAddressFamilies=")]
    return ["DynamicUser=yes", "PrivateNetwork=yes", "UMask=0022", *server, f"RestrictAddressFamilies=~{_NO_SOCKETS}",
            "SystemCallErrorNumber=EPERM"]


#: The socket families a model unit is denied: every one a file-making command could reach anything with.
#: A deny list because systemd-run (252) refuses ``RestrictAddressFamilies=none`` for a transient unit
#: ("Invalid argument"), and an empty allow list means "allow all" in a unit file but "deny all" through
#: systemd-run: no spelling of "none" means the same everywhere.
_NO_SOCKETS = ("AF_UNIX AF_INET AF_INET6 AF_NETLINK AF_PACKET AF_VSOCK AF_ALG AF_BLUETOOTH AF_CAN AF_XDP "
               "AF_TIPC AF_RDS AF_KEY AF_X25 AF_AX25 AF_APPLETALK AF_IPX AF_LLC AF_IB AF_MPLS AF_QIPCRTR")


class UnsafeOutput(OSError):
    """What a sandboxed command left as its output is not a plain file of its own (a link, a device, a
    hard link to another file): refused, nothing done to it."""


def take_output(state_dir: str, name: str, dest: str, *, uid: int = 0, gid: int = 0, mode: int = 0o644) -> bool:
    """Move the file ``name`` that a sandboxed command left in ``state_dir`` (its unit's state directory as
    root sees it: ``/var/lib/private/<state>`` for a dynamic user, never the link to it) to ``dest``, owned
    by ``uid``:``gid`` with ``mode``. False when there is no such file.

    The sandbox owns ``state_dir`` and may have left anything there: the file is opened without following a
    link and must be a regular file with one link, or :class:`UnsafeOutput`; it is renamed to ``dest`` and
    checked to be the inode opened (across file systems: copied into a file made here with ``O_EXCL``);
    owner and mode change through the descriptor, so nothing the sandbox names is ever chowned."""
    dir_fd = os.open(state_dir, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    try:
        try:
            src = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, dir_fd=dir_fd)
        except FileNotFoundError:
            return False
        except OSError as exc:
            if exc.errno == errno.ELOOP:
                raise UnsafeOutput(exc.errno, f"{state_dir}/{name} is a symbolic link, not the command's output; "
                                              "refused") from None
            raise
        try:
            found = os.fstat(src)
            if not stat.S_ISREG(found.st_mode) or found.st_nlink != 1:
                kind = "a hard link to another file" if stat.S_ISREG(found.st_mode) else "not a regular file"
                raise UnsafeOutput(errno.EPERM, f"{state_dir}/{name} is {kind}; refused")
            out = _move(dir_fd, name, src, found, dest)
            try:
                os.fchown(out, uid, gid)
                os.fchmod(out, mode)
            finally:
                if out != src:
                    os.close(out)
        finally:
            os.close(src)
    finally:
        os.close(dir_fd)
    return True


def _move(dir_fd: int, name: str, src: int, found: os.stat_result, dest: str) -> int:
    """``name`` (open as ``src``) at ``dest``: renamed when it can be, else copied; the descriptor of what is
    at ``dest`` now."""
    try:
        os.rename(name, dest, src_dir_fd=dir_fd)
    except OSError as exc:
        if exc.errno != errno.EXDEV:
            raise
    else:
        moved = os.lstat(dest)
        if (moved.st_dev, moved.st_ino) != (found.st_dev, found.st_ino):
            os.unlink(dest)
            raise UnsafeOutput(errno.EPERM, f"{dest}: not the file the command left; refused")
        return src
    with contextlib.suppress(FileNotFoundError):
        os.unlink(dest)
    out = os.open(dest, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    try:
        with os.fdopen(os.dup(src), "rb") as reader, os.fdopen(os.dup(out), "wb") as writer:
            shutil.copyfileobj(reader, writer, 1 << 20)
    except BaseException:
        os.close(out)
        os.unlink(dest)
        raise
    return out


def run_options(lines: Sequence[str]) -> list[str]:
    """``lines`` as ``systemd-run`` options (``-p KEY=VALUE`` each)."""
    return [arg for line in lines for arg in ("-p", line)]
