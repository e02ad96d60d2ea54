"""The budget arithmetic every selection policy shares, and HKVD's KV deviation.

CacheBlend's observation: a few tokens' KV changes a lot once the chunk sees the
rest of the prompt (cross-attention), and the tokens that deviate most at one
layer keep deviating at the next. Recomputing those (top r of the cached tokens)
recovers much of `full`'s quality at a fraction of its compute. Other policies
(kvblend.fusion.policies) rank the candidates differently, but all of them keep
exactly `budget(...)` candidates, forced ones (chunk heads) included, so their
fidelity compares at equal compute.
"""

from __future__ import annotations

import math

import torch


def budget(ratio: float, n_approx: int, extra_token_layers: int = 0, layers_after: int = 1) -> int:
    """How many candidates a check keeps: ⌈ratio·n_approx⌉ (at least one), less the rows that
    `extra_token_layers` of other work (the probe pass) already cost over the `layers_after`
    layers that run the kept set, so every policy at one ratio costs the same compute."""
    n = max(1, math.ceil(ratio * n_approx))
    if extra_token_layers:
        n -= math.ceil(extra_token_layers / max(1, layers_after))
    return max(1, n)


def candidate_mean(x: torch.Tensor, candidates: torch.Tensor) -> torch.Tensor:
    """`x` divided by its mean over the candidates: scores of different scales become comparable.

    Only the candidates: always-recomputed rows have no cached KV (zeros), so their
    'deviation' is the KV's whole norm and would swamp the mean.
    """
    return x / x[candidates].mean().clamp_min(1e-12) if bool(candidates.any()) else x


def kv_deviation(
    fresh_k: torch.Tensor,
    fresh_v: torch.Tensor,
    cached_k: torch.Tensor,
    cached_v: torch.Tensor,
    how: str,
    candidates: torch.Tensor,
) -> torch.Tensor:
    """Per-token squared L2 distance between fresh and cached KV, summed over heads and dims.

    `kv` adds the K and V distances, each normalised by its mean over `candidates`.
    """

    def dist(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        return (a.float() - b.float()).pow(2).sum(dim=(0, 1, 3))

    if how == "k":
        return dist(fresh_k, cached_k)
    if how == "v":
        return dist(fresh_v, cached_v)
    return candidate_mean(dist(fresh_k, cached_k), candidates) + candidate_mean(dist(fresh_v, cached_v), candidates)


def keep_top(
    current: torch.Tensor,
    always: torch.Tensor,
    score: torch.Tensor,
    n_keep: int,
    forced: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Keep every `always` row, the `forced` candidates, then the best-scoring candidates up to
    `n_keep` candidates in all (forced ones count inside it).

    All masks and `score` are over the rows of `current` (the positions still active).
    Returns the kept positions (ascending) and their rows in `current`.
    """
    candidates = ~always
    keep = always.clone()
    if forced is not None:
        forced = forced & candidates
        forced_rows = forced.nonzero().squeeze(1)[:n_keep]  # forced beyond the budget: the first ones
        keep[forced_rows] = True
        n_keep -= int(forced_rows.numel())
        candidates = candidates & ~keep
    n_keep = max(0, min(n_keep, int(candidates.sum())))
    if n_keep:
        ranked = score.float().masked_fill(~candidates, float("-inf"))
        keep[torch.topk(ranked, n_keep).indices] = True
    rows = keep.nonzero().squeeze(1)
    return current[rows], rows
