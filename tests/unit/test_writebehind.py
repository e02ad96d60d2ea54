"""The write-behind queue (issue 35 point 4): a query only reads; its writes run after the answer, in order,
through the engine's one queue, and a write that fails is a warning, never a lost answer."""

from __future__ import annotations

from support import flip_layer_byte
from test_fusor_fixes import PASSAGES, ask, engine_for

from kvblend.pipeline.writebehind import WriteBehind
from kvblend.types import WAITING, Steps


def test_jobs_run_in_order_and_a_failing_one_is_a_warning_that_stops_nothing():
    queue, ran, warnings = WriteBehind(), [], []

    def stepwise(name: str) -> Steps[None]:
        ran.append(f"{name}:start")
        yield WAITING  # another writer holds it a moment: drain waits, then goes on
        ran.append(f"{name}:end")

    def fails() -> None:
        raise OSError("disk full")

    queue.put(stepwise("a"))
    queue.put_call(fails)
    queue.put_call(lambda: ran.append("c"))
    assert ran == [] and len(queue) == 3  # nothing runs when it is queued
    assert queue.drain(warnings.append) == 3
    assert ran == ["a:start", "a:end", "c"] and not queue
    assert warnings == ["could not write after the answer: disk full"]


def test_a_query_writes_nothing_before_its_answer_and_the_engine_writes_it_after(tmp_path):
    """At the first token (and when run_query returns) the archive holds only what was there before: the
    instruction prefix is not archived, no segment touched. Engine.query drains the queue after the answer, so
    the next query finds the prefix archived, as when the writes ran inline."""
    from kvblend.generation import SamplingConfig
    from kvblend.pipeline import QueryOptions
    from kvblend.pipeline.query import run_query

    with engine_for(tmp_path, "a") as engine:
        keys = [r.key for r in engine.store_texts(PASSAGES)]
        archive = engine.archive()
        before = {r.key: r.hits for r in archive.iter_segments()}
        seen: list[dict[str, int]] = []

        def on_token(_: str) -> None:
            seen.append({r.key: r.hits for r in archive.iter_segments()})

        opts = QueryOptions(segment_keys=keys, sampling=SamplingConfig(max_new_tokens=3))
        first = run_query(engine, "what is alpha one", opts, on_token)
        assert seen and seen[0] == before  # nothing written before the first token
        assert {r.key: r.hits for r in archive.iter_segments()} == before and len(engine.writes) == 1
        assert not first.prefix_cached
        engine.writes.drain()
        after = {r.key: r.hits for r in archive.iter_segments()}
        assert len(after) == len(before) + 1  # the instruction prefix, archived after the answer
        assert all(after[k] == before[k] + 1 for k in keys)  # and the passages used, touched
        second = engine.query("what is alpha two", opts)
        assert second.prefix_cached and not engine.writes  # Engine.query drained its own writes


def test_closing_the_engine_runs_the_writes_still_queued(tmp_path):
    from kvblend.generation import SamplingConfig
    from kvblend.pipeline import QueryOptions
    from kvblend.pipeline.query import run_query

    with engine_for(tmp_path, "a") as engine:
        keys = [r.key for r in engine.store_texts(PASSAGES)]
        opts = QueryOptions(segment_keys=keys, sampling=SamplingConfig(max_new_tokens=3))
        run_query(engine, "what is alpha one", opts)
        assert engine.writes
    with engine_for(tmp_path, "a") as reopened:
        assert reopened.archive().count_segments() == len(PASSAGES) + 1  # the prefix, written on close



