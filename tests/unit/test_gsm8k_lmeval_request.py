"""``request: lm-eval`` sends what lm-eval's own ``gsm8k`` and ``gsm8k_cot_llama`` tasks send, byte for byte.

``data/gsm8k_lmeval_requests.json`` pins the chat bodies lm-eval 0.4.13 POSTs for the fixture task's ten
questions (tests/fixtures/evals/tasks/fixture-gsm8k-lmeval.yaml: the ten fixture problems, gsm8k's few-shot
pool the first 22 rows of GSM8K's train split; gsm8k_cot_llama brings its own eight examples), with
``--apply_chat_template`` and ``fewshot_as_multiturn`` on (its default there) and off. They were captured from
lm-eval's own code end to end: its ``ConfigurableTask`` built from its installed task file (``gsm8k.yaml``,
``gsm8k-cot-llama.yaml``; the fixture rows given as the task's dataset), seeded as its evaluator
seeds it, its requests built with ``LocalChatCompletion.apply_chat_template`` and sent by
``LocalChatCompletion.generate_until`` to a loopback server that keeps each body. ``python
tests/unit/test_gsm8k_lmeval_request.py`` captures them again. rigctl's bodies are checked against the pins
always, and against a fresh capture where lm-eval can be imported. lm-eval and ``datasets`` are no dev
dependencies; to run the capture, install them into scratch directories and put both on ``PYTHONPATH``:
``pip install --target /tmp/lmeval --no-deps lm-eval==0.4.13`` and ``pip install --target /tmp/lmeval-deps
datasets sacrebleu evaluate tenacity aiohttp requests``.

rigctl's body differs from lm-eval's in two keys only: lm-eval names a ``model`` (llama-server serves one),
and rigctl sends ``chat_template_kwargs`` (its thinking switch; the study runs thinking off).
"""

from __future__ import annotations

import copy
import json
import shutil
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from hf_server import HfRepo, HfServer
from local_http import Handler, LocalServer

from rigctl.errors import EvalError
from rigctl.evals import lmeval
from rigctl.evals.runner import task_stamp
from rigctl.evals.tasks import load_task, parse_task
from rigctl.hostside import scorers

PINS = Path(__file__).parent / "data" / "gsm8k_lmeval_requests.json"
FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "evals"
TASK = FIXTURES / "tasks" / "fixture-gsm8k-lmeval.yaml"
TRAIN = FIXTURES / "hf" / "gsm8k_train.jsonl"
TEST = FIXTURES / "hf" / "gsm8k.jsonl"
RIGCTL_ONLY = {"chat_template_kwargs"}
LMEVAL_ONLY = {"model"}


@pytest.fixture
def hub(tmp_path, monkeypatch) -> Iterator[HfServer]:
    monkeypatch.setenv("RIGCTL_CACHE_DIR", str(tmp_path / "cache"))
    for name in ("RIGCTL_DATASET_LOCK", "RIGCTL_OFFLINE", "HF_HUB_OFFLINE"):
        monkeypatch.delenv(name, raising=False)
    root = tmp_path / "repo"
    shutil.copytree(FIXTURES / "hf", root)
    with HfServer(HfRepo("datasets/rigctl/eval-fixtures", "5f3c9a1e0b2d4c6e8f7a9b1c3d5e7f9a0b2c4d6e", root)) as server:
        monkeypatch.setenv("HF_ENDPOINT", server.endpoint)
        yield server


TASK_FILES = {"gsm8k": "gsm8k.yaml", "gsm8k_cot_llama": "gsm8k-cot-llama.yaml"}


def rigctl_task(lmeval_task: str, multiturn: bool, tmp_path: Path) -> Path:
    text = TASK.read_text(encoding="utf-8")
    if lmeval_task != "gsm8k":  # its own examples: no train split
        text = text.split("fewshot:")[0] + f"lmeval_task: {lmeval_task}\n"
    task = tmp_path / f"{lmeval_task}-{multiturn}.yaml"
    task.write_text(text + ("" if multiturn else "fewshot_as_multiturn: false\n"), encoding="utf-8")
    return task


def rigctl_bodies(lmeval_task: str, multiturn: bool, tmp_path: Path) -> list[dict[str, Any]]:
    loaded = load_task(str(rigctl_task(lmeval_task, multiturn, tmp_path)))
    return [scorers.chat_request(loaded.scorer, q.data, loaded.request) for q in loaded.questions]


def _same(ours: dict[str, Any], theirs: dict[str, Any]) -> None:
    assert set(ours) - RIGCTL_ONLY == set(theirs) - LMEVAL_ONLY
    for key in set(theirs) - LMEVAL_ONLY:
        # Compared as JSON text: the same strings in the same order, the same numbers of the same type.
        assert json.dumps(ours[key], ensure_ascii=False) == json.dumps(theirs[key], ensure_ascii=False), key


