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
             there the top-r cached tokens by the selection   active tokens' fresh KV
             policy stay active, with uncached + last always  (at a check layer: every
             on top (kvblend.fusion.policies)                 scored token's fresh KV)

No mode but `full` recomputes the *exact prefix* (kvblend.fusion.plan says why).
Active tokens attend over the whole (patched) KV with a causal mask on absolute
positions, so compute is proportional to the active count. Several check layers
give the paper's *gradual filtering*: each chooses among the previous survivors.

Cached K arrives post-RoPE at the positions it was prefilled at; the feed
re-rotates it to this prompt's offsets before the fusor sees it.
"""

from __future__ import annotations

import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

from kvblend.defaults import HEAD_TOKENS
from kvblend.errors import UsageError
from kvblend.feeds.memory import InMemoryFeed
from kvblend.fusion.config import BlendConfig
from kvblend.fusion.plan import (
    Plan,
    effective_blend,
    effective_cached,
    feed_schedule,
    never_recomputed,
    plan_prompt,
)
from kvblend.fusion.policies import Check, head_mask, select
from kvblend.fusion.probe import KeptLayers, probe_pass, probe_rows
from kvblend.fusion.selection import budget, keep_top
from kvblend.model.runner import ModelRunner, row_chunks
from kvblend.types import LayerKV, Segment, Steps, drain


class CachedKVFeed(Protocol):
    """Supplies, layer by layer, the cached KV of the whole prompt already re-positioned.

    `layer(i)` returns (K, V) shaped [1, kv_heads, T, hd] in the compute dtype on the
    compute device; rows of uncached tokens are arbitrary (the fusor overwrites them).
    The tensors are the fusor's to keep and patch in place: return a fresh pair per call.
    The fusor asks for exactly the layers of kvblend.fusion.feed_schedule, in order.
    Implementations may prefetch ahead (see kvblend.feeds.archive) and report how long
    the fusor waited.
    """

    def layer(self, index: int) -> LayerKV: ...

    @property
    def wait_s(self) -> float: ...


class StageClock:
    """Wall time of a fusion per stage, so a query can say where blend's time goes beyond its compute share:
    the probe pass, reading each layer's cached KV (loader waits, and on a CPU without spare cores the decode and
    re-rotation too), the Q/K/V projections, gathering and scattering the kept rows, selecting them, attention,
    and o_proj + MLP. CPU tensor ops are synchronous, so the clock measures them; on CUDA a stage's time is the
    time to queue its kernels."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}

    @contextmanager
    def __call__(self, stage: str) -> Iterator[None]:
        t0 = time.perf_counter()
        try:
            yield
        finally:
            self.seconds[stage] = self.seconds.get(stage, 0.0) + time.perf_counter() - t0


@dataclass
class FusionResult:
    """A prompt's fused KV, the last token's logits, and what it cost."""

    kv: list[LayerKV]  # per layer [1, kv_heads, T, hd]
    last_logits: torch.Tensor  # [vocab], float32
    token_ids: list[int]
    mode: str
    active_per_layer: list[int]
    recomputed_token_layers: int  # every token-layer computed, the probe pass's included
    total_token_layers: int
    cached_tokens: int
    exact_prefix_tokens: int = 0  # cached tokens never recomputed: their KV is already exact
    load_wait_s: float = 0.0
    compute_s: float = 0.0
    selected: torch.Tensor | None = None  # positions kept active after the last check layer
    stream: object | None = None  # the archive feed's StreamStats, when the KV was streamed
    select: str | None = None  # blend's selection policy
    probe_token_layers: int = 0  # the probe pass's share of recomputed_token_layers
    stages: dict[str, float] = field(default_factory=dict)  # StageClock: seconds per stage
    approximate_mask: torch.Tensor | None = None  # [T] bool: cached positions whose KV is not exact here

    @property
    def recompute_share(self) -> float:
        return self.recomputed_token_layers / max(1, self.total_token_layers)


def fuse(
    runner: ModelRunner,
    segments: Sequence[Segment],
    mode: str = "blend",
    blend: BlendConfig | None = None,
    feed: CachedKVFeed | None = None,
) -> FusionResult:
    """Build the prompt's KV in `mode`; return it with the last token's logits."""
    return drain(fuse_steps(runner, segments, mode, blend, feed))


