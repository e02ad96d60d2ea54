"""The in-memory feed, and laying one layer's cached KV out for the whole prompt.

`assemble_layer` is the one place segments' stored KV becomes a prompt-wide
layer (K rotated to its new offset); the archive feed uses it too, on KV it
has just decoded.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from kvblend.archive.quant import Quantized
from kvblend.errors import UsageError
from kvblend.model.runner import ModelRunner
from kvblend.types import LayerKV, Segment

# (segment index, segment, layer) → that segment's stored layer KV, or None to leave its rows zero.
LayerSource = Callable[[int, Segment, int], "LayerKV | None"]


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
        self.schedule = schedule or {}  # layer -> which segments' KV it needs (fusion.feed_schedule)
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
    layer_of: LayerSource | None = None,
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
        # Cross the bus as stored (16-bit, or a lossy codec's codes); widen while writing into place.
        k = k.to(device=device, non_blocking=True)
        v = v.to(device=device, non_blocking=True)
        place_segment(runner, k, v, offsets[i] - seg.base_position, k_out[0, :, rows], v_out[0, :, rows], index)
    return k_out, v_out


def place_segment(
    runner: ModelRunner, k, v, delta: int, k_dst: torch.Tensor, v_dst: torch.Tensor, layer: int = 0
) -> None:
    """Write one segment's stored K of `layer` (moved `delta` positions) and V into their rows of the layer.

    Quantized KV (kvblend.archive.quant) is dequantized by the same pass that
    writes it: V straight into place, K into place when it needs no rotation,
    else into a temporary that the rotation reads (the rotation cannot run in place).
    """
    if isinstance(k, Quantized):
        if delta == 0:
            k.dequantize(out=k_dst)
        else:
            runner.reposition(k.dequantize(), delta, out=k_dst, layer=layer)
    else:
        runner.reposition(k, delta, out=k_dst, layer=layer)
    if isinstance(v, Quantized):
        v.dequantize(out=v_dst)
    else:
        v_dst.copy_(v)
