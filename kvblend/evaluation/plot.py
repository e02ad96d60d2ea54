"""Quality vs time to first token (the paper's Fig. 12/16 shape), drawn from a bench report.

matplotlib is optional (`pip install 'kvblend[plot]'`) and imported only here,
inside the functions, so nothing else pays for it.
"""

from __future__ import annotations

import math
import os
from pathlib import Path

from kvblend.errors import UsageError
from kvblend.evaluation.records import ANSWER_KL_TOKENS

# mode → (color, marker, filled, size): prefix hollow and larger, so it shows around full when they coincide
_STYLE = {
    "full": ("black", "s", True, 7),
    "prefix": ("tab:gray", "D", False, 12),
    "reuse": ("tab:red", "v", True, 9),
    "blend": ("tab:blue", "o", True, 8),
}


def check_plot_available(path: Path | None = None) -> None:
    """Fail before the benchmark runs, not after, when --plot cannot be honoured: no matplotlib, or a file
    name whose suffix it cannot write (a traceback after the whole run, and the results lost)."""
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        raise UsageError("--plot needs matplotlib: pip install 'kvblend[plot]' (or pip install matplotlib)") from None
    if path is not None:
        from matplotlib.backend_bases import FigureCanvasBase

        kinds = FigureCanvasBase.get_supported_filetypes()
        if path.suffix and path.suffix.lstrip(".").lower() not in kinds:  # no suffix: it writes PNG
            raise UsageError(
                f"--plot {path}: matplotlib writes no {path.suffix} file; "
                f"name it .png (or one of {', '.join('.' + k for k in sorted(kinds))})"
            )


_CODEC_LINES = ("-", "--", ":", "-.")  # one line style per archive codec, where several ran


def _draw_mode(ax, rows: list[dict], mode: str, key: str, codec: str | None = None, line: str = "-") -> None:
    color, marker, filled, size = _STYLE[mode]
    xs = [r["ttft_median_s"] for r in rows]
    ys = [r[key] for r in rows]
    label = (mode if mode != "blend" else "blend (recompute ratio r)") + (f" [{codec}]" if codec else "")
    ax.plot(
        xs,
        ys,
        marker=marker,
        color=color,
        linestyle=line if len(rows) > 1 else "none",
        markersize=size,
        markerfacecolor=color if filled else "none",
        markeredgewidth=1.5,
        label=label,
        zorder=3 if filled else 2,
        clip_on=False,
    )
    if mode == "blend":
        for j, r in enumerate(rows):  # alternate above/below so neighbouring labels do not collide
            ax.annotate(
                f"r={r['ratio']:g}",
                (r["ttft_median_s"], r[key]),
                textcoords="offset points",
                xytext=(4, 8 if j % 2 == 0 else -14),
                fontsize=8,
                color=color,
            )


def _draw_panel(ax, results: list[dict], key: str, ylabel: str, title: str, x_max: float) -> None:
    # Runs that read archived KV, of several codecs: one line per (mode, codec), named (all were one zigzag line)
    codecs = list(dict.fromkeys(r.get("codec") for r in results if r.get("bytes_per_token") is not None))
    several = len(codecs) > 1
    for mode in ("full", "prefix", "reuse", "blend"):
        of_mode = [r for r in results if r["mode"] == mode]
        groups = (
            [(c, [r for r in of_mode if r.get("codec") == c]) for c in codecs]
            if several and any(r.get("bytes_per_token") is not None for r in of_mode)
            else [(None, of_mode)]
        )
        for codec, group in groups:
            rows = sorted(group, key=lambda r: r["ttft_median_s"])
            if rows:
                line = _CODEC_LINES[codecs.index(codec) % len(_CODEC_LINES)] if codec else "-"
                _draw_mode(ax, rows, mode, key, codec, line)
    ax.set_xlabel("TTFT, median over records (s)")
    ax.set_ylabel(ylabel)
    ax.set_title(title, fontsize=9, color="dimgray")
    ax.grid(True, alpha=0.3)
    ax.set_xlim(0, x_max * 1.1)
    if key == "f1":
        ax.set_ylim(-0.08, 1.04)
    else:
        top = max((r[key] for r in results if math.isfinite(r[key])), default=0.0)
        top = top * 1.15 if top > 0 else 1.0
        ax.set_ylim(-0.04 * top, top)
    ax.legend(fontsize=8, loc="best")


def plot_report(report, path: str | os.PathLike[str]) -> Path:
    """F1 and answer KL against median TTFT, per mode, as a PNG at `path` (a BenchReport or its JSON dict)."""
    check_plot_available()
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    data = report if isinstance(report, dict) else report.to_dict()
    results = [r for r in data["results"] if r.get("ttft_median_s") is not None]
    n_tok = data.get("settings", {}).get("answer_kl_tokens", ANSWER_KL_TOKENS)
    fig = Figure(figsize=(11, 4.8), dpi=150)
    FigureCanvasAgg(fig)
    axes = fig.subplots(1, 2)
    panels = [
        ("f1", "F1 vs gold answers (mean)", "answer quality: higher is better"),
        (
            "answer_kl_vs_full",
            f"answer KL from full (nats, mean over ≤{n_tok} tokens)",
            "divergence from full: lower is better",
        ),
    ]
    x_max = max((r["ttft_median_s"] for r in results), default=1.0) or 1.0
    for ax, (key, ylabel, title) in zip(axes, panels):
        _draw_panel(ax, results, key, ylabel, title, x_max)
    fig.suptitle(f"{data['model']}: quality vs time to first token ({data['records']} records)", fontsize=11)
    fig.text(0.5, 0.008, data.get("machine", ""), ha="center", fontsize=6.5, color="dimgray")
    fig.tight_layout(rect=(0, 0.03, 1, 0.96))
    out = Path(path)
    fig.savefig(out)
    return out