def test_a_blob_damaged_at_a_middle_layer_is_recomputed_in_place_and_restored_after_the_answer(tmp_path):
    """Layer l of a passage fails its checksum mid-fusion: the passage is prefilled alone (what ingest stored)
    and fed from memory from layer l on. The answer is the undamaged archive's, the fusion ran once (the same
    token-layers recomputed and layers loaded as the clean run: a restart recomputes the passage in the prompt),
    and the passage's KV is written back after the answer, so the next query reads it from the archive."""
    import torch

    from kvblend.generation import SamplingConfig
    from kvblend.pipeline import QueryOptions

    def ask(engine, keys, on_warning=None):
        opts = QueryOptions(segment_keys=keys, sampling=SamplingConfig(max_new_tokens=3))
        return engine.query("what is alpha one", opts, on_warning=on_warning)

    with engine_for(tmp_path, "a") as engine:
        keys = [r.key for r in engine.store_texts(PASSAGES)]
        ask(engine, keys)  # the instruction prefix is archived: both runs below read it
        clean = ask(engine, keys)
        archive = engine.archive()
        middle = engine.runner.n_layers // 2
        before = [archive.read_layer(keys[1], i) for i in range(engine.runner.n_layers)]
        flip_layer_byte(archive, keys[1], middle)
        warnings: list[str] = []
        damaged = ask(engine, keys, on_warning=warnings.append)
        assert [w for w in warnings if keys[1][:12] in w and "went on" in w], warnings
        assert not any("recomputing" in w for w in warnings), warnings
        assert damaged.generation.token_ids == clean.generation.token_ids
        assert all(s.cached for s in damaged.segments)
        assert damaged.fusion.recomputed_token_layers == clean.fusion.recomputed_token_layers
        assert damaged.fusion.stream.layers_loaded == clean.fusion.stream.layers_loaded
        restored = [archive.read_layer(keys[1], i) for i in range(engine.runner.n_layers)]  # checksums pass again
        assert all(torch.allclose(a.float(), b.float(), atol=1e-2) for (a, _), (b, _) in zip(before, restored))
        again = ask(engine, keys, on_warning=warnings.append)
        assert again.generation.token_ids == clean.generation.token_ids and len(warnings) == 1


def test_a_stored_miss_answers_from_its_kv_and_is_written_after_the_answer(tmp_path):
    """`query --context-file --store`: the passage is prefilled alone and answers from that KV; the archive
    holds nothing new at the first token, and after the answer holds exactly what store_texts would have
    stored (same key, same KV). The answer equals one over the passage stored beforehand."""
    import torch

    from kvblend.generation import SamplingConfig
    from kvblend.pipeline import QueryOptions
    from kvblend.pipeline.query import run_query

    text = PASSAGES[1]
    opts = QueryOptions(context_texts=[text], store_context=True, top_k=0, sampling=SamplingConfig(max_new_tokens=3))
    with engine_for(tmp_path, "ahead") as ahead:
        (expected_rec,) = ahead.store_texts([text])
        expected = ahead.query("what is alpha one", opts)
        assert [s.cached for s in expected.segments] == [True] and not expected.segments[0].stored
        expected_kv = [ahead.archive().read_layer(expected_rec, i) for i in range(ahead.runner.n_layers)]
    with engine_for(tmp_path, "behind") as engine:
        archive = engine.archive()
        counts: list[int] = []
        result = run_query(engine, "what is alpha one", opts, lambda _: counts.append(archive.count_segments()))
        assert counts[0] == 0 and archive.count_segments() == 0  # nothing written at the first token
        assert [(s.cached, s.stored) for s in result.segments] == [(True, True)]
        assert result.generation.token_ids == expected.generation.token_ids
        engine.writes.drain()
        rec = archive.get_segment(expected_rec.key)
        assert rec is not None and archive.has_embedding(rec.key) and archive.count_segments() == 2  # and the prefix
        kv = [archive.read_layer(rec, i) for i in range(engine.runner.n_layers)]
        assert all(torch.equal(a, b) for layer, other in zip(kv, expected_kv) for a, b in zip(layer, other))
        assert [s.cached for s in engine.query("what is alpha one", opts).segments] == [True]


def test_a_prompt_too_long_for_the_context_stores_none_of_its_passages(tmp_path):
    """The early check counted the passages but not the template and question: a prompt that passed it was
    prefilled, its --store passage staged, and the write ran on close although the query failed."""
    import pytest

    from kvblend.generation import SamplingConfig
    from kvblend.pipeline import QueryOptions
    from kvblend.pipeline.query import ContextLengthError

    with engine_for(tmp_path, "a") as engine:
        engine.store_texts(PASSAGES[:1])
        passage = " ".join(f"gamma{i}" for i in range(100))
        room = engine.runner.max_positions - len(engine.runner.tokenize(passage + "\n\n"))
        opts = QueryOptions(context_texts=(passage,), store_context=True, top_k=0,
                            sampling=SamplingConfig(max_new_tokens=room - 2))  # the passages fit; the prompt not
        with pytest.raises(ContextLengthError, match="use shorter passages or a shorter question"):
            engine.query("what is gamma seven", opts)
    with engine_for(tmp_path, "a") as reopened:
        assert reopened.archive().count_segments() == 1  # only what was there before


