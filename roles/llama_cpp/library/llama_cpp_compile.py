#!/usr/bin/python3
# Part of rigctl's llama_cpp role.
"""Run the compile in a transient unit that ends with the controller's connection."""

from __future__ import annotations

DOCUMENTATION = r"""
module: llama_cpp_compile
short_description: Run a build command in a transient systemd unit that stops when the controller is gone
description:
  - Runs C(command) as the transient service C(unit) (systemd-run --wait --pipe --collect), with C(env), under a
    watcher (module_utils play_lock) that stops it, and with it the unit's whole cgroup, within a second of the
    controller's SSH connection ending: a controller that dies mid-compile leaves no compile behind.
  - Returns C(rc), C(stdout), C(stderr) and C(disconnected); never fails by itself (the role judges C(rc)).
options:
  unit: {description: The transient unit's name., type: str, required: true}
  command: {description: The build command (argv)., type: list, elements: str, required: true}
  env: {description: Environment variables for the command., type: dict, default: {}}
  nice: {description: The unit's niceness (systemd's Nice=)., type: int, default: 0}
"""

import subprocess
import sys

from ansible.module_utils.basic import AnsibleModule
from ansible.module_utils.play_lock import DISCONNECTED, while_connected


def main() -> None:
    module = AnsibleModule(
        argument_spec={
            "unit": {"type": "str", "required": True},
            "command": {"type": "list", "elements": "str", "required": True},
            "env": {"type": "dict", "default": {}},
            "nice": {"type": "int", "default": 0},
        },
        supports_check_mode=False,
    )
    p = module.params
    argv = ["systemd-run", f"--unit={p['unit']}", "--wait", "--pipe", "--collect", "--quiet",
            "--service-type=exec", f"--nice={p['nice']}",
            *(f"--setenv={key}={value}" for key, value in sorted(p["env"].items())),
            "--", *while_connected(sys.executable, p["command"])]
    done = subprocess.run(argv, stdin=subprocess.DEVNULL, capture_output=True, text=True, errors="replace",
                          check=False)
    module.exit_json(changed=True, rc=done.returncode, stdout=done.stdout, stderr=done.stderr,
                     disconnected=done.returncode == DISCONNECTED, cmd=p["command"])


if __name__ == "__main__":
    main()