@pytest.mark.parametrize("multiturn", [True, False], ids=["multiturn", "one-turn"])
def test_rigctl_sends_lmevals_pinned_bodies(hub, tmp_path, multiturn):
    pins = json.loads(PINS.read_text(encoding="utf-8"))
    assert pins["lm_eval"] == scorers.LMEVAL_VERSION
    expected = pins["tasks"]["gsm8k"]["multiturn" if multiturn else "one_turn"]
    ours = rigctl_bodies("gsm8k", multiturn, tmp_path)
    assert len(ours) == len(expected) == 10
    for mine, theirs in zip(ours, expected, strict=True):
        _same(mine, theirs)
    turns = ours[0]["messages"]
    if multiturn:  # five examples as user/assistant pairs, then the question: what the pins hold, restated
        assert [m["role"] for m in turns] == ["user", "assistant"] * 5 + ["user"]
        assert turns[-1]["content"].startswith("Question: Tom has 3 boxes") and turns[-1]["content"].endswith(
            "\nAnswer:")
        assert turns[1]["content"].endswith("\n#### " + scorers.gsm8k_gold(turns[1]["content"]))
    else:
        assert len(turns) == 1 and turns[0]["content"].count("Question: ") == 6
        assert "\n\nQuestion: Tom has 3 boxes" in turns[0]["content"]
    assert ours[0]["stop"] == ["Question:", "</s>", "<|im_end|>"] and ours[0]["max_tokens"] == 256


@pytest.mark.parametrize("multiturn", [True, False], ids=["multiturn", "one-turn"])
def test_rigctl_sends_gsm8k_cot_llamas_pinned_bodies(hub, tmp_path, multiturn):
    expected = json.loads(PINS.read_text(encoding="utf-8"))["tasks"]["gsm8k_cot_llama"]
    ours = rigctl_bodies("gsm8k_cot_llama", multiturn, tmp_path)
    for mine, theirs in zip(ours, expected["multiturn" if multiturn else "one_turn"], strict=True):
        _same(mine, theirs)
    turns = ours[0]["messages"]
    assert len(turns) == (17 if multiturn else 1) and turns[-1]["content"].endswith("to the problem.\n")
    # The first four of its five stop sequences, as lm-eval sends them.
    assert ours[0]["stop"] == ["<|eot_id|>", "<|start_header_id|>user<|end_header_id|>", "Q:", "</s>"]


def test_each_question_draws_its_own_examples(hub):
    """One sampler for the run: the questions' example sets differ, and a limit keeps the first draws."""
    full = load_task(str(TASK))
    firsts = {q.data["prompt"][0]["content"] for q in full.questions}
    assert len(firsts) > 1
    three = load_task(str(TASK), limit=3)
    assert [q.data["prompt"] for q in three.questions] == [q.data["prompt"] for q in full.questions[:3]]


def test_the_record_names_the_request_and_the_instruments(hub):
    task = task_stamp(load_task(str(TASK), limit=2))
    assert task.request == {"name": "lm-eval", "reproduces": "lm-eval 0.4.13 gsm8k", "num_fewshot": 5,
                            "fewshot_as_multiturn": True, "fewshot_seed": 1234,
                            "stop": ["Question:", "</s>", "<|im_end|>"], "max_tokens": 256}
    assert task.instruments == {"lm-eval": "0.4.13"}
    assert set(task.dataset_sha256) == {f.key for f in load_task(str(TASK), limit=1).files} and \
        len(task.dataset_sha256) == 2
    own = task_stamp(load_task(str(FIXTURES / "tasks" / "fixture-gsm8k.yaml"), limit=1))
    assert own.request == {"name": "rigctl", "num_fewshot": 0, "max_tokens": 24, "stop": []}


@pytest.mark.parametrize(("extra", "message"), [
    ("request: lm-eval\nfewshot: {path: t.jsonl}\nprompt: 'Q: {question}'\n", "remove prompt"),
    ("request: lm-eval\nfewshot: {path: t.jsonl}\nmax_tokens: 512\n", "remove max_tokens"),
    ("request: lm-eval\n", "request lm-eval needs fewshot"),
    ("fewshot: {path: t.jsonl}\n", "belong to request lm-eval"),
    ("lmeval_task: gsm8k_cot_llama\n", "belong to request lm-eval"),
    ("request: lm-eval\nlmeval_task: gsm8k_cot_llama\nfewshot: {path: t.jsonl}\n", "its own examples: remove fewshot"),
    ("request: lm-eval\nlmeval_task: gsm8k_cot\n", "lmeval_task"),
    ("request: lm-eval-ish\nfewshot: {path: t.jsonl}\n", "request"),
])
def test_a_request_that_is_not_lmevals_is_refused(extra, message):
    with pytest.raises(EvalError, match=message):
        parse_task(f"name: g\nscorer: gsm8k\ndataset: {{path: q.jsonl}}\n{extra}", "t.yaml")


