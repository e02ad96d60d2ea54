"""Judging blended answers against full prefill: the one harness behind `kvblend bench` and `kvblend tune`.

* :mod:`~kvblend.evaluation.metrics`: F1, EM, ROUGE-L, KL, percentiles.
* :mod:`~kvblend.evaluation.records`: :class:`QARecord` and :func:`load_records` (MuSiQue schema).
* :mod:`~kvblend.evaluation.harness`: runs every mode on every record, scored against full.
* :mod:`~kvblend.evaluation.drift`: what the answer step that leaves full's reads (stale KV or not).
* :mod:`~kvblend.evaluation.summary`: :class:`BenchReport`, means and percentiles per run.
* :mod:`~kvblend.evaluation.report` / :mod:`~kvblend.evaluation.plot`: markdown tables, the Pareto plot.
* :mod:`~kvblend.evaluation.demo`: `kvblend demo` — ingest the bundled documents, blend vs full.

Nothing is imported here: the CLI reads the records module at start-up without torch.
"""
