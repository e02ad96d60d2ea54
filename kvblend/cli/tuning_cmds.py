"""`kvblend profile` and `kvblend tune`: the loading controller's measurements and decisions.

Parsing and rendering only: the workflows are :func:`kvblend.tuning.profiling.run_profile`,
:func:`kvblend.tuning.profile.list_profiles` and :func:`kvblend.tuning.tune.run_tune`,
imported inside the commands so that importing this module (every `kvblend`
start-up) does not import torch.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Optional

import typer
from rich.markup import escape
from rich.table import Table

from kvblend.cli.common import (
    ArchiveOpt,
    ComputeOpt,
    JsonOpt,
    ModelOpt,
    err,
    given_options,
    human_bytes,
    no_effect,
    out,
    parse_budget,
    print_json,
)
from kvblend.defaults import DEFAULT_SELECT, DEFAULT_TOP_K
from kvblend.evaluation.records import parse_ratios
from kvblend.options import Select
from kvblend.tuning.delay import (
    DEFAULT_CALIBRATION_LIMIT,
    DEFAULT_KL_BOUND,
    DEFAULT_TOLERANCE,
    DEFAULT_TUNE_RATIOS,
    passes_bounds,
    ratio_table,
)
from kvblend.tuning.profile import (
    TYPICAL_PROMPT_TOKENS,
    Profile,
    ProfileListing,
    busy_warning,
)
from kvblend.tuning.storage import DEFAULT_STORAGE_COSTS, parse_costs

if TYPE_CHECKING:  # annotations only: the tune workflow imports torch
    from kvblend.tuning.tune import TuneResult

TUNE_RATIOS_TEXT = ",".join(f"{r:g}" for r in DEFAULT_TUNE_RATIOS)


def register(app: typer.Typer) -> None:
    app.command()(profile)
    app.command()(tune)


def _ms(seconds: float | None) -> str:
    return "-" if seconds is None else f"{seconds * 1e3:.2f} ms"


def _mbps(x: float | None) -> str:
    return "-" if x is None else f"{x:,.0f} MB/s"


def _logger(as_json: bool, command: str):
    """Progress lines on stderr for a human; nothing when stdout is JSON for a script."""
    return (lambda msg: None) if as_json else (lambda msg: err.print(f"[dim]{command}: {msg}[/]"))


# ───────────────────────────────── profile ─────────────────────────────────


def profile(
    ctx: typer.Context,
    device: Optional[str] = typer.Option(
        None,
        "--device",
        "-d",
        help="Storage to profile: nvme, ssd or hdd (the archive's own directory, recorded under that label), "
        "ram (an in-memory tier), or a directory PATH (default: the archive's directory, label guessed).",
        show_default=False,
    ),
    label: Optional[str] = typer.Option(
        None,
        "--label",
        help="Name a PATH location (e.g. hdd) so `tune --storage-costs` can price it.",
        show_default=False,
    ),
    quick: bool = typer.Option(
        False, "--quick", help="A few seconds: short contexts, small scratch file, random-normal KV."
    ),
    show: bool = typer.Option(False, "--show", help="List stored profiles instead of measuring."),
    archive: Optional[str] = ArchiveOpt,
    model: Optional[str] = ModelOpt,
    compute: Optional[str] = ComputeOpt,
    as_json: bool = JsonOpt,
) -> None:
    """Measure this machine: storage read speed (cold and warm), codec decompression, per-layer prefill cost."""
    if show:
        from kvblend.tuning.profile import list_profiles

        if flags := given_options(ctx, "device", "label", "quick"):
            err.print(f"[yellow]warning:[/] {no_effect(flags, 'with --show: it lists what was measured')}")

        _print_listing(list_profiles(archive, model), as_json)
        return
    from kvblend.tuning.profiling import run_profile

    prof = run_profile(
        archive, model, compute, device=device, label=label, quick=quick, log=_logger(as_json, "profile")
    )
    if as_json:
        d = prof.to_dict()
        print_json({**d, "per_length": d["layer_cost"]["per_length"], "stored_as": prof.name})
        return
    _print_profile(prof)


def _profile_table(p: Profile) -> Table:
    st, cost = p.storage, p.layer_cost
    t = Table(
        title=f"profile of {p.machine.hostname} — {p.model.name} on {p.compute}",
        show_header=False,
        title_justify="left",
    )
    t.add_column("what", style="bold")
    t.add_column("value")
    fs = st.filesystem or {}
    guessed = (
        f" [dim]({st.label_source}; name it with --device LABEL or --label)[/]" if st.label_source != "given" else ""
    )
    t.add_row(
        "storage", f"{st.label}  ({st.path or 'in memory'}{', ' + fs['fs_type'] if fs.get('fs_type') else ''}){guessed}"
    )
    if st.path is None:
        t.add_row("read (memcpy)", _mbps(p.read_warm_MBps))
    else:
        resident = st.cold_resident_fraction
        cold_note = "" if resident is None else f"  ({resident:.0%} still cached after eviction)"
        t.add_row("read cold", _mbps(p.read_cold_MBps) + cold_note)
        t.add_row("read warm", _mbps(p.read_warm_MBps))
    t.add_row(
        "decompress",
        f"{_mbps(p.decompress_MBps)} compressed in, {_mbps(p.decompress_raw_MBps)} raw out "
        f"({p.codec}, {p.compression_ratio:.2f}x)",
    )
    for name, c in p.codecs.items():  # every codec on the same KV: what `tune` weighs
        t.add_row(
            f"codec {name}",
            f"{c['stored_fraction']:.3f}× fp16; decode {_mbps(c['decompress_MBps'])} in, "
            f"{_mbps(c['decompress_raw_MBps'])} KV out",
        )
    t.add_row(
        "KV per token-layer", f"{p.kv_bytes_per_token_layer:.0f} B stored, {p.kv_raw_bytes_per_token_layer} B raw fp16"
    )
    t.add_row(
        "layer cost fit", f"cost(L) = {cost.a_s_per_token * 1e6:.3f} µs·L + {cost.b_s_per_token2 * 1e9:.4f} ns·L²"
    )
    t.add_row(
        "cost per token",
        f"{(p.layer_cost_s_per_token or 0.0) * 1e6:.2f} µs per token-layer at L = {p.layer_cost_ref_tokens}",
    )
    sc = cost.selective_check
    if sc:
        t.add_row(
            "selective check",
            f"r = {sc.ratio:g} of {sc.L} tokens: {_ms(sc.measured_s)} measured, "
            f"{_ms(sc.predicted_s)} by r·cost(L) (×{sc.measured_over_predicted:.2f})",
        )
    t.add_row(
        "sample KV",
        f"{p.sample.source if p.sample else '-'}, {p.sample.tokens if p.sample else 0} tokens; "
        f"scratch {human_bytes(st.scratch_bytes)}, {st.reads_per_pass} reads per pass",
    )
    if p.weights:  # each weight format's decode step: what `--weights auto` takes
        choice, rows = p.weights_choice()
        for fmt, m in p.weights.items():
            steps = ", ".join(
                f"batch {k.removeprefix('step_ms_')} {_ms(v / 1000)}" for k, v in m.items() if k.startswith("step_ms_")
            )
            mark = f"  [bold]← auto (decode batches ≤ {rows})[/]" if fmt == choice else ""
            t.add_row(f"decode {fmt}", f"{steps}; KL {m.get('kl', 0.0):.1e} vs fp32{mark}")
    chosen_dtype = p.dtype_choice()
    for dtype, m in p.prefill_dtypes.items():  # each compute dtype's prefill: what `--dtype auto` takes
        mark = "  [bold]← auto[/]" if dtype == chosen_dtype else ""
        t.add_row(
            f"prefill {dtype}",
            f"{_ms(m.get('prefill_ms', 0.0) / 1000)} for {p.prefill_context_tokens} tokens; "
            f"KL {m.get('kl', 0.0):.1e} vs fp32{mark}",
        )
    t.add_row("took", f"{p.seconds:.1f} s")
    return t


def _print_profile(p: Profile) -> None:
    out.print(_profile_table(p))
    measured = {r.L: r.layer_s for r in p.layer_cost.per_length}
    lt = Table(title="per layer, by context length", title_justify="left")
    for col in ("L", "prefill (measured)", "prefill (fit)", "load (cold)", "r_hide"):
        lt.add_column(col, justify="right")
    for r in ratio_table(p.load_model(), p.cost_model, sorted({*measured, TYPICAL_PROMPT_TOKENS})):
        lt.add_row(str(r.L), _ms(measured.get(r.L)), _ms(r.t_full_layer_s), _ms(r.t_load_s), f"{r.r_hide:.3f}")
    out.print(lt)
    warning = busy_warning(p)
    if warning:
        out.print(f"[yellow]note: {warning}[/]")
    out.print(f"stored as profile [bold]{p.name}[/]; run `kvblend tune` to pick the ratio")


def _print_listing(listing: ProfileListing, as_json: bool) -> None:
    if as_json:
        print_json(listing.to_dict())
        return
    for name, why in listing.unreadable.items():
        err.print(f"[yellow]warning:[/] profile {escape(name)} left out: {escape(why)}")
    if not listing.profiles:
        out.print(f"no profiles in {listing.archive}: run `kvblend profile`")
        return
    out.print(
        f"[bold]{len(listing.profiles)} profile(s) in {listing.archive}[/] (this machine: {listing.machine.hostname})"
    )
    for p, flags in zip(listing.profiles, listing.flags):
        m, mod = p.machine, p.model
        marks = f"  [yellow]⚠ {', '.join(flags)}[/]" if flags else ""
        out.print(f"\n[bold]{p.name}[/]{marks}")
        out.print(f"  {p.date[:19].replace('T', ' ') or '?'}{'  (quick)' if p.quick else ''}")
        out.print(f"  machine {m.hostname}: {m.cpu}" + (f", {m.gpu}" if m.gpu else ""))
        out.print(f"  model {mod.name} ({str(mod.fingerprint)[:12]}) on {p.compute}")
        out.print(f"  storage {p.storage.label} ({p.storage.path or 'in memory'})")
        out.print(
            f"  read cold {_mbps(p.read_cold_MBps)}, warm {_mbps(p.read_warm_MBps)}; "
            f"decompress {_mbps(p.decompress_MBps)}; "
            f"prefill {(p.layer_cost_s_per_token or 0) * 1e6:.2f} µs per token-layer"
        )


# ───────────────────────────────── tune ─────────────────────────────────


def tune(
    ctx: typer.Context,
    calibration: Optional[Path] = typer.Option(
        None,
        "--calibration",
        help="MuSiQue-schema JSON, or 'bundled' for the MuSiQue set shipped with kvblend (default: prompts made of the archive's own passages, each asking how one of their sentences ends; the bundled set when the archive has none).",
        show_default=False,
    ),
    limit: int = typer.Option(DEFAULT_CALIBRATION_LIMIT, "--limit", help="Calibration prompts to run."),
    top_k: int = typer.Option(
        DEFAULT_TOP_K,
        "--top-k",
        help="Passages a query stitches together (as `query --top-k`): the archive's calibration prompts hold this many, and the context length tuned for is this many mean segments.",
    ),
    tolerance: float = typer.Option(DEFAULT_TOLERANCE, "--tolerance", help="Largest F1 drop vs full accepted."),
    kl_bound: float = typer.Option(
        DEFAULT_KL_BOUND,
        "--kl-bound",
        help="Largest mean first-token KL from full accepted, as a fraction of reuse's KL on the same records (reuse = no recompute).",
    ),
    ratios: str = typer.Option(TUNE_RATIOS_TEXT, "--ratios", help="Ratios to test for the quality floor."),
    r_quality: Optional[float] = typer.Option(
        None, "--r-quality", help="Skip calibration and use this quality floor.", show_default=False
    ),
    select: Select = typer.Option(
        Select(DEFAULT_SELECT),
        "--select",
        help="Blend's selection policy to calibrate (queries use the default unless told).",
    ),
    context_tokens: Optional[int] = typer.Option(
        None,
        "--context-tokens",
        help=f"Prompt length to tune for (default: --top-k × the archive's mean segment, else {TYPICAL_PROMPT_TOKENS}).",
        show_default=False,
    ),
    storage_costs: str = typer.Option(
        DEFAULT_STORAGE_COSTS, "--storage-costs", help="$/GB-month per storage label; profiled labels are compared."
    ),
    archive_size: Optional[str] = typer.Option(
        None, "--archive-size", help="Size to price, e.g. 100GB (default: this archive's size).", show_default=False
    ),
    archive: Optional[str] = ArchiveOpt,
    model: Optional[str] = ModelOpt,
    compute: Optional[str] = ComputeOpt,
    as_json: bool = JsonOpt,
) -> None:
    """Pick the recompute ratio r = max(r_quality, r_hide) for this archive's storage, and the cheapest storage."""
    from kvblend.tuning.tune import TuneRequest, run_tune

    req = TuneRequest(
        archive=archive,
        model=model,
        compute=compute,
        calibration=calibration,
        limit=limit,
        tolerance=tolerance,
        kl_bound=kl_bound,
        ratios=tuple(sorted(parse_ratios(ratios))),
        r_quality=r_quality,
        context_tokens=context_tokens,
        costs=parse_costs(storage_costs),
        archive_bytes=parse_budget(archive_size, "--archive-size") if archive_size else None,
        select=select,
        top_k=top_k,
    )
    req.check()  # before the model loads
    if r_quality is not None and (
        flags := given_options(ctx, "calibration", "limit", "tolerance", "kl_bound", "ratios")
    ):
        err.print(f"[yellow]warning:[/] {no_effect(flags, 'with --r-quality: nothing is calibrated')}")
    result = run_tune(req, log=_logger(as_json, "tune"))
    if as_json:
        print_json({**result.setting.to_dict(), "tuned_key": result.key})
        return
    _print_tune(result)


