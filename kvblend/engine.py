"""The engine: what the CLI and the Python API call. CLI → engine → archive / model / fusor.

`Engine` owns one archive and (lazily) one model. It knows how to ingest
documents (segment → prefill alone in batches → archive) and how to answer a
query (retrieve → assemble → stream + fuse → generate), and nothing about
terminals: progress and tokens leave through callbacks.
"""

from __future__ import annotations

import hashlib
import json
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable, Iterable, Sequence

import numpy as np
import torch

from kvblend.archive_format import (
    Archive,
    DEFAULT_CODEC,
    DocumentRecord,
    SegmentRecord,
    resolve_archive_path,
)
from kvblend.documents import iter_documents
from kvblend.errors import ArchiveBusyError, UsageError
from kvblend.fusor import DEFAULT_DEVIATION, MODES, BlendConfig, FusionResult, Segment, feed_schedule, fuse, plan_prompt
from kvblend.generate import Generation, SamplingConfig, generate
from kvblend.model import (
    DEFAULT_MODEL_NAME,
    ModelRunner,
    load_model,
    resolve_model_source,
    source_fingerprint,
)
from kvblend.precompute import DEFAULT_BATCH_TOKENS, precompute_kv, storage_dtype
from kvblend.prompt import PromptTemplate, assemble_prompt, segment_text_for_kv
from kvblend.retrieval import get_embedder, top_k
from kvblend.segmenter import split_into_segments
from kvblend.streaming import ArchiveFeed, SegmentUnavailable

DEFAULT_RATIO = 0.15
DEFAULT_CHECK_LAYERS = (1,)
SINK_POLICIES = ("alone",)  # segments are prefilled alone (see BENCHMARKS.md, variants)


def segment_key(fingerprint: str, token_ids: Sequence[int], settings: dict) -> str:
    """Key = hash(model fingerprint, token ids, KV-producing settings): no collisions across models."""
    h = hashlib.blake2b(digest_size=20)
    h.update(fingerprint.encode())
    h.update(np.asarray(token_ids, dtype=np.int64).tobytes())
    h.update(json.dumps(settings, sort_keys=True).encode())
    return h.hexdigest()


# ───────────────────────────────── results ─────────────────────────────────


@dataclass
class IngestReport:
    documents: int = 0
    documents_unchanged: int = 0
    segments_new: int = 0
    segments_reused: int = 0
    tokens_new: int = 0
    tokens_total: int = 0
    bytes_written: int = 0
    raw_bytes: int = 0
    seconds: float = 0.0
    prefill_seconds: float = 0.0
    skipped: list[dict] = field(default_factory=list)

    @property
    def tokens_per_s(self) -> float:
        return self.tokens_new / self.seconds if self.seconds > 0 else 0.0

    @property
    def compression_ratio(self) -> float:
        return self.raw_bytes / self.bytes_written if self.bytes_written else 0.0

    def to_dict(self) -> dict:
        d = asdict(self)
        d["tokens_per_s"] = round(self.tokens_per_s, 1)
        d["compression_ratio"] = round(self.compression_ratio, 3)
        return d


@dataclass
class SegmentInfo:
    key: str
    document: str | None
    tokens: int
    cached: bool
    score: float | None = None


@dataclass
class QueryResult:
    answer: str
    mode: str
    ratio: float | None
    ttft_s: float
    load_wait_s: float
    prompt_tokens: int
    recomputed_tokens: int
    recompute_share: float
    segments: list[SegmentInfo]
    tokens_per_s: float
    timings: dict[str, float]
    warnings: list[str]
    prefix_cached: bool = False
    fusion: FusionResult | None = None
    generation: Generation | None = None

    def to_dict(self) -> dict:
        return {
            "answer": self.answer,
            "mode": self.mode,
            "ratio": self.ratio,
            "ttft_s": round(self.ttft_s, 4),
            "load_wait_s": round(self.load_wait_s, 4),
            "prompt_tokens": self.prompt_tokens,
            "recomputed_tokens": self.recomputed_tokens,
            "recompute_share": round(self.recompute_share, 4),
            "segments": [asdict(s) for s in self.segments],
            "tokens_per_s": round(self.tokens_per_s, 2),
            "prefix_cached": self.prefix_cached,
            "timings": {k: round(v, 4) for k, v in self.timings.items()},
            "warnings": self.warnings,
        }


