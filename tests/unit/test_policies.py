"""Selection policies on tiny random-weight models: exact at ratio 1.0, equal budgets, chunk heads,
question attention from the fresh layer, the probe's accounting."""

from __future__ import annotations

import importlib
import math

import pytest
import torch

from support import ARCHS, random_tokens, tiny_runner
from kvblend.defaults import HEAD_TOKENS
from kvblend.options import SELECTIONS
from kvblend.errors import UsageError
from kvblend.fusion import BlendConfig, fuse
from kvblend.fusion import policies
from kvblend.fusion.selection import budget

ATOL = 1e-4


def rag_prompt(runner, n_chunks: int = 4, cached_prefix: bool = True):
    """[prefix, exact when cached] + cached chunks (each prefilled alone) + [uncached question]."""
    from kvblend.types import Segment

    prefix = random_tokens(7, 1)
    chunks = [random_tokens(30 + 4 * i, seed=10 + i) for i in range(n_chunks)]
    kvs = runner.prefill_batch(chunks)
    segs = [Segment(prefix, kv=runner.prefill_batch([prefix])[0] if cached_prefix else None)]
    segs += [Segment(c, kv=[(k.clone(), v.clone()) for k, v in kv]) for c, kv in zip(chunks, kvs)]
    return segs + [Segment(random_tokens(9, 2))]


@pytest.fixture(params=ARCHS)
def runner(request):
    return tiny_runner(request.param)


@pytest.mark.parametrize("select", SELECTIONS)
def test_every_policy_at_ratio_one_is_exactly_full(runner, select):
    segs = rag_prompt(runner, cached_prefix=True)
    full = fuse(runner, segs, "full")
    blend = fuse(runner, segs, "blend", BlendConfig.single(1.0, select=select))
    assert blend.recompute_share == 1.0 and blend.probe_token_layers == 0
    assert torch.equal(full.last_logits, blend.last_logits)
    for (kf, vf), (kb, vb) in zip(full.kv, blend.kv):
        assert torch.equal(kf, kb) and torch.equal(vf, vb)


@pytest.mark.parametrize("cached_prefix", [True, False])
def test_each_policy_spends_exactly_its_budget(runner, cached_prefix):
    segs = rag_prompt(runner, cached_prefix=cached_prefix)
    ratio, L = 0.3, runner.n_layers
    spent = {}
    for select in SELECTIONS:
        fused = fuse(runner, segs, "blend", BlendConfig.single(ratio, check_layer=1, select=select))
        T, exact = len(fused.token_ids), fused.exact_prefix_tokens
        n_approx = fused.cached_tokens - exact
        always = T - fused.cached_tokens
        probe = always * L if select == "probe" else 0
        assert fused.probe_token_layers == probe
        n_keep = budget(ratio, n_approx, probe, L - 2)
        if select != "probe":
            assert n_keep == math.ceil(ratio * n_approx)
        assert fused.active_per_layer[:2] == [T - exact] * 2  # every approximate token up to the check layer
        assert fused.active_per_layer[2:] == [always + n_keep] * (L - 2)
        assert fused.recomputed_token_layers == sum(fused.active_per_layer) + probe
        spent[select] = fused.recomputed_token_layers
    # The probe's own token-layers come out of its budget: it never costs more than HKVD,
    # and less by under one kept row per layer (rounding).
    assert spent["hkvd"] - (L - 2) < spent["probe"] <= spent["hkvd"]
    assert len({v for k, v in spent.items() if k != "probe"}) == 1


@pytest.mark.parametrize("cached_prefix", [True, False])
def test_probe_preselecting_at_layer_zero_runs_only_the_kept_set(runner, cached_prefix):
    """A layer-0 check (the probe's only): every layer runs the same kept set, chosen before layer 0,
    and the budget spreads the probe's cost over all L layers."""
    segs = rag_prompt(runner, cached_prefix=cached_prefix)
    ratio, L = 0.3, runner.n_layers
    fused = fuse(runner, segs, "blend", BlendConfig.single(ratio, check_layer=0, select="probe"))
    T, exact = len(fused.token_ids), fused.exact_prefix_tokens
    always = T - fused.cached_tokens
    n_keep = budget(ratio, fused.cached_tokens - exact, always * L, L)
    assert fused.active_per_layer == [always + n_keep] * L
    assert fused.recomputed_token_layers == L * (always + n_keep) + always * L
    assert len(fused.selected) == always + n_keep
    with pytest.raises(UsageError, match="check layer 0"):
        fuse(runner, segs, "blend", BlendConfig.single(ratio, check_layer=0, select="hkvd"))


def test_chunk_heads_are_selected(runner):
    segs = rag_prompt(runner)
    fused = fuse(runner, segs, "blend", BlendConfig.single(0.2, select="heads"))
    selected = set(fused.selected.tolist())
    start = len(segs[0].token_ids)
    for seg in segs[1:-1]:
        assert set(range(start, start + HEAD_TOKENS)) <= selected
        start += len(seg.token_ids)
    T = len(fused.token_ids)
    assert set(range(T - 9, T)) <= selected  # the question is always recomputed


