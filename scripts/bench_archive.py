"""Archive benchmark (issue 3): ingest overhead vs plain prefill, bytes per token, layer read throughput.

- Ingest throughput (tokens/s) of `Engine.ingest` over MuSiQue passages written as
  files, vs the model's plain batched prefill of exactly the same segments.
- Bytes stored per token vs raw fp16 KV.
- Read + decompress throughput of one layer of 6 segments, cold (page cache
  evicted with POSIX_FADV_DONTNEED) and warm.
"""

from __future__ import annotations

import json
import shutil
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, __file__.rsplit("/", 1)[0])
from benchlib import SHARED_DATA, evict_page_cache, machine, median, write_result  # noqa: E402

from kvblend.model.prefill import precompute_kv  # noqa: E402
from kvblend.pipeline import Engine  # noqa: E402


def passages(n: int) -> list[str]:
    data = json.loads((SHARED_DATA / "musique_dev.json").read_text())
    out = []
    for rec in data:
        for c in rec["ctxs"]:
            out.append(f"{c['title']}\n\n{c['text']}")
            if len(out) == n:
                return out
    return out


def main(n_docs: int = 24, reps: int = 2) -> dict:
    work = Path(tempfile.mkdtemp(prefix="kvblend-bench-archive-"))
    try:
        docs = work / "docs"
        docs.mkdir()
        texts = passages(n_docs)
        for i, t in enumerate(texts):
            (docs / f"p{i:03d}.txt").write_text(t)
        # Warm-up ingest; its segments are exactly what every later ingest makes, so the
        # plain prefill below runs on the same token ids (the reference for the overhead).
        with Engine(work / "warmup") as engine:
            engine.ingest([docs])
            runner = engine.runner
            ids = [rec.token_ids for rec in engine.archive().iter_segments()]
        precompute_kv(runner, ids[:2])  # warm-up
        prefill_s, ingest_s, tokens = [], [], sum(map(len, ids))
        report = None
        for rep in range(reps):  # interleaved: prefill, ingest, prefill, ingest
            t0 = time.perf_counter()
            precompute_kv(runner, ids)
            prefill_s.append(time.perf_counter() - t0)
            arc = work / f"arc{rep}"
            with Engine(arc, runner=runner) as e:
                report = e.ingest([docs])
                ingest_s.append(report.seconds)
                assert report.tokens_new == tokens, (report.tokens_new, tokens)
                stats = e.archive().stats()
        prefill_tps = tokens / median(prefill_s)
        ingest_tps = tokens / median(ingest_s)
        read = layer_read_throughput(work / f"arc{reps - 1}", runner)
        result = {
            "machine": machine(),
            "documents": n_docs,
            "tokens": tokens,
            "prefill_tokens_per_s": prefill_tps,
            "ingest_tokens_per_s": ingest_tps,
            "ingest_overhead": 1 - ingest_tps / prefill_tps,
            "prefill_share_of_ingest": report.prefill_seconds / report.seconds,
            "bytes_per_token_raw_fp16": stats["bytes_per_token_raw"],
            "bytes_per_token_stored": stats["bytes_per_token_stored"],
            "compression_ratio": stats["compression_ratio"],
            **read,
        }
        write_result("archive", result)
        return result
    finally:
        shutil.rmtree(work, ignore_errors=True)


def layer_read_throughput(arc_path: Path, runner, layer: int = 15, reps: int = 5) -> dict:
    """One layer of 6 segments: read (pread + checksum) and decompress, cold and warm."""
    with Engine(arc_path, runner=runner) as e:
        archive = e.archive()
        recs = list(archive.iter_segments())[:6]
        raw_bytes = sum(2 * r.kv_heads * r.n_tokens * r.head_dim * 2 for r in recs)
        out = {}
        for label, cold in (("cold", True), ("warm", False)):
            times, read_times, stored = [], [], 0
            for _ in range(reps):
                if cold:
                    evict_page_cache(arc_path / "blobs")
                t0 = time.perf_counter()
                raws = [archive.read_layer_raw(r, layer) for r in recs]
                t1 = time.perf_counter()
                for r, raw in zip(recs, raws):
                    archive.decode(r, layer, raw)
                t2 = time.perf_counter()
                stored = sum(map(len, raws))
                read_times.append(t1 - t0)
                times.append(t2 - t0)
            out[f"layer_read_{label}_MBps_stored"] = stored / median(read_times) / 1e6
            out[f"layer_read_decompress_{label}_MBps_raw"] = raw_bytes / median(times) / 1e6
            out[f"layer_read_decompress_{label}_ms"] = median(times) * 1000
        out["layer_bytes_raw_6_segments"] = raw_bytes
        return out


def markdown(r: dict) -> str:
    return "\n".join([
        "| measure | value |",
        "|---|---:|",
        f"| documents / tokens | {r['documents']} / {r['tokens']:,} |",
        f"| plain batched prefill | {r['prefill_tokens_per_s']:,.0f} tok/s |",
        f"| `ingest` (segment, prefill, embed, compress, fsync, index) | {r['ingest_tokens_per_s']:,.0f} tok/s |",
        f"| **archive overhead** (1 − ingest/prefill) | **{r['ingest_overhead']:.1%}** |",
        f"| bytes per token, raw fp16 KV | {r['bytes_per_token_raw_fp16']:,.0f} |",
        f"| bytes per token, stored | {r['bytes_per_token_stored']:,.0f} ({r['compression_ratio']:.3f}× smaller) |",
        f"| one layer × 6 segments, read + decompress, cold | {r['layer_read_decompress_cold_MBps_raw']:,.0f} MB/s raw ({r['layer_read_decompress_cold_ms']:.1f} ms) |",
        f"| one layer × 6 segments, read + decompress, warm | {r['layer_read_decompress_warm_MBps_raw']:,.0f} MB/s raw ({r['layer_read_decompress_warm_ms']:.1f} ms) |",
        f"| read only (stored bytes), cold / warm | {r['layer_read_cold_MBps_stored']:,.0f} / {r['layer_read_warm_MBps_stored']:,.0f} MB/s |",
    ])


if __name__ == "__main__":
    print(markdown(main()))
