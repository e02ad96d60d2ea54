"""Query benchmark (issue 4): TTFT from the on-disk archive, blend@0.15 vs full, warm and cold.

6 MuSiQue passages (~500 tokens each) archived with `Engine.store_texts`, then
answered through `Engine.query` (KV streamed layer by layer from disk). Modes
interleaved per repetition; cold = the archive's blobs evicted from the page
cache before each query. The warm-up round archives the instruction prefix, as
any first query does; `blend, prefix computed` (warm) shows what that saves.
"""

from __future__ import annotations

import json
import shutil
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, __file__.rsplit("/", 1)[0])
from benchlib import SHARED_DATA, evict_page_cache, machine, median, write_result  # noqa: E402

from kvblend.generation import SamplingConfig  # noqa: E402
from kvblend.pipeline import Engine, QueryOptions  # noqa: E402
from kvblend.prompt import MUSIQUE_TEMPLATE  # noqa: E402


# (page cache, mode, instruction prefix cached), interleaved in this order every repetition
RUNS = [("warm", "full", True), ("warm", "blend", True), ("warm", "blend", False),
        ("cold", "full", True), ("cold", "blend", True)]


def main(records: int = 3, reps: int = 3, compute: str | None = None) -> dict:
    work = Path(tempfile.mkdtemp(prefix="kvblend-bench-query-"))
    try:
        data = json.loads((SHARED_DATA / "musique_dev.json").read_text())[:records]
        engine = Engine(work / "arc", compute=compute)
        engine.warm_up()
        rows: dict[str, dict[str, list[float]]] = {}
        shares: dict[str, float] = {}
        prompt_tokens = []
        for rec in data:
            stored = engine.store_texts([f"{c['title']}\n\n{c['text']}" for c in rec["ctxs"][:6]])
            keys = [r.key for r in stored]
            for rep in range(reps + 1):
                for cache, mode, cache_prefix in RUNS:
                    if cache == "cold":
                        evict_page_cache(work / "arc" / "blobs")
                    opts = QueryOptions(mode=mode, ratio=0.15 if mode == "blend" else None, segment_keys=keys,
                                        template=MUSIQUE_TEMPLATE, sampling=SamplingConfig(max_new_tokens=1),
                                        cache_prefix=cache_prefix)
                    r = engine.query(rec["question"], opts)
                    if rep > 0:  # round 0 warms up
                        variant = "" if cache_prefix else "/prefix-computed"
                        d = rows.setdefault(f"{mode}/{cache}{variant}", {"ttft": [], "wait": [], "read": [], "decompress": []})
                        d["ttft"].append(r.ttft_s)
                        d["wait"].append(r.load_wait_s)
                        stream = getattr(r.fusion, "stream", None)
                        d["read"].append(stream.read_s if stream else 0.0)
                        d["decompress"].append(stream.decompress_s if stream else 0.0)
                        shares[mode + variant] = r.recompute_share
                        prompt_tokens.append(r.prompt_tokens)
        med = {k: {m: median(v) for m, v in d.items()} for k, d in rows.items()}
        result = {
            "machine": machine(),
            "compute": str(engine.runner.device),
            "records": records,
            "reps": reps,
            "prompt_tokens_mean": sum(prompt_tokens) / len(prompt_tokens),
            "median": med,
            "speedup_warm": med["full/warm"]["ttft"] / med["blend/warm"]["ttft"],
            "speedup_cold": med["full/cold"]["ttft"] / med["blend/cold"]["ttft"],
            "load_wait_share_warm": med["blend/warm"]["wait"] / med["blend/warm"]["ttft"],
            "load_wait_share_cold": med["blend/cold"]["wait"] / med["blend/cold"]["ttft"],
            "speedup_warm_prefix_computed": med["full/warm"]["ttft"] / med["blend/warm/prefix-computed"]["ttft"],
            "recompute_share": shares,
        }
        engine.close()
        write_result("query", result)
        return result
    finally:
        shutil.rmtree(work, ignore_errors=True)


def markdown(r: dict) -> str:
    m = r["median"]
    lines = [
        "| page cache | full TTFT | blend@0.15 TTFT | speed-up | blend load wait (share of TTFT) | blend read / decompress (loader threads) |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for cache in ("warm", "cold"):
        f, b = m[f"full/{cache}"], m[f"blend/{cache}"]
        lines.append(
            f"| {cache} | {f['ttft'] * 1000:.0f} ms | {b['ttft'] * 1000:.0f} ms | **{f['ttft'] / b['ttft']:.2f}×** | "
            f"{b['wait'] * 1000:.1f} ms ({b['wait'] / b['ttft']:.1%}) | {b['read'] * 1000:.0f} / {b['decompress'] * 1000:.0f} ms |"
        )
    p = m.get("blend/warm/prefix-computed")
    if p:
        f = m["full/warm"]
        lines.append(
            f"| warm, instruction prefix computed (`--no-prefix-cache`) | {f['ttft'] * 1000:.0f} ms | {p['ttft'] * 1000:.0f} ms | "
            f"{f['ttft'] / p['ttft']:.2f}× | {p['wait'] * 1000:.1f} ms ({p['wait'] / p['ttft']:.1%}) | "
            f"{p['read'] * 1000:.0f} / {p['decompress'] * 1000:.0f} ms |"
        )
    return "\n".join(lines)


if __name__ == "__main__":
    print(markdown(main()))
