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

Its chat variant ``gsm8k_cot_llama`` (gsm8k-cot-llama.yaml, metadata version 4.0; run with
``--apply_chat_template --fewshot_as_multiturn``) asks ``Given the following problem, …\nProblem: {question}\n
Your response should end with "The final answer is [answer]" …\n`` with the task file's own eight examples, in
order (``sampler: first_n``), each answered with its worked ``target``, no delimiter between question and answer,
and sends the first four of its five stop sequences.
"""

from __future__ import annotations

import random
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from rigctl.hostside.scorers import LMEVAL_TASKS, LMEVAL_VERSION

#: The evaluator's ``fewshot_random_seed`` and the API model's ``seed``, both 1234 unless the user says otherwise.
LMEVAL_SEED = 1234
#: ``max_gen_toks`` of lm-eval's API models when the task sets none.
LMEVAL_MAX_GEN_TOKS = 256


@dataclass(frozen=True)
class LmevalGsm8k:
    """One of lm-eval's GSM8K tasks as a request: its name, the shots, and how a question and its answer are
    written."""

    task: str
    num_fewshot: int
    question_template: str  # str.format over the record
    target_delimiter: str = " "
    fewshot_delimiter: str = "\n\n"
    #: The task file's own examples, taken in order (``sampler: first_n``); empty: drawn from the train split.
    examples: tuple[Mapping[str, str], ...] = ()
    #: As the body carries it: the task's ``temperature: 0.0``, or the API model's default 0 where it sets none.
    temperature: float | int = 0

    def question(self, row: Mapping[str, Any]) -> str:
        return self.question_template.format(question=row["question"])

    @property
    def sent_stop(self) -> list[str]:
        """The stop sequences lm-eval's chat body carries (the scorer cuts at the same ones)."""
        return list(LMEVAL_TASKS[self.task].stop)

    def stamp(self, *, fewshot_as_multiturn: bool, seed: int) -> dict[str, Any]:
        """What a run record says of the request that produced its numbers."""
        return {"name": "lm-eval", "reproduces": f"lm-eval {LMEVAL_VERSION} {self.task}",
                "num_fewshot": self.num_fewshot, "fewshot_as_multiturn": fewshot_as_multiturn,
                **({} if self.examples else {"fewshot_seed": seed}), "stop": self.sent_stop,
                "max_tokens": LMEVAL_MAX_GEN_TOKS}


GSM8K = LmevalGsm8k(task="gsm8k", num_fewshot=5, question_template="Question: {question}\nAnswer:", temperature=0.0)


def _example(question: str, answer: str) -> Mapping[str, str]:
    return {"question": question, "answer": answer}


#: gsm8k_cot_llama's eight examples (the chain-of-thought exemplars of Wei et al., 2022), as its task file has them.
GSM8K_COT_LLAMA = LmevalGsm8k(
    task="gsm8k_cot_llama", num_fewshot=8, target_delimiter="",
    question_template='Given the following problem, reason and give a final answer to the problem.\nProblem: '
                      '{question}\nYour response should end with "The final answer is [answer]" where [answer] is '
                      'the response to the problem.\n',
    examples=(
        _example("There are 15 trees in the grove. Grove workers will plant trees in the grove today. After they "
                 "are done, there will be 21 trees. How many trees did the grove workers plant today?",
                 "There are 15 trees originally. Then there were 21 trees after some more were planted. So there "
                 "must have been 21 - 15 = 6. The final answer is 6"),
        _example("If there are 3 cars in the parking lot and 2 more cars arrive, how many cars are in the parking "
                 "lot?", "There are originally 3 cars. 2 more cars arrive. 3 + 2 = 5. The final answer is 5"),
        _example("Leah had 32 chocolates and her sister had 42. If they ate 35, how many pieces do they have left "
                 "in total?", "Originally, Leah had 32 chocolates. Her sister had 42. So in total they had 32 + 42 "
                 "= 74. After eating 35, they had 74 - 35 = 39. The final answer is 39"),
        _example("Jason had 20 lollipops. He gave Denny some lollipops. Now Jason has 12 lollipops. How many "
                 "lollipops did Jason give to Denny?", "Jason started with 20 lollipops. Then he had 12 after "
                 "giving some to Denny. So he gave Denny 20 - 12 = 8. The final answer is 8"),
        _example("Shawn has five toys. For Christmas, he got two toys each from his mom and dad. How many toys "
                 "does he have now?", "Shawn started with 5 toys. If he got 2 toys each from his mom and dad, "
                 "then that is 4 more toys. 5 + 4 = 9. The final answer is 9"),
        _example("There were nine computers in the server room. Five more computers were installed each day, "
                 "from monday to thursday. How many computers are now in the server room?", "There were "
                 "originally 9 computers. For each of 4 days, 5 more computers were added. So 5 * 4 = 20 "
                 "computers were added. 9 + 20 is 29. The final answer is 29"),
        _example("Michael had 58 golf balls. On tuesday, he lost 23 golf balls. On wednesday, he lost 2 more. How "
                 "many golf balls did he have at the end of wednesday?", "Michael started with 58 golf balls. "
                 "After losing 23 on tuesday, he had 58 - 23 = 35. After losing 2 more, he had 35 - 2 = 33 golf "
                 "balls. The final answer is 33"),
        _example("Olivia has $23. She bought five bagels for $3 each. How much money does she have left?",
                 "Olivia had 23 dollars. 5 bagels for 3 dollars each will be 5 x 3 = 15 dollars. So she has 23 - "
                 "15 dollars left. 23 - 15 is 8. The final answer is 8"),
    ))

#: lm-eval's GSM8K tasks rigctl can ask as lm-eval does, by name.
LMEVAL_GSM8K = {spec.task: spec for spec in (GSM8K, GSM8K_COT_LLAMA)}


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
