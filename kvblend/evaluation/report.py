"""Markdown tables of a `kvblend bench --json` report, for BENCHMARKS.md (scripts/bench_all.py).

They read the JSON dict, not a live :class:`~kvblend.evaluation.summary.BenchReport`,
so a report written months ago renders the same way. No torch here.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

from kvblend.evaluation.records import ANSWER_KL_TOKENS


def _num(x, digits: int = 3) -> str:
    return "—" if x is None or (isinstance(x, float) and not math.isfinite(x)) else f"{x:.{digits}f}"


def _table(headers: list[str], rows: list[list[str]], numeric_from: int) -> str:
    align = ["---" if i < numeric_from else "---:" for i in range(len(headers))]
    lines = ["| " + " | ".join(headers) + " |", "| " + " | ".join(align) + " |"]
    lines += ["| " + " | ".join(r) + " |" for r in rows]
    return "\n".join(lines)


def _settings_line(data: dict) -> str:
    s = data.get("settings", {})
    return (
        f"{data.get('records', '?')} records × {s.get('chunks', '?')} passages "
        f"(~{s.get('mean_prompt_tokens', 0):.0f} prompt tokens), {data.get('model', '?')}, "
        f"compute {s.get('compute', '?')}/{s.get('dtype', '?')}, {s.get('weights', 'fp32')} weights in decode; "
        f"greedy, ≤{s.get('max_new_tokens', '?')} new tokens, "
        f"same prompt token ids for every mode; modes interleaved per record."
    )


def _result_row(r: dict, full: dict | None) -> list[str]:
    speed = (full["ttft_median_s"] / r["ttft_median_s"]) if full and r["ttft_median_s"] else None
    return [
        r["mode"],
        "—" if r["ratio"] is None else f"{r['ratio']:g}",
        _num(r["f1"]),
        _num(r["em_vs_full"]),
        _num(r["rouge_l_vs_full"]),
        _num(r["kl_vs_full"], 4),
        _num(r["answer_kl_vs_full"], 4),
        _num(r["ttft_median_s"]),
        _num(r["ttft_p90_s"]),
        "—" if speed is None else f"{speed:.2f}×",
        f"{r['recompute_share']:.1%}",
    ]


def markdown_results(data: dict) -> str:
    """The main table of a `kvblend bench --json` report, as markdown."""
    rows_in = data.get("results") or []
    if not rows_in:
        return "(no results)"
    full = next((r for r in rows_in if r["mode"] == "full"), None)
    n_tok = data.get("settings", {}).get("answer_kl_tokens", ANSWER_KL_TOKENS)
    return "\n".join(
        [
            _settings_line(data),
            "",
            _table(
                [
                    "mode",
                    "ratio",
                    "F1 (gold)",
                    "EM vs full",
                    "ROUGE-L vs full",
                    "KL 1st token",
                    "answer KL",
                    "TTFT p50 (s)",
                    "TTFT p90 (s)",
                    "speed-up vs full (p50)",
                    "recompute share",
                ],
                [_result_row(r, full) for r in rows_in],
                2,
            ),
            "",
            "F1: SQuAD token F1 against the gold answers (max over them). EM / ROUGE-L vs full: agreement with "
            "full's own answer on the same record. KL (nats) from full's distribution: of the first token, and "
            f"averaged over full's first ≤{n_tok} answer tokens fed to every mode (teacher forcing on the same "
            "fused KV). "
            "TTFT: KV streamed from the on-disk archive + fusion + first token; model load excluded. "
            "Recompute share: token-layers computed / prompt tokens × layers.",
        ]
    )


def markdown_variants(data: dict) -> str:
    """The fusor-variant table of a `kvblend bench --variants --json` report, as markdown."""
    rows_in = data.get("variants") or []
    if not rows_in:
        return "(no variants)"
    rows, last = [], None
    for r in rows_in:
        rows.append(
            [
                r["group"] if r["group"] != last else "",
                r["name"],
                r["mode"],
                _num(r["f1"]),
                _num(r["em_vs_full"]),
                _num(r["rouge_l_vs_full"]),
                _num(r["kl_vs_full"], 4),
                _num(r["answer_kl_vs_full"], 4),
                _num(r["ttft_median_s"]),
                f"{r['recompute_share']:.1%}",
                r.get("kv_source", ""),
            ]
        )
        last = r["group"]
    ratio = data.get("settings", {}).get("variant_ratio")
    return "\n".join(
        [
            _settings_line(data) + (f" Blend at ratio {ratio:g}." if ratio is not None else ""),
            "",
            _table(
                [
                    "group",
                    "variant",
                    "mode",
                    "F1 (gold)",
                    "EM vs full",
                    "ROUGE-L vs full",
                    "KL 1st token",
                    "answer KL",
                    "TTFT p50 (s)",
                    "recompute share",
                    "KV from",
                ],
                rows,
                3,
            ),
            "",
            "deviation: HKVD scored on K, V, or both (each normalised by its mean). check_layers: where tokens are "
            "selected (1,2,3 = gradual filtering, ratios shrinking to the target). sink: chunks prefilled alone "
            "(what the archive stores) vs after the prompt's shared instruction prefix (its KV dropped); these rows "
            "hold the KV in memory, so their TTFTs compare with each other only."
            + (f" Note: {data['note']}." if data.get("note") else ""),
        ]
    )


def markdown_codecs(data: dict) -> str:
    """The codec rows of a `kvblend bench --codecs … --json` report: size, load speed and fidelity side by side."""
    rows_in = [r for r in data.get("results") or [] if r.get("bytes_per_token") is not None]
    if not rows_in:
        return "(no codec rows)"
    raw = data.get("settings", {}).get("raw_bytes_per_token")
    rows = [
        [
            r["codec"],
            r["mode"] + ("" if r["ratio"] is None else f"@{r['ratio']:g}"),
            f"{r['bytes_per_token']:,.0f}",
            "—" if not raw else f"{r['bytes_per_token'] / raw:.3f}×",
            _num(r.get("read_MBps"), 0),
            _num(r.get("decode_MBps"), 0),
            _num(r["kl_vs_full"], 4),
            _num(r["answer_kl_vs_full"], 4),
            _num(r["em_vs_full"]),
            _num(r["ttft_median_s"]),
        ]
        for r in rows_in
    ]
    return "\n".join(
        [
            _settings_line(data),
            "",
            _table(
                [
                    "codec",
                    "run",
                    "bytes/token",
                    "vs raw fp16",
                    "read MB/s",
                    "decode MB/s",
                    "KL 1st token",
                    "answer KL",
                    "EM vs full",
                    "TTFT p50 (s)",
                ],
                rows,
                2,
            ),
            "",
            "bytes/token: stored bytes per prompt token over all layers (K and V). read: stored MB/s off the archive; "
            "decode: KV MB/s (as fp16) built into the prompt's layers (decompress, dequantize, re-position). "
            "KL from full, which is computed once per record.",
        ]
    )


def pareto_grid(points: list[dict]) -> tuple[list[str], list[list[str]]]:
    """The `--pareto` sweep as (headers, rows): per policy, first-token KL from full (recompute share, TTFT
    speed-up over full) at each ratio. The CLI's table and the markdown one are this grid."""
    ratios = sorted({p["ratio"] for p in points})
    by = {(p["select"], p["ratio"]): p for p in points}
    rows = [
        [policy] + [_pareto_cell(by[policy, r]) if (policy, r) in by else "—" for r in ratios]
        for policy in dict.fromkeys(p["select"] for p in points)
    ]
    return ["policy"] + [f"r={r:g}" for r in ratios], rows


