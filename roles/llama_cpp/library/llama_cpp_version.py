#!/usr/bin/python3
# Part of rigctl's llama_cpp role.
"""Ask a staged llama.cpp build which build it is. Changes nothing."""

from __future__ import annotations

DOCUMENTATION = r"""
module: llama_cpp_version
short_description: Read what a llama.cpp binary's --version reports and compare it with the pin
description:
  - Runs C(<binary> --version) with a timeout and reads its C(version:) line in either form llama.cpp has
    printed (C(version: 4547 (c5d9effb)) and C(version: 0.4.1-dev (build 10991, commit 930e2fa59))), past
    whatever the backends log first; the reader is module_utils llama_version, rigctl's own.
  - Returns C(matches) (the build number and commit are the expected ones), what was read, and the first
    line of the output where nothing could be read. Never fails itself; the role judges.
  - Never changes the host; supports check mode.
options:
  binary: {description: The binary to ask., type: path, required: true}
  build_number: {description: The build number it must report., type: int, required: true}
  commit:
    description: The commit (or release label) it must report; a short hash matches its prefix.
    type: str
    required: true
  timeout: {description: Seconds the binary may take to answer., type: int, default: 60}
"""

import subprocess

from ansible.module_utils.basic import AnsibleModule
from ansible.module_utils.llama_version import parse, same_commit


def main() -> None:
    module = AnsibleModule(
        argument_spec={
            "binary": {"type": "path", "required": True},
            "build_number": {"type": "int", "required": True},
            "commit": {"type": "str", "required": True},
            "timeout": {"type": "int", "default": 60},
        },
        supports_check_mode=True,
    )
    p = module.params
    try:
        done = subprocess.run([p["binary"], "--version"], capture_output=True, text=True, errors="replace",
                              timeout=p["timeout"], check=False)
    except (OSError, subprocess.TimeoutExpired) as exc:
        module.exit_json(changed=False, matches=False, rc=None, said=str(exc).splitlines()[0][:300])
    said = (done.stderr + done.stdout).strip()
    try:
        version = parse(said)
    except ValueError as exc:
        module.exit_json(changed=False, matches=False, rc=done.returncode, said=str(exc))
    matches = (done.returncode == 0 and version.build_number == p["build_number"]
               and same_commit(version.commit, p["commit"]))
    module.exit_json(changed=False, matches=matches, rc=done.returncode, version=version.as_dict(),
                     said=f"build {version.build_number}, commit {version.commit}")


if __name__ == "__main__":
    main()
