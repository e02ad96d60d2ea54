"""Citing a large CSV's rows (issue 32): the time `segment_sources` takes for a 200,000-row CSV cut into its
table blocks (one span each, 8,912), and its first and last sources.

    .venv/bin/python scripts/bench_row_citations.py
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import time

from kvblend import conversion
from kvblend.provenance import segment_sources

text = "a,b\n" + "".join(f"{i},x{i}\n" for i in range(200_000))
c = conversion.delimited_table(text, "csv")
# spans: every block (as the segmenter would cut roughly)
blocks = []; at = 0
for p in c.text.split("\n\n"):
    blocks.append((at, at + len(p))); at += len(p) + 2
t = time.perf_counter(); src = segment_sources(c.text, blocks, (), c.row_marks); dt = time.perf_counter() - t
print(len(c.row_marks), "rows", len(blocks), "spans", f"{dt:.2f}s", src[0], src[-1])
