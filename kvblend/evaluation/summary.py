"""Aggregating runs: :class:`BenchReport` and the per-spec means and percentiles in its tables.

F1 is against the gold answers (max over them); EM and ROUGE-L against full's
own answer on the same record, so "agrees with full" and "is right" stay
separate questions.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from kvblend.evaluation.metrics import exact_match, f1_score, percentile, rouge_l
from kvblend.evaluation.specs import RunRecord, RunSpec


@dataclass
class BenchReport:
    model: str
    machine: str
    command: str
    date: str
    records: int
    results: list[dict]
    variants: list[dict] | None = None
    settings: dict = field(default_factory=dict)
    runs: list[RunRecord] = field(default_factory=list)  # per record × run, for scripts
    full_answers: dict[int, str] = field(default_factory=dict)
    questions: list[str] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)
    pareto: list[dict] | None = None  # `--pareto`: per (policy, ratio) first-token KL and recompute share
    # per record, the passages its prompts were built from, in prompt order, as a query reports its segments'
    # provenance: {"document": the passage's title in the QA file, "pages", "section", "rows"} (a QA passage has none)
    sources: list[list[dict]] = field(default_factory=list)
    first_record: int = 0  # the first record's number in its dataset (bench --offset): records are named by it

    def per_record(self) -> list[dict]:
        """Every run's answer and numbers, record by record (for `--answers`, and eyeballing)."""
        return [
            {"record": self.first_record + i, "question": question, **self._record_runs(i)}
            for i, question in enumerate(self.questions)
        ]

    def _record_runs(self, i: int) -> dict[str, Any]:
        mine = [r for r in self.runs if r.record == i]
        return {
            "gold": mine[0].golds if mine else [],
            "sources": self.sources[i] if i < len(self.sources) else [],
            "runs": [
                {
                    "run": r.spec.label,
                    "mode": r.spec.mode,
                    "ratio": r.spec.ratio,
                    "answer": r.answer,
                    "f1": round(f1_score(r.answer, r.golds), 4),
                    "kl_vs_full": round(r.kl_vs_full, 6),
                    "answer_kl_vs_full": round(r.answer_kl_vs_full, 6),
                    "ttft_s": round(r.ttft_s, 4),
                    "recompute_share": round(r.recompute_share, 4),
                    "position_kls": [round(x, 6) for x in r.position_kls],
                    "diverges_at": r.diverges_at,
                    "stale_reading": r.stale.to_dict() if r.stale is not None else None,
                }
                for r in mine
            ],
        }

    def to_dict(self, answers: bool = False) -> dict:
        d = {
            "model": self.model,
            "machine": self.machine,
            "command": self.command,
            "date": self.date,
            "records": self.records,
            "settings": self.settings,
            "results": self.results,
        }
        if self.variants is not None:
            d["variants"] = self.variants
        if self.pareto is not None:
            d["pareto"] = self.pareto
        if self.warnings:
            d["warnings"] = self.warnings
        if answers:
            d["per_record"] = self.per_record()
        return d


def mean(xs: Sequence[float]) -> float:
    """The mean, NaN for nothing (a table cell shows "—" rather than the run failing)."""
    return sum(xs) / len(xs) if xs else math.nan


def summarize_spec(runs: Sequence[RunRecord], full_answers: dict[int, str]) -> dict:
    """Aggregate one spec's runs: means over records, TTFT median and p90."""
    if not runs:
        raise ValueError("no runs to summarize")
    spec = runs[0].spec
    ttfts = [r.ttft_s for r in runs]
    return {
        "mode": spec.mode,
        "ratio": spec.ratio,
        "f1": mean([f1_score(r.answer, r.golds) for r in runs]),
        "em_vs_full": mean([exact_match(r.answer, full_answers[r.record]) for r in runs]),
        "rouge_l_vs_full": mean([rouge_l(r.answer, full_answers[r.record]) for r in runs]),
        "kl_vs_full": mean([r.kl_vs_full for r in runs]),
        "answer_kl_vs_full": mean([r.answer_kl_vs_full for r in runs]),
        "ttft_median_s": percentile(ttfts, 50),
        "ttft_p90_s": percentile(ttfts, 90),
        "recompute_share": mean([r.recompute_share for r in runs]),
        "codec": spec.codec,
        **drift_summary(runs),
        **storage_summary(runs),
    }


