"""Citing a large CSV's rows (issue 32): the time `segment_sources` takes for a 200,000-row CSV cut into its
table blocks (one span each, 8,912), and its first and last sources.

    .venv/bin/python scripts/bench_row_citations.py
"""

import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from kvblend import conversion  # noqa: E402
from kvblend.provenance import segment_sources  # noqa: E402


def main() -> None:
    table = conversion.delimited_table("a,b\n" + "".join(f"{i},x{i}\n" for i in range(200_000)), "csv")
    spans, at = [], 0
    for block in table.text.split("\n\n"):  # a span per table block, as the segmenter cuts a table roughly
        spans.append((at, at + len(block)))
        at += len(block) + 2
    started = time.perf_counter()
    sources = segment_sources(table.text, spans, (), table.row_marks)
    seconds = time.perf_counter() - started
    print(f"{len(table.row_marks)} rows, {len(spans)} spans: {seconds:.2f} s; first {sources[0]}, last {sources[-1]}")


if __name__ == "__main__":
    main()
