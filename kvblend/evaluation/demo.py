"""`kvblend demo`: the whole product in one run, on the documents and questions bundled with the package.

Ingests kvblend/data/docs into an archive, then asks a few of the bundled
two-hop questions (kvblend/data/questions.json; each needs two documents) with
`full`, `reuse` and `blend` on the same retrieved passages, and measures for
every answer how far its first-token distribution is from full's (KL) and how
soon it came (TTFT). The story a newcomer should see: reuse is fastest but
drifts from full, blend stays close to full at a fraction of its time. The
bundled model is tiny and often wrong *even with full*, so the yardstick is
agreement with full, not with the gold answer. The terminal rendering is the
CLI's (kvblend.cli.query_cmds); progress leaves through `on_stage`.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import asdict, dataclass
from importlib.resources import files
from pathlib import Path
from typing import Any

from kvblend.defaults import NATIVE_WEIGHTS
from kvblend.errors import UsageError
from kvblend.evaluation.metrics import kl_divergence, normalize_answer, rouge_l
from kvblend.options import Mode, QueryOptions, SamplingConfig
from kvblend.pipeline.engine import Engine
from kvblend.pipeline.results import IngestReport, QueryResult

DEMO_QUESTIONS = 6  # the first questions of questions.json: about two minutes on two cores, install aside
DEMO_MAX_TOKENS = 32  # the answers are a few words; decoding is not what the demo shows
DEMO_MODES = (Mode.full, Mode.reuse, Mode.blend)  # full first: the others are measured against it

Stage = Callable[[str, Any], None]  # ("ingest", {docs, archive}) | ("ingested", IngestReport) | ("ask", {...})


@dataclass
class DemoRow:
    """One mode's answer to one question, next to full's."""

    question: str
    gold: list[str]
    mode: str
    answer: str
    ttft_s: float
    recompute_share: float
    kl_vs_full: float  # first-token KL(full ‖ mode), nats; 0 for full itself
    same_as_full: bool  # the same answer text as full's (normalised)
    rouge_l_vs_full: float  # word overlap with full's answer (longest common subsequence F-measure)


@dataclass
class ModeSummary:
    """A mode over every demo question."""

    mode: str
    agreement: int  # answers the same as full's
    questions: int
    mean_rouge_l_vs_full: float
    mean_kl_vs_full: float
    mean_ttft_s: float
    speedup_vs_full: float  # full's mean TTFT / this mode's
    mean_recompute_share: float


@dataclass
class DemoRun:
    """What the demo measured: the ingest, every answer, and each mode over all questions."""

    report: IngestReport
    rows: list[DemoRow]
    modes: list[ModeSummary]

    def to_dict(self) -> dict[str, Any]:
        return {
            "ingest": self.report.to_dict(),
            "rows": [asdict(r) for r in self.rows],
            "modes": [asdict(m) for m in self.modes],
        }


def demo_docs() -> Path:
    """The bundled documents, as a directory on disk (package data)."""
    docs = files("kvblend.data") / "docs"
    if not isinstance(docs, Path) or not docs.is_dir():
        raise UsageError(f"demo documents not found at {docs} (reinstall kvblend)")
    return docs


def demo_questions(n: int = DEMO_QUESTIONS) -> list[dict[str, Any]]:
    """The first `n` bundled questions ({"question", "answers", "docs"})."""
    data = json.loads((files("kvblend.data") / "questions.json").read_text(encoding="utf-8"))
    return list(data[:n])


def run_demo(
    archive: Path, compute: str | None = None, on_stage: Stage | None = None, n_questions: int = DEMO_QUESTIONS
) -> DemoRun:
    """Ingest the bundled documents into `archive`, then ask the demo questions with every demo mode."""
    notify = on_stage or (lambda _stage, _data: None)
    docs = demo_docs()
    rows: list[DemoRow] = []
    sampling = SamplingConfig(max_new_tokens=DEMO_MAX_TOKENS)
    with Engine(archive, None, compute, weights=NATIVE_WEIGHTS) as engine:  # decode as `query` does with no profile
        notify("ingest", {"docs": docs, "archive": archive})
        report = engine.ingest([docs])
        notify("ingested", report)
        questions = demo_questions(n_questions)
        for i, item in enumerate(questions):
            notify("ask", {"index": i + 1, "total": len(questions), "question": item["question"]})
            results = {
                mode: engine.query(item["question"], QueryOptions(mode=mode, sampling=sampling)) for mode in DEMO_MODES
            }
            rows.extend(_rows(item, results))
    return DemoRun(report, rows, _summaries(rows))


def _rows(item: dict[str, Any], results: dict[Mode, QueryResult]) -> list[DemoRow]:
    full = results[Mode.full]
    return [
        DemoRow(
            item["question"],
            list(item["answers"]),
            str(mode),
            r.answer,
            r.ttft_s,
            r.recompute_share,
            kl_divergence(_logits(full), _logits(r)) if mode != Mode.full else 0.0,
            normalize_answer(r.answer) == normalize_answer(full.answer),
            rouge_l(r.answer, full.answer),
        )
        for mode, r in results.items()
    ]


def _logits(result: QueryResult) -> Any:
    assert result.fusion is not None, "an engine query reports its fusion"
    return result.fusion.last_logits


def _summaries(rows: list[DemoRow]) -> list[ModeSummary]:
    def mean(xs: list[float]) -> float:
        return sum(xs) / len(xs) if xs else 0.0

    full_ttft = mean([r.ttft_s for r in rows if r.mode == Mode.full])
    out = []
    for mode in DEMO_MODES:
        mine = [r for r in rows if r.mode == mode]
        ttft = mean([r.ttft_s for r in mine])
        out.append(
            ModeSummary(
                str(mode),
                sum(r.same_as_full for r in mine),
                len(mine),
                mean([r.rouge_l_vs_full for r in mine]),
                mean([r.kl_vs_full for r in mine]),
                ttft,
                full_ttft / ttft if ttft else 0.0,
                mean([r.recompute_share for r in mine]),
            )
        )
    return out