def _pareto_cell(point: dict) -> str:
    speedup = f", {point['speedup']:.2f}×" if point.get("speedup") else ""  # sweeps saved before TTFTs have none
    return f"{point['kl_vs_full']:.4f} ({point['recompute_share']:.1%}{speedup})"


def markdown_pareto(points: list[dict]) -> str:
    """The `--pareto` sweep as a markdown table."""
    if not points:
        return "(no sweep)"
    headers, rows = pareto_grid(points)
    return _table(headers, rows, 1)


def write_outputs(data: dict, out_file: Path | None = None, plot: Path | None = None) -> list[tuple[str, Path]]:
    """Write a bench report's JSON to `out_file` and its charts to `plot` (with a Pareto sweep, the KL-vs-compute
    chart there and the quality-vs-TTFT one beside it as NAME-ttft.png); returns (what, where) per file written."""
    written: list[tuple[str, Path]] = []
    if out_file is not None:
        out_file.write_text(json.dumps(data, indent=2, default=str) + "\n", encoding="utf-8")
        written.append(("report", out_file))
    if plot is not None:
        from kvblend.evaluation.plot import plot_report

        if not data.get("pareto"):
            written.append(("plot", plot_report(data, plot)))
        else:
            from kvblend.evaluation.pareto import plot_pareto

            title = f"{data['model']}: selection policies, {data['records']} records"
            written.append(("plot", plot_pareto(data["pareto"], plot, title, data["machine"])))
            if data["results"]:
                written.append(("plot", plot_report(data, plot.with_name(plot.stem + "-ttft" + plot.suffix))))
    return written