@torch.inference_mode()
def fuse_steps(
    runner: ModelRunner,
    segments: Sequence[Segment],
    mode: str = "blend",
    blend: BlendConfig | None = None,
    feed: CachedKVFeed | None = None,
    rows_per_step: int | None = None,
) -> Steps[FusionResult]:
    """:func:`fuse` in steps: it yields after every layer and, with `rows_per_step`, within a layer after
    every `rows_per_step` tokens' projections and every `rows_per_step` queries' attention and MLP, so a
    server can decode other requests' next tokens in between (vLLM's chunked prefill). Without it every layer
    is computed whole, exactly as :func:`fuse` computes it."""
    blend = blend or BlendConfig()
    if mode == "blend":
        blend.validate(runner.n_layers)
    plan = plan_prompt(segments, mode)
    blend = effective_blend(plan, mode, blend)
    T = len(plan.token_ids)
    if runner.max_positions and runner.max_positions < T:
        raise UsageError(f"prompt has {T} tokens; the model's context is {runner.max_positions}")
    device = runner.device
    cached_mask = plan.cached_mask.to(device)
    n_cached = int(cached_mask.sum())
    schedule = feed_schedule(segments, plan, mode, blend, runner.n_layers)
    if n_cached and feed is None:
        feed = InMemoryFeed(runner, segments, plan.offsets, schedule)
    mode_effective = mode if n_cached else "full"
    exact = never_recomputed(plan, mode_effective, blend)

    ids = torch.tensor([plan.token_ids], device=device)
    loop = _LayerLoop(runner, feed, schedule, T, ~cached_mask, n_cached - exact, rows_per_step)
    if mode_effective == "blend" and blend.selects:
        loop.set_selection(blend, plan, _approximate(segments, mode, exact), exact)
    hidden = runner.embed(ids)
    active = _first_active(mode_effective, cached_mask, exact, T)  # None means every position
    if active is not None:
        hidden = hidden[:, active]
    if loop.probing:
        yield from loop.probe(ids)
    hidden, active = yield from loop.run(hidden, active)
    last_logits = runner.logits(hidden[:, -1:])[0, -1]
    compute_s = loop.busy_s()
    return FusionResult(
        kv=loop.kv,
        last_logits=last_logits,
        token_ids=plan.token_ids,
        mode=mode,
        active_per_layer=loop.active_counts,
        recomputed_token_layers=sum(loop.active_counts) + loop.probe_cost,
        total_token_layers=T * runner.n_layers,
        cached_tokens=n_cached,
        exact_prefix_tokens=exact,
        load_wait_s=feed.wait_s if feed is not None else 0.0,
        compute_s=compute_s,
        selected=active.cpu() if active is not None else None,
        select=blend.select if mode == "blend" else None,
        probe_token_layers=loop.probe_cost,
        stages=dict(loop.clock.seconds),
        approximate_mask=_approximate_positions(plan),
    )


def _first_active(mode: str, cached_mask: torch.Tensor, exact: int, T: int) -> torch.Tensor | None:
    """The positions computed at layer 0 (None: every position)."""
    if mode in ("prefix", "reuse"):
        return (~cached_mask).nonzero().squeeze(1)
    if exact:  # blend never recomputes the exact prefix, not even before the check layer
        return torch.arange(exact, T, device=cached_mask.device)
    return None


def _approximate_positions(plan: Plan) -> torch.Tensor:
    """[T] bool (CPU): the cached positions after the exact prefix, whose KV came from a chunk prefilled
    alone (the drift analysis asks which of them a step reads, kvblend.evaluation.drift)."""
    mask = plan.cached_mask.clone()
    mask[: plan.exact] = False
    return mask


def _approximate(segments: Sequence[Segment], mode: str, exact: int) -> list[bool]:
    """Which segments' cached KV is an approximation in this prompt (all cached but an exact prefix)."""
    return [c and not (i == 0 and exact) for i, c in enumerate(effective_cached(segments, mode))]


