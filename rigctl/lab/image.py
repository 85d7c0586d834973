"""The lab's Debian base image: built once with debootstrap into the controller's cache (a zstd tarball
named after what went into it), unpacked once beside it, and shared read-only by every rig's overlay.

The cache is shared by every lab slot, so two processes may want the same image at once: each entry (the
tarball, the tree) is made under its own :func:`rigctl.files.entry_lock` and lands by one rename, so the
second process waits and takes the first one's complete entry instead of making it again or colliding."""

from __future__ import annotations

import hashlib
import logging
import os
import shlex
import subprocess
import tempfile
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rigctl.errors import LabError
from rigctl.files import entry_lock
from rigctl.lab.system import (
    COMMAND_TIMEOUT_S,
    alive,
    in_step,
    last_line,
    read_mountinfo,
    remove_tree,
    run_command,
    write_file,
)

log = logging.getLogger(__name__)

SUITE = "bookworm"
VARIANT = "minbase"
#: What a rig boots and is managed with (python3-apt: Ansible's apt module needs it and could not
#: fetch it later, rigs having no internet).
SYSTEM_PACKAGES: tuple[str, ...] = (
    *("systemd", "systemd-sysv", "dbus", "openssh-server", "sudo", "procps", "iproute2", "ca-certificates"),
    *("python3", "python3-apt"),
)
#: What a rig builds llama.cpp with; baked in for the same reason.
BUILD_PACKAGES: tuple[str, ...] = ("build-essential", "cmake", "git", "ccache", "python3-venv", "curl")
BASE_PACKAGES = SYSTEM_PACKAGES + BUILD_PACKAGES
#: Bump whenever the build changes what the image holds beyond its package list.
IMAGE_RECIPE_REVISION = 2
APT_SOURCES_DIR = Path("/etc/apt/sources.list.d")
APT_SOURCES_LIST = Path("/etc/apt/sources.list")
#: Written into each rig image: rigs resolve names only from /etc/hosts.
RIG_RESOLV_CONF = "# rigctl lab rig: no DNS; names come from /etc/hosts\n"
DEBOOTSTRAP_TIMEOUT_S = 1800
PACK_TIMEOUT_S = 600
UNPACK_TIMEOUT_S = 300


@dataclass(frozen=True)
class BaseImage:
    """The cached base root file system (a zstd tarball)."""

    path: Path
    size_bytes: int
    #: True when this call built it, False when it came from the cache.
    built: bool
    build_seconds: float = 0.0

    @property
    def tree(self) -> Path:
        """The unpacked image beside the tarball, shared read-only by every rig."""
        return self.path.with_name(self.path.name.removesuffix(".tar.zst") + ".rootfs")


def apt_mirror(deb822_sources: Sequence[str], one_line_sources: str | None, suite: str = SUITE) -> str:
    """The Debian mirror from apt's configuration: the first deb822 ``URIs:`` (else the first ``deb``
    line of sources.list), preferring an entry that carries ``suite`` itself."""
    candidates: list[tuple[str, list[str]]] = []
    for text in deb822_sources:
        for stanza in _deb822_stanzas(text):
            if stanza.get("enabled", "yes").lower() == "no" or "deb" not in stanza.get("types", "").split():
                continue
            uris = stanza.get("uris", "").split()
            if uris:
                candidates.append((uris[0], stanza.get("suites", "").split()))
    for line in (one_line_sources or "").splitlines():
        words = line.split("#", 1)[0].split()
        if not words or words[0] != "deb":
            continue
        words = words[1:]
        if words and words[0].startswith("["):
            while words and not words[0].endswith("]"):
                words = words[1:]
            words = words[1:]
        if words:
            candidates.append((words[0], words[1:2]))
    if not candidates:
        raise LabError(f"no Debian mirror found in {APT_SOURCES_DIR}/*.sources or {APT_SOURCES_LIST}")
    for uri, suites in candidates:
        if suite in suites:
            return uri
    return candidates[0][0]


def _deb822_stanzas(text: str) -> Iterator[dict[str, str]]:
    stanza: dict[str, str] = {}
    for line in text.splitlines() + [""]:
        if line.startswith("#"):
            continue
        if not line.strip():
            if stanza:
                yield stanza
            stanza = {}
        elif ":" in line and not line[0].isspace():
            key, value = line.split(":", 1)
            stanza[key.strip().lower()] = value.strip()


