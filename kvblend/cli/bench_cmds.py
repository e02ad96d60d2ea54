"""`kvblend bench`: every mode on a QA file, KV streamed from an on-disk archive; quality vs TTFT.

Parsing and rendering only: the workflow is :func:`kvblend.evaluation.bench.run_bench`,
imported inside the command (it needs torch); the option checks and defaults
come from the torch-free :mod:`kvblend.evaluation.records`.
"""

from __future__ import annotations

import dataclasses
import shlex
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Optional

import typer
from rich import box
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
    no_effect,
    out,
    print_json,
    printable,
    progress_enabled,
)
from kvblend.defaults import DEFAULT_SELECT, DEFAULT_SINK
from kvblend.errors import KvblendError, UsageError
from kvblend.evaluation.records import (
    DEFAULT_BENCH_MAX_NEW_TOKENS,
    DEFAULT_BENCH_MODES,
    DEFAULT_BENCH_RATIOS,
    DEFAULT_CHUNKS,
    DEFAULT_VARIANT_RATIO,
    PARETO_RATIOS,
    load_records,
    parse_codecs,
    parse_modes,
    parse_ratios,
)
from kvblend.options import NAMED_TEMPLATES, ComputeDtype, PromptTemplate, Select, Sink, WeightsFormat, check_ratio
from kvblend.provenance import cite

BENCH_RATIOS_TEXT = ",".join(f"{r:g}" for r in DEFAULT_BENCH_RATIOS)
PARETO_RATIOS_TEXT = ",".join(f"{r:g}" for r in PARETO_RATIOS)


def register(app: typer.Typer) -> None:
    app.command()(bench)


def _check_writable_target(path: Optional[Path], flag: str, suffix: str) -> None:
    if path is None:
        return
    if path.is_dir():
        raise UsageError(f"{flag} {path} is a directory; give a {suffix} file name")
    parent = path.expanduser().resolve().parent
    if not parent.is_dir():
        raise UsageError(f"{flag} {path}: directory {parent} does not exist")


