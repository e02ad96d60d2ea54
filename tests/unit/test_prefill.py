"""Segment precompute on tiny random-weight models: how segments are batched, and that a segment's KV does not
depend on the batch it was prefilled in."""

from __future__ import annotations

import random

import pytest
import torch

from support import ARCHS, tiny_runner
from kvblend.model.prefill import MAX_PAD_FRACTION, batches_by_tokens, precompute_kv, precompute_kv_steps
from kvblend.types import drain


def test_a_short_tail_segment_is_not_padded_to_the_long_ones():
    """Three documents of ~630 tokens split 499 + 132 (as the segmenter does at 512): the tails get a batch of
    their own instead of being padded to 499, which made that ingest's prefill compute 1.6× its tokens."""
    lengths = [499, 132, 497, 136, 480, 125]
    batches = list(batches_by_tokens(lengths, budget=4096))
    assert sorted(map(sorted, batches)) == [[0, 2, 4], [1, 3, 5]]


@pytest.mark.parametrize("seed", range(5))
def test_batches_cover_every_segment_once_within_budget_and_padding_bound(seed):
    rng = random.Random(seed)
    lengths = [rng.randint(1, 600) for _ in range(40)]
    budget = 2048
    batches = list(batches_by_tokens(lengths, budget))
    assert sorted(i for b in batches for i in b) == list(range(len(lengths)))
    for batch in batches:
        width = max(lengths[i] for i in batch)
        assert len(batch) == 1 or width * len(batch) <= budget
        assert all(lengths[i] >= width * (1 - MAX_PAD_FRACTION) for i in batch)


@pytest.mark.parametrize("arch", ARCHS)
def test_a_segments_kv_is_the_same_alone_and_batched_with_others(arch):
    runner = tiny_runner(arch)
    rng = random.Random(1)
    vocab = runner.model.config.vocab_size
    segments = [[rng.randrange(vocab) for _ in range(n)] for n in (40, 9, 37, 12, 33)]
    batched = precompute_kv(runner, segments, batch_tokens=4096)
    for tokens, layers in zip(segments, batched):
        (alone,) = precompute_kv(runner, [tokens])
        for (k, v), (k_alone, v_alone) in zip(layers, alone):
            assert k.shape == k_alone.shape == (k.shape[0], len(tokens), k.shape[2])
            assert torch.allclose(k.float(), k_alone.float(), atol=1e-3)
            assert torch.allclose(v.float(), v_alone.float(), atol=1e-3)


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("step_rows", [None, 8])
def test_segments_prefilled_after_a_sink_prefilled_once_have_their_kv_in_the_whole_sequence(arch, step_rows):
    """`ingest --sink prefix` prefills the sink once and has every segment attend to its KV: a segment's KV must be
    what it has right after the sink in one sequence, batched or not, and in a server's token ranges (step_rows)."""
    runner = tiny_runner(arch)
    runner.local_layers_skip_sink = False  # in view in every layer (the next test checks the default)
    rng = random.Random(2)
    vocab = runner.model.config.vocab_size
    sink = [rng.randrange(vocab) for _ in range(11)]
    segments = [[rng.randrange(vocab) for _ in range(n)] for n in (30, 27, 9)]
    after_sink = drain(precompute_kv_steps(runner, segments, sink_prefix=sink, rows_per_step=step_rows))
    for tokens, layers in zip(segments, after_sink):
        (whole,) = runner.prefill_batch([sink + tokens])
        for (k, v), (k_whole, v_whole) in zip(layers, whole):
            assert k.shape[1] == len(tokens)
            # stored in fp16: a relative rounding of 2^-11 (Gemma's normed K reaches |k| ~ 3)
            assert torch.allclose(k.float(), k_whole[:, len(sink) :].float(), atol=1e-3, rtol=1e-3)
            assert torch.allclose(v.float(), v_whole[:, len(sink) :].float(), atol=1e-3, rtol=1e-3)


def test_local_layers_of_a_mixed_window_model_prefill_segments_without_the_sink():
    """Gemma 3's local layers never see the sink: in a prompt, a passage past the first window sees only the
    passage before it there. Its global layers do. Tiny Gemma: layer 0 local, 1 global, 2 and 3 local."""
    runner = tiny_runner("gemma3")
    rng = random.Random(3)
    vocab = runner.model.config.vocab_size
    sink = [rng.randrange(vocab) for _ in range(11)]
    tokens = [rng.randrange(vocab) for _ in range(30)]
    (after_sink,) = precompute_kv(runner, [tokens], sink_prefix=sink)
    (alone,) = runner.prefill_batch([tokens], start_position=len(sink))  # same positions, no sink at all
    # layer 1's K/V are what layer 0 (local) made of the tokens: the sink was not in view there
    assert torch.allclose(after_sink[1][0].float(), alone[1][0], atol=1e-3, rtol=1e-3)
    # layer 2's come through layer 1 (global), which attended to the sink
    assert not torch.allclose(after_sink[2][0].float(), alone[2][0], atol=1e-2, rtol=1e-2)
