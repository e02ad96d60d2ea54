"""HKVD selection: at a check layer, keep the cached tokens whose KV deviates most from fresh.

CacheBlend's observation: a few tokens' KV changes a lot once the chunk sees the
rest of the prompt (cross-attention), and the tokens that deviate most at one
layer keep deviating at the next. Recomputing those (top r of the cached tokens)
recovers most of `full`'s quality at a fraction of its compute.
"""

from __future__ import annotations

import math

import torch


def kv_deviation(
    fresh_k: torch.Tensor, fresh_v: torch.Tensor, cached_k: torch.Tensor, cached_v: torch.Tensor, how: str
) -> torch.Tensor:
    """Per-token squared L2 distance between fresh and cached KV, summed over heads and dims."""

    def dist(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        return (a.float() - b.float()).pow(2).sum(dim=(0, 1, 3))

    if how == "k":
        return dist(fresh_k, cached_k)
    if how == "v":
        return dist(fresh_v, cached_v)
    dk, dv = dist(fresh_k, cached_k), dist(fresh_v, cached_v)
    return dk / dk.mean().clamp_min(1e-12) + dv / dv.mean().clamp_min(1e-12)


def select_hkvd(
    active: torch.Tensor | None,
    T: int,
    k: torch.Tensor,
    v: torch.Tensor,
    cached_k: torch.Tensor,
    cached_v: torch.Tensor,
    always: torch.Tensor,
    ratio: float,
    n_cached: int,
    deviation: str,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Keep the top `ratio·n_cached` cached tokens by KV deviation, plus every always-kept token.

    `n_cached` counts the cached tokens whose KV is approximate (the exact prefix excluded).

    Returns the new active positions (ascending) and the rows of the current
    active set they correspond to. Among the current active set only, so several
    check layers filter gradually.
    """
    device = k.device
    current = active if active is not None else torch.arange(T, device=device)
    dev = kv_deviation(k, v, cached_k[:, :, current], cached_v[:, :, current], deviation)
    forced = always[current]
    dev = dev.masked_fill(forced, float("-inf"))
    candidates = int((~forced).sum())
    n_keep = min(candidates, max(1, math.ceil(ratio * n_cached))) if candidates else 0
    keep = forced.clone()
    if n_keep:
        keep[torch.topk(dev, n_keep).indices] = True
    rows = keep.nonzero().squeeze(1)
    return current[rows], rows
