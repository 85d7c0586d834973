"""Task files: YAML, validated with pydantic, turned into a list of questions.

A task names its scorer and its data; everything else has defaults::

    name: gsm8k
    scorer: gsm8k                 # gsm8k | bfcl_simple | choice
    dataset:                      # exactly one of hf / url / path
      hf: openai/gsm8k            # Hugging Face dataset repo ...
      revision: 1d2f...           # ... at a pinned revision ...
      file: main/test.jsonl       # ... and a file in it
      sha256: null                # unknown: the first download records it in the lock file
    prompt: "{question}"          # str.format over the record's fields
    max_tokens: 2048
    request: rigctl               # or lm-eval: lm-eval's own gsm8k request (then fewshot: the train split's source)

    name: suite
    scorer: choice
    sets:
      - name: boolq
        dataset: {url: https://.../dev.jsonl}
        prompt: "{passage}\\n\\nQuestion: {question}?\\nAnswer yes or no."
        gold: answer              # the record's field holding the gold value
        labels: {"true": "yes", "false": "no"}   # gold value (as text, lower case) -> label the model says

``bfcl_simple`` takes ``dataset`` (BFCL's questions: id, question, function) and ``answers`` (its possible
answers: id, ground_truth), joined by id. Shipped tasks live in ``rigctl/tasks/*.yaml``; ``load_task``
takes a shipped name or a path.
"""

from __future__ import annotations

import hashlib
import itertools
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated, Any, Literal, TypeVar

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from rigctl.errors import ConfigError, EvalError
from rigctl.evals import datasets, lmeval
from rigctl.evals.datasets import DatasetFile
from rigctl.hostside.bfcl import BFCL_EVAL_VERSION, BFCL_TEMPERATURE
from rigctl.hostside.scorers import LMEVAL_VERSION, gsm8k_gold
from rigctl.inputs import decode_utf8, dotted, error_line, parse_mapping

_Row = TypeVar("_Row")

TASKS_DIR = Path(__file__).resolve().parent.parent / "tasks"


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class Source(_Strict):
    hf: str | None = None
    revision: str | None = None
    file: str | None = None
    url: str | None = None
    path: str | None = None
    sha256: str | None = Field(default=None, pattern=r"^[0-9a-fA-F]{64}$")

    @model_validator(mode="after")
    def _one_kind(self) -> Source:
        kinds = [k for k in ("hf", "url", "path") if getattr(self, k)]
        if len(kinds) != 1:
            raise ValueError(f"give exactly one of hf, url, path (got {', '.join(kinds) or 'none'})")
        if self.hf and not (self.revision and self.file):
            raise ValueError("an hf source needs revision and file")
        if not self.hf and (self.revision or self.file):
            raise ValueError("revision and file belong to an hf source")
        return self

    def fetch(self, base: Path) -> DatasetFile:
        if self.hf:
            return datasets.fetch_hf(self.hf, self.revision or "", self.file or "", sha256=self.sha256)
        if self.url:
            return datasets.fetch_url(self.url, sha256=self.sha256)
        path = Path(self.path or "")
        # Resolved, so a run started from a relative task path records the file a resume finds again.
        return datasets.local_file((path if path.is_absolute() else base / path).resolve(), sha256=self.sha256)


class _TaskBase(_Strict):
    name: str = Field(pattern=r"^[A-Za-z0-9_.-]+$")
    description: str = ""
    limit: int | None = Field(default=None, ge=1)


