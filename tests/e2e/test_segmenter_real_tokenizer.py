"""The segmenter with the default model's real tokenizer: limits hold on real token counts."""

from __future__ import annotations

import importlib.util
import os
import sys
from pathlib import Path

import pytest

from kvblend.defaults import DEFAULT_CHUNK_TOKENS, DEFAULT_GGUF_FILE, DEFAULT_GGUF_PACKAGE
from kvblend.segmenter import split_into_segments
from support import DOCS

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "unit"))
from test_segmenter import make_doc, no_ws  # noqa: E402  (the unit tests' document generator)


@pytest.fixture(scope="module")
def real_count():
    spec = importlib.util.find_spec(DEFAULT_GGUF_PACKAGE)
    if spec is None:
        pytest.skip("default model package not installed")
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(os.path.dirname(spec.origin), gguf_file=DEFAULT_GGUF_FILE)
    return lambda s: len(tok.encode(s, add_special_tokens=False))


def test_100kb_document_splits_within_the_limit_with_a_real_tokenizer(real_count):
    text = "\n\n".join(make_doc(9, 1200, 5, 60))
    assert len(text) > 100_000
    segments = split_into_segments(text, real_count, DEFAULT_CHUNK_TOKENS)
    assert max(real_count(s) for s in segments) <= DEFAULT_CHUNK_TOKENS
    assert no_ws("".join(segments)) == no_ws(text)


def test_bundled_documents_are_about_one_default_chunk(real_count):
    docs = sorted(DOCS.glob("*.md"))
    assert len(docs) == 12
    for f in docs:
        n = real_count(f.read_text(encoding="utf-8"))
        assert 450 <= n <= 550, (f.name, n)


def test_every_segment_of_a_long_table_begins_under_its_header(real_count):
    """A CSV (or XLSX sheet) of 1,000 digit-dense rows: each block of pipe rows fits a default segment, so no
    segment's numbers are left without their column names (blocks of 25 rows alone took ~970 tokens)."""
    import csv
    import io

    from kvblend.conversion import delimited_table

    out = io.StringIO()
    writer = csv.writer(out)
    writer.writerow(["Item", "Quarter", "Cost (EUR)", "Ordered", "With VAT"])
    writer.writerows([f"Part {i % 97}", f"Q{i % 4 + 1}", f"{80 + 0.37 * i:.2f}", f"2026-{i % 12 + 1:02d}-{i % 28 + 1:02d}",
                      f"{(80 + 0.37 * i) * 1.2:.4f}"] for i in range(1000))
    segments = split_into_segments(delimited_table(out.getvalue(), "csv").text, real_count, DEFAULT_CHUNK_TOKENS)
    assert len(segments) > 20
    assert all(s.startswith("| Item | Quarter | Cost (EUR) | Ordered | With VAT |\n|---|") for s in segments)
