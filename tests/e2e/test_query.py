"""`query` end to end on the real default model over a real archive of the fixture documents."""

from __future__ import annotations

import math
from dataclasses import replace

import pytest
import torch
from support import flip_layer_byte, reference_checkpoint

from kvblend.defaults import DEFAULT_RATIO
from kvblend.errors import UsageError
from kvblend.fusion import BlendConfig, fuse
from kvblend.generation import SamplingConfig, generate
from kvblend.pipeline import Engine, QueryOptions
from kvblend.prompt import PromptTemplate, assemble_prompt, split_template
from kvblend.archive.records import tuned_key
from kvblend.types import Segment

QUESTION = "Who manages the plant where the Tern-4 sonar is built?"
SHORT = SamplingConfig(max_new_tokens=6)


@pytest.fixture
def engine(copy_of_bundled_archive, default_runner):
    """A private copy of the bundled documents' archive, so tests that damage it don't leak."""
    with Engine(copy_of_bundled_archive, runner=default_runner) as eng:
        assert eng.archive().stats().segments >= 12
        yield eng


def pinned(engine, n: int = 4, **changes) -> QueryOptions:
    docs = sorted(d.path for d in engine.archive().iter_documents())[:n]
    return QueryOptions(docs=docs, **{"sampling": SHORT, **changes})


def test_full_answers_exactly_as_model_generate(engine, default_runner):
    """`full` over two retrieved passages, then greedy decoding in kvblend's own step: the same tokens (up to 24)
    as transformers' `generate` on the same prompt ids (its own forward pass and DynamicCache)."""
    sampling = SamplingConfig(max_new_tokens=24)
    result = engine.query(QUESTION, QueryOptions(mode="full", sampling=sampling, top_k=2))
    ids = torch.tensor([result.fusion.token_ids])
    with torch.inference_mode():
        ref = reference_checkpoint(default_runner).generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=sampling.max_new_tokens, do_sample=False)
    expected = []
    for t in ref[0, ids.shape[1]:].tolist():
        if t in default_runner.stop_token_ids:
            break
        expected.append(t)
    assert expected
    assert result.generation.token_ids == expected
    assert result.recompute_share == 1.0


def test_blend_that_computes_the_whole_prompt_reports_no_passage_cached(engine):
    """A question longer than the passage and the instruction prefix together: the probe would cost more than the
    whole prompt, so blend computes it as full does. It still reported the passage `cached` (JSON, -v's stars)."""
    question = "When does the depot close? " * 120
    result = engine.query(question, pinned(engine, 1, sampling=SamplingConfig(max_new_tokens=1)))
    assert result.recompute_share == 1.0 and result.segments and not any(s.cached for s in result.segments)
    assert any("computed the whole prompt" in w for w in result.warnings), result.warnings
    short = engine.query(QUESTION, pinned(engine, 1, sampling=SamplingConfig(max_new_tokens=1)))
    assert short.recompute_share < 1.0 and any(s.cached for s in short.segments)  # the probe pays here


def test_blend_at_ratio_one_answers_as_full(engine):
    opts = pinned(engine, 2)
    full = engine.query(QUESTION, replace(opts, mode="full"))
    blend = engine.query(QUESTION, replace(opts, mode="blend", ratio=1.0))
    assert blend.answer == full.answer
    assert blend.generation.token_ids == full.generation.token_ids
    assert torch.allclose(blend.fusion.last_logits, full.fusion.last_logits, atol=1e-5)


def archived_prompt(engine, result, recompute: str | None = None) -> list[Segment]:
    """The prompt `result` ran on, rebuilt in memory from the archive: its passages' KV and,
    when the query used it, the instruction prefix's (segment `recompute` left uncached)."""
    archive, runner = engine.archive(), engine.runner

    def stored(key: str) -> list:
        return [archive.read_layer(archive.get_segment(key), i) for i in range(runner.n_layers)]

    records = [archive.get_segment(info.key) for info in result.segments]
    segs = [Segment(list(rec.token_ids), kv=None if rec.key == recompute else stored(rec.key),
                    base_position=rec.base_position) for rec in records]
    prompt = assemble_prompt(runner, PromptTemplate(), QUESTION, segs)
    if result.prefix_cached:
        key = engine.key_of(prompt[0].token_ids)
        prompt[0] = Segment(prompt[0].token_ids, kv=stored(key), key=key)
    return prompt


