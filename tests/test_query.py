"""`query` end to end on the real default model over a real archive of the fixture documents."""

from __future__ import annotations

import math
import shutil

import pytest
import torch

from conftest import FIXTURES
from kvblend.engine import Engine, QueryOptions
from kvblend.errors import UsageError
from kvblend.fusor import BlendConfig, Segment, fuse
from kvblend.generate import SamplingConfig, generate
from kvblend.prompt import PromptTemplate, assemble_prompt

pytestmark = pytest.mark.e2e

QUESTION = "Who manages the plant where the Tern-4 sonar is built?"
SHORT = SamplingConfig(max_new_tokens=12)


@pytest.fixture(scope="module")
def built_archive(tmp_path_factory, default_runner):
    path = tmp_path_factory.mktemp("arc") / "archive"
    with Engine(path, runner=default_runner) as engine:
        report = engine.ingest([FIXTURES / "docs"])
    assert report.segments_new >= 12
    return path


@pytest.fixture
def engine(built_archive, default_runner, tmp_path):
    """A private copy of the archive, so tests that damage it don't leak."""
    path = tmp_path / "archive"
    shutil.copytree(built_archive, path)
    with Engine(path, runner=default_runner) as eng:
        yield eng


def pinned(engine, n: int = 4) -> QueryOptions:
    docs = sorted(d.path for d in engine.archive().iter_documents())[:n]
    return QueryOptions(docs=docs, sampling=SHORT)


def test_full_answers_exactly_as_model_generate(engine, default_runner):
    result = engine.query(QUESTION, QueryOptions(mode="full", sampling=SHORT, top_k=4))
    ids = torch.tensor([result.fusion.token_ids])
    with torch.inference_mode():
        ref = default_runner.model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=12, do_sample=False)
    expected = []
    for t in ref[0, ids.shape[1]:].tolist():
        if t in default_runner.stop_token_ids:
            break
        expected.append(t)
    assert result.generation.token_ids == expected
    assert result.recompute_share == 1.0


def test_blend_at_ratio_one_answers_as_full(engine):
    opts = pinned(engine)
    full = engine.query(QUESTION, QueryOptions(**{**opts.__dict__, "mode": "full"}))
    blend = engine.query(QUESTION, QueryOptions(**{**opts.__dict__, "mode": "blend", "ratio": 1.0}))
    assert blend.answer == full.answer
    assert blend.generation.token_ids == full.generation.token_ids
    assert torch.allclose(blend.fusion.last_logits, full.fusion.last_logits, atol=1e-5)


@pytest.mark.parametrize("depth", [1, 2])
def test_streaming_holds_at_most_the_prefetch_depth(engine, depth):
    opts = pinned(engine)
    opts.prefetch_depth = depth
    result = engine.query(QUESTION, opts)
    stream = result.fusion.stream
    assert stream.layers_loaded == engine.runner.n_layers - 1  # blend loads layers 1..L-1
    assert 1 <= stream.high_water <= depth
    assert stream.bytes_read > 0


def test_streamed_blend_equals_in_memory_blend(engine):
    """Streaming is transport only: the fused result must equal fusing the same KV in memory."""
    opts = pinned(engine, 3)
    streamed = engine.query(QUESTION, opts)
    archive = engine.archive()
    runner = engine.runner
    segs = []
    for info in streamed.segments:
        rec = archive.get_segment(info.key)
        segs.append(Segment(list(rec.token_ids), kv=[archive.read_layer(rec, i) for i in range(runner.n_layers)]))
    prompt = assemble_prompt(runner, PromptTemplate(), QUESTION, segs)
    local = fuse(runner, prompt, "blend", BlendConfig.single(0.15))
    assert local.token_ids == streamed.fusion.token_ids
    assert torch.equal(local.last_logits, streamed.fusion.last_logits)


def _flip_byte(archive, key: str, layer: int) -> None:
    rec = archive.get_segment(key)
    entry = rec.layers[layer]
    blob = archive.path / rec.blob
    data = bytearray(blob.read_bytes())
    data[entry.offset + entry.length // 2] ^= 0xFF
    blob.write_bytes(bytes(data))


@pytest.mark.parametrize("damage", ["bitflip", "missing"])
def test_corrupt_blob_falls_back_to_recompute(engine, damage):
    opts = pinned(engine, 3)
    clean = engine.query(QUESTION, opts)
    victim = clean.segments[1].key
    archive = engine.archive()
    if damage == "bitflip":
        _flip_byte(archive, victim, 7)
    else:
        (archive.path / archive.get_segment(victim).blob).unlink()
    warnings: list[str] = []
    damaged = engine.query(QUESTION, opts, on_warning=warnings.append)
    assert any(victim[:12] in w for w in warnings), warnings
    assert [s.cached for s in damaged.segments] == [True, False, True]
    # Identical to a run where that segment is simply recomputed.
    runner = engine.runner
    segs = []
    for info in clean.segments:
        rec = archive.get_segment(info.key)
        kv = None if info.key == victim else [archive.read_layer(rec, i) for i in range(runner.n_layers)]
        segs.append(Segment(list(rec.token_ids), kv=kv))
    prompt = assemble_prompt(runner, PromptTemplate(), QUESTION, segs)
    expected = fuse(runner, prompt, "blend", BlendConfig.single(0.15))
    assert torch.equal(expected.last_logits, damaged.fusion.last_logits)
    assert generate(runner, expected, SHORT).token_ids == damaged.generation.token_ids


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
    from kvblend.controller import tuned_key

    runner = engine.runner
    engine.archive().put_tuned(tuned_key(engine.model_name, runner.device.type, engine.archive_path), {"ratio": 0.4})
    opts = pinned(engine, 2)
    opts.sampling = SamplingConfig(max_new_tokens=1)
    tuned = engine.query(QUESTION, opts)
    cached = tuned.fusion.cached_tokens
    uncached = len(tuned.fusion.token_ids) - cached
    assert tuned.ratio == 0.4
    assert tuned.fusion.active_per_layer[-1] == uncached + math.ceil(0.4 * cached)
    opts.ratio = 0.1
    override = engine.query(QUESTION, opts)
    assert override.ratio == 0.1
    assert override.fusion.active_per_layer[-1] == uncached + math.ceil(0.1 * cached)