def _quality_table(result: TuneResult) -> Table:
    s, q = result.setting, result.setting.quality
    assert q is not None, "only a calibrated setting has a quality table"
    qt = Table(
        title=f"quality vs full ({q.records} calibration prompts from {s.calibration or 'the bundled set'}; "
        f"full F1 {q.full_f1:.3f}, reuse KL {q.reuse_kl:.4f})",
        title_justify="left",
    )
    for col in ("ratio", "F1", "F1 drop", "first-token KL", "same answer", "within bounds"):
        qt.add_column(col, justify="right")
    for r, v in sorted(q.by_ratio.items()):
        ok = passes_bounds(v, s.tolerance, q.kl_bound)
        qt.add_row(
            f"{r:g}",
            f"{v.f1:.3f}",
            f"{v.f1_drop:+.3f}",
            f"{v.kl:.4f}",
            f"{v.same_as_full:.0%}",
            "[green]yes[/]" if ok else "[red]no[/]",
        )
    for r in q.skipped:
        qt.add_row(f"{r:g}", "-", "-", "-", "-", "[dim]not run: a larger ratio failed[/]")
    return qt


def _layer_table(result: TuneResult) -> Table:
    d = result.decision
    lt = Table(title=f"per layer at ratio {d.ratio:.3f} (profile {d.profile})", title_justify="left")
    for col in ("L", "load (cold)", "full prefill", "recompute at r", "r_hide", "loading hides recompute"):
        lt.add_column(col, justify="right")
    for row in d.table:
        mark = " ◀" if row.L == d.L else ""
        lt.add_row(
            f"{row.L}{mark}",
            _ms(row.t_load_s),
            _ms(row.t_full_layer_s),
            _ms(row.t_recompute_s),
            f"{row.r_hide:.3f}",
            "yes" if row.hidden else "no",
        )
    return lt