@pytest.mark.parametrize("depth", [1, 2])
def test_streaming_holds_at_most_the_prefetch_depth(engine, depth):
    opts = pinned(engine, prefetch_depth=depth)
    first = engine.query(QUESTION, opts)
    assert not first.prefix_cached
    # hkvd recomputes every token at layer 0, so it loads layers 1..L-1; the probe pass reads layer 0 too
    probes = first.fusion.select == "probe"
    assert first.fusion.stream.layers_loaded == engine.runner.n_layers - (0 if probes else 1)
    result = engine.query(QUESTION, opts)
    assert result.prefix_cached
    stream = result.fusion.stream
    assert stream.layers_loaded == engine.runner.n_layers  # + layer 0, for the cached prefix alone
    assert 1 <= stream.high_water <= depth
    assert stream.bytes_read > first.fusion.stream.bytes_read


@pytest.mark.parametrize("overlap", [True, False], ids=["built-ahead", "built-on-demand"])
def test_streamed_blend_equals_in_memory_blend(engine, overlap):
    """Streaming is transport only: the fused result must equal fusing the same KV in memory."""
    opts = pinned(engine, 3, loader_overlap=overlap)
    for expect_prefix_cached in (False, True):  # the first query archives the prefix, the second reuses it
        streamed = engine.query(QUESTION, opts)
        assert streamed.prefix_cached == expect_prefix_cached
        assert streamed.fusion.stream.build == ("overlap" if overlap else "on-demand")
        local = fuse(engine.runner, archived_prompt(engine, streamed), "blend", BlendConfig.single(DEFAULT_RATIO))
        assert local.token_ids == streamed.fusion.token_ids
        assert torch.equal(local.last_logits, streamed.fusion.last_logits)



