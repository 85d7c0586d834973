"""`rigctl eval kld`: KL divergence of quantised artifacts against their reference (bf16 or Q8_0) on a host,
with llama.cpp's own instrument, as a detached job.

A KLD spec names hosts, the reference artifact, the quantised artifacts and the text (a file on the controller,
shipped with the job and recorded by its sha256), and llama-perplexity's settings: the context (``ctx``: the
text is cut into chunks of this many tokens, scored over their second half), how many chunks (``chunks``: all
the text gives, by default), batch, threads and GPU layers. :func:`start_kld` starts one job per host through
:mod:`rigctl.jobs` running :mod:`rigctl.hostside.kld_task` (which says what runs, and what each raw file is),
under the host's ``gpu`` lock, with the host's llama-server instances stopped for it and started again after
(``stop_servers``, default on: a 4 GB card cannot hold a served model and a bf16 reference at once).

The reference's logits file is the one large thing a run writes on the host (``chunks * (ctx - 1 - ctx/2) *
(vocabulary + 4) * 2`` bytes: 25 MB a chunk at ``ctx: 512`` over a 49k vocabulary, 127 MB over 248k):
the job refuses before any pass when its bound is over ``max_logits_gib`` or the free space of the run
directory, and deletes the file however it ends; nothing of it is pulled.

What a pulled run says, with intervals: :mod:`rigctl.analysis.kld`.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pydantic import BaseModel, ConfigDict, Field, model_validator

from rigctl.errors import ConfigError, RigctlError
from rigctl.inputs import validated
from rigctl.inventory import Host, Inventory

if TYPE_CHECKING:  # rigctl.jobs brings paramiko
    from rigctl import jobs

#: The host-side module a KLD job runs (rigctl/hostside/kld_task.py).
KLD_TASK = "kld_task"
#: The name the text has in the job directory.
CORPUS_FILE = "corpus.txt"


class KldSpec(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    hosts: list[str] = Field(min_length=1)
    reference: str
    models: list[str] = Field(min_length=1)
    text: Path
    ctx: int = Field(default=512, ge=16, le=1 << 20)  # llama-perplexity's default
    chunks: int | None = Field(default=None, ge=1)  # none: all the text has
    batch: int | None = Field(default=None, ge=1)
    threads: int | None = Field(default=None, ge=1)
    ngl: int | None = Field(default=None, ge=0)  # none: llama.cpp's default
    stop_servers: bool = True
    max_logits_gib: float = Field(default=16.0, gt=0)
    pass_timeout_s: float = Field(default=3600.0, gt=0)

    @model_validator(mode="after")
    def _distinct(self) -> KldSpec:
        if self.reference in self.models:
            raise ValueError(f"the reference {self.reference!r} is also one of the models")
        if len(set(self.models)) != len(self.models):
            raise ValueError("models: an artifact is listed twice")
        return self


def parse_spec(data: Mapping[str, Any], origin: str) -> KldSpec:
    """A KLD spec from a mapping (the command line, a campaign); ConfigError naming the first bad key."""
    return validated(KldSpec, dict(data), origin)


def corpus_identity(path: Path) -> dict[str, Any]:
    """The text as the record names it: file name, sha256, bytes; ConfigError when it cannot be read."""
    try:
        data = path.read_bytes()
    except OSError as exc:
        raise ConfigError(f"KLD text {path}: {exc.strerror or exc}") from None
    if not data.strip():
        raise ConfigError(f"KLD text {path}: empty")
    return {"name": path.name, "sha256": hashlib.sha256(data).hexdigest(), "bytes": len(data)}


def llama_perplexity_path(host: Host) -> str:
    root = str(host.vars.get("llama_cpp_install_root") or "/opt/llama.cpp")
    return f"{root}/current/bin/llama-perplexity"


def kld_job_spec(host: Host, spec: KldSpec, corpus: Mapping[str, Any] | None = None) -> jobs.JobSpec:
    """The job that runs ``spec`` on ``host``; ConfigError when the host lacks one of the artifacts.
    ``corpus``: the text's :func:`corpus_identity`, when the caller has read it already."""
    from rigctl import jobs

    available = {a.name: a for a in host.artifacts}
    for name in [spec.reference, *spec.models]:
        if name not in available:
            raise ConfigError(f"host {host.name}: KLD artifact {name!r} is not an artifact of this host "
                              f"(it has: {', '.join(available) or 'none'})")
    corpus = corpus or corpus_identity(spec.text)
    params = {
        "llama_perplexity": llama_perplexity_path(host),
        "reference": {"name": spec.reference, "path": available[spec.reference].path},
        "models": [{"name": name, "path": available[name].path} for name in spec.models],
        "corpus": {"file": CORPUS_FILE, **corpus},
        "ctx": spec.ctx, "chunks": spec.chunks, "batch": spec.batch, "threads": spec.threads, "ngl": spec.ngl,
        "max_logits_bytes": int(spec.max_logits_gib * 2**30), "pass_timeout_s": spec.pass_timeout_s,
    }
    passes = 1 + 3 * len(spec.models)
    return jobs.JobSpec(kind="kld", task=KLD_TASK, params=params, lock="gpu",
                        files={CORPUS_FILE: spec.text}, max_runtime_s=int(passes * spec.pass_timeout_s + 600),
                        stop_servers=spec.stop_servers,
                        artifacts=tuple(available[n].path for n in [spec.reference, *spec.models]))


def start_kld(inventory: Inventory, spec: KldSpec) -> dict[str, jobs.JobInfo | RigctlError]:
    """One KLD job per host of the spec; per host its job or the error (a busy lock, a missing artifact).
    ConfigError when the text cannot be read."""
    from rigctl import jobs

    corpus = corpus_identity(spec.text)  # the text's problems are the command's, not each host's
    hosts = inventory.select(spec.hosts, where="the KLD's hosts (-H)")
    return jobs.start_each(hosts, lambda host: kld_job_spec(host, spec, corpus))
