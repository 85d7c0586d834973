#!/usr/bin/python3
# Part of rigctl's models role.
"""Make one GGUF artifact (copy, convert or quantize), write its manifest, check its pin, put it in place."""

from __future__ import annotations

DOCUMENTATION = r"""
module: models_artifact
short_description: Make one GGUF model artifact with a manifest beside it, atomically
description:
  - Runs the artifact's command (or links/copies a ready GGUF) into a temporary name beside I(path),
    reads the result's GGUF header (tensor count, tensors and bytes per type), hashes it, checks the
    hash against the host's pin, writes I(path).manifest.json, and only then renames both into place.
    Until that rename a server keeps reading the old file.
  - Idempotent. The manifest stores a key over everything that determines the file (kind, command,
    input identity, recipe, llama.cpp build); with the same key and a file of the recorded size,
    nothing runs and changed is false.
  - Supports check mode (reports whether it would make the artifact).
  - The command (the converter, llama-quantize, llama-imatrix) runs sandboxed as a transient systemd
    service - a dynamic unprivileged user, the server unit's hardening, no network and no sockets, the file
    system read-only but for the unit's own state directory, where it writes its output; root then moves
    that file beside I(path), opened without following links and refused unless it is a plain file.
  - The GGUF reader (module_utils gguf, rigctl/hostside/gguf.py) is standard library only, so the module
    runs with the host's system python3; rigctl's tests check it against the gguf package's reader.
options:
  name: {description: Artifact name., type: str, required: true}
  path: {description: Final GGUF path on the host., type: path, required: true}
  kind: {description: How the artifact is made., type: str, required: true, choices: [file, convert, quantize, copy]}
  input: {description: The source file, checkout directory or input artifact., type: path, required: true}
  input_id:
    description:
      - What identifies the input (a resolved revision, a sha256). Empty - the sha256 in the input's own
        manifest, else a digest of the input's content (a file, or every file of a directory).
    type: str
    default: ""
  argv: {description: "Command; {input} and {output} are replaced. Empty for file and copy.", type: list, elements: str, default: []}
  env: {description: Extra environment for the command., type: dict, default: {}}
  timeout: {description: Seconds the command may run., type: int, default: 7200}
  recipe: {description: Recipe settings recorded in the manifest and its key., type: dict, default: {}}
  source: {description: The model's source, recorded in the manifest., type: dict, default: {}}
  build: {description: The llama.cpp build (from its local fact), recorded in the manifest., type: dict, default: {}}
  key_build: {description: Whether the llama.cpp build key joins the artifact key (quantize)., type: bool, default: false}
  model: {description: Model name in the catalog., type: str, default: ""}
  host: {description: Inventory name of the host, for messages and the manifest., type: str, required: true}
  pin: {description: Pinned sha256 for this host, empty for none., type: str, default: ""}
  pin_policy: {description: What a pin mismatch does., type: str, default: fail, choices: [fail, warn]}
  expect_sha256: {description: For copy, the sha256 the file must have (the builder's)., type: str, default: ""}
  trust_remote_code:
    description:
      - For convert - run the converter on a checkout that carries Python files or an auto_map (the catalog
        entry's trust_remote_code). Without it such a checkout is refused before the converter starts.
    type: bool
    default: false
  imatrix:
    description:
      - For quantize with an importance matrix - argv (llama-imatrix; {input}, {calibration} and {output}
        are replaced), calibration (text file on the host) and dir (where matrices are kept). The matrix
        is named by a key over the input, the calibration text and the command, so it is made once and
        remade only when one of them changes; {imatrix} in I(argv) becomes its path.
    type: dict
    default: {}
"""

import hashlib
import json
import os
import re
import shlex
import shutil
import subprocess
import time

from ansible.module_utils.basic import AnsibleModule
from ansible.module_utils.gguf import GGUFError, read_header, type_summary
from ansible.module_utils.model_checkout import describe, remote_code
from ansible.module_utils.model_files import file_sha256, manifest_path
from ansible.module_utils.sandbox import UnsafeOutput, clean_exec, model_unit_properties, take_output