def test_corrupt_blob_mid_fusion_is_recomputed_in_place_answering_as_the_undamaged_archive(engine):
    """A bit flip in a middle layer is caught by its checksum while streaming: the segment is prefilled alone
    (what ingest stored) and fed from memory from that layer on. Same tokens as the undamaged archive, the
    fusion ran once (same layers loaded, same token-layers recomputed: a restart recomputes the passage in the
    prompt), and the segment is stored again after the answer (the next query reads it without a warning)."""
    opts = pinned(engine, 3, loader_overlap=False)
    engine.query(QUESTION, opts)  # the instruction prefix is archived: both runs below read it
    clean = engine.query(QUESTION, opts)
    victim = clean.segments[1].key
    flip_layer_byte(engine.archive(), victim, engine.runner.n_layers // 2)
    warnings: list[str] = []
    damaged = engine.query(QUESTION, opts, on_warning=warnings.append)
    assert [w for w in warnings if victim[:12] in w and "went on" in w] and len(warnings) == 1, warnings
    assert [s.cached for s in damaged.segments] == [True, True, True]
    assert damaged.generation.token_ids == clean.generation.token_ids
    assert damaged.fusion.stream.layers_loaded == clean.fusion.stream.layers_loaded
    assert damaged.fusion.recomputed_token_layers == clean.fusion.recomputed_token_layers
    again = engine.query(QUESTION, opts, on_warning=warnings.append)
    assert len(warnings) == 1 and again.generation.token_ids == clean.generation.token_ids  # restored


# A missing blob (found by a stat before fusing) is recomputed in the prompt, built ahead on the loader's thread;
# a bit flip found mid-fusion is recovered in place (the test above, on demand in the fusor's thread), or, with a
# lossy codec that prefilling again cannot reproduce, recomputed in the prompt (tests/unit/test_quant_archive.py).
@pytest.mark.parametrize("damage,overlap", [("missing", True)])
def test_corrupt_blob_falls_back_to_recompute(engine, damage, overlap):
    opts = pinned(engine, 3, loader_overlap=overlap)
    clean = engine.query(QUESTION, opts)
    victim = clean.segments[1].key
    archive = engine.archive()
    (archive.path / archive.get_segment(victim).blob).unlink()
    warnings: list[str] = []
    damaged = engine.query(QUESTION, opts, on_warning=warnings.append)
    assert any(victim[:12] in w for w in warnings), warnings
    assert [s.cached for s in damaged.segments] == [True, False, True]
    # Identical to a run where that segment is simply recomputed.
    assert damaged.prefix_cached
    expected = fuse(engine.runner, archived_prompt(engine, damaged, recompute=victim), "blend", BlendConfig.single(DEFAULT_RATIO))
    assert torch.equal(expected.last_logits, damaged.fusion.last_logits)
    assert generate(engine.runner, expected, SHORT).token_ids == damaged.generation.token_ids


@pytest.mark.parametrize("select", ["hkvd", "probe"])
def test_instruction_prefix_is_archived_once_then_reused(engine, select):
    """The prefix's KV is exact at position 0: reusing it saves prefix × layers of compute and
    changes the answer only by its 16-bit storage rounding. (The probe pass also stops running
    the prefix's rows; its budget then returns those token-layers to the selection.)"""
    opts = pinned(engine, 3, select=select)
    segments_before = engine.archive().count_segments()
    first = engine.query(QUESTION, opts)
    assert not first.prefix_cached
    assert engine.archive().count_segments() == segments_before + 1
    prefix_ids = first.fusion.token_ids[: len(engine.runner.tokenize(_prefix_text(engine)))]
    key = engine.key_of(prefix_ids)
    rec = engine.archive().get_segment(key)
    assert rec is not None and rec.extra["role"] == "prefix" and rec.token_ids == prefix_ids
    assert not engine.archive().has_embedding(key)  # never retrieved as a passage
    second = engine.query(QUESTION, opts)
    assert second.prefix_cached and second.fusion.exact_prefix_tokens == len(prefix_ids)
    assert engine.archive().count_segments() == segments_before + 1
    saved = first.fusion.recomputed_token_layers - second.fusion.recomputed_token_layers
    prefix_token_layers = len(prefix_ids) * engine.runner.n_layers
    if select == "hkvd":
        assert saved == prefix_token_layers
    else:
        assert first.fusion.probe_token_layers - second.fusion.probe_token_layers == prefix_token_layers
        assert second.fusion.recompute_share <= first.fusion.recompute_share
    if select == "hkvd":  # same selection both times (the probe's budget, and so its choice, moved)
        assert second.answer == first.answer
        first_p = torch.log_softmax(first.fusion.last_logits, -1)
        second_p = torch.log_softmax(second.fusion.last_logits, -1)
        assert float((first_p.exp() * (first_p - second_p)).sum()) < 1e-4
    # Opting out neither reads nor writes it; `full` never uses it (once: the selection plays no part in full).
    off = engine.query(QUESTION, replace(opts, cache_prefix=False))
    assert not off.prefix_cached and off.fusion.exact_prefix_tokens == 0
    assert off.fusion.recomputed_token_layers == first.fusion.recomputed_token_layers
    if select == "hkvd":
        full = engine.query(QUESTION, replace(opts, mode="full"))
        assert not full.prefix_cached and full.recompute_share == 1.0


def _prefix_text(engine) -> str:
    return split_template(engine.runner, PromptTemplate(), QUESTION)[0]


def test_bad_queries_are_clear_errors(engine, tmp_path, default_runner):
    with pytest.raises(UsageError, match="no such document"):
        engine.query(QUESTION, QueryOptions(docs=["nope.md"]))
    with pytest.raises(UsageError, match="top-k"):
        engine.query(QUESTION, QueryOptions(top_k=0))
    with pytest.raises(UsageError, match="empty question"):
        engine.query("   ", QueryOptions())
    with pytest.raises(UsageError, match="context is"):
        engine.query("why " * 9000, QueryOptions(top_k=2))
    with pytest.raises(UsageError, match=r"ratio must be in \(0, 1\]"):
        engine.query(QUESTION, QueryOptions(ratio=1.5))
    with Engine(tmp_path / "empty", runner=default_runner) as empty:
        empty.archive(create=True)
        with pytest.raises(UsageError, match="empty"):
            empty.query(QUESTION, QueryOptions())


def test_query_uses_the_tuned_ratio_and_ratio_overrides_it(engine):
    """What `kvblend tune` stored for this model/device/archive is what `query` recomputes at."""
    runner = engine.runner
    engine.archive().put_tuned(tuned_key(engine.model_name, runner.device.type, engine.location), {"ratio": 0.4})
    # hkvd: the plain budget, ⌈ratio · cached⌉ kept (the probe pays its pass out of it)
    opts = pinned(engine, 2, select="hkvd", sampling=SamplingConfig(max_new_tokens=1))
    tuned = engine.query(QUESTION, opts)
    cached = tuned.fusion.cached_tokens
    uncached = len(tuned.fusion.token_ids) - cached
    assert tuned.ratio == 0.4
    assert tuned.fusion.active_per_layer[-1] == uncached + math.ceil(0.4 * cached)
    opts = replace(opts, ratio=0.1)
    override = engine.query(QUESTION, opts)  # the instruction prefix is archived now: never recomputed
    exact = override.fusion.exact_prefix_tokens
    assert override.ratio == 0.1 and exact > 0
    assert override.fusion.active_per_layer[-1] == uncached - exact + math.ceil(0.1 * cached)
    # the same weights by another name (a GGUF's path for a bundled model's name) share the archive, and so
    # its tuned ratio: it was silently dropped for the default
    alias = replace(runner, name="the-same-weights-by-another-name")
    with Engine(engine.location, runner=alias) as other:
        assert other.query(QUESTION, replace(opts, ratio=None)).ratio == 0.4
