"""`kvblend profile` and `kvblend tune`: the loading controller's measurements and decisions.

The logic lives in :mod:`kvblend.controller`; this module parses options,
opens the archive and the model, and prints tables (or JSON).
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any, Optional

import typer
from rich.table import Table

from kvblend.cli.common import ArchiveOpt, ComputeOpt, JsonOpt, ModelOpt, err, human_bytes, out, parse_size, print_json
from kvblend.errors import UsageError


def register(app: typer.Typer) -> None:
    app.command()(profile)
    app.command()(tune)


def _ms(seconds: float | None) -> str:
    return "-" if seconds is None else f"{seconds * 1e3:.2f} ms"


def _mbps(x: float | None) -> str:
    return "-" if x is None else f"{x:,.0f} MB/s"


# ───────────────────────────────── profile ─────────────────────────────────


def profile(
    device: Optional[str] = typer.Option(
        None, "--device", "-d",
        help="Storage to profile: nvme, ssd or hdd (the archive's own directory, recorded under that label), "
             "ram (an in-memory tier), or a directory PATH (default: the archive's directory, label guessed).",
        show_default=False),
    label: Optional[str] = typer.Option(None, "--label", help="Name a PATH location (e.g. hdd) so `tune --storage-costs` can price it.", show_default=False),
    quick: bool = typer.Option(False, "--quick", help="A few seconds: short contexts, small scratch file, random-normal KV."),
    show: bool = typer.Option(False, "--show", help="List stored profiles instead of measuring."),
    archive: Optional[Path] = ArchiveOpt,
    model: Optional[str] = ModelOpt,
    compute: Optional[str] = ComputeOpt,
    as_json: bool = JsonOpt,
) -> None:
    """Measure this machine: storage read speed (cold and warm), codec decompression, per-layer prefill cost."""
    from kvblend.archive_format import Archive, resolve_archive_path

    path = resolve_archive_path(str(archive) if archive else None)
    if show:
        _show_profiles(path, model, as_json)
        return
    from kvblend import controller as ctl
    from kvblend.model import load_model

    if label is not None and not label.strip():
        raise UsageError("--label must not be empty")
    if device is not None and device not in ctl.DEVICE_LABELS and not Path(device).expanduser().is_dir():
        raise UsageError(f"--device must be nvme, ssd, hdd, ram or an existing directory, not {device!r}")
    log = (lambda msg: None) if as_json else (lambda msg: err.print(f"[dim]profile: {msg}[/]"))
    runner = load_model(model, compute)
    settings = ctl.ProfileSettings.quick() if quick else ctl.ProfileSettings()
    with Archive.open(path, create=True, model_name=runner.name, model_fingerprint=runner.fingerprint) as ar:
        prof = ctl.build_profile(runner, ar, device=device, settings=settings, label=label, log=log)
        ar.put_profile(prof["name"], prof)
    if as_json:
        print_json({**prof, "per_length": prof["layer_cost"]["per_length"], "stored_as": prof["name"]})
        return
    _print_profile(prof)


def _print_profile(p: dict) -> None:
    from kvblend import controller as ctl

    st = p["storage"]
    t = Table(title=f"profile of {p['machine']['hostname']} — {p['model']['name']} on {p['compute']}",
              show_header=False, title_justify="left")
    t.add_column("what", style="bold")
    t.add_column("value")
    fs = st.get("filesystem") or {}
    where = st.get("path") or "in memory"
    guessed = f" [dim]({st['label_source']}; name it with --device LABEL or --label)[/]" \
        if st.get("label_source") not in (None, "given") else ""
    t.add_row("storage", f"{st['label']}  ({where}{', ' + fs['fs_type'] if fs.get('fs_type') else ''}){guessed}")
    resident = st.get("cold_resident_fraction")
    cold_note = "" if resident is None else f"  ({resident:.0%} still cached after eviction)"
    if st.get("path") is None:
        t.add_row("read (memcpy)", _mbps(p["read_warm_MBps"]))
    else:
        t.add_row("read cold", _mbps(p["read_cold_MBps"]) + cold_note)
        t.add_row("read warm", _mbps(p["read_warm_MBps"]))
    t.add_row("decompress", f"{_mbps(p['decompress_MBps'])} compressed in, {_mbps(p['decompress_raw_MBps'])} raw out "
                            f"({p['codec']}, {p['compression_ratio']:.2f}x)")
    t.add_row("KV per token-layer", f"{p['kv_bytes_per_token_layer']:.0f} B stored, {p['kv_raw_bytes_per_token_layer']} B raw fp16")
    cost = p["layer_cost"]
    t.add_row("layer cost fit", f"cost(L) = {cost['a_s_per_token'] * 1e6:.3f} µs·L + {cost['b_s_per_token2'] * 1e9:.4f} ns·L²")
    t.add_row("cost per token", f"{p['layer_cost_s_per_token'] * 1e6:.2f} µs per token-layer at L = {p['layer_cost_ref_tokens']}")
    sc = cost.get("selective_check")
    if sc:
        t.add_row("selective check", f"r = {sc['ratio']:g} of {sc['L']} tokens: {_ms(sc['measured_s'])} measured, "
                                     f"{_ms(sc['predicted_s'])} by r·cost(L) (×{sc['measured_over_predicted']:.2f})")
    t.add_row("sample KV", f"{p['sample']['source']}, {p['sample']['tokens']} tokens; "
                           f"scratch {human_bytes(st['scratch_bytes'])}, {st['reads_per_pass']} reads per pass")
    t.add_row("took", f"{p['seconds']:.1f} s")
    out.print(t)

    lengths = [r["L"] for r in cost["per_length"]]
    rows = ctl.ratio_table(p, sorted({*lengths, ctl.TYPICAL_PROMPT_TOKENS}))
    measured = {r["L"]: r["layer_s"] for r in cost["per_length"]}
    lt = Table(title="per layer, by context length", title_justify="left")
    for col in ("L", "prefill (measured)", "prefill (fit)", "load (cold)", "r_hide"):
        lt.add_column(col, justify="right")
    for r in rows:
        lt.add_row(str(r["L"]), _ms(measured.get(r["L"])), _ms(r["t_full_layer_s"]), _ms(r["t_load_s"]),
                   f"{r['r_hide']:.3f}")
    out.print(lt)
    warning = ctl.busy_warning(p)
    if warning:
        out.print(f"[yellow]note: {warning}[/]")
    out.print(f"stored as profile [bold]{p['name']}[/]; run `kvblend tune` to pick the ratio")


def _show_profiles(path: Path, model: Optional[str], as_json: bool) -> None:
    from kvblend import controller as ctl
    from kvblend.archive_format import Archive
    from kvblend.model import resolve_model_source, source_fingerprint

    if not path.exists():
        raise UsageError(f"no archive at {path}: run `kvblend profile` or `kvblend ingest` first")
    fingerprint, changed_at = None, None
    try:
        source = resolve_model_source(model)
        fingerprint = source_fingerprint(source)
        weights = source.directory / source.gguf_file if source.gguf_file else source.directory / "config.json"
        changed_at = weights.stat().st_mtime
    except Exception:
        if model is not None:
            raise
    machine = ctl.machine_info()
    with Archive.open(path, create=False) as ar:
        profiles = [dict(p, name=p.get("name", name)) for name, p in ar.iter_profiles()]
        if model is None:  # judge against the model the archive was built with, not the default
            fingerprint = ar.model_fingerprint or fingerprint
    profiles.sort(key=lambda p: p.get("created", 0))
    for p in profiles:
        p["flags"] = ctl.profile_flags(p, machine, fingerprint, changed_at)
    if as_json:
        print_json({"archive": str(path), "machine": machine, "model_fingerprint": fingerprint, "profiles": profiles})
        return
    if not profiles:
        out.print(f"no profiles in {path}: run `kvblend profile`")
        return
    out.print(f"[bold]{len(profiles)} profile(s) in {path}[/] (this machine: {machine['hostname']})")
    for p in profiles:
        m = p.get("machine", {})
        mod = p.get("model", {})
        st = p.get("storage") or {}
        flags = f"  [yellow]⚠ {', '.join(p['flags'])}[/]" if p["flags"] else ""
        out.print(f"\n[bold]{p['name']}[/]{flags}")
        out.print(f"  {str(p.get('date', '?'))[:19].replace('T', ' ')}{'  (quick)' if p.get('quick') else ''}")
        out.print(f"  machine {m.get('hostname', '?')}: {m.get('cpu', '?')}" + (f", {m['gpu']}" if m.get("gpu") else ""))
        out.print(f"  model {mod.get('name', '?')} ({str(mod.get('fingerprint', '?'))[:12]}) on {p.get('compute', '?')}")
        out.print(f"  storage {ctl.storage_label(p)} ({st.get('path') or 'in memory'})")
        out.print(f"  read cold {_mbps(p.get('read_cold_MBps'))}, warm {_mbps(p.get('read_warm_MBps'))}; "
                  f"decompress {_mbps(p.get('decompress_MBps'))}; "
                  f"prefill {p.get('layer_cost_s_per_token', 0) * 1e6:.2f} µs per token-layer")


# ───────────────────────────────── tune ─────────────────────────────────


def tune(
    calibration: Optional[Path] = typer.Option(None, "--calibration", help="MuSiQue-schema JSON (default: fixtures/calibration.json).", show_default=False),
    limit: int = typer.Option(4, "--limit", help="Calibration records to run."),
    tolerance: float = typer.Option(0.02, "--tolerance", help="Largest F1 drop vs full accepted."),
    kl_bound: float = typer.Option(0.5, "--kl-bound", help="Largest mean first-token KL from full accepted, as a fraction of reuse's KL on the same records (reuse = no recompute)."),
    ratios: str = typer.Option("0.05,0.1,0.15,0.2,0.3", "--ratios", help="Ratios to test for the quality floor."),
    r_quality: Optional[float] = typer.Option(None, "--r-quality", help="Skip calibration and use this quality floor.", show_default=False),
    context_tokens: Optional[int] = typer.Option(None, "--context-tokens", help="Prompt length to tune for (default: top-6 × the archive's mean segment, else 3072).", show_default=False),
    storage_costs: str = typer.Option("ram=5,nvme=0.1,hdd=0.02", "--storage-costs", help="$/GB-month per storage label; profiled labels are compared."),
    archive_size: Optional[str] = typer.Option(None, "--archive-size", help="Size to price, e.g. 100GB (default: this archive's size).", show_default=False),
    archive: Optional[Path] = ArchiveOpt,
    model: Optional[str] = ModelOpt,
    compute: Optional[str] = ComputeOpt,
    as_json: bool = JsonOpt,
) -> None:
    """Pick the recompute ratio r = max(r_quality, r_hide) for this archive's storage, and the cheapest storage."""
    from kvblend import controller as ctl
    from kvblend.archive_format import Archive, resolve_archive_path
    from kvblend.model import pick_compute_device, resolve_model_source, source_fingerprint

    ratio_list = ctl.parse_ratios(ratios)
    costs = ctl.parse_costs(storage_costs)
    size_bytes = parse_size(archive_size) if archive_size else None
    if tolerance < 0 or kl_bound < 0:
        raise UsageError("--tolerance and --kl-bound must be >= 0")
    if r_quality is not None and not 0 < r_quality <= 1:
        raise UsageError("--r-quality must be in (0, 1]")
    if context_tokens is not None and context_tokens < 1:
        raise UsageError("--context-tokens must be at least 1")
    log = (lambda msg: None) if as_json else (lambda msg: err.print(f"[dim]tune: {msg}[/]"))

    path = resolve_archive_path(str(archive) if archive else None)
    if not path.exists():
        raise UsageError(f"no archive at {path}: run `kvblend profile` first")
    source = resolve_model_source(model)
    fingerprint = source_fingerprint(source)
    compute_type = pick_compute_device(compute).type
    machine = ctl.machine_info()
    with Archive.open(path, create=False, model_name=source.name, model_fingerprint=fingerprint) as ar:
        profiles = ctl.applicable_profiles([p for _, p in ar.iter_profiles()], machine, fingerprint, compute_type)
        here = ctl.location_profile(profiles, path)
        if here is None:
            raise UsageError(f"no profile of this archive's location ({path}) for {source.name} on {compute_type} "
                             f"on this machine: run `kvblend profile --archive {path}` first")
        if context_tokens is not None:
            L, L_source = context_tokens, "--context-tokens"
        else:
            L, L_source = ctl.typical_prompt_tokens(ar)
        max_pos = here.get("model", {}).get("max_positions") or 0
        if max_pos and L > max_pos:
            L, L_source = max_pos, L_source + f", capped at the model's context {max_pos}"
        if size_bytes is None:
            size_bytes = ar.size_bytes()

        quality: dict[str, Any] | None = None
        notes: list[str] = []
        if ctl.busy_warning(here):
            notes.append("profile: " + ctl.busy_warning(here))
        if here.get("quick"):
            notes.append("the profile is a --quick one (short contexts): run `kvblend profile` for a better cost fit")
        if r_quality is not None:
            rq, rq_source = r_quality, "given"
        else:
            from kvblend.model import load_model

            records = ctl.load_calibration(calibration or ctl.default_calibration_path(), limit)
            log(f"calibration: {len(records)} records × ratios {', '.join(f'{r:g}' for r in ratio_list)} vs full")
            runner = load_model(model, compute)
            quality = ctl.measure_quality(runner, records, ratio_list, tolerance=tolerance,
                                          kl_bound_vs_reuse=kl_bound, log=log)
            floor = ctl.quality_floor(quality["by_ratio"], tolerance, quality["kl_bound"])
            if floor is None:
                rq, rq_source = 1.0, "fallback"
                top = max(ratio_list)
                v = quality["by_ratio"][top]
                notes.append(f"even r = {top:g} misses the bounds (F1 drop {v['f1_drop']:+.3f} vs ≤ {tolerance:g}, "
                             f"KL {v['kl']:.3f} vs ≤ {quality['kl_bound']:.3f} = {kl_bound:g}× reuse's), so r_quality = 1.0: queries will recompute "
                             "every token (the cost of --mode full); test larger --ratios (e.g. 0.5,0.7), loosen "
                             "--kl-bound/--tolerance, or pass --r-quality")
            else:
                rq, rq_source = floor, "calibration"
        decision = ctl.decide(here, rq, L, r_quality_source=rq_source, L_source=L_source)
        decision.notes = notes + decision.notes
        storage = ctl.cheapest_storage(profiles, costs, decision.ratio, L, cost_model=here, archive_bytes=size_bytes)
        entry = {
            "ratio": decision.ratio,
            "r_quality": decision.r_quality,
            "r_quality_source": rq_source,
            "r_hide": decision.r_hide,
            "L": decision.L,
            "L_source": L_source,
            "t_load_s": decision.t_load_s,
            "t_recompute_s": decision.t_recompute_s,
            "bottleneck": decision.bottleneck,
            "table": decision.table,
            "date": ctl.today(),
            "created": time.time(),
            "profile": here.get("name"),
            "model": {"name": source.name, "fingerprint": fingerprint},
            "compute": compute_type,
            "archive": ctl.normalize_path(path),
            "tolerance": tolerance,
            "kl_bound": kl_bound,
            "quality": _quality_json(quality),
            "storage": storage.to_dict(),
            "archive_bytes": size_bytes,
            "notes": decision.notes,
        }
        key = ctl.tuned_key(source.name, compute_type, path)
        ar.put_tuned(key, entry)
    if as_json:
        print_json({**entry, "tuned_key": key})
        return
    _print_tune(entry, decision, storage, costs, quality, tolerance, kl_bound, key)


