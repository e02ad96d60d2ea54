"""Ingest: documents → segments → each prefilled alone, in batches → archived KV + embeddings.

Unchanged documents are skipped without loading the model; segments already in
the archive (or already waiting for prefill) are reused by key. Each batch is
stored on a background thread while the next one prefills (StoreBehind), and a
document is committed only after every segment it points at.
"""

from __future__ import annotations

import dataclasses
import functools
import heapq
import os
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import suppress
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from kvblend.archive import (
    Archive,
    DocumentRecord,
    SegmentRecord,
    check_codec,
    codec_settings,
    encode_layer,
)
from kvblend.defaults import DEFAULT_BATCH_TOKENS, DEFAULT_CODEC, DEFAULT_LEVEL
from kvblend.documents import Document, Reading, SourceFile, Unchanged, find_files, read_file, read_unchanged
from kvblend.errors import ArchiveError, UsageError
from kvblend.model.prefill import precompute_kv_steps
from kvblend.model.runner import ModelRunner
from kvblend.pipeline.resources import Resources
from kvblend.pipeline.results import IngestPlan, IngestReport
from kvblend.pipeline.writebehind import StagedSegment
from kvblend.prompt import segment_text_for_kv
from kvblend.provenance import segment_sources
from kvblend.retrieval import get_embedder
from kvblend.segmenter import split_into_spans
from kvblend.types import WAITING, LayerKV, Steps, drain

MIN_CHUNK_TOKENS = 16
SAMPLE_SEGMENTS = 8  # `ingest --dry-run` measures the longest new segments, at most this many ...
SAMPLE_TOKENS = 2048  # ... and this many tokens, prefilled in one batch as ingest would
CLAIM_WAIT_S = 60.0  # how long to wait for a segment another node is prefilling before prefilling it here


class StoreBehind:
    """Stores one prefilled batch on a background thread while the model prefills the next.

    Encoding (zstd releases the GIL), blob writes, their fsyncs and the index
    commit would otherwise stall the model between batches. One worker keeps
    the order (a document commits only after its segments), and at most one
    batch is in flight, so memory holds two batches of KV at most. Leaving the
    block waits for the batch in flight: an interrupted ingest still commits
    everything that was handed over, and a failure in the worker is raised here.
    """

    def __init__(self) -> None:
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="kvblend-store")
        self._inflight: Future | None = None
        self.keys: frozenset[str] = frozenset()  # segments being stored: not yet visible in the index

    def submit(self, job: Callable[[], None], keys: Iterable[str]) -> None:
        self.drain()
        self.keys = frozenset(keys)
        self._inflight = self._pool.submit(job)

    def drain(self) -> None:
        """Wait for the batch in flight; re-raise its error."""
        future, self._inflight = self._inflight, None
        try:
            if future is not None:
                future.result()
        finally:
            self.keys = frozenset()

    def __enter__(self) -> StoreBehind:
        return self

    def __exit__(self, *exc) -> None:
        try:
            self.drain()
        finally:
            self._pool.shutdown(wait=True)


class _Claims:
    """Every segment the documents of one ingest run list: replacing a document in that run drops none of them.

    The run decides to reuse a stored segment on its own thread while StoreBehind commits earlier documents on
    another; replacing a document drops the segments no document lists, and a later document of the run that
    was just found to reuse one of them is not committed yet. The lock orders the two: either the reuse is
    decided first and the replacement keeps the segment, or the replacement commits first and the segment is
    found gone and prefilled again. Without it, `b.md` (a copy of `a.md`) lost its segments when `a.md`
    changed in the same run.
    """

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.keys: set[str] = set()


@dataclass
class _Pending:
    """Segments awaiting prefill, and the documents that may commit once they are stored."""

    segments: list[tuple[str, str, list[int]]] = field(default_factory=list)  # (key, text, ids)
    keys: set[str] = field(default_factory=set)
    documents: list[DocumentRecord] = field(default_factory=list)
    claims: _Claims = field(default_factory=_Claims)  # the whole run's, not reset by take()

    def add(self, key: str, text: str, ids: list[int]) -> None:
        self.segments.append((key, text, ids))
        self.keys.add(key)

    def tokens(self) -> int:
        return sum(len(ids) for _, _, ids in self.segments)

    def take(self) -> tuple[list[tuple[str, str, list[int]]], list[DocumentRecord]]:
        """Hand over everything pending and start empty."""
        segments, documents = self.segments, self.documents
        self.segments, self.documents, self.keys = [], [], set()
        return segments, documents


