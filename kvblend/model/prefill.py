"""Segment precompute: prefill many segments alone, in batches, for the archive.

Batches are formed by a token budget over length-sorted segments, and a segment
much shorter than the batch's longest starts a batch of its own, so padding
stays small; results come back in input order, on the CPU, in the storage
dtype (fp16 unless the model computes in bf16), ready for the codec.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence

import torch

from kvblend.defaults import DEFAULT_BATCH_TOKENS
from kvblend.model.runner import ModelRunner
from kvblend.types import LayerKV, Steps, drain


def storage_dtype(runner: ModelRunner) -> torch.dtype:
    """fp16 keeps more mantissa than bf16 and KV values fit its range; keep bf16 if computed in bf16."""
    return torch.bfloat16 if runner.dtype == torch.bfloat16 else torch.float16


#: The most of a batch row that may be padding. Rows are padded to the batch's longest segment, and a pad
#: costs as much compute as a token: a document's short tail segment (631 tokens split 499 + 132) batched with
#: full-length ones made an ingest's prefill compute 1.6× its tokens. Matmuls run as fast on ~100 rows as on
#: thousands on a CPU, so smaller batches of like lengths cost nothing.
MAX_PAD_FRACTION = 0.25


def batches_by_tokens(lengths: Sequence[int], budget: int, max_pad: float = MAX_PAD_FRACTION) -> Iterator[list[int]]:
    """Group indices (longest first) so each batch's padded size stays within `budget` tokens and no row is
    more than `max_pad` padding."""
    order = sorted(range(len(lengths)), key=lambda i: -lengths[i])
    batch: list[int] = []
    for i in order:
        width = lengths[batch[0]] if batch else lengths[i]
        if batch and (width * (len(batch) + 1) > budget or lengths[i] < width * (1 - max_pad)):
            yield batch
            batch = []
        batch.append(i)
    if batch:
        yield batch


def precompute_kv(
    runner: ModelRunner,
    token_lists: Sequence[list[int]],
    sink_prefix: list[int] | None = None,
    batch_tokens: int = DEFAULT_BATCH_TOKENS,
    on_batch: Callable[[list[int], int], None] | None = None,
) -> list[list[LayerKV]]:
    """Per-layer KV ([kv_heads, n, hd], CPU, storage dtype) of each token list, prefilled alone.

    With `sink_prefix`, each segment is prefilled after those tokens (a shared
    instruction prefix that takes the attention-sink role) whose KV is dropped;
    the segment's base position is then len(sink_prefix). The prefix is prefilled
    once and every segment attends to its KV, rather than being computed again in
    each row (37 tokens of the default template: 7% of a 512-token segment).
    """
    return drain(precompute_kv_steps(runner, token_lists, sink_prefix, batch_tokens, on_batch))


def precompute_kv_steps(
    runner: ModelRunner,
    token_lists: Sequence[list[int]],
    sink_prefix: list[int] | None = None,
    batch_tokens: int = DEFAULT_BATCH_TOKENS,
    on_batch: Callable[[list[int], int], None] | None = None,
    rows_per_step: int | None = None,
) -> Steps[list[list[LayerKV]]]:
    """:func:`precompute_kv` in steps: it yields after every layer of every batch, and every `rows_per_step`
    tokens within one (a server prefills a client's new passages between other requests' decode steps)."""
    prefix = list(sink_prefix or [])
    dtype = storage_dtype(runner)
    results: list[list[LayerKV] | None] = [None] * len(token_lists)
    past = (yield from runner.prefill_steps([prefix], rows_per_step=rows_per_step))[0] if prefix else None
    lengths = [len(t) for t in token_lists]
    for batch in batches_by_tokens(lengths, batch_tokens):
        rows = [list(token_lists[i]) for i in batch]
        kv_rows = yield from runner.prefill_steps(rows, len(prefix), past, rows_per_step)
        for i, layers in zip(batch, kv_rows):
            results[i] = [(k.to("cpu", dtype).contiguous(), v.to("cpu", dtype).contiguous()) for k, v in layers]
        if on_batch is not None:
            on_batch(batch, sum(len(token_lists[i]) for i in batch))
    return results  # type: ignore[return-value]
