"""Which of a prompt's tokens each mode may take from cache, and which cached layers it reads.

The *exact prefix* is a cached first segment prefilled at position 0 (typically
the prompt's instruction prefix). Causal attention means its KV in this prompt
is exactly the KV it was prefilled with, so no mode but `full` ever recomputes
it, and blend's ratio counts only the cached tokens after it, whose KV is an
approximation.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from kvblend.errors import UsageError
from kvblend.fusion.config import BlendConfig
from kvblend.fusion.probe import probe_rows
from kvblend.fusion.selection import budget
from kvblend.options import Mode, choice
from kvblend.types import Segment


@dataclass
class Plan:
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


def plan_prompt(segments: Sequence[Segment], mode: str) -> Plan:
    """Concatenate segments and decide which positions count as cached for `mode`."""
    choice(Mode, mode, "mode")
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
    return Plan(token_ids, cached_mask, offsets, exact_prefix_tokens(segments, mode, len(token_ids)))


def exact_prefix_tokens(segments: Sequence[Segment], mode: str, total: int) -> int:
    """Tokens of a cached first segment prefilled at position 0: its KV needs no recompute.

    Never the prompt's last token, whose logits must be computed.
    """
    if not segments or not effective_cached(segments[:1], mode)[0] or segments[0].base_position != 0:
        return 0
    return min(len(segments[0].token_ids), total - 1)


def never_recomputed(plan: Plan, mode: str, blend: BlendConfig) -> int:
    """How many leading tokens `blend` leaves to the exact prefix's cached KV.

    None at ratio 1.0: "recompute every cached token" then means exactly `full`,
    bit for bit, not `full` with a prefix read back from 16-bit storage.
    """
    return plan.exact if mode == "blend" and blend.ratios[-1] < 1.0 else 0


def feed_schedule(
    segments: Sequence[Segment], plan: Plan, mode: str, blend: BlendConfig, n_layers: int
) -> dict[int, list[bool]]:
    """The layers whose cached KV the fusor reads from a feed, in order, and which segments' KV
    each needs (the others' rows are recomputed, so loading them would be wasted).

    The fusor reads exactly these layers, so a streaming feed and the fusor never disagree.
    `blend` needs only the exact prefix before its first check layer (every other token is
    computed there), then every cached segment while a selection is in effect (after a check
    that keeps everything, and with no exact prefix, every token is computed: nothing to read);
    with the probe policy it reads every layer first (kvblend.fusion.probe);
    `prefix`/`reuse` need their cached segments at every layer; `full` needs nothing.
    """
    blend = effective_blend(plan, mode, blend)
    use = effective_cached(segments, mode)
    if mode == "full" or not any(use):
        return {}
    if mode != "blend" or blend.probes:
        return {layer: use for layer in range(n_layers)}
    exact = bool(never_recomputed(plan, mode, blend))
    only_exact = [i == 0 for i in range(len(segments))]
    schedule: dict[int, list[bool]] = {}
    ratio = 1.0  # the ratio in effect: that of the last check layer at or below this layer
    checks = dict(zip(blend.check_layers, blend.ratios))
    for layer in range(n_layers):
        ratio = checks.get(layer, ratio)
        if layer >= blend.check_layers[0] and ratio < 1.0:
            schedule[layer] = use
        elif exact:
            schedule[layer] = only_exact
    return schedule


def effective_blend(plan: Plan, mode: str, blend: BlendConfig) -> BlendConfig:
    """The blend configuration this prompt runs: `blend`, unless its probe would cost more than it can save.

    The probe runs its rows (the question, and an uncached instruction prefix) through every layer, and the
    main loop computes them again with the tokens it keeps. Where that comes to at least the whole prompt (a
    prompt mostly uncached: a new system prompt before one short passage), blend computes the whole prompt,
    exactly as `full` (it cost 166% of full's compute). Per layer, as the loop spends it: the probe's rows,
    the tokens always recomputed, and the kept ones (`budget`, the probe's cost taken off). The fusor plans
    with this, and feed_schedule too, so the archive feed streams the layers the fusor reads."""
    if mode != "blend" or not blend.probes:
        return blend
    exact = never_recomputed(plan, mode, blend)
    candidates = plan.cached_mask.clone()
    candidates[:exact] = False
    always = ~plan.cached_mask
    rows = probe_rows(always, candidates, plan.offsets[-1])
    if rows is None:
        return blend
    n_rows, n_approx = int(rows.numel()), int(candidates.sum())
    kept = budget(blend.ratios[0], n_approx, n_rows, 1)  # over every layer: per layer, the rows come off
    if n_rows + int(always.sum()) + kept < len(plan.token_ids):
        return blend
    return BlendConfig(blend.check_layers, (1.0,) * len(blend.ratios), blend.deviation, blend.select)
