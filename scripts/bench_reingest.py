"""Re-ingesting a folder of PDFs that did not change (issue 32): known by their bytes, against converting them again.

    python scripts/bench_reingest.py [--files 40] [--pages 50] [--out bench-out/reingest.json]

Writes FILES copies of bench_extract's 50-page report PDF (each with its own trailing bytes, so no two files
are equal), ingests them once into a scratch archive with the default model (their text is the same, so the
KV is prefilled once and shared), then times, interleaved, best of 3 each:

- `ingest` again as kvblend does it: a file whose bytes the archive recorded is not converted;
- `ingest` again with that check switched off, as before 2026-11-27: every file converted to text, its
  content hash compared.

Both end with every document unchanged and nothing prefilled.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_extract import big_pdf  # noqa: E402
from benchlib import machine  # noqa: E402

import kvblend.pipeline.ingest as ingest_module  # noqa: E402
from kvblend.pipeline import Engine  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--files", type=int, default=40)
    parser.add_argument("--pages", type=int, default=50)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="kvblend-reingest-") as tmp:
        folder = Path(tmp) / "pdfs"
        folder.mkdir()
        big_pdf(folder / "report.pdf", args.pages)
        data = (folder / "report.pdf").read_bytes()
        (folder / "report.pdf").unlink()
        for i in range(args.files):
            (folder / f"report-{i:03d}.pdf").write_bytes(data + f"\n% copy {i}\n".encode())
        with Engine(Path(tmp) / "archive", compute="cpu") as engine:
            started = time.perf_counter()
            first = engine.ingest([folder])
            first_s = time.perf_counter() - started
            times: dict[str, list[float]] = {"known by bytes": [], "converted again": []}
            real = ingest_module.read_file
            for _ in range(3):
                for label in times:
                    if label == "converted again":  # the check off (no predicate): every file read, as before
                        ingest_module.read_file = lambda source, is_unchanged=None: real(source, None)
                    try:
                        started = time.perf_counter()
                        report = engine.ingest([folder])
                        times[label].append(time.perf_counter() - started)
                    finally:
                        ingest_module.read_file = real
                    assert report.documents_unchanged == args.files and report.tokens_new == 0
    best = {label: min(v) for label, v in times.items()}
    rows = {
        "machine": machine(),
        "files": args.files,
        "pages_each": args.pages,
        "bytes_each": len(data),
        "first_ingest_s": first_s,
        "first_tokens": first.tokens_total,
        "reingest_best_s": best,
        "reingest_all_s": times,
        "speedup": best["converted again"] / best["known by bytes"],
    }
    print(f"{args.files} PDFs of {args.pages} pages ({len(data) / 1e6:.2f} MB each); {rows['machine']}")
    print(f"first ingest: {first_s:.1f} s")
    for label, s in best.items():
        print(f"re-ingest, {label}: {s:.2f} s (best of 3: {', '.join(f'{x:.2f}' for x in times[label])})")
    print(f"known by bytes is {rows['speedup']:.1f}x faster")
    if args.out:
        args.out.write_text(json.dumps(rows, indent=2) + "\n")


if __name__ == "__main__":
    main()
