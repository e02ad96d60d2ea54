"""The probe pass: where does the question look when it reads the cached KV as is?

Before blend's layer loop, the always-recomputed tokens alone (the uncached
segments: the question and the template's tail, the last token) run through
every layer over the *stale* cached KV, as `reuse` would compute them. Their
attention at every layer tells which cached tokens the answer depends on, all
the way up, not only at the shallow check layer; those are the tokens worth
recomputing. It costs (always-recomputed rows × layers) token-layers, which the
fusor counts in the recompute share and takes out of the selection's budget.

The pass needs every layer of cached KV before the main loop starts, and a
streaming feed hands each layer once, in order. So the probe keeps the layers it
reads and the main loop reads them back from memory (KeptLayers) instead of the
feed: no second load, and no extra peak memory either, since the fused result
holds every layer's KV in the end anyway (the kept tensors *are* those layers,
patched in place).
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext

import torch

from kvblend.model.runner import ModelRunner
from kvblend.types import LayerKV, Steps

# The probe's rows before the first cached token: all of them up to PROBE_LEADING_MAX (an instruction prefix not yet
# cached, ~60 tokens), else only the first PROBE_LEADING_SINK (the attention sink every row leans on).
PROBE_LEADING_MAX = 256
PROBE_LEADING_SINK = 64


def probe_rows(always: torch.Tensor, candidates: torch.Tensor, question_start: int) -> torch.Tensor | None:
    """The positions the probe pass runs (ascending), None where nothing cached is left to select from.

    The question's rows (the last segment: the question and the template's tail) and the recomputed tokens
    before the first cached one (of more than PROBE_LEADING_MAX, the first PROBE_LEADING_SINK). `always`:
    the positions always recomputed; `candidates`: the cached positions a selection may recompute."""
    positions = torch.arange(always.numel(), device=always.device)
    cached = positions[candidates]
    if not cached.numel():
        return None
    first = int(cached[0])
    probed = always.clone()
    probed[first:question_start] = False
    if int(probed[:first].sum()) > PROBE_LEADING_MAX:
        probed[PROBE_LEADING_SINK:first] = False
    return positions[probed]


class KeptLayers:
    """A feed over layers already read: the main loop's source after a probe pass."""

    def __init__(self, layers: list[LayerKV]):
        self._layers = layers

    @property
    def wait_s(self) -> float:
        return 0.0  # the waiting happened while the probe read the layers: the first feed counts it

    def layer(self, index: int) -> LayerKV:
        return self._layers[index]


def probe_pass(
    runner: ModelRunner,
    feed,
    token_ids: torch.Tensor,
    rows: torch.Tensor,
    score_from: int,
    candidates: torch.Tensor,
    cos_all: torch.Tensor,
    sin_all: torch.Tensor,
    pause: Callable[[], Steps[None]] | None = None,
    clock: Callable[[str], AbstractContextManager[None]] | None = None,
    hidden_keys: torch.Tensor | None = None,
) -> Steps[tuple[torch.Tensor, list[LayerKV]]]:
    """Run the `rows` (positions, ascending) through every layer over the feed's cached KV.

    In steps: it yields (through `pause`) after every layer. Returns the probe score per position
    ([T] float32: per layer, the maximum over heads of the mean attention of rows[score_from:] (the
    question), normalised to sum 1 over the `candidates` mask, then averaged over layers) and every
    layer's KV as read from the feed, with
    the rows' probe K/V written in (the main loop recomputes those rows anyway). `clock` (a StageClock) splits
    its time into reading the cached layers ("load") and the pass itself ("probe"). `hidden_keys` ([T] bool):
    positions the pass leaves out of every row's attention (recomputed positions that are not among `rows`,
    whose KV it never computes).
    """
    timed = clock if clock is not None else _untimed
    hidden = runner.embed(token_ids[:, rows])
    cos, sin = cos_all[:, rows], sin_all[:, rows]
    weights = candidates.float()
    total = torch.zeros(token_ids.shape[1], dtype=torch.float32, device=token_ids.device)
    kept: list[LayerKV] = []
    for layer in range(runner.n_layers):
        with timed("load"):
            layer_k, layer_v = feed.layer(layer)
        with timed("probe"):
            q, k, v = runner.project_qkv(layer, hidden, cos, sin)
            layer_k[:, :, rows] = k.to(layer_k.dtype)
            layer_v[:, :, rows] = v.to(layer_v.dtype)
            kept.append((layer_k, layer_v))
            probs = runner.attention_weights(layer, q, layer_k, rows, hidden_keys)  # [1, heads, rows, T]
            per_token = probs[0, :, score_from:].mean(dim=1).amax(dim=0)  # [T]: the most attentive head
            total += per_token / per_token.dot(weights).clamp_min(1e-12)
            hidden = runner.finish_layer(layer, hidden, attention_output(runner, probs, layer_v, hidden.dtype))
        if pause is not None:
            yield from pause()
    return total / runner.n_layers, kept


def _untimed(stage: str) -> AbstractContextManager[None]:
    return nullcontext()


def attention_output(runner: ModelRunner, probs: torch.Tensor, v: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """probs @ V with grouped query heads → [1, rows, heads·hd], reusing the scoring probabilities."""
    b, heads, n, t = probs.shape
    kv_heads = v.shape[1]
    grouped = probs.reshape(b, kv_heads, heads // kv_heads * n, t)
    out = torch.matmul(grouped.to(v.dtype), v).view(b, heads, n, -1)
    return out.transpose(1, 2).reshape(b, n, -1).to(dtype)
