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

The *exact prefix* is a cached first segment prefilled at position 0 (typically
the prompt's instruction prefix). Causal attention means its KV in this prompt
is exactly the KV it was prefilled with, so no mode but `full` ever recomputes
it, and blend's ratio counts only the cached tokens after it, whose KV is an
approximation.

Active tokens attend over the whole (patched) KV with a causal mask on absolute
positions, so compute is proportional to the active count. Several check layers
give the paper's *gradual filtering*: each chooses among the previous survivors.

Cached K arrives post-RoPE at the positions it was prefilled at; the feed
re-rotates it to this prompt's offsets before the fusor sees it.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from typing import Protocol, Sequence

import torch

from kvblend.errors import UsageError
from kvblend.model import LayerKV, ModelRunner

MODES = ("full", "prefix", "reuse", "blend")
DEVIATIONS = ("k", "v", "kv")
# HKVD measure. V beat K on every fidelity measure on MuSiQue (first-token KL 0.078 vs 0.085,
# answer KL 0.054 vs 0.064, ROUGE-L vs full 0.85 vs 0.77 at r=0.15; BENCHMARKS.md, variants).
DEFAULT_DEVIATION = "v"


@dataclass
class Segment:
    """One piece of the prompt. `kv` (per layer, [kv_heads, n, hd]) makes it cached for in-memory use.

    `base_position` is the position the segment's first token had when its KV was
    prefilled (0 when prefilled alone; >0 when prefilled after a shared sink prefix).
    """

    token_ids: list[int]
    kv: list[LayerKV] | None = None
    cached: bool | None = None
    base_position: int = 0
    key: str | None = None

    def __post_init__(self) -> None:
        if self.cached is None:
            self.cached = self.kv is not None


@dataclass(frozen=True)
class BlendConfig:
    """Check layers and their ratios (fractions of *cached* tokens kept active)."""

    check_layers: tuple[int, ...] = (1,)
    ratios: tuple[float, ...] = (0.15,)
    deviation: str = DEFAULT_DEVIATION

    @classmethod
    def single(cls, ratio: float = 0.15, check_layer: int = 1, deviation: str = DEFAULT_DEVIATION) -> "BlendConfig":
        return cls((check_layer,), (ratio,), deviation)

    @classmethod
    def gradual(cls, ratio: float, check_layers: Sequence[int], deviation: str = DEFAULT_DEVIATION) -> "BlendConfig":
        """The paper's gradual filtering: ratios shrink toward `ratio` at the last check layer.

        r_j = ratio · (1 + 0.5·(n−1−j)/n), e.g. 3 layers at 0.15 → 0.20, 0.175, 0.15.
        """
        n = len(check_layers)
        ratios = tuple(min(1.0, ratio * (1 + 0.5 * (n - 1 - j) / n)) for j in range(n))
        return cls(tuple(check_layers), ratios, deviation)

    def validate(self, n_layers: int) -> None:
        if not self.check_layers:
            raise UsageError("blend needs at least one check layer")
        if len(self.check_layers) != len(self.ratios):
            raise UsageError("give one ratio per check layer")
        for r in self.ratios:
            if not (0.0 < r <= 1.0) or math.isnan(r):
                raise UsageError(f"recompute ratio must be in (0, 1], got {r}")
        if list(self.check_layers) != sorted(set(self.check_layers)):
            raise UsageError("check layers must be distinct and ascending")
        for layer in self.check_layers:
            if not 0 <= layer < n_layers:
                raise UsageError(f"check layer {layer} is beyond the model's depth (layers 0..{n_layers - 1})")
        if list(self.ratios) != sorted(self.ratios, reverse=True):
            raise UsageError("gradual filtering needs non-increasing ratios across check layers")
        if self.deviation not in DEVIATIONS:
            raise UsageError(f"deviation must be one of {', '.join(DEVIATIONS)}")


class CachedKVFeed(Protocol):
    """Supplies, layer by layer, the cached KV of the whole prompt already re-positioned.

    `layer(i)` returns (K, V) shaped [1, kv_heads, T, hd] in the compute dtype on the
    compute device; rows of uncached tokens are arbitrary (the fusor overwrites them).
    The tensors are the fusor's to keep and patch in place: return a fresh pair per call.
    Implementations may prefetch ahead (see kvblend.streaming) and report how long
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

    @property
    def recompute_share(self) -> float:
        return self.recomputed_token_layers / max(1, self.total_token_layers)


@dataclass
class _Plan:
    """Which positions are cached, and the segments' offsets in this prompt."""

    token_ids: list[int]
    cached_mask: torch.Tensor  # [T] bool
    offsets: list[int] = field(default_factory=list)
    exact: int = 0  # leading cached tokens whose KV is exact here (see module docstring)


def effective_cached(segments: Sequence[Segment], mode: str) -> list[bool]:
    """Which segments' cached KV `mode` uses.

    `full` uses none. `prefix` uses only a cached first segment at its own base
    position: segments are prefilled alone, so no later one is an exact prefix.
    """
    if mode == "full":
        return [False] * len(segments)
    if mode == "prefix":
        return [i == 0 and bool(s.cached) and s.base_position == 0 for i, s in enumerate(segments)]
    return [bool(s.cached) for s in segments]


def plan_prompt(segments: Sequence[Segment], mode: str) -> _Plan:
    """Concatenate segments and decide which positions count as cached for `mode`."""
    if mode not in MODES:
        raise UsageError(f"mode must be one of {', '.join(MODES)}, not {mode!r}")
    token_ids: list[int] = []
    flags: list[bool] = []
    offsets: list[int] = []
    for seg, cached in zip(segments, effective_cached(segments, mode)):
        offsets.append(len(token_ids))
        token_ids.extend(seg.token_ids)
        flags.extend([cached] * len(seg.token_ids))
    if not token_ids:
        raise UsageError("empty prompt: nothing to compute")
    cached_mask = torch.tensor(flags, dtype=torch.bool)
    cached_mask[-1] = False  # the last token is always computed: its logits start generation
    return _Plan(token_ids, cached_mask, offsets, exact_prefix_tokens(segments, mode, len(token_ids)))


def exact_prefix_tokens(segments: Sequence[Segment], mode: str, total: int) -> int:
    """Tokens of a cached first segment prefilled at position 0: its KV needs no recompute.

    Never the prompt's last token, whose logits must be computed.
    """
    if not segments or not effective_cached(segments[:1], mode)[0] or segments[0].base_position != 0:
        return 0
    return min(len(segments[0].token_ids), total - 1)


def never_recomputed(plan: _Plan, mode: str, blend: BlendConfig) -> int:
    """How many leading tokens `blend` leaves to the exact prefix's cached KV.

    None at ratio 1.0: "recompute every cached token" then means exactly `full`,
    bit for bit, not `full` with a prefix read back from 16-bit storage.
    """
    return plan.exact if mode == "blend" and blend.ratios[-1] < 1.0 else 0


def feed_schedule(
    segments: Sequence[Segment], plan: _Plan, mode: str, blend: BlendConfig, n_layers: int
) -> dict[int, list[bool]]:
    """The layers whose cached KV the fusor asks a feed for, in order, and which segments' KV
    each needs (the others' rows are recomputed, so loading them would be wasted).

    `blend` needs only the exact prefix before its first check layer (every other token is
    computed there), then every cached segment; `prefix`/`reuse` need their cached
    segments at every layer; `full` needs nothing.
    """
    use = effective_cached(segments, mode)
    if mode == "full" or not any(use):
        return {}
    if mode != "blend":
        return {layer: use for layer in range(n_layers)}
    first_check = blend.check_layers[0]
    only_exact = [i == 0 for i in range(len(segments))]
    early = range(first_check) if never_recomputed(plan, mode, blend) else range(0)
    return {**{layer: only_exact for layer in early}, **{layer: use for layer in range(first_check, n_layers)}}


class InMemoryFeed:
    """A feed over KV already in memory (the Python API, tests, the engine benchmark)."""

    def __init__(
        self,
        runner: ModelRunner,
        segments: Sequence[Segment],
        offsets: Sequence[int],
        schedule: dict[int, list[bool]] | None = None,
    ):
        self.runner = runner
        self.segments = segments
        self.offsets = offsets
        self.schedule = schedule or {}
        self.total = sum(len(s.token_ids) for s in segments)
        self._wait = 0.0

    @property
    def wait_s(self) -> float:
        return self._wait

    def layer(self, index: int) -> LayerKV:
        needed = self.schedule.get(index)

        def layer_of(i: int, seg: Segment, layer: int) -> LayerKV | None:
            if seg.kv is None or (needed is not None and not needed[i]):
                return None
            return seg.kv[layer]

        return assemble_layer(self.runner, self.segments, self.offsets, self.total, index, layer_of)


def assemble_layer(
    runner: ModelRunner,
    segments: Sequence[Segment],
    offsets: Sequence[int],
    total: int,
    index: int,
    layer_of=None,
) -> LayerKV:
    """Lay out one layer's cached KV for the whole prompt, K re-positioned to this prompt.

    `layer_of(seg_idx, seg, index)` fetches a segment's stored layer (default: seg.kv).
    Uncached rows are zero; the fusor always overwrites them. Each segment is written
    straight into the prompt-wide tensors (widened and rotated in one pass, about 1 ms
    a layer for 3,700 tokens on CPU).
    """
    device, dtype = runner.device, runner.dtype
    shape = (1, runner.n_kv_heads, total, runner.head_dim)
    k_out = torch.empty(shape, device=device, dtype=dtype)
    v_out = torch.empty(shape, device=device, dtype=dtype)
    for i, seg in enumerate(segments):
        n = len(seg.token_ids)
        rows = slice(offsets[i], offsets[i] + n)
        stored = layer_of(i, seg, index) if layer_of else (seg.kv[index] if seg.kv is not None else None)
        if stored is None:
            k_out[:, :, rows].zero_()
            v_out[:, :, rows].zero_()
            continue
        k, v = stored
        if k.shape[-2] != n:
            raise UsageError(f"segment {seg.key or i}: cached KV has {k.shape[-2]} tokens, expected {n}")
        # Cross the bus in the stored (16-bit) dtype; widen while writing into place.
        k = k.to(device=device, non_blocking=True)
        v = v.to(device=device, non_blocking=True)
        runner.reposition(k, offsets[i] - seg.base_position, out=k_out[0, :, rows])
        v_out[0, :, rows].copy_(v)
    return k_out, v_out


def _deviation(
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
    ids = torch.tensor([plan.token_ids], device=device)
    all_positions = torch.arange(T, device=device)
    cos_all, sin_all = runner.rope(all_positions[None])
    hidden = runner.embed(ids)  # [1, active, D], active rows follow `active`
    active: torch.Tensor | None = None  # None means every position
    if mode_effective in ("prefix", "reuse"):
        active = (~cached_mask).nonzero().squeeze(1)
        hidden = hidden[:, active]
    elif exact:  # blend never recomputes the exact prefix, not even before the check layer
        active = torch.arange(exact, T, device=device)
        hidden = hidden[:, active]
    checks = dict(zip(blend.check_layers, blend.ratios)) if mode_effective == "blend" else {}
    always = ~cached_mask  # uncached tokens (incl. the last) are always recomputed

    kv_out: list[LayerKV] = []
    active_counts: list[int] = []
    for layer in range(runner.n_layers):
        n_active = T if active is None else int(active.numel())
        active_counts.append(n_active)
        if active is None:
            cos, sin = cos_all, sin_all
        else:
            cos, sin = cos_all[:, active], sin_all[:, active]
        q, k, v = runner.project_qkv(layer, hidden, cos, sin)
        computed = active  # positions whose fresh K/V this layer has (None: all)
        cached_k = cached_v = None
        if active is not None or layer in checks:
            cached_k, cached_v = feed.layer(layer)
        if layer in checks:
            active, keep_rows = _select_hkvd(
                active, T, k, v, cached_k, cached_v, always, checks[layer], n_cached - exact, blend.deviation
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
    last_logits = runner.logits(hidden[:, -1:])[0, -1]
    compute_s = time.perf_counter() - start
    wait = feed.wait_s if feed is not None else 0.0
    return FusionResult(
        kv=kv_out,
        last_logits=last_logits,
        token_ids=plan.token_ids,
        mode=mode,
        active_per_layer=active_counts,
        recomputed_token_layers=sum(active_counts),
        total_token_layers=T * runner.n_layers,
        cached_tokens=n_cached,
        exact_prefix_tokens=exact,
        load_wait_s=wait,
        compute_s=compute_s,
        selected=active.cpu() if active is not None else None,
    )


def _select_hkvd(
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
    dev = _deviation(k, v, cached_k[:, :, current], cached_v[:, :, current], deviation)
    forced = always[current]
    dev = dev.masked_fill(forced, float("-inf"))
    candidates = int((~forced).sum())
    n_keep = min(candidates, max(1, math.ceil(ratio * n_cached))) if candidates else 0
    keep = forced.clone()
    if n_keep:
        keep[torch.topk(dev, n_keep).indices] = True
    rows = keep.nonzero().squeeze(1)
    return current[rows], rows
