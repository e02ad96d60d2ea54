"""Commit latency on a 10,000-segment index (issue 35): a query's ``touch`` and an ingest batch commit.

Builds a synthetic archive through the real archive API (tiny two-layer KV per
segment, so the index is full-size while the blobs stay small), then times, in
one process:

* ``touch``: one query's usage-count write (5 segment keys, one LMDB write
  transaction), ``--n`` times;
* ``batch``: one ingest batch (8 new segments: blobs written and fsynced, then
  one index commit), ``--n`` times;
* ``open``: a read-only open of the archive (what every CLI command pays);
* ``check``: the index structure check that ``kvblend verify`` runs.

Self-contained (no benchlib), so a copy of it can time another checkout:
``PYTHONPATH=/work/main python /tmp/bench_commit.py --label main``.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from kvblend.archive import Archive, SegmentRecord

HEADS, TOKENS, DIM, LAYERS = 1, 128, 4, 2
BATCH = 8  # segments per timed ingest batch
TOUCHED = 5  # segments one query touches (its top-k)


def tiny_layers(seed: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    return [
        (torch.randn(HEADS, TOKENS, DIM, generator=g).half(), torch.randn(HEADS, TOKENS, DIM, generator=g).half())
        for _ in range(LAYERS)
    ]


def item(i: int) -> tuple[SegmentRecord, list[tuple[torch.Tensor, torch.Tensor]]]:
    # A realistic record size: ~128 token ids and a paragraph of text, as a 128-token chunk has.
    rec = SegmentRecord(
        key=f"s{i:07d}", token_ids=list(range(i, i + TOKENS)), text=f"segment {i} " + "lorem ipsum " * 50
    )
    return rec, tiny_layers(i)


def build(root: Path, segments: int) -> None:
    layers = tiny_layers(0)
    with Archive.open(root, model_name="bench", model_fingerprint="fp-bench") as ar, ar.writer():
        for start in range(0, segments, 500):
            batch = [(item(i)[0], layers) for i in range(start, min(start + 500, segments))]
            ar.put_segments(batch)


def timings(fn, n: int) -> list[float]:
    out = []
    for i in range(n):
        t0 = time.perf_counter()
        fn(i)
        out.append(time.perf_counter() - t0)
    return out


def summary(xs: list[float]) -> dict[str, float]:
    xs = sorted(xs)
    return {
        "median_ms": statistics.median(xs) * 1000,
        "p90_ms": xs[int(0.9 * (len(xs) - 1))] * 1000,
        "mean_ms": statistics.fmean(xs) * 1000,
        "n": len(xs),
    }


def machine() -> str:
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True, check=True).stdout
        name = next(line.split(":", 1)[1].strip() for line in out.splitlines() if line.startswith("Model name:"))
    except (OSError, subprocess.SubprocessError, StopIteration):
        name = "unknown CPU"
    return f"{name}, {os.cpu_count()} cores, load {os.getloadavg()[0]:.2f}"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--segments", type=int, default=10_000)
    p.add_argument("--n", type=int, default=200, help="timed touches and timed batches each")
    p.add_argument("--label", default="branch", help="names the JSON file: bench-out/commit-<label>.json")
    p.add_argument("--out", type=Path, default=Path(__file__).resolve().parent.parent / "bench-out")
    p.add_argument("--scratch", type=Path, default=None, help="where the archive is built (default: a temp dir)")
    args = p.parse_args()

    scratch = Path(tempfile.mkdtemp(prefix="kvblend-commit-", dir=args.scratch))
    root = scratch / "arc"
    try:
        t0 = time.perf_counter()
        build(root, args.segments)
        build_s = time.perf_counter() - t0
        rng = random.Random(35)
        keys = [f"s{i:07d}" for i in range(args.segments)]
        with Archive.open(root) as ar:
            touch = timings(lambda i: ar.touch(rng.sample(keys, TOUCHED)), args.n)
            with ar.writer():
                batch = timings(
                    lambda i: ar.put_segments([item(args.segments + i * BATCH + j) for j in range(BATCH)]), args.n
                )
        opens = timings(lambda i: Archive.open(root, readonly=True).close(), 20)
        with Archive.open(root, readonly=True) as ar:
            check = timings(lambda i: ar.store.structure_problems(), 5)
        index_bytes = (root / "index" / "data.mdb").stat().st_size
    finally:
        shutil.rmtree(scratch, ignore_errors=True)

    result = {
        "label": args.label,
        "kvblend": str(Path(sys.modules["kvblend"].__file__).resolve().parent.parent),
        "machine": machine(),
        "date": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "segments": args.segments,
        "index_bytes": index_bytes,
        "build_s": build_s,
        "touch": summary(touch),
        "batch": summary(batch),
        "open_readonly": summary(opens),
        "structure_check": summary(check),
    }
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / f"commit-{args.label}.json").write_text(json.dumps(result, indent=2))
    print(
        f"{args.label}: {result['kvblend']} on {result['machine']}; {args.segments} segments, "
        f"data.mdb {index_bytes / 1e6:.1f} MB (built in {build_s:.0f} s)"
    )
    print("| measure | median ms | p90 ms | n |\n|---|---:|---:|---:|")
    for name in ("touch", "batch", "open_readonly", "structure_check"):
        s = result[name]
        print(f"| {name} | {s['median_ms']:.2f} | {s['p90_ms']:.2f} | {s['n']} |")


if __name__ == "__main__":
    main()
