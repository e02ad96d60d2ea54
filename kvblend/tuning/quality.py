"""``r_quality``: the smallest ratio whose answers stay close to full's on a calibration set.

The sweep runs through the benchmark harness (:class:`~kvblend.evaluation.harness.RecordRunner`),
so `tune` and `bench` judge blending with the same prompt template, decoding and
metrics. Each record's passages are prefilled alone (as the archive stores
them) and held in memory, or, for prompts made of the archive's own segments,
read back from it; ``full`` and ``reuse`` run once per record, then
``blend`` at each ratio against full's reference. Per ratio: mean first-token
KL from full, mean F1 vs gold (greedy), its drop from full's F1, and how often
the answer equals full's.

``reuse`` (no recompute) is the yardstick for the KL bound: an absolute KL
means little across models and prompt lengths, while "blend removes most of
reuse's deviation" does.

The calibration set ships with the package (``kvblend/data/calibration.json``)
and is read through :mod:`importlib.resources`, so it is found in a wheel install too.
"""

from __future__ import annotations

import os
import statistics
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from importlib.resources import as_file, files
from importlib.resources.abc import Traversable
from typing import TYPE_CHECKING, Any

from kvblend.defaults import DEFAULT_SELECT
from kvblend.errors import UsageError
from kvblend.evaluation.records import QARecord, load_records
from kvblend.evaluation.specs import RunRecord, RunSpec
from kvblend.prompt import MUSIQUE_TEMPLATE
from kvblend.tuning.delay import RatioQuality, passes_bounds
from kvblend.types import Segment

if TYPE_CHECKING:  # the harness imports torch: `tune`'s option checks and stored settings must not wait for it
    from kvblend.evaluation.harness import MemoryKV, RecordRunner, Reference

SWEEP_MAX_NEW_TOKENS = 16

FULL_IN_MEMORY = RunSpec("full", source="memory")
REUSE_IN_MEMORY = RunSpec("reuse", source="memory")

Log = Callable[[str], None]


def calibration_file() -> Traversable:
    """The bundled calibration set (MuSiQue schema), as package data."""
    return files("kvblend.data") / "calibration.json"


def load_calibration(path: str | os.PathLike[str] | None = None, limit: int | None = None) -> list[QARecord]:
    """The calibration records at `path`, else the bundled set; the first `limit`."""
    if path is not None:
        return load_records(path, limit, what="calibration set")
    with as_file(calibration_file()) as bundled:
        return load_records(bundled, limit, what="calibration set")


@dataclass
class QualitySweep:
    """What the sweep measured; ``kl_bound`` is ``kl_bound_vs_reuse × reuse_kl`` (None without a bound)."""

    records: int
    full_f1: float
    reuse_kl: float
    kl_bound: float | None
    by_ratio: dict[float, RatioQuality]
    skipped: list[float] = field(default_factory=list)  # never run: a larger ratio already failed
    seconds: float = 0.0

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["by_ratio"] = {f"{r:g}": asdict(q) for r, q in sorted(self.by_ratio.items())}
        return d

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> QualitySweep:
        by_ratio = {float(r): RatioQuality(**q) for r, q in d["by_ratio"].items()}
        return cls(
            d["records"],
            d["full_f1"],
            d["reuse_kl"],
            d.get("kl_bound"),
            by_ratio,
            [float(r) for r in d.get("skipped", [])],
            d.get("seconds", 0.0),
        )


@dataclass
class _Case:
    """A calibration record that fits the model, with full's reference and its in-memory KV."""

    index: int
    record: QARecord
    reference: Reference
    memory: MemoryKV
    full_f1: float


#: The stored KV of an archived segment, by key, as a cached prompt segment (None: unreadable, prefill instead).
ArchivedPassage = Callable[[str], Segment | None]


def _archived_memory(rec: QARecord, archived: ArchivedPassage | None) -> MemoryKV:
    """The record's passages with the KV the archive holds for them, when it names its segments and every one
    reads back whole; else nothing (the harness prefills the passages from their text)."""
    if archived is None or not rec.segment_keys:
        return {}
    segments = [archived(key) for key in rec.segment_keys]
    if any(s is None for s in segments):
        return {}
    return {REUSE_IN_MEMORY.sink: [s for s in segments if s is not None]}