MANIFEST_VERSION = 1

def gguf_summary(path: str) -> dict:
    """Tensor count, tensors and bytes per ggml type, and a few header fields of a GGUF file."""
    header = read_header(path)
    architecture = header["meta"].get("general.architecture", "")
    return {
        "gguf_version": header["version"],
        "tensor_count": header["tensor_count"],
        "kv_count": header["kv_count"],
        # A string, as the reader keeps it (a longer one it keeps as its length only): never another type.
        "architecture": architecture if isinstance(architecture, str) else "",
        "types": type_summary(header),
    }


def input_identity(path: str) -> str:
    """The sha256 an input's manifest records, else a digest of its content."""
    try:
        with open(manifest_path(path), encoding="utf-8") as f:
            return "sha256:" + json.load(f)["sha256"]
    except (OSError, ValueError, KeyError):
        pass
    if os.path.isfile(path):
        return "sha256:" + file_sha256(path)
    digest = hashlib.sha256()
    for root, dirs, files in os.walk(path):
        dirs.sort()
        for name in sorted(files):
            full = os.path.join(root, name)
            digest.update(f"{os.path.relpath(full, path)}\0{file_sha256(full)}\n".encode())
    return "tree:" + digest.hexdigest()


def artifact_key(p: dict, input_id: str, imatrix_key: str = "") -> str:
    inputs = {
        "kind": p["kind"],
        "argv": p["argv"],
        "input_id": input_id,
        "recipe": p["recipe"],
        "build": p["build"].get("key", "") if p["key_build"] else "",
        "manifest_version": MANIFEST_VERSION,
    }
    if imatrix_key:  # only then, so artifacts without a matrix keep their keys
        inputs["imatrix"] = imatrix_key
    return hashlib.sha256(json.dumps(inputs, sort_keys=True).encode()).hexdigest()


def current_manifest(path: str, key: str) -> dict | None:
    """The manifest beside ``path`` if it was made from these inputs and the file is still its size."""
    try:
        with open(manifest_path(path), encoding="utf-8") as f:
            manifest = json.load(f)
        size = os.path.getsize(path)
    except (OSError, ValueError):
        return None
    if manifest.get("key") != key or manifest.get("bytes") != size:
        return None
    return manifest


def _place_input(src: str, dst: str) -> None:
    # A hard link costs nothing and the source copy stays byte-identical; across file systems, copy.
    try:
        os.link(src, dst)
    except OSError:
        shutil.copyfile(src, dst)


#: Less free space than this beside a failed artifact: the failure is (most likely) the disk being full.
DISK_FULL_BYTES = 64 << 20


def disk_note(directory: str) -> str:
    """``; disk full: ...`` when the file system of ``directory`` is (nearly) out of space, else ``""``:
    llama-quantize and friends rarely say so themselves, they just stop or write a short file."""
    try:
        st = os.statvfs(directory)
    except OSError:
        return ""
    free = st.f_bavail * st.f_frsize
    return f"; disk full: {free // 1024} KiB free on the file system of {directory}" if free < DISK_FULL_BYTES else ""


#: Seconds systemd gets to stop a command that ran past its time.
_STOP_GRACE = 60


