"""Rotary position embedding, and moving already-rotated K to a new position.

A segment's K is archived post-RoPE at the positions it was prefilled at. RoPE
rotations compose, R(p + Δ) = R(Δ)·R(p), so placing the segment Δ positions
later in a prompt is one more rotation by Δ — no recompute. The rotation is
taken from the model's own rotary embedding (rope scaling included), so the
result equals K computed at the new position.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

RopeFn = Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor]]  # [B, T] positions → cos, sin


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    """HF's RoPE convention: pairs are (i, i + d/2)."""
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate x ([B, heads, T, hd]) by cos/sin broadcast over heads."""
    return x * cos + rotate_half(x) * sin


class Rotations:
    """fp32 cos/sin [head_dim] that move post-RoPE K by `delta` positions; memoised.

    `rope` may return several RoPE kinds side by side ([.., kinds·head_dim], see
    ModelRunner.rope); `kind` picks one. The RoPE kinds kvblend runs (default, linear,
    llama3; kvblend.model.config) scale neither cos nor sin, so the tables are the rotation.
    """

    MAX_ENTRIES = 4096  # offsets repeat across queries; keep the memo bounded

    def __init__(self, rope: RopeFn, head_dim: int):
        self.rope = rope
        self.head_dim = head_dim
        self._memo: dict[tuple[int, str, int], tuple[torch.Tensor, torch.Tensor]] = {}

    def __call__(self, delta: int, device: torch.device, kind: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
        key = (delta, str(device), kind)
        cached = self._memo.get(key)
        if cached is None:
            cos, sin = self.rope(torch.tensor([[delta]], device=device))
            part = slice(kind * self.head_dim, (kind + 1) * self.head_dim)  # the whole table for one kind
            cached = (cos.float().reshape(-1)[part].clone(), sin.float().reshape(-1)[part].clone())
            if len(self._memo) > self.MAX_ENTRIES:
                self._memo.clear()
            self._memo[key] = cached
        return cached


def rotate_k(k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """Rotate K by the fp32 `cos`/`sin` of `Rotations`, computing in fp32.

    With `out` (same shape, any float dtype) the result is written there, so the
    loader can lay segments straight into the prompt-wide layer without a cat.
    In fp32 this is four fused passes over the halves of the HF `rotate_half`
    convention — x·cos + rotate_half(x)·sin, expanded — with no temporaries.
    """
    if out is None or out.dtype != torch.float32:
        k32 = k.float()
        rotated = k32 * cos + rotate_half(k32) * sin
        return rotated.to(k.dtype) if out is None else out.copy_(rotated)
    half = k.shape[-1] // 2
    x1, x2 = k[..., :half], k[..., half:]
    o1, o2 = out[..., :half], out[..., half:]
    torch.mul(x1, cos[:half], out=o1)
    o1.addcmul_(x2, sin[:half], value=-1)
    torch.mul(x2, cos[half:], out=o2)
    o2.addcmul_(x1, sin[half:])
    return out
