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
