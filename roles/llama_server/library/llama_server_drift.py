#!/usr/bin/python3
# Part of rigctl's llama_server role.
"""Find the llama-server instances whose running process differs from their files."""

from __future__ import annotations

DOCUMENTATION = r"""
module: llama_server_drift
short_description: Find the running llama-server instances whose process differs from their files
description:
  - For each named instance whose unit runs, compares the main process (its arguments, its executable,
    the environment file's hash the launcher gave it) with the instance's arguments file, binary link and
    environment file now (rigctl/hostside/server_drift.py). Whatever run wrote the files, such an instance
    is pending a restart.
  - Reads only; supports check mode. Reports C(changed) when some instance is pending a restart, so that a
    check run lists it and a real run notifies the rollout.
options:
  config_dir: {description: The instances' configuration directory., type: path, required: true}
  names: {description: The instances to look at., type: list, elements: str, required: true}
"""

RETURN = r"""
pending: {description: Instance name to what differs (arguments, binary, environment)., type: dict, returned: always}
"""

from ansible.module_utils.basic import AnsibleModule
from ansible.module_utils.server_drift import pending_restarts


def main() -> None:
    module = AnsibleModule(
        argument_spec={
            "config_dir": {"type": "path", "required": True},
            "names": {"type": "list", "elements": "str", "required": True},
        },
        supports_check_mode=True,
    )
    pending = pending_restarts(module.params["config_dir"], module.params["names"])
    said = "; ".join(f"{name} ({', '.join(what)})" for name, what in sorted(pending.items()))
    module.exit_json(changed=bool(pending), pending=pending,
                     msg=f"pending restart: {said}" if pending else "every running instance runs its files")


if __name__ == "__main__":
    main()
