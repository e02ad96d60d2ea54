"""Feeds on a tiny random-weight model: the in-memory layout is the KV each segment would have at its
place in the prompt, and streaming from a real archive on disk hands the fusor exactly the same."""

from __future__ import annotations

import pytest
import torch

from support import cached_prompt, flip_layer_byte, tiny_runner
from kvblend.archive import Archive, SegmentRecord
from kvblend.feeds.archive import ArchiveFeed, SegmentUnavailable
from kvblend.feeds.memory import InMemoryFeed
from kvblend.fusion import BlendConfig, feed_schedule, fuse, plan_prompt
from kvblend.model.prefill import precompute_kv, storage_dtype
from kvblend.types import Segment

ATOL = 1e-4


@pytest.fixture(scope="module")
def runner():
    return tiny_runner("qwen2")


@pytest.fixture(scope="module")
def prompt(runner) -> list[Segment]:
    """[uncached prefix] + three cached chunks (16-bit, as archived) + [uncached question]."""
    return cached_prompt(runner, [30, 39, 48])


def offsets_of(segs: list[Segment]) -> list[int]:
    starts, at = [], 0
    for s in segs:
        starts.append(at)
        at += len(s.token_ids)
    return starts


def test_in_memory_layer_is_each_segment_placed_by_hand(runner, prompt):
    """K rows equal the segment's K prefilled at its prompt offset; V is as stored; uncached rows are zero."""
    offsets = offsets_of(prompt)
    feed = InMemoryFeed(runner, prompt, offsets)
    for layer in (0, runner.n_layers - 1):
        k, v = feed.layer(layer)
        assert k.shape == (1, runner.n_kv_heads, sum(len(s.token_ids) for s in prompt), runner.head_dim)
        for seg, start in zip(prompt, offsets):
            rows = slice(start, start + len(seg.token_ids))
            if seg.kv is None:
                assert not k[0, :, rows].any() and not v[0, :, rows].any()
                continue
            placed = runner.prefill_batch([seg.token_ids], start_position=start)[0][layer][0]
            assert torch.allclose(k[0, :, rows], placed, atol=1e-2)  # stored in fp16
            assert torch.equal(v[0, :, rows], seg.kv[layer][1].float())


def test_in_memory_feed_leaves_out_segments_the_schedule_does_not_need(runner, prompt):
    offsets = offsets_of(prompt)
    needed = [False, True, False, True, False]
    k, _ = InMemoryFeed(runner, prompt, offsets, {2: needed}).layer(2)
    full_k, _ = InMemoryFeed(runner, prompt, offsets).layer(2)
    for seg, start, need in zip(prompt, offsets, needed):
        rows = slice(start, start + len(seg.token_ids))
        if need:
            assert torch.equal(k[0, :, rows], full_k[0, :, rows])
        else:
            assert not k[0, :, rows].any()


def record_of(runner, seg: Segment) -> SegmentRecord:
    """The index record a segment prefilled alone at position 0 gets (as ingest writes it)."""
    return SegmentRecord(key=seg.key, n_tokens=len(seg.token_ids), token_ids=seg.token_ids,
                         dtype=str(storage_dtype(runner)).replace("torch.", ""), n_layers=runner.n_layers,
                         kv_heads=runner.n_kv_heads, head_dim=runner.head_dim)


def with_cached_prefix(runner, prompt: list[Segment]) -> list[Segment]:
    """The prompt with its first segment cached at position 0 (the exact instruction prefix)."""
    first = prompt[0].token_ids
    return [Segment(first, kv=precompute_kv(runner, [first])[0], key="sink"), *prompt[1:]]


@pytest.fixture
def archive(tmp_path):
    archive = Archive.open(tmp_path / "arc", create=True, model_name="tiny", model_fingerprint="tiny")
    yield archive
    archive.close()


def store(runner, archive: Archive, segs: list[Segment]) -> dict[str, SegmentRecord]:
    """Archive every cached segment of `segs`; their records as the archive has them, by key."""
    cached = [seg for seg in segs if seg.kv is not None]
    with archive.writer():
        archive.put_segments([(record_of(runner, seg), seg.kv) for seg in cached])
    return {seg.key: archive.get_segment(seg.key) for seg in cached}


def streamed_prompt(prompt: list[Segment]) -> list[Segment]:
    """The same prompt as a query has it: cached segments carry keys, not KV."""
    return [Segment(s.token_ids, cached=s.kv is not None, key=s.key) for s in prompt]


@pytest.mark.parametrize("overlap", [True, False], ids=["built-ahead", "built-on-demand"])
@pytest.mark.parametrize("cached_prefix", [False, True])
def test_archive_feed_streams_exactly_the_in_memory_layers(runner, prompt, archive, overlap, cached_prefix):
    segs = with_cached_prefix(runner, prompt) if cached_prefix else prompt
    records = store(runner, archive, segs)
    cfg = BlendConfig.single(0.3, select="hkvd")  # the probe policy reads every layer (test_policies)
    plan = plan_prompt(segs, "blend")
    schedule = feed_schedule(segs, plan, "blend", cfg, runner.n_layers)
    assert list(schedule) == (list(range(runner.n_layers)) if cached_prefix else list(range(1, runner.n_layers)))
    streamed = streamed_prompt(segs)
    memory = InMemoryFeed(runner, segs, plan.offsets, schedule)
    with ArchiveFeed(runner, archive, streamed, records, plan.offsets, schedule, depth=2, overlap=overlap) as feed:
        for layer in schedule:
            k_mem, v_mem = memory.layer(layer)
            k_arc, v_arc = feed.layer(layer)
            assert torch.equal(k_arc, k_mem) and torch.equal(v_arc, v_mem), layer
    assert feed.stats.layers_loaded == len(schedule) and 1 <= feed.stats.high_water <= 2
    assert feed.stats.build == ("overlap" if overlap else "on-demand")
    # And so the fusion over either feed is the same, bit for bit.
    local = fuse(runner, segs, "blend", cfg)
    with ArchiveFeed(runner, archive, streamed, records, plan.offsets, schedule, overlap=overlap) as feed:
        remote = fuse(runner, streamed, "blend", cfg, feed=feed)
    assert torch.equal(local.last_logits, remote.last_logits)



@pytest.mark.parametrize("overlap", [True, False], ids=["built-ahead", "built-on-demand"])
@pytest.mark.parametrize("damage", ["bitflip", "missing"])
def test_a_damaged_blob_raises_segment_unavailable_naming_it(runner, prompt, archive, overlap, damage):
    records = store(runner, archive, prompt)
    victim = records["chunk1"]
    if damage == "bitflip":
        flip_layer_byte(archive, victim, 2)
    else:
        (archive.path / victim.blob).unlink()
    plan = plan_prompt(prompt, "reuse")
    schedule = feed_schedule(prompt, plan, "reuse", BlendConfig(), runner.n_layers)
    with ArchiveFeed(runner, archive, streamed_prompt(prompt), records, plan.offsets, schedule,
                     overlap=overlap) as feed:
        first_bad = 2 if damage == "bitflip" else 0
        for layer in range(first_bad):
            feed.layer(layer)  # the intact layers still stream
        with pytest.raises(SegmentUnavailable) as caught:
            feed.layer(first_bad)
    assert caught.value.key == "chunk1"
    assert "chunk1" in str(caught.value)