def image_file_name(suite: str, variant: str, packages: Sequence[str], revision: int) -> str:
    """The cached tarball's name, carrying the hash of what went into it."""
    recipe = "\n".join([suite, variant, str(revision), *sorted(packages)])
    digest = hashlib.sha256(recipe.encode()).hexdigest()[:16]
    return f"{suite}-{variant}-{digest}.tar.zst"


def ensure_base_image(target: Path) -> BaseImage:
    """The tarball at ``target`` from the cache, or built there first (by this process, or by another one
    this waits for)."""
    if not target.is_file():
        with entry_lock(target, DEBOOTSTRAP_TIMEOUT_S + PACK_TIMEOUT_S, LabError):
            if not target.is_file():
                return build_base_image(target)
    size = target.stat().st_size
    log.info("base image: %s (cached, %.0f MB)", target, size / 1e6)
    return BaseImage(target, size, built=False)


def build_base_image(target: Path) -> BaseImage:
    started = time.monotonic()
    mirror = apt_mirror(
        [p.read_text() for p in sorted(APT_SOURCES_DIR.glob("*.sources"))],
        APT_SOURCES_LIST.read_text() if APT_SOURCES_LIST.is_file() else None,
    )
    target.parent.mkdir(parents=True, exist_ok=True)
    _remove_abandoned_work(target.parent)
    workdir = Path(tempfile.mkdtemp(prefix=f".build-{os.getpid()}-", dir=target.parent))
    try:
        rootfs = workdir / "rootfs"
        log.info("base image: debootstrap %s (%s) from %s; takes minutes", SUITE, VARIANT, mirror)
        _debootstrap(rootfs, mirror, workdir / "debootstrap.log")
        log.info("base image: debootstrap done in %.0fs; trimming", time.monotonic() - started)
        _trim_image_rootfs(rootfs)
        partial = workdir / target.name
        log.info("base image: packing %s", target.name)
        _pack(rootfs, partial)
        os.replace(partial, target)
    finally:
        remove_tree(workdir)
    seconds = time.monotonic() - started
    size = target.stat().st_size
    log.info("base image: built %s in %.0fs (%.0f MB)", target, seconds, size / 1e6)
    return BaseImage(target, size, built=True, build_seconds=seconds)


def ensure_base_tree(image: BaseImage) -> Path:
    """The image's unpacked tree beside its tarball: present only once complete (it lands by one rename),
    made by this process or by another one this waits for."""
    tree = image.tree
    if tree.is_dir():
        return tree
    with in_step("base image", "unpack"), entry_lock(tree, UNPACK_TIMEOUT_S * 2, LabError):
        if not tree.is_dir():
            _unpack_into(image.path, tree)
        _remove_unused_base_trees(keep=tree)
    return tree


def _unpack_into(tarball: Path, tree: Path) -> None:
    _remove_abandoned_work(tarball.parent)
    workdir = Path(tempfile.mkdtemp(prefix=f".unpack-{os.getpid()}-", dir=tarball.parent))
    try:
        staged = workdir / "rootfs"
        staged.mkdir()
        _unpack(tarball, staged)
        try:
            staged.rename(tree)
        except OSError:
            # Lost to a writer that did not take the entry's lock: its tree landed by the same one
            # rename, so being there means it is complete; take it.
            if not tree.is_dir():
                raise
            log.info("base image: %s was unpacked by another process meanwhile; using it", tree)
    finally:
        remove_tree(workdir)


def _remove_unused_base_trees(keep: Path) -> None:
    """Trees of older images that no rig's overlay still uses (their tarballs stay cached)."""
    mountinfo = read_mountinfo()
    for tree in keep.parent.glob("*.rootfs"):
        if tree != keep and f"lowerdir={tree}" not in mountinfo:
            log.info("base image: removing the unused tree %s", tree)
            remove_tree(tree)


