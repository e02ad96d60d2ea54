"""What the archive tests share: tiny random KV, bit-exact comparison, and an open archive fixture."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from kvblend.archive import Archive, SegmentRecord

N_LAYERS, HEADS, TOKENS, DIM = 4, 2, 8, 16


def layers(seed: int, dtype=torch.float16, n_layers=N_LAYERS, tokens=TOKENS):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(HEADS, tokens, DIM, generator=g).to(dtype),
             torch.randn(HEADS, tokens, DIM, generator=g).to(dtype)) for _ in range(n_layers)]


def same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bit-identical (an integer view, so -0.0 and NaN payloads count)."""
    return a.dtype == b.dtype and torch.equal(a.view(torch.int16), b.view(torch.int16))


def put(ar: Archive, key: str, seed: int = 0, **kw) -> SegmentRecord:
    rec = SegmentRecord(key=key, token_ids=list(range(TOKENS)), **{"text": f"text of {key}", **kw})
    return ar.put_segment(rec, layers(seed))


def flip_byte(path: Path, offset: int) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        b = f.read(1)
        f.seek(offset)
        f.write(bytes([b[0] ^ 0xFF]))


@pytest.fixture
def ar(tmp_path):
    """A fresh writable archive recorded for a made-up model."""
    archive = Archive.open(tmp_path / "ar", model_name="tiny", model_fingerprint="fp-tiny")
    yield archive
    archive.close()
