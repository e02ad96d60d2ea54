"""Continuous batching changes no answer: on every supported architecture's tiny config, a sequence decoded in a
batch gives the tokens it gives alone (logits within 1e-4), and fusion in row chunks gives what fusion whole does."""

from __future__ import annotations

import pytest
import torch

from kvblend.fusion import BlendConfig, fuse, fuse_steps
from kvblend.generation import DecodeState, decode_step
from kvblend.types import drain
from support import ARCHS, cached_prompt, tiny_runner

ATOL = 1e-4
STEPS = 6


def greedy(logits: torch.Tensor) -> int:
    return int(torch.argmax(logits))


def prompts(runner) -> list:
    """Three blended prompts of different lengths (ragged in a batch)."""
    return [fuse(runner, cached_prompt(runner, lengths), "blend", BlendConfig.single(0.3))
            for lengths in ([40, 30], [70], [25, 25, 25])]


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("graphed", [False, True], ids=["eager", "static"])
def test_a_sequence_decodes_the_same_alone_and_in_a_batch(arch, graphed):
    """Eager: one batched pass over ragged KV. Static: each sequence's fixed-shape step in turn (CUDA replays
    it as a graph; here it runs eagerly)."""
    runner = tiny_runner(arch)
    fused = prompts(runner)
    alone_tokens, alone_logits = [], []
    for f in fused:
        state, token, tokens, logits = DecodeState(runner, f, STEPS + 1), greedy(f.last_logits), [], []
        for _ in range(STEPS):
            step = state.step(token)
            tokens.append(token)
            logits.append(step)
            token = greedy(step)
        alone_tokens.append(tokens)
        alone_logits.append(logits)
    states = [DecodeState(runner, f, STEPS + 1, graphed=graphed) for f in fused]
    tokens = [greedy(f.last_logits) for f in fused]
    batched_tokens: list[list[int]] = [[] for _ in fused]
    for step in range(STEPS):
        logits = decode_step(runner, states, tokens)
        for i in range(len(fused)):
            batched_tokens[i].append(tokens[i])
            assert torch.allclose(logits[i], alone_logits[i][step], atol=ATOL), (arch, i, step)
        tokens = [greedy(row) for row in logits]
    assert batched_tokens == alone_tokens


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("mode,config", [("blend", BlendConfig.single(0.3)), ("full", None),
                                         ("blend", BlendConfig.single(0.3, check_layer=0, select="probe"))])
def test_fusion_in_row_chunks_matches_fusion_whole(arch, mode, config):
    """The server's fusion yields every few rows inside a layer; the KV and the first token are fusion's."""
    runner = tiny_runner(arch)
    segments = cached_prompt(runner, [60, 45])
    whole = fuse(runner, segments, mode, config)
    steps = fuse_steps(runner, segments, mode, config, rows_per_step=16)
    yields = 0
    while True:
        try:
            next(steps)
            yields += 1
        except StopIteration as done:
            chunked = done.value
            break
    assert yields > runner.n_layers  # it did yield inside layers, not only between them
    assert torch.allclose(chunked.last_logits, whole.last_logits, atol=ATOL)
    assert greedy(chunked.last_logits) == greedy(whole.last_logits)
    for (k1, v1), (k2, v2) in zip(chunked.kv, whole.kv):
        assert torch.allclose(k1, k2, atol=ATOL) and torch.allclose(v1, v2, atol=ATOL)
    assert chunked.recomputed_token_layers == whole.recomputed_token_layers


@pytest.mark.parametrize("arch", ARCHS)
def test_prefill_in_row_chunks_matches_prefill_whole(arch):
    runner = tiny_runner(arch)
    batch = [list(range(5, 75)), list(range(100, 140))]
    whole = runner.prefill_batch(batch)
    chunked = drain(runner.prefill_steps(batch, rows_per_step=16))
    for row_whole, row_chunked in zip(whole, chunked):
        for (k1, v1), (k2, v2) in zip(row_whole, row_chunked):
            assert torch.allclose(k1, k2, atol=ATOL) and torch.allclose(v1, v2, atol=ATOL)
