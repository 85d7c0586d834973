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

Its configuration is rigctl's alone. llama.cpp reads ``/etc/llama.cpp/config.ini`` and then
``${XDG_CONFIG_HOME:-$HOME/.config}/llama.cpp/config.ini`` before the environment and the command line
(b11434's ``common/arg.cpp``, ``common_params_apply_system_config``), and its options from ``LLAMA_ARG_*``
variables: the sandbox hides ``/etc/llama.cpp`` (:data:`HIDDEN_CONFIG`), points ``HOME`` and
``XDG_CONFIG_HOME`` at :data:`CONFIG_HOME` (root's, empty, read-only), and every launcher drops the variables
llama.cpp reads (:func:`clean_environment`, :func:`clean_exec`, :data:`CLEAN_ENV_SH`).
"""

from __future__ import annotations

import contextlib
import errno
import os
import re
import shutil
import stat
from collections.abc import Mapping, Sequence

#: systemd's DeviceAllow= entries of the llama_server role's default (``llama_server_device_allow``).
DEVICE_ALLOW = ("char-nvidia-frontend rw", "char-nvidia-uvm rw", "char-nvidia-caps rw")
#: The llama_server role's default ``llama_server_supplementary_groups`` (the GPU's device nodes' group).
SUPPLEMENTARY_GROUPS = ("video",)

#: The system-wide config directory llama.cpp reads whatever the environment says (``/etc/llama.cpp/config.ini``
#: is a fixed path in common/arg.cpp): hidden from every sandboxed process (``-``: nothing to hide when absent).
HIDDEN_CONFIG = "/etc/llama.cpp"
#: ``HOME`` and ``XDG_CONFIG_HOME`` of every sandboxed process: an empty directory of root's (the llama_cpp
#: role makes it, 0555), so the user-level config file llama.cpp looks for is never there and cannot be written.
CONFIG_HOME = "/usr/local/share/rigctl/empty-config-home"
#: The environment variables llama.cpp's argument parser reads besides its own ``LLAMA_`` prefix
#: (common/arg.cpp's ``set_env``: ``LLAMA_ARG_*``, ``LLAMA_API_KEY``; and these two).
FOREIGN_NAMES = ("HF_TOKEN", "MTMD_BACKEND_DEVICE")
FOREIGN_PREFIX = "LLAMA_"
#: POSIX sh that unsets every variable :func:`foreign_variable` names (``env`` lists them; names are letters,
#: digits and ``_`` only, so a value can add nothing but a harmless ``unset`` of an absent name). Its loop
#: variable is its own: the server's launcher keeps the instance's name in ``name``.
CLEAN_ENV_SH = (f"for _rigctl_var in $(env | grep -o '^{FOREIGN_PREFIX}[A-Za-z0-9_]*='); do "
                f"unset \"${{_rigctl_var%=}}\"; done; unset _rigctl_var {' '.join(FOREIGN_NAMES)}")

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
    return lines + list(_AFTER_PATHS) + list(CONFIG_LINES)


#: No config file but rigctl's flags: ``/etc/llama.cpp`` hidden, the user-level one looked for in root's empty
#: directory.
CONFIG_LINES = (f"InaccessiblePaths=-{HIDDEN_CONFIG}", f"Environment=HOME={CONFIG_HOME}",
                f"Environment=XDG_CONFIG_HOME={CONFIG_HOME}")


#: The config files llama.cpp reads on a Linux host, in its order, for a process in the sandbox: the
#: system-wide one (hidden by the sandbox, but read by any llama.cpp started outside rigctl: drift) and the
#: user-level one under :data:`CONFIG_HOME` (never there unless someone put it into root's directory).
SYSTEM_CONFIG_FILE = f"{HIDDEN_CONFIG}/config.ini"
CONFIG_FILES = (SYSTEM_CONFIG_FILE, f"{CONFIG_HOME}/llama.cpp/config.ini")
#: What llama.cpp logs for each config file it applies (common/arg.cpp, ``LOG_INF``).
_USING_CONFIG = re.compile(r"using config file: (.+?)\s*$")


def config_files_command() -> list[str]:
    """The command of the host fact "which llama.cpp config files are there": ``ls -1d`` of
    :data:`CONFIG_FILES`, which lists those present (a link too, dangling or not) and exits 2 when some
    are absent; :func:`parse_config_files` reads its output."""
    return ["ls", "-1d", "--", *CONFIG_FILES]


def parse_config_files(stdout: str) -> list[str]:
    """The config files :func:`config_files_command` listed, in llama.cpp's order; any other line is not
    a path it was asked about and is ignored."""
    listed = {line.strip() for line in stdout.splitlines()}
    return [path for path in CONFIG_FILES if path in listed]


def parse_used_config_files(log: str) -> list[str]:
    """The config files a llama.cpp process says it applied (its "using config file: PATH" lines), in its
    order, each once."""
    used: list[str] = []
    for line in log.splitlines():
        found = _USING_CONFIG.search(line)
        if found and found.group(1) not in used:
            used.append(found.group(1))
    return used


def foreign_variable(name: str) -> bool:
    """Whether llama.cpp would read ``name`` as an option (or one of its own switches): never let in."""
    return name.startswith(FOREIGN_PREFIX) or name in FOREIGN_NAMES


def clean_environment(environ: Mapping[str, str]) -> dict[str, str]:
    """``environ`` without the variables llama.cpp reads, for a launcher written in Python."""
    return {name: value for name, value in environ.items() if not foreign_variable(name)}


def clean_exec(argv: Sequence[str]) -> list[str]:
    """``argv`` run through ``/bin/sh``, which drops the variables llama.cpp reads and execs it (same pid)."""
    return ["/bin/sh", "-c", f'{CLEAN_ENV_SH}; exec "$@"', "rigctl-clean-exec", *argv]


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
