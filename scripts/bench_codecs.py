"""Codec benchmark (issue 15): TTFT of blend@0.15 from a lossless, an int8 and an int4 archive, side by side.

The same MuSiQue passages (6 per question) are archived once per codec in one
archive (a lossy codec's segments have keys of their own), then answered
through `Engine.query` with 1 new token. Codecs are interleaved within every
repetition, in an order rotated each time, so load drift hits them alike;
round 0 warms up. Cold = the archive's blobs evicted from the page cache
before each query. Reported: median TTFT, load wait, loader read and build
(decompress + dequantize + re-position) time, and each codec's TTFT relative
to the lossless archive's.

    python scripts/bench_codecs.py [records] [reps]
"""

from __future__ import annotations

import json
import shutil
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, __file__.rsplit("/", 1)[0])
from benchlib import SHARED_DATA, command_line, evict_page_cache, machine, median, write_result  # noqa: E402

from kvblend.generation import SamplingConfig  # noqa: E402
from kvblend.pipeline import Engine, QueryOptions  # noqa: E402
from kvblend.prompt import MUSIQUE_TEMPLATE  # noqa: E402

CODECS = ("zstd-shuffle", "int8", "int4")
CACHES = ("warm", "cold")


def _query(engine: Engine, question: str, keys: list[str]):
    opts = QueryOptions(mode="blend", ratio=0.15, segment_keys=keys, template=MUSIQUE_TEMPLATE,
                        sampling=SamplingConfig(max_new_tokens=1))
    return engine.query(question, opts)


def _runs(rep: int) -> list[tuple[str, str]]:
    """(cache, codec) pairs of one repetition: codecs rotated by the repetition, warm before cold."""
    shift = rep % len(CODECS)
    order = CODECS[shift:] + CODECS[:shift]
    return [(cache, codec) for cache in CACHES for codec in order]


def main(records: int = 3, reps: int = 5, compute: str | None = None) -> dict:
    work = Path(tempfile.mkdtemp(prefix="kvblend-bench-codecs-"))
    try:
        data = json.loads((SHARED_DATA / "musique_dev.json").read_text())[:records]
        engine = Engine(work / "arc", compute=compute)
        engine.warm_up()
        rows: dict[str, dict[str, list[float]]] = {}
        stored: dict[str, list[int]] = {c: [0, 0] for c in CODECS}  # bytes, tokens
        for rec in data:
            texts = [f"{c['title']}\n\n{c['text']}" for c in rec["ctxs"][:6]]
            keys = {}
            for codec in CODECS:
                segs = engine.store_texts(texts, codec=codec)
                keys[codec] = [s.key for s in segs]
                stored[codec][0] += sum(s.stored_bytes for s in segs)
                stored[codec][1] += sum(s.n_tokens for s in segs)
            for rep in range(reps + 1):
                for cache, codec in _runs(rep):
                    if cache == "cold":
                        evict_page_cache(work / "arc" / "blobs")
                    r = _query(engine, rec["question"], keys[codec])
                    if rep == 0:
                        continue  # warm-up round
                    s = r.fusion.stream
                    d = rows.setdefault(f"{codec}/{cache}", {"ttft": [], "wait": [], "read": [], "build": []})
                    d["ttft"].append(r.ttft_s)
                    d["wait"].append(r.load_wait_s)
                    d["read"].append(s.read_s)
                    d["build"].append(s.build_s)
        med = {k: {m: median(v) for m, v in d.items()} for k, d in rows.items()}
        result = {
            "command": command_line(),
            "machine": machine(),
            "compute": str(engine.runner.device),
            "records": records,
            "reps": reps,
            "bytes_per_token": {c: b / t for c, (b, t) in stored.items()},
            "median": med,
            "ttft_vs_lossless": {f"{c}/{cache}": med[f"{c}/{cache}"]["ttft"] / med[f"zstd-shuffle/{cache}"]["ttft"]
                                 for c in CODECS for cache in CACHES},
        }
        engine.close()
        write_result("codecs_ttft", result)
        return result
    finally:
        shutil.rmtree(work, ignore_errors=True)


def markdown(r: dict) -> str:
    lines = ["| codec | page cache | B/token | blend@0.15 TTFT | vs lossless | load wait | read / build (loader) |",
             "|---|---|---:|---:|---:|---:|---:|"]
    for cache in CACHES:
        for codec in CODECS:
            m = r["median"][f"{codec}/{cache}"]
            lines.append(f"| {codec} | {cache} | {r['bytes_per_token'][codec]:,.0f} | {m['ttft'] * 1000:.0f} ms | "
                         f"{r['ttft_vs_lossless'][f'{codec}/{cache}']:.3f}× | {m['wait'] * 1000:.1f} ms | "
                         f"{m['read'] * 1000:.0f} / {m['build'] * 1000:.0f} ms |")
    return "\n".join(lines)


if __name__ == "__main__":
    args = [int(a) for a in sys.argv[1:3]]
    print(markdown(main(*args)))
