#!/usr/bin/python
# Part of rigctl's gpu_host role. "python", not "python3": Ansible (and mitogen) put the task's
# ansible_python_interpreter (the playbook's own Python) only in place of this shebang.
"""Read what the NVIDIA driver reports about the host's GPUs. Changes nothing."""

from __future__ import annotations

DOCUMENTATION = r"""
module: gpu_host_nvidia_smi
short_description: Read each GPU's name, driver, compute capability, memory and persistence mode from nvidia-smi
description:
  - Runs C(nvidia-smi --query-gpu=name,driver_version,compute_cap,memory.total,persistence_mode
    --format=csv,noheader,nounits) and plain C(nvidia-smi) (whose header names the CUDA version), each with a
    timeout, unless I(query) and I(summary) give their outputs.
  - The reader is module_utils nvidia_smi (rigctl/hostside/nvidia_smi.py), the one rigctl's probe uses: the
    CUDA version from either header generation (C(CUDA Version) or, from R610, C(CUDA UMD Version)), and a
    cell the driver cannot fill (C([N/A]), C([Not Supported]), ...) read as null, never as a value (a
    unified-memory GPU such as GB10 reports no C(memory.total)).
  - Returns C(answered) (the driver answered and every line read), C(said) (the first line of what went
    wrong, else empty), C(gpus) (one entry per GPU) and C(gpu) (the first one, with C(cuda_version)). Never
    fails itself; the role judges.
  - Never changes the host; supports check mode.
options:
  query: {description: "The --query-gpu answer to read instead of running nvidia-smi.", type: str}
  summary: {description: "Plain nvidia-smi's output to read instead of running nvidia-smi.", type: str}
  timeout: {description: Seconds nvidia-smi may take to answer., type: int, default: 60}
"""

import subprocess

from ansible.module_utils.basic import AnsibleModule
from ansible.module_utils.nvidia_smi import cell, query_rows, summary_versions, whole

#: What the role asks, in this order (names as ``nvidia-smi --help-query-gpu`` lists them).
FIELDS = ("name", "driver_version", "compute_cap", "memory.total", "persistence_mode")
QUERY_ARGV = ["nvidia-smi", f"--query-gpu={','.join(FIELDS)}", "--format=csv,noheader,nounits"]
EMPTY_GPU = {"name": None, "driver_version": None, "compute_capability": None, "vram_mib": None,
             "persistence_mode": None, "cuda_version": None}


def read(query: str, summary: str) -> tuple[list[dict], str | None]:
    """Each GPU of the ``--query-gpu`` answer, null where the driver reports nothing, and the CUDA version
    of plain nvidia-smi's header (None where it names none). ValueError naming a line that is not one GPU."""
    gpus = [{"name": cell(row["name"]), "driver_version": cell(row["driver_version"]),
             "compute_capability": cell(row["compute_cap"]), "vram_mib": whole(row["memory.total"]),
             "persistence_mode": cell(row["persistence_mode"])}
            for row in query_rows(query, FIELDS)]
    return gpus, summary_versions(summary).cuda


def _ask(argv: list[str], timeout: int) -> tuple[str | None, str]:
    """(stdout, "") when ``argv`` answered, else (None, the first line of what it said)."""
    try:
        done = subprocess.run(argv, capture_output=True, text=True, errors="replace", timeout=timeout,
                              check=False)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return None, str(exc).splitlines()[0][:300]
    if done.returncode != 0:
        said = (done.stderr.strip() or done.stdout.strip() or f"exit status {done.returncode}").splitlines()[0]
        return None, said[:300]
    return done.stdout, ""


def main() -> None:
    module = AnsibleModule(
        argument_spec={"query": {"type": "str"}, "summary": {"type": "str"},
                       "timeout": {"type": "int", "default": 60}},
        supports_check_mode=True,
    )
    p = module.params
    query, said = (p["query"], "") if p["query"] is not None else _ask(QUERY_ARGV, p["timeout"])
    if query is None:
        module.exit_json(changed=False, answered=False, said=said, gpus=[], gpu=EMPTY_GPU)
    # The CUDA version is only in the summary's header; a summary that fails leaves it null, the role judges.
    summary = p["summary"] if p["summary"] is not None else (_ask(["nvidia-smi"], p["timeout"])[0] or "")
    try:
        gpus, cuda_version = read(query, summary)
    except ValueError as exc:
        module.exit_json(changed=False, answered=False, said=str(exc), gpus=[], gpu=EMPTY_GPU)
    if not gpus:
        module.exit_json(changed=False, answered=False, said="nvidia-smi lists no GPU", gpus=[], gpu=EMPTY_GPU)
    module.exit_json(changed=False, answered=True, said="", gpus=gpus, gpu={**gpus[0], "cuda_version": cuda_version})


if __name__ == "__main__":
    main()
