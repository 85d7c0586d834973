"""``rigctl lab prepare``: the lab's slow one-time work, done into the controller's cache before any test
or demo, so that a per-test time limit bounds test work only.

A cold machine pays for two slow things: the lab's Debian base image (debootstrap) and the lab's
llama.cpp build (a from-source compile, minutes on two cores). Both land in the controller's cache:

1. **base image**: :meth:`rigctl.lab.rigs.Lab.ensure_base_image`.
2. **llama.cpp build**: the project's own roles, on the lab's first rig (brought up for the play and left
   as found): gpu_host, then llama_cpp, which fetches the pinned source archive onto the controller,
   checks its sha256, compiles through the lab's compiler cache (:attr:`rigctl.lab.rigs.LabConfig.compiler_cache`),
   smoke-tests the build and, as the lab builds each build key once (``llama_cpp_build_once``),
   publishes it in ``<cache>/builds/``, where every later provision of a lab rig copies it from; then
   models, which takes the lab's model out of its wheel into the cache.
3. **CUDA wheels**: NVIDIA's toolkit wheels the lab's inventory pins (``gpu_host_cuda_wheels``, when
   ``gpu_host_cuda_source`` is ``wheels``), fetched into ``<cache>/wheels/`` by the gpu_host role's own
   fetch (:func:`rigctl.hostside.sdist_fetch.fetch_wheel`, each checked against its pin), so the CUDA
   configure test and ``make cuda-check`` find them there and no test downloads anything.

What was prepared is recorded in ``<cache>/lab/prepared.json`` under a digest of what decides it (the
image's name and the build rig's ``llama_cpp_*`` and ``models_*`` variables). A second run that finds the
record, the image and the artifact with its recorded sha256 does nothing: seconds. Anything missing or
changed runs the step again, and the roles are idempotent, so a rerun after an interruption only
finishes what is missing.
"""

from __future__ import annotations

import hashlib
import json
import logging
import platform
import time
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rigctl.errors import LabError
from rigctl.files import write_atomically
from rigctl.hostside.sdist_fetch import SdistFetchError, fetch_wheel
from rigctl.inventory import Host, Inventory
from rigctl.lab.rigs import Lab

log = logging.getLogger(__name__)

#: The roles the build step runs: the toolchain, the build, the model file.
PREPARE_TAGS = ("gpu_host", "llama_cpp", "models")
#: Variables of the build rig whose values decide what the build step makes.
DECIDING_PREFIXES = ("llama_cpp_", "models_")
#: A cold compile on two busy cores; nothing else runs in the play.
PLAY_TIMEOUT_S = 3600


@dataclass(frozen=True)
class PreparedStep:
    """One step of :func:`prepare`: what it is, whether it was made now or found in the cache, how long."""

    name: str
    made: bool
    seconds: float
    detail: str


