#!/usr/bin/python
# Part of rigctl's gpu_host role. "python", not "python3": Ansible (and mitogen) put the task's
# ansible_python_interpreter (the playbook's own Python, with pip) only in place of this shebang.
"""Fetch a pinned wheel onto the controller from the package index, verified, never run."""

from __future__ import annotations

DOCUMENTATION = r"""
module: gpu_host_wheel
short_description: Download a pinned wheel file from pip's package index into a directory, without running it
description:
  - Returns at once with the file when I(dest_dir) holds a wheel of that name and version whose sha256 is
    the pin (no index is asked). Otherwise reads the project's page of the simple API (PEP 691 JSON, else
    PEP 503 HTML) on the indexes pip is configured with (PIP_INDEX_URL, pip config, else pip's default),
    picks the file whose listed sha256 is the pin (on an index that lists no hashes, the one wheel of that
    version for I(machine)), streams it into a .part file and renames it into I(dest_dir) under the index's
    file name only when its sha256 is the pin. Unlike C(pip download), nothing resolves dependencies and
    nothing in the wheel runs. On any failure nothing is left in I(dest_dir).
  - Runs on the controller (delegate_to localhost) under a Python that has pip. Supports check mode.
  - The code is module_utils sdist_fetch (rigctl/hostside/sdist_fetch.py), shared with the llama_cpp
    role's source archive fetch.
options:
  requirement: {description: "The wheel, name==version.", type: str, required: true}
  sha256: {description: The wheel's pinned sha256., type: str, required: true}
  dest_dir: {description: The directory the wheel goes into., type: path, required: true}
  machine: {description: "The host's machine (x86_64, aarch64): which wheel, where the index lists no hashes.", type: str, required: true}
  host: {description: Inventory name of the host the wheel is for, for messages., type: str, required: true}
  timeout: {description: Seconds without progress before a request fails., type: int, default: 60}
"""

from ansible.module_utils.sdist_fetch import ansible_module, fetch_or_fail, fetch_wheel


def main() -> None:
    module = ansible_module({"dest_dir": {"type": "path", "required": True},
                             "machine": {"type": "str", "required": True}})
    p = module.params
    if module.check_mode:
        module.exit_json(changed=False, msg=f"would fetch {p['requirement']} unless {p['dest_dir']} has it")
    path = fetch_or_fail(module, "gpu_host_cuda_wheels", fetch_wheel, p["dest_dir"], machine=p["machine"])
    module.exit_json(changed=False, path=str(path))


if __name__ == "__main__":
    main()
