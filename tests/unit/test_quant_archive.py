"""A real archive holding segments of several codecs, on a tiny random-weight model: each segment
streams with its own codec, verify/stats see every codec, and a damaged quantized blob is found by
`verify` and recomputed by the query pipeline."""

from __future__ import annotations

import json

import pytest
import torch

from support import cached_prompt, flip_layer_byte, one_line_error, random_tokens, run_cli, tiny_runner
from kvblend.archive import SegmentRecord
from kvblend.evaluation.metrics import kl_divergence
from kvblend.feeds.archive import ArchiveFeed
from kvblend.feeds.memory import InMemoryFeed
from kvblend.fusion import BlendConfig, feed_schedule, fuse, plan_prompt
from kvblend.model.prefill import storage_dtype
from kvblend.pipeline import Engine, QueryOptions
from kvblend.pipeline.query import fuse_streaming
from kvblend.types import Segment, drain

CODEC_OF = {"chunk0": "lossless", "chunk1": "int8", "chunk2": "int4"}


@pytest.fixture(scope="module")
def runner():
    return tiny_runner("llama")  # llama3 rope scaling: re-positioning is not the identity


@pytest.fixture(scope="module")
def prompt(runner) -> list[Segment]:
    """[uncached prefix] + three cached 70-88 token chunks + [uncached question]."""
    return cached_prompt(runner, [70, 79, 88])


@pytest.fixture
def engine(tmp_path, runner):
    with Engine(tmp_path / "arc", runner=runner, sink="none") as eng:  # a tiny runner has no tokenizer
        yield eng


def store_mixed(runner, archive, segs) -> dict[str, SegmentRecord]:
    """Each cached chunk stored with its own codec (CODEC_OF), in separate batches as separate ingests would."""
    dtype = str(storage_dtype(runner)).replace("torch.", "")
    with archive.writer():
        for seg in segs:
            if seg.kv is not None:
                rec = SegmentRecord(key=seg.key, n_tokens=len(seg.token_ids), token_ids=seg.token_ids, dtype=dtype)
                archive.put_segments([(rec, seg.kv)], codec=CODEC_OF[seg.key])
    return {s.key: archive.get_segment(s.key) for s in segs if s.kv is not None}


def offsets_of(segs):
    starts, at = [], 0
    for s in segs:
        starts.append(at)
        at += len(s.token_ids)
    return starts


def streamed(segs):
    return [Segment(s.token_ids, cached=s.kv is not None, key=s.key) for s in segs]


@pytest.mark.parametrize("overlap", [True, False], ids=["built-ahead", "built-on-demand"])
def test_mixed_codec_archive_streams_each_segment_with_its_own_codec(runner, prompt, engine, overlap):
    archive = engine.archive()
    records = store_mixed(runner, archive, prompt)
    assert [records[k].codec for k in ("chunk0", "chunk1", "chunk2")] == ["zstd-shuffle", "int8", "int4"]
    per_token = archive.stats().bytes_per_token_by_codec
    assert per_token["int4"] < per_token["int8"] < per_token["zstd-shuffle"]
    # What the loader builds = the in-memory layout of the KV each codec decodes to (dequantized in place).
    decoded = [Segment(s.token_ids, kv=None if s.kv is None else
                       [archive.read_layer(records[s.key], i) for i in range(runner.n_layers)], key=s.key)
               for s in prompt]
    cfg = BlendConfig.single(0.3)
    plan = plan_prompt(prompt, "blend")
    schedule = feed_schedule(prompt, plan, "blend", cfg, runner.n_layers)
    memory = InMemoryFeed(runner, decoded, plan.offsets, schedule)
    with ArchiveFeed(runner, archive, streamed(prompt), records, plan.offsets, schedule, overlap=overlap) as feed:
        for layer in schedule:
            k_mem, v_mem = memory.layer(layer)
            k_arc, v_arc = feed.layer(layer)
            assert torch.allclose(k_arc, k_mem, atol=2e-3, rtol=2e-3) and torch.allclose(v_arc, v_mem, atol=2e-3)
    assert feed.stats.raw_bytes > feed.stats.bytes_read > 0 and feed.stats.build_s > 0
    # ... and it answers like the lossless archive: same next token, a small KL.
    lossless = fuse(runner, prompt, "blend", cfg)
    with ArchiveFeed(runner, archive, streamed(prompt), records, plan.offsets, schedule, overlap=overlap) as feed:
        mixed = fuse(runner, streamed(prompt), "blend", cfg, feed=feed)
    assert mixed.last_logits.argmax() == lossless.last_logits.argmax()
    assert kl_divergence(lossless.last_logits.float(), mixed.last_logits.float()) < 1e-3


