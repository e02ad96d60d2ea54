"""`kvblend ingest`, `kvblend query` and `kvblend demo`."""

from __future__ import annotations

import sys
import time
from pathlib import Path
from typing import List, Optional

import typer
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn
from rich.table import Table

from kvblend.cli.common import (
    ArchiveOpt,
    archive_dir_or_scratch,
    ComputeOpt,
    JsonOpt,
    ModelOpt,
    err,
    human_bytes,
    out,
    parse_check_layers,
    print_json,
    progress_enabled,
)
from kvblend.documents import read_user_text
from kvblend.errors import UsageError
from kvblend.generate import SamplingConfig


def register(app: typer.Typer) -> None:
    app.command()(ingest)
    app.command()(query)
    app.command()(demo)


def ingest(
    paths: List[Path] = typer.Argument(..., help="Files or directories (recursive) of text to archive."),
    chunk_tokens: int = typer.Option(512, "--chunk-tokens", help="Target segment size in tokens."),
    level: int = typer.Option(3, "--level", help="zstd compression level (1-22)."),
    codec: Optional[str] = typer.Option(None, "--codec", help="KV codec: zstd-shuffle (default) or zstd."),
    batch_tokens: int = typer.Option(4096, "--batch-tokens", help="Tokens prefilled per batch (memory vs throughput); each batch commits on its own."),
    wait: bool = typer.Option(False, "--wait", help="Wait for another writer instead of exiting."),
    archive: Optional[Path] = ArchiveOpt,
    model: Optional[str] = ModelOpt,
    compute: Optional[str] = ComputeOpt,
    as_json: bool = JsonOpt,
) -> None:
    """Split documents into segments, prefill each alone, and archive its per-layer KV."""
    from kvblend.archive_format import CODECS, DEFAULT_CODEC
    from kvblend.engine import Engine

    codec = codec or DEFAULT_CODEC
    if codec not in CODECS:
        raise UsageError(f"--codec must be one of {', '.join(CODECS)}")
    if not 1 <= level <= 22:
        raise UsageError("--level must be between 1 and 22")
    if batch_tokens < 1:
        raise UsageError("--batch-tokens must be at least 1")
    for p in paths:
        if not p.exists():
            raise UsageError(f"no such file or directory: {p}")
    with Engine(archive, model, compute) as engine:
        if progress_enabled(as_json):
            with Progress(
                TextColumn("[bold]ingest"), BarColumn(), MofNCompleteColumn(), TextColumn("docs"),
                TextColumn("{task.fields[rate]}"), TimeElapsedColumn(), TimeRemainingColumn(),
                console=err, transient=True,
            ) as bar:
                task = bar.add_task("ingest", total=None, rate="")
                started = time.perf_counter()

                def on_progress(p: dict) -> None:
                    rate = p["tokens"] / max(1e-9, time.perf_counter() - started)
                    bar.update(task, completed=p["documents"], total=p.get("total"), rate=f"{rate:,.0f} tok/s")

                report = engine.ingest(paths, chunk_tokens, codec, level, batch_tokens, wait_for_writer=wait,
                                       on_progress=on_progress)
        else:
            report = engine.ingest(paths, chunk_tokens, codec, level, batch_tokens, wait_for_writer=wait)
        on_disk = engine.archive().size_bytes()
    for s in report.skipped:
        err.print(f"[yellow]skipped[/] {s['path']}: {s['reason']}")
    if as_json:
        print_json({**report.to_dict(), "archive": str(engine.archive_path), "archive_bytes": on_disk})
        return
    out.print(
        f"{report.documents} documents ({report.documents_unchanged} unchanged), "
        f"{report.segments_new} segments new / {report.segments_reused} reused, "
        f"{report.tokens_total:,} tokens ({report.tokens_new:,} prefilled at {report.tokens_per_s:,.0f} tok/s); "
        f"wrote {human_bytes(report.bytes_written)}"
        + (f" (compression {report.compression_ratio:.2f}x vs fp16)" if report.bytes_written else "")
        + f"; archive {human_bytes(on_disk)} at {engine.archive_path}; {report.seconds:.1f}s"
    )


def _read_context_files(files: List[Path]) -> list[str]:
    texts = []
    for f in files:
        text = read_user_text(f, "context file")
        if not text.strip():
            raise UsageError(f"context file is empty: {f}")
        texts.append(text)
    return texts


