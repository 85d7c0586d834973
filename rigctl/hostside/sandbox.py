"""The sandbox of everything that runs llama.cpp code on a host: the ``llama-server@`` units, rigctl's jobs
and the bench's probe servers. Standard library only, and no sibling imports: the llama_server role's filter
plugin loads this file by its path to render the unit's hardening from :func:`properties`, and
:mod:`rigctl.hostside.jobhost` (on the host) and :func:`rigctl.fleet.servers.probe_server` (on the controller)
pass the same lines to ``systemd-run -p``, so a job or a probe is exactly as confined as the server unit.

A model file that exploits llama.cpp gets what these properties leave: the service account, no capabilities,
no new privileges, the file system read-only except ``read_write`` (a server's state directory, a job's run
directory, nothing for a probe), the GPU's device nodes and the pseudo devices only. Never
``PrivateDevices=yes``: it would hide the GPU (``DevicePolicy=closed`` with ``DeviceAllow=`` does what it
would, and leaves the GPU's driver classes). ``MemoryDenyWriteExecute`` stays off: CUDA JIT-compiles kernels
into W+X memory.
"""

from __future__ import annotations

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


def run_options(lines: Sequence[str]) -> list[str]:
    """``lines`` as ``systemd-run`` options (``-p KEY=VALUE`` each)."""
    return [arg for line in lines for arg in ("-p", line)]