class Sandbox:
    """One command's transient unit and its state directory (``/var/lib/<state>``, the one place it may
    write). ``output(name)`` is a path inside it as the command sees it; :meth:`take` moves such a file
    out, owned by root; :meth:`remove` leaves nothing of the unit behind.

    The unit has the server unit's hardening and no sockets (module_utils sandbox: a model's code, a
    converter bug or a llama.cpp exploit gets an unprivileged user with no network and nothing to write to
    but its state directory), and what it leaves there is taken as data: a link or anything but a plain
    file is refused, never followed by root."""

    def __init__(self, unit: str):
        self.unit = unit
        self.state = unit
        self.dir = os.path.join("/var/lib", self.state)
        # Where the state really is with DynamicUser (/var/lib/<state> is a link to it): root's 0700
        # /var/lib/private, so the sandbox cannot swap the directory, only what is in it.
        self.private = os.path.join("/var/lib/private", self.state)

    def output(self, name: str) -> str:
        return os.path.join(self.dir, name)

    def argv(self, argv: list, env: dict, timeout: int) -> list:
        return ["systemd-run", f"--unit={self.unit}", "--wait", "--pipe", "--collect", "--quiet",
                "--service-type=exec", *[f"--property={prop}" for prop in model_unit_properties()],
                f"--property=StateDirectory={self.state}", f"--property=RuntimeMaxSec={timeout}",
                "--setenv=HOME=/tmp", "--setenv=HF_HUB_OFFLINE=1",
                *[f"--setenv={k}={v}" for k, v in env.items()], "--", *clean_exec(argv)]

    def run(self, argv: list, env: dict, timeout: int) -> subprocess.CompletedProcess:
        self.remove()  # a run that died before cleaning up
        try:
            return subprocess.run(self.argv(argv, env, timeout), capture_output=True, text=True,
                                  stdin=subprocess.DEVNULL, timeout=timeout + _STOP_GRACE, check=False)
        except subprocess.TimeoutExpired as exc:
            subprocess.run(["systemctl", "stop", f"{self.unit}.service"], capture_output=True, timeout=60, check=False)
            return subprocess.CompletedProcess(exc.cmd, 124, exc.stdout or "", f"timed out after {timeout} s")

    def take(self, name: str, dest: str) -> bool:
        """The command's output ``name`` to ``dest`` (same directory as the final file), root's, 0644; False
        when it left none. :class:`UnsafeOutput` for a link or anything but a plain file."""
        return take_output(self.private, name, dest)

    def remove(self) -> None:
        shutil.rmtree(self.private, ignore_errors=True)
        if os.path.islink(self.dir):
            os.unlink(self.dir)
        else:
            shutil.rmtree(self.dir, ignore_errors=True)


