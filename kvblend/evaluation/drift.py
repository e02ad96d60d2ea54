"""What a diverging answer step reads: its attention over the prompt's stale KV (issue 33, point 1).

`bench --drift` finds the first position of full's answer where a mode's greedy token
leaves full's (teacher-forced on full's tokens). This module looks at that step from the
inside: the answer's tokens up to it run again over the mode's fused KV, one chunk through
every layer, and the attention of its query row is split into what lands on *stale*
cached KV (cached tokens neither recomputed nor an exact prefix) and the rest. The same is
read for the answer's first step, the last prompt token: the only step the selection
looks at (the probe scores the question's rows). If the diverging step reads stale tokens
that the first step did not, the selection served the question and missed the answer.

Cost: one forward of (divergence + 1) tokens with attention weights materialised, per
diverging run: a fraction of one answer's decode.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import torch

from kvblend.fusion.fuse import FusionResult
from kvblend.fusion.probe import attention_output
from kvblend.model.runner import ModelRunner

TOP_TOKENS = 20  # the most-read cached tokens compared between the first and the diverging step
TOP_HEADS = 3


@dataclass(frozen=True)
class StaleReading:
    """How much of a step's attention lands on stale KV, and where.

    Masses are shares of the attention probability (0-1), averaged over query heads and the layers
    above the first (whose cached KV is exact for every token).
    """

    step: int  # the answer position examined (the first diverging one)
    stale_share: float  # prompt tokens whose KV was stale: their share of the prompt
    stale_mass: float  # the diverging step's attention on stale KV
    stale_mass_first: float  # the same for the answer's first step (the last prompt token)
    top_stale_share: float  # of the diverging step's TOP_TOKENS most-read cached tokens, the share left stale
    top_overlap_first: float  # their overlap with the first step's TOP_TOKENS most-read cached tokens
    top_positions: list[int]  # the diverging step's most-read stale tokens (prompt positions), most read first
    top_heads: list[tuple[int, int, float]]  # (layer, head, stale mass) that read stale KV most at that step

    def to_dict(self) -> dict:
        d = asdict(self)
        return {k: (round(v, 4) if isinstance(v, float) else v) for k, v in d.items()}


def stale_mask(fusion: FusionResult) -> torch.Tensor:
    """[T] bool: prompt positions whose KV the fusion took from cache as an approximation.

    `approximate_mask` holds the cached positions past the exact instruction prefix; `selected` the
    positions computed after the last check (reuse: the uncached ones; blend: those plus the recomputed
    tokens). None selected means every position was computed (full, blend at 1.0): nothing is stale.
    """
    if fusion.approximate_mask is None or fusion.selected is None:
        return torch.zeros(len(fusion.token_ids), dtype=torch.bool)
    mask = fusion.approximate_mask.clone()
    mask[fusion.selected.cpu()] = False
    return mask


@torch.inference_mode()
def step_attention(runner: ModelRunner, fusion: FusionResult, forced: list[int], step: int) -> torch.Tensor:
    """[layers, heads, 2, T-1]: the attention over the prompt (all but its last token) of the answer's
    first step and of step `step`, teacher-forced on `forced` over the fused KV.

    The chunk is the last prompt token followed by forced[:step], at their positions; its rows'
    K/V are computed fresh (the fusor recomputes the last token too), so row `step` sees exactly
    what generation's step `step` saw.
    """
    T = len(fusion.token_ids)
    ids = torch.tensor([[fusion.token_ids[-1], *forced[:step]]], device=runner.device)
    positions = torch.arange(T - 1, T + step, device=runner.device)
    cos, sin = runner.rope(positions[None])
    hidden = runner.embed(ids)
    rows = []
    for layer, (cached_k, cached_v) in enumerate(fusion.kv):
        q, k, v = runner.project_qkv(layer, hidden, cos, sin)
        keys = torch.cat([cached_k[:, :, : T - 1].to(k.dtype), k], dim=2)
        values = torch.cat([cached_v[:, :, : T - 1].to(v.dtype), v], dim=2)
        probs = runner.attention_weights(layer, q, keys, positions)  # [1, heads, step+1, T+step]
        rows.append(probs[0, :, [0, step], : T - 1].float().cpu())
        hidden = runner.finish_layer(layer, hidden, attention_output(runner, probs, values, hidden.dtype))
    return torch.stack(rows)


def stale_reading(runner: ModelRunner, fusion: FusionResult, forced: list[int], step: int) -> StaleReading | None:
    """The diverging step's reading of stale KV (None when nothing in the prompt is stale)."""
    stale = stale_mask(fusion)[: len(fusion.token_ids) - 1]
    if fusion.approximate_mask is None or not stale.any() or step > len(forced):
        return None
    # Layer 0 is left out: a token's layer-0 K/V depend on itself and its position only, so a cached
    # token's layer 0 is exact wherever it sits (and first-layer heads read broadly: they would lead the list).
    probs = step_attention(runner, fusion, forced, step)[1:]  # [L-1, H, 2, T-1]
    first, diverging = probs[:, :, 0], probs[:, :, 1]
    cached = fusion.approximate_mask[: len(stale)]  # stale or recomputed: where a choice was made
    read_div, read_first = diverging.mean(dim=(0, 1)), first.mean(dim=(0, 1))  # [T-1]
    top_div = _top(read_div, cached)
    top_first = _top(read_first, cached)
    stale_by_head = diverging[:, :, stale].sum(-1)  # [L, H]
    order = stale_by_head.flatten().argsort(descending=True)[:TOP_HEADS]
    heads = stale_by_head.shape[1]
    stale_read = torch.where(stale, read_div, torch.zeros_like(read_div))
    return StaleReading(
        step=step,
        stale_share=float(stale.float().mean()),
        stale_mass=float(stale_by_head.mean()),
        stale_mass_first=float(first[:, :, stale].sum(-1).mean()),
        top_stale_share=float(stale[top_div].float().mean()) if top_div.numel() else 0.0,
        top_overlap_first=len(set(top_div.tolist()) & set(top_first.tolist())) / max(1, top_div.numel()),
        top_positions=stale_read.argsort(descending=True)[: min(TOP_TOKENS, int(stale.sum()))].tolist(),
        top_heads=[(1 + int(i) // heads, int(i) % heads, round(float(stale_by_head.flatten()[i]), 4)) for i in order],
    )


def _top(read: torch.Tensor, among: torch.Tensor) -> torch.Tensor:
    """The TOP_TOKENS positions of `among` that `read` weighs most."""
    masked = torch.where(among, read, torch.full_like(read, -1.0))
    return masked.argsort(descending=True)[: min(TOP_TOKENS, int(among.sum()))]
