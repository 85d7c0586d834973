#!/usr/bin/python3
# Part of rigctl's play_lock role.
"""Take or free this host's play lock (module_utils play_lock, rigctl/hostside/play_lock.py)."""

from __future__ import annotations

DOCUMENTATION = r"""
module: play_lock_hold
short_description: One play at a time per host, held for as long as the controller's connection lasts
description:
  - C(state=acquired) takes C(/run/rigctl/play.lock), held by a small process that ends when the
    controller's SSH connection does, and records the holder in C(play.json) beside it. Another play holding
    it fails the task naming that holder; a record whose holder is gone is taken over and reported. A lock
    directory that is not root's alone (another user made it, or may write it) is refused.
  - C(state=released) frees the lock taken with C(token), leaving the holder's record with C(outcome).
  - Runs in check mode too: a check run holds the host like any other play.
  - Never reports a change: a lock is not part of the host's configuration (a run that changes nothing
    says so).
options:
  state: {description: acquired or released., type: str, choices: [acquired, released], default: acquired}
  holder:
    description: The controller's record of itself (base64 of a JSON object; rigctl sets it), empty for a plain
      ansible-playbook run.
    type: str
    default: ""
  host: {description: The inventory name of this host, for messages., type: str, required: true}
  token: {description: What acquiring returned (state=released)., type: str, default: ""}
  lock_dir: {description: Where the lock and its record live (root's, mode 0700)., type: path, default: /run/rigctl}
  outcome:
    description: How the play ended (state=released) - ok, or failed for a play that ended by failure.
    type: str
    choices: [ok, failed]
    default: ok
"""

import base64
import binascii
import json

from ansible.module_utils.basic import AnsibleModule
from ansible.module_utils.play_lock import LockBusy, acquire, describe, release

#: What a holder record may carry from the controller (anything else is dropped), each at most this long.
HOLDER_KEYS = ("controller", "user", "pid", "command", "started", "inventory")
HOLDER_VALUE_MAX = 500


def parse_holder(text: str) -> dict:
    if not text:
        return {"command": "ansible-playbook"}
    try:
        data = json.loads(base64.b64decode(text, validate=True))
    except (ValueError, binascii.Error) as exc:
        raise ValueError(f"holder: not base64 of a JSON object ({exc})") from None
    if not isinstance(data, dict):
        raise ValueError("holder: not a JSON object")
    holder = {}
    for key in HOLDER_KEYS:
        value = data.get(key)
        if isinstance(value, int) and not isinstance(value, bool):
            holder[key] = value
        elif isinstance(value, str):
            holder[key] = value[:HOLDER_VALUE_MAX]
    return holder


def main() -> None:
    module = AnsibleModule(
        argument_spec={
            "state": {"type": "str", "choices": ["acquired", "released"], "default": "acquired"},
            "holder": {"type": "str", "default": ""},
            "host": {"type": "str", "required": True},
            "token": {"type": "str", "default": "", "no_log": False},
            "lock_dir": {"type": "path", "default": "/run/rigctl"},
            "outcome": {"type": "str", "choices": ["ok", "failed"], "default": "ok"},
        },
        supports_check_mode=True,
    )
    p = module.params
    if p["state"] == "released":
        try:
            freed = release(p["token"], lock_dir=p["lock_dir"], outcome=p["outcome"])
        except OSError as exc:
            module.fail_json(msg=f"{p['host']}: play lock {p['lock_dir']}: {exc.strerror or exc}")
        module.exit_json(changed=False, released=freed)
    try:
        holder = parse_holder(p["holder"])
    except ValueError as exc:
        module.fail_json(msg=f"{p['host']}: play lock: {exc}")
    try:
        record = acquire(holder, lock_dir=p["lock_dir"])
    except LockBusy as exc:
        module.fail_json(msg=f"{p['host']}: {exc}", holder=exc.holder)
    except OSError as exc:  # LockDirRefused among them: its text names the directory and why
        module.fail_json(msg=f"{p['host']}: play lock {p['lock_dir']}: {exc.strerror or exc}")
    stale, previous = record.pop("stale"), record.pop("previous")
    if stale:  # its holder died without releasing it
        msg = f"{p['host']}: took over the play lock left by {describe(stale)}: its holder is gone"
    elif previous and previous.get("outcome") == "failed":
        msg = f"{p['host']}: play lock taken; the last play, {describe(previous)}, ended by failure here"
    else:
        msg = f"{p['host']}: play lock taken"
    module.exit_json(changed=False, token=record["token"], holder=record, stale=stale, previous=previous, msg=msg)

if __name__ == "__main__":
    main()