def drift_summary(runs: Sequence[RunRecord]) -> dict:
    """Where along full's answer a spec drifts (teacher-forced on full's first tokens, issue 33).

    ``diverged_share``: the share of records where the spec's greedy token differs from full's at some forced
    position; ``first_divergence_median``: the median first such position over those records (None if none);
    ``kl_by_position``: the mean KL(full ‖ spec) at each position, over the records whose answers reach it.
    Over the diverging runs (kvblend.evaluation.drift): ``stale_mass_diverging`` and ``stale_mass_first``, the
    attention on stale KV at the diverging step and at the answer's first step; ``top_stale_share``, the share
    of the diverging step's most-read cached tokens left stale; ``top_overlap_first``, their overlap with the
    first step's (None where no run diverged or nothing was stale).
    """
    diverged = [r.diverges_at for r in runs if r.diverges_at is not None]
    width = max((len(r.position_kls) for r in runs), default=0)
    by_position = [mean([r.position_kls[i] for r in runs if i < len(r.position_kls)]) for i in range(width)]
    readings = [r.stale for r in runs if r.stale is not None]

    def over_readings(field: str) -> float | None:
        return mean([getattr(x, field) for x in readings]) if readings else None

    return {
        "diverged_share": len(diverged) / len(runs) if runs else math.nan,
        "first_divergence_median": percentile(diverged, 50) if diverged else None,
        "kl_by_position": [round(x, 6) for x in by_position],
        **{
            name: over_readings(field)
            for name, field in (
                ("stale_mass_diverging", "stale_mass"),
                ("stale_mass_first", "stale_mass_first"),
                ("top_stale_share", "top_stale_share"),
                ("top_overlap_first", "top_overlap_first"),
                ("stale_share", "stale_share"),
            )
        },
    }


def storage_summary(runs: Sequence[RunRecord]) -> dict:
    """What the spec's archived KV cost: bytes per token as stored, and how fast it streamed.

    ``read_MBps``: stored bytes per second of pread + checksum; ``decode_MBps``:
    KV (as fp16) per second of building layers from them (decompress,
    dequantize, widen, re-position); ``load_MBps``: both together. None where
    the runs read no passage KV (full, prefix).
    """
    stored, tokens = sum(r.stored_bytes for r in runs), sum(r.stored_tokens for r in runs)
    streams = [r.stream for r in runs if r.stream is not None]
    read_b, raw_b = sum(s.bytes_read for s in streams), sum(s.raw_bytes for s in streams)
    read_s, build_s = sum(s.read_s for s in streams), sum(s.build_s for s in streams)
    return {
        "bytes_per_token": stored / tokens if tokens else None,
        "read_MBps": read_b / read_s / 1e6 if read_s else None,
        "decode_MBps": raw_b / build_s / 1e6 if build_s else None,
        "load_MBps": raw_b / (read_s + build_s) / 1e6 if read_s + build_s else None,
    }


def summarize(
    runs: Sequence[RunRecord], full_answers: dict[int, str], specs: Sequence[RunSpec] | None = None
) -> list[dict]:
    """One summary per spec (in `specs` order, else first-seen order)."""
    by_spec: dict[RunSpec, list[RunRecord]] = {}
    for r in runs:
        by_spec.setdefault(r.spec, []).append(r)
    order = list(specs) if specs is not None else list(by_spec)
    return [summarize_spec(by_spec[s], full_answers) for s in order if s in by_spec]


def rounded(d: dict, digits: int = 6) -> dict:
    """Finite floats rounded, so JSON reports diff cleanly between runs."""
    return {k: (round(v, digits) if isinstance(v, float) and math.isfinite(v) else v) for k, v in d.items()}