def ingest_paths(
    res: Resources,
    paths: Iterable[str | Path],
    chunk_tokens: int,
    codec: str,
    level: int,
    batch_tokens: int,
    wait_for_writer: bool | float,
    on_progress: Callable[[dict], None] | None,
) -> IngestReport:
    """Segment, prefill and archive documents; unchanged segments are not recomputed."""
    codec = _checked(chunk_tokens, codec)
    started = time.perf_counter()
    existing = functools.cache(lambda: _existing_archive(res))  # opened at the first file worth asking about

    def held(path: str, digest: str) -> bool:  # its KV is checked under the writer lock, below: a file that
        return _holds_file(existing(), path, digest)  # fails that is read then

    # Files are read (converted) one at a time as the ingest goes, so memory holds a batch's documents, not
    # the corpus's, and the first batch commits before the last file is read.
    files, walked_past = find_files([Path(p) for p in paths])
    report = IngestReport(skipped=[{"path": s.path, "reason": s.reason} for s in walked_past])
    done = 0

    read_here = _ReadHere()

    def read(source: SourceFile) -> Reading:
        nonlocal done
        reading = read_file(source, held)
        report.skipped.extend({"path": s.path, "reason": s.reason} for s in reading.skipped)
        read_here.note(source, reading)
        done += 1
        return reading

    first = None  # the archive is created (and locked) only once there is something to put in it
    for source in files:
        _progress(on_progress, report, source.shown, done, len(files))
        first = read(source)
        if first.docs or first.unchanged:
            break
    if first is None or not (first.docs or first.unchanged):
        raise _nothing_to_ingest(report.skipped)
    load_before = res.model_load_s
    if not Archive.exists(res.location):  # a new archive prefills everything: a model that fails to load
        _ = res.runner  # must leave no empty archive behind (its folder, index and disk reserve)
    archive = res.archive(create=True)
    pending = _Pending()
    with archive.writer(wait=wait_for_writer):
        with StoreBehind() as behind:
            rest = iter(files[done:])
            reading: Reading | None = first
            while reading is not None:
                docs = reading.docs + _read_if_changed(res, archive, reading.unchanged, codec, chunk_tokens, report)
                for doc in docs:
                    report.documents += 1
                    previous = archive.get_document(doc.path)
                    if _unchanged(res, archive, previous, doc, codec, chunk_tokens):
                        assert previous is not None
                        _count_unchanged(report, archive, previous)
                        if doc.source_hash and previous.source_hash != doc.source_hash:
                            # the same text from bytes (or a converter) it was not recorded with: recorded now, so
                            # the next ingest knows the file from its bytes
                            archive.put_document(dataclasses.replace(previous, source_hash=doc.source_hash))
                    else:
                        pending.documents.append(
                            _segment_document(res, archive, doc, chunk_tokens, codec, pending, behind, report)
                        )
                        if pending.tokens() >= batch_tokens:
                            _flush(res, archive, pending, codec, level, batch_tokens, report, behind)
                upcoming = next(rest, None)
                if upcoming is not None:
                    _progress(on_progress, report, upcoming.shown, done, len(files))
                reading = read(upcoming) if upcoming is not None else None
            _flush(res, archive, pending, codec, level, batch_tokens, report, behind)
        # once the store thread has committed every record (a segment they reuse is theirs), under the same lock
        gone = read_here.left_out(archive, report.skipped)
        report.removed = archive.remove_documents(gone) if gone else []
    _progress(on_progress, report, "", done, len(files))  # every file read, its KV committed (the store thread's)
    res.refresh()  # a query after this, on the same engine, retrieves from the documents just ingested
    report.seconds = time.perf_counter() - started
    report.model_load_seconds = res.model_load_s - load_before  # only a load this ingest paid for
    return report


