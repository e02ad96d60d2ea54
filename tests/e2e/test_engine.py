"""End-to-end checks of the engine on the real default model (SmolLM2-135M-Instruct)."""

from __future__ import annotations

import json
import shutil
import subprocess

import pytest
import torch

from support import DOCS, QUESTIONS, kvblend_script, reference_checkpoint
from kvblend.evaluation.metrics import kl_divergence
from kvblend.fusion import BlendConfig, fuse
from kvblend.generation import SamplingConfig, generate
from kvblend.model.prefill import precompute_kv
from kvblend.prompt import PromptTemplate, assemble_prompt, segment_text_for_kv
from kvblend.types import Segment


def fixture_question(index: int = 0) -> dict:
    return json.loads(QUESTIONS.read_text())[index]


def fixture_passages(runner, names: list[str]) -> list[Segment]:
    """Fixture documents as cached segments (prefilled alone, stored fp16 like the archive)."""
    ids = [runner.tokenize(segment_text_for_kv((DOCS / n).read_text())) for n in names]
    kvs = precompute_kv(runner, ids)
    return [Segment(i, kv=kv, key=n) for i, kv, n in zip(ids, kvs, names)]


def rag_names(question: dict, n_distractors: int) -> list[str]:
    """Needed docs separated by distractors, so cross-chunk attention matters."""
    others = sorted(p.name for p in DOCS.glob("*.md") if p.name not in question["docs"])
    first, second = question["docs"]
    return [first, *others[:n_distractors], second]


def test_greedy_generation_after_full_equals_model_generate(default_runner):
    runner = default_runner
    q = fixture_question(0)
    prompt = assemble_prompt(runner, PromptTemplate(), q["question"], fixture_passages(runner, q["docs"]))
    fused = fuse(runner, prompt, "full")
    ours = generate(runner, fused, SamplingConfig(max_new_tokens=24))
    ids = torch.tensor([fused.token_ids])
    with torch.inference_mode():
        ref = reference_checkpoint(runner).generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=24, do_sample=False)
    ref_tokens = ref[0, ids.shape[1]:].tolist()
    stops = runner.stop_token_ids
    expected = []
    for t in ref_tokens:
        if t in stops:
            break
        expected.append(t)
    assert ours.token_ids == expected
    assert len(expected) > 0


def test_blend_is_closer_to_full_than_reuse_at_a_quarter_of_the_compute(default_runner):
    runner = default_runner
    q = fixture_question(0)
    passages = fixture_passages(runner, rag_names(q, n_distractors=2))
    assert len(passages) >= 4
    assert sum(len(p.token_ids) for p in passages) >= 1500
    prompt = assemble_prompt(runner, PromptTemplate(), q["question"], passages)
    full = fuse(runner, prompt, "full")
    reuse = fuse(runner, prompt, "reuse")
    blend = fuse(runner, prompt, "blend", BlendConfig.single(0.15))
    kl_reuse = kl_divergence(full.last_logits, reuse.last_logits)
    kl_blend = kl_divergence(full.last_logits, blend.last_logits)
    assert kl_blend < kl_reuse, (kl_blend, kl_reuse)
    assert blend.recompute_share <= 0.25, blend.recompute_share
    assert reuse.recompute_share < 0.05


def test_demo_asks_with_full_reuse_and_blend_side_by_side(copy_of_bundled_archive):
    """The demo's story on one bundled question: blend stays closer to full than reuse, at a fraction of its compute.
    Its archive already holds the bundled documents (ingested once for the whole run): the demo finds them
    unchanged, as on a second `kvblend demo`."""
    from kvblend.evaluation.demo import run_demo

    run = run_demo(copy_of_bundled_archive, compute="cpu", n_questions=1)
    assert run.report.documents_unchanged == len(list(DOCS.glob("*.md")))
    assert [r.mode for r in run.rows] == ["full", "reuse", "blend"]
    by_mode = {r.mode: r for r in run.rows}
    assert by_mode["full"].kl_vs_full == 0.0 and by_mode["full"].same_as_full
    assert by_mode["blend"].kl_vs_full < by_mode["reuse"].kl_vs_full
    assert by_mode["blend"].recompute_share < 0.35 and by_mode["reuse"].recompute_share < by_mode["blend"].recompute_share
    summary = {m.mode: m for m in run.modes}
    assert summary["blend"].questions == 1 and summary["blend"].speedup_vs_full > 1
    assert run.report.documents == len(list(DOCS.glob("*.md")))


def test_a_copy_keeps_its_segments_when_the_original_changes_in_the_same_ingest(default_runner, tmp_path):
    """`b.md` is a copy of `a.md` and `a.md` changes, both in one run: b's segments are found stored and reused,
    and replacing a's record must not drop them as no longer listed (it used to: b pointed at nothing). A batch
    per document: a's replacement commits on the store thread while b is segmented (one batch failed too)."""
    batch_tokens = 1
    from kvblend.pipeline import Engine

    docs = tmp_path / "docs"
    docs.mkdir()
    shutil.copy(DOCS / "travel-policy.md", docs / "a.md")
    with Engine(tmp_path / "arc", runner=default_runner) as engine:
        engine.ingest([docs], batch_tokens=batch_tokens)
        shutil.copy(docs / "a.md", docs / "b.md")
        shutil.copy(DOCS / "skua-recall.md", docs / "a.md")
        report = engine.ingest([docs], batch_tokens=batch_tokens)
        assert report.segments_reused >= 1  # b's segments were a's: nothing to prefill for b
        archive = engine.archive()
        for name in ("a.md", "b.md"):
            doc = archive.get_document(docs / name)
            assert doc is not None and not doc.incomplete
            assert doc.segment_keys and all(archive.has_segment(k) for k in doc.segment_keys), name
    assert subprocess.run([*kvblend_script(), "verify", "--archive", str(tmp_path / "arc")]).returncode == 0
