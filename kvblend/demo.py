"""`kvblend demo`: the whole product in one run, on the bundled fixture documents.

Ingests fixtures/docs into an archive, then answers a question that needs two
of the documents with `blend` and with `full`, and shows answers, TTFTs and
how close blend stayed to full (first-token KL).
"""

from __future__ import annotations

import json
from pathlib import Path

from rich.console import Console
from rich.table import Table

from kvblend.errors import UsageError

FIXTURES = Path(__file__).resolve().parent.parent / "fixtures"


def fixtures_dir() -> Path:
    if not (FIXTURES / "docs").is_dir():
        raise UsageError(f"demo fixtures not found at {FIXTURES} (run from a kvblend checkout)")
    return FIXTURES


def run_demo(archive: Path, compute: str | None, as_json: bool, console: Console, err_console: Console) -> dict:
    from kvblend.engine import Engine, QueryOptions
    from kvblend.metrics import kl_divergence

    fixtures = fixtures_dir()
    question = json.loads((fixtures / "questions.json").read_text())[0]
    with Engine(archive, None, compute) as engine:
        err_console.print(f"[bold]1.[/] ingest {fixtures / 'docs'} → {archive}")
        report = engine.ingest([fixtures / "docs"])
        err_console.print(
            f"   {report.documents} documents, {report.segments_new} segments, {report.tokens_new:,} tokens "
            f"prefilled at {report.tokens_per_s:,.0f} tok/s, {report.compression_ratio:.2f}x compression"
        )
        err_console.print(f"[bold]2.[/] ask: {question['question']}  (gold: {question['answers'][0]})")
        results = {}
        for mode in ("full", "blend"):
            results[mode] = engine.query(question["question"], QueryOptions(mode=mode, top_k=6))
        kl = kl_divergence(results["full"].fusion.last_logits, results["blend"].fusion.last_logits)
    summary = {
        "question": question["question"],
        "gold": question["answers"],
        "retrieved": [s.document for s in results["blend"].segments],
        "first_token_kl_blend_vs_full": kl,
        "results": {m: r.to_dict() for m, r in results.items()},
        "ttft_speedup": results["full"].ttft_s / results["blend"].ttft_s,
    }
    if as_json:
        import sys

        sys.stdout.write(json.dumps(summary, indent=2) + "\n")
        return summary
    table = Table(title="blend vs full on the same archive")
    for col in ("mode", "answer", "TTFT", "recomputed", "KV load wait"):
        table.add_column(col)
    for mode, r in results.items():
        label = f"{mode} @ {r.ratio:.2f}" if r.ratio is not None else mode
        table.add_row(label, r.answer, f"{r.ttft_s * 1000:.0f} ms", f"{r.recompute_share:.0%}", f"{r.load_wait_s * 1000:.0f} ms")
    console.print(table)
    console.print(
        f"blend is {summary['ttft_speedup']:.1f}x faster to the first token; "
        f"first-token KL(full ‖ blend) = {kl:.4f}"
    )
    return summary