class Gsm8kTask(_TaskBase):
    """``request: rigctl`` (the default) asks ``prompt`` zero-shot with ``max_tokens`` and no stop sequences;
    ``request: lm-eval`` sends the request of lm-eval's task ``lmeval_task`` (:mod:`rigctl.evals.lmeval`):
    ``gsm8k``, its prompt and five examples drawn from ``fewshot`` (the train split), or ``gsm8k_cot_llama``,
    its prompt and its task file's eight examples; as chat turns (or, with ``fewshot_as_multiturn: false``, as
    one user turn), with its stop sequences and its 256-token limit, and scored as that task scores. prompt,
    system and max_tokens are then lm-eval's and may not be set."""

    scorer: Literal["gsm8k"]
    dataset: Source
    id_field: str | None = None  # none: "<name>-<line number>"
    question_field: str = "question"
    answer_field: str = "answer"
    prompt: str = "{question}"
    system: str | None = None
    max_tokens: int = Field(default=2048, ge=1)
    request: Literal["rigctl", "lm-eval"] = "rigctl"
    lmeval_task: Literal["gsm8k", "gsm8k_cot_llama"] = "gsm8k"
    fewshot: Source | None = None
    fewshot_as_multiturn: bool = True

    @model_validator(mode="after")
    def _request_settings(self) -> Gsm8kTask:
        if self.request == "lm-eval":
            own = sorted({"prompt", "system", "max_tokens", "question_field"} & self.model_fields_set)
            if own:
                raise ValueError(f"request lm-eval sends lm-eval's own prompt and limits: remove {', '.join(own)}")
            fixed = bool(lmeval.LMEVAL_GSM8K[self.lmeval_task].examples)
            if self.fewshot is None and not fixed:
                raise ValueError("request lm-eval needs fewshot (the train split its examples are drawn from)")
            if self.fewshot is not None and fixed:
                raise ValueError(f"{self.lmeval_task} asks with its own examples: remove fewshot")
        elif {"fewshot", "fewshot_as_multiturn", "lmeval_task"} & self.model_fields_set:
            raise ValueError("fewshot, fewshot_as_multiturn and lmeval_task belong to request lm-eval")
        return self

    def request_stamp(self) -> dict[str, Any]:
        """Which request produced the task's numbers, as its run records say."""
        if self.request == "lm-eval":
            return lmeval.LMEVAL_GSM8K[self.lmeval_task].stamp(fewshot_as_multiturn=self.fewshot_as_multiturn,
                                                                seed=lmeval.LMEVAL_SEED)
        return {"name": "rigctl", "num_fewshot": 0, "max_tokens": self.max_tokens, "stop": []}


class BfclTask(_TaskBase):
    """BFCL's own request unless the task says otherwise: no system prompt, the description and float notes,
    temperature 0.001 and no token limit. Any other setting is a deviation the task must explain in
    ``deviation``; the run record and the report name it."""

    scorer: Literal["bfcl_simple"]
    dataset: Source
    answers: Source
    system: str | None = None
    max_tokens: int | None = Field(default=None, ge=1)
    temperature: float = Field(default=BFCL_TEMPERATURE, ge=0)
    bfcl_notes: bool = True
    deviation: str | None = Field(default=None, min_length=1)
    # A template that cannot carry tools is refused before the run, unless the task measures exactly that.
    allow_template_without_tools: bool = False

    @model_validator(mode="after")
    def _deviation_explained(self) -> BfclTask:
        departures = self.deviations()
        if departures and not self.deviation:
            raise ValueError(f"departs from BFCL's own request ({'; '.join(departures)}): say why under deviation")
        if self.deviation and not departures:
            raise ValueError("deviation given, but the request is BFCL's own")
        return self

    def deviations(self) -> list[str]:
        """How the request departs from BFCL's own, one phrase each."""
        out = []
        if self.system:
            out.append("a system prompt (BFCL: none)")
        if self.max_tokens is not None:
            out.append(f"max_tokens {self.max_tokens} (BFCL: no limit)")
        if self.temperature != BFCL_TEMPERATURE:
            out.append(f"temperature {self.temperature:g} (BFCL: {BFCL_TEMPERATURE:g})")
        if not self.bfcl_notes:
            out.append("no Python 3 and float notes in the function documents (BFCL: both)")
        return out


class ChoiceSet(_Strict):
    name: str = Field(pattern=r"^[A-Za-z0-9_.-]+$")
    dataset: Source
    prompt: str
    system: str | None = None
    gold: str
    labels: dict[str, str] = Field(min_length=2)
    id_field: str | None = None
    limit: int | None = Field(default=None, ge=1)


class ChoiceTask(_TaskBase):
    scorer: Literal["choice"]
    sets: list[ChoiceSet] = Field(min_length=1)
    n_probs: int = Field(default=100, ge=2)

    @model_validator(mode="after")
    def _unique_sets(self) -> ChoiceTask:
        names = [s.name for s in self.sets]
        duplicates = sorted({n for n in names if names.count(n) > 1})
        if duplicates:
            raise ValueError(f"set names must be unique: {', '.join(duplicates)}")
        return self


