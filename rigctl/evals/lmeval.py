"""lm-eval's own GSM8K request: what lm-evaluation-harness sends for its ``gsm8k`` task, so that a score named
after lm-eval is lm-eval's on lm-eval's request, not on rigctl's.

Restated (not copied) from lm-eval 0.4.13: the task file (``lm_eval/tasks/gsm8k/gsm8k.yaml``, metadata
version 3.0), the request builder (``ConfigurableTask.fewshot_context`` and ``build_qa_turn`` in
``lm_eval/api/task.py``; ``Message`` and ``multiturn_to_singleturn`` in ``lm_eval/api/utils.py``), the few-shot
sampler (``ContextSampler`` in ``lm_eval/api/samplers.py``, seeded by the evaluator's ``fewshot_random_seed``)
and the chat endpoint's body (``LocalChatCompletion._create_payload`` in ``lm_eval/models/openai_completions.py``):

- a question reads ``Question: {question}\\nAnswer:``; an example is a train-split question answered with its
  whole answer field (the worked solution and ``#### n``);
- 5 examples per question, drawn by the default sampler: ONE ``random.Random(1234)`` for the whole run,
  ``sample(train split, 5)`` once per question, in the test split's order (``--limit N`` keeps the first N
  questions and so the first N draws); the train split is not the test split, so nothing is left out of a pool;
- as chat turns (``--apply_chat_template``, which turns ``fewshot_as_multiturn`` on): user ``Question: …\\nAnswer:``,
  assistant the answer, five times, then the question as the last user turn; with ``fewshot_as_multiturn`` off,
  one user turn holding the plain-text prompt: each example as ``Question: …\\nAnswer: <answer>\\n\\n``, then
  ``Question: …\\nAnswer:``;
- ``stop`` the task's ``until`` (lm-eval sends the first four; gsm8k has three), ``max_tokens`` 256
  (``max_gen_toks``, the model's default, since the task sets none), ``temperature`` 0, ``seed`` 1234.
"""

from __future__ import annotations

import random
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from rigctl.hostside.scorers import LMEVAL_STOP, LMEVAL_VERSION

#: The evaluator's ``fewshot_random_seed`` and the API model's ``seed``, both 1234 unless the user says otherwise.
LMEVAL_SEED = 1234
#: ``max_gen_toks`` of lm-eval's API models when the task sets none.
LMEVAL_MAX_GEN_TOKS = 256
#: How many of the task's stop sequences lm-eval's chat body carries (``stop[:4]``).
LMEVAL_STOP_SENT = 4


@dataclass(frozen=True)
class LmevalGsm8k:
    """One of lm-eval's GSM8K tasks as a request: its name, the shots, and how a question and its answer are
    written."""

    task: str
    num_fewshot: int
    stop: tuple[str, ...]
    question_template: str  # str.format over the record
    target_delimiter: str = " "
    fewshot_delimiter: str = "\n\n"

    def question(self, row: Mapping[str, Any]) -> str:
        return self.question_template.format(question=row["question"])

    @property
    def sent_stop(self) -> list[str]:
        return list(self.stop[:LMEVAL_STOP_SENT])

    def stamp(self, *, fewshot_as_multiturn: bool, seed: int) -> dict[str, Any]:
        """What a run record says of the request that produced its numbers."""
        return {"name": "lm-eval", "reproduces": f"lm-eval {LMEVAL_VERSION} {self.task}",
                "num_fewshot": self.num_fewshot, "fewshot_as_multiturn": fewshot_as_multiturn,
                "fewshot_seed": seed, "stop": self.sent_stop, "max_tokens": LMEVAL_MAX_GEN_TOKS}


GSM8K = LmevalGsm8k(task="gsm8k", num_fewshot=5, stop=LMEVAL_STOP, question_template="Question: {question}\nAnswer:")


def fewshot_draws(pool_size: int, questions: int, *, k: int, seed: int = LMEVAL_SEED) -> Iterator[list[int]]:
    """The pool indices of each question's examples, in question order: the default sampler's draws
    (``Random(seed).sample(pool, k)`` once per question; ``sample`` picks by position, so drawing positions
    draws the same rows)."""
    if k > pool_size:
        raise ValueError(f"{k} examples asked of a pool of {pool_size}")
    rnd = random.Random(seed)
    for _ in range(questions):
        yield rnd.sample(range(pool_size), k)


def chat_messages(spec: LmevalGsm8k, row: Mapping[str, Any], shots: Sequence[Mapping[str, Any]], *,
                  fewshot_as_multiturn: bool) -> list[dict[str, str]]:
    """The ``messages`` lm-eval sends for ``row`` with ``shots`` (records with ``question`` and ``answer``)."""
    turns = [(spec.question(shot), str(shot["answer"])) for shot in shots]
    if fewshot_as_multiturn:
        out = []
        for question, answer in turns:
            out += [{"role": "user", "content": question}, {"role": "assistant", "content": answer}]
        return out + [{"role": "user", "content": spec.question(row)}]
    return [{"role": "user", "content": completion_prompt(spec, row, shots)}]


def completion_prompt(spec: LmevalGsm8k, row: Mapping[str, Any], shots: Sequence[Mapping[str, Any]]) -> str:
    """The plain-text prompt (no chat template): each example, then the question."""
    examples = "".join(f"{spec.question(shot)}{spec.target_delimiter}{shot['answer']}{spec.fewshot_delimiter}"
                       for shot in shots)
    return examples + spec.question(row)
