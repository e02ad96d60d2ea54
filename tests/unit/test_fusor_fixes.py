"""Fusor fixes (issue 13) and sink-aware precompute, on tiny random-weight models and real tiny archives.

Each test here fails without its fix: gradual filtering that keeps everything at an early check
layer must still read the archive in order; re-rotation uses fp32 cos/sin; `kv` deviation
normalises over the candidates only; check layer 0 and length-dependent RoPE are refused.
"""

from __future__ import annotations

import pytest
import torch
import transformers as tf

from support import TINY, tiny_runner
from kvblend.errors import UnsupportedModelError, UsageError
from kvblend.fusion import BlendConfig, fuse
from kvblend.fusion.policies import Check, select
from kvblend.model.config import ModelConfig
from kvblend.model.runner import ModelRunner
from kvblend.types import Segment


class WordTokenizer:
    """Just what the engine asks a tokenizer for: one id per word (hashed), decode, special ids."""

    chat_template = None
    pad_token_id, eos_token_id, unk_token_id, bos_token_id = 0, 1, 2, None

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        return [3 + sum(map(ord, w)) * 7 % 280 for w in text.split()]

    def decode(self, ids, skip_special_tokens: bool = True) -> str:
        return " ".join(f"w{i}" for i in ids)

    def convert_tokens_to_ids(self, token: str):
        return None


def engine_for(tmp_path, name: str, sink: str = "none"):
    from kvblend.pipeline import Engine

    runner = tiny_runner("qwen2")
    runner.tokenizer = WordTokenizer()
    return Engine(tmp_path / name, runner=runner, sink=sink)


PASSAGES = [" ".join(f"alpha{i} beta{j}" for j in range(20 + 5 * i)) for i in range(3)]


def ask(engine, keys, **options):
    from kvblend.generation import SamplingConfig
    from kvblend.pipeline import QueryOptions

    opts = QueryOptions(segment_keys=keys, sampling=SamplingConfig(max_new_tokens=3), **options)
    return engine.query("what is alpha one", opts)


def test_gradual_filtering_from_the_archive_when_an_early_check_keeps_everything(tmp_path):
    """ratio 0.8 over check layers 1,3 is 1.0 then 0.8: layer 1 keeps every token, so layer 2 needs
    no cached KV; the schedule and the fusor's reads must agree (it used to fail: wanted 3, got 2)."""
    with engine_for(tmp_path, "a") as engine:
        keys = [r.key for r in engine.store_texts(PASSAGES)]
        for select in ("hkvd", "question"):  # (the probe reads every layer anyway)
            result = ask(engine, keys, ratio=0.8, check_layers=(1, 3), cache_prefix=False, select=select)
            assert result.fusion.active_per_layer[2] == result.prompt_tokens  # everything, as the check kept
            assert result.fusion.selected.numel() < result.prompt_tokens  # layer 3 selected from the archive


@pytest.mark.parametrize("sink", ["template", "prefix"])
def test_sink_precomputed_and_plain_archives_both_answer_with_their_own_keys(tmp_path, sink):
    with engine_for(tmp_path, "plain") as plain, engine_for(tmp_path, "sink", sink=sink) as sunk:
        plain_recs, sink_recs = plain.store_texts(PASSAGES), sunk.store_texts(PASSAGES)
        assert sunk.sink_ids() and all(r.base_position == len(sunk.sink_ids()) for r in sink_recs)
        assert all(r.base_position == 0 for r in plain_recs)
        assert not {r.key for r in plain_recs} & {r.key for r in sink_recs}
        for engine, recs in ((plain, plain_recs), (sunk, sink_recs)):
            for mode in ("reuse", "blend"):
                result = ask(engine, [r.key for r in recs], mode=mode)
                assert result.answer and not result.warnings
        # The sink-precomputed KV is exactly what the segment gets after those tokens in a prompt.
        runner = sunk.runner
        first = sink_recs[0]
        kv = [sunk.archive().read_layer(first, i) for i in range(runner.n_layers)]
        segs = [Segment(sunk.sink_ids()), Segment(list(first.token_ids), kv=[(k.float(), v.float()) for k, v in kv],
                                                  base_position=first.base_position), Segment([5, 6, 7])]
        full, reuse = fuse(runner, segs, "full"), fuse(runner, segs, "reuse")
        assert torch.allclose(full.last_logits, reuse.last_logits, atol=1e-2)


def test_prefix_sink_is_the_whole_instruction_prefix_and_keys_differ_from_the_template_sink(tmp_path):
    """`--sink prefix`: the first passage of a default-template prompt is prefilled in its real context."""
    from kvblend.prompt import PromptTemplate, split_template

    with engine_for(tmp_path, "t", sink="template") as short, engine_for(tmp_path, "p", sink="prefix") as long:
        prefix = long.runner.tokenize(split_template(long.runner, PromptTemplate(), "any question?")[0])
        assert long.sink_ids() == prefix and short.sink_ids() == prefix[: len(short.sink_ids())]
        assert len(short.sink_ids()) < len(prefix)
        assert long.key_of([5, 6, 7]) != short.key_of([5, 6, 7])

