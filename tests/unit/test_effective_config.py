"""The effective configuration (issue #36): what a server ran besides its argv is stated in the record and
flagged by `rigctl compare` and the report; the host-side facts' parsers; the sandbox's clean launch. The
lab side (a config file planted on a rig, a variable from a drop-in) is tests/lab/test_effective_config_lab.py."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from handmade_runs import load_run

from rigctl.hostside import sandbox, stamp
from rigctl.results.record import RUN_FILE, Server
from rigctl.results.store import ResultsStore

RIGCTL = str(Path(sys.executable).parent / "rigctl")
ARGS = ["--model", "/m.gguf", "-c", "2048", "-np", "2", "-t", "2"]


def _request(started: float) -> dict:
    return {"prompt": "chat", "ok": True, "error": None, "ttft_s": 0.05, "wall_s": 0.4, "tokens": 16,
            "tpot_s": 0.35 / 15, "decode_per_s": 40.0, "started_s": started}


def _load_run(root: Path, run_id: str, **props: object) -> Path:
    run_dir = load_run(root, "desktop", run_id, {1: [_request(i * 0.4) for i in range(4)]}, server="smollm2",
                       artifact="smollm2-135m-q4_1", args=ARGS)
    record = json.loads((run_dir / RUN_FILE).read_text())
    record["servers"][0].update(props)
    (run_dir / RUN_FILE).write_text(json.dumps(record))
    return run_dir


def test_a_record_whose_props_n_ctx_differs_from_the_profile_is_flagged_in_compare(tmp_path: Path) -> None:
    root = tmp_path / "results"
    # -c 2048 over -np 2: 1024 per slot (or 2048 with one unified cache) is what the profile gives.
    _load_run(root, "load-20261130T070000Z-aaaa", n_ctx=1024, total_slots=2)
    _load_run(root, "load-20261130T080000Z-bbbb", n_ctx=5, total_slots=2)
    done = subprocess.run([RIGCTL, "compare", "desktop/load-20261130T070000Z-aaaa",
                           "desktop/load-20261130T080000Z-bbbb", "--results", str(root)],
                          capture_output=True, text=True, timeout=120, env={**os.environ, "COLUMNS": "200"})
    assert done.returncode == 0, done.stderr
    flagged = [line for line in done.stdout.splitlines() if line.startswith("effective configuration")]
    assert flagged == ["effective configuration of desktop/load-20261130T080000Z-bbbb: desktop/smollm2: "
                       "/props n_ctx 5 per slot, the profile's -c 2048 over 2 slots"]
    from rigctl.analysis.compare import RunRef

    store = ResultsStore(root)
    assert RunRef.of(store.find("desktop/load-20261130T070000Z-aaaa")).effective == ()
    assert RunRef.of(store.find("desktop/load-20261130T080000Z-bbbb")).effective == (
        "desktop/smollm2: /props n_ctx 5 per slot, the profile's -c 2048 over 2 slots",)


def test_effective_differences_name_config_files_variables_and_slots() -> None:
    server = Server(name="smollm2", host="desktop", argv=ARGS, n_ctx=2048, total_slots=4,
                    config_files=["/etc/llama.cpp/config.ini"], environment=["LLAMA_ARG_CTX_SIZE=***"])
    assert server.effective_differences() == [
        "applied llama.cpp config file /etc/llama.cpp/config.ini",
        "llama.cpp variable LLAMA_ARG_CTX_SIZE=*** in its environment",
        "/props total_slots 4, the profile's -np 2",
    ]
    # A unified cache (every slot the whole -c) and a split one are both what the flags give.
    assert Server(argv=ARGS, n_ctx=2048, total_slots=2).effective_differences() == []
    assert Server(argv=ARGS, n_ctx=1024, total_slots=2).effective_differences() == []
    assert Server(argv=["-c", "0"], n_ctx=8192, total_slots=1).effective_differences() == []  # the model's own


def test_the_journal_line_and_environ_are_read_as_llama_cpp_writes_them() -> None:
    # common/arg.cpp (b11434): LOG_INF("using config file: %s\n", ...); the journal adds nothing with -o cat.
    log = ("using config file: /etc/llama.cpp/config.ini\n"
           "using config file: /var/lib/llama-server/.config/llama.cpp/config.ini\n"
           "main: n_parallel is set to auto, using n_parallel = 4 and kv_unified = true\n")
    assert sandbox.parse_used_config_files(log) == ["/etc/llama.cpp/config.ini",
                                                    "/var/lib/llama-server/.config/llama.cpp/config.ini"]
    environ = b"PATH=/usr/bin\0LLAMA_ARG_CTX_SIZE=64\0LLAMA_API_KEY=secret\0HF_TOKEN=hf_x\0LLAMA_CACHE=/c\0"
    assert stamp.parse_environ(environ) == ["HF_TOKEN=***", "LLAMA_API_KEY=***", "LLAMA_ARG_CTX_SIZE=***",
                                            "LLAMA_CACHE=***"]
    listing = "/etc/llama.cpp/config.ini\nls: cannot access 'x': No such file or directory\n/etc/passwd\n"
    assert sandbox.parse_config_files(listing) == ["/etc/llama.cpp/config.ini"]


def test_clean_exec_drops_every_variable_llama_cpp_reads(tmp_path: Path) -> None:
    env = {"PATH": os.environ["PATH"], "LLAMA_ARG_CTX_SIZE": "64", "LLAMA_API_KEY": "k", "HF_TOKEN": "t",
           "MTMD_BACKEND_DEVICE": "x", "CUDA_VISIBLE_DEVICES": "0", "NOTE": "a\nLLAMA_ARG_N_PREDICT=5"}
    done = subprocess.run(sandbox.clean_exec(["env", "-0"]), env=env, capture_output=True, timeout=30, check=True)
    names = sorted(entry.split(b"=", 1)[0].decode() for entry in done.stdout.split(b"\0") if entry)
    assert "CUDA_VISIBLE_DEVICES" in names and "NOTE" in names
    assert not [name for name in names if sandbox.foreign_variable(name)]
    assert sandbox.clean_environment(env).keys() == {"PATH", "CUDA_VISIBLE_DEVICES", "NOTE"}
    # Every sandboxed unit hides /etc/llama.cpp and reads its user-level config in root's empty directory.
    lines = sandbox.properties(["/var/lib/llama-server"])
    assert f"InaccessiblePaths=-{sandbox.HIDDEN_CONFIG}" in lines
    assert f"Environment=XDG_CONFIG_HOME={sandbox.CONFIG_HOME}" in lines
    assert f"Environment=HOME={sandbox.CONFIG_HOME}" in lines
