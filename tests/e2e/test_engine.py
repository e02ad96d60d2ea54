"""End-to-end checks of the engine on the real default model (SmolLM2-135M-Instruct)."""

from __future__ import annotations

import shutil
import subprocess

from support import DOCS, FIXTURES, kvblend_script


def test_demo_asks_with_full_reuse_and_blend_side_by_side(copy_of_bundled_archive):
    """The demo's story on one bundled question: blend stays closer to full than reuse at under a quarter of its
    compute, over six retrieved passages (~3,000 tokens) streamed from the archive. Its archive already holds the
    bundled documents (ingested once for the whole run): the demo finds them unchanged, as on a second `kvblend
    demo`. (Full's greedy answer equals transformers' `generate`: tests/e2e/test_query.py.)"""
    from kvblend.evaluation.demo import run_demo

    run = run_demo(copy_of_bundled_archive, compute="cpu", n_questions=1)
    assert run.report.documents_unchanged == len(list(DOCS.glob("*.md")))
    assert [r.mode for r in run.rows] == ["full", "reuse", "blend"]
    by_mode = {r.mode: r for r in run.rows}
    assert by_mode["full"].kl_vs_full == 0.0 and by_mode["full"].same_as_full
    assert by_mode["blend"].kl_vs_full < by_mode["reuse"].kl_vs_full
    assert by_mode["blend"].recompute_share <= 0.25 and by_mode["reuse"].recompute_share < 0.05
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


def test_an_unchanged_file_is_known_by_its_bytes_and_not_converted_again(default_runner, tmp_path, monkeypatch):
    """Re-ingesting a folder converts only what changed: a PDF whose bytes the archive recorded is not read into
    text again (1,000 unchanged PDFs would otherwise be converted again to find nothing new). New bytes with the
    same text, or a new converter, convert it once more; the ingest reports its progress file by file."""
    from kvblend import conversion
    from kvblend.pipeline import Engine

    docs = tmp_path / "docs"
    docs.mkdir()
    shutil.copy(FIXTURES / "documents" / "manual.pdf", docs / "manual.pdf")
    shutil.copy(FIXTURES / "documents" / "quickstart.md", docs / "quickstart.md")
    real_convert = conversion.convert
    converted: list[str] = []

    def counting(fmt, data):
        converted.append(fmt)
        return real_convert(fmt, data)

    monkeypatch.setattr(conversion, "convert", counting)
    seen: list[dict] = []
    with Engine(tmp_path / "arc", runner=default_runner) as engine:
        first = engine.ingest([docs], on_progress=seen.append)
        assert converted == ["pdf"] and first.documents == 2 and first.documents_unchanged == 0
        # file by file, read as the ingest goes: the file about to be read, then "" at the end
        assert [(p["files"], p["total"], p["current"]) for p in seen] == [
            (0, 2, f"{docs.as_posix()}/manual.pdf"), (1, 2, f"{docs.as_posix()}/quickstart.md"), (2, 2, "")]
        assert seen[-1]["documents"] == 2 and seen[-1]["tokens"] == first.tokens_new

        again = engine.ingest([docs])
        assert converted == ["pdf"]  # known by its bytes: not converted
        assert (again.documents, again.documents_unchanged, again.tokens_new) == (2, 2, 0)
        assert again.tokens_total == first.tokens_total

        with open(docs / "manual.pdf", "ab") as f:  # new bytes, the same text (a byte after %%EOF)
            f.write(b"\n")
        touched = engine.ingest([docs])
        assert converted == ["pdf", "pdf"] and touched.documents_unchanged == 2 and touched.tokens_new == 0
        engine.ingest([docs])
        assert converted == ["pdf", "pdf"]  # its new bytes were recorded: known again

        # under the writer lock the record is asked again: if another writer replaced it since the file was
        # left unread, the file is read after all
        from kvblend.archive import check_codec
        from kvblend.defaults import DEFAULT_CHUNK_TOKENS, DEFAULT_CODEC
        from kvblend.documents import Unchanged, source_hash
        from kvblend.pipeline.ingest import _read_if_changed
        from kvblend.pipeline.results import IngestReport

        pdf = f"{docs.as_posix()}/manual.pdf"
        for recorded, read_again in ((source_hash((docs / "manual.pdf").read_bytes()), 0), ("replaced", 1)):
            report = IngestReport()
            found = _read_if_changed(engine, engine.archive(), [Unchanged(pdf, "manual.pdf", recorded)],
                                     check_codec(DEFAULT_CODEC), DEFAULT_CHUNK_TOKENS, report)
            assert [d.format for d in found] == ["pdf"] * read_again
            assert report.documents_unchanged == 1 - read_again
        assert converted == ["pdf"] * 3  # the read-again one

        monkeypatch.setattr(conversion, "CONVERSION_REVISION", conversion.CONVERSION_REVISION + 1)
        conversion.converter_identity.cache_clear()
        try:
            engine.ingest([docs])
        finally:
            monkeypatch.undo()
            conversion.converter_identity.cache_clear()
        assert converted == ["pdf"] * 4  # a new converter reads every file again


