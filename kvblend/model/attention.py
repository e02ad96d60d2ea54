"""Attention kernels for the runner: all queries, a suffix of queries, or scattered queries.

All are causal on absolute positions, GQA-native (`enable_gqa`), and take q as
[B, heads, Tq, hd] and K/V as [B, kv_heads, Tk, hd]. Which one runs is the
runner's choice (ModelRunner.attend); cost should track the number of queries:

- dense_causal: every position is a query (prefill, `full`);
- dense_suffix: every position after a short skipped prefix (prefix mode, blend
  before its check layer when the exact prefix is cached);
- sparse_queries: any ascending subset (blend after its check layer, decoding),
  and every query set under a sliding window shorter than the keys.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F

from kvblend.model import quant_kernels

# Query blocks of 64 measured fastest on CPU (26 ms vs 40 ms unblocked for 555 of 3,700 tokens).
QUERY_BLOCK = 64


def dense_causal(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """Every key position is also a query position."""
    return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, enable_gqa=True)


def last_query(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, visible: torch.Tensor | None = None
) -> torch.Tensor:
    """One query at the newest position: it may see every key, so no mask (decoding, one token per step).
    `visible` ([1, Tk] bool, visible_keys) leaves keys out instead, for a step that attends over a whole
    fixed-size buffer (kvblend.generation.decode.StaticStep: positions past the query, or outside a window).

    On the CPU kvblend's own kernel (kvblend.model.quant_kernels) attends fp32 or fp16 K/V as they lie in a
    decode buffer, 16-bit values widened in registers: on a 2-core AMD EPYC (Zen 4), 30 layers of 3,656
    keys took 9.7-10.6 ms over fp32 K/V and 5.4-6.0 ms over fp16, against 19.3 ms for SDPA over fp32 and
    13.5-18 ms for the widening path below. Without the kernel (no C compiler), K/V held in 16 bits under fp32 compute
    are widened one layer at a time, so the widened copy is read back from cache rather than memory, and
    attended as a grouped matmul: on an AVX2-only EPYC that took 16.6 ms against 18.3 ms for SDPA over fp32
    K/V, while SDPA over the widened tensors took 83 ms and SDPA in bf16 or fp16 79-124 ms (no native
    16-bit arithmetic there)."""
    if q.device.type == "cpu" and visible is None and (kernels := quant_kernels.kernels()) is not None:
        out = kernels.decode_attention(q, k, v, scale)
        if out is not None:
            return out
    if k.dtype == q.dtype:
        mask = None if visible is None else visible.view(1, 1, 1, -1)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=True)
    b, heads, tq, hd = q.shape
    kv_heads = k.shape[1]
    grouped = q.reshape(b, kv_heads, heads // kv_heads * tq, hd)  # GQA: a KV head's query heads stacked
    scores = torch.matmul(grouped, k.to(q.dtype).transpose(-1, -2)).mul_(scale)
    if visible is not None:
        scores = scores.masked_fill(~visible, float("-inf"))
    out = torch.matmul(torch.softmax(scores, dim=-1), v.to(q.dtype))
    return out.view(b, heads, tq, hd)


def is_short_suffix(query_positions: torch.Tensor, n_keys: int) -> bool:
    """Are the queries exactly positions p..n_keys-1 with p at most a quarter of the keys?

    Then padding the p skipped rows costs less than the masked blocked kernel's ~20%
    overhead on the rest (measured: 121 ms dense vs 148 ms blocked for 3,650 of 3,710).
    """
    n = query_positions.numel()
    skip = n_keys - n
    if n == 0 or skip > n_keys // 4:
        return False
    return int(query_positions[0]) == skip and int(query_positions[-1]) == n_keys - 1


def dense_suffix(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """Queries are the last Tq positions: the dense causal kernel over zero-padded queries."""
    n_keys = k.shape[2]
    skip = n_keys - q.shape[2]
    padded = q.new_zeros((*q.shape[:2], n_keys, q.shape[3]))
    padded[:, :, skip:] = q
    return dense_causal(padded, k, v, scale)[:, :, skip:]


class QueryBlock(NamedTuple):
    """One block of queries: its rows, the key range they can see, and an additive mask."""

    start: int
    stop: int
    lo: int
    hi: int
    bias: torch.Tensor  # [1, 1, stop - start, hi - lo], 0 where allowed, -inf elsewhere


#: On CUDA a block's mask may hold this many elements (32 MB in bf16): blocks as large as that, so a query
#: set is one attention call where it fits. Small blocks pay on the CPU (QUERY_BLOCK); on a GPU each block is
#: a launch and its plan a host sync, and 47 blocks a layer made Gemma 3's windowed `full` prefill of 2,980
#: tokens take 369 ms on an H200 (BENCHMARKS.md, "On an H100").
CUDA_MASK_ELEMENTS = 1 << 24


def block_rows(device: torch.device, n_keys: int) -> int:
    """Queries per block: QUERY_BLOCK on the CPU, as many as CUDA_MASK_ELEMENTS allows on a GPU."""
    if device.type == "cpu":
        return QUERY_BLOCK
    return max(QUERY_BLOCK, CUDA_MASK_ELEMENTS // max(1, n_keys))


class QueryBlockPlanner:
    """Builds the block plan of a query set, memoised for the same query tensor, one plan per window.

    After the check layer the fusor keeps one set of query positions for all remaining layers, so the
    masks are built once per fusion and window (Gemma's local and global layers alternate), not per layer.
    """

    def __init__(self, dtype: torch.dtype):
        self.dtype = dtype
        self._positions: torch.Tensor | None = None  # held, so identity cannot be reused by another tensor
        self._n_keys = -1
        self._plans: dict[int | None, list[QueryBlock]] = {}

    def plan(self, query_positions: torch.Tensor, n_keys: int, window: int | None) -> list[QueryBlock]:
        if query_positions is not self._positions or n_keys != self._n_keys:
            self._positions, self._n_keys, self._plans = query_positions, n_keys, {}
        if window not in self._plans:
            self._plans[window] = self._build(query_positions, n_keys, window)
        return self._plans[window]

    def _build(self, query_positions: torch.Tensor, n_keys: int, window: int | None) -> list[QueryBlock]:
        key_positions = torch.arange(n_keys, device=query_positions.device)
        rows = block_rows(query_positions.device, n_keys)
        bounds = query_positions[::rows].tolist(), query_positions[rows - 1 :: rows].tolist()
        last = int(query_positions[-1])
        blocks = []
        for i, start in enumerate(range(0, query_positions.numel(), rows)):
            pos = query_positions[start : start + rows]
            hi = (bounds[1][i] if i < len(bounds[1]) else last) + 1
            lo = max(0, bounds[0][i] - window + 1) if window is not None else 0
            delta = pos[:, None] - key_positions[None, lo:hi]
            allowed = delta >= 0
            if window is not None:
                allowed &= delta < window
            # Additive float mask, built once: SDPA would convert a bool mask on every call (every layer).
            bias = torch.zeros(allowed.shape, dtype=self.dtype, device=allowed.device)
            bias.masked_fill_(~allowed, float("-inf"))
            blocks.append(QueryBlock(start, start + pos.numel(), lo, hi, bias[None, None]))
        return blocks


def sparse_queries(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, blocks: list[QueryBlock], scale: float
) -> torch.Tensor:
    """Scattered queries over all keys, causal on absolute positions.

    Queries go in ascending blocks, each attending only to keys up to its last
    position (and from its first position's window start): this recovers the
    triangle that a dense causal kernel skips, so cost tracks the kept fraction.
    """
    outs = [
        F.scaled_dot_product_attention(
            q[:, :, b.start : b.stop],
            k[:, :, b.lo : b.hi],
            v[:, :, b.lo : b.hi],
            attn_mask=b.bias,
            scale=scale,
            enable_gqa=True,
        )
        for b in blocks
    ]
    return outs[0] if len(outs) == 1 else torch.cat(outs, dim=2)


def visible_keys(query_positions: torch.Tensor, n_keys: int, window: int | None = None) -> torch.Tensor:
    """[Tq, Tk] bool: True where a query at its absolute position may see a key (at or before it, and inside
    `window` positions of it when the layer has one). Device ops only, so a CUDA graph can capture it."""
    delta = query_positions[:, None] - torch.arange(n_keys, device=query_positions.device)[None]
    visible = delta >= 0
    if window is not None:
        visible &= delta < window
    return visible


def causal_bias(query_positions: torch.Tensor, n_keys: int, window: int | None = None) -> torch.Tensor:
    """[Tq, Tk] fp32 additive mask: 0 where a query at its absolute position may see a key, -inf elsewhere."""
    visible = visible_keys(query_positions, n_keys, window)
    return torch.zeros(visible.shape, device=visible.device).masked_fill_(~visible, float("-inf"))


def attention_probs(q: torch.Tensor, k: torch.Tensor, bias: torch.Tensor, scale: float) -> torch.Tensor:
    """Attention probabilities of a few queries over every key, in fp32, under an additive `bias`
    (causal_bias). q: [B, heads, Tq, hd]; k: [B, kv_heads, Tk, hd] → [B, heads, Tq, Tk].

    For scoring (which tokens the question reads) and small query sets: it materialises
    the whole matrix.
    """
    b, heads, tq, hd = q.shape
    kv_heads = k.shape[1]
    grouped = (q.float() * scale).reshape(b, kv_heads, heads // kv_heads * tq, hd)  # GQA: query heads stacked
    scores = torch.matmul(grouped, k.float().transpose(-1, -2)).view(b, heads, tq, -1)
    return torch.softmax(scores.add_(bias), dim=-1)
