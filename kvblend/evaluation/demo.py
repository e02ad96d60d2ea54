"""`kvblend demo`: the whole product in one run, on the documents bundled with the package.

Ingests kvblend/data/docs into an archive, then answers a question that needs
two of the documents with `blend` and with `full`, and measures how close blend
stayed to full (first-token KL) and how much sooner its first token came. The
terminal rendering is the CLI's (kvblend.cli.query_cmds); progress leaves
through `on_stage`.
"""

from __future__ import annotations

from dataclasses import dataclass
from importlib.resources import files
from pathlib import Path
from typing import Any, Callable

from kvblend.defaults import DEFAULT_TOP_K
from kvblend.errors import UsageError
from kvblend.evaluation.metrics import kl_divergence
from kvblend.pipeline.engine import Engine
from kvblend.pipeline.results import IngestReport, QueryOptions, QueryResult

# Answerable only from two bundled documents (sonar-products.md names the plant, plants.md its manager).
DEMO_QUESTION = "Who manages the plant where the Tern-4 sonar is built?"
DEMO_ANSWERS = ["Ingrid Solberg"]

Stage = Callable[[str, Any], None]  # ("ingest", {docs, archive}) | ("ingested", IngestReport) | ("ask", {question, gold})


@dataclass
class DemoRun:
    """What the demo measured: the ingest, one answer per mode, and the JSON summary."""

    report: IngestReport
    results: dict[str, QueryResult]
    summary: dict


def demo_docs() -> Path:
    """The bundled documents, as a directory on disk (package data)."""
    docs = files("kvblend.data") / "docs"
    if not isinstance(docs, Path) or not docs.is_dir():
        raise UsageError(f"demo documents not found at {docs} (reinstall kvblend)")
    return docs


def run_demo(archive: Path, compute: str | None = None, on_stage: Stage | None = None) -> DemoRun:
    """Ingest the bundled documents into `archive`, then answer the demo question with full and blend."""
    notify = on_stage or (lambda _stage, _data: None)
    docs = demo_docs()
    with Engine(archive, None, compute) as engine:
        notify("ingest", {"docs": docs, "archive": archive})
        report = engine.ingest([docs])
        notify("ingested", report)
        notify("ask", {"question": DEMO_QUESTION, "gold": DEMO_ANSWERS})
        results = {mode: engine.query(DEMO_QUESTION, QueryOptions(mode=mode, top_k=DEFAULT_TOP_K))
                   for mode in ("full", "blend")}
        kl = kl_divergence(results["full"].fusion.last_logits, results["blend"].fusion.last_logits)
    summary = {
        "question": DEMO_QUESTION,
        "gold": DEMO_ANSWERS,
        "retrieved": [s.document for s in results["blend"].segments],
        "first_token_kl_blend_vs_full": kl,
        "results": {m: r.to_dict() for m, r in results.items()},
        "ttft_speedup": results["full"].ttft_s / results["blend"].ttft_s,
    }
    return DemoRun(report, results, summary)
