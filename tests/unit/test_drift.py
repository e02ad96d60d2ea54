"""What a diverging answer step reads (kvblend.evaluation.drift) on tiny random-weight models:
its attention equals transformers' at that step, and stale KV is told from recomputed and exact KV."""

from __future__ import annotations

import pytest
import torch

from support import ARCHS, random_tokens, tiny_runner
from test_policies import rag_prompt
from kvblend.evaluation.drift import TOP_TOKENS, stale_mask, stale_reading, step_attention
from kvblend.fusion import BlendConfig, fuse


@pytest.mark.parametrize("arch", ARCHS)
def test_a_steps_attention_over_the_prompt_is_transformers_attention_at_that_step(arch):
    runner = tiny_runner(arch)
    segs = rag_prompt(runner)
    full = fuse(runner, segs, "full")
    forced = random_tokens(5, seed=3)
    step = 4
    probs = step_attention(runner, full, forced, step)  # [L, H, 2, T-1]
    T = len(full.token_ids)
    reference = runner.reference
    reference.set_attn_implementation("eager")
    ids = torch.tensor([[*full.token_ids, *forced[:step]]])
    with torch.no_grad():
        attentions = reference(ids, output_attentions=True).attentions  # per layer [1, H, n, n]
    for layer, a in enumerate(attentions):
        torch.testing.assert_close(probs[layer, :, 0], a[0, :, T - 1, : T - 1], atol=1e-5, rtol=1e-4)
        torch.testing.assert_close(probs[layer, :, 1], a[0, :, T - 1 + step, : T - 1], atol=1e-5, rtol=1e-4)


def test_stale_kv_is_what_was_cached_past_the_exact_prefix_and_not_recomputed():
    runner = tiny_runner("llama")
    segs = rag_prompt(runner, cached_prefix=True)
    prefix, question = len(segs[0].token_ids), len(segs[-1].token_ids)
    reuse = fuse(runner, segs, "reuse")
    T = len(reuse.token_ids)
    expected = torch.zeros(T, dtype=torch.bool)
    expected[prefix : T - question] = True  # the chunks; the exact prefix and the question are not stale
    assert torch.equal(stale_mask(reuse), expected)
    blend = fuse(runner, segs, "blend", BlendConfig.single(0.5, check_layer=1, select="hkvd"))
    recomputed = torch.zeros(T, dtype=torch.bool)
    recomputed[blend.selected] = True
    assert torch.equal(stale_mask(blend), expected & ~recomputed)
    assert 0 < int(stale_mask(blend).sum()) < int(expected.sum())
    assert not stale_mask(fuse(runner, segs, "full")).any()
    assert not stale_mask(fuse(runner, segs, "blend", BlendConfig.single(1.0))).any()


def test_a_reuse_steps_reading_lands_on_stale_tokens_and_nothing_is_read_where_nothing_is_stale():
    runner = tiny_runner("llama")
    segs = rag_prompt(runner)
    forced = random_tokens(4, seed=5)
    reuse = fuse(runner, segs, "reuse")
    reading = stale_reading(runner, reuse, forced, 3)
    assert reading is not None and reading.step == 3
    stale = stale_mask(reuse)
    assert 0.0 < reading.stale_mass < 1.0 and 0.0 < reading.stale_mass_first < 1.0
    assert reading.top_stale_share == 1.0  # reuse recomputes no cached token
    assert len(reading.top_positions) == TOP_TOKENS and all(stale[p] for p in reading.top_positions)
    probs = step_attention(runner, reuse, forced, 3)
    upper = probs[1:, :, 1][:, :, stale[: probs.shape[-1]]].sum(-1)  # layer 0's cached KV is exact: not counted
    assert reading.stale_mass == pytest.approx(float(upper.mean()))
    layer, head, mass = reading.top_heads[0]
    assert layer >= 1 and mass == pytest.approx(float(upper.max()), abs=1e-4)
    assert mass == pytest.approx(float(probs[layer, head, 1][stale[: probs.shape[-1]]].sum()), abs=1e-4)
    assert stale_reading(runner, fuse(runner, segs, "full"), forced, 3) is None
