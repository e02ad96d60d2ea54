"""Where blend's wall time goes, per stage, before and after issue 20 (one interleaved run).

Records from musique_dev (6 passages each, archived once), answered to the first
token from the archive by `full`, by blend as it was when issue 20 was filed
(the probe choosing at layer 1) and by today's default (the probe choosing
before layer 0), in that order every repetition; the first repetition is a
warm-up. A fourth setting answers like the default from a second archive of the
same passages stored with `ingest --codec zstd --level -1` (zstd's fast mode:
no entropy coding, KV at about its raw size), to show what decoding costs in
the load stage. Per setting: median TTFT, speed-up over full, compute share, and each
stage of the fusion's StageClock (`query -v`) as milliseconds and share of
TTFT. Attention also gets its *work share*: the query-key pairs the kept
queries attend to, over full's T(T+1)/2. Selected tokens sit late in the prompt
and the question attends to every key, so attention's fair share of full's
time is this, not the token share.

    .venv/bin/python scripts/bench_stages.py [--records 3] [--reps 3]   # → bench-out/stages.json + markdown
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, __file__.rsplit("/", 1)[0])
from benchlib import SHARED_DATA, command_line, machine, write_result  # noqa: E402

from kvblend.generation import SamplingConfig  # noqa: E402
from kvblend.pipeline import Engine, QueryOptions  # noqa: E402
from kvblend.prompt import MUSIQUE_TEMPLATE  # noqa: E402

#: archive name → (codec, zstd level) its passages are stored with
ARCHIVES = {"default": ("lossless", 3), "fast": ("zstd", -1)}
#: setting → (archive, query options)
SETTINGS = {
    "full": ("default", {"mode": "full"}),
    "blend, probe at layer 1 (when issue 20 was filed)": ("default", {"mode": "blend", "ratio": 0.15,
                                                                      "check_layers": (1,)}),
    "blend, probe before layer 0 (today's default)": ("default", {"mode": "blend", "ratio": 0.15}),
    "the default from an archive stored with --codec zstd --level -1": ("fast", {"mode": "blend", "ratio": 0.15}),
}
STAGE_ORDER = ("attention", "mlp", "project", "probe", "load", "patch", "gather", "select")


def attention_work_share(selected, total: int) -> float:
    """Query-key pairs of the kept queries (each sees the keys up to its position) over full's."""
    if selected is None:
        return 1.0
    return float((selected.float() + 1).sum()) / (total * (total + 1) / 2)


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--records", type=int, default=3)
    ap.add_argument("--reps", type=int, default=3, help="timed repetitions (after one warm-up)")
    args = ap.parse_args(argv)
    records = json.loads((SHARED_DATA / "musique_dev.json").read_text())[: args.records]
    root = Path(tempfile.mkdtemp(prefix="kvblend-stages-"))
    engines = {name: Engine(root / name, compute="cpu") for name in ARCHIVES}
    keys = {}
    for name, (codec, level) in ARCHIVES.items():
        engines[name].warm_up()
        keys[name] = [[r.key for r in engines[name].store_texts(
            [f"{c['title']}\n\n{c['text']}" for c in rec["ctxs"][:6]], codec=codec, level=level)]
            for rec in records]
    runs: dict[str, list] = {name: [] for name in SETTINGS}
    for rep in range(args.reps + 1):
        for i, rec in enumerate(records):
            for name, (archive, kw) in SETTINGS.items():
                opts = QueryOptions(segment_keys=keys[archive][i], template=MUSIQUE_TEMPLATE,
                                    sampling=SamplingConfig(max_new_tokens=1), **kw)
                res = engines[archive].query(rec["question"], opts)
                if rep:
                    f = res.fusion
                    runs[name].append({"ttft": res.ttft_s, "share": res.recompute_share, "stages": f.stages,
                                       "work": attention_work_share(f.selected, len(f.token_ids))})
    full_ttft = statistics.median(r["ttft"] for r in runs["full"])
    full_attention = statistics.median(r["stages"].get("attention", 0.0) for r in runs["full"])
    rows = []
    for name, rs in runs.items():
        ttft = statistics.median(r["ttft"] for r in rs)
        stages = {s: statistics.median(r["stages"].get(s, 0.0) for r in rs) for s in STAGE_ORDER}
        rows.append({
            "setting": name, "ttft_s": ttft, "speedup": full_ttft / ttft,
            "compute_share": statistics.median(r["share"] for r in rs),
            "attention_work_share": statistics.median(r["work"] for r in rs),
            "attention_vs_full": stages["attention"] / full_attention if full_attention else None,
            "stages_s": stages,
        })
    data = {"command": command_line(), "machine": machine(), "records": len(records), "reps": args.reps,
            "rows": rows, "markdown": markdown(rows)}
    write_result("stages", data)
    print(data["markdown"])
    return data


def markdown(rows: list[dict]) -> str:
    head = "| setting | TTFT | speed-up | compute share | attention work share | attention time vs full's | "
    head += " | ".join(STAGE_ORDER) + " |"
    lines = [head, "|" + "---|" * 1 + "---:|" * (5 + len(STAGE_ORDER))]
    for r in rows:
        cells = [
            r["setting"], f"{r['ttft_s'] * 1000:.0f} ms", f"{r['speedup']:.2f}×", f"{r['compute_share']:.1%}",
            f"{r['attention_work_share']:.1%}",
            f"{r['attention_vs_full']:.1%}" if r["attention_vs_full"] is not None else "—",
        ]
        for s in STAGE_ORDER:
            ms = r["stages_s"][s] * 1000
            cells.append(f"{ms:.0f} ({ms / (r['ttft_s'] * 1000):.0%})" if ms >= 0.5 else "—")
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