def _references(
    rr: RecordRunner, records: Sequence[QARecord], log: Log, archived: ArchivedPassage | None = None
) -> tuple[list[_Case], list[float]]:
    """Full (the reference) and reuse on every record that fits; the cases and reuse's KLs."""
    from kvblend.evaluation.harness import PromptTooLong
    from kvblend.evaluation.metrics import f1_score

    cases, reuse_kls = [], []
    for n, rec in enumerate(records):
        memory = _archived_memory(rec, archived)
        try:
            ref, runs = rr.run(n, rec, [REUSE_IN_MEMORY], memory=memory)
        except PromptTooLong:
            log(f"record {n + 1}: prompt longer than the model's context; skipped")
            continue
        cases.append(_Case(n, rec, ref, memory, f1_score(ref.answer, rec.answers)))
        reuse_kls.append(next(r.kl_vs_full for r in runs if r.spec == REUSE_IN_MEMORY))
        log(f"full {n + 1}/{len(records)}: {len(ref.ids)} tokens, F1 {cases[-1].full_f1:.2f}")
    if not cases:
        raise UsageError("no calibration record fits the model's context")
    return cases, reuse_kls


def _ratio_quality(cases: list[_Case], runs: list[RunRecord], full_f1: float) -> RatioQuality:
    from kvblend.evaluation.metrics import exact_match, f1_score

    mean = statistics.fmean
    kls = [r.kl_vs_full for r in runs]
    f1s = [f1_score(r.answer, r.golds) for r in runs]
    # as bench's "EM vs full" and the demo count it ("Halifax." and "Halifax" are the same answer)
    same = [exact_match(r.answer, c.reference.answer) for c, r in zip(cases, runs)]
    return RatioQuality(
        f1_drop=full_f1 - mean(f1s), kl=mean(kls), f1=mean(f1s), kl_max=max(kls), same_as_full=mean(same)
    )


def measure_quality(
    runner,
    records: Sequence[QARecord],
    ratios: Sequence[float],
    max_new_tokens: int = SWEEP_MAX_NEW_TOKENS,
    check_layer: int | None = None,
    tolerance: float | None = None,
    kl_bound_vs_reuse: float | None = None,
    log: Log | None = None,
    select: str = DEFAULT_SELECT,
    archived: ArchivedPassage | None = None,
) -> QualitySweep:
    """Quality of `blend` at each ratio against `full` on calibration records (see the module doc).

    With `archived`, records that name their segments (tune's prompts made of the archive's passages) run on the
    KV the archive holds for them, as queries will, instead of a fresh prefill.

    With ``tolerance`` and ``kl_bound_vs_reuse`` the sweep saves work without
    changing :func:`~kvblend.tuning.delay.quality_floor`'s answer: ratios run
    from the largest down and stop after the first that fails (no smaller ratio
    can be the floor then). Ratios never run are listed in ``skipped``.
    """
    from kvblend.evaluation.harness import RecordRunner

    log = log or (lambda _msg: None)
    started = time.perf_counter()
    rr = RecordRunner(runner, MUSIQUE_TEMPLATE, max_new_tokens, answer_kl_tokens=0, reference_spec=FULL_IN_MEMORY)
    cases, reuse_kls = _references(rr, records, log, archived)
    full_f1 = statistics.fmean(c.full_f1 for c in cases)
    reuse_kl = statistics.fmean(reuse_kls)
    kl_bound = None if kl_bound_vs_reuse is None else kl_bound_vs_reuse * reuse_kl
    log(f"reuse: KL {reuse_kl:.4f}" + ("" if kl_bound is None else f" → KL bound {kl_bound:.4f}"))

    early_stop = tolerance is not None and kl_bound is not None
    results: dict[float, RatioQuality] = {}
    for r in sorted(ratios, reverse=True) if early_stop else list(ratios):
        layers = (check_layer,) if check_layer is not None else ()  # none: the policy's default
        spec = RunSpec("blend", r, check_layers=layers, source="memory", select=select)
        runs = [rr.run(c.index, c.record, [spec], reference=c.reference, memory=c.memory)[1][0] for c in cases]
        q = results[r] = _ratio_quality(cases, runs, full_f1)
        log(f"r={r:g}: KL {q.kl:.4f}, F1 {q.f1:.3f} (drop {q.f1_drop:+.3f}), same answer as full {q.same_as_full:.0%}")
        if tolerance is not None and kl_bound is not None and not passes_bounds(q, tolerance, kl_bound):
            break
    return QualitySweep(
        len(cases),
        full_f1,
        reuse_kl,
        kl_bound,
        dict(sorted(results.items())),
        [r for r in ratios if r not in results],
        time.perf_counter() - started,
    )
