#!/usr/bin/python3
# Part of rigctl's gpu_host role.
"""Lay NVIDIA's CUDA wheels out as a toolkit tree that CMake and nvcc take for an installed toolkit."""

from __future__ import annotations

DOCUMENTATION = r"""
module: gpu_host_cuda_wheels
short_description: Check pinned CUDA wheels and lay them out as a CUDA toolkit directory
description:
  - Checks every wheel's sha256 against its pin and its metadata against the pinned name and version
    before anything is unpacked. Then unpacks each wheel's C(nvidia/<component>/) tree into I(root) in
    the layout of NVIDIA's own installers, which C(nvcc.profile) and CMake's FindCUDAToolkit expect
    (C(bin/), C(nvvm/), C(targets/<arch>-linux/include) and C(targets/<arch>-linux/lib), with
    C(include), C(lib) and C(lib64) links to the latter), and adds the unversioned C(libX.so) links a
    linker needs (wheels ship C(libcudart.so.13), not C(libcudart.so)).
  - The tree is built in C(<root>.partial) and renamed into place; I(link) (the toolkit home, e.g.
    C(/usr/local/cuda)) then points at it, replaced by a rename. C(<root>/.rigctl-toolkit.json) records the
    pins; a root whose record matches is left alone.
  - Nothing in the wheels runs here. A member with an absolute path, a C(..) component or a link, or two
    wheels that disagree about one file, fail the task and leave nothing behind.
options:
  wheels:
    description: The pinned wheels, each C(name), C(version) and C(sha256).
    type: list
    elements: dict
    required: true
  wheel_dir:
    description: Where the wheel files are on this host (under their index file names). Not read when the
      toolkit of these pins is in place already.
    type: path
  root:
    description: The toolkit directory to make.
    type: path
    required: true
  link:
    description: The toolkit home to point at I(root) (a symlink; an existing directory is refused).
    type: path
    required: true
"""

import hashlib
import json
import os
import platform
import re
import shutil
import stat
import zipfile

from ansible.module_utils.basic import AnsibleModule

MANIFEST = ".rigctl-toolkit.json"
#: NVIDIA's name for a machine's target directory (nvcc.profile's $(_TARGET_DIR_) is targets/<this>).
TARGET_DIRS = {"x86_64": "x86_64-linux", "aarch64": "sbsa-linux"}
#: What a toolkit must hold for llama.cpp's CUDA build: the compiler and its front ends, the runtime and
#: cuBLAS to link, CCCL's headers.
REQUIRED = ("bin/nvcc", "bin/cudafe++", "bin/fatbinary", "bin/ptxas", "nvvm/bin/cicc", "include/cuda_runtime.h",
            "include/crt/host_config.h", "include/cublas_v2.h", "lib/libcudart.so", "lib/libcublas.so",
            "lib/libcublasLt.so")
_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*$")
_SHA256 = re.compile(r"^[0-9a-f]{64}$")
_SONAME = re.compile(r"^(lib[A-Za-z0-9_+-]+)\.so\.[0-9]+(\.[0-9]+)*$")


class LayoutError(Exception):
    """One line: which wheel or file, and what is wrong with it."""


def canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def file_sha256(path: str) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        while chunk := handle.read(1 << 20):
            digest.update(chunk)
    return digest.hexdigest()


def pins(wheels: list[dict]) -> list[dict]:
    """The pins as the manifest records them, sorted by name; LayoutError on a malformed one."""
    out = []
    for wheel in wheels:
        name, version, sha256 = (str(wheel.get(k, "")) for k in ("name", "version", "sha256"))
        if not _NAME.match(name) or not _NAME.match(version) or not _SHA256.match(sha256.lower()):
            raise LayoutError(f"wheel {wheel.get('name')!r}: needs name, version and a sha256 of 64 hex digits")
        out.append({"name": canonical(name), "version": version, "sha256": sha256.lower()})
    return sorted(out, key=lambda p: p["name"])