def _remove_abandoned_work(image_dir: Path) -> None:
    """Build and unpack directories of a run that was killed (its pid is in the name and is gone)."""
    for leftover in [*image_dir.glob(".build-*"), *image_dir.glob(".unpack-*")]:
        pid = leftover.name.split("-")[1]
        if pid.isdigit() and not alive(int(pid)):
            log.info("base image: removing the abandoned %s", leftover)
            remove_tree(leftover)


def _debootstrap(rootfs: Path, mirror: str, log_path: Path) -> None:
    argv = ["debootstrap", f"--variant={VARIANT}", f"--include={','.join(BASE_PACKAGES)}", SUITE, str(rootfs), mirror]
    with open(log_path, "wb") as out:
        try:
            done = subprocess.run(
                argv, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, timeout=DEBOOTSTRAP_TIMEOUT_S
            )
        except subprocess.TimeoutExpired:
            raise LabError(f"base image: debootstrap ran past {DEBOOTSTRAP_TIMEOUT_S}s") from None
    if done.returncode != 0:
        lines = log_path.read_text(errors="replace").splitlines()
        errors = [line for line in lines if line.startswith("E:")] or lines or ["no output"]
        raise LabError(f"base image: debootstrap exited {done.returncode}: {errors[-1]}")


def _trim_image_rootfs(rootfs: Path) -> None:
    """What every rig gets anew (host keys, machine id) out, caches out, no DNS."""
    run_command(["chroot", str(rootfs), "apt-get", "clean"], timeout=COMMAND_TIMEOUT_S * 4)
    for item in (rootfs / "var/lib/apt/lists").iterdir():
        if item.is_file() and item.name != "lock":
            item.unlink()
    for key in (rootfs / "etc/ssh").glob("ssh_host_*"):
        key.unlink()
    write_file(rootfs / "etc/machine-id", "", 0o444)
    # dbus keeps a copy of its own; as a file it would give every rig the build's id.
    dbus_machine_id = rootfs / "var/lib/dbus/machine-id"
    if dbus_machine_id.parent.is_dir():
        dbus_machine_id.unlink(missing_ok=True)
        dbus_machine_id.symlink_to("/etc/machine-id")
    (rootfs / "etc/resolv.conf").unlink(missing_ok=True)
    write_file(rootfs / "etc/resolv.conf", RIG_RESOLV_CONF, 0o644)


_TAR_OPTIONS = ["--numeric-owner", "--xattrs", "--xattrs-include=*"]


def _pack(rootfs: Path, out: Path) -> None:
    with open(out, "wb") as sink:
        _pipeline(
            ["tar", "-C", str(rootfs), *_TAR_OPTIONS, "-cf", "-", "."],
            ["zstd", "-q", "-T0", "-3"],
            sink,
            PACK_TIMEOUT_S,
        )


def _unpack(tarball: Path, rootfs: Path) -> None:
    _pipeline(
        ["zstd", "-dcq", str(tarball)],
        ["tar", "-C", str(rootfs), *_TAR_OPTIONS, "-xpf", "-"],
        subprocess.DEVNULL,
        UNPACK_TIMEOUT_S,
    )


def _pipeline(first: list[str], second: list[str], sink: Any, timeout: float) -> None:
    """``first | second > sink``; LabError naming the failed side."""
    deadline = time.monotonic() + timeout
    head = subprocess.Popen(first, stdout=subprocess.PIPE, stderr=subprocess.PIPE, stdin=subprocess.DEVNULL)
    try:
        tail = subprocess.Popen(second, stdin=head.stdout, stdout=sink, stderr=subprocess.PIPE)
    except BaseException:
        head.kill()
        head.wait()
        raise
    assert head.stdout is not None
    head.stdout.close()
    try:
        _, tail_err = tail.communicate(timeout=max(deadline - time.monotonic(), 1))
        _, head_err = head.communicate(timeout=max(deadline - time.monotonic(), 1))
    except subprocess.TimeoutExpired:
        for proc in (head, tail):
            proc.kill()
            proc.wait()
        raise LabError(f"`{first[0]} | {second[0]}` ran past {timeout:.0f}s") from None
    for proc, argv, err in ((head, first, head_err), (tail, second, tail_err)):
        if proc.returncode != 0:
            raise LabError(f"`{shlex.join(argv)}` exited {proc.returncode}: {last_line(err.decode(errors='replace'))}")
