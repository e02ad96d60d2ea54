"""`kvblend bench --pareto`: first-token KL from full against recompute share and against TTFT, per policy.

The chart a user reads to pick a setting. Every point is a real query from the
archive (passages archived once per record, outside timing), answered to its
first token: its KL(full ‖ blend) of the first token, its recompute share
(probe pass included), and its TTFT (segment lookup, KV streaming, fusion, the
first token), against `full` on the same record. Within a record the points run
in an order rotated by the record's index, so machine-load drift spreads over
all of them alike. The variants table has decoded answers; this has only what
the charts need.
"""

from __future__ import annotations

import os
import statistics
from collections.abc import Callable, Sequence
from pathlib import Path

from kvblend.defaults import DEFAULT_CHECK_LAYERS
from kvblend.evaluation.harness import RecordRunner
from kvblend.evaluation.metrics import kl_divergence
from kvblend.evaluation.records import PARETO_RATIOS, QARecord
from kvblend.evaluation.specs import RunSpec
from kvblend.evaluation.summary import mean
from kvblend.options import SELECTIONS
from kvblend.prompt import MUSIQUE_TEMPLATE, PromptTemplate

#: Beside the policies (checked at layer 1): the probe choosing before layer 0 (its scores need no fresh layer).
PROBE_AT_0 = "probe@layer0"
PARETO_SERIES = (*SELECTIONS, PROBE_AT_0)


def series_spec(series: str, ratio: float) -> RunSpec:
    """The blend run one point of a line stands for (every policy compared at layer 1, the probe also at 0)."""
    if series == PROBE_AT_0:
        return RunSpec("blend", ratio, check_layers=(0,), select="probe")
    return RunSpec("blend", ratio, check_layers=DEFAULT_CHECK_LAYERS, select=series)


def run_pareto(
    engine,
    records: Sequence[QARecord],
    policies: Sequence[str] = PARETO_SERIES,
    ratios: Sequence[float] = PARETO_RATIOS,
    chunks: int | None = None,
    template: PromptTemplate = MUSIQUE_TEMPLATE,
    on_progress: Callable[[int, int, str], None] | None = None,
) -> list[dict]:
    """Mean first-token KL, mean recompute share and median TTFT per (policy, ratio) over `records`, each point
    with full's median TTFT on the same records (`speedup`: full's median over the point's)."""
    rr = RecordRunner(engine.runner, template, max_new_tokens=1, chunks=chunks, engine=engine)
    points = [(p, r) for p in policies for r in ratios]
    kls: dict[tuple[str, float], list[float]] = {key: [] for key in points}
    shares: dict[tuple[str, float], list[float]] = {key: [] for key in points}
    ttfts: dict[tuple[str, float], list[float]] = {key: [] for key in points}
    full_ttfts: list[float] = []
    total, done = len(records) * (len(points) + 1), 0
    for i, record in enumerate(records):
        keys = [s.key for s in rr.store(record)]
        full = rr.answer(record.question, RunSpec("full"), keys, {})
        reference = full.fusion.last_logits.float().cpu()
        full_ttfts.append(full.ttft_s)
        done += 1
        shift = i % len(points)
        for policy, ratio in points[shift:] + points[:shift]:
            run = rr.answer(record.question, series_spec(policy, ratio), keys, {})
            if run.fusion.token_ids != full.fusion.token_ids:
                raise RuntimeError(f"record {i}: {policy}@{ratio:g} fused another prompt than full")
            kls[policy, ratio].append(kl_divergence(reference, run.fusion.last_logits.float().cpu()))
            shares[policy, ratio].append(run.recompute_share)
            ttfts[policy, ratio].append(run.ttft_s)
            del run
            done += 1
            if on_progress:
                on_progress(done, total, f"pareto record {i + 1}/{len(records)} {policy}@{ratio:g}")
    full_ttft = statistics.median(full_ttfts)
    return [
        {
            "select": p,
            "ratio": r,
            "kl_vs_full": round(mean(kls[p, r]), 6),
            "recompute_share": round(mean(shares[p, r]), 6),
            "ttft_median_s": round(statistics.median(ttfts[p, r]), 4),
            "full_ttft_median_s": round(full_ttft, 4),
            "speedup": round(full_ttft / statistics.median(ttfts[p, r]), 3),
            "records": len(kls[p, r]),
        }
        for p, r in points
    ]


def plot_pareto(points: Sequence[dict], path: str | os.PathLike[str], title: str = "", footer: str = "") -> Path:
    """Two panels, one line per policy: first-token KL against recompute share, and against TTFT from the archive
    (with full's TTFT marked), as a PNG at `path`. A sweep without TTFTs (saved before they were measured) draws
    the first panel alone."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    timed = all(p.get("ttft_median_s") for p in points)
    fig = Figure(figsize=(13, 5) if timed else (7.5, 5), dpi=150)
    FigureCanvasAgg(fig)
    axes = fig.subplots(1, 2 if timed else 1, squeeze=False)[0]
    _draw_lines(axes[0], points, lambda p: 100 * p["recompute_share"])
    axes[0].set_xlabel("recompute share (% of full's token-layers)")
    axes[0].set_title("fidelity vs compute", fontsize=9)
    if timed:
        _draw_lines(axes[1], points, lambda p: 1000 * p["ttft_median_s"])
        full_ms = 1000 * points[0]["full_ttft_median_s"]
        axes[1].axvline(full_ms, color="black", linestyle="--", linewidth=1)
        axes[1].annotate("full", (full_ms, 0.98), xycoords=("data", "axes fraction"), ha="right", va="top", fontsize=7)
        axes[1].set_xlabel("TTFT from the archive (ms, median)")
        axes[1].set_title("fidelity vs wall time (the setting to pick)", fontsize=9)
    fig.suptitle(title or "selection policies", fontsize=10)
    if footer:
        fig.text(0.5, 0.008, footer, ha="center", fontsize=6.5, color="dimgray")
    fig.tight_layout(rect=(0, 0.03, 1, 1))
    out = Path(path)
    fig.savefig(out)
    return out


def _draw_lines(ax, points: Sequence[dict], x: Callable[[dict], float]) -> None:
    for policy in dict.fromkeys(p["select"] for p in points):
        rows = sorted((p for p in points if p["select"] == policy), key=x)
        ax.plot([x(p) for p in rows], [p["kl_vs_full"] for p in rows], marker="o", label=policy)
    ax.set_ylabel("first-token KL from full (nats, mean)")
    ax.set_yscale("log")
    ax.grid(True, alpha=0.3, which="both")
    ax.legend(title="--select", fontsize=8)
