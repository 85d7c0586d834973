"""Full-size evals read their files a line at a time and keep only what scoring needs.

Answer files and datasets split at newline only (a reply may hold U+2028), a bad line is still one error
naming file, line and byte; resume cuts a torn tail from the file's end, however long the torn line; the
running tally gives the summary the answers give; a dataset is read only as far as the task's limit; a compare
of several runs reads each answers file once, and again only when it has changed.
"""

from __future__ import annotations

import json

import pytest
from handmade_runs import eval_run
from hypothesis import given, settings
from hypothesis import strategies as st

from rigctl.analysis import compare
from rigctl.errors import ConfigError, EvalError
from rigctl.evals import datasets
from rigctl.evals.runner import answered
from rigctl.evals.tasks import load_task
from rigctl.hostside.scorers import GSM8K_SCORES, Tally, summarise
from rigctl.results.store import ResultsStore, iter_jsonl, read_jsonl

ROW = {"id": "a", "set": "s", "score": 1}


def _line(row: dict) -> str:
    return json.dumps(row, ensure_ascii=False) + "\n"  # as the runner writes an answer


def test_a_reply_holding_line_separators_reads_back_whole(tmp_path):
    reply = "first\u2028second\u2029third\x85fourth"
    path = tmp_path / "answers.jsonl"
    path.write_text(_line({**ROW, "reply": reply}) + _line({**ROW, "id": "b"}), encoding="utf-8")
    assert [row["reply"] for row in read_jsonl(path)[:1]] == [reply]
    assert answered(path) == {("s", "a"), ("s", "b")}
    data = tmp_path / "data.jsonl"
    data.write_text(_line({"question": reply, "answer": "#### 1"}), encoding="utf-8")
    assert datasets.read_records(data) == [{"question": reply, "answer": "#### 1"}]


def test_a_bad_answer_line_is_one_error_naming_file_line_and_byte(tmp_path):
    path = tmp_path / "answers.jsonl"
    good = _line(ROW).encode()
    path.write_bytes(good + b'{"id": "b\xff", "set": "s", "score": 1}\n')
    with pytest.raises(ConfigError) as info:
        read_jsonl(path)
    assert str(info.value) == f"{path}:2: not UTF-8 text (byte {len(good) + 9}: b'\\xff')"
    path.write_bytes(good + b"[1]\n" + good)
    with pytest.raises(ConfigError, match=rf"^{path}:2: a list, not a JSON object$"):
        read_jsonl(path)
    with pytest.raises(ConfigError, match=r"missing\.jsonl: cannot read: No such file"):
        read_jsonl(tmp_path / "missing.jsonl")
    # A torn last line is left out; the rows before it come one at a time.
    path.write_bytes(good + good[:-5])
    rows = iter_jsonl(path)
    assert next(rows) == ROW
    assert list(rows) == []


@pytest.mark.parametrize("torn", [b'{"id": "b", "reply": "' + b"x" * 200_000, b"", b'{"id"'])
def test_answered_cuts_a_torn_tail_however_long(tmp_path, torn):
    path = tmp_path / "answers.jsonl"
    whole = _line(ROW).encode() * 3
    path.write_bytes(whole + torn)
    assert answered(path) == {("s", "a")}
    assert path.read_bytes() == whole
    path.write_bytes(b'{"id": "a", "set": "s", "sc')  # nothing whole at all
    assert answered(path) == set()
    assert path.read_bytes() == b""


def _reference_summary(rows: list[dict], scorer: str) -> dict:
    """The summary as the runner computed it before the tally: from every row at once."""

    def mean(values: list[float]) -> float | None:
        return sum(values) / len(values) if values else None

    def block(items: list[dict]) -> dict:
        out = {"n": len(items), "score": mean([float(r["score"]) for r in items]),
               "cutoffs": sum(1 for r in items if r.get("cutoff"))}
        if scorer == "gsm8k":
            out.update({k: mean([float(r.get(k, 0)) for r in items]) for k in GSM8K_SCORES if k != "score"})
        if scorer == "bfcl_simple":
            out["toolless"] = sum(1 for r in items if r.get("toolless"))
            out["missed_calls"] = sum(1 for r in items if r.get("missed_call"))
        return out

    sets: dict[str, list[dict]] = {}
    for row in rows:
        sets.setdefault(str(row["set"]), []).append(row)
    per_set = {name: block(items) for name, items in sorted(sets.items())}
    overall = block(rows)
    overall["macro"] = mean([s["score"] for s in per_set.values() if s["score"] is not None])
    return {"sets": per_set, "overall": overall}


