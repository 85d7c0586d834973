"""Quality evals against any llama-server (or OpenAI-compatible endpoint): tasks as data, datasets
pinned by hash, three scorers, an async runner with resumable runs.

Modules: ``tasks`` (task files, questions), ``datasets`` (download, sha256, cache, lock file), ``runner``
(asking, answers.jsonl, run records, summaries), ``fanout`` (one task over several servers), ``remote`` (the
eval as a job on the host), ``target`` (the server asked and its provenance). The scorers run on both sides, so
they are host-side code: :mod:`rigctl.hostside.scorers` (GSM8K extraction, choice, request bodies, records,
summaries) and :mod:`rigctl.hostside.bfcl` (BFCL's AST checker and missed-call detector).

Run directory (``<results>/<host>/<run id>/``, see :mod:`rigctl.results`)::

    run.json        a RunRecord (:mod:`rigctl.results.record`) of kind "eval"
    answers.jsonl   one JSON object per answered question, appended and flushed as each completes

``run.json`` for evals (the one record shape, :mod:`rigctl.hostside.runrecord`): ``servers`` = one per
server that answered (a fan-out's several, each with its ``gpu``): {endpoint, label, build_info,
model_path, total_slots, n_ctx (from ``/props``), and for inventory servers name, host, unit, profile,
port, artifact and the argv as deployed (read from the host)}; ``artifacts`` = [{name, path, sha256,
manifest}] from the host's model manifest; ``task`` = {name, scorer, file, file_sha256, dataset_sha256:
{source key: sha256}, questions, request (gsm8k: which request produced the numbers, rigctl's or lm-eval's,
:meth:`rigctl.evals.tasks.Gsm8kTask.request_stamp`), instruments ({package: release} whose scoring the
numbers reproduce: lm-eval, bfcl-eval)}; ``seed``; ``concurrency``; ``extra`` = {thinking, limit, timeout_s,
summary, label_tokens (choice), resumed: [times], error (a failed or stopped run's reason), and for
bfcl_simple template_carries_tools ([bool] per server) and deviations ({from, settings, reason}, only when
the task departs from BFCL's own request)}. ``summary`` is
``{"sets": {set: block}, "overall": block + {"macro"}}`` with block = {n, score, cutoffs, and
lmeval_strict_match, lmeval_flexible_extract (gsm8k) or toolless, missed_calls (bfcl_simple)}.

``answers.jsonl`` keys, every scorer:

    id        question id, unique within its set (dataset id, or "<set>-<line number>")
    set       set name (the task name for gsm8k and bfcl_simple; the set for choice suites)
    score     1 or 0
    cutoff    true when the reply stopped on the token limit (finish_reason "length")

gsm8k adds: reply, reasoning (only with thinking on), finish_reason, tokens (completion tokens), gold,
number (the reply's last number, normalised, or null; ``score`` is rigctl's normalised match of it against
gold), and lm-eval 0.4's two scores as its gsm8k task computes them: lmeval_strict (the strict-match filter's
output, ``[invalid]`` when nothing matched) with lmeval_strict_match (0/1), lmeval_flexible with
lmeval_flexible_extract (0/1) (:data:`rigctl.hostside.scorers.GSM8K_SCORES` names the three).

bfcl_simple adds: reply (text content), reasoning, finish_reason, tokens, tool_calls ([{name, arguments}],
arguments parsed to an object when they are JSON), error and error_type (BFCL's checker; empty when
right), toolless (no tool call at all), missed_call (tool-less and the text looks like a call:
``tool_call``, ``<function``, or a JSON object with name and arguments/parameters).

choice adds: gold and pred (label texts; pred null when no label was in the server's top n), label_probs
({label: probability of its first token, or null when outside the top n}), label_mass (sum of the
seen label probabilities), top_token (the most probable next token, label or not).

Questions are answered exactly once per run: ``--resume`` skips every (set, id) already in
``answers.jsonl`` and cuts a torn last line before appending.
"""