def query(
    question: str = typer.Argument(..., help="The question."),
    mode: str = typer.Option("blend", "--mode", help="blend | full | reuse | prefix"),
    ratio: Optional[float] = typer.Option(None, "--ratio", help="Share of cached tokens recomputed (default: tuned, else 0.15)."),
    check_layers: Optional[str] = typer.Option(None, "--check-layers", help="e.g. 1 or 1,2,3 (gradual filtering)."),
    deviation: Optional[str] = typer.Option(None, "--deviation", help="HKVD measure: v, k or kv (default: v, chosen by `kvblend bench --variants`).", show_default=False),
    top_k: int = typer.Option(6, "--top-k", help="Segments to retrieve."),
    doc: List[str] = typer.Option([], "--doc", help="Pin a whole ingested document (repeatable, in order)."),
    segment: List[str] = typer.Option([], "--segment", help="Pin a segment by key (repeatable)."),
    context_file: List[Path] = typer.Option([], "--context-file", help="Extra passage from a file (computed unless archived)."),
    store: bool = typer.Option(False, "--store", help="Archive --context-file passages for next time."),
    system: Optional[str] = typer.Option(None, "--system", help="System prompt."),
    prefix_cache: bool = typer.Option(True, "--prefix-cache/--no-prefix-cache", help="Reuse the instruction prefix's exact KV from the archive (stored on first use)."),
    max_tokens: int = typer.Option(64, "--max-tokens", help="Maximum tokens to generate."),
    temperature: float = typer.Option(0.0, "--temperature", help="0 = greedy."),
    top_p: float = typer.Option(1.0, "--top-p"),
    seed: Optional[int] = typer.Option(None, "--seed"),
    verbose: bool = typer.Option(False, "--verbose", "-v", help="Timing table on stderr."),
    archive: Optional[Path] = ArchiveOpt,
    model: Optional[str] = ModelOpt,
    compute: Optional[str] = ComputeOpt,
    as_json: bool = JsonOpt,
) -> None:
    """Answer a question from archived segments: stream their KV, recompute HKVD tokens, generate."""
    from kvblend.engine import Engine, QueryOptions
    from kvblend.fusor import DEFAULT_DEVIATION
    from kvblend.prompt import PromptTemplate

    template = PromptTemplate() if system is None else PromptTemplate(system=system)
    opts = QueryOptions(
        mode=mode, ratio=ratio, check_layers=parse_check_layers(check_layers), deviation=deviation or DEFAULT_DEVIATION,
        top_k=top_k, docs=list(doc), segment_keys=list(segment), context_texts=_read_context_files(context_file),
        store_context=store, template=template, cache_prefix=prefix_cache,
        sampling=SamplingConfig(max_new_tokens=max_tokens, temperature=temperature, top_p=top_p, seed=seed),
    )
    opts.sampling.validate()
    with Engine(archive, model, compute) as engine:
        engine.archive(create=False)  # fail fast on a missing archive, before loading the model

        def stream(piece: str) -> None:
            sys.stdout.write(piece)
            sys.stdout.flush()

        result = engine.query(
            question, opts, on_token=None if as_json else stream,
            on_warning=lambda m: err.print(f"[yellow]warning:[/] {m}"),
        )
    if as_json:
        print_json(result.to_dict())
    else:
        sys.stdout.write("\n")
    if verbose:
        err.print(timing_table(result))


def timing_table(result) -> Table:
    t = result.timings
    table = Table(title=f"{result.mode}" + (f" @ {result.ratio:.2f}" if result.ratio is not None else ""), show_header=False)
    rows = [
        ("retrieval", f"{t['retrieval_s'] * 1000:.1f} ms"),
        ("model load (not in TTFT)", f"{t['model_load_s']:.2f} s"),
        ("KV load wait", f"{t['load_wait_s'] * 1000:.1f} ms"),
        ("recompute", f"{t['recompute_s'] * 1000:.1f} ms"),
        ("TTFT", f"{result.ttft_s * 1000:.1f} ms"),
        ("decode", f"{result.tokens_per_s:.1f} tok/s"),
        ("tokens recomputed / prompt", f"{result.recomputed_tokens} / {result.prompt_tokens} ({result.recompute_share:.1%} of full compute)"),
        ("segments", ", ".join(f"{s.key[:8]}{'' if s.cached else '*'}" for s in result.segments) + "  (* = computed)"),
        ("instruction prefix", "cached (exact, never recomputed)" if result.prefix_cached else "computed"),
    ]
    for k, v in rows:
        table.add_row(k, v)
    return table


def demo(
    keep: Optional[Path] = typer.Option(None, "--archive", "-a", help="Keep the demo archive here instead of a temp dir."),
    compute: Optional[str] = ComputeOpt,
    as_json: bool = JsonOpt,
) -> None:
    """Ingest the bundled fixture documents and answer a two-document question with blend and full."""
    from kvblend.demo import run_demo

    with archive_dir_or_scratch(keep, "kvblend-demo-") as (target, _scratch):
        run_demo(target, compute=compute, as_json=as_json, console=out, err_console=err)