def test_a_document_counts_as_stored_only_under_the_sink_asked_for(tmp_path):
    """`ingest` skips an unchanged document only if its segments were prefilled under the sink asked for (by the
    policy's name, so without loading the model; by the tokens for records from before names were stored), and
    prefills it again otherwise: an archive made under `--sink none` moves to the new default on its next ingest."""
    with engine_for(tmp_path, "p", sink="prefix") as sunk, engine_for(tmp_path, "n") as alone:
        (rec,) = sunk.store_texts(PASSAGES[:1])
        assert rec.extra == {"sink": sunk.keys.sink_setting, "sink_policy": "prefix"}
        tokens_only = {"sink": sunk.keys.sink_setting}
        assert sunk.prefilled_under_sink(rec.extra) and sunk.prefilled_under_sink(tokens_only)
        assert not sunk.prefilled_under_sink({"sink": "tokens:5,6", "sink_policy": "template"})
        assert not sunk.prefilled_under_sink({"sink": "tokens:5,6"})
        assert not any(map(sunk.prefilled_under_sink, ({}, {"sink": "alone"})))
        assert alone.prefilled_under_sink({}) and alone.prefilled_under_sink({"sink": "alone"})
        assert not any(map(alone.prefilled_under_sink, (rec.extra, tokens_only)))


def test_rerotation_takes_fp32_cos_sin_in_a_16_bit_model():
    runner = tiny_runner("llama")
    runner = ModelRunner(runner.model.to(torch.bfloat16), None, name="tiny-bf16")
    cos, sin = runner._rotations(777, runner.device)
    probe = torch.empty(0, dtype=torch.float32)
    exact_cos, exact_sin = runner.decoder.rotary_emb(probe, torch.tensor([[777]]))
    assert cos.dtype == torch.float32
    assert torch.allclose(cos, exact_cos.reshape(-1), atol=1e-6)  # bf16 rounding would be ~4e-3
    assert torch.allclose(sin, exact_sin.reshape(-1), atol=1e-6)


def test_kv_deviation_normalises_over_the_candidates_only():
    """Two candidates and two always-recomputed rows whose cached KV is zeros (a huge K 'deviation').
    Candidate 0 deviates most in K relative to the candidates, candidate 1 in V: with means over the
    candidates 0 wins; means swamped by the forced rows would pick 1."""
    fresh_k = torch.zeros(1, 1, 4, 1)
    fresh_v = torch.zeros(1, 1, 4, 1)
    fresh_k[0, 0, :, 0] = torch.tensor([2.0, 1.0, 100.0, 100.0])  # squared distances 4, 1 | 1e4
    fresh_v[0, 0, :, 0] = torch.tensor([1.0, 2.0 ** 0.5, 1.0, 1.0])  # squared distances 1, 2 | 1
    always = torch.tensor([False, False, True, True])
    check = Check(None, 1, torch.arange(4), always, None, fresh_k, fresh_v, torch.zeros_like(fresh_k),
                  torch.zeros_like(fresh_v), None, torch.zeros(4, dtype=torch.bool), None, "kv")
    kept, _ = select("hkvd", check, n_keep=1)
    assert kept.tolist() == [0, 2, 3]


def test_check_layer_zero_is_refused_for_scores_read_off_a_layer():
    """Layer 0's KV does not depend on context: deviation and question attention there are noise.
    (The probe scores from its own pass, so it may select before layer 0: test_policies.)"""
    runner = tiny_runner("llama")
    chunk = list(range(3, 40))
    segs = [Segment([5, 6]), Segment(chunk, kv=runner.prefill_batch([chunk])[0]), Segment([7, 8, 9])]
    for cfg in (BlendConfig.single(0.15, check_layer=0, select="hkvd"),
                BlendConfig.gradual(0.15, (0, 2), select="question")):
        with pytest.raises(UsageError, match="check layer 0"):
            fuse(runner, segs, "blend", cfg)


@pytest.mark.parametrize("rope", [
    {"rope_type": "dynamic", "factor": 2.0, "rope_theta": 10000.0},
    {"rope_type": "longrope", "rope_theta": 10000.0, "short_factor": [1.0] * 8, "long_factor": [2.0] * 8,
     "original_max_position_embeddings": 64},
])
def test_length_dependent_rope_is_refused_from_the_config(rope):
    """Dynamic NTK and longrope change their frequencies with the sequence length: no rotation by Δ moves
    KV prefilled alone to its place in a prompt, so such a model is refused when its config is read,
    naming why, before any weights load."""
    config = tf.LlamaConfig(**TINY, rope_parameters=rope, architectures=["LlamaForCausalLM"])
    with pytest.raises(UnsupportedModelError, match="sequence length"):
        ModelConfig.from_dict(config.to_dict())


def test_a_passage_is_reported_cached_only_where_its_mode_reused_its_kv(tmp_path):
    """`full` recomputes every passage and `prefix` all but an exact first one: their answers said `cached: true`
    for every archived passage (and a server's `source: "hit"`), where `-v` said 100% of full's compute."""
    with engine_for(tmp_path, "plain") as engine:
        keys = [r.key for r in engine.store_texts(PASSAGES)]
        reported = {mode: [s.cached for s in ask(engine, keys, mode=mode).segments] for mode in
                    ("full", "prefix", "reuse", "blend")}
    assert reported == {"full": [False] * 3, "prefix": [False] * 3, "reuse": [True] * 3, "blend": [True] * 3}