@dataclass
class _ReadHere:
    """The documents a run read (or found unchanged), and the files it read whole that hold several (a JSON(L)
    file's records, a ZIP's members): what such a file no longer holds is forgotten (ingest) or named (its plan)."""

    paths: set[str] = dataclasses.field(default_factory=set)  # absolute, as the archive names documents
    containers: set[str] = dataclasses.field(default_factory=set)

    def note(self, source: SourceFile, reading: Reading) -> None:
        paths = [d.path for d in reading.docs] + [u.path for u in reading.unchanged]
        self.paths.update(os.path.abspath(p) for p in paths)
        if any(p != source.shown for p in paths):
            self.containers.add(os.path.abspath(source.shown))

    def left_out(self, archive: Archive | None, skipped: list[dict]) -> list[str]:
        """The archived documents of each container read that it no longer holds (a line deleted, a member
        removed); those it holds but could not read now (skipped) are kept, as a file skipped is."""
        if archive is None or not self.containers:
            return []
        kept = self.paths | {os.path.abspath(s["path"]) for s in skipped}
        prefixes = tuple(c + sep for c in self.containers for sep in ("#", "/"))
        return [d.path for d in archive.iter_documents() if d.path.startswith(prefixes) and d.path not in kept]


def _read_if_changed(
    res: Resources, archive: Archive, unread: list[Unchanged], codec: str, chunk_tokens: int, report: IngestReport
) -> list[Document]:
    """Files left unread as unchanged, checked again under the writer lock (another writer may have replaced
    their records since): counted as unchanged, or read now, their documents returned to ingest."""
    docs: list[Document] = []
    for file in unread:
        previous = _still_held(res, archive, file, codec, chunk_tokens)
        if previous is not None:
            report.documents += 1
            _count_unchanged(report, archive, previous)
            continue
        docs.extend(_read_again(file, report.skipped))
    return docs


def _still_held(
    res: Resources, archive: Archive | None, file: Unchanged, codec: str, chunk_tokens: int
) -> DocumentRecord | None:
    """The record of a file left unread as unchanged, if the archive still holds it as its bytes are now and as
    this codec and sink would store it; None when it must be read after all."""
    previous = archive.get_document(file.path) if archive is not None else None
    if archive is None or previous is None or previous.source_hash != file.source_hash:
        return None
    return previous if _intact(res, archive, previous, codec, chunk_tokens) else None


def _read_again(file: Unchanged, skipped: list[dict]) -> list[Document]:
    """A file left unread as unchanged, read now: its documents, its skips added to ``skipped``."""
    again = read_unchanged(file)
    skipped.extend({"path": s.path, "reason": s.reason} for s in again.skipped)
    return again.docs


def _existing_archive(res: Resources) -> Archive | None:
    """The archive when there is one to compare files with; None for a new one (nothing is created here: an
    ingest with nothing to ingest leaves no archive). Whatever keeps an existing one from opening (damage,
    another model) is raised when ingest opens it to write, as before."""
    if not Archive.exists(res.location):
        Archive.check_creatable(res.location)  # a file there, or no permission: the ingest would refuse
        return None
    try:
        return res.archive(create=False)
    except ArchiveError:  # a Redis archive not made yet (exists() cannot tell without connecting), or damage
        return None


def _archive_to_plan_against(res: Resources) -> Archive | None:
    """The archive a dry run compares files with, None where there is none yet. Unlike ingest's own look
    (:func:`_existing_archive`), what would refuse the ingest when it opens the archive to write (another
    model's archive, a newer format, damage, a store that is down) is raised here: a plan of an ingest that
    cannot run would mislead."""
    if not Archive.exists(res.location):
        Archive.check_creatable(res.location)  # a file there, or no permission: the ingest would refuse
        return None
    try:
        return res.archive(create=False)
    except ArchiveError as e:
        if type(e) is ArchiveError:  # "no archive at ...": a Redis archive not made yet
            return None
        raise


def _intact(res: Resources, archive: Archive, previous: DocumentRecord, codec: str, chunk_tokens: int) -> bool:
    """Whether a stored document needs no work: complete, split at this chunk size (a record from before the
    size was recorded counts as split at it), its KV made with this codec and sink."""
    split = previous.extra.get("chunk_tokens", chunk_tokens) == chunk_tokens
    return not previous.incomplete and split and stored_as(archive, previous, codec, res.prefilled_under_sink)


def _checked(chunk_tokens: int, codec: str) -> str:
    """The codec's canonical name, once the settings an ingest (or its dry run) takes are valid."""
    if chunk_tokens < MIN_CHUNK_TOKENS:
        raise UsageError(f"--chunk-tokens must be at least {MIN_CHUNK_TOKENS}")
    return check_codec(codec)


def _holds_file(archive: Archive | None, path: str, digest: str) -> bool:
    """Whether the archive holds the converted file at ``path`` as its bytes are now (``digest``): not read."""
    previous = archive.get_document(path) if archive is not None else None
    return previous is not None and previous.source_hash == digest and not previous.incomplete