class TaskFile(BaseModel):
    task: Annotated[Gsm8kTask | BfclTask | ChoiceTask, Field(discriminator="scorer")]


Task = Gsm8kTask | BfclTask | ChoiceTask


@dataclass(frozen=True)
class Question:
    """One thing to ask: ``id`` unique in the task, ``set`` the set it belongs to (the task name for
    single-set tasks), ``data`` what its scorer needs."""

    id: str
    set: str
    data: dict[str, Any]


@dataclass
class LoadedTask:
    spec: Task
    path: Path
    file_sha256: str
    files: list[DatasetFile] = field(default_factory=list)
    questions: list[Question] = field(default_factory=list)

    @property
    def name(self) -> str:
        return self.spec.name

    @property
    def scorer(self) -> str:
        return self.spec.scorer

    @property
    def dataset_sha256(self) -> dict[str, str]:
        return {f.key: f.sha256 for f in self.files}

    @property
    def request(self) -> dict[str, Any]:
        """The chat request's settings (:func:`rigctl.hostside.scorers.chat_request`); empty for choice tasks."""
        spec = self.spec
        if isinstance(spec, BfclTask):
            return {"temperature": spec.temperature, "max_tokens": spec.max_tokens, "bfcl_notes": spec.bfcl_notes}
        if isinstance(spec, Gsm8kTask) and spec.request == "lm-eval":
            asked = lmeval.LMEVAL_GSM8K[spec.lmeval_task]
            return {"temperature": asked.temperature, "max_tokens": lmeval.LMEVAL_MAX_GEN_TOKS, "stop": asked.sent_stop}
        if isinstance(spec, Gsm8kTask):
            return {"temperature": 0.0, "max_tokens": spec.max_tokens}
        return {}

    @property
    def request_stamp(self) -> dict[str, Any] | None:
        """Which request produced the numbers (gsm8k: rigctl's or lm-eval's); None for the other scorers, whose
        request is their instrument's (a BFCL task's departures are its ``deviations``)."""
        return self.spec.request_stamp() if isinstance(self.spec, Gsm8kTask) else None

    @property
    def instruments(self) -> dict[str, str]:
        """The instrument releases whose scoring the numbers reproduce, by package name."""
        if isinstance(self.spec, Gsm8kTask):
            return {"lm-eval": LMEVAL_VERSION}
        if isinstance(self.spec, BfclTask):
            return {"bfcl-eval": BFCL_EVAL_VERSION}
        return {}

    @property
    def deviations(self) -> dict[str, Any] | None:
        """What the run record keeps of a task that departs from its instrument's own request, or None."""
        spec = self.spec
        if isinstance(spec, BfclTask) and spec.deviations():
            return {"from": "BFCL's own request", "settings": spec.deviations(), "reason": spec.deviation}
        return None


def set_names(task: Task) -> list[str]:
    """The sets a task's questions belong to (:class:`Question`'s ``set``): a single-set task's is its name."""
    return [s.name for s in task.sets] if isinstance(task, ChoiceTask) else [task.name]


def check_task_sets(names: Sequence[str], refs: Sequence[str], origin: str) -> None:
    """ConfigError naming ``origin`` when a set in ``names`` is a set of none of the tasks ``refs`` (shipped names or
    files: read and parsed, no dataset fetched)."""
    if not names:
        return
    sets = sorted({s for ref in refs for s in set_names(load_task(ref, fetch=False).spec)})
    unknown = [name for name in names if name not in sets]
    if unknown:
        raise ConfigError(f"{origin}: {', '.join(map(repr, unknown))}: no such set in the tasks "
                          f"{', '.join(dict.fromkeys(refs)) or 'none'} (sets: {', '.join(sets) or 'none'})")