@dataclass
class QueryOptions:
    mode: str = "blend"
    ratio: float | None = None  # None: tuned ratio if any, else DEFAULT_RATIO
    check_layers: tuple[int, ...] | None = None
    deviation: str = DEFAULT_DEVIATION
    top_k: int = 6
    docs: list[str] = field(default_factory=list)
    segment_keys: list[str] = field(default_factory=list)
    context_texts: list[str] = field(default_factory=list)
    store_context: bool = False
    template: PromptTemplate = field(default_factory=PromptTemplate)
    sampling: SamplingConfig = field(default_factory=SamplingConfig)
    prefetch_depth: int = 2
    loader_overlap: bool | None = None  # build layers on loader threads; None: where cores are spare
    cache_prefix: bool = True  # reuse (and after first use, archive) the instruction prefix's exact KV
    keep_step_logits: bool = False
    forced_tokens: list[int] | None = None


# ───────────────────────────────── engine ─────────────────────────────────


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

    def __enter__(self) -> "StoreBehind":
        return self

    def __exit__(self, *exc) -> None:
        try:
            self.drain()
        finally:
            self._pool.shutdown(wait=True)


class Engine:
    """One archive + one model. Cheap to create: the model loads on first use."""

    def __init__(
        self,
        archive: str | Path | None = None,
        model: str | None = None,
        compute: str | None = None,
        dtype: str | None = None,
        runner: ModelRunner | None = None,
    ):
        self.archive_path = resolve_archive_path(str(archive) if archive else None)
        self.model_spec = model
        self.compute = compute
        self.dtype = dtype
        self._runner = runner
        self._archive: Archive | None = None
        self.model_load_s = 0.0
        if runner is not None:
            self.model_name, self.fingerprint = runner.name, runner.fingerprint
        else:
            source = resolve_model_source(model)
            self.model_name, self.fingerprint = source.name, source_fingerprint(source)

    # ── resources ──
    @property
    def runner(self) -> ModelRunner:
        if self._runner is None:
            t0 = time.perf_counter()
            self._runner = load_model(self.model_spec, self.compute, self.dtype)
            self.model_load_s = time.perf_counter() - t0
        return self._runner

    def archive(self, create: bool = True) -> Archive:
        if self._archive is None:
            self._archive = Archive.open(
                self.archive_path,
                create=create,
                model_name=self.model_name,
                model_fingerprint=self.fingerprint,
            )
        return self._archive

    def close(self) -> None:
        if self._archive is not None:
            self._archive.close()
            self._archive = None

    def __enter__(self) -> "Engine":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def kv_settings(self) -> dict:
        """Everything besides model and tokens that changes the stored KV."""
        return {"sink": "alone", "dtype": str(storage_dtype(self.runner)).replace("torch.", "")}

    def key_of(self, token_ids: Sequence[int]) -> str:
        """The archive key of these tokens' KV under this model and settings: one scheme for
        ingested segments, stored context files and the instruction prefix alike."""
        return segment_key(self.fingerprint, token_ids, self.kv_settings())

    # ── ingest ──
    def ingest(
        self,
        paths: Iterable[str | Path],
        chunk_tokens: int = 512,
        codec: str = DEFAULT_CODEC,
        level: int = 3,
        batch_tokens: int = DEFAULT_BATCH_TOKENS,
        wait_for_writer: bool | float = False,
        on_progress: Callable[[dict], None] | None = None,
    ) -> IngestReport:
        """Segment, prefill and archive documents; unchanged segments are not recomputed."""
        if chunk_tokens < 16:
            raise UsageError("--chunk-tokens must be at least 16")
        started = time.perf_counter()
        docs, skipped = iter_documents([Path(p) for p in paths])
        if not docs:
            shown = ", ".join(f"{s.path} ({s.reason})" for s in skipped[:3]) + (" ..." if len(skipped) > 3 else "")
            raise UsageError(f"no readable text documents to ingest; skipped {len(skipped)}: {shown}")
        report = IngestReport(skipped=[{"path": s.path, "reason": s.reason} for s in skipped])
        archive = self.archive(create=True)
        total_docs = len(docs)
        pending: list[tuple[str, str, list[int]]] = []  # (key, text, ids) awaiting prefill
        pending_keys: set[str] = set()
        waiting_docs: list[DocumentRecord] = []
        behind = StoreBehind()
        with archive.writer(wait=wait_for_writer), behind:
            for doc in docs:
                report.documents += 1
                previous = archive.get_document(doc.path)
                if previous is not None and previous.content_hash == doc.content_hash and not getattr(
                    previous, "incomplete", False
                ):
                    report.documents_unchanged += 1
                    report.segments_reused += len(previous.segment_keys)
                    report.tokens_total += previous.n_tokens
                    self._progress(on_progress, report, doc.path, total_docs)
                    continue
                # The model loads only here: re-ingesting an unchanged tree never pays for it.
                runner = self.runner
                keys, n_tokens = [], 0
                for text in split_into_segments(doc.text, runner.count_tokens, chunk_tokens):
                    ids = runner.tokenize(segment_text_for_kv(text))
                    key = self.key_of(ids)
                    keys.append(key)
                    n_tokens += len(ids)
                    if key in pending_keys or key in behind.keys or (
                        archive.has_segment(key) and archive.has_embedding(key)
                    ):
                        report.segments_reused += 1
                    else:
                        pending.append((key, text, ids))
                        pending_keys.add(key)
                report.tokens_total += n_tokens
                waiting_docs.append(
                    DocumentRecord(
                        path=doc.path,
                        content_hash=doc.content_hash,
                        segment_keys=keys,
                        n_tokens=n_tokens,
                        ingested=time.time(),
                        size=len(doc.text.encode()),
                    )
                )
                if sum(len(p[2]) for p in pending) >= batch_tokens:
                    self._flush(archive, pending, waiting_docs, codec, level, batch_tokens, report, behind)
                    pending_keys.clear()
                self._progress(on_progress, report, doc.path, total_docs)
            self._flush(archive, pending, waiting_docs, codec, level, batch_tokens, report, behind)
        report.seconds = time.perf_counter() - started
        return report

    def _progress(self, on_progress, report: IngestReport, current: str, total: int | None = None) -> None:
        if on_progress is not None:
            on_progress({"documents": report.documents, "total": total, "tokens": report.tokens_new,
                         "current": current})

    def _flush(self, archive, pending, waiting_docs, codec, level, batch_tokens, report,
               behind: "StoreBehind | None" = None) -> None:
        """Prefill pending segments and embed them here; store them (and then the documents
        that needed them) on `behind`'s thread while the next batch prefills, else inline."""
        items, embeddings = [], None
        if not pending and not waiting_docs:
            return
        if pending:
            settings = self.kv_settings()
            t0 = time.perf_counter()
            kvs = precompute_kv(self.runner, [ids for _, _, ids in pending], batch_tokens=batch_tokens)
            report.prefill_seconds += time.perf_counter() - t0
            items = [(self._new_record(key, text, ids, settings), kv) for (key, text, ids), kv in zip(pending, kvs)]
            embeddings = get_embedder().embed([text for _, text, _ in pending])
        docs = list(waiting_docs)
        pending.clear()
        waiting_docs.clear()

        def store() -> None:
            if items:
                vectors = {rec.key: vec for (rec, _), vec in zip(items, embeddings)}
                stored = archive.put_segments(items, codec=codec, level=level, embeddings=vectors)
                for rec in stored:
                    report.segments_new += 1
                    report.tokens_new += rec.n_tokens
                    report.bytes_written += sum(layer.length for layer in rec.layers)
                    report.raw_bytes += raw_kv_bytes(rec)
            for doc in docs:  # only after their segments committed: a document never points at nothing
                archive.replace_document(doc)

        if behind is None:
            store()
        else:
            behind.submit(store, [rec.key for rec, _ in items])

    def _new_record(self, key: str, text: str, ids: list[int], settings: dict) -> SegmentRecord:
        r = self.runner
        return SegmentRecord(
            key=key,
            n_tokens=len(ids),
            token_ids=list(ids),
            text=text,
            dtype=settings["dtype"],
            codec="",
            n_layers=r.n_layers,
            kv_heads=r.n_kv_heads,
            head_dim=r.head_dim,
            base_position=0,
            extra={"sink": settings["sink"]},
        )

    def store_texts(self, texts: Sequence[str], codec: str = DEFAULT_CODEC, level: int = 3) -> list[SegmentRecord]:
        """Archive exact texts as segments (no splitting): for --context-file --store and the bench."""
        archive = self.archive(create=True)
        items = []
        for text in texts:
            ids = self.runner.tokenize(segment_text_for_kv(text))
            items.append((self.key_of(ids), text, ids))
        todo = [it for it in dict((k, (k, t, i)) for k, t, i in items).values() if not archive.has_segment(it[0])]
        if todo:
            report = IngestReport()
            with archive.writer(wait=30.0):
                self._flush(archive, todo, [], codec, level, DEFAULT_BATCH_TOKENS, report)
        return [archive.get_segment(k) for k, _, _ in items]

    # ── query ──
    def blend_config(self, opts: QueryOptions) -> tuple[BlendConfig, float]:
        ratio = opts.ratio if opts.ratio is not None else self.tuned_ratio() or DEFAULT_RATIO
        layers = tuple(opts.check_layers or DEFAULT_CHECK_LAYERS)
        if len(layers) == 1:
            cfg = BlendConfig.single(ratio, layers[0], opts.deviation)
        else:
            cfg = BlendConfig.gradual(ratio, layers, opts.deviation)
        cfg.validate(self.runner.n_layers)
        return cfg, ratio

    def tuned_ratio(self) -> float | None:
        """The ratio `kvblend tune` stored for this model, compute device and archive location."""
        from kvblend.controller import tuned_key

        if self._archive is None and not Archive.exists(self.archive_path):
            return None  # no archive yet: nothing was tuned, and asking must not create one
        entry = self.archive().get_tuned(tuned_key(self.model_name, self.runner.device.type, self.archive_path))
        return float(entry["ratio"]) if entry else None

    def select_records(self, question: str, opts: QueryOptions) -> tuple[list[SegmentRecord], list[SegmentInfo]]:
        """Pinned documents then pinned segments (both may be given), else top-k retrieval; in prompt order."""
        archive = self.archive(create=False)
        records: list[SegmentRecord] = []
        infos: list[SegmentInfo] = []
        for path in opts.docs:
            doc = self._find_document(path)
            for key in doc.segment_keys:
                records.append(self._segment_or_error(key))
                infos.append(SegmentInfo(key, doc.path, records[-1].n_tokens, True))
        for key in opts.segment_keys:
            rec = self._segment_or_error(key)
            records.append(rec)
            infos.append(SegmentInfo(rec.key, self._document_of(rec.key), rec.n_tokens, True))
        if records:
            return records, infos
        if opts.context_texts and opts.top_k == 0:
            return records, infos
        if opts.top_k < 1:
            raise UsageError("--top-k must be at least 1")
        keys, matrix = archive.get_embeddings()
        if not keys:
            raise UsageError(f"the archive at {self.archive_path} is empty: run `kvblend ingest PATH` first")
        query_vec = get_embedder().embed([question])[0]
        for key, score in top_k(query_vec, keys, matrix, opts.top_k):
            rec = archive.get_segment(key)
            if rec is None:
                continue
            records.append(rec)
            infos.append(SegmentInfo(key, self._document_of(key), rec.n_tokens, True, round(score, 4)))
        return records, infos

    def _find_document(self, path: str) -> DocumentRecord:
        archive = self.archive(create=False)
        doc = archive.get_document(path) or archive.get_document(str(Path(path).expanduser().resolve()))
        if doc is None:
            matches = [d for d in archive.iter_documents() if d.path.endswith("/" + path) or d.path == path]
            if len(matches) == 1:
                doc = matches[0]
        if doc is None:
            raise UsageError(f"no such document in the archive: {path} (see `kvblend ls`)")
        return doc

    def _segment_or_error(self, key: str) -> SegmentRecord:
        archive = self.archive(create=False)
        rec = archive.get_segment(key)
        if rec is None and len(key) >= 6:
            matches = [r for r in archive.iter_segments() if r.key.startswith(key)]
            rec = matches[0] if len(matches) == 1 else None
        if rec is None:
            raise UsageError(f"no such segment in the archive: {key}")
        return rec

    def _document_of(self, key: str) -> str | None:
        if not hasattr(self, "_doc_index"):
            self._doc_index = {k: d.path for d in self.archive(create=False).iter_documents() for k in d.segment_keys}
        return self._doc_index.get(key)

    def warm_up(self) -> None:
        """Load model and embedder outside the timed region (TTFT excludes model load)."""
        _ = self.runner
        get_embedder()

    def query(
        self,
        question: str,
        opts: QueryOptions | None = None,
        on_token: Callable[[str], None] | None = None,
        on_warning: Callable[[str], None] | None = None,
    ) -> QueryResult:
        """Answer `question` from archived segments with the chosen mode."""
        opts = opts or QueryOptions()
        if opts.mode not in MODES:
            raise UsageError(f"--mode must be one of {', '.join(MODES)}")
        if not question or not question.strip():
            raise UsageError("empty question")
        self.warm_up()
        runner = self.runner
        blend_cfg, ratio = self.blend_config(opts) if opts.mode == "blend" else (BlendConfig(), None)
        warnings: list[str] = []

        def warn(msg: str) -> None:
            warnings.append(msg)
            if on_warning:
                on_warning(msg)

        t0 = time.perf_counter()
        records, infos = self.select_records(question, opts)
        passages = [Segment(list(r.token_ids), cached=True, key=r.key, base_position=r.base_position) for r in records]
        record_by_key = {r.key: r for r in records}
        for text in opts.context_texts:
            seg, info, rec = self._context_segment(text, store=opts.store_context)
            passages.append(seg)
            infos.append(info)
            if rec is not None:
                record_by_key[rec.key] = rec
        if not passages:
            raise UsageError("no passages: the question needs at least one segment or --context-file")
        t_retrieved = time.perf_counter()
        prompt = assemble_prompt(runner, opts.template, question, passages)
        if opts.cache_prefix:
            self._use_archived_prefix(prompt[0], record_by_key)
        total = sum(len(s.token_ids) for s in prompt)
        if runner.max_positions and total + opts.sampling.max_new_tokens > runner.max_positions:
            raise UsageError(
                f"prompt is {total} tokens (+{opts.sampling.max_new_tokens} to generate); "
                f"the model's context is {runner.max_positions}: use fewer segments (--top-k) or a shorter question"
            )
        for seg in prompt:
            if seg.cached and not blob_intact(self.archive(), record_by_key[seg.key]):
                seg.cached = False
                warn(f"segment {seg.key[:12]}: blob missing or truncated; recomputing it (run `kvblend verify --repair`)")
        fused = self._fuse_streaming(prompt, record_by_key, opts, blend_cfg, warn)
        t_fused = time.perf_counter()
        gen = generate(runner, fused, opts.sampling, on_token=on_token, keep_logits=opts.keep_step_logits,
                       forced_tokens=opts.forced_tokens)
        ttft = (t_fused - t0) + gen.first_token_s
        cached_flags = {s.key: bool(s.cached) for s in prompt}
        for info in infos:
            info.cached = cached_flags.get(info.key, info.cached)
        prefix_cached = bool(prompt[0].cached) and fused.mode != "full"  # cached only when opts.cache_prefix
        try:
            if opts.cache_prefix and not prompt[0].cached:
                self._archive_prefix(prompt[0], fused)
            self.archive().touch([s.key for s in prompt if s.cached])
        except Exception as exc:  # bookkeeping must never fail an answered query
            warn(f"could not record segment use: {exc}")
        last_active = fused.active_per_layer[-1]
        timings = {
            "retrieval_s": t_retrieved - t0,
            "model_load_s": self.model_load_s,
            "load_wait_s": fused.load_wait_s,
            "recompute_s": fused.compute_s - fused.load_wait_s,
            "fusion_s": t_fused - t_retrieved,
            "ttft_s": ttft,
            "decode_s": gen.decode_s,
        }
        return QueryResult(
            answer=gen.text,
            mode=opts.mode,
            ratio=ratio,
            ttft_s=ttft,
            load_wait_s=fused.load_wait_s,
            prompt_tokens=total,
            recomputed_tokens=last_active,
            recompute_share=fused.recompute_share,
            segments=infos,
            tokens_per_s=gen.tokens_per_s,
            timings=timings,
            warnings=warnings,
            prefix_cached=prefix_cached,
            fusion=fused,
            generation=gen,
        )

    # ── the instruction prefix: prefix-cached, as vLLM or LMCache would ──
    def _use_archived_prefix(self, prefix: Segment, record_by_key: dict[str, SegmentRecord]) -> None:
        """Mark the prompt's instruction prefix cached when the archive holds its KV.

        It sits at position 0 and was prefilled there, so its archived KV is exactly
        what this prompt would compute: no mode but `full` recomputes it (fusor docstring).
        """
        prefix.key = self.key_of(prefix.token_ids)
        rec = self.archive().get_segment(prefix.key)
        if rec is not None and list(rec.token_ids) == list(prefix.token_ids):
            prefix.cached, prefix.base_position = True, 0
            record_by_key[prefix.key] = rec

    def _archive_prefix(self, prefix: Segment, fused: FusionResult) -> None:
        """Store the prefix's KV from this fusion (computed fresh at positions 0..n-1 in every
        mode when it was not cached), so later queries with the same template reuse it.

        Opportunistic: skipped, without a warning, while another process holds the writer
        lock; it costs no recompute, only an encode and a commit after the answer.
        """
        n = len(prefix.token_ids)
        if not n or n >= len(fused.token_ids) or prefix.key is None:
            return
        dtype = storage_dtype(self.runner)
        layers = [(k[0, :, :n].to("cpu", dtype).contiguous(), v[0, :, :n].to("cpu", dtype).contiguous())
                  for k, v in fused.kv]
        record = self._new_record(prefix.key, self.runner.tokenizer.decode(prefix.token_ids), prefix.token_ids,
                                  self.kv_settings())
        record.extra["role"] = "prefix"
        archive = self.archive()
        try:
            with archive.writer(wait=False):
                if not archive.has_segment(prefix.key):
                    archive.put_segments([(record, layers)])
        except ArchiveBusyError:
            pass  # another writer is busy: the next query stores it

    def _context_segment(self, text: str, store: bool) -> tuple[Segment, SegmentInfo, SegmentRecord | None]:
        """A --context-file text: cached if already archived, stored with --store, else computed."""
        ids = self.runner.tokenize(segment_text_for_kv(text))
        key = self.key_of(ids)
        rec = self.archive().get_segment(key)
        if rec is None and store:
            rec = self.store_texts([text])[0]
        cached = rec is not None
        seg = Segment(ids, cached=cached, key=key, base_position=rec.base_position if rec else 0)
        return seg, SegmentInfo(key, None, len(ids), cached), rec

    def _fuse_streaming(self, prompt, record_by_key, opts, blend_cfg, warn) -> FusionResult:
        """Fuse with the archive feed; a blob that fails mid-stream is recomputed instead."""
        while True:
            plan = plan_prompt(prompt, opts.mode)
            schedule = feed_schedule(prompt, plan, opts.mode, blend_cfg, self.runner.n_layers)
            feed = ArchiveFeed(self.runner, self.archive(), prompt, record_by_key, plan.offsets, schedule,
                               depth=opts.prefetch_depth, overlap=opts.loader_overlap)
            try:
                with feed:
                    fused = fuse(self.runner, prompt, opts.mode, blend_cfg, feed=feed)
                fused.stream = feed.stats  # type: ignore[attr-defined]
                return fused
            except SegmentUnavailable as exc:
                warn(f"{exc}; recomputing that segment (run `kvblend verify --repair`)")
                for seg in prompt:
                    if seg.key == exc.key:
                        seg.cached = False


def raw_kv_bytes(rec: SegmentRecord) -> int:
    """Size of the segment's KV as plain fp16: 2 tensors × 2 bytes × layers × heads × dim × tokens."""
    return 2 * 2 * rec.n_layers * rec.kv_heads * rec.head_dim * rec.n_tokens


def blob_intact(archive: Archive, rec: SegmentRecord) -> bool:
    """Cheap pre-flight (a stat, no read): the blob exists and is long enough for every layer.

    Bit flips are caught later by per-layer checksums while streaming.
    """
    try:
        size = (archive.path / rec.blob).stat().st_size
    except OSError:
        return False
    return all(layer.offset + layer.length <= size for layer in rec.layers)
