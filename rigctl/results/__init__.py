"""Run records and the results store.

Every run writes one directory, on the host while a job runs and on the controller after a pull, with
the same layout::

    <results root>/<host>/<run id>/run.json      the run record (:class:`rigctl.results.record.RunRecord`)
    <results root>/<host>/<run id>/<raw files>   llama-bench JSON, per-question JSONL, ...

``run.json`` lists every raw file with its sha256, so a pull can check what it copied and a report can
link every number to the file it came from. Eval runs write one JSON line per question to
``answers.jsonl`` (``ANSWERS_FILE``) with at least the keys ``id``, ``set``, ``score`` (0/1 or a float)
and ``cutoff``; scorers add their own keys.

* :mod:`.record`: the typed record and its provenance stamp (the shape is
  :mod:`rigctl.hostside.runrecord`'s, which jobs build on the host), read as untrusted input, and the
  reading of older records.
* :mod:`.stamp`: the stamp as the inventory knows it, completed by the host's one builder
  (:mod:`rigctl.hostside.stamp`: the server's argv as deployed among it) over SSH.
* :mod:`.run`: a run's lifecycle, :func:`rigctl.results.run.open_run`: the directory at once, the seal
  however the run ends (where a new run kind starts).
* :mod:`.store`: the controller's tree of runs.
"""