def _unchanged(
    res: Resources, archive: Archive, previous: DocumentRecord | None, doc: Document, codec: str, chunk_tokens: int
) -> bool:
    """Whether ``doc`` is stored as it is now (``previous``, its record), as these settings store it: no work."""
    return (
        previous is not None
        and previous.content_hash == doc.content_hash
        and _intact(res, archive, previous, codec, chunk_tokens)
    )


def _nothing_to_ingest(skipped: list[dict]) -> UsageError:
    shown = ", ".join(f"{s['path']} ({s['reason']})" for s in skipped[:3]) + (" ..." if len(skipped) > 3 else "")
    return UsageError(f"no readable text documents to ingest; skipped {len(skipped)}: {shown}")


def _count_unchanged(report: IngestReport, archive: Archive, previous: DocumentRecord) -> None:
    _tally_unchanged(report, previous)
    report.embeddings_restored += restore_embeddings(archive, previous)


def _tally_unchanged(counts: IngestReport | IngestPlan, previous: DocumentRecord) -> None:
    """An unchanged document counted: its segments reused, its tokens in the total (an ingest and its plan)."""
    counts.documents_unchanged += 1
    counts.segments_reused += len(previous.segment_keys)
    counts.tokens_total += previous.n_tokens


def restore_embeddings(archive: Archive, doc: DocumentRecord) -> int:
    """Embed again, from their records' text, the segments of a stored document whose retrieval embeddings are
    gone, and return how many. Redis run as a cache may evict any key, the embeddings hash included; the KV is
    still there, so no prefill is needed, but without this an unchanged document would be skipped and never
    retrieved again."""
    lost = [k for k in doc.segment_keys if not archive.has_embedding(k)]  # records are read only for these
    missing = [rec for rec in (archive.get_segment(k) for k in lost) if rec is not None]
    if missing:
        vectors = get_embedder().embed([rec.text for rec in missing])
        archive.put_embeddings([(rec.key, vec) for rec, vec in zip(missing, vectors)])
    return len(missing)


def stored_as(archive: Archive, doc: DocumentRecord, codec: str, same_sink: Callable[[dict], bool]) -> bool:
    """Whether the document's segments hold the KV `codec` gives back (one lossless one is as good as
    another) and were prefilled under the sink asked for (`same_sink` of a record's extra); re-ingesting
    with a lossy codec, or back, or under another sink, re-does the document under the new keys."""
    want = codec_settings(codec)
    for settings in archive.segment_settings(doc.segment_keys):
        try:
            if settings is None or codec_settings(settings[0]) != want or not same_sink(settings[1]):
                return False
        except UsageError:  # a codec of a newer kvblend
            return False
    return True


def _segment_document(
    res: Resources,
    archive: Archive,
    doc: Document,
    chunk_tokens: int,
    codec: str,
    pending: _Pending,
    behind: StoreBehind,
    report: IngestReport,
) -> DocumentRecord:
    """Split a changed document into segments, queue the new ones, and return its record."""
    spans, segments = _segments_of(res, doc, chunk_tokens, codec)
    keys = [key for key, _, _ in segments]
    n_tokens = sum(len(ids) for _, _, ids in segments)
    with pending.claims.lock:  # see _Claims: no replacement may drop what is found reusable here
        pending.claims.keys.update(keys)
        for key, text, ids in segments:
            if key in pending.keys or key in behind.keys or (archive.has_segment(key) and archive.has_embedding(key)):
                report.segments_reused += 1
            else:
                pending.add(key, text, ids)
    report.tokens_total += n_tokens
    return DocumentRecord(
        path=doc.path,
        name=doc.name,
        content_hash=doc.content_hash,
        segment_keys=keys,
        n_tokens=n_tokens,
        ingested=time.time(),
        size=len(doc.text.encode()),
        format=doc.format,
        pages=len(doc.page_starts),
        encoding=doc.encoding,
        source_hash=doc.source_hash,
        # per (document, segment): not in the KV's record
        sources=segment_sources(doc.text, spans, doc.page_starts, doc.row_marks),
        extra={"chunk_tokens": chunk_tokens},  # an ingest at another size splits it again
    )


