"""Selection policies: at a check layer, which cached tokens blend recomputes from there on.

Every policy ranks the *candidates* (the cached tokens whose KV is approximate,
still active) and keeps the same number of them (kvblend.fusion.selection.budget);
the always-recomputed tokens (uncached segments, the question and the template's
tail, the last token) stay on top of that. What differs is the ranking:

    hkvd           CacheBlend: ‖fresh − cached‖² of V (or K, or both: --deviation) at the check layer
    heads          the first HEAD_TOKENS tokens of every cached segment forced (EPIC: a chunk
                   prefilled alone makes its first tokens false attention sinks), HKVD for the rest
    question       the question's attention at the check layer: mean over heads and question rows of
                   softmax(q·Kᵀ), from the fresh layers below (A³-style)
    question+hkvd  question attention and deviation, each divided by its mean over the candidates, summed
    probe          the question's attention over the *stale* cached KV through every layer, from a cheap
                   first pass of only the always-recomputed rows (kvblend.fusion.probe): per layer the
                   maximum over heads, normalised over the candidates, then averaged over layers. Its
                   token-layers come out of the budget.

The scores are over the rows of the current active set, so several check layers
filter gradually (each keeps a subset of the previous survivors).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvblend.fusion.selection import candidate_mean, keep_top, kv_deviation
from kvblend.model.runner import ModelRunner


@dataclass
class Check:
    """What a policy sees at a check layer; every [n] tensor is over the rows of `current`."""

    runner: ModelRunner
    layer: int
    current: torch.Tensor  # [n] active positions (ascending)
    always: torch.Tensor  # [n] bool: recomputed whatever the policy says
    q: torch.Tensor  # [1, heads, n, hd] fresh queries
    k: torch.Tensor  # [1, kv_heads, n, hd] fresh keys / values
    v: torch.Tensor
    cached_k: torch.Tensor  # [1, kv_heads, n, hd] the cached (stale) KV of the same rows
    cached_v: torch.Tensor
    layer_k: torch.Tensor  # [1, kv_heads, T, hd] this layer's keys, fresh rows patched in
    heads: torch.Tensor  # [n] bool: leading tokens of an approximate cached segment
    probe: torch.Tensor | None  # [T] probe scores (policy `probe` only)
    deviation: str


def select(policy: str, check: Check, n_keep: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Apply `policy`: the kept positions (ascending) and their rows in `check.current`."""
    forced = check.heads if policy == "heads" else None
    return keep_top(check.current, check.always, score(policy, check), n_keep, forced)


def score(policy: str, check: Check) -> torch.Tensor:
    """The policy's ranking of the current rows (higher: recompute first); [n] float32."""
    if policy in ("hkvd", "heads"):
        return deviation(check)
    if policy == "question":
        return question_attention(check)
    if policy == "question+hkvd":
        cand = ~check.always
        return candidate_mean(question_attention(check), cand) + candidate_mean(deviation(check), cand)
    if policy == "probe":
        if check.probe is None:
            raise RuntimeError("policy probe needs the probe pass's scores")
        return check.probe[check.current]
    raise ValueError(f"unknown selection policy {policy!r}")


def deviation(check: Check) -> torch.Tensor:
    return kv_deviation(check.k, check.v, check.cached_k, check.cached_v, check.deviation, ~check.always)


def question_rows(positions: torch.Tensor, always: torch.Tensor, candidates: torch.Tensor) -> torch.Tensor:
    """Rows of always-recomputed tokens that come after the first candidate (the question and the
    template's tail): the ones whose attention says which cached tokens the answer reads.
    Falls back to the last row."""
    first = positions[candidates][:1]
    rows = (always & (positions > first[0])).nonzero().squeeze(1) if first.numel() else always.nonzero().squeeze(1)
    return rows if rows.numel() else torch.tensor([positions.numel() - 1], device=positions.device)


def question_attention(check: Check) -> torch.Tensor:
    """Mean attention of the question rows over each current row, at the check layer.

    Every layer below the check layer was computed fresh for every active token, so
    this is the attention `full` would have at this layer up to the exact prefix.
    """
    rows = question_rows(check.current, check.always, ~check.always)
    probs = check.runner.attention_weights(check.layer, check.q[:, :, rows], check.layer_k, check.current[rows])
    return probs[0].mean(dim=(0, 1))[check.current]


def head_mask(
    offsets: list[int], lengths: list[int], approximate: list[bool], total: int, n: int, device: torch.device
) -> torch.Tensor:
    """[total] bool: the first `n` tokens of every segment whose cached KV is approximate."""
    mask = torch.zeros(total, dtype=torch.bool, device=device)
    for off, length, approx in zip(offsets, lengths, approximate):
        if approx:
            mask[off : off + min(n, length)] = True
    return mask