class _LayerLoop:
    """Every layer: fresh QKV for the active tokens, the rest from the feed, selection at check layers.

    `always` marks the tokens always recomputed (uncached, incl. the last); `n_approx`
    counts the cached tokens whose KV is approximate (blend's ratio is a share of them).
    """

    def __init__(
        self,
        runner: ModelRunner,
        feed: CachedKVFeed | None,
        schedule: dict[int, list[bool]],
        T: int,
        always: torch.Tensor,
        n_approx: int,
        rows_per_step: int | None = None,
    ):
        self.runner, self.feed, self.schedule, self.T = runner, feed, schedule, T
        self.rows = rows_per_step
        self.clock = StageClock()
        self._busy, self._resumed = 0.0, time.perf_counter()
        self.always, self.n_approx = always, n_approx
        self.checks: dict[int, float] = {}
        self.blend = BlendConfig()  # set_selection's, when blend selects
        # masks over positions, set by set_selection (and the probe's scores by probe): none for other modes
        self.heads: Any = None
        self.candidates: Any = None
        self.probe_scores: Any = None
        self.probe_cost = 0
        self.probing = False
        self.question_start = T
        self.cos_all, self.sin_all = runner.rope(torch.arange(T, device=runner.device)[None])
        self.kv: list[LayerKV] = []
        self.active_counts: list[int] = []

    def set_selection(self, blend: BlendConfig, plan: Plan, approximate: list[bool], exact: int) -> None:
        self.blend, self.checks, self.probing = blend, dict(zip(blend.check_layers, blend.ratios)), blend.probes
        lengths = [b - a for a, b in zip(plan.offsets, [*plan.offsets[1:], self.T])]
        device = self.runner.device
        self.heads = head_mask(plan.offsets, lengths, approximate, self.T, HEAD_TOKENS, device)
        self.question_start = plan.offsets[-1]  # the last segment: the question and the template's tail
        self.candidates = ~self.always
        self.candidates[:exact] = False

    def busy_s(self) -> float:
        """Time spent computing, not counting the pauses at :meth:`pause` (other requests' turns)."""
        return self._busy + time.perf_counter() - self._resumed

    def pause(self) -> Steps[None]:
        """A safe point between units of work."""
        self._busy += time.perf_counter() - self._resumed
        yield None
        self._resumed = time.perf_counter()

    def probe(self, ids: torch.Tensor) -> Steps[None]:
        """The probe pass (kvblend.fusion.probe); the main loop then reads the layers it kept.

        Its rows are the question's (the last segment: the question and the template's tail) and the recomputed
        tokens before the first cached one (the instruction prefix when it is not cached; of a longer run only
        its first PROBE_LEADING_SINK tokens, the attention sink). A passage computed in the prompt (one a server
        may not store, or one too long to) is left out, and out of the rows' attention: the main loop computes
        it anyway, and the pass computed it a second time (an 8,000-token passage took two full prefills' time
        and 6 GB for its attention probabilities). With nothing cached to select from there is no pass."""
        rows = probe_rows(self.always, self.candidates, self.question_start)
        if rows is None:
            self.probe_scores = torch.zeros(self.T, dtype=torch.float32, device=ids.device)
            return
        probed = torch.zeros_like(self.always)
        probed[rows] = True
        hidden = self.always & ~probed
        score_from = int(torch.searchsorted(rows, torch.tensor(self.question_start, device=rows.device)))
        self.probe_scores, kept = yield from probe_pass(
            self.runner,
            self.feed,
            ids,
            rows,
            score_from,
            self.candidates,
            self.cos_all,
            self.sin_all,
            self.pause,
            self.clock,
            hidden if bool(hidden.any()) else None,
        )
        self.probe_cost = int(rows.numel()) * self.runner.n_layers
        self.feed = KeptLayers(kept)

    def run(self, hidden: torch.Tensor, active: torch.Tensor | None) -> Steps[tuple[torch.Tensor, torch.Tensor | None]]:
        """All layers; returns the last hidden states and the final active set."""
        runner, T = self.runner, self.T
        for layer in range(runner.n_layers):
            if layer == 0 and 0 in self.checks:
                active, hidden = self._preselect(active, hidden)
            self.active_counts.append(T if active is None else int(active.numel()))
            with self.clock("gather"):
                cos, sin = (
                    (self.cos_all, self.sin_all)
                    if active is None
                    else (self.cos_all[:, active], self.sin_all[:, active])
                )
            q, k, v = yield from self._project(layer, hidden, cos, sin)
            computed = active  # positions whose fresh K/V this layer has (None: all)
            ratio = self.checks.get(layer, 1.0) if layer else 1.0  # a layer-0 check was made before it
            with self.clock("load"):
                cached_k, cached_v = self._read(layer, needed=active is not None or ratio < 1.0)
            current = active if active is not None else torch.arange(T, device=runner.device)
            stale = None
            if ratio < 1.0:
                assert cached_k is not None and cached_v is not None
                with self.clock("gather"):
                    stale = (cached_k[:, :, current], cached_v[:, :, current])
            if computed is None:
                layer_k, layer_v = k, v
            else:
                assert cached_k is not None and cached_v is not None
                layer_k, layer_v = cached_k, cached_v  # the feed hands over fresh tensors: patch in place
                with self.clock("patch"):
                    layer_k[:, :, computed] = k.to(layer_k.dtype)
                    layer_v[:, :, computed] = v.to(layer_v.dtype)
            if stale is not None:
                check = Check(
                    runner,
                    layer,
                    current,
                    self.always[current],
                    q,
                    k,
                    v,
                    *stale,
                    layer_k,
                    self.heads[current],
                    self.probe_scores,
                    self.blend.deviation,
                )
                n_keep = budget(ratio, self.n_approx, self.probe_cost, runner.n_layers - self.blend.check_layers[0] - 1)
                with self.clock("select"):
                    active, keep_rows = select(self.blend.select, check, n_keep)
                # Only the survivors' queries go on; but every token scored here keeps its fresh
                # K/V in this layer (already paid for, and closer to full than the cached KV).
                with self.clock("gather"):
                    q, hidden = q[:, :, keep_rows], hidden[:, keep_rows]
                if active.numel() == T:  # everything kept: exactly the full computation from here on
                    active = None
            hidden = yield from self._attend_and_finish(layer, q, layer_k, layer_v, active, hidden)
            self.kv.append((layer_k, layer_v))
            yield from self.pause()
        return hidden, active

    def _chunks(self, n: int) -> list[slice]:
        """Row ranges of at most `rows_per_step` (one range: the whole layer at once, as fuse() computes it)."""
        return row_chunks(n, self.rows)

    def _project(
        self, layer: int, hidden: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
    ) -> Steps[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
        """Q/K/V of the active rows (a token's projections depend only on its own hidden state)."""
        chunks = self._chunks(hidden.shape[1])
        if len(chunks) == 1:
            with self.clock("project"):
                return self.runner.project_qkv(layer, hidden, cos, sin)
        parts = []
        for rows in chunks:
            with self.clock("project"):
                parts.append(self.runner.project_qkv(layer, hidden[:, rows], cos[:, rows], sin[:, rows]))
            yield from self.pause()
        q, k, v = (torch.cat(t, dim=2) for t in zip(*parts))
        return q, k, v

    def _attend_and_finish(
        self,
        layer: int,
        q: torch.Tensor,
        layer_k: torch.Tensor,
        layer_v: torch.Tensor,
        active: torch.Tensor | None,
        hidden: torch.Tensor,
    ) -> Steps[torch.Tensor]:
        """Attention of the kept queries over the layer's whole KV, then o_proj + MLP: by query rows when
        chunked (every key is already in place, so each chunk sees exactly what the whole would)."""
        runner, chunks = self.runner, self._chunks(q.shape[2])
        if len(chunks) == 1:
            with self.clock("attention"):
                attn = runner.attend(layer, q, layer_k, layer_v, query_positions=active)
            with self.clock("mlp"):
                return runner.finish_layer(layer, hidden, attn)
        positions = active if active is not None else torch.arange(self.T, device=q.device)
        parts = []
        for rows in chunks:
            with self.clock("attention"):
                attn = runner.attend(layer, q[:, :, rows], layer_k, layer_v, query_positions=positions[rows])
            with self.clock("mlp"):
                parts.append(runner.finish_layer(layer, hidden[:, rows], attn))
            yield from self.pause()
        return torch.cat(parts, dim=1)

    def _preselect(self, active: torch.Tensor | None, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """A check at layer 0 (the probe's only, see BlendConfig.validate): the probe's scores need no
        fresh layer, so the kept set is chosen before any layer runs and every layer runs only it.
        A token's layer-0 KV does not depend on the others, so the cached layer 0 is already exact."""
        current = active if active is not None else torch.arange(self.T, device=self.runner.device)
        n_keep = budget(self.checks[0], self.n_approx, self.probe_cost, self.runner.n_layers)
        kept, rows = keep_top(current, self.always[current], self.probe_scores[current], n_keep)
        return kept, hidden[:, rows]

    def _read(self, layer: int, needed: bool) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """Exactly the schedule's layers are read (a streaming feed hands each once, in order)."""
        if layer not in self.schedule:
            if needed:
                raise RuntimeError(f"the fusor needs cached layer {layer}, which the feed schedule leaves out")
            return None, None
        assert self.feed is not None, "a layer the schedule lists needs a feed"
        return self.feed.layer(layer)