def _segments_of(
    res: Resources, doc: Document, chunk_tokens: int, codec: str
) -> tuple[list[tuple[int, int]], list[tuple[str, str, list[int]]]]:
    """A document's segment spans, and each segment's (key, text, token ids)."""
    runner = res.runner  # the model loads only here: re-ingesting an unchanged tree never pays for it
    spans = split_into_spans(doc.text, runner.count_tokens, chunk_tokens, breaks=doc.page_starts)
    segments = []
    for a, b in spans:
        text = doc.text[a:b]
        ids = runner.tokenize(segment_text_for_kv(text))
        segments.append((res.key_of(ids, codec), text, ids))
    return spans, segments


def plan_ingest(
    res: Resources,
    paths: Iterable[str | Path],
    chunk_tokens: int,
    codec: str,
    level: int,
    on_progress: Callable[[dict], None] | None = None,
) -> IngestPlan:
    """What :func:`ingest_paths` would prefill and store, with nothing written (``ingest --dry-run``).

    Real corpora are large: a 16 MB folder of text is ~4M tokens, ~80 GB of KV and hours of prefill on a
    CPU, so a user asks what an ingest will cost before starting it. Files are read, converted and split
    exactly as ingest does, and checked against the archive (unchanged documents and segments it already
    holds cost nothing); then the longest new segments (about 2,000 tokens) are prefilled once and encoded
    with ``codec`` to measure this machine's prefill rate and the bytes a token takes stored, from which the
    whole is estimated. No archive is created or locked."""
    codec = _checked(chunk_tokens, codec)
    archive = _archive_to_plan_against(res)

    def held(path: str, digest: str) -> bool:
        return _holds_file(archive, path, digest)

    files, walked_past = find_files([Path(p) for p in paths])
    plan = IngestPlan(files=len(files), skipped=[{"path": s.path, "reason": s.reason} for s in walked_past])
    seen: set[str] = set()
    longest: list[tuple[int, int, list[int]]] = []  # a heap of the longest new segments: what is measured
    read_here = _ReadHere()
    for done, source in enumerate(files):
        _progress(on_progress, plan, source.shown, done, len(files))
        reading = read_file(source, held)
        plan.skipped.extend({"path": s.path, "reason": s.reason} for s in reading.skipped)
        read_here.note(source, reading)
        docs = list(reading.docs)
        for file in reading.unchanged:  # the same bytes as archived: no work if stored with this codec and sink
            previous = _still_held(res, archive, file, codec, chunk_tokens)
            if previous is None:
                docs.extend(_read_again(file, plan.skipped))  # as ingest reads it then
                continue
            plan.documents += 1
            _tally_unchanged(plan, previous)
        for doc in docs:
            plan.documents += 1
            previous = archive.get_document(doc.path) if archive is not None else None
            if archive is not None and _unchanged(res, archive, previous, doc, codec, chunk_tokens):
                assert previous is not None
                _tally_unchanged(plan, previous)
                continue
            for key, _, ids in _segments_of(res, doc, chunk_tokens, codec)[1]:
                plan.tokens_total += len(ids)
                if key in seen or (archive is not None and archive.has_segment(key) and archive.has_embedding(key)):
                    plan.segments_reused += 1
                    continue
                seen.add(key)
                plan.segments_new += 1
                plan.tokens_new += len(ids)
                heapq.heappush(longest, (len(ids), plan.segments_new, ids))
                if len(longest) > SAMPLE_SEGMENTS:
                    heapq.heappop(longest)
    _progress(on_progress, plan, "", len(files), len(files))
    if plan.documents == 0:
        raise _nothing_to_ingest(plan.skipped)
    plan.would_remove = read_here.left_out(archive, plan.skipped)
    if longest:  # (an unchanged tree loads no model, as its ingest does not)
        runner = res.runner
        plan.raw_bytes = 2 * 2 * runner.n_layers * runner.n_kv_heads * runner.head_dim * plan.tokens_new
        _measure_sample(res, plan, [ids for _, _, ids in sorted(longest, reverse=True)], codec, level)
    plan.disk_free_bytes = _free_bytes(res)
    return plan


