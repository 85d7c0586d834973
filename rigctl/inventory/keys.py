"""Shapes of inventory values that the typed views, the schema and the fact probe share (standard library only,
so reading an inventory costs no pydantic): commit and sha256 patterns, and the variables that hold what a host
said about itself."""

from __future__ import annotations

import re

HEX_COMMIT = re.compile(r"^[0-9a-f]{7,40}$")
FULL_COMMIT = re.compile(r"^[0-9a-f]{40}$")
SHA256 = re.compile(r"^[0-9a-f]{64}$")
#: The longest text a host may report for one fact: longer than any GPU name, CPU brand string (48 bytes) or
#: os-release PRETTY_NAME shipped.
HOST_TEXT_MAX = 128
#: The variables :func:`rigctl.fleet.host_facts.inventory_vars` writes: facts, which rigctl reads as data and
#: never templates.
PROBED_KEYS = frozenset({"gpu_host_gpu", "gpu_host_gpus", "llama_cpp_cuda_architectures", "rigctl_host_facts"})