def main() -> None:
    module = AnsibleModule(
        argument_spec={
            "name": {"type": "str", "required": True},
            "path": {"type": "path", "required": True},
            "kind": {"type": "str", "required": True, "choices": ["file", "convert", "quantize", "copy"]},
            "input": {"type": "path", "required": True},
            "input_id": {"type": "str", "default": ""},
            "argv": {"type": "list", "elements": "str", "default": []},
            "env": {"type": "dict", "default": {}},
            "timeout": {"type": "int", "default": 7200},
            "recipe": {"type": "dict", "default": {}},
            "source": {"type": "dict", "default": {}},
            "build": {"type": "dict", "default": {}},
            "key_build": {"type": "bool", "default": False},
            "model": {"type": "str", "default": ""},
            "host": {"type": "str", "required": True},
            "pin": {"type": "str", "default": ""},
            "pin_policy": {"type": "str", "default": "fail", "choices": ["fail", "warn"]},
            "expect_sha256": {"type": "str", "default": ""},
            "imatrix": {"type": "dict", "default": {}},
            "trust_remote_code": {"type": "bool", "default": False},
        },
        supports_check_mode=True,
    )
    p = module.params
    host = p["host"]
    path, name = p["path"], p["name"]
    if not os.path.exists(p["input"]):
        if module.check_mode:  # made by an earlier artifact of this run
            module.exit_json(changed=True, manifest={}, path=path, msg=f"would make {name} ({p['kind']})")
        module.fail_json(msg=f"{host}: {name}: input {p['input']} does not exist")
    input_id = p["input_id"] or input_identity(p["input"])
    imatrix = _imatrix_plan(module, p, input_id) if p["imatrix"] else None
    if imatrix:
        p["argv"] = [a.replace("{imatrix}", imatrix["path"]) for a in p["argv"]]
    key = artifact_key(p, input_id, imatrix["key"] if imatrix else "")
    manifest = current_manifest(path, key)
    if manifest is not None:
        _check_pin(module, manifest, p, staged=False)
        module.exit_json(changed=False, manifest=manifest, path=path)
    # Whatever fetched or copied the checkout, this is the last look before the converter loads it.
    code = remote_code(p["input"]) if p["kind"] == "convert" and not p["trust_remote_code"] else []
    if code:
        module.fail_json(msg=f"{host}: {name}: checkout {p['input']} carries code the converter would run "
                             f"({describe(code)}); refused (models_catalog.{p['model']}.trust_remote_code: true "
                             "accepts it)")
    if module.check_mode:
        module.exit_json(changed=True, manifest={}, path=path, msg=f"would make {name} ({p['kind']})")
    directory = os.path.dirname(path)
    os.makedirs(directory, exist_ok=True)
    tmp = os.path.join(directory, f".{os.path.basename(path)}.partial")
    for stale in (tmp, manifest_path(tmp)):
        if os.path.exists(stale):
            os.unlink(stale)
    argv = [a.replace("{input}", p["input"]).replace("{output}", tmp) for a in p["argv"]]
    try:
        if imatrix:
            _make_imatrix(module, p, imatrix)
        started = time.monotonic()
        if argv:
            _run_sandboxed(module, Sandbox(f"rigctl-models-{name}-{key[:8]}"), argv, tmp, directory)
        else:
            try:
                _place_input(p["input"], tmp)
            except OSError as exc:
                module.fail_json(msg=f"{host}: {name}: copying {p['input']} to {tmp}: {exc.strerror or exc}"
                                     f"{disk_note(directory)}")
        wall = time.monotonic() - started
        if not os.path.isfile(tmp):
            module.fail_json(msg=f"{host}: {name}: `{shlex.join(argv)}` wrote no file at {tmp}{disk_note(directory)}")
        try:
            summary = gguf_summary(tmp)
        except GGUFError as exc:
            module.fail_json(msg=f"{host}: {name}: {tmp}: {exc}{disk_note(directory)}")
        digest = file_sha256(tmp)
        if p["expect_sha256"] and digest != p["expect_sha256"]:
            module.fail_json(msg=f"{host}: {name}: copied file {tmp} has sha256 {digest}, "
                                 f"the builder's is {p['expect_sha256']}")
        manifest = {
            "manifest_version": MANIFEST_VERSION,
            "artifact": name,
            "model": p["model"],
            "kind": p["kind"],
            "host": host,
            "path": path,
            "bytes": os.path.getsize(tmp),
            "sha256": digest,
            **summary,
            "recipe": p["recipe"],
            "source": p["source"],
            "input": {"path": p["input"], "id": input_id},
            "llama_cpp": p["build"],
            "command": shlex.join(argv).replace(tmp, path) if argv else "",
            "wall_s": round(wall, 3),
            **({"imatrix": {k: imatrix[k] for k in ("path", "calibration", "calibration_id", "command", "wall_s")}}
               if imatrix else {}),
            "created_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            "key": key,
        }
        _check_pin(module, manifest, p, staged=True)
        try:
            with open(manifest_path(tmp), "w", encoding="utf-8") as f:
                json.dump(manifest, f, indent=2, sort_keys=True)
                f.write("\n")
            os.chmod(tmp, 0o644)
            os.rename(tmp, path)
            os.rename(manifest_path(tmp), manifest_path(path))
        except OSError as exc:
            module.fail_json(msg=f"{host}: {name}: {exc.filename or path}: {exc.strerror or exc}{disk_note(directory)}")
    finally:
        for stale in (tmp, manifest_path(tmp)):
            if os.path.exists(stale):
                os.unlink(stale)
    module.exit_json(changed=True, manifest=manifest, path=path)