def _quality_json(quality: dict | None) -> dict | None:
    if quality is None:
        return None
    return {**quality, "by_ratio": {f"{r:g}": v for r, v in quality["by_ratio"].items()}}


def _print_tune(entry, decision, storage, costs, quality, tolerance, kl_bound, key) -> None:
    if quality is not None:
        abs_bound = quality["kl_bound"]
        qt = Table(title=f"quality vs full ({quality['records']} calibration records, full F1 {quality['full_f1']:.3f}, "
                         f"reuse KL {quality['reuse_kl']:.4f})",
                   title_justify="left")
        for col in ("ratio", "F1", "F1 drop", "first-token KL", "same answer", "within bounds"):
            qt.add_column(col, justify="right")
        for r, v in sorted(quality["by_ratio"].items()):
            ok = v["f1_drop"] <= tolerance + 1e-12 and v["kl"] <= abs_bound
            qt.add_row(f"{r:g}", f"{v['f1']:.3f}", f"{v['f1_drop']:+.3f}", f"{v['kl']:.4f}",
                       f"{v['same_as_full']:.0%}", "[green]yes[/]" if ok else "[red]no[/]")
        for r in quality.get("skipped", []):
            qt.add_row(f"{r:g}", "-", "-", "-", "-", "[dim]not run: a larger ratio failed[/]")
        out.print(qt)
    lt = Table(title=f"per layer at ratio {decision.ratio:.3f} (profile {decision.profile})", title_justify="left")
    for col in ("L", "load (cold)", "full prefill", "recompute at r", "r_hide", "loading hides recompute"):
        lt.add_column(col, justify="right")
    for row in decision.table:
        mark = " ◀" if row["L"] == decision.L else ""
        lt.add_row(f"{row['L']}{mark}", _ms(row["t_load_s"]), _ms(row["t_full_layer_s"]), _ms(row["t_recompute_s"]),
                   f"{row['r_hide']:.3f}", "yes" if row["hidden"] else "no")
    out.print(lt)
    src = {"calibration": f"F1 drop ≤ {tolerance:g} and KL ≤ {kl_bound:g}× reuse's on calibration",
           "given": "--r-quality", "fallback": "no tested ratio met the bounds"}[decision.r_quality_source]
    out.print(f"context L = {decision.L} tokens ({decision.L_source})")
    out.print(f"r_quality = {decision.r_quality:g} ({src}); r_hide = {decision.r_hide:.3f} "
              f"(T_load {_ms(decision.t_load_s)} = r·{_ms(decision.t_full_layer_s)})")
    out.print(f"[bold]ratio = max(r_quality, r_hide) = {decision.ratio:.3f}[/]; per layer: load {_ms(decision.t_load_s)}, "
              f"recompute {_ms(decision.t_recompute_s)} → {decision.bottleneck} sets the pace")
    for note in decision.notes:
        out.print(f"  · {note}")
    size = entry["archive_bytes"]
    if storage.candidates:
        st = Table(title=f"storage for {human_bytes(size)} at ratio {decision.ratio:.3f}, L = {decision.L}",
                   title_justify="left")
        for col in ("storage", "$/GB-month", "$/month", "load", "recompute", "adds no delay"):
            st.add_column(col, justify="right")
        for o in storage.candidates:
            chosen = storage.choice is not None and o.label == storage.choice.label
            st.add_row(f"[bold]{o.label}[/]" if chosen else o.label, f"{o.price_per_GB_month:g}",
                       f"{o.monthly_cost:,.2f}" if o.monthly_cost is not None else "-", _ms(o.t_load_s),
                       _ms(o.t_recompute_s), "yes" if o.hides else "no")
        out.print(st)
    if storage.choice is not None:
        c = storage.choice
        out.print(f"cheapest storage that adds no delay: [bold]{c.label}[/] (${c.price_per_GB_month:g}/GB-month, "
                  f"${c.monthly_cost:,.2f}/month for {human_bytes(size)})")
    elif storage.candidates:
        out.print("no priced storage hides recompute at this ratio: every candidate adds loading delay")
    if storage.unprofiled:
        out.print(f"[dim]not profiled on this machine (run `kvblend profile --device ...`): "
                  f"{', '.join(storage.unprofiled)}[/]")
    out.print(f"stored as tuned setting [bold]{key}[/]: `kvblend query` uses ratio {decision.ratio:.3f} "
              "unless --ratio is given")