def bench(
    ctx: typer.Context,
    dataset: Path = typer.Argument(
        ..., help='QA file: a JSON list of {"ctxs": [{"title","text"}...], "question", "answers"}.', show_default=False
    ),
    limit: Optional[int] = typer.Option(
        None, "--limit", "-n", help="Benchmark the first N records (default: all).", show_default=False
    ),
    offset: int = typer.Option(0, "--offset", help="Skip the first N records (e.g. held-out records after a dev set)."),
    chunks: int = typer.Option(
        DEFAULT_CHUNKS, "--chunks", help="Passages per record (the first N, in order) archived as segments."
    ),
    modes: str = typer.Option(
        ",".join(DEFAULT_BENCH_MODES), "--modes", help="Comma-separated modes; full always runs (it is the reference)."
    ),
    ratios: str = typer.Option(
        BENCH_RATIOS_TEXT,
        "--ratios",
        help="Blend recompute ratios, each in (0, 1]; `default` is the built-in ratio a query uses when none is given or tuned.",
    ),
    codecs: str = typer.Option(
        "lossless",
        "--codecs",
        help="Archive codecs to compare, e.g. lossless,int8,int4: reuse and blend run once per codec on the same records (full once).",
    ),
    max_tokens: int = typer.Option(
        DEFAULT_BENCH_MAX_NEW_TOKENS, "--max-tokens", help="Greedy answer length limit (same for every mode)."
    ),
    select: Select = typer.Option(
        Select(DEFAULT_SELECT), "--select", help="Blend's token selection policy for the main table."
    ),
    sink: Sink = typer.Option(
        Sink(DEFAULT_SINK),
        "--sink",
        help="How the passages are archived, as `ingest --sink`: alone (none), after the template's first tokens, or after the default template's instruction prefix.",
    ),
    template: str = typer.Option(
        "musique",
        "--template",
        help="Prompt template: musique (the paper's MuSiQue layout) or default (what `kvblend query` uses).",
    ),
    system: Optional[str] = typer.Option(
        None, "--system", help="System prompt in place of the template's.", show_default=False
    ),
    variants: bool = typer.Option(
        False,
        "--variants",
        help="Also compare fusor choices: every selection policy, HKVD deviation k/v/kv, check layer 1/2/1,2,3, sink policy.",
    ),
    pareto: bool = typer.Option(
        False,
        "--pareto",
        help="Also sweep every selection policy over --pareto-ratios, each point a query from the archive to its first token (first-token KL, recompute share, TTFT); with --plot, the chart is KL vs recompute share beside KL vs TTFT.",
    ),
    pareto_ratios: str = typer.Option(
        PARETO_RATIOS_TEXT,
        "--pareto-ratios",
        help="Ratios each policy's --pareto line runs (fewer: a cheaper sweep).",
    ),
    variant_ratio: float = typer.Option(DEFAULT_VARIANT_RATIO, "--variant-ratio", help="Blend ratio for --variants."),
    answers: bool = typer.Option(
        False, "--answers", help="Include every run's answer, per record, in the JSON (per_record)."
    ),
    drift: bool = typer.Option(
        False,
        "--drift",
        help="Show where each mode's answer drifts from full's: KL per position of full's answer (teacher-forced) "
        "and the first position whose greedy token differs (always in the JSON).",
    ),
    plot: Optional[Path] = typer.Option(
        None,
        "--plot",
        help="Write quality (F1, answer KL) vs TTFT to this PNG (needs matplotlib); with --pareto, first-token KL vs recompute share and vs TTFT per policy (and the quality chart to NAME-ttft.png).",
        show_default=False,
    ),
    out_file: Optional[Path] = typer.Option(
        None, "--out", help="Also write the JSON report to this file.", show_default=False
    ),
    archive: Optional[str] = typer.Option(
        None,
        "--archive",
        "-a",
        help="Archive for the passages: a directory or a redis:// URL (default: a scratch temp dir, removed after).",
        show_default=False,
    ),
    model: Optional[str] = ModelOpt,
    compute: Optional[str] = ComputeOpt,
    dtype: Optional[ComputeDtype] = DtypeOpt,
    weights: Optional[WeightsFormat] = WeightsOpt,
    enforce_eager: bool = EagerOpt,
    as_json: bool = JsonOpt,
) -> None:
    """Benchmark full / prefix / reuse / blend on QA records: F1, agreement and KL vs full, TTFT, recompute share."""
    # Everything a user can get wrong fails here, before the model loads.
    mode_list = parse_modes(modes)
    ratio_list = parse_ratios(ratios)  # checked whether or not blend runs (`--ratios abc` said nothing)
    ratio_list = ratio_list if "blend" in mode_list else ()
    pareto_list = parse_ratios(pareto_ratios, "--pareto-ratios")
    codec_list = parse_codecs(codecs)
    check_ratio(variant_ratio, "--variant-ratio")
    if offset < 0:
        raise UsageError(f"--offset must be at least 0, not {offset}")
    if chunks < 1:
        raise UsageError(f"--chunks must be at least 1, not {chunks}")
    if max_tokens < 1:
        raise UsageError(f"--max-tokens must be at least 1, not {max_tokens}")
    if limit is not None and limit < 1:  # (checked on offset + limit below, it named the wrong flag)
        raise UsageError(f"--limit must be at least 1, not {limit}")
    if plot is not None and not plot.suffix:  # as matplotlib writes it, and says so: NAME.png
        plot = plot.with_suffix(".png")
    _check_writable_target(plot, "--plot", ".png")
    _check_writable_target(out_file, "--out", ".json")
    prompt_template = _template(template, system)
    if plot is not None:
        from kvblend.evaluation.plot import check_plot_available

        check_plot_available(plot)
    records = load_records(dataset, None if limit is None else offset + limit)[offset:]
    if not records:
        raise UsageError(f"--offset {offset}: the dataset has no records past it")
    if "blend" not in mode_list and (flags := given_options(ctx, "ratios")):
        err.print(f"[yellow]warning:[/] {no_effect(flags, 'without blend in --modes')}")
    if not variants and (flags := given_options(ctx, "variant_ratio")):
        err.print(f"[yellow]warning:[/] {no_effect(flags, 'without --variants')}")
    if "full" not in mode_list and not as_json:
        err.print("[dim]note: full also runs: it is the reference for agreement and KL[/]")
    command = "kvblend " + " ".join(shlex.quote(a) for a in sys.argv[1:])

    from kvblend.evaluation.bench import run_bench
    from kvblend.evaluation.report import write_outputs
    from kvblend.pipeline import Engine
    from kvblend.pipeline.query import ContextLengthError

    with archive_dir_or_scratch(archive, "kvblend-bench-") as (target, scratch):
        # `auto` reads the profiles `kvblend profile` stored in the user's archive: a scratch one holds none
        profiled = archive if scratch else target
        with (
            Engine(
                target,
                model,
                compute,
                compute_dtype(dtype, profiled, model, compute),
                sink=sink,
                **decode_settings(weights, profiled, model, compute, enforce_eager),
            ) as engine,
            _progress(as_json) as on_progress,
        ):
            try:
                report = run_bench(
                    engine,
                    records,
                    mode_list,
                    ratio_list,
                    chunks=chunks,
                    max_new_tokens=max_tokens,
                    variants=variants,
                    variant_ratio=variant_ratio,
                    command=command,
                    codecs=codec_list,
                    select=select,
                    pareto=pareto,
                    pareto_ratios=pareto_list,
                    template=prompt_template,
                    on_progress=on_progress,
                    first_record=offset,
                )
            except ContextLengthError as e:  # bench has no --top-k: its passages are --chunks
                raise UsageError(e.explain("--chunks", "--max-tokens")) from None
    data = report.to_dict(answers=answers)
    if scratch:
        data["settings"]["archive"] = "scratch (temporary)"
    for w in data.get("warnings", []):
        err.print(f"[yellow]warning:[/] {escape(printable(w))}")
    if as_json:
        print_json(data)
    else:
        _print_human(data, drift)
    try:  # after the results are out: a file that cannot be written loses nothing of a long run
        written = write_outputs(data, out_file, plot)
    except (OSError, ValueError) as e:
        raise KvblendError(
            f"the results are above, but a file of them could not be written: {printable(str(e))}"
        ) from None
    if not as_json:
        for what, path in written:
            err.print(f"wrote {what} to {path}")