def test_an_unchanged_member_of_a_zipped_folder_is_not_converted_again(default_runner, tmp_path, monkeypatch):
    """A ZIP's members are known by their bytes as files are: re-ingesting a zipped folder of PDFs converts none
    of them again, and one whose record another writer replaced meanwhile is read from the bytes held."""
    import zipfile

    from kvblend import conversion
    from kvblend.archive import check_codec
    from kvblend.defaults import DEFAULT_CHUNK_TOKENS, DEFAULT_CODEC
    from kvblend.pipeline import Engine
    from kvblend.pipeline.ingest import _read_if_changed
    from kvblend.pipeline.results import IngestReport

    docs = tmp_path / "docs"
    docs.mkdir()
    with zipfile.ZipFile(docs / "bundle.zip", "w", zipfile.ZIP_DEFLATED) as z:
        z.write(FIXTURES / "documents" / "manual.pdf", "manual/manual.pdf")
        z.write(FIXTURES / "documents" / "quickstart.md", "manual/quickstart.md")
    real_convert = conversion.convert
    converted: list[str] = []
    monkeypatch.setattr(conversion, "convert", lambda fmt, data: converted.append(fmt) or real_convert(fmt, data))
    with Engine(tmp_path / "arc", runner=default_runner) as engine:
        first = engine.ingest([docs])
        assert converted == ["pdf"] and (first.documents, first.documents_unchanged) == (2, 0)
        names = sorted(d.name for d in engine.archive().iter_documents())
        assert names == ["bundle.zip/manual/manual.pdf", "bundle.zip/manual/quickstart.md"]
        again = engine.ingest([docs])
        assert converted == ["pdf"] and (again.documents, again.documents_unchanged, again.tokens_new) == (2, 2, 0)
        # the dry run agrees, and converts nothing either
        plan = engine.plan_ingest([docs])
        assert converted == ["pdf"] and plan.documents_unchanged == 2
        # left unread, then found replaced under the writer lock: read from the member's bytes, not the ZIP
        from kvblend.documents import Unchanged

        member = f"{docs.as_posix()}/bundle.zip/manual/manual.pdf"
        data = zipfile.ZipFile(docs / "bundle.zip").read("manual/manual.pdf")
        found = _read_if_changed(engine, engine.archive(), [Unchanged(member, "bundle.zip/manual/manual.pdf",
                                 "replaced", data)], check_codec(DEFAULT_CODEC), DEFAULT_CHUNK_TOKENS,
                                 IngestReport())
        assert [(d.format, d.name) for d in found] == [("pdf", "bundle.zip/manual/manual.pdf")]