def find_task(ref: str) -> Path:
    """A shipped task by name (``gsm8k``) or a task file by path."""
    path = Path(ref).expanduser()
    if path.suffix in {".yaml", ".yml"} or path.exists():
        if not path.is_file():
            raise EvalError(f"task file {path} does not exist")
        return path
    shipped = TASKS_DIR / f"{ref}.yaml"
    if shipped.is_file():
        return shipped
    known = ", ".join(sorted(p.stem for p in TASKS_DIR.glob("*.yaml"))) or "none"
    raise EvalError(f"task {ref!r}: no such task file or shipped task (shipped: {known})")


def parse_task(text: str, where: str) -> Task:
    data = parse_mapping(text, where, expected="a task file is a mapping", error=EvalError)
    try:
        return TaskFile(task=data).task
    except ValidationError as exc:
        raise EvalError(error_line(exc, where, whole="task", path=_task_key)) from None


def _task_key(loc: Sequence[Any]) -> str:
    """A task file's key path: below the wrapper's ``task`` key, without the scorer union's tags."""
    return dotted(p for p in loc[1:] if not str(p).startswith(("gsm8k", "bfcl", "choice")))


def load_task(ref: str, *, limit: int | None = None, fetch: bool = True) -> LoadedTask:
    """Parse the task file, fetch (or find in the cache) its datasets and build its questions.

    ``limit`` keeps the first N questions of each set (after the task's own limits)."""
    path = find_task(ref)
    raw = path.read_bytes()
    spec = parse_task(decode_utf8(raw, path, EvalError), str(path))
    loaded = LoadedTask(spec=spec, path=path, file_sha256=hashlib.sha256(raw).hexdigest())
    if fetch:
        _build(loaded, limit)
    return loaded


def _cap(rows: Iterable[_Row], *limits: int | None) -> Iterator[_Row]:
    """The first rows, as many as the smallest limit allows; read no further than that."""
    caps = [cap for cap in limits if cap is not None]
    return itertools.islice(rows, min(caps) if caps else None)


def _format(template: str, row: dict[str, Any], where: str) -> str:
    try:
        return template.format(**row)
    except KeyError as exc:
        raise EvalError(f"{where}: prompt names field {exc.args[0]!r}, which the record lacks "
                        f"(fields: {', '.join(sorted(row))})") from None
    except (IndexError, ValueError, AttributeError, TypeError) as exc:
        raise EvalError(f"{where}: prompt template {template!r}: {exc}") from None


def _field(row: dict[str, Any], name: str, where: str) -> Any:
    if name not in row:
        raise EvalError(f"{where}: record has no field {name!r} (fields: {', '.join(sorted(row))})")
    return row[name]


