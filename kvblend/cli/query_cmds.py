"""`kvblend ingest`, `kvblend query` and `kvblend demo`: parsing and rendering only.

The workflows are kvblend.pipeline's; it is imported inside each command, after the
command's own checks, so that `kvblend --help`, the archive commands and a mistyped
flag never wait for torch to import.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path
from typing import Optional

import typer
from rich.markup import escape
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    TextColumn,
    TimeElapsedColumn,
    TimeRemainingColumn,
)
from rich.table import Table

from kvblend.cli.common import (
    ArchiveOpt,
    ComputeOpt,
    DtypeOpt,
    EagerOpt,
    JsonOpt,
    ModelOpt,
    WeightsOpt,
    archive_dir_or_scratch,
    compute_dtype,
    decode_settings,
    err,
    given_options,
    human_bytes,
    no_effect,
    open_existing,
    out,
    parse_check_layers,
    print_json,
    printable,
    progress_enabled,
)
from kvblend.conversion import has_visible_text
from kvblend.defaults import (
    DEFAULT_BATCH_TOKENS,
    DEFAULT_CHUNK_TOKENS,
    DEFAULT_DEVIATION,
    DEFAULT_LEVEL,
    DEFAULT_MAX_NEW_TOKENS,
    DEFAULT_MODE,
    DEFAULT_RATIO,
    DEFAULT_SELECT,
    DEFAULT_SINK,
    DEFAULT_TOP_K,
    MIN_FAST_LEVEL,
)
from kvblend.documents import read_user_text
from kvblend.errors import UsageError
from kvblend.options import (
    Codec,
    ComputeDtype,
    Deviation,
    Mode,
    PromptTemplate,
    QueryOptions,
    SamplingConfig,
    Select,
    Sink,
    WeightsFormat,
)
from kvblend.provenance import cite


def register(app: typer.Typer) -> None:
    app.command()(ingest)
    app.command()(query)
    app.command()(demo)


def ingest(
    paths: list[str] = typer.Argument(
        ...,
        help="Files or directories (recursive) to archive: text (any encoding), Markdown, JSON/JSONL, CSV/TSV, PDF, HTML, DOCX, PPTX, ODT, ODS, ODP, EPUB, XLSX, XML, e-mail (.eml, mailboxes), Jupyter notebooks (.ipynb), transcripts (.vtt, .srt); any of them gzip'd (.gz), or in a ZIP or tar archive.",
    ),
    chunk_tokens: int = typer.Option(DEFAULT_CHUNK_TOKENS, "--chunk-tokens", help="Target segment size in tokens."),
    level: int = typer.Option(
        DEFAULT_LEVEL,
        "--level",
        help="zstd compression level, 1-22; or -7..-1, zstd's fast mode: KV stored at about its raw size, but decoded several times faster (for hosts where decoding, not reading, delays the first token; see BENCHMARKS.md).",
    ),
    codec: Codec = typer.Option(
        Codec.lossless,
        "--codec",
        help="KV codec: lossless (= zstd-shuffle, the default), zstd, or the lossy int8 (~0.5x the bytes) / int4 (~0.3x); a lossy codec's segments get keys of their own.",
    ),
    batch_tokens: int = typer.Option(
        DEFAULT_BATCH_TOKENS,
        "--batch-tokens",
        help="Tokens prefilled per batch (memory vs throughput); each batch commits on its own.",
    ),
    wait: bool = typer.Option(False, "--wait", help="Wait for another writer instead of exiting."),
    dry_run: bool = typer.Option(
        False,
        "--dry-run",
        help="Write nothing: read and split the documents, and say what an ingest would prefill and store, with its size on disk and time estimated from a few segments prefilled here.",
    ),
    sink: Sink = typer.Option(
        Sink(DEFAULT_SINK),
        "--sink",
        help="Prefill each segment alone (none), or after a fixed sink whose KV is dropped, so no segment grows a false attention sink of its own: the chat template's first tokens (template) or the default template's whole instruction prefix (prefix, the default: best fidelity, see README). Segments get keys of their own; archives built either way answer queries, and ingesting a document again under another sink prefills it again.",
    ),
    archive: Optional[str] = ArchiveOpt,
    model: Optional[str] = ModelOpt,
    compute: Optional[str] = ComputeOpt,
    dtype: Optional[ComputeDtype] = DtypeOpt,
    as_json: bool = JsonOpt,
) -> None:
    """Split documents into segments, prefill each alone, and archive its per-layer KV."""
    if not (MIN_FAST_LEVEL <= level <= -1 or 1 <= level <= 22):
        raise UsageError(f"--level must be between 1 and 22, or {MIN_FAST_LEVEL} and -1 (fast mode)")
    if batch_tokens < 1:
        raise UsageError("--batch-tokens must be at least 1")
    if "" in paths:  # Path("") is the current directory: `ingest "$DOCS"` with DOCS unset would archive it
        raise UsageError("an empty path names no file or directory (an unset shell variable?)")
    files = [Path(p) for p in paths]
    for f in files:
        try:
            if not f.exists():
                raise UsageError(f"no such file or directory: {f}")
        except OSError as exc:  # under a folder this user may not search: Python 3.11's exists() raises
            raise UsageError(f"cannot read {f} ({(exc.strerror or type(exc).__name__).lower()})") from None
    from kvblend.pipeline import Engine  # after the checks: a usage error comes back before torch imports

    chosen = compute_dtype(dtype, archive, model, compute)
    if dry_run:
        _dry_run(files, chunk_tokens, codec, level, archive, model, compute, chosen, sink, as_json)
        return
    with Engine(archive, model, compute, chosen, sink=sink, weights="fp32") as engine:  # ingest never decodes
        if progress_enabled(as_json):
            with _files_bar("ingest", prefills=True) as bar:
                task = bar.add_task("ingest", total=None, rate="", current="")
                started = time.perf_counter()

                def on_progress(p: dict) -> None:  # the rate leaves out the model's load time
                    rate = p["tokens"] / max(1e-9, time.perf_counter() - started - engine.model_load_s)
                    bar.update(
                        task,
                        completed=p["files"],
                        total=p["total"],
                        rate=f"{rate:,.0f} tok/s" if p["tokens"] else "",
                        current=escape(p["current"][-40:]),  # the file being read (a PDF takes a moment)
                    )

                report = engine.ingest(
                    files,
                    chunk_tokens,
                    codec.canonical,
                    level,
                    batch_tokens,
                    wait_for_writer=wait,
                    on_progress=on_progress,
                )
        else:
            report = engine.ingest(files, chunk_tokens, codec.canonical, level, batch_tokens, wait_for_writer=wait)
        on_disk = engine.archive().size_bytes()
    for s in report.skipped:
        err.print(
            f"[yellow]skipped[/] {escape(printable(s['path']))}: {escape(s['reason'])}"
        )  # a name may hold "[bold]"
    if as_json:
        print_json({**report.to_dict(), "archive": str(engine.location), "archive_bytes": on_disk})
        return
    out.print(
        f"{report.documents} documents ({report.documents_unchanged} unchanged), "
        f"{report.segments_new} segments new / {report.segments_reused} reused, "
        f"{report.tokens_total:,} tokens ({report.tokens_new:,} prefilled at {report.tokens_per_s:,.0f} tok/s); "
        f"wrote {human_bytes(report.bytes_written)}"
        + (f" (compression {report.compression_ratio:.2f}x vs fp16)" if report.bytes_written else "")
        + f"; archive {human_bytes(on_disk)} at {engine.location}; {report.seconds:.1f}s"
        + (f" (model load {report.model_load_seconds:.1f}s)" if report.model_load_seconds else "")
        + (f"; {report.embeddings_restored} lost retrieval embeddings restored" if report.embeddings_restored else "")
    )
    if report.removed:
        err.print(_removed_line(report.removed, "removed"), markup=False)


def _removed_line(paths: list[str], verb: str) -> str:
    """The documents an ingest forgets (or would): those a JSON(L) file or an archive it read no longer holds."""
    shown = ", ".join(printable(p) for p in paths[:3]) + (" ..." if len(paths) > 3 else "")
    return f"{verb} {len(paths)} document{'s' if len(paths) != 1 else ''} their file no longer holds: {shown}"


def _files_bar(label: str, prefills: bool) -> Progress:
    """The bar an ingest (or its dry run) shows on a terminal: the files read of all of them, the time, and the
    file being read; an ingest also its prefill rate and the time left."""
    rate = [TextColumn("{task.fields[rate]}")] if prefills else []
    left = [TimeRemainingColumn()] if prefills else []
    return Progress(
        TextColumn(f"[bold]{label}"),
        BarColumn(),
        MofNCompleteColumn(),
        TextColumn("files"),
        *rate,
        TimeElapsedColumn(),
        *left,
        TextColumn("{task.fields[current]}"),
        console=err,
        transient=True,
    )


def _dry_run(
    paths: list[Path],
    chunk_tokens: int,
    codec: Codec,
    level: int,
    archive: Optional[str],
    model: Optional[str],
    compute: Optional[str],
    dtype: Optional[str],
    sink: Sink,
    as_json: bool,
) -> None:
    """`ingest --dry-run`: what an ingest would prefill and store, and what that would cost here."""
    from kvblend.pipeline import Engine

    with Engine(archive, model, compute, dtype, sink=sink, weights="fp32") as engine:
        if progress_enabled(as_json):
            with _files_bar("dry run", prefills=False) as bar:
                task = bar.add_task("dry run", total=None, current="")

                def on_progress(p: dict) -> None:
                    bar.update(task, completed=p["files"], total=p["total"], current=escape(p["current"][-40:]))

                plan = engine.plan_ingest(paths, chunk_tokens, codec.canonical, level, on_progress)
        else:
            plan = engine.plan_ingest(paths, chunk_tokens, codec.canonical, level)
    for s in plan.skipped:
        err.print(f"[yellow]skipped[/] {escape(printable(s['path']))}: {escape(s['reason'])}")
    if as_json:
        print_json({**plan.to_dict(), "archive": str(engine.location)})
        return
    out.print(
        f"dry run, nothing written: {plan.documents} documents ({plan.documents_unchanged} unchanged), "
        f"{plan.segments_new} segments new / {plan.segments_reused} reused, {plan.tokens_total:,} tokens "
        f"({plan.tokens_new:,} to prefill)"
    )
    if plan.would_remove:
        out.print(_removed_line(plan.would_remove, "would remove"), markup=False)
    if plan.tokens_new:
        per_token = plan.estimated_bytes / plan.tokens_new
        out.print(
            f"would store about {human_bytes(plan.estimated_bytes)} ({human_bytes(per_token)} a token with "
            f"--codec {codec.value}) and take about {_duration(plan.estimated_seconds)} at "
            f"{plan.prefill_tokens_per_s:,.0f} tok/s (measured on {plan.sample_tokens:,} of the tokens, prefilled here)"
        )
    if plan.disk_free_bytes is not None:
        where = escape(str(engine.location))
        if plan.fits:
            out.print(f"{human_bytes(plan.disk_free_bytes)} free where the archive is ({where})")
        else:
            err.print(
                f"[yellow]warning:[/] it would not fit: {human_bytes(plan.disk_free_bytes)} free where the archive "
                f"is ({where}); --codec int8 or int4 stores ~0.5x or ~0.3x the bytes, `kvblend gc` frees space"
            )


def _duration(seconds: float) -> str:
    """``42 s``, ``17 min``, ``3 h 05 min``: an estimate, shown as coarsely as it is known."""
    if seconds < 90:
        return f"{seconds:.0f} s"
    minutes = round(seconds / 60)
    return f"{minutes} min" if minutes < 90 else f"{minutes // 60} h {minutes % 60:02d} min"


def _ignored_options(ctx: typer.Context, opts) -> list[str]:
    """The options given on the command line that this query's other choices leave without effect, each a
    warning (it runs as asked, but a user who typed `--ratio 0.5 --mode prefix` should know the ratio did
    nothing)."""

    def given(*names: str) -> list[str]:
        return given_options(ctx, *names)

    notes = []
    if opts.mode != "blend" and (flags := given("ratio", "check_layers", "select", "deviation")):
        notes.append(no_effect(flags, f"with --mode {opts.mode}: only blend selects tokens to recompute"))
    elif opts.select in ("probe", "question") and given("deviation"):
        notes.append(
            f"--deviation has no effect with --select {opts.select}: only hkvd, heads and question+hkvd measure "
            "deviation"
        )
    if (opts.docs or opts.segment_keys) and given("top_k"):
        notes.append("--top-k has no effect with --doc or --segment: nothing is retrieved")
    if opts.store_context and not opts.context_texts:
        notes.append("--store has no effect without --context-file: it archives those passages")
    if opts.sampling.temperature == 0 and (flags := given("top_p", "seed")):
        notes.append(no_effect(flags, "at --temperature 0 (greedy)"))
    return notes


def _read_context_files(files: list[Path]) -> list[str]:
    texts = []
    for f in files:
        text = read_user_text(f, "context file", convert=True)
        if not has_visible_text(text):  # zero-width characters or colour codes alone: ingest's `empty` too
            raise UsageError(f"context file is empty: {f}")
        texts.append(text)
    return texts


def query(
    ctx: typer.Context,
    question: str = typer.Argument(..., help="The question."),
    mode: Mode = typer.Option(
        Mode(DEFAULT_MODE),
        "--mode",
        help="blend: cached KV, the tokens that matter recomputed; full: every token (the reference); reuse: cached KV as is; prefix: only a cached first segment reused.",
    ),
    ratio: Optional[float] = typer.Option(
        None, "--ratio", help=f"Share of cached tokens recomputed (default: tuned, else {DEFAULT_RATIO})."
    ),
    check_layers: Optional[str] = typer.Option(
        None,
        "--check-layers",
        help="Layers where blend selects tokens, e.g. 1 or 1,2,3 (gradual filtering); 0 only with --select probe, which chooses before any layer runs (default: 0 for probe, 1 for the other policies).",
    ),
    deviation: Deviation = typer.Option(
        Deviation(DEFAULT_DEVIATION), "--deviation", help="HKVD measure (chosen by `kvblend bench --variants`)."
    ),
    select: Select = typer.Option(
        Select(DEFAULT_SELECT),
        "--select",
        help="Blend's token selection (see README, 'Selection policies'); every policy recomputes the same budget.",
    ),
    top_k: int = typer.Option(DEFAULT_TOP_K, "--top-k", help="Segments to retrieve."),
    doc: list[str] = typer.Option([], "--doc", help="Pin a whole ingested document (repeatable, in order)."),
    segment: list[str] = typer.Option([], "--segment", help="Pin a segment by key (repeatable)."),
    context_file: list[Path] = typer.Option(
        [], "--context-file", help="Extra passage from a file (computed unless archived)."
    ),
    store: bool = typer.Option(False, "--store", help="Archive --context-file passages for next time."),
    system: Optional[str] = typer.Option(None, "--system", help="System prompt."),
    prefix_cache: bool = typer.Option(
        True,
        "--prefix-cache/--no-prefix-cache",
        help="Reuse the instruction prefix's exact KV from the archive (stored on first use).",
    ),
    max_tokens: int = typer.Option(DEFAULT_MAX_NEW_TOKENS, "--max-tokens", help="Maximum tokens to generate."),
    temperature: float = typer.Option(
        0.0, "--temperature", help="Sampling temperature, a finite number >= 0; 0 = greedy."
    ),
    top_p: float = typer.Option(
        1.0,
        "--top-p",
        help="Nucleus sampling: sample from the smallest set of tokens whose probability reaches this share, in (0, 1]; 1 = all (only with --temperature > 0).",
    ),
    seed: Optional[int] = typer.Option(
        None,
        "--seed",
        help="Random seed for sampling, 0 to 2^63-1, so a sampled answer can be repeated (default: random).",
    ),
    verbose: bool = typer.Option(False, "--verbose", "-v", help="Timing table on stderr."),
    archive: Optional[str] = ArchiveOpt,
    model: Optional[str] = ModelOpt,
    compute: Optional[str] = ComputeOpt,
    dtype: Optional[ComputeDtype] = DtypeOpt,
    weights: Optional[WeightsFormat] = WeightsOpt,
    enforce_eager: bool = EagerOpt,
    as_json: bool = JsonOpt,
) -> None:
    """Answer a question from archived segments: stream their KV, recompute HKVD tokens, generate."""
    if not has_visible_text(question):  # what ingest calls empty: nothing that shows
        raise UsageError("empty question")
    opts = QueryOptions(
        mode=mode,
        ratio=ratio,
        check_layers=parse_check_layers(check_layers),
        deviation=deviation,
        select=select,
        top_k=top_k,
        docs=tuple(doc),
        segment_keys=tuple(segment),
        context_texts=tuple(_read_context_files(context_file)),
        store_context=store,
        template=PromptTemplate() if system is None else PromptTemplate(system=system),
        cache_prefix=prefix_cache,
        sampling=SamplingConfig(max_new_tokens=max_tokens, temperature=temperature, top_p=top_p, seed=seed),
    ).validate()  # a usage error now, in a fraction of a second: before torch imports and the model loads
    with open_existing(archive) as ar:  # so is a missing or damaged archive, and a mistyped --doc or --segment
        for name in opts.docs:
            ar.find_document(name)
        for key in opts.segment_keys:
            ar.find_segment(key)
    notes = _ignored_options(ctx, opts)
    for note in notes:  # once the query will run: an error stays one line
        err.print(f"[yellow]warning:[/] {note}")
    from kvblend.pipeline import Engine

    chosen = compute_dtype(dtype, archive, model, compute)
    decode = decode_settings(weights, archive, model, compute, enforce_eager)
    with Engine(archive, model, compute, chosen, **decode) as engine:
        engine.archive(create=False)  # as queries use it: checked against the model, read-only if not writable

        started = False

        def stream(piece: str) -> None:
            nonlocal started
            if not started:  # the answer as --json and serve give it: without the whitespace that leads it
                piece = piece.lstrip()
                started = bool(piece)
            sys.stdout.write(piece)
            sys.stdout.flush()

        result = engine.query(
            question,
            opts,
            on_token=None if as_json else stream,
            on_warning=lambda m: err.print(f"[yellow]warning:[/] {escape(printable(m))}"),
        )
    if as_json:  # the warnings on stderr, in the JSON too: a script reading only it would miss them
        result.warnings[:0] = notes
        print_json(result.to_dict())
    else:
        sys.stdout.write("\n")
        sources = cite(result.segments)
        if sources:  # what the answer was drawn from: document, pages, section (none for --context-file passages)
            sys.stdout.write(f"Sources: {printable(sources)}\n")
        sys.stdout.flush()
    if verbose:
        err.print(timing_table(result))


def timing_table(result) -> Table:
    t = result.timings
    table = Table(
        title=f"{result.mode}" + (f" @ {result.ratio:.2f}" if result.ratio is not None else ""), show_header=False
    )
    rows = [
        ("retrieval", f"{t['retrieval_s'] * 1000:.1f} ms"),
        ("model load (not in TTFT)", f"{t['model_load_s']:.2f} s"),
        ("KV load wait", f"{t['load_wait_s'] * 1000:.1f} ms"),
        ("recompute", f"{t['recompute_s'] * 1000:.1f} ms"),
        ("TTFT", f"{result.ttft_s * 1000:.1f} ms"),
        ("decode", f"{result.tokens_per_s:.1f} tok/s ({result.weights} weights)"),
        (
            "tokens recomputed / prompt",
            f"{result.recomputed_tokens} / {result.prompt_tokens} ({result.recompute_share:.1%} of full compute)",
        ),
        ("segments", ", ".join(f"{s.key[:8]}{'' if s.cached else '*'}" for s in result.segments) + "  (* = computed)"),
        ("instruction prefix", "cached (exact, never recomputed)" if result.prefix_cached else "computed"),
    ]
    stages = result.stages
    if stages:  # where the fusion's time went: what the recompute share alone does not say
        total = sum(stages.values()) or 1.0
        rows.append(
            (
                "fusion stages",
                "  ".join(
                    f"{name} {sec * 1000:.0f} ms ({sec / total:.0%})"
                    for name, sec in sorted(stages.items(), key=lambda kv: -kv[1])
                ),
            )
        )
    for k, v in rows:
        table.add_row(k, v)
    return table


def _relative_speed(speedup: float) -> str:
    """How a mode's time to first token compares with full's: "4.5x faster", or "10.0x slower" where the mode
    lost (a GPU prefills a small model faster than the archive streams its KV), since "0.1x faster" reads as
    a gain."""
    if speedup >= 1 or speedup <= 0:
        return f"{speedup:.1f}x faster"
    return f"{1 / speedup:.1f}x slower"


def demo(
    keep: Optional[Path] = typer.Option(
        None, "--archive", "-a", help="Keep the demo archive here instead of a temp dir."
    ),
    compute: Optional[str] = ComputeOpt,
    as_json: bool = JsonOpt,
) -> None:
    """Ingest the bundled documents, then ask a few two-hop questions with full, reuse and blend side by side."""
    from kvblend.errors import ArchiveModelMismatchError
    from kvblend.evaluation.demo import run_demo

    with archive_dir_or_scratch(keep, "kvblend-demo-") as (target, _scratch):
        try:
            run = run_demo(Path(target), compute=compute, on_stage=_show_demo_stage)
        except ArchiveModelMismatchError as e:  # its "pass --model" hint: the demo has no --model
            why = str(e).partition(" (")[0]
            raise ArchiveModelMismatchError(
                f"{why} (the demo runs the bundled default model: give it another --archive, or none)"
            ) from None
    if as_json:
        print_json(run.to_dict())
        return
    out.print(_demo_table(run))
    for m in run.modes:
        if m.mode == "full":
            continue
        out.print(
            f"[bold]{m.mode}[/]: first-token KL from full {m.mean_kl_vs_full:.3f} on average, the same answer "
            f"as full on {m.agreement}/{m.questions} questions (word overlap {m.mean_rouge_l_vs_full:.0%}), "
            f"{_relative_speed(m.speedup_vs_full)} to the first token ({m.mean_recompute_share:.0%} of full's compute)"
        )
    out.print(
        "[dim]The bundled model is tiny and often wrong even with full prefill: what kvblend promises is "
        "blend's closeness to full (low KL, same answers) at a fraction of full's time to first token.[/]"
    )
    if any(m.mode != "full" and 0 < m.speedup_vs_full < 1 for m in run.modes):
        out.print(
            "[dim]Here full prefill was faster than reusing cached KV: a fast device (a GPU) prefills this 135M "
            "model's few thousand tokens in tens of milliseconds, less than streaming and placing the cached KV "
            'costs (BENCHMARKS.md, "On an H100"). Reuse pays where prefill is expensive: larger models, longer '
            "prompts, CPUs.[/]"
        )


def _demo_table(run) -> Table:
    table = Table(
        title="the same retrieved passages, three ways",
        caption="KL: first-token KL(full ‖ mode) in nats. ≈ full: the same answer, else its word overlap "
        "with full's (ROUGE-L).",
        caption_justify="left",
    )
    for col, ratio in (("question", 2), ("mode", None), ("answer", 3)):
        table.add_column(col, justify="left", overflow="fold", ratio=ratio, no_wrap=ratio is None)
    for col in ("TTFT", "KL", "≈ full"):
        table.add_column(col, justify="right", no_wrap=True)
    last = None
    for r in run.rows:
        question = "" if r.question == last else f"{r.question}\n[dim]gold: {r.gold[0]}[/]"
        table.add_row(
            question,
            r.mode,
            r.answer,
            f"{r.ttft_s * 1000:.0f} ms",
            "—" if r.mode == "full" else f"{r.kl_vs_full:.3f}",
            "—" if r.mode == "full" else ("same" if r.same_as_full else f"{r.rouge_l_vs_full:.0%}"),
            end_section=r.mode == run.modes[-1].mode,
        )
        last = r.question
    return table


def _show_demo_stage(stage: str, data) -> None:
    """The demo's progress lines, on stderr."""
    if stage == "ingest":
        err.print(f"[bold]1.[/] ingest {data['docs']} → {data['archive']}")
    elif stage == "ingested":
        err.print(
            f"   {data.documents} documents, {data.segments_new} segments, {data.tokens_new:,} tokens "
            f"prefilled at {data.tokens_per_s:,.0f} tok/s, {data.compression_ratio:.2f}x compression"
        )
    elif stage == "ask":
        err.print(f"[bold]2.[/] question {data['index']}/{data['total']}: {data['question']}  (full, reuse, blend)")
