"""The fusor: build a prompt's per-layer KV from cached segments, recomputing only what matters.

A prompt is an ordered list of segments; each is either *cached* (its per-layer
K/V was prefilled alone and is supplied) or not. One loop serves all four modes,
because they differ only in which tokens' hidden states flow through each layer
(the *active* set) and where the rest of the KV comes from:

    mode     active tokens per layer                         inactive tokens' KV
    full     all, every layer                                 (none)
    prefix   all tokens after a cached first segment          cached, as loaded
    reuse    uncached tokens + the last token                 cached, as loaded
    blend    all but the exact prefix up to the check layer;  cached, patched with the
             there the top-r cached tokens by KV deviation    active tokens' fresh KV
             (HKVD) stay active, with uncached + last always  (at a check layer: every
             on top                                           scored token's fresh KV)

No mode but `full` recomputes the *exact prefix* (kvblend.fusion.plan says why).
Active tokens attend over the whole (patched) KV with a causal mask on absolute
positions, so compute is proportional to the active count. Several check layers
give the paper's *gradual filtering*: each chooses among the previous survivors.

Cached K arrives post-RoPE at the positions it was prefilled at; the feed
re-rotates it to this prompt's offsets before the fusor sees it.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Protocol, Sequence

import torch

from kvblend.errors import UsageError
from kvblend.feeds.memory import InMemoryFeed
from kvblend.fusion.config import BlendConfig
from kvblend.fusion.plan import feed_schedule, never_recomputed, plan_prompt
from kvblend.fusion.selection import select_hkvd
from kvblend.model.runner import ModelRunner
from kvblend.types import LayerKV, Segment


class CachedKVFeed(Protocol):
    """Supplies, layer by layer, the cached KV of the whole prompt already re-positioned.

    `layer(i)` returns (K, V) shaped [1, kv_heads, T, hd] in the compute dtype on the
    compute device; rows of uncached tokens are arbitrary (the fusor overwrites them).
    The tensors are the fusor's to keep and patch in place: return a fresh pair per call.
    Implementations may prefetch ahead (see kvblend.feeds.archive) and report how long
    the fusor waited.
    """

    def layer(self, index: int) -> LayerKV: ...

    @property
    def wait_s(self) -> float: ...


@dataclass
class FusionResult:
    """A prompt's fused KV, the last token's logits, and what it cost."""

    kv: list[LayerKV]  # per layer [1, kv_heads, T, hd]
    last_logits: torch.Tensor  # [vocab], float32
    token_ids: list[int]
    mode: str
    active_per_layer: list[int]
    recomputed_token_layers: int
    total_token_layers: int
    cached_tokens: int
    exact_prefix_tokens: int = 0  # cached tokens never recomputed: their KV is already exact
    load_wait_s: float = 0.0
    compute_s: float = 0.0
    selected: torch.Tensor | None = None  # positions kept active after the last check layer
    stream: object | None = None  # the archive feed's StreamStats, when the KV was streamed

    @property
    def recompute_share(self) -> float:
        return self.recomputed_token_layers / max(1, self.total_token_layers)


@torch.inference_mode()
def fuse(
    runner: ModelRunner,
    segments: Sequence[Segment],
    mode: str = "blend",
    blend: BlendConfig | None = None,
    feed: CachedKVFeed | None = None,
) -> FusionResult:
    """Build the prompt's KV in `mode`; return it with the last token's logits."""
    blend = blend or BlendConfig()
    if mode == "blend":
        blend.validate(runner.n_layers)
    plan = plan_prompt(segments, mode)
    T = len(plan.token_ids)
    if runner.max_positions and T > runner.max_positions:
        raise UsageError(f"prompt has {T} tokens; the model's context is {runner.max_positions}")
    device = runner.device
    cached_mask = plan.cached_mask.to(device)
    n_cached = int(cached_mask.sum())
    if n_cached and feed is None:
        schedule = feed_schedule(segments, plan, mode, blend, runner.n_layers)
        feed = InMemoryFeed(runner, segments, plan.offsets, schedule)
    mode_effective = mode if n_cached else "full"
    exact = never_recomputed(plan, mode_effective, blend)

    start = time.perf_counter()
    hidden = runner.embed(torch.tensor([plan.token_ids], device=device))  # [1, active, D]
    active = _first_active(mode_effective, cached_mask, exact, T)  # None means every position
    if active is not None:
        hidden = hidden[:, active]
    checks = dict(zip(blend.check_layers, blend.ratios)) if mode_effective == "blend" else {}
    kv, active_counts, hidden, active = _run_layers(
        runner, feed, hidden, active, T, checks, ~cached_mask, n_cached - exact, blend.deviation
    )
    last_logits = runner.logits(hidden[:, -1:])[0, -1]
    compute_s = time.perf_counter() - start
    return FusionResult(
        kv=kv,
        last_logits=last_logits,
        token_ids=plan.token_ids,
        mode=mode,
        active_per_layer=active_counts,
        recomputed_token_layers=sum(active_counts),
        total_token_layers=T * runner.n_layers,
        cached_tokens=n_cached,
        exact_prefix_tokens=exact,
        load_wait_s=feed.wait_s if feed is not None else 0.0,
        compute_s=compute_s,
        selected=active.cpu() if active is not None else None,
    )


def _first_active(mode: str, cached_mask: torch.Tensor, exact: int, T: int) -> torch.Tensor | None:
    """The positions computed at layer 0 (None: every position)."""
    if mode in ("prefix", "reuse"):
        return (~cached_mask).nonzero().squeeze(1)
    if exact:  # blend never recomputes the exact prefix, not even before the check layer
        return torch.arange(exact, T, device=cached_mask.device)
    return None


def _run_layers(
    runner: ModelRunner,
    feed: CachedKVFeed | None,
    hidden: torch.Tensor,
    active: torch.Tensor | None,
    T: int,
    checks: dict[int, float],
    always: torch.Tensor,
    n_approx: int,
    deviation: str,
) -> tuple[list[LayerKV], list[int], torch.Tensor, torch.Tensor | None]:
    """Every layer: fresh QKV for the active tokens, the rest from the feed, HKVD at check layers.

    `always` marks the tokens always recomputed (uncached, incl. the last); `n_approx`
    counts the cached tokens whose KV is approximate (blend's ratio is a share of them).
    Returns the per-layer KV, the active count per layer, the last hidden states and
    the final active set.
    """
    cos_all, sin_all = runner.rope(torch.arange(T, device=runner.device)[None])
    kv_out: list[LayerKV] = []
    active_counts: list[int] = []
    for layer in range(runner.n_layers):
        active_counts.append(T if active is None else int(active.numel()))
        cos, sin = (cos_all, sin_all) if active is None else (cos_all[:, active], sin_all[:, active])
        q, k, v = runner.project_qkv(layer, hidden, cos, sin)
        computed = active  # positions whose fresh K/V this layer has (None: all)
        cached_k = cached_v = None
        if active is not None or layer in checks:
            cached_k, cached_v = feed.layer(layer)
        if layer in checks:
            active, keep_rows = select_hkvd(
                active, T, k, v, cached_k, cached_v, always, checks[layer], n_approx, deviation
            )
            # Only the survivors' queries go on; but every token scored here keeps its fresh
            # K/V in this layer (already paid for, and closer to full than the cached KV).
            q, hidden = q[:, :, keep_rows], hidden[:, keep_rows]
            if active.numel() == T:  # ratio 1.0: exactly the full computation from here on
                active = None
        if computed is None:
            layer_k, layer_v = k, v
        else:
            layer_k, layer_v = cached_k, cached_v  # the feed hands over fresh tensors: patch in place
            layer_k[:, :, computed] = k.to(layer_k.dtype)
            layer_v[:, :, computed] = v.to(layer_v.dtype)
        attn = runner.attend(layer, q, layer_k, layer_v, query_positions=active)
        kv_out.append((layer_k, layer_v))
        hidden = runner.finish_layer(layer, hidden, attn)
    return kv_out, active_counts, hidden, active
