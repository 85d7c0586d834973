"""The local lab rigs: real Debian hosts on this machine for tests and ``make demo``.

Each rig named in the lab inventory (the hosts that set ``rigctl_lab``) is a systemd-nspawn container
booting systemd as PID 1, with sshd, python3 and the build tools, in its own network namespace whose
``eth0`` is a veth on a private bridge. The bridge has no NAT and each rig's default route points at a
gateway that does not exist, so a rig reaches this machine's bridge address and the other rigs, nothing
else. A stand-in ``nvidia-smi`` (``assets/nvidia-smi``) answers from a state file in each rig.

The machine may not run systemd as PID 1, so nspawn runs unregistered (``--register=no --keep-unit``)
in cgroups of its own, under a small supervisor (``assets/rig-supervisor``) that starts nspawn
again when the guest reboots.

Everything ``up`` makes is named after the rig and marked as the lab's, so ``down`` (and a failed
``up``) can remove exactly that, including what a crashed run left behind. One thing stays on
purpose: the *fence*, an ``unreachable`` route for the lab network at the lowest priority. While the
bridge is up its own route wins; once the lab is down, anything still aimed at a rig's address (a
bench, an SSH retry) fails at once with "No route to host" instead of leaving this machine by its
default route.
"""

from __future__ import annotations

import contextlib
import dataclasses
import fcntl
import json
import logging
import os
import secrets
import shlex
import signal
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Any

from rigctl.errors import ConfigError, LabError
from rigctl.files import write_atomically
from rigctl.inventory import Inventory
from rigctl.lab import network
from rigctl.lab.config import (
    LabConfig,
    RigPaths,
    RigSpec,
    check_lab_paths,
    config_from_hosts,
    known_hosts_lines,
    render_etc_hosts,
)
from rigctl.lab.gpu import (
    DMESG_IN_RIG,
    GPU_STATE_IN_RIG,
    NVIDIA_SMI_IN_RIG,
    GpuState,
    gpu_lock,
    read_gpu_state,
)
from rigctl.lab.image import (
    BASE_PACKAGES,
    IMAGE_RECIPE_REVISION,
    SUITE,
    VARIANT,
    BaseImage,
    ensure_base_image,
    ensure_base_tree,
    image_file_name,
)
from rigctl.lab.network import check_lab_network, find_host_conflicts, rig_tag
from rigctl.lab.system import (
    COMMAND_TIMEOUT_S,
    NETNS_DIR,
    POLL_S,
    REQUIRED_TOOLS,
    SUPERVISORS,
    alive,
    attempt,
    cgroup_roots,
    check_root,
    check_tools,
    console_tail,
    in_step,
    is_namespace_init,
    kill_all,
    last_line,
    live_pid,
    pids_with_argument,
    read_mountinfo,
    release_netns_dir,
    remove_empty_dirs_up_to,
    remove_tree,
    rmdir_tree,
    run_command,
    tcp_answers,
    wait_until,
    write_file,
)

log = logging.getLogger(__name__)

NSPAWN_RUNTIME_DIR = Path("/run/systemd/nspawn")
#: A stranger rig's sshd: root logs in with its password, nothing else is set up.
STRANGER_SSHD_CONF = Path("etc/ssh/sshd_config.d/rigctl-lab-stranger.conf")
STRANGER_SSHD_SETTINGS = ("# rigctl lab: a host not enrolled yet, root with a password only\n"
                          "PermitRootLogin yes\nPasswordAuthentication yes\n")
NSPAWN_START_TIMEOUT_S = 15
SSH_WAIT_TIMEOUT_S = 120
SYSTEM_RUNNING_TIMEOUT_S = 180
STATUS_SSH_TIMEOUT_S = 15
STOP_TIMEOUT_S = 30
KILL_TIMEOUT_S = 10
CGROUP_REMOVE_TIMEOUT_S = 5


# ----------------------------------------------------------------------------------------------- records


@dataclass(frozen=True)
class RigStatus:
    """One rig as found now."""

    name: str
    address: str
    exists: bool
    supervisor_pid: int | None
    nspawn_pid: int | None
    sshd: bool
    #: ``systemctl is-system-running`` over SSH; None when SSH did not answer.
    systemd: str | None

    @property
    def running(self) -> bool:
        return self.supervisor_pid is not None and self.nspawn_pid is not None

    @property
    def ready(self) -> bool:
        """Booted and reachable: what ``up`` leaves every rig as."""
        return self.running and self.sshd and self.systemd in {"running", "degraded"}