def test_question_scores_come_from_the_fresh_layer(runner, monkeypatch):
    """At the check layer every layer below ran fresh, so the question attends over full's keys."""
    segs = rag_prompt(runner, cached_prefix=False)
    seen = []
    real_select = policies.select

    def spy(policy, check, n_keep):
        seen.append((check, policies.question_attention(check)))
        return real_select(policy, check, n_keep)

    monkeypatch.setattr(importlib.import_module("kvblend.fusion.fuse"), "select", spy)
    fuse(runner, segs, "blend", BlendConfig.single(0.3, check_layer=2, select="question"))
    full = fuse(runner, segs, "full")
    (check, scores), = seen
    full_k = full.kv[2][0]
    assert torch.allclose(check.layer_k, full_k, atol=ATOL)  # fresh keys, not the cached ones
    assert not torch.allclose(check.cached_k, check.k, atol=1e-3)  # (which do differ)
    rows = policies.question_rows(check.current, check.always, ~check.always)
    expected = runner.attention_weights(2, check.q[:, :, rows], full_k, check.current[rows])[0].mean(dim=(0, 1))
    assert torch.allclose(scores, expected[check.current], atol=1e-5)
    assert scores[~check.always].sum() > 0


def test_probe_scores_every_layer_and_reads_each_once(runner):
    """The probe reads every cached layer once, in order, and the main loop reuses what it read."""
    from kvblend.feeds.memory import InMemoryFeed
    from kvblend.fusion import feed_schedule, plan_prompt

    segs = rag_prompt(runner)
    cfg = BlendConfig.single(0.25, select="probe")
    plan = plan_prompt(segs, "blend")
    schedule = feed_schedule(segs, plan, "blend", cfg, runner.n_layers)
    assert list(schedule) == list(range(runner.n_layers))
    reads = []

    class Recording(InMemoryFeed):
        def layer(self, index):
            reads.append(index)
            return super().layer(index)

    feed = Recording(runner, segs, plan.offsets, schedule)
    streamed = fuse(runner, segs, "blend", cfg, feed=feed)
    assert reads == list(range(runner.n_layers))
    in_memory = fuse(runner, segs, "blend", cfg)
    assert torch.equal(streamed.selected, in_memory.selected)
    assert torch.allclose(streamed.last_logits, in_memory.last_logits, atol=1e-6)


def test_the_probe_leaves_out_a_segment_computed_between_cached_ones(runner):
    """A passage computed in the prompt between cached ones (a server's unstored passage) is recomputed by the
    main loop anyway: the probe neither computes it a second time nor attends to it (its KV is not there), so
    its cost is the question's rows; with no such passage its rows are every recomputed token, as before."""
    from kvblend.types import Segment

    segs = rag_prompt(runner, n_chunks=4)
    interior = Segment(random_tokens(50, seed=77))  # no KV: computed in the prompt
    with_interior = [*segs[:3], interior, *segs[3:]]
    L, cfg = runner.n_layers, BlendConfig.single(0.3, select="probe")
    fused = fuse(runner, with_interior, "blend", cfg)
    question = len(segs[-1].token_ids)
    assert fused.probe_token_layers == question * L  # the prefix is cached; the 50 rows are not probed
    plain = fuse(runner, segs, "blend", cfg)
    assert plain.probe_token_layers == question * L
    # The passage still holds its fresh KV in the fused result, and at ratio 1.0 blend is still full exactly.
    assert fused.recomputed_token_layers == sum(fused.active_per_layer) + question * L
    assert all(n >= question + 50 for n in fused.active_per_layer)
    full, exact = fuse(runner, with_interior, "full"), fuse(runner, with_interior, "blend", BlendConfig.single(1.0))
    assert torch.equal(full.last_logits, exact.last_logits)
    # last before the question, the same; and with nothing cached to select from, no pass at all
    assert fuse(runner, [*segs[:-1], interior, segs[-1]], "blend", cfg).probe_token_layers == question * L
    uncached = [Segment(s.token_ids) for s in segs]
    assert fuse(runner, uncached, "blend", cfg).probe_token_layers == 0


def test_a_long_uncached_run_before_the_first_cached_segment_is_probed_by_its_sink_only(runner):
    from kvblend.fusion.probe import PROBE_LEADING_MAX, PROBE_LEADING_SINK
    from kvblend.types import Segment

    segs = rag_prompt(runner, n_chunks=4, cached_prefix=False)  # enough cached for the probe to pay
    lead = Segment(random_tokens(PROBE_LEADING_MAX + 10 - len(segs[0].token_ids), seed=5))
    fused = fuse(runner, [segs[0], lead, *segs[1:]], "blend", BlendConfig.single(0.3, select="probe"))
    assert fused.probe_token_layers == (PROBE_LEADING_SINK + len(segs[-1].token_ids)) * runner.n_layers
    short = fuse(runner, segs, "blend", BlendConfig.single(0.3, select="probe"))  # a short uncached prefix: probed
    assert short.probe_token_layers == (len(segs[0].token_ids) + len(segs[-1].token_ids)) * runner.n_layers


def test_blend_computes_the_whole_prompt_where_the_probe_would_cost_more_than_full(runner):
    """A new system prompt (uncached) before one short cached passage: the probe ran the prefix and the question
    through every layer, the main loop computed them again, and blend cost 166% of full's compute. Where the
    probe, the tokens always computed and the kept ones come to the whole prompt or more, blend is full."""
    from kvblend.types import Segment

    prefix, question = Segment(random_tokens(40, 1)), Segment(random_tokens(9, 2))
    short = random_tokens(6, seed=10)
    segs = [prefix, Segment(short, kv=runner.prefill_batch([short])[0]), question]
    cfg = BlendConfig.single(0.12, select="probe")
    fused = fuse(runner, segs, "blend", cfg)
    assert fused.probe_token_layers == 0 and fused.recompute_share == 1.0  # was (40 + 9) probe rows on top
    assert torch.equal(fused.last_logits, fuse(runner, segs, "full").last_logits)
    # with passages worth selecting among, the probe runs and blend costs less than full
    segs = rag_prompt(runner, n_chunks=4, cached_prefix=False)
    fused = fuse(runner, segs, "blend", cfg)
    assert fused.probe_token_layers > 0 and fused.recompute_share < 1.0