def test_lossy_codecs_get_keys_of_their_own(engine):
    ids = random_tokens(20, 3)
    keys = {c: engine.key_of(ids, c) for c in ("lossless", "zstd", "zstd-shuffle", "int8", "int4")}
    assert keys["lossless"] == keys["zstd"] == keys["zstd-shuffle"] == engine.key_of(ids)  # same bits, same key
    assert len({keys["lossless"], keys["int8"], keys["int4"]}) == 3



def test_corrupt_quantized_blob_is_found_by_verify_and_recomputed_by_query(runner, prompt, engine):
    archive = engine.archive()
    records = store_mixed(runner, archive, prompt)
    report = archive.verify(deep=True)
    assert report.ok and report.codecs == {"zstd-shuffle": 1, "int8": 1, "int4": 1}
    flip_layer_byte(archive, records["chunk2"], 2)
    for deep in (False, True):
        report = archive.verify(deep=deep)
        assert [(p.key, p.layer) for p in report.problems] == [("chunk2", 2)]
    proc = run_cli("verify", "--archive", archive.path, "--json")
    assert proc.returncode == 1 and json.loads(proc.stdout)["problems"][0]["segment"] == "chunk2"

    segs = streamed(prompt)
    warnings: list[str] = []
    opts = QueryOptions(mode="blend", ratio=0.3)
    fused, unreadable = drain(fuse_streaming(engine, segs, records, opts, BlendConfig.single(0.3), warnings.append))
    assert unreadable == ["chunk2"]
    assert len(warnings) == 1 and "chunk2" in warnings[0] and "recomputing" in warnings[0]
    assert [s.cached for s in segs] == [False, True, True, False, False]  # only the damaged one recomputed
    again, _ = drain(fuse_streaming(engine, [Segment(s.token_ids, cached=s.cached, key=s.key) for s in segs],
                                    records, opts, BlendConfig.single(0.3), warnings.append))
    assert torch.equal(fused.last_logits, again.last_logits) and len(warnings) == 1


def test_stats_and_verify_commands_show_every_codec(runner, prompt, engine):
    store_mixed(runner, engine.archive(), prompt)
    path = engine.archive().path
    stats = json.loads(run_cli("stats", "--archive", path, "--json", check=True).stdout)
    assert set(stats["bytes_per_token_by_codec"]) == {"zstd-shuffle", "int8", "int4"}
    text = run_cli("verify", "--archive", path, check=True).stdout
    assert "1 int4" in text and "1 int8" in text and "1 zstd-shuffle" in text


def test_unknown_codec_is_refused_with_one_line(tmp_path):
    doc = tmp_path / "doc.txt"
    doc.write_text("Some text to archive.\n")
    line = one_line_error(run_cli("ingest", doc, "--codec", "int3", "--archive", tmp_path / "arc"))
    assert "--codec" in line and "'int3'" in line and "int4" in line and "lossless" in line
    assert not (tmp_path / "arc").exists()  # refused before anything was created
    qa = tmp_path / "qa.json"
    qa.write_text(json.dumps([{"question": "q?", "answers": ["a"], "ctxs": [{"title": "t", "text": "x"}]}]))
    line = one_line_error(run_cli("bench", qa, "--codecs", "lossless,int3", "--archive", tmp_path / "b"))
    assert "--codecs" in line and "unknown codec 'int3'" in line