def _imatrix_plan(module: AnsibleModule, p: dict, input_id: str) -> dict:
    spec = p["imatrix"]
    host, name = p["host"], p["name"]
    calibration = spec.get("calibration", "")
    if not os.path.isfile(calibration):
        module.fail_json(msg=f"{host}: {name}: imatrix calibration file {calibration} does not exist")
    calibration_id = input_identity(calibration)
    argv = [str(a).replace("{calibration}", calibration) for a in spec.get("argv", [])]
    key = hashlib.sha256(json.dumps([input_id, calibration_id, argv]).encode()).hexdigest()[:16]
    path = os.path.join(spec["dir"], f"{name}-{key}.imatrix.gguf")
    return {"key": key, "path": path, "argv": argv, "dir": spec["dir"], "calibration": calibration,
            "calibration_id": calibration_id, "command": "", "wall_s": 0.0}


def _make_imatrix(module: AnsibleModule, p: dict, imatrix: dict) -> None:
    """Make the importance matrix unless one with this key exists; drop this artifact's older ones."""
    host, name, path = p["host"], p["name"], imatrix["path"]
    argv = [a.replace("{input}", p["input"]).replace("{output}", path + ".partial") for a in imatrix["argv"]]
    imatrix["command"] = shlex.join(argv).replace(path + ".partial", path)
    if not os.path.isfile(path):
        os.makedirs(imatrix["dir"], exist_ok=True)
        started = time.monotonic()
        try:
            _run_sandboxed(module, Sandbox(f"rigctl-models-{name}-imatrix"), argv, path + ".partial", imatrix["dir"])
            if not os.path.isfile(path + ".partial"):
                module.fail_json(msg=f"{host}: {name}: `{shlex.join(argv)}` wrote no file")
            imatrix["wall_s"] = round(time.monotonic() - started, 3)
            os.rename(path + ".partial", path)
        finally:
            if os.path.exists(path + ".partial"):
                os.unlink(path + ".partial")
    own = re.compile(rf"^{re.escape(name)}-[0-9a-f]{{16}}\.imatrix\.gguf$")
    for entry in os.listdir(imatrix["dir"]):
        if own.match(entry) and entry != os.path.basename(path):
            os.unlink(os.path.join(imatrix["dir"], entry))


def _run_sandboxed(module: AnsibleModule, sandbox: Sandbox, argv: list, output: str, directory: str) -> None:
    """``argv``, which writes ``output``, run in ``sandbox`` writing into its state directory instead; the
    file it wrote is then moved to ``output``. A failure is one line naming the command as recorded."""
    p = module.params
    inside = sandbox.output(os.path.basename(output))
    try:
        proc = sandbox.run([a.replace(output, inside) for a in argv], {k: str(v) for k, v in p["env"].items()},
                           p["timeout"])
        if proc.returncode != 0:
            tail = [ln for ln in (proc.stderr + proc.stdout).strip().splitlines() if ln.strip()]
            module.fail_json(msg=f"{p['host']}: {p['name']}: `{shlex.join(argv)}` exited {proc.returncode}: "
                                 f"{tail[-1] if tail else 'no output'}{disk_note(directory)}",
                             stdout=proc.stdout[-4000:], stderr=proc.stderr[-4000:])
        sandbox.take(os.path.basename(output), output)
    except UnsafeOutput as exc:
        module.fail_json(msg=f"{p['host']}: {p['name']}: `{shlex.join(argv)}` left no plain file: {exc.strerror}")
    finally:
        sandbox.remove()


def _check_pin(module: AnsibleModule, manifest: dict, p: dict, *, staged: bool) -> None:
    pin = (p["pin"] or "").lower()
    if not pin or pin == manifest["sha256"]:
        return
    where = "new file (not put in place)" if staged else manifest["path"]
    msg = (f"{p['host']}: {p['name']}: pinned sha256 {pin} but the {where} has "
           f"{manifest['sha256']}")
    if p["pin_policy"] == "fail":
        module.fail_json(msg=msg)
    module.warn(msg)


if __name__ == "__main__":
    main()