# ----------------------------------------------------------------------------------------------- the lab


def _asset_text(name: str) -> str:
    """A file of ``assets/`` (the stand-in nvidia-smi, the rig supervisor), as text."""
    return resources.files("rigctl.lab").joinpath("assets", name).read_text()


class Lab:
    """The lab rigs of one inventory: build the image, bring them up, report, tear down."""

    def __init__(self, config: LabConfig):
        self.config = config

    @classmethod
    def from_inventory(cls, inventory: Inventory) -> Lab:
        hosts = [h for h in inventory.hosts.values() if h.vars.get("rigctl_lab")]
        if not hosts:
            raise ConfigError(f"inventory {inventory.source}: no lab rigs (no host sets rigctl_lab)")
        return cls(config_from_hosts(hosts))

    # ------------------------------------------------------------------ public API

    def rig(self, name: str) -> RigSpec:
        for rig in self.config.rigs:
            if rig.name == name:
                return rig
        known = ", ".join(r.name for r in self.config.rigs)
        raise ConfigError(f"unknown lab rig {name!r} (lab rigs: {known})")

    def ssh_argv(self, name: str, command: str | Sequence[str] | None = None) -> list[str]:
        """The ``ssh`` command line for rig ``name`` (strict host keys, the lab key, no prompts)."""
        rig = self.rig(name)
        if not rig.enrolled:
            raise LabError(f"{name} is not enrolled yet: no key logs in "
                           f"(rigctl hosts add {name} {rig.address} --ask-pass)")
        argv = ["ssh", "-o", f"UserKnownHostsFile={self.config.known_hosts}", "-o", "StrictHostKeyChecking=yes"]
        argv += ["-o", "BatchMode=yes", "-i", str(self.config.key_file), "-o", "IdentitiesOnly=yes"]
        if rig.port != 22:
            argv += ["-p", str(rig.port)]
        argv.append(f"{rig.user}@{rig.address}")
        if command is not None:
            argv += ["--", command if isinstance(command, str) else shlex.join(command)]
        return argv

    def status(self) -> list[RigStatus]:
        return [self._rig_status(rig) for rig in self.config.rigs]

    def ensure_base_image(self) -> BaseImage:
        """The base image from the cache, built first when the cache has none."""
        self._preflight()
        with self._locked():
            return self._ensure_base_image()

    def up(self) -> list[RigStatus]:
        """Every rig booted and answering SSH; rigs already so are left exactly as they are."""
        started = time.monotonic()
        self._preflight()
        with self._locked():
            self._check_host_conflicts()
            network.fence(self.config)
            self._refresh_known_hosts()
            pending = [s.name for s in self.status() if not s.ready]
            pending = [name for name in pending if not self._recovers(self.rig(name))]
            if not pending:
                log.info("lab: all %d rigs already up", len(self.config.rigs))
                return self.status()
            self._bring_up([self.rig(name) for name in pending])
        log.info("lab: up in %.1fs", time.monotonic() - started)
        return self.status()

    @contextlib.contextmanager
    def up_while(self) -> Iterator[list[RigStatus]]:
        """The rigs up for the ``with`` block; left as found: taken down afterwards only when this brought
        them up (a developer's lab, or ``make demo``'s, stays up)."""
        was_up = all(rig.ready for rig in self.status())
        statuses = self.up()
        try:
            yield statuses
        finally:
            if not was_up:
                self.down()

    def down(self) -> None:
        """Stop every rig and remove all the lab made outside the cache but the fence; fine when nothing
        is up."""
        started = time.monotonic()
        check_root()
        check_tools(("ip",))
        with self._locked():
            network.fence(self.config)  # before the bridge goes: a lab brought up before the fence existed gets it too
            problems = self._remove_rigs(self.config.rigs)
            problems += attempt(lambda: network.remove_bridge(self.config), "bridge")
            problems += attempt(lambda: self.config.known_hosts.unlink(missing_ok=True), "known_hosts")
            problems += attempt(self._remove_shared_leftovers, "runtime directories")
        if problems:
            raise LabError(f"lab down left {len(problems)} problem(s); first: {problems[0]}")
        log.info("lab: down in %.1fs", time.monotonic() - started)

    def root_password(self, name: str) -> str:
        """The root password of stranger rig ``name`` (what its owner would hand you for first contact)."""
        rig = self.rig(name)
        if not rig.stranger:
            raise LabError(f"{name} is not a stranger rig (rigctl_lab.unenrolled); root logs in with the lab's key")
        try:
            return self._paths(rig).root_password.read_text().strip()
        except OSError as exc:
            raise LabError(f"{name}: no root password ({exc.strerror}); is the lab up?") from None

    def guest_run(self, name: str, argv: Sequence[str], timeout: float = COMMAND_TIMEOUT_S) -> str:
        """stdout of ``argv`` run inside rig ``name`` without SSH (for tests: what did its sshd log?)."""
        return self._guest(self.rig(name), argv, timeout).stdout

    def remove(self, name: str) -> None:
        """Stop rig ``name`` and remove what it used; the other rigs and the bridge stay."""
        check_root()
        with self._locked():
            problems = self._remove_rigs([self.rig(name)])
            problems += attempt(self._refresh_known_hosts, "known_hosts")
        if problems:
            raise LabError(f"removing {name} left {len(problems)} problem(s); first: {problems[0]}")

    def gpu_state(self, name: str) -> GpuState:
        path = self._gpu_state_path(self.rig(name))
        with gpu_lock(path):
            return read_gpu_state(path, name)

    def set_gpu(self, name: str, /, **fields: Any) -> GpuState:
        """Change what rig ``name``'s nvidia-smi reports (e.g. ``temperature_sequence=[80, 60, 40]``)."""
        path = self._gpu_state_path(self.rig(name))
        with gpu_lock(path):
            current = dataclasses.asdict(read_gpu_state(path, name))
            state = GpuState.from_mapping({**current, **fields}, f"{name}: set_gpu")
            write_atomically(path, state.to_json(), 0o644)
        log.info("%s: stand-in GPU set: %s", name, ", ".join(f"{k}={v!r}" for k, v in sorted(fields.items())))
        return state

    # ------------------------------------------------------------------ preflight and lock

    def _preflight(self) -> None:
        check_lab_network(self.config.bridge, self.config.bridge_address, self.config.rigs)
        check_lab_paths(self.config)
        check_root()
        check_tools(tuple(REQUIRED_TOOLS))

    def _check_host_conflicts(self) -> None:
        # -d: the details carry each link's alias, the lab's mark.
        links = json.loads(run_command(["ip", "-j", "-d", "addr", "show"], timeout=COMMAND_TIMEOUT_S).stdout or "[]")
        problems = find_host_conflicts(links, self.config)
        if problems:
            raise LabError(problems[0])

    @contextlib.contextmanager
    def _locked(self) -> Iterator[None]:
        self.config.dir.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.config.lock_file, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                holder = os.pread(fd, 32, 0).decode(errors="replace").strip() or "unknown"
                raise LabError(
                    f"lab {self.config.dir} is busy: another rigctl lab command (pid {holder}) holds "
                    f"{self.config.lock_file}"
                ) from None
            os.ftruncate(fd, 0)
            os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
            try:
                yield
            finally:
                os.ftruncate(fd, 0)
        finally:
            os.close(fd)

    # ------------------------------------------------------------------ base image

    @property
    def image_path(self) -> Path:
        return self.config.image_dir / image_file_name(SUITE, VARIANT, BASE_PACKAGES, IMAGE_RECIPE_REVISION)

    def _ensure_base_image(self) -> BaseImage:
        return ensure_base_image(self.image_path)

    # ------------------------------------------------------------------ up

    def _recovers(self, rig: RigSpec) -> bool:
        """A rig whose supervisor is alive may just be (re)booting: give it the chance to settle."""
        status = self._rig_status(rig)
        if status.supervisor_pid is None:
            return False
        log.info("%s: running but not ready (systemd %s); waiting for it", rig.name, status.systemd or "unknown")
        try:
            self._wait_ready(rig)
        except LabError as exc:
            log.warning("%s: %s; starting it afresh", rig.name, exc)
            return False
        return True

    def _bring_up(self, rigs: Sequence[RigSpec]) -> None:
        image = self._ensure_base_image()
        tree = ensure_base_tree(image)
        public_key = self._ensure_key_pair()
        bridge_made = False
        try:
            self._remove_rigs(rigs, strict=True)
            bridge_made = network.ensure_bridge(self.config)
            with ThreadPoolExecutor(max_workers=len(rigs)) as pool:
                for future in [pool.submit(self._make_rootfs, rig, tree, public_key) for rig in rigs]:
                    future.result()
            for rig in rigs:
                with in_step(rig.name, "network"):
                    network.add_rig(self.config, rig)
                with in_step(rig.name, "boot"):
                    self._boot(rig)
            self._refresh_known_hosts()
            for rig in rigs:
                self._wait_ready(rig, require_running=True)
        except BaseException as exc:
            log.error("lab up failed (%s); removing what it made", exc)
            self._remove_rigs(rigs)
            if bridge_made and not any(self._paths(r).dir.exists() for r in self.config.rigs):
                attempt(lambda: network.remove_bridge(self.config), "bridge")
            attempt(self._refresh_known_hosts, "known_hosts")
            attempt(self._remove_shared_leftovers, "runtime directories")
            raise

    def _ensure_key_pair(self) -> str:
        key = self.config.key_file
        if not key.is_file():
            log.info("lab: making the lab's SSH key pair %s", key)
            key.parent.mkdir(parents=True, exist_ok=True)
            run_command(
                ["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-C", "rigctl-lab", "-f", str(key)],
                timeout=COMMAND_TIMEOUT_S,
            )
        public = run_command(["ssh-keygen", "-y", "-f", str(key)], timeout=COMMAND_TIMEOUT_S).stdout
        write_atomically(key.with_name(key.name + ".pub"), public, 0o644)
        return public

    def _make_rootfs(self, rig: RigSpec, base_tree: Path, public_key: str) -> None:
        paths = self._paths(rig)
        with in_step(rig.name, "overlay the base image"):
            for directory in (paths.upper, paths.overlay_work, paths.rootfs):
                directory.mkdir(parents=True)
            options = f"lowerdir={base_tree},upperdir={paths.upper},workdir={paths.overlay_work}"
            run_command(["mount", "-t", "overlay", "overlay", "-o", options, str(paths.rootfs)],
                        timeout=COMMAND_TIMEOUT_S)
        with in_step(rig.name, "configure"):
            root = paths.rootfs
            run_command(["ssh-keygen", "-A", "-f", str(root)], timeout=COMMAND_TIMEOUT_S)
            write_file(root / "etc/hostname", f"{rig.name}\n", 0o644)
            write_file(root / "etc/hosts", render_etc_hosts(rig.name, self.config.rigs), 0o644)
            if rig.stranger:
                self._make_stranger(rig, root)
            else:
                (root / "root/.ssh").mkdir(mode=0o700, exist_ok=True)
                write_file(root / "root/.ssh/authorized_keys", public_key, 0o600)
            write_file(root / NVIDIA_SMI_IN_RIG, _asset_text("nvidia-smi"), 0o755)
            write_file(root / DMESG_IN_RIG, _asset_text("dmesg"), 0o755)
            (root / GPU_STATE_IN_RIG).parent.mkdir(parents=True, exist_ok=True)
            write_file(root / GPU_STATE_IN_RIG, rig.gpu.to_json(), 0o644)

    def _make_stranger(self, rig: RigSpec, root: Path) -> None:
        """Root logs in with a fresh password only: no key, no fleet user."""
        password = secrets.token_urlsafe(18)
        paths = self._paths(rig)
        fd = os.open(paths.root_password, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(password + "\n")
        # chpasswd reads the password on stdin: never an argument.
        done = subprocess.run(["chroot", str(root), "chpasswd"], input=f"root:{password}\n", text=True,
                              capture_output=True, timeout=COMMAND_TIMEOUT_S)
        if done.returncode != 0:
            raise LabError(f"chpasswd exited {done.returncode}: {last_line(done.stderr)}")
        write_file(root / STRANGER_SSHD_CONF, STRANGER_SSHD_SETTINGS, 0o644)

    def _boot(self, rig: RigSpec) -> None:
        paths = self._paths(rig)
        cgroups = [root / self._tag(rig) for root in cgroup_roots(read_mountinfo())]
        for cgroup in cgroups:
            cgroup.mkdir(exist_ok=True)
        write_file(paths.supervisor_script, _asset_text("rig-supervisor"), 0o755)
        netns = NETNS_DIR / self._tag(rig)
        nspawn = [
            # nspawn mounts the guest's /sys in the network namespace it runs in; started outside the
            # rig's, the guest's /sys/class/net (and so Ansible's facts) would list this machine's links.
            "nsenter",
            f"--net={netns}",
            "--",
            "systemd-nspawn",
            "--quiet",
            "--boot",
            f"--directory={paths.rootfs}",
            f"--machine={self._tag(rig)}",
            # No systemd as this machine's PID 1: nothing to register with, no unit to move into.
            "--register=no",
            "--keep-unit",
            "--link-journal=no",
            "--console=read-only",
            "--resolv-conf=off",
            f"--network-namespace-path={netns}",
        ]
        if self.config.guest_ccache_dir is not None:
            self.config.compiler_cache.mkdir(parents=True, exist_ok=True, mode=0o755)
            nspawn.append(f"--bind={self.config.compiler_cache}:{self.config.guest_ccache_dir}")
        argv = [sys.executable, str(paths.supervisor_script), "--pid-file", str(paths.nspawn_pid)]
        argv += ["--stop-file", str(paths.stop_flag)]
        for cgroup in cgroups:
            argv += ["--cgroup", str(cgroup)]
        with open(paths.console_log, "ab") as console:
            supervisor = subprocess.Popen(
                [*argv, "--", *nspawn],
                stdin=subprocess.DEVNULL,
                stdout=console,
                stderr=subprocess.STDOUT,
                start_new_session=True,
                close_fds=True,
            )
        SUPERVISORS[supervisor.pid] = supervisor
        write_file(paths.supervisor_pid, f"{supervisor.pid}\n", 0o644)
        if (
            not wait_until(lambda: paths.nspawn_pid.exists() or supervisor.poll() is not None, NSPAWN_START_TIMEOUT_S)
            or supervisor.poll() is not None
        ):
            raise LabError(f"systemd-nspawn did not start: {console_tail(paths.console_log)}")
        log.info("%s: booting (supervisor pid %d)", rig.name, supervisor.pid)

    def _wait_ready(self, rig: RigSpec, require_running: bool = False) -> None:
        paths = self._paths(rig)
        with in_step(rig.name, "wait for sshd"):
            deadline = time.monotonic() + SSH_WAIT_TIMEOUT_S
            while not (self._ssh_answers(rig) if rig.enrolled else tcp_answers(rig.address, rig.port)):
                if live_pid(paths.supervisor_pid, str(paths.supervisor_script)) is None:
                    raise LabError(f"the container stopped: {console_tail(paths.console_log)}")
                if time.monotonic() > deadline:
                    self._remote(rig, "true", STATUS_SSH_TIMEOUT_S)  # raises with ssh's own reason
                    raise LabError(f"sshd did not answer on {rig.address}:{rig.port} within {SSH_WAIT_TIMEOUT_S}s")
                time.sleep(POLL_S)
        with in_step(rig.name, "wait for systemd"):
            state = self._remote(rig, "systemctl is-system-running --wait", SYSTEM_RUNNING_TIMEOUT_S)
            if state == "running" or (state == "degraded" and not require_running):
                log.info("%s: up at %s (systemd %s)", rig.name, rig.address, state)
                return
            failed = self._remote(rig, "systemctl list-units --failed --plain --no-legend", STATUS_SSH_TIMEOUT_S)
            units = ", ".join(line.split()[0] for line in failed.splitlines() if line.strip()) or "none listed"
            raise LabError(f"systemd is {state or 'silent'} (failed units: {units})")

    def _ssh_answers(self, rig: RigSpec) -> bool:
        """sshd accepts a login (sshd may take TCP connections a moment before it can serve them)."""
        if not tcp_answers(rig.address, rig.port):
            return False
        try:
            self._remote(rig, "true", STATUS_SSH_TIMEOUT_S)
        except LabError:
            return False
        return True

    def _remote(self, rig: RigSpec, command: str, timeout: float) -> str:
        """stdout of ``command`` on the rig over strict-key SSH, whatever its exit status; LabError when
        SSH itself fails. A rig not enrolled has no key to log in with: the command runs in its
        namespaces from here instead, for the lab's own checks."""
        if not rig.enrolled:
            return self._guest(rig, ["sh", "-c", command], timeout).stdout.strip()
        argv = self.ssh_argv(rig.name, command)
        argv[1:1] = ["-o", "ConnectTimeout=5"]
        try:
            done = subprocess.run(argv, capture_output=True, text=True, timeout=timeout, stdin=subprocess.DEVNULL)
        except subprocess.TimeoutExpired:
            raise LabError(f"ssh {rig.user}@{rig.address} `{command}` ran past {timeout:.0f}s") from None
        ssh_failed = 255
        if done.returncode == ssh_failed:
            raise LabError(f"ssh {rig.user}@{rig.address}: {last_line(done.stderr)}")
        return done.stdout.strip()

    def _refresh_known_hosts(self) -> None:
        """known_hosts as the rigs that exist now are: their real host keys, by name and address."""
        lines: list[str] = []
        for rig in self.config.rigs:
            if not rig.enrolled:  # first contact is `rigctl hosts add`'s to make
                continue
            keys = sorted((self._paths(rig).rootfs / "etc/ssh").glob("ssh_host_*_key.pub"))
            lines += known_hosts_lines(rig, [k.read_text() for k in keys])
        path = self.config.known_hosts
        text = "".join(f"{line}\n" for line in lines)
        if not lines:
            path.unlink(missing_ok=True)
        elif not path.is_file() or path.read_text() != text:
            path.parent.mkdir(parents=True, exist_ok=True)
            write_atomically(path, text, 0o644)

    def _guest(self, rig: RigSpec, argv: Sequence[str], timeout: float) -> subprocess.CompletedProcess[str]:
        """``argv`` inside the rig (its init's namespaces, by nsenter), whatever its exit status."""
        init = next((pid for pid in sorted(self._rig_pids(rig)) if is_namespace_init(pid)), None)
        if init is None:
            raise LabError(f"{rig.name}: the container is not running")
        command = ["nsenter", f"--target={init}", "--mount", "--uts", "--ipc", "--net", "--pid", "--", *argv]
        try:
            return subprocess.run(command, capture_output=True, text=True, timeout=timeout, stdin=subprocess.DEVNULL)
        except subprocess.TimeoutExpired:
            raise LabError(f"{rig.name}: `{shlex.join(argv)}` ran past {timeout:.0f}s") from None

    # ------------------------------------------------------------------ status

    def _paths(self, rig: RigSpec) -> RigPaths:
        return RigPaths(self.config.hosts_dir / rig.name)

    def _tag(self, rig: RigSpec) -> str:
        return rig_tag(self.config.bridge, rig.name)

    def _rig_status(self, rig: RigSpec) -> RigStatus:
        paths = self._paths(rig)
        supervisor = live_pid(paths.supervisor_pid, str(paths.supervisor_script))
        nspawn = live_pid(paths.nspawn_pid, f"--directory={paths.rootfs}")
        sshd = nspawn is not None and tcp_answers(rig.address, rig.port)
        systemd = None
        if sshd:
            with contextlib.suppress(LabError):
                systemd = self._remote(rig, "systemctl is-system-running", STATUS_SSH_TIMEOUT_S) or None
        return RigStatus(rig.name, rig.address, paths.rootfs.is_dir(), supervisor, nspawn, sshd, systemd)

    # ------------------------------------------------------------------ down

    def _remove_rigs(self, rigs: Sequence[RigSpec], strict: bool = False) -> list[str]:
        """Stop and remove ``rigs``; the problems met (raised at once when ``strict``)."""
        halting = {rig.name: self._signal_stop(rig) for rig in rigs}
        problems: list[str] = []
        for rig in rigs:
            for step, action in (
                ("stop", lambda r: self._stop(r, halting[r.name])),
                ("cgroups", self._remove_cgroups),
                ("network", lambda r: network.remove_rig(self.config, r)),
                ("nspawn runtime", self._remove_nspawn_runtime),
                ("files", lambda r: remove_tree(self._paths(r).dir)),
            ):
                step_started = time.monotonic()
                problems += attempt(lambda action=action, rig=rig: action(rig), f"{rig.name}: {step}")
                log.debug("%s: %s took %.1fs", rig.name, step, time.monotonic() - step_started)
        if problems and strict:
            raise LabError(problems[0])
        return problems

    def _signal_stop(self, rig: RigSpec) -> bool:
        """Ask the guest to halt (nspawn turns SIGTERM into a clean shutdown); False when there is no
        nspawn or supervisor left to ask (nothing runs, or a crash orphaned the guest)."""
        paths = self._paths(rig)
        if paths.dir.is_dir():
            paths.stop_flag.touch()
        supervisor = live_pid(paths.supervisor_pid, str(paths.supervisor_script))
        nspawn = live_pid(paths.nspawn_pid, f"--directory={paths.rootfs}")
        target = nspawn or supervisor
        if target is not None:
            log.info("%s: stopping", rig.name)
            with contextlib.suppress(ProcessLookupError):
                os.kill(target, signal.SIGTERM)
        return target is not None

    def _stop(self, rig: RigSpec, halting: bool) -> None:
        """Wait for the halt asked for; kill whatever is left (all of it when nothing could be asked,
        or when nspawn died without taking its guest along)."""
        if halting and not wait_until(
            lambda: not self._rig_pids(rig) or not self._nspawn_or_supervisor_alive(rig), STOP_TIMEOUT_S
        ):
            log.warning("%s: did not halt within %ds; killing it", rig.name, STOP_TIMEOUT_S)
        leftover = self._rig_pids(rig)
        if not leftover:
            return
        log.info("%s: killing %d leftover process(es)", rig.name, len(leftover))
        if not wait_until(lambda: kill_all(self._rig_pids(rig)), KILL_TIMEOUT_S):
            raise LabError(f"processes {sorted(self._rig_pids(rig))} survived SIGKILL")

    def _nspawn_or_supervisor_alive(self, rig: RigSpec) -> bool:
        paths = self._paths(rig)
        return (
            live_pid(paths.nspawn_pid, f"--directory={paths.rootfs}") is not None
            or live_pid(paths.supervisor_pid, str(paths.supervisor_script)) is not None
        )

    def _rig_pids(self, rig: RigSpec) -> set[int]:
        """Live processes of the rig: those in its cgroups, and its supervisor and nspawn even
        outside them (a crash between starting and joining)."""
        paths = self._paths(rig)
        pids = set()
        for root in cgroup_roots(read_mountinfo()):
            top = root / self._tag(rig)
            for directory, _dirs, _files in os.walk(top):
                with contextlib.suppress(OSError):
                    pids.update(int(p) for p in Path(directory, "cgroup.procs").read_text().split())
        pids.update(pids_with_argument({str(paths.supervisor_script), f"--directory={paths.rootfs}"}))
        return {pid for pid in pids if alive(pid)}

    def _remove_cgroups(self, rig: RigSpec) -> None:
        for root in cgroup_roots(read_mountinfo()):
            top = root / self._tag(rig)
            if not top.is_dir():
                continue
            if not wait_until(lambda top=top: rmdir_tree(top), CGROUP_REMOVE_TIMEOUT_S):
                raise LabError(f"cannot remove cgroup {top}")

    def _remove_nspawn_runtime(self, rig: RigSpec) -> None:
        if NSPAWN_RUNTIME_DIR.is_dir():
            for leftover in NSPAWN_RUNTIME_DIR.glob(f"*/{self._tag(rig)}"):
                remove_tree(leftover)

    def _remove_shared_leftovers(self) -> None:
        """What rigs share once no rig needs it: the hosts directory, nspawn's and ip's runtime dirs."""
        with contextlib.suppress(OSError):
            self.config.hosts_dir.rmdir()
        remove_empty_dirs_up_to(NSPAWN_RUNTIME_DIR, stop_at=NSPAWN_RUNTIME_DIR.parent)
        release_netns_dir()

    def _gpu_state_path(self, rig: RigSpec) -> Path:
        rootfs = self._paths(rig).rootfs
        path = rootfs / GPU_STATE_IN_RIG
        if not path.is_file():
            raise LabError(f"{rig.name}: no stand-in GPU state at {path}; is the lab up? (rigctl lab up)")
        # The guest's root owns this tree: never follow a link it made out of it.
        for parent in [path, *path.parents]:
            if parent == rootfs:
                break
            if parent.is_symlink():
                raise LabError(f"{rig.name}: {parent} is a symlink; refusing to use it")
        return path