@dataclass(frozen=True)
class Prepared:
    """What ``prepared.json`` records: the digest of the deciding inputs and the build it led to."""

    digest: str
    build: str
    artifact: str
    artifact_sha256: str

    @classmethod
    def load(cls, path: Path) -> Prepared | None:
        """The record at ``path``; None when there is none or it is not one (it is then made again)."""
        try:
            data = json.loads(path.read_text())
            return cls(**{key: str(data[key]) for key in ("digest", "build", "artifact", "artifact_sha256")})
        except (OSError, ValueError, TypeError, KeyError):
            return None

    def save(self, path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        write_atomically(path, json.dumps(self.__dict__, indent=2, sort_keys=True) + "\n")


def deciding_digest(image_name: str, host_vars: Mapping[str, Any]) -> str:
    """sha256 over the base image's name and every ``llama_cpp_*``/``models_*`` variable of the build rig:
    a change to any of them (pin, archive, flags, targets, model source) prepares again. A superset of the
    role's build key on purpose: the key is the role's to derive, and a needless rerun only costs a
    no-op play."""
    deciding = {key: host_vars[key] for key in sorted(host_vars) if key.startswith(DECIDING_PREFIXES)}
    text = json.dumps({"image": image_name, "vars": deciding}, sort_keys=True, default=str)
    return hashlib.sha256(text.encode()).hexdigest()


def artifact_path(cache_dir: Path, build_name: str) -> Path:
    """Where the llama_cpp role publishes a build on the controller (its ``_llama_cpp_artifact``)."""
    return cache_dir / "builds" / f"{build_name}.tar.gz"


def file_sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def pin_path(artifact: Path) -> Path:
    """The controller's pin of a published build (the llama_cpp role's ``_llama_cpp_artifact_pin``): its
    sha256, without which no host takes the pack."""
    return artifact.with_name(artifact.name + ".sha256")


def is_prepared(record: Prepared, digest: str, cache_dir: Path) -> bool:
    """The record is for these inputs and its artifact is in the cache, byte for byte, with no other pin."""
    if record.digest != digest:
        return False
    artifact = cache_dir / record.artifact
    if not artifact.is_file() or file_sha256(artifact) != record.artifact_sha256:
        return False
    pin = pin_path(artifact)
    return not pin.exists() or pin.read_text(encoding="utf-8").strip() == record.artifact_sha256


def ensure_pin(record: Prepared, cache_dir: Path) -> None:
    """The pin of the record's artifact, from the record (this controller's own when it first made the
    artifact): a cache prepared before packs had pins gets one, never from what a host says."""
    pin = pin_path(cache_dir / record.artifact)
    if not pin.exists():
        write_atomically(pin, record.artifact_sha256 + "\n")


@contextmanager
def _timed(name: str, steps: list[PreparedStep], on_step: Callable[[PreparedStep], None] | None,
           ) -> Iterator[dict[str, Any]]:
    """Time one step; the block fills in ``made`` and ``detail``."""
    started = time.monotonic()
    outcome: dict[str, Any] = {"made": False, "detail": ""}
    yield outcome
    step = PreparedStep(name, bool(outcome["made"]), time.monotonic() - started, str(outcome["detail"]))
    steps.append(step)
    log.info("lab prepare: %s %s in %.1f s (%s)", name, "made" if step.made else "cached", step.seconds,
             step.detail)
    if on_step:
        on_step(step)


def prepare(
    inventory: Inventory,
    *,
    on_step: Callable[[PreparedStep], None] | None = None,
    on_task: Callable[[str], None] | None = None,
    on_event: Callable[[Any], None] | None = None,
) -> list[PreparedStep]:
    """Make what the lab needs into the controller's cache, or find it there; returns each step.

    ``on_step`` hears each finished step, ``on_task``/``on_event`` the build play's progress. Raises
    LabError when a step fails (the play's failure, one line); what the steps made stays cached.
    """
    lab = Lab.from_inventory(inventory)
    config = lab.config
    build_rig = _build_rig(inventory, lab)
    record_path = config.image_dir / "prepared.json"
    steps: list[PreparedStep] = []

    with _timed("base image", steps, on_step) as outcome:
        image = lab.ensure_base_image()
        outcome.update(made=image.built, detail=f"{image.path.name}, {image.size_bytes / 1e6:.0f} MB")

    digest = deciding_digest(image.path.name, build_rig.vars)
    with _timed("llama.cpp build", steps, on_step) as outcome:
        record = Prepared.load(record_path)
        if record is None or not is_prepared(record, digest, config.cache_dir):
            record = _build(inventory, lab, build_rig, digest, on_task, on_event)
            record.save(record_path)
            outcome["made"] = True
        ensure_pin(record, config.cache_dir)
        outcome["detail"] = f"{record.build} in {record.artifact}"

    wheels = build_rig.vars.get("gpu_host_cuda_wheels") or []
    if build_rig.vars.get("gpu_host_cuda_source") == "wheels" and wheels:
        with _timed("CUDA wheels", steps, on_step) as outcome:
            outcome.update(fetch_cuda_wheels(wheels, config.cache_dir / "wheels"))
    return steps


def fetch_cuda_wheels(wheels: list[dict[str, Any]], dest_dir: Path) -> dict[str, Any]:
    """Each pinned wheel into ``dest_dir`` (where the gpu_host role's controller-side fetch puts it),
    fetched only when no file there has its pinned sha256."""
    dest_dir.mkdir(parents=True, exist_ok=True)
    before = set(dest_dir.iterdir())
    for wheel in wheels:
        requirement = f"{wheel['name']}=={wheel['version']}"
        try:
            fetch_wheel(requirement, dest_dir, wheel["sha256"], machine=platform.machine())
        except SdistFetchError as exc:
            raise LabError(f"lab prepare: CUDA wheel {requirement}: {exc}") from None
    made = set(dest_dir.iterdir()) - before
    size = sum(path.stat().st_size for path in made)
    return {"made": bool(made), "detail": f"{len(wheels)} pinned wheels in {dest_dir}"
            + (f", {len(made)} fetched ({size / 1e6:.0f} MB)" if made else "")}


def _build_rig(inventory: Inventory, lab: Lab) -> Host:
    """The rig the build step provisions: the inventory's first enrolled lab rig."""
    for rig in lab.config.rigs:
        if rig.enrolled and rig.name in inventory.hosts:
            return inventory.host(rig.name)
    raise LabError("lab prepare: the inventory has no enrolled lab rig to build on")


def _build(inventory: Inventory, lab: Lab, rig: Host, digest: str, on_task: Callable[[str], None] | None,
           on_event: Callable[[Any], None] | None) -> Prepared:
    """Run the roles on ``rig`` (the lab up for it, left as found) and record the build they published.
    A failed play raises DeployError naming the host and task."""
    from rigctl.fleet.build import read_builds
    from rigctl.fleet.deploy import run_playbook

    with lab.up_while():
        run_playbook(inventory, "site.yml", limit=rig.name, tags=PREPARE_TAGS, timeout=PLAY_TIMEOUT_S,
                     on_task=on_task, on_event=on_event).raise_for_failures()
        current = read_builds(rig).current
    if current is None:
        raise LabError(f"lab prepare: {rig.name} has no current llama.cpp build after the play")
    artifact = artifact_path(lab.config.cache_dir, current.name)
    if not artifact.is_file():
        # The role publishes only a build it compiled or one a twin copied: a rig that already had the
        # build (a lab left up from before an emptied cache) publishes nothing.
        raise LabError(f"lab prepare: {rig.name} has build {current.name} but the controller's cache has no "
                       f"{artifact}; take the lab down (rigctl lab down) and prepare again")
    return Prepared(digest=digest, build=current.name, artifact=str(artifact.relative_to(lab.config.cache_dir)),
                    artifact_sha256=file_sha256(artifact))