def test_blend_at_ratio_one_reports_nothing_cached(tmp_path):
    """Blend at ratio 1.0 recomputes every token (it is `full`, bit for bit), yet said the passages' KV and the
    instruction prefix were cached."""
    with engine_for(tmp_path, "a") as engine:
        keys = [r.key for r in engine.store_texts(PASSAGES)]
        ask(engine, keys)  # archives the instruction prefix
        exact = ask(engine, keys, ratio=1.0)
        assert exact.fusion.recompute_share == 1.0
        assert not exact.prefix_cached and not any(s.cached for s in exact.segments)
        blended = ask(engine, keys)
        assert blended.prefix_cached and all(s.cached for s in blended.segments)


def test_the_context_length_error_names_the_remedy_that_can_work():
    from kvblend.pipeline.query import ContextLengthError

    assert "use fewer segments (--top-k)" in str(ContextLengthError(9000, 64, 8192))
    assert "or --max-tokens at most 192" in str(ContextLengthError(8000, 500, 8192))
    assert str(ContextLengthError(500, 100000, 8192)).endswith("--max-tokens must be at most 7692 for this prompt")
    assert "--top-k" not in str(ContextLengthError(9000, 64, 8192, retrieved=False))


def test_ingesting_again_at_another_chunk_size_splits_the_documents_again(tmp_path):
    """--chunk-tokens was not part of "unchanged": an ingest at another size kept the old segments, and said 0 new."""
    docs = tmp_path / "docs"
    docs.mkdir()
    (docs / "a.md").write_text("\n\n".join(f"Paragraph {i} says alpha{i} beta{i} gamma{i} delta{i}." for i in range(40)))
    with engine_for(tmp_path, "a") as engine:
        first = engine.ingest([docs], chunk_tokens=64)
        assert first.segments_new > 1 and engine.ingest([docs], chunk_tokens=64).segments_new == 0
        again = engine.ingest([docs], chunk_tokens=128)
        assert 0 < again.segments_new < first.segments_new
        doc = engine.archive().get_document(str(docs / "a.md"))
        assert len(doc.segment_keys) == again.segments_new and doc.extra["chunk_tokens"] == 128


def test_a_container_read_again_forgets_the_documents_it_no_longer_holds(tmp_path, monkeypatch):
    """A JSONL file with a line deleted kept its last line's document (#L3) in the archive, retrieved and cited
    as if it were still there; a line that is now invalid JSON is skipped, and its document kept. The folder is
    given as the README gives it, relative (paths as typed never matched the archive's absolute ones)."""
    import json

    monkeypatch.chdir(tmp_path)

    docs = tmp_path / "docs"
    docs.mkdir()
    lines = [json.dumps({"text": f"Fact {i}: alpha{i} beta{i} gamma{i}."}) for i in range(4)]
    (docs / "facts.jsonl").write_text("\n".join(lines) + "\n")
    (docs / "other.md").write_text("Another document.")
    with engine_for(tmp_path, "a") as engine:
        engine.ingest(["docs"], chunk_tokens=64)
        (docs / "facts.jsonl").write_text("\n".join([lines[1], "{not json", lines[3]]) + "\n")
        plan = engine.plan_ingest(["docs"], chunk_tokens=64)  # the dry run says so, and removes nothing
        assert plan.would_remove == [str(docs / "facts.jsonl") + "#L4"] and engine.archive().count_documents() == 5
        report = engine.ingest(["docs"], chunk_tokens=64)
        names = sorted(d.name for d in engine.archive().iter_documents())
        assert names == ["facts.jsonl#L1", "facts.jsonl#L2", "facts.jsonl#L3", "other.md"]  # L2: skipped, kept
        assert report.removed == [str(docs / "facts.jsonl") + "#L4"]
        assert engine.archive().verify().ok


def test_a_passage_pinned_twice_is_in_the_prompt_once(tmp_path):
    """`--doc a.md --doc a.md` (or a segment of a pinned document given again with --segment) put the passage
    into the prompt twice."""
    from kvblend.generation import SamplingConfig
    from kvblend.pipeline import QueryOptions
    from kvblend.pipeline.query import select_records

    docs = tmp_path / "docs"
    docs.mkdir()
    (docs / "a.md").write_text("Alpha one beta two gamma three.")
    with engine_for(tmp_path, "a") as engine:
        engine.ingest([docs], chunk_tokens=64)
        key = engine.archive().get_document(str(docs / "a.md")).segment_keys[0]
        opts = QueryOptions(docs=("a.md", str(docs / "a.md")), segment_keys=(key[:12],),
                            sampling=SamplingConfig(max_new_tokens=2))
        records, infos = select_records(engine, "what is alpha", opts)
        assert [r.key for r in records] == [key] and len(infos) == 1