def test_a_pool_without_answers_is_one_error(tmp_path):
    (tmp_path / "train.jsonl").write_text('{"question": "q?"}\n' * 6)
    (tmp_path / "t.yaml").write_text(f"name: g\nscorer: gsm8k\nrequest: lm-eval\ndataset: {{path: {TEST}}}\n"
                                     "fewshot: {path: train.jsonl}\n")
    with pytest.raises(EvalError, match=r"train.jsonl:1: a few-shot example needs 'answer'"):
        load_task(str(tmp_path / "t.yaml"))


def test_draws_are_the_samplers():
    """The sampler's own call on the positions: what lm-eval's ``rnd.sample(docs, k)`` picks, by index."""
    import random

    rnd = random.Random(1234)
    docs = [f"doc{i}" for i in range(40)]
    theirs = [rnd.sample(docs, 5) for _ in range(4)]
    ours = [[docs[i] for i in drawn] for drawn in lmeval.fewshot_draws(40, 4, k=5)]
    assert ours == theirs


# ----------------------------------------------------------------------------------------------- lm-eval's own


def lmeval_bodies(lmeval_task: str, multiturn: bool) -> list[dict[str, Any]]:
    """The bodies lm-eval 0.4.13 POSTs for ``lmeval_task`` on the fixture rows (see the module docstring)."""
    import datasets
    import lm_eval
    import pyarrow
    import yaml
    from lm_eval.api.task import ConfigurableTask
    from lm_eval.models.openai_completions import LocalChatCompletion

    def rows(path: Path) -> list[dict[str, Any]]:
        return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines()]

    def dataset(**_metadata: Any) -> Any:
        # A fingerprint given, so datasets does not hash (pickle) the rows to make one.
        return datasets.DatasetDict({split: datasets.Dataset(pyarrow.Table.from_pylist(rows(path)), fingerprint=split)
                                     for split, path in (("train", TRAIN), ("test", TEST))})

    yaml_path = Path(lm_eval.__file__).parent / "tasks" / "gsm8k" / TASK_FILES[lmeval_task]
    config = yaml.safe_load(yaml_path.read_text(encoding="utf-8"))
    task = ConfigurableTask(config={**config, "custom_dataset": dataset})
    task.set_fewshot_seed(seed=lmeval.LMEVAL_SEED)  # the evaluator's fewshot_random_seed default

    bodies: list[dict[str, Any]] = []

    class Capture(LocalServer):
        def handler(self) -> type[Handler]:
            class Answer(Handler):
                server_requests = self.requests

                def do_POST(self) -> None:  # noqa: N802 (http.server's name)
                    bodies.append(json.loads(self.rfile.read(int(self.headers["Content-Length"]))))
                    reply = {"choices": [{"index": 0, "message": {"role": "assistant", "content": "#### 1"},
                                          "finish_reason": "stop"}]}
                    self.send_body(json.dumps(reply).encode(), "application/json")

            return Answer

    with Capture() as server:
        model = LocalChatCompletion(base_url=f"{server.base_url}/v1/chat/completions", model="m", max_retries=1)
        task.build_all_requests(apply_chat_template=True, fewshot_as_multiturn=multiturn,
                                chat_template=model.apply_chat_template)
        model.generate_until(copy.deepcopy(task.instances), disable_tqdm=True)
    # generate_until sends the longest first: put the bodies back in question order (each fixture question is
    # in one body's last message, and in no example).
    return [next(body for body in bodies if row["question"] in body["messages"][-1]["content"])
            for row in rows(TEST)]


def _lmeval_importable() -> bool:
    try:
        import datasets  # noqa: F401
        import lm_eval.api.task  # noqa: F401
        import lm_eval.models.openai_completions  # noqa: F401
    except ImportError:
        return False
    return True


@pytest.mark.skipif(not _lmeval_importable(), reason="lm-eval (with datasets) is not importable")
@pytest.mark.parametrize("lmeval_task", list(TASK_FILES))
@pytest.mark.parametrize("multiturn", [True, False], ids=["multiturn", "one-turn"])
def test_rigctl_sends_what_lmeval_sends(hub, tmp_path, lmeval_task, multiturn):
    import importlib.metadata

    assert importlib.metadata.version("lm_eval") == scorers.LMEVAL_VERSION
    theirs = lmeval_bodies(lmeval_task, multiturn)
    pins = json.loads(PINS.read_text(encoding="utf-8"))
    assert theirs == pins["tasks"][lmeval_task]["multiturn" if multiturn else "one_turn"]
    for mine, body in zip(rigctl_bodies(lmeval_task, multiturn, tmp_path), theirs, strict=True):
        _same(mine, body)


def _pin() -> None:
    import importlib.metadata

    out = {"lm_eval": importlib.metadata.version("lm_eval"),
           "tasks": {task: {"multiturn": lmeval_bodies(task, True), "one_turn": lmeval_bodies(task, False)}
                     for task in TASK_FILES}}
    PINS.write_text(json.dumps(out, ensure_ascii=False, indent=1) + "\n", encoding="utf-8")
    print(f"{PINS}: {', '.join(out['tasks'])}", file=sys.stderr)


if __name__ == "__main__":
    _pin()