def _measure_sample(res: Resources, plan: IngestPlan, segments: list[list[int]], codec: str, level: int) -> None:
    """Prefill the longest new segments, up to :data:`SAMPLE_TOKENS`, in one batch as ingest would (after the
    sink, in the storage dtype), encode their layers with ``codec``, and scale what that took to the plan's
    new tokens. One segment alone measured 20-40% under ingest's batched rate on a 2-core CPU (296-367 against
    467 tok/s); four, ~2,000 tokens, measured it (BENCHMARKS.md). A first prefill in a process pays one-off
    set-up (allocations, kernel choice), so a short warm-up runs first, untimed."""
    batch = segments[:1]
    for ids in segments[1:]:
        if sum(map(len, batch)) + len(ids) > SAMPLE_TOKENS:
            break
        batch.append(ids)
    sink = res.sink_ids() or None
    drain(precompute_kv_steps(res.runner, [batch[0][:16]], sink_prefix=sink))
    t0 = time.perf_counter()
    kvs = drain(precompute_kv_steps(res.runner, batch, sink_prefix=sink))
    seconds = time.perf_counter() - t0
    tokens = sum(map(len, batch))
    stored = sum(len(encode_layer(k, v, codec, level)) for kv in kvs for k, v in kv)
    plan.sample_tokens = tokens
    plan.prefill_tokens_per_s = tokens / seconds if seconds > 0 else 0.0
    plan.estimated_bytes = round(stored / tokens * plan.tokens_new)
    plan.estimated_seconds = plan.tokens_new / plan.prefill_tokens_per_s if plan.prefill_tokens_per_s else 0.0


def _free_bytes(res: Resources) -> int | None:
    """Free bytes where a local archive is (or would be created); None for Redis, whose memory is its own."""
    import shutil

    path = res.location.path
    if path is None:
        return None
    for place in (path, *path.parents):
        if place.exists():
            return shutil.disk_usage(place).free
    return None


def _progress(
    on_progress: Callable[[dict], None] | None,
    report: IngestReport | IngestPlan,
    current: str,
    files_done: int,
    files: int,
) -> None:
    """``files`` of ``total`` read, ``documents`` seen and ``tokens`` prefilled (or, planned, to prefill) so far;
    ``current``: the file being read next ("" at the end)."""
    if on_progress is not None:
        on_progress(
            {
                "files": files_done,
                "total": files,
                "documents": report.documents,
                "tokens": report.tokens_new,
                "current": current,
            }
        )


def _flush(
    res: Resources,
    archive: Archive,
    pending: _Pending,
    codec: str,
    level: int,
    batch_tokens: int,
    report: IngestReport,
    behind: StoreBehind | None = None,
) -> None:
    """Prefill pending segments and embed them here; store them (and then the documents
    that needed them) on `behind`'s thread while the next batch prefills, else inline."""
    drain(_flush_steps(res, archive, pending, codec, level, batch_tokens, report, behind))


def _flush_steps(
    res: Resources,
    archive: Archive,
    pending: _Pending,
    codec: str,
    level: int,
    batch_tokens: int,
    report: IngestReport,
    behind: StoreBehind | None = None,
    rows_per_step: int | None = None,
) -> Steps[None]:
    """:func:`_flush` in steps (it yields after every layer of prefill, and every `rows_per_step` tokens within
    one, and while it waits for another node).

    In batches of at most `batch_tokens` (a segment longer is a batch of its own), each stored while the next
    prefills, the documents with the last: one long document was one batch, prefilled whole before anything was
    stored, so its KV filled memory whatever --batch-tokens said and a Ctrl-C kept none of it (the segments
    stored before it are reused by the next ingest: their keys are their content)."""
    segments, docs = pending.take()
    if not segments and not docs:
        return
    batches = _batches(segments, batch_tokens) or [[]]
    for i, batch in enumerate(batches):
        with_docs = docs if i == len(batches) - 1 else []
        yield from _flush_batch(
            res, archive, pending, batch, with_docs, codec, level, batch_tokens, report, behind, rows_per_step
        )


def _batches(segments: list[tuple[str, str, list[int]]], batch_tokens: int) -> list[list[tuple[str, str, list[int]]]]:
    """Consecutive runs of `segments` of at most `batch_tokens` tokens each (at least one segment each)."""
    batches: list[list[tuple[str, str, list[int]]]] = []
    tokens = 0
    for seg in segments:
        if not batches or tokens + len(seg[2]) > batch_tokens:
            batches.append([])
            tokens = 0
        batches[-1].append(seg)
        tokens += len(seg[2])
    return batches