def _template(name: str, system: str | None) -> PromptTemplate:
    """`--template` and `--system` as a PromptTemplate (the system prompt replaces the template's own)."""
    if name not in NAMED_TEMPLATES:
        raise UsageError(f"unknown --template {name!r}; choose one of: {', '.join(NAMED_TEMPLATES)}")
    if system is not None and not system.strip():
        raise UsageError("--system must not be empty")
    chosen = NAMED_TEMPLATES[name]
    return chosen if system is None else dataclasses.replace(chosen, system=system)


@contextmanager
def _progress(as_json: bool) -> Iterator[Callable[[int, int, str], None] | None]:
    """A progress bar on stderr for a human at a terminal (its update callback), else None."""
    if not progress_enabled(as_json):
        yield None
        return
    with Progress(
        TextColumn("[bold]bench"),
        BarColumn(),
        MofNCompleteColumn(),
        TextColumn("runs"),
        TimeElapsedColumn(),
        TimeRemainingColumn(),
        TextColumn("{task.description}"),
        console=err,
        transient=True,
    ) as bar:
        task = bar.add_task("loading model", total=None)

        def on_progress(done: int, total: int, label: str) -> None:
            bar.update(task, completed=done, total=total, description=label)

        yield on_progress


def _f(x, digits: int = 3) -> str:
    return "—" if x is None else f"{x:.{digits}f}"