def find_wheel(wheel_dir: str, pin: dict) -> str:
    """The file in ``wheel_dir`` named as a wheel of the pin's name and version whose sha256 is the pin."""
    stem = f"{pin['name'].replace('-', '_')}-{pin['version']}-"
    candidates = sorted(n for n in os.listdir(wheel_dir) if n.startswith(stem) and n.endswith(".whl"))
    found = {}
    for name in candidates:
        found[name] = file_sha256(os.path.join(wheel_dir, name))
        if found[name] == pin["sha256"]:
            return check_wheel(os.path.join(wheel_dir, name), pin)
    seen = ", ".join(f"{name} has sha256 {digest}" for name, digest in found.items()) or "none is there"
    raise LayoutError(f"no wheel of {pin['name']} {pin['version']} with the pinned sha256 {pin['sha256']} "
                      f"in {wheel_dir} ({seen})")


def check_wheel(path: str, pin: dict) -> str:
    """``path``, once its sha256 is the pin and its metadata declares the pinned name and version."""
    actual = file_sha256(path)
    if actual != pin["sha256"]:
        raise LayoutError(f"wheel {path} has sha256 {actual} but {pin['name']} {pin['version']} is pinned to "
                          f"{pin['sha256']}")
    with zipfile.ZipFile(path) as archive:
        metadata = [n for n in archive.namelist() if re.fullmatch(r"[^/]+\.dist-info/METADATA", n)]
        if len(metadata) != 1:
            raise LayoutError(f"wheel {path}: no single .dist-info/METADATA")
        text = archive.read(metadata[0]).decode("utf-8", "replace")
    fields = dict(re.findall(r"^(Name|Version):\s*(\S+)\s*$", text, re.MULTILINE))
    if canonical(fields.get("Name", "")) != pin["name"] or fields.get("Version") != pin["version"]:
        raise LayoutError(f"wheel {path} is {fields.get('Name')} {fields.get('Version')}, "
                          f"not the pinned {pin['name']} {pin['version']}")
    return path


def destination(member: str, target: str) -> str | None:
    """Where a wheel member goes in the toolkit (relative), None for what a toolkit does not need.

    ``nvidia/<component>/include/x.h`` -> ``targets/<target>/include/x.h``, ``.../lib/...`` likewise,
    ``.../bin/nvcc`` -> ``bin/nvcc``; the wheel's metadata and Python package files are left out."""
    parts = member.split("/")
    if member.startswith("/") or ".." in parts or "\\" in member:
        raise LayoutError(f"member {member!r} leaves the toolkit directory")
    if len(parts) < 4 or parts[0] != "nvidia" or parts[-1] == "" or parts[2].startswith("."):
        return None
    if parts[-1] == "__init__.py" or "__pycache__" in parts:
        return None
    rest = parts[2:]
    if rest[0] in ("include", "lib"):
        return "/".join(["targets", target, *rest])
    return "/".join(rest)


def unpack(path: str, tree: str, target: str) -> int:
    """Every member of the wheel at ``path`` into ``tree``; a file another wheel put there must be identical."""
    count = 0
    with zipfile.ZipFile(path) as archive:
        for info in archive.infolist():
            if info.is_dir():
                continue
            mode = info.external_attr >> 16
            if stat.S_ISLNK(mode):
                raise LayoutError(f"wheel {path}: member {info.filename} is a link")
            relative = destination(info.filename, target)
            if relative is None:
                continue
            dest = os.path.join(tree, relative)
            data = archive.read(info)
            if os.path.lexists(dest):
                with open(dest, "rb") as existing:
                    if existing.read() != data:
                        raise LayoutError(f"wheel {path}: {relative} differs from the one another wheel gave")
                continue
            os.makedirs(os.path.dirname(dest), mode=0o755, exist_ok=True)
            with open(dest, "wb") as out:
                out.write(data)
            os.chmod(dest, 0o755 if mode & 0o111 else 0o644)
            count += 1
    return count


def link_libraries(libdir: str) -> list[str]:
    """``libX.so`` -> ``libX.so.N[.M]`` for every versioned library without one (the newest when several)."""
    made = []
    versioned: dict[str, list[str]] = {}
    for name in os.listdir(libdir):
        match = _SONAME.match(name)
        if match:
            versioned.setdefault(match.group(1), []).append(name)
    for base, names in sorted(versioned.items()):
        plain = os.path.join(libdir, f"{base}.so")
        if not os.path.lexists(plain):
            newest = max(names, key=lambda n: [int(x) for x in n.split(".so.", 1)[1].split(".")])
            os.symlink(newest, plain)
            made.append(f"{base}.so")
    return made


