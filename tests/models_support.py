"""Helpers the models role's unit and lab tests share: the gguf package's reading of a file, the tools venv."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

from make_hf_checkout import tools_python


def gguf_reader_summary(path: Path) -> dict:
    """Tensor count and tensors/bytes per type by the gguf package (in the tools venv)."""
    script = (
        "import json, sys, gguf\n"
        "r = gguf.GGUFReader(sys.argv[1])\n"
        "types = {}\n"
        "for t in r.tensors:\n"
        "    e = types.setdefault(t.tensor_type.name, {'tensors': 0, 'bytes': 0})\n"
        "    e['tensors'] += 1; e['bytes'] += int(t.n_bytes)\n"
        "print(json.dumps({'tensor_count': len(r.tensors), 'types': types}))\n"
    )
    out = subprocess.run([str(tools_python_cached()), "-c", script, str(path)], capture_output=True, text=True,
                         check=True, timeout=300)
    return json.loads(out.stdout)


def tools_python_cached() -> Path:
    from make_hf_checkout import cache_dir

    return tools_python(cache_dir())