def _share(x) -> str:
    return "—" if x is None else f"{x:.0%}"


def _print_human(data: dict, drift: bool = False) -> None:
    from rich.console import Console

    # Piped output: a fixed wide console, so the tables are not squeezed to 80 columns.
    con = out if out.is_terminal else Console(highlight=False, soft_wrap=True, width=150)
    s = data["settings"]
    con.print(f"[bold]{escape(data['model'])}[/] on {escape(data['machine'])}")
    passages = s.get("mean_passages", s["chunks"])  # what the records held, at most --chunks
    con.print(
        f"{data['records']} records × {passages:g} passages (~{s['mean_prompt_tokens']:.0f} prompt tokens), "
        f"greedy ≤{s['max_new_tokens']} tokens; answer KL over full's first "
        f"≤{min(s['answer_kl_tokens'], s['max_new_tokens'])} tokens; {data['date']}"
    )
    con.print(f"[dim]{escape(data['command'])}[/]")
    if data["results"]:
        several = len(s.get("codecs", [])) > 1  # then name each archived run's codec
        rows = [
            [
                r["mode"] + (f" [{r['codec']}]" if several and r.get("bytes_per_token") is not None else ""),
                "—" if r["ratio"] is None else f"{r['ratio']:g}",
                _f(r["f1"]),
                _f(r["em_vs_full"]),
                _f(r["rouge_l_vs_full"]),
                _f(r["kl_vs_full"], 4),
                _f(r["answer_kl_vs_full"], 4),
                f"{r['ttft_median_s']:.3f}",
                f"{r['ttft_p90_s']:.3f}",
                f"{r['recompute_share']:.1%}",
            ]
            for r in data["results"]
        ]
        con.print(
            _table(
                "modes vs full (same prompt token ids, same greedy decoding)",
                ["mode", "ratio", "F1", "EM", "ROUGE-L", "KL 1st", "KL ans", "TTFT p50", "TTFT p90", "recomp."],
                rows,
                caption="EM, ROUGE-L: agreement with full's answer. KL from full in nats: first token, and answer "
                "(teacher-forced on full's answer). TTFT in s. recomp.: share of full's compute.",
            )
        )
    if len(s.get("codecs", [])) > 1:
        _print_codecs(con, data["results"])
    if drift and data["results"]:
        _print_drift(con, data["results"])
    for rec in data.get("per_record", []):
        con.print(
            f"[bold]#{rec['record']}[/] {escape(rec['question'])}  [dim]gold: {escape(' | '.join(rec['gold']))}[/]"
        )
        for run in rec["runs"]:
            con.print(f"   {run['run']:<40} {run['answer']!r}", markup=False)
        sources = cite(rec.get("sources", []))
        if sources:
            con.print(f"   Sources: {sources}", markup=False)
    if data.get("pareto"):
        _print_pareto(con, data["pareto"])
    if data.get("variants"):
        rows, last = [], None
        for r in data["variants"]:
            rows.append(
                [
                    r["group"] if r["group"] != last else "",
                    r["name"],
                    r["mode"],
                    _f(r["f1"]),
                    _f(r["em_vs_full"]),
                    _f(r["kl_vs_full"], 4),
                    _f(r["answer_kl_vs_full"], 4),
                    f"{r['ttft_median_s']:.3f}",
                    f"{r['recompute_share']:.1%}",
                ]
            )
            last = r["group"]
        con.print(
            _table(
                f"fusor variants, blend at ratio {s['variant_ratio']:g}",
                ["group", "variant", "mode", "F1", "EM", "KL 1st", "KL ans", "TTFT p50", "recomp."],
                rows,
                text_cols=3,
                caption="sink rows run with the KV in memory: their TTFTs compare with each other, not with the rows above.",
            )
        )


def _print_pareto(con, points: list[dict]) -> None:
    """The --pareto sweep: first-token KL, recompute share and speed-up over full per policy and ratio."""
    from kvblend.evaluation.report import pareto_grid

    headers, rows = pareto_grid(points)
    con.print(
        _table("selection policies: first-token KL from full (recompute share, TTFT speed-up over full)", headers, rows)
    )