def _build(loaded: LoadedTask, limit: int | None) -> None:
    spec, base = loaded.spec, loaded.path.parent
    questions: list[Question] = []
    if isinstance(spec, Gsm8kTask):
        file = spec.dataset.fetch(base)
        loaded.files.append(file)
        rows = list(_cap(enumerate(datasets.iter_records(file.path), 1), spec.limit, limit))
        prompts = _lmeval_prompts(spec, loaded, [(f"{file.path}:{n}", row) for n, row in rows]) \
            if spec.request == "lm-eval" else None
        for index, (number, row) in enumerate(rows):
            where = f"{file.path}:{number}"
            qid = str(_field(row, spec.id_field, where)) if spec.id_field else f"{spec.name}-{number}"
            answer = str(_field(row, spec.answer_field, where))
            try:
                gold = gsm8k_gold(answer)
            except ValueError as exc:
                raise EvalError(f"{where}: {exc}") from None
            prompt = prompts[index] if prompts else _format(spec.prompt, row, where)
            questions.append(Question(qid, spec.name, {"prompt": prompt, "system": spec.system, "gold": gold,
                                                       "answer": answer, "lmeval_task": spec.lmeval_task}))
    elif isinstance(spec, BfclTask):
        file = spec.dataset.fetch(base)
        answers_file = spec.answers.fetch(base)
        loaded.files += [file, answers_file]
        answers = {str(_field(a, "id", str(answers_file.path))): a for a in datasets.iter_records(answers_file.path)}
        for row in _cap(datasets.iter_records(file.path), spec.limit, limit):
            qid = str(_field(row, "id", str(file.path)))
            where = f"{file.path}: {qid}"
            if qid not in answers:
                raise EvalError(f"{where}: no possible answer with this id in {answers_file.path}")
            turns = _field(row, "question", where)
            messages = turns[0] if turns and isinstance(turns[0], list) else turns
            functions = _field(row, "function", where)
            functions = functions if isinstance(functions, list) else [functions]
            truth = _field(answers[qid], "ground_truth", where)
            if len(functions) != 1 or not truth:
                raise EvalError(f"{where}: a simple task has one function and one ground truth call")
            function = functions[0]
            if not isinstance(function, dict) or not isinstance(function.get("name"), str) or not function["name"]:
                raise EvalError(f"{where}: function: needs a name (a non-empty string)")
            if not isinstance(function.get("parameters", {}), dict):
                raise EvalError(f"{where}: function {function['name']}: parameters must be a JSON object")
            questions.append(Question(qid, spec.name, {"messages": messages, "function": functions[0],
                                                       "system": spec.system,
                                                       "possible_answer": truth[0] if isinstance(truth, list)
                                                       else truth}))
    else:
        for choice_set in spec.sets:
            file = choice_set.dataset.fetch(base)
            loaded.files.append(file)
            labels = {str(k).lower(): v for k, v in choice_set.labels.items()}
            rows = enumerate(datasets.iter_records(file.path), 1)
            for number, row in _cap(rows, choice_set.limit, spec.limit, limit):
                where = f"{file.path}:{number}"
                gold_value = str(_field(row, choice_set.gold, where)).lower()
                if gold_value not in labels:
                    raise EvalError(f"{where}: gold value {gold_value!r} is not among the set's labels "
                                    f"({', '.join(labels)})")
                qid = str(_field(row, choice_set.id_field, where)) if choice_set.id_field else \
                    f"{choice_set.name}-{number}"
                questions.append(Question(qid, choice_set.name, {
                    "prompt": _format(choice_set.prompt, row, where), "system": choice_set.system,
                    "gold": labels[gold_value], "labels": sorted(set(labels.values()))}))
    if not questions:
        names = ", ".join(str(f.path) for f in loaded.files)
        raise EvalError(f"{loaded.path}: no questions: the datasets ({names}) have no records")
    seen: set[tuple[str, str]] = set()
    for question in questions:
        if (question.set, question.id) in seen:
            raise EvalError(f"{loaded.path}: question id {question.id!r} occurs twice in set {question.set!r}")
        seen.add((question.set, question.id))
    loaded.questions = questions


def _lmeval_prompts(spec: Gsm8kTask, loaded: LoadedTask,
                    rows: list[tuple[str, dict[str, Any]]]) -> list[list[dict[str, str]]]:
    """lm-eval's conversation for each question, in order: its task file's own examples, or examples drawn from
    the ``fewshot`` split the way its sampler draws them (:func:`rigctl.evals.lmeval.fewshot_draws`)."""
    asked = lmeval.LMEVAL_GSM8K[spec.lmeval_task]
    for where, row in rows:
        if not isinstance(row.get("question"), str):
            raise EvalError(f"{where}: lm-eval's request needs 'question' (a string)")
    if asked.examples:
        shots = [list(asked.examples[:asked.num_fewshot])] * len(rows)
    else:
        assert spec.fewshot is not None  # the task's validator requires it
        file = spec.fewshot.fetch(loaded.path.parent)
        loaded.files.append(file)
        pool = list(datasets.iter_records(file.path))
        for number, shot in enumerate(pool, 1):
            for key in ("question", "answer"):
                if not isinstance(shot.get(key), str):
                    raise EvalError(f"{file.path}:{number}: a few-shot example needs {key!r} (a string)")
        if len(pool) < asked.num_fewshot:
            raise EvalError(f"{file.path}: {len(pool)} few-shot examples; lm-eval's {asked.task} draws "
                            f"{asked.num_fewshot} per question")
        shots = [[pool[i] for i in drawn] for drawn in lmeval.fewshot_draws(len(pool), len(rows),
                                                                            k=asked.num_fewshot)]
    return [lmeval.chat_messages(asked, row, examples, fewshot_as_multiturn=spec.fewshot_as_multiturn)
            for (_, row), examples in zip(rows, shots, strict=True)]


def shipped_tasks() -> list[Path]:
    return sorted(TASKS_DIR.glob("*.yaml"))