def _flush_batch(
    res: Resources,
    archive: Archive,
    pending: _Pending,
    segments: list[tuple[str, str, list[int]]],
    docs: list[DocumentRecord],
    codec: str,
    level: int,
    batch_tokens: int,
    report: IngestReport,
    behind: StoreBehind | None,
    rows_per_step: int | None,
) -> Steps[None]:
    """Prefill one batch of segments (waiting for those another node claimed) and store it, then `docs`."""
    mine = set(archive.claim([key for key, _, _ in segments]))  # the rest another node is prefilling now
    theirs = [s for s in segments if s[0] not in mine]
    ours = [s for s in segments if s[0] in mine]
    try:
        if theirs:  # prefill ours in the meantime, then wait: by then theirs are usually stored
            items, vectors = yield from _prefill(res, ours, batch_tokens, report, rows_per_step)
            missing = yield from _await_others(archive, theirs)
            report.segments_reused += len(theirs) - len(missing)
            # their writer gave up: prefill them here after all
            late, late_vectors = yield from _prefill(res, missing, batch_tokens, report, rows_per_step)
            items, vectors = items + late, [*vectors, *late_vectors]
        else:
            items, vectors = yield from _prefill(res, ours, batch_tokens, report, rows_per_step)
    except BaseException:  # stopped before storing: another writer need not wait for these
        _release(archive, mine)
        raise
    store = functools.partial(_store, archive, items, vectors, docs, codec, level, report, pending.claims, mine)
    if behind is None:
        store()
    else:
        behind.submit(store, [rec.key for rec, _ in items])


def _prefill(
    res: Resources,
    segments: list[tuple[str, str, list[int]]],
    batch_tokens: int,
    report: IngestReport,
    rows_per_step: int | None = None,
) -> Steps[tuple[list[tuple[SegmentRecord, list[LayerKV]]], list[np.ndarray]]]:
    """Each segment prefilled alone (after the sink), with its record, and the texts' retrieval embeddings."""
    if not segments:
        return [], []
    runner, settings = res.runner, res.kv_settings()
    t0 = time.perf_counter()
    sink = res.sink_ids()  # prefilled after the sink (its KV dropped): base position len(sink)
    kvs = yield from precompute_kv_steps(
        runner,
        [ids for _, _, ids in segments],
        sink_prefix=sink or None,
        batch_tokens=batch_tokens,
        rows_per_step=rows_per_step,
    )
    report.prefill_seconds += time.perf_counter() - t0
    items = [
        (new_record(runner, key, text, ids, settings, len(sink), res.sink.value), kv)
        for (key, text, ids), kv in zip(segments, kvs)
    ]
    return items, list(get_embedder().embed([text for _, text, _ in segments]))


def _await_others(
    archive: Archive, segments: list[tuple[str, str, list[int]]], timeout_s: float = CLAIM_WAIT_S
) -> Steps[list[tuple[str, str, list[int]]]]:
    """Wait for segments another writer claimed (a shared store: two nodes met the same passages) to be stored;
    returns those that did not appear in time, for this writer to prefill after all."""
    waiting = {seg[0]: seg for seg in segments}
    deadline = time.monotonic() + timeout_s
    while waiting and time.monotonic() < deadline:
        for key in [k for k in waiting if archive.has_segment(k)]:
            del waiting[key]
        if waiting:
            yield WAITING  # a server gives the turn to its other requests meanwhile; drain() sleeps a moment
    return list(waiting.values())


def _store(
    archive: Archive,
    items: list[tuple[SegmentRecord, list[LayerKV]]],
    embeddings: list[np.ndarray],
    docs: list[DocumentRecord],
    codec: str,
    level: int,
    report: IngestReport,
    claims: _Claims,
    claimed: set[str],
) -> None:
    """Commit a prefilled batch, then the documents waiting for it: a document never points at nothing.
    The batch's claims (`claimed`) are given up once it is stored, or once storing it failed."""
    if items:
        vectors = {rec.key: vec for (rec, _), vec in zip(items, embeddings)}
        try:
            stored = archive.put_segments(items, codec=codec, level=level, embeddings=vectors)
        except BaseException:
            _release(archive, claimed)
            raise
        archive.release(list(claimed))
        for rec in stored:
            report.segments_new += 1
            report.tokens_new += rec.n_tokens
            report.bytes_written += sum(layer.length for layer in rec.layers)
            report.raw_bytes += raw_kv_bytes(rec)
    with claims.lock:
        for doc in docs:
            archive.replace_document(doc, keep=claims.keys)