def test_ingest_reads_as_it_goes_so_an_interrupt_keeps_what_was_committed(default_runner, tmp_path, monkeypatch):
    """Files are read one at a time as the ingest prefills, not all before it: memory holds a batch, and a
    batch commits before the next file is read. A Ctrl-C while a later PDF converts keeps the earlier
    document (all files used to be converted first, so it lost everything)."""
    from kvblend import conversion
    from kvblend.pipeline import Engine

    docs = tmp_path / "docs"
    docs.mkdir()
    shutil.copy(DOCS / "plants.md", docs / "a-plants.md")
    shutil.copy(FIXTURES / "documents" / "manual.pdf", docs / "b-manual.pdf")

    def interrupted(fmt, data):
        raise KeyboardInterrupt

    monkeypatch.setattr(conversion, "convert", interrupted)
    with Engine(tmp_path / "arc", runner=default_runner) as engine:
        try:
            engine.ingest([docs], batch_tokens=1)
        except KeyboardInterrupt:
            pass
        else:
            raise AssertionError("the interrupt was swallowed")
        archive = engine.archive()
        kept = archive.get_document(docs / "a-plants.md")
        assert kept is not None and kept.segment_keys and all(archive.has_segment(k) for k in kept.segment_keys)
        assert archive.get_document(docs / "b-manual.pdf") is None
    assert subprocess.run([*kvblend_script(), "verify", "--archive", str(tmp_path / "arc")]).returncode == 0


def test_the_bundled_gguf_by_its_path_loads_its_conversion_by_package_name(default_runner):
    """The same file by another name (its path, not `--model`'s package name) was de-quantised a second time:
    ~30 s for Gemma and 1.3 GB more in the model cache. Its fingerprint is the file's: one conversion serves both."""
    from kvblend.model import load_model
    from kvblend.model.loading import cached_conversion
    from kvblend.model.source import model_cache_dir, resolve_model_source

    source = resolve_model_source(None)
    path = source.directory / source.gguf_file
    before = sorted(p.name for p in model_cache_dir().iterdir())
    by_path = load_model(str(path), "cpu")
    assert by_path.fingerprint == default_runner.fingerprint and by_path.name != default_runner.name
    assert sorted(p.name for p in model_cache_dir().iterdir()) == before  # nothing converted again
    assert cached_conversion(by_path.name, by_path.fingerprint) == cached_conversion(default_runner.name,
                                                                                     default_runner.fingerprint)


def test_a_long_document_commits_batch_by_batch_and_an_interrupt_keeps_them(default_runner, tmp_path, monkeypatch):
    """--batch-tokens bounds what one batch prefills before it is stored: one long document was one batch,
    prefilled whole before anything was stored, so its KV filled memory whatever --batch-tokens said and a
    Ctrl-C near its end kept none of it. Its batches now commit as they go (the document with the last), and
    the next ingest reuses them."""
    from kvblend.pipeline import Engine
    from kvblend.pipeline import ingest as ingest_module

    docs = tmp_path / "docs"
    docs.mkdir()
    shutil.copy(DOCS / "research.md", docs / "research.md")
    real, calls = ingest_module.precompute_kv_steps, []

    def interrupted_at_the_fourth(*args, **kwargs):
        calls.append(1)
        if len(calls) == 4:
            raise KeyboardInterrupt
        return (yield from real(*args, **kwargs))

    monkeypatch.setattr(ingest_module, "precompute_kv_steps", interrupted_at_the_fourth)
    with Engine(tmp_path / "arc", runner=default_runner) as engine:
        try:
            engine.ingest([docs], chunk_tokens=64, batch_tokens=64)
        except KeyboardInterrupt:
            pass
        else:
            raise AssertionError("the interrupt was swallowed")
        archive = engine.archive()
        assert archive.get_document(docs / "research.md") is None  # it commits with its last batch
        stored = {rec.key for rec in archive.iter_segments()}
        assert len(stored) >= 3  # the three batches before the interrupt, of one segment or more each
        monkeypatch.setattr(ingest_module, "precompute_kv_steps", real)
        report = engine.ingest([docs], chunk_tokens=64, batch_tokens=64)
        assert report.segments_reused == len(stored) and report.segments_new > 0
        assert stored <= {rec.key for rec in engine.archive().iter_segments()}
    assert subprocess.run([*kvblend_script(), "verify", "--archive", str(tmp_path / "arc")]).returncode == 0