ROWS = st.lists(st.fixed_dictionaries(
    {"id": st.text(max_size=3), "set": st.sampled_from(["boolq", "nli", "x"]), "score": st.sampled_from([0, 1, 0.5]),
     "cutoff": st.booleans(), "toolless": st.booleans(), "missed_call": st.booleans(),
     "lmeval_strict_match": st.sampled_from([0, 1]), "lmeval_flexible_extract": st.sampled_from([0, 1])}), max_size=40)


@settings(max_examples=60, deadline=None)
@given(rows=ROWS, scorer=st.sampled_from(["gsm8k", "bfcl_simple", "choice"]))
def test_the_tally_gives_the_summary_of_all_the_rows(rows, scorer):
    tally = Tally(scorer)
    for row in rows:
        tally.add(row)
    expected = _reference_summary(rows, scorer)
    assert json.dumps(tally.summary()) == json.dumps(expected)  # same keys, same order, same floats
    assert summarise(rows, scorer) == expected


def test_answered_tallies_what_it_reads(tmp_path):
    rows = [{"id": str(i), "set": "ab"[i % 2], "score": i % 3 == 0, "cutoff": i == 4} for i in range(9)]
    path = tmp_path / "answers.jsonl"
    path.write_text("".join(_line(r) for r in rows))
    tally = Tally("choice")
    assert len(answered(path, tally)) == 9
    assert tally.summary() == summarise(rows, "choice")


def test_a_dataset_is_read_only_as_far_as_the_limit(tmp_path):
    data = tmp_path / "data.jsonl"
    data.write_text("".join(_line({"question": f"q{i}", "answer": "#### 1"}) for i in range(3)) + "not json\n")
    (tmp_path / "t.yaml").write_text("name: t\nscorer: gsm8k\ndataset: {path: data.jsonl}\n")
    assert [q.id for q in load_task(str(tmp_path / "t.yaml"), limit=3).questions] == ["t-1", "t-2", "t-3"]
    with pytest.raises(EvalError, match=r"data\.jsonl:4: not a JSON line"):
        load_task(str(tmp_path / "t.yaml"))
    array = tmp_path / "array.json"
    array.write_text('\n\n  [{"a": 1},\n {"a": 2}]\n')
    assert datasets.read_records(array) == [{"a": 1}, {"a": 2}]
    array.write_text('\n[{"a": 1}, 2]\n')
    with pytest.raises(EvalError, match="record 1 is a int"):
        datasets.read_records(array)


def test_a_compare_of_several_runs_reads_each_answers_file_once(tmp_path, monkeypatch):
    rows = [{"id": f"q{i}", "set": "s", "score": i % 2, "reply": "r" * 50, "gold": "x"} for i in range(30)]
    for name in ("eval-a", "eval-b", "eval-c"):
        eval_run(tmp_path, "desktop", name, name, rows)
    store = ResultsStore(tmp_path)
    runs = [store.find(f"desktop/{name}") for name in ("eval-a", "eval-b", "eval-c")]
    reads: list[str] = []

    def counted(path):
        reads.append(path.parent.name)
        return iter_jsonl(path)

    monkeypatch.setattr(compare, "iter_jsonl", counted)
    compare._scored_answers.cache_clear()
    result = compare.compare_runs(runs, exclude=["s"], resamples=200)
    assert len(result.pairs) == 3
    assert sorted(reads) == ["eval-a", "eval-b", "eval-c"]
    kept = compare.scored_answers(runs[0])[0]
    assert kept == {"id": "q0", "set": "s", "score": 0, "reply": "r" * 50}  # no gold: not needed to compare
    with (runs[1].path / "answers.jsonl").open("a") as out:  # a changed file is read again
        out.write(_line({"id": "q30", "set": "s", "score": 1}))
    pair = compare.compare_runs(runs[:2], resamples=200).pairs[0]
    assert (pair.only_a, pair.only_b) == (0, 1)
    assert sorted(reads) == ["eval-a", "eval-b", "eval-b", "eval-c"]