def lay_out(wheels: list[dict], wheel_dir: str, root: str, machine: str) -> dict:
    """The toolkit at ``root`` from the pinned ``wheels`` in ``wheel_dir`` (every one checked before any is
    unpacked), built beside it and renamed into place."""
    target = TARGET_DIRS.get(machine)
    if target is None:
        raise LayoutError(f"no CUDA target directory known for machine {machine!r} (known: {', '.join(TARGET_DIRS)})")
    pinned = pins(wheels)
    by_name = {pin["name"]: find_wheel(wheel_dir, pin) for pin in pinned}
    partial = f"{root}.partial"
    shutil.rmtree(partial, ignore_errors=True)
    try:
        os.makedirs(os.path.join(partial, "targets", target, "include"), mode=0o755)
        os.makedirs(os.path.join(partial, "targets", target, "lib"), mode=0o755)
        files = sum(unpack(by_name[pin["name"]], partial, target) for pin in pinned)
        links = link_libraries(os.path.join(partial, "targets", target, "lib"))
        for name, points_to in (("include", f"targets/{target}/include"), ("lib", f"targets/{target}/lib"),
                                ("lib64", f"targets/{target}/lib")):
            if os.path.lexists(os.path.join(partial, name)):
                raise LayoutError(f"a wheel gives {name} at the toolkit's top, where the layout links to {points_to}")
            os.symlink(points_to, os.path.join(partial, name))
        missing = [p for p in REQUIRED if not os.path.exists(os.path.join(partial, p))]
        if missing:
            raise LayoutError(f"the wheels make no complete toolkit: no {', '.join(missing)} "
                              f"(pin nvcc, crt, nvvm, runtime, cublas and cccl wheels of one CUDA release)")
        with open(os.path.join(partial, MANIFEST), "w", encoding="utf-8") as out:
            json.dump({"wheels": pinned, "target": target}, out, indent=2, sort_keys=True)
            out.write("\n")
        if os.path.lexists(root):
            shutil.rmtree(root)
        os.rename(partial, root)
    except BaseException:
        shutil.rmtree(partial, ignore_errors=True)
        raise
    return {"files": files, "library_links": links, "target": target}


def recorded(root: str) -> list[dict] | None:
    try:
        with open(os.path.join(root, MANIFEST), encoding="utf-8") as handle:
            return json.load(handle).get("wheels")
    except (OSError, ValueError, AttributeError):
        return None


def point(link: str, root: str) -> bool:
    """``link`` -> ``root``, replaced by a rename; False when it points there already."""
    if os.path.lexists(link) and not os.path.islink(link):
        raise LayoutError(f"{link} is a directory or file rigctl did not make (a toolkit from apt?); "
                          "point gpu_host_cuda_home elsewhere for the wheels' toolkit")
    if os.path.islink(link) and os.readlink(link) == root:
        return False
    os.makedirs(os.path.dirname(link) or "/", exist_ok=True)
    staged = f"{link}.rigctl-new"
    if os.path.lexists(staged):
        os.unlink(staged)
    os.symlink(root, staged)
    os.replace(staged, link)
    return True


def main() -> None:
    module = AnsibleModule(
        argument_spec={
            "wheels": {"type": "list", "elements": "dict", "required": True},
            "wheel_dir": {"type": "path"},
            "root": {"type": "path", "required": True},
            "link": {"type": "path", "required": True},
        },
        supports_check_mode=True,
    )
    p = module.params
    try:
        wanted = pins(p["wheels"])
        current = recorded(p["root"]) == wanted
        linked = os.path.islink(p["link"]) and os.readlink(p["link"]) == p["root"]
        if module.check_mode or (current and linked):
            module.exit_json(changed=not (current and linked), root=p["root"], laid_out=False)
        if not current and not p["wheel_dir"]:
            raise LayoutError(f"the toolkit at {p['root']} is not in place and no wheel_dir was given")
        result = {} if current else lay_out(p["wheels"], p["wheel_dir"], p["root"], platform.machine())
        point(p["link"], p["root"])
    except (LayoutError, OSError, zipfile.BadZipFile, KeyError) as exc:
        module.fail_json(msg=f"gpu_host_cuda_wheels: {exc}")
    module.exit_json(changed=True, root=p["root"], laid_out=not current, **result)


if __name__ == "__main__":
    main()
