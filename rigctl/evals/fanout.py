"""Fan-out: one eval run over several servers that serve the same artifact with the same build.

Each server is an inventory server (:func:`rigctl.evals.target.inventory_target`, its stamp read over
SSH); they may join one run only when the artifact's sha256 (from the model manifest on each host) and the
llama.cpp build (commit and build key from each host's build fact) are the same everywhere, so every
answer of the run comes from the same weights through the same code. The runner then deals the
questions to whichever server is free (:func:`rigctl.evals.runner.execute`) and the servers' own
``/props`` builds are checked once more when the run starts.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from rigctl.errors import ConfigError
from rigctl.evals.target import Target
from rigctl.llama_http import Endpoint


def _name(target: Target) -> str:
    return target.label


def _sha256(target: Target) -> str:
    artifacts = target.provenance().artifacts
    digest = artifacts[0].sha256 if artifacts else None
    if not digest:
        raise ConfigError(f"{_name(target)}: the sha256 of artifact {target.artifact!r} could not be "
                          "read from the host's model manifest; a fan-out needs it to know every server serves "
                          "the same file")
    return str(digest)


def _build(target: Target) -> tuple[str, str]:
    build = target.provenance().llama_cpp
    if not build.commit or not build.build_key:
        raise ConfigError(f"{_name(target)}: the llama.cpp build (commit and build key) could not be read from "
                          "the host; a fan-out needs it to know every server runs the same build")
    return build.commit, build.build_key


def check_same_artifact(targets: Sequence[Target]) -> None:
    """Refuse (ConfigError) unless every target serves the same artifact file with the same build."""
    if len(targets) < 2:
        return
    names = [_name(t) for t in targets]
    twice = sorted({n for n in names if names.count(n) > 1})
    if twice:
        raise ConfigError(f"a fan-out lists {', '.join(twice)} more than once")
    first = targets[0]
    digest, build = _sha256(first), _build(first)
    for other in targets[1:]:
        if _sha256(other) != digest:
            raise ConfigError(
                f"refusing a fan-out over different artifacts: {_name(first)} serves "
                f"{first.artifact} (sha256 {digest[:12]}), {_name(other)} serves "
                f"{other.artifact} (sha256 {_sha256(other)[:12]})")
        if _build(other) != build:
            raise ConfigError(
                f"refusing a fan-out over different llama.cpp builds: {_name(first)} runs {build[0]} "
                f"(build {build[1]}), {_name(other)} runs {_build(other)[0]} (build {_build(other)[1]})")


@dataclass(frozen=True)
class FanOut:
    """Several checked targets as the runner's arguments: the first one's stamp names the run (its host
    is the results directory), every server goes into the record's ``servers`` with its own GPU."""

    targets: tuple[Target, ...]

    @classmethod
    def of(cls, targets: Sequence[Target]) -> FanOut:
        if not targets:
            raise ConfigError("a fan-out needs at least one server")
        check_same_artifact(targets)
        return cls(tuple(targets))

    @property
    def first(self) -> Target:
        return self.targets[0]

    @property
    def endpoints(self) -> list[Endpoint]:
        return [t.endpoint for t in self.targets]


    def describe(self) -> str:
        return ", ".join(str(e) for e in self.endpoints)