def _release(archive: Archive, claimed: set[str]) -> None:
    """Give up claims on the way out of a failure, which is the error that counts: a Redis that is gone
    lets the claims lapse (CLAIM_TTL_S) instead."""
    with suppress(Exception):
        archive.release(list(claimed))


def new_record(
    runner: ModelRunner,
    key: str,
    text: str,
    ids: list[int],
    settings: dict,
    base_position: int = 0,
    sink_policy: str | None = None,
) -> SegmentRecord:
    """The index record of a segment prefilled at `base_position` (after a sink of that many tokens,
    or alone at 0) under `settings` (KeyScheme.settings). `sink_policy` names the sink (`ingest --sink`)
    beside its tokens, so a later ingest can tell the document is stored as asked without the tokenizer."""
    return SegmentRecord(
        key=key,
        n_tokens=len(ids),
        token_ids=list(ids),
        text=text,
        dtype=settings["dtype"],
        codec="",
        n_layers=runner.n_layers,
        kv_heads=runner.n_kv_heads,
        head_dim=runner.head_dim,
        base_position=base_position,
        extra={"sink": settings["sink"]} | ({"sink_policy": sink_policy} if sink_policy else {}),
    )


def raw_kv_bytes(rec: SegmentRecord) -> int:
    """Size of the segment's KV as plain fp16: 2 tensors × 2 bytes × layers × heads × dim × tokens."""
    return 2 * 2 * rec.n_layers * rec.kv_heads * rec.head_dim * rec.n_tokens


def store_texts(
    res: Resources, texts: Sequence[str], codec: str = DEFAULT_CODEC, level: int = DEFAULT_LEVEL, replace: bool = False
) -> list[SegmentRecord]:
    """Archive exact texts as segments (no splitting): for --context-file --store, client chunks and the bench.
    ``replace``: store even segments the archive lists (their KV could not be read: stored again)."""
    return drain(store_texts_steps(res, texts, codec, level, replace))


def store_texts_steps(
    res: Resources,
    texts: Sequence[str],
    codec: str = DEFAULT_CODEC,
    level: int = DEFAULT_LEVEL,
    replace: bool = False,
    rows_per_step: int | None = None,
) -> Steps[list[SegmentRecord]]:
    """:func:`store_texts` in steps (it yields after every layer of prefill, and every `rows_per_step` tokens
    within one)."""
    archive = res.archive(create=True)
    codec = check_codec(codec)
    items = []
    for text in texts:
        ids = res.runner.tokenize(segment_text_for_kv(text))
        items.append((res.key_of(ids, codec), text, ids))
    todo = _Pending()
    for key, text, ids in {key: (key, text, ids) for key, text, ids in items}.values():  # one per key
        if replace or not archive.has_segment(key):
            todo.add(key, text, ids)
    if todo.segments:
        with archive.writer(wait=30.0):
            report = IngestReport()
            yield from _flush_steps(
                res, archive, todo, codec, level, DEFAULT_BATCH_TOKENS, report, rows_per_step=rows_per_step
            )
    stored = [archive.get_segment(k) for k, _, _ in items]
    return [rec for rec in stored if rec is not None]


def prefill_text_steps(res: Resources, text: str, rows_per_step: int | None = None) -> Steps[StagedSegment]:
    """One exact text prefilled alone and its record, exactly as :func:`store_texts` stores it (same key, sink,
    KV in the storage dtype) but not stored: a query's stored miss answers from this KV and leaves the write to
    :func:`store_prefilled`, queued behind its answer."""
    ids = res.runner.tokenize(segment_text_for_kv(text))
    sink = res.sink_ids()
    kvs = yield from precompute_kv_steps(res.runner, [ids], sink_prefix=sink or None, rows_per_step=rows_per_step)
    rec = new_record(res.runner, res.key_of(ids), text, ids, res.kv_settings(), len(sink), res.sink.value)
    return rec, kvs[0]


def store_prefilled(res: Resources, rec: SegmentRecord, kv: list[LayerKV]) -> SegmentRecord | None:
    """Write a segment :func:`prefill_text_steps` computed, with its retrieval embedding (as store_texts does),
    unless another writer stored it meanwhile; waits for the writer lock as store_texts does."""
    archive = res.archive(create=True)
    with archive.writer(wait=30.0):
        if archive.has_segment(rec.key):
            return None
        vector = get_embedder().embed([rec.text])[0]
        return archive.put_segments([(rec, kv)], embeddings={rec.key: vector})[0]