def _storage_table(result: TuneResult) -> Table:
    s, storage = result.setting, result.setting.storage
    st = Table(
        title=f"storage for {human_bytes(s.archive_bytes or 0)} at ratio {s.ratio:.3f}, L = {s.L}", title_justify="left"
    )
    for col in ("storage", "$/GB-month", "$/month", "load", "recompute", "adds no delay"):
        st.add_column(col, justify="right")
    for o in storage.candidates:
        chosen = storage.choice is not None and o.label == storage.choice.label
        st.add_row(
            f"[bold]{o.label}[/]" if chosen else o.label,
            f"{o.price_per_GB_month:g}",
            f"{o.monthly_cost:,.2f}" if o.monthly_cost is not None else "-",
            _ms(o.t_load_s),
            _ms(o.t_recompute_s),
            "yes" if o.hides else "no",
        )
    return st


def _print_decision(result: TuneResult) -> None:
    d, s = result.decision, result.setting
    src = {
        "calibration": f"F1 drop ≤ {s.tolerance:g} and KL ≤ {s.kl_bound:g}× reuse's on calibration",
        "given": "--r-quality",
        "fallback": "no tested ratio met the bounds",
    }[d.r_quality_source]
    out.print(f"context L = {d.L} tokens ({d.L_source})")
    out.print(
        f"r_quality = {d.r_quality:g} ({src}); r_hide = {d.r_hide:.3f} "
        f"(T_load {_ms(d.t_load_s)} = r·{_ms(d.t_full_layer_s)})"
    )
    out.print(
        f"[bold]ratio = max(r_quality, r_hide) = {d.ratio:.3f}[/]; per layer: load {_ms(d.t_load_s)}, "
        f"recompute {_ms(d.t_recompute_s)} → {d.bottleneck} sets the pace"
    )
    for note in d.notes:
        out.print(f"  · {note}")


def _print_tune(result: TuneResult) -> None:
    s, storage = result.setting, result.setting.storage
    if s.quality is not None:
        out.print(_quality_table(result))
    out.print(_layer_table(result))
    _print_decision(result)
    if storage.candidates:
        out.print(_storage_table(result))
    if storage.choice is not None:
        c = storage.choice
        out.print(
            f"cheapest storage that adds no delay: [bold]{c.label}[/] (${c.price_per_GB_month:g}/GB-month, "
            f"${c.monthly_cost:,.2f}/month for {human_bytes(s.archive_bytes or 0)})"
        )
    elif storage.candidates:
        out.print("no priced storage hides recompute at this ratio: every candidate adds loading delay")
    if storage.unprofiled:
        out.print(
            f"[dim]not profiled on this machine (run `kvblend profile --device ...`): "
            f"{', '.join(storage.unprofiled)}[/]"
        )
    query = "kvblend query" if s.select == DEFAULT_SELECT else f"kvblend query --select {s.select}"
    out.print(
        f"stored as tuned setting [bold]{escape(result.key)}[/]: `{query}` uses ratio {s.ratio:.3f} "
        "unless --ratio is given"
    )
