#!/usr/bin/python3
# Part of rigctl's llama_server role.
"""Wait until a llama-server instance serves what it should, or say why it does not."""

from __future__ import annotations

DOCUMENTATION = r"""
module: llama_server_wait
short_description: Wait for a llama-server unit to answer /health 200 and /props with the expected model and build
description:
  - Polls the unit's systemd state and the server's C(/health) and C(/props) until C(/props) reports the
    expected C(model_path) and C(build_info), or fails as soon as the unit has failed or systemd has had
    to restart it (a crash loop never turns healthy), or when the timeout passes.
  - Reads only; supports check mode.
options:
  unit: {description: The systemd unit (llama-server@NAME.service)., type: str, required: true}
  url: {description: The server's base URL (http://127.0.0.1:8080)., type: str, required: true}
  api_key: {description: The API key for /props when one is set., type: str, default: "", no_log: true}
  model_path: {description: The model path /props must report., type: str, required: true}
  build_info: {description: The build_info /props must report (b<number>-<commit>)., type: str, required: true}
  timeout: {description: Seconds to wait., type: int, default: 120}
"""

import json
import subprocess
import time
import urllib.error
import urllib.request

from ansible.module_utils.basic import AnsibleModule


def unit_state(unit: str) -> dict:
    out = subprocess.run(["systemctl", "show", unit, "-p", "ActiveState,SubState,NRestarts,MainPID,Result"],
                         capture_output=True, text=True, timeout=10, check=False).stdout
    return dict(line.split("=", 1) for line in out.splitlines() if "=" in line)


def get(url: str, api_key: str) -> tuple[int, str]:
    request = urllib.request.Request(url, headers={"Authorization": f"Bearer {api_key}"} if api_key else {})
    try:
        with urllib.request.urlopen(request, timeout=5) as response:
            return response.status, response.read().decode("utf-8", errors="replace")
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode("utf-8", errors="replace")
    except (urllib.error.URLError, OSError) as exc:
        return 0, str(exc)


def main() -> None:
    module = AnsibleModule(
        argument_spec={
            "unit": {"type": "str", "required": True},
            "url": {"type": "str", "required": True},
            "api_key": {"type": "str", "default": "", "no_log": True},
            "model_path": {"type": "str", "required": True},
            "build_info": {"type": "str", "required": True},
            "timeout": {"type": "int", "default": 120},
        },
        supports_check_mode=True,
    )
    p = module.params
    if module.check_mode:
        module.exit_json(changed=False, skipped=True, msg="check mode: not waiting")
    base = p["url"].rstrip("/")
    started = time.monotonic()
    restarts = unit_state(p["unit"]).get("NRestarts", "0")
    last = "no answer yet"
    while time.monotonic() - started < p["timeout"]:
        state = unit_state(p["unit"])
        if state.get("ActiveState") == "failed" or state.get("NRestarts", "0") != restarts:
            crashes = int(state.get("NRestarts", "0")) - int(restarts)
            how = "failed" if crashes <= 0 else f"systemd restarted it {crashes} times"
            module.fail_json(msg=f"{p['unit']} exited instead of serving ({how})", state=state)
        status, body = get(f"{base}/health", "")
        if status == 200:
            status, body = get(f"{base}/props", p["api_key"])
            if status != 200:
                module.fail_json(msg=f"{base}/props answered HTTP {status}: {body[:200]}", state=state)
            props = json.loads(body)
            model, build = props.get("model_path"), props.get("build_info")
            if model != p["model_path"] or build != p["build_info"]:
                module.fail_json(msg=f"{base}/props reports model {model} build {build}, "
                                     f"expected {p['model_path']} build {p['build_info']}", props=props)
            module.exit_json(changed=False, waited_s=round(time.monotonic() - started, 1),
                             main_pid=int(state.get("MainPID", "0")), props={"model_path": model, "build_info": build})
        last = f"/health answered {status or body}"
        time.sleep(0.5)
    module.fail_json(msg=f"{p['unit']} not healthy within {p['timeout']} s ({last})")


if __name__ == "__main__":
    main()
