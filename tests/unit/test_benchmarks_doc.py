"""BENCHMARKS.md is what scripts/bench_all.py renders from bench-out/ and docs/: a section written into the file by
hand and not into its source (docs/benchmark-sections.md, docs/benchmark-notes*.md) would be lost by the next
`make bench`, as six sections nearly were (2026-11-27)."""

from __future__ import annotations

import sys

from support import REPO


def test_benchmarks_md_is_what_its_sources_render():
    sys.path.insert(0, str(REPO / "scripts"))
    try:
        import bench_all
    finally:
        sys.path.remove(str(REPO / "scripts"))
    rendered = bench_all.render()
    committed = (REPO / "BENCHMARKS.md").read_text()
    assert rendered == committed, "BENCHMARKS.md was edited by hand: put the text in its source under docs/ and re-render"