def _print_codecs(con, results: list[dict]) -> None:
    """The codecs side by side: what each stores per token, how fast it loads, what it costs in fidelity."""
    rows = [
        [
            r["codec"],
            r["mode"] + ("" if r["ratio"] is None else f"@{r['ratio']:g}"),
            _f(r["bytes_per_token"], 0),
            _f(r["read_MBps"], 0),
            _f(r["decode_MBps"], 0),
            _f(r["kl_vs_full"], 4),
            _f(r["answer_kl_vs_full"], 4),
            f"{r['ttft_median_s']:.3f}",
        ]
        for r in results
        if r.get("bytes_per_token") is not None
    ]
    if rows:
        con.print(
            _table(
                "codecs (same records; full computed once)",
                ["codec", "run", "B/token", "read MB/s", "decode MB/s", "KL 1st", "KL ans", "TTFT p50"],
                rows,
                text_cols=2,
                caption="B/token: stored bytes per token (all layers). read: stored MB/s; decode: KV MB/s (as fp16) "
                "built into the prompt's layers (decompress, dequantize, re-position).",
            )
        )


DRIFT_POSITIONS = (0, 1, 2, 4, 8, 15)  # positions of full's answer the drift table shows


def _print_drift(con, results: list[dict]) -> None:
    """KL from full along full's answer, and where greedy decoding would first leave it, per mode."""
    shown = [i for i in DRIFT_POSITIONS if any(i < len(r["kl_by_position"]) for r in results)]
    several = len({r.get("codec") for r in results if r.get("bytes_per_token") is not None}) > 1
    rows = [
        [
            r["mode"] + (f" [{r['codec']}]" if several and r.get("bytes_per_token") is not None else ""),
            "—" if r["ratio"] is None else f"{r['ratio']:g}",
            *(_f(r["kl_by_position"][i], 4) if i < len(r["kl_by_position"]) else "—" for i in shown),
            f"{r['diverged_share']:.0%}",
            _f(r["first_divergence_median"], 1),
            *(
                _share(r.get(k))
                for k in ("stale_mass_first", "stale_mass_diverging", "top_stale_share", "top_overlap_first")
            ),
        ]
        for r in results
    ]
    con.print(
        _table(
            "drift along full's answer (teacher-forced on full's tokens)",
            [
                "mode",
                "ratio",
                *(f"KL @{i}" for i in shown),
                "diverged",
                "1st div. p50",
                "stale attn @0",
                "stale attn @div",
                "top-20 stale",
                "top-20 ∩ @0",
            ],
            rows,
            caption="KL @i: mean KL(full ‖ mode) in nats before full's i-th answer token. diverged: records where "
            "the mode's greedy token differs from full's at some forced position; 1st div. p50: the median first "
            "such position among them. Over those records: stale attn, the attention on KV neither recomputed nor "
            "exact (mean over heads and every layer but the first, whose cached KV is exact) at the answer's first "
            "step and at the diverging step; top-20 stale, the share of the diverging step's 20 most-read cached "
            "tokens left stale; top-20 ∩ @0, how many of them the first step (the one the selection serves) also "
            "read most.",
        )
    )


def _table(title: str, headers: list[str], rows: list[list[str]], caption: str = "", text_cols: int = 1) -> Table:
    """Numbers never truncated (headers wrap instead), so the table reads at 80 columns too."""
    table = Table(title=title, caption=caption, box=box.SIMPLE_HEAD, caption_justify="left")
    for c, header in enumerate(headers):
        if c < text_cols:
            table.add_column(header, justify="left")
        else:
            table.add_column(header, justify="right", min_width=max(len(row[c]) for row in rows))
    for row in rows:  # cells are text, not markup: "reuse [int4]" lost its codec to Rich's markup parser
        table.add_row(*(escape(cell) for cell in row))
    return table
