"""`kvblend bench --pareto`: first-token KL from full against recompute share, per selection policy.

A sweep over ratios for every policy is many fusions, so it measures only what
the chart needs: each record's passages are prefilled alone and held in memory
(the same fp16 KV the archive stores losslessly), full runs once per record for
its first-token logits, then every (policy, ratio) fuses the same prompt and is
scored by KL(full ‖ blend) of the first token and its recompute share (probe
pass included). No decoding, no TTFT: the variants table has those.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from pathlib import Path

from kvblend.defaults import DEFAULT_CHECK_LAYERS
from kvblend.evaluation.harness import RecordRunner
from kvblend.evaluation.metrics import kl_divergence
from kvblend.evaluation.records import QARecord
from kvblend.evaluation.summary import mean
from kvblend.fusion import BlendConfig, fuse
from kvblend.options import SELECTIONS
from kvblend.prompt import MUSIQUE_TEMPLATE, PromptTemplate, assemble_prompt

PARETO_RATIOS = (0.05, 0.1, 0.15, 0.2, 0.3, 0.5)
#: Beside the policies (checked at layer 1): the probe choosing before layer 0 (its scores need no fresh layer).
PROBE_AT_0 = "probe@layer0"
PARETO_SERIES = (*SELECTIONS, PROBE_AT_0)


def series_config(series: str, ratio: float) -> BlendConfig:
    """The blend settings one line of the chart stands for."""
    if series == PROBE_AT_0:
        return BlendConfig.single(ratio, check_layer=0, select="probe")
    return BlendConfig.single(ratio, check_layer=DEFAULT_CHECK_LAYERS[0], select=series)  # all compared at layer 1


def run_pareto(
    runner,
    records: Sequence[QARecord],
    policies: Sequence[str] = PARETO_SERIES,
    ratios: Sequence[float] = PARETO_RATIOS,
    chunks: int | None = None,
    template: PromptTemplate = MUSIQUE_TEMPLATE,
    on_progress: Callable[[int, int, str], None] | None = None,
) -> list[dict]:
    """Mean first-token KL and recompute share per (policy, ratio) over `records`."""
    rr = RecordRunner(runner, template, chunks=chunks)
    kls: dict[tuple[str, float], list[float]] = {(p, r): [] for p in policies for r in ratios}
    shares: dict[tuple[str, float], list[float]] = {key: [] for key in kls}
    total, done = len(records) * len(kls), 0
    for i, record in enumerate(records):
        passages = rr.memory_segments(record, "alone")
        prompt = assemble_prompt(runner, template, record.question, passages)
        reference = fuse(runner, prompt, "full").last_logits.float().cpu()
        for policy, ratio in kls:
            fused = fuse(runner, prompt, "blend", series_config(policy, ratio))
            kls[policy, ratio].append(kl_divergence(reference, fused.last_logits.float().cpu()))
            shares[policy, ratio].append(fused.recompute_share)
            del fused
            done += 1
            if on_progress:
                on_progress(done, total, f"pareto record {i + 1}/{len(records)} {policy}@{ratio:g}")
    return [
        {
            "select": p,
            "ratio": r,
            "kl_vs_full": round(mean(kls[p, r]), 6),
            "recompute_share": round(mean(shares[p, r]), 6),
            "records": len(kls[p, r]),
        }
        for p, r in kls
    ]


def plot_pareto(points: Sequence[dict], path: str | os.PathLike[str], title: str = "", footer: str = "") -> Path:
    """First-token KL against recompute share, one line per policy, as a PNG at `path`."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(7.5, 5), dpi=150)
    FigureCanvasAgg(fig)
    ax = fig.subplots()
    for policy in dict.fromkeys(p["select"] for p in points):
        rows = sorted((p for p in points if p["select"] == policy), key=lambda p: p["recompute_share"])
        ax.plot([100 * p["recompute_share"] for p in rows], [p["kl_vs_full"] for p in rows], marker="o", label=policy)
    ax.axvline(22, color="gray", linestyle=":", linewidth=1)
    ax.set_xlabel("recompute share (% of full's token-layers)")
    ax.set_ylabel("first-token KL from full (nats, mean)")
    ax.set_yscale("log")
    ax.grid(True, alpha=0.3, which="both")
    ax.legend(title="--select", fontsize=8)
    ax.set_title(title or "selection policies: fidelity vs compute", fontsize=10)
    if footer:
        fig.text(0.5, 0.008, footer, ha="center", fontsize=6.5, color="dimgray")
    fig.tight_layout(rect=(0, 0.03, 1, 1))
    out = Path(path)
    fig.savefig(out)
    return out
