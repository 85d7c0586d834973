"""The schema of an upgrade's gates (``rigctl_upgrade_gates``, and a ``--gates`` file laid over it) and of the
llama-bench matrix they measure with: part of the inventory's schema, so ``inventory check`` refuses a misspelt
key or an absurd number as ``build upgrade`` and ``build bisect`` do, before anything is fetched or built.

What each section means is :mod:`rigctl.upgrade.gates`'s docstring. Every number has a ceiling no real
measurement reaches (a budget of 10^12 rounds is a typo that would run for ever) and every float must be
finite; what needs the host (its artifacts, the shipped tasks and prompt kinds) is checked where the host is
known (:func:`rigctl.upgrade.gates.check_gates`).
"""

from __future__ import annotations

from typing import Annotated, Any, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

#: The inventory variable with the fleet's gates.
GATES_VAR = "rigctl_upgrade_gates"

#: llama-bench's KV cache types (its -ctk/-ctv values).
CACHE_TYPES = ("f32", "f16", "bf16", "q8_0", "q4_0", "q4_1", "iq4_nl", "q5_0", "q5_1")
#: The bench's default cooldown: each cell starts at or below this GPU temperature.
DEFAULT_THRESHOLD_C = 40.0
#: Past any model's context (the longest are 10M tokens): a longer prompt or depth is a unit mistake.
MAX_TOKENS = 10_000_000
#: Past what any gate or bench would repeat (a day of cells, tens of thousands of questions).
MAX_REPEATS = 1000
MAX_QUESTIONS = 100_000
#: A day: longer than any cooldown wait or poll a bench needs.
MAX_SECONDS = 86_400.0

Tokens = Annotated[int, Field(ge=0, le=MAX_TOKENS)]
PromptLength = Annotated[int, Field(ge=1, le=MAX_TOKENS)]


class _Strict(BaseModel):
    # Finite floats only: a nan margin compares false with everything, an inf budget never ends.
    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)


class Matrix(_Strict):
    """llama-bench's matrix; lists run every combination (llama-bench's own comma lists)."""

    p: list[Tokens] = Field(default=[512], max_length=64)
    n: list[Tokens] = Field(default=[128], max_length=64)
    r: int = Field(default=5, ge=1, le=MAX_REPEATS)
    fa: list[Literal[0, 1]] = [1]
    ngl: list[Annotated[int, Field(ge=0, le=10_000)]] = Field(default=[99], max_length=64)
    t: list[Annotated[int, Field(ge=1, le=65_536)]] = Field(default=[], max_length=64)
    ctk: list[Literal[CACHE_TYPES]] = []  # type: ignore[valid-type]
    ctv: list[Literal[CACHE_TYPES]] = []  # type: ignore[valid-type]
    d: list[Tokens] = Field(default=[], max_length=64)
    b: list[Annotated[int, Field(ge=1, le=MAX_TOKENS)]] = Field(default=[], max_length=64)  # llama-bench -b
    ub: list[Annotated[int, Field(ge=1, le=MAX_TOKENS)]] = Field(default=[], max_length=64)  # llama-bench -ub

    def flags(self) -> dict[str, Any]:
        return self.model_dump()


class Cooldown(_Strict):
    threshold_c: float | None = Field(default=DEFAULT_THRESHOLD_C, gt=0, le=150)  # null: no gating
    timeout_s: float = Field(default=600.0, gt=0, le=MAX_SECONDS)
    poll_s: float = Field(default=2.0, gt=0, le=MAX_SECONDS)


class _Budgeted(_Strict):
    """A section measured ``BUDGET[0]`` times to start with and up to ``BUDGET[1]`` times while undecided:
    the most is never below the start."""

    BUDGET: ClassVar[tuple[str, str]]

    @model_validator(mode="after")
    def _budget(self) -> _Budgeted:
        start, most = self.BUDGET
        if getattr(self, most) < getattr(self, start):
            raise ValueError(f"{most} {getattr(self, most)} is below {start} {getattr(self, start)}")
        return self


class BenchGate(_Budgeted):
    BUDGET = ("rounds", "max_rounds")  # (start, most)

    # Test sizes and repetitions of every point; each deployed instance's point takes its profile's threads,
    # batch, ubatch, KV types, flash attention and ngl over them. Its other keys are an extra point.
    matrix: Matrix = Matrix(p=[512], n=[128], r=3)
    rounds: int = Field(default=2, ge=1, le=MAX_REPEATS)
    max_rounds: int = Field(default=6, ge=1, le=MAX_REPEATS)
    models: list[str] = Field(default=[], max_length=64)  # the extra point's; default: the first instance's artifact
    cooldown: Cooldown = Cooldown()  # each cell starts on a cool card, as every bench's
    stop_servers: bool = True  # the host's servers give the card up for the cells


class ServerGate(_Budgeted):
    BUDGET = ("repeats", "max_repeats")  # (start, most)

    @model_validator(mode="before")
    @classmethod
    def _no_stand_in(cls, data: Any) -> Any:
        # The old key measured one instance instead of the deployed ones: a regression tied to a setting the
        # named instance does not use passed every gate.
        if isinstance(data, dict) and "instance" in data:
            raise ValueError("instance: the gates measure every enabled instance at its own profile; one cannot "
                             "stand in for them (name instances to measure besides them in server.instances)")
        return data

    # Every enabled instance of the canary is measured at its own profile; these are measured besides them.
    instances: list[str] = Field(default=[], max_length=64)
    prompt_lengths: list[PromptLength] = Field(default=[128, 512], min_length=1, max_length=64)
    max_tokens: int = Field(default=64, ge=1, le=MAX_TOKENS)
    repeats: int = Field(default=3, ge=1, le=MAX_REPEATS)
    max_repeats: int = Field(default=9, ge=1, le=MAX_REPEATS)
    port_offset: int = Field(default=100, ge=1, le=10000)  # the candidate probe listens on the port plus this


class IdentityGate(_Strict):
    floor: float = Field(default=0.9, ge=0, le=1)
    max_tokens: int = Field(default=64, ge=1, le=MAX_TOKENS)
    kinds: list[str] = Field(default=[], max_length=64)  # prompt kinds of rigctl/bench/data/spec_prompts.yaml


class QualityGate(_Budgeted):
    BUDGET = ("limit", "max_limit")  # (start, most)

    task: str  # a shipped task's name or a task file
    limit: int = Field(default=50, ge=1, le=MAX_QUESTIONS)
    max_limit: int = Field(default=200, ge=1, le=MAX_QUESTIONS)
    margin: float = Field(default=5.0, gt=0, le=100)  # equivalence margin, points
    concurrency: int = Field(default=4, ge=1, le=256)


class Gates(_Strict):
    speed_margin: float = Field(default=0.95, gt=0, le=1)
    # rigctl.stats.DEFAULT_LEVEL (a unit test holds them equal): importing it would bring numpy into every
    # inventory load.
    level: float = Field(default=0.95, gt=0.5, lt=1)
    bench: BenchGate | None = BenchGate()
    server: ServerGate | None = ServerGate()
    identity: IdentityGate | None = IdentityGate()
    quality: QualityGate | None = None
    new_errors: int = Field(default=0, ge=0, le=1_000_000)
