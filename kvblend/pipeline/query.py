"""Query: retrieve → assemble the prompt → stream cached KV + fuse → generate.

    select_records      pinned documents / segments, else top-k retrieval
    build_prompt        instruction prefix + passages + question, prefix cache, length check
    fuse_streaming      fuse over the archive feed; a blob that fails mid-stream is prefilled alone and fed
                        from memory from that layer on (planned once), or else recomputed in the prompt
    finish_steps        the writes, queued behind the answer (writebehind.py): archive the instruction
                        prefix on first use, touch what was used, restore what could not be read

Damaged blobs never fail a query: a missing or short blob is caught by a stat
before fusing, a bit flip by its checksum while streaming; either way the
segment is recomputed and a warning names it.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from kvblend.archive import SegmentRecord
from kvblend.archive.codec import is_lossless
from kvblend.errors import ArchiveBusyError, ArchiveError, ArchiveUnavailableError, NotFoundError, UsageError
from kvblend.feeds.archive import ArchiveFeed, RecoveringFeed, SegmentUnavailable
from kvblend.fusion import BlendConfig, FusionResult, effective_cached, feed_schedule, fuse_steps, plan_prompt
from kvblend.fusion.plan import effective_blend
from kvblend.generation import Generation, generate
from kvblend.model.prefill import precompute_kv, storage_dtype
from kvblend.model.runner import ModelRunner
from kvblend.pipeline.ingest import new_record, prefill_text_steps, store_prefilled, store_texts_steps
from kvblend.pipeline.resources import Resources
from kvblend.pipeline.results import QueryOptions, QueryResult, SegmentInfo
from kvblend.prompt import assemble_prompt, segment_text_for_kv, split_template
from kvblend.retrieval import get_embedder, top_k
from kvblend.types import LayerKV, Segment, Steps, drain

Warn = Callable[[str], None]


class ContextLengthError(UsageError):
    """The prompt plus the tokens to generate exceed the model's context (a server answers 400)."""

    def __init__(self, prompt_tokens: int, new_tokens: int, limit: int, retrieved: bool = True):
        self.prompt_tokens, self.new_tokens, self.limit = prompt_tokens, new_tokens, limit
        # fewer segments help only where retrieval picked them
        super().__init__(self.explain("--top-k" if retrieved else None, "--max-tokens"))

    def explain(self, fewer_segments: str | None, max_tokens: str = "max_tokens") -> str:
        """The message, naming the remedy that can work, in the caller's words (a flag, a request field;
        `fewer_segments` None: the passages were chosen by hand). Generation alone past the context leaves
        no room for any prompt: only a smaller max-tokens helps."""
        head = (
            f"prompt is {self.prompt_tokens} tokens (+{self.new_tokens} to generate); "
            f"the model's context is {self.limit}"
        )
        room = self.limit - self.prompt_tokens  # what this prompt leaves to generate
        if self.new_tokens >= self.limit and room > 0:
            return f"{head}: {max_tokens} must be at most {room} for this prompt"
        fix = (
            f"use fewer segments ({fewer_segments}) or a shorter question"
            if fewer_segments
            else "use shorter passages or a shorter question"
        )
        return f"{head}: {fix}, or {max_tokens} at most {room}" if room > 0 else f"{head}: {fix}"


def run_query(
    res: Resources,
    question: str,
    opts: QueryOptions,
    on_token: Callable[[str], None] | None = None,
    on_warning: Warn | None = None,
) -> QueryResult:
    """Answer `question` from archived segments with the chosen mode."""
    prepared = drain(prepare_steps(res, question, opts, on_warning))
    gen = generate(
        res.runner,
        prepared.fused,
        opts.sampling,
        on_token=on_token,
        keep_logits=opts.keep_step_logits,
        forced_tokens=list(opts.forced_tokens) if opts.forced_tokens is not None else None,
    )
    res.writes.put(finish_steps(res, prepared))  # after the answer, by the queue's owner (writebehind.py)
    result = answered(prepared, gen, prepared.fusion_s + gen.first_token_s, res.runner)
    result.timings["model_load_s"] = res.model_load_s
    return result


@dataclass
class Prepared:
    """A query up to its first token's logits: the prompt, its fused KV, and what it took to get there."""

    opts: QueryOptions
    ratio: float | None
    prompt: list[Segment]
    fused: FusionResult
    infos: list[SegmentInfo]
    record_by_key: dict[str, SegmentRecord]
    unreadable: list[str]  # segments whose KV could not be read (recomputed in the prompt; stored again after)
    warnings: list[str]
    retrieval_s: float
    fusion_s: float  # from the start to the fused KV (retrieval, stored misses, streaming, fusion)
    warn: Warn
    recovered: list[str] = field(default_factory=list)  # recomputed alone mid-fusion (in the prompt's seg.kv)

    @property
    def prefix_cached(self) -> bool:
        # cached only with opts.cache_prefix; blend at ratio 1.0 is exactly `full`, the prefix recomputed too
        if not self.prompt[0].cached or self.fused.mode == "full":
            return False
        return self.fused.mode != "blend" or self.fused.exact_prefix_tokens > 0


def prepare_steps(
    res: Resources,
    question: str,
    opts: QueryOptions,
    on_warning: Warn | None = None,
    rows_per_step: int | None = None,
) -> Steps[Prepared]:
    """Retrieve, store the passages the archive misses, assemble the prompt, stream its KV and fuse, in steps
    (a server runs a new request's steps between its running requests' decode steps), which yield every
    `rows_per_step` tokens inside a layer too (see fuse_steps; None: whole layers)."""
    opts.validate()
    if not question or not question.strip():
        raise UsageError("empty question")
    res.warm_up()
    blend_cfg, ratio = res.blend_config(opts) if opts.mode == "blend" else (BlendConfig(), None)
    warnings: list[str] = []

    def warn(msg: str) -> None:
        warnings.append(msg)
        if on_warning:
            on_warning(msg)

    t0 = time.perf_counter()
    passages, infos, record_by_key = yield from _passages(res, question, opts, warn, rows_per_step)
    t_retrieved = time.perf_counter()
    prompt = build_prompt(res, question, passages, record_by_key, opts, warn)
    recovered: list[str] = []
    fused, unreadable = yield from fuse_streaming(
        res, prompt, record_by_key, opts, blend_cfg, warn, rows_per_step, recovered
    )
    # whether the mode reused the passage's KV: `full` reuses none, `prefix` only an exact first segment,
    # blend at ratio 1.0 none (it recomputes every cached token: exactly `full`), nor blend where its probe
    # would have cost more than the whole prompt (fusion.plan.effective_blend)
    ran = effective_blend(plan_prompt(prompt, opts.mode), opts.mode, blend_cfg) if opts.mode == "blend" else None
    used_mode = "full" if ran is not None and not ran.selects else opts.mode
    if ran is not None and blend_cfg.selects and not ran.selects:
        warn(
            "blend computed the whole prompt, as full does: its cached passages are too few tokens beside the rest "
            "for the probe's pass to pay"
        )
    cached_flags = {s.key: used for s, used in zip(prompt, effective_cached(prompt, used_mode))}
    for info in infos:
        info.cached = cached_flags.get(info.key, info.cached)
    return Prepared(
        opts,
        ratio,
        prompt,
        fused,
        infos,
        record_by_key,
        unreadable,
        warnings,
        t_retrieved - t0,
        time.perf_counter() - t0,
        warn,
        recovered,
    )


def finish_steps(res: Resources, prepared: Prepared, rows_per_step: int | None = None) -> Steps[None]:
    """The write job a query leaves in the engine's write-behind queue (query code never runs it itself): after
    the answer, archive a freshly computed instruction prefix, touch the segments used (for gc), and
    store again the passages whose KV could not be read (yielding every `rows_per_step` tokens of a layer)."""
    _record_use(res, prepared.prompt, prepared.fused, prepared.opts, prepared.warn)
    if prepared.opts.restore_missing:
        for seg in prepared.prompt:  # recomputed alone mid-fusion: their KV is at hand, written as is
            if seg.key in prepared.recovered and seg.kv is not None and seg.key in prepared.record_by_key:
                write_back(res, prepared.record_by_key[seg.key], seg.kv, prepared.warn)
                seg.kv = None
    if prepared.unreadable and prepared.opts.restore_missing:
        records = [prepared.record_by_key[k] for k in prepared.unreadable if k in prepared.record_by_key]
        yield from restore_segments(res, records, prepared.warn, rows_per_step)


def answered(prepared: Prepared, gen: Generation, ttft: float, runner: ModelRunner) -> QueryResult:
    """The report of an answered query (`ttft`: from its start to its first token, as the caller measured it) by
    `runner` (its compute dtype and decode weights are reported)."""
    fused = prepared.fused
    timings = {
        "retrieval_s": prepared.retrieval_s,
        "load_wait_s": fused.load_wait_s,
        "recompute_s": fused.compute_s - fused.load_wait_s,
        "fusion_s": prepared.fusion_s - prepared.retrieval_s,
        "ttft_s": ttft,
        "decode_s": gen.decode_s,
    }
    return QueryResult(
        answer=gen.text,
        mode=prepared.opts.mode,
        ratio=prepared.ratio,
        ttft_s=ttft,
        load_wait_s=fused.load_wait_s,
        prompt_tokens=len(fused.token_ids),
        recomputed_tokens=fused.active_per_layer[-1],
        recompute_share=fused.recompute_share,
        segments=prepared.infos,
        tokens_per_s=gen.tokens_per_s,
        timings=timings,
        warnings=prepared.warnings,
        prefix_cached=prepared.prefix_cached,
        weights=runner.weights_name,
        dtype=runner.dtype_name,
        fusion=fused,
        generation=gen,
    )


# ── passages ──
def _passages(
    res: Resources, question: str, opts: QueryOptions, warn: Warn, rows_per_step: int | None = None
) -> Steps[tuple[list[Segment], list[SegmentInfo], dict[str, SegmentRecord]]]:
    """The prompt's passages in order: archived records, then --context-file texts."""
    records, infos = select_records(res, question, opts, warn)
    passages = [Segment(list(r.token_ids), cached=True, key=r.key, base_position=r.base_position) for r in records]
    record_by_key = {r.key: r for r in records}
    lengths = [len(res.runner.tokenize(segment_text_for_kv(t))) for t in opts.context_texts]
    if opts.context_texts:  # before any text is stored: a prompt that cannot fit stores nothing
        before, after = split_template(res.runner, opts.template, question)
        skeleton = len(res.runner.tokenize(before)) + len(res.runner.tokenize(after))
        check_length(res, skeleton + sum(len(p.token_ids) for p in passages) + sum(lengths), opts)
    stored_tokens = 0
    for text, n in zip(opts.context_texts, lengths):
        # a request stores at most max_stored_tokens of new passages: the rest is computed in the prompt
        store = opts.store_context and (opts.max_stored_tokens is None or stored_tokens + n <= opts.max_stored_tokens)
        seg, info, rec = yield from context_segment_steps(res, text, store, warn, rows_per_step)
        stored_tokens += n if info.stored else 0
        passages.append(seg)
        infos.append(info)
        if rec is not None:
            record_by_key[rec.key] = rec
    if not passages:
        raise UsageError("no passages: the question needs at least one segment or --context-file")
    return passages, infos, record_by_key


def select_records(
    res: Resources, question: str, opts: QueryOptions, warn: Warn | None = None
) -> tuple[list[SegmentRecord], list[SegmentInfo]]:
    """Pinned documents then pinned segments (both may be given), else top-k retrieval; in prompt order.

    A pinned document that lost segments (evicted, damaged and dropped) answers from the rest with a warning;
    one with nothing left is NotFoundError (a server answers 404), never silently other documents' passages.
    """
    archive = res.archive(create=False)
    records: list[SegmentRecord] = []
    infos: list[SegmentInfo] = []
    pinned: set[str] = set()  # documents given twice (two names of one) go into the prompt once
    for name in opts.docs:
        doc = archive.find_document(name)
        if doc.path in pinned:
            continue
        pinned.add(doc.path)
        present: list[tuple[int, SegmentRecord]] = []  # (index in the document, record) of what is still there
        for i, k in enumerate(doc.segment_keys):
            if (stored := archive.get_segment(k)) is not None:
                present.append((i, stored))
        if not present:
            raise NotFoundError(
                f"document {doc.display_name} has no segments left in the archive (evicted or damaged): ingest it again"
            )
        if (len(present) < len(doc.segment_keys) or doc.incomplete) and warn is not None:
            warn(
                f"document {doc.display_name} lost segments (evicted or damaged): answering from the "
                f"{len(present)} left; ingest it again to restore it"
            )
        for i, rec in present:
            records.append(rec)
            infos.append(SegmentInfo(rec.key, doc.display_name, rec.n_tokens, True, **doc.source(i)))
    for key in opts.segment_keys:
        rec = archive.find_segment(key)
        if any(r.key == rec.key for r in records):  # pinned already, by --segment or in a --doc
            continue
        records.append(rec)
        infos.append(_archived_info(res, rec))
    if records or (opts.context_texts and opts.top_k == 0):
        return records, infos
    keys, matrix = _documents_only(res, *archive.get_embeddings())
    if not keys:  # no embeddings at all (a cache may have evicted them), or only stored passages'
        alone = " (or --top-k 0 to answer from the given passages alone)" if opts.context_texts else ""
        raise UsageError(
            f"the archive at {res.location} is empty (no ingested documents to retrieve from): "
            f"run `kvblend ingest PATH` first{alone}"
        )
    query_vec = get_embedder().embed([question])[0]
    for key, score in top_k(query_vec, keys, matrix, opts.top_k):
        found = archive.get_segment(key)
        if found is None:
            continue
        rec = found
        records.append(rec)
        infos.append(_archived_info(res, rec, round(score, 4)))
    return records, infos


def _archived_info(res: Resources, rec: SegmentRecord, score: float | None = None) -> SegmentInfo:
    """A retrieved or pinned segment's report: the document holding it, and where in it (pages, section)."""
    origin = res.origin_of(rec.key)
    if origin is None:  # a stored passage of no document (a --context-file --store, a client's chunk)
        return SegmentInfo(rec.key, None, rec.n_tokens, True, score)
    document, source = origin
    return SegmentInfo(rec.key, document, rec.n_tokens, True, score, **source)


def _documents_only(res: Resources, keys: list[str], matrix: np.ndarray) -> tuple[list[str], np.ndarray]:
    """Retrieval searches the ingested documents' segments only. Passages a query or a server's client brought
    along are stored to reuse their KV when the same text comes again, not to answer other questions: a
    passage one client sent (a memo, a key) was retrieved into another client's answer."""
    rows = [i for i, key in enumerate(keys) if res.document_of(key) is not None]
    return [keys[i] for i in rows], matrix[rows]


def context_segment(
    res: Resources, text: str, store: bool, warn: Warn | None = None
) -> tuple[Segment, SegmentInfo, SegmentRecord | None]:
    """:func:`context_segment_steps` in one go."""
    return drain(context_segment_steps(res, text, store, warn))


def context_segment_steps(
    res: Resources, text: str, store: bool, warn: Warn | None = None, rows_per_step: int | None = None
) -> Steps[tuple[Segment, SegmentInfo, SegmentRecord | None]]:
    """A --context-file text (or a client's passage): cached if already archived, stored with --store, else
    computed.

    Stored write-behind: the passage is prefilled alone (exactly what ingest would store), the answer reads
    that KV from memory (the same values the archive would hand back, for the lossless default codec: the
    same answer), and the write (encode, blob, index, embedding) is queued on the engine's write-behind queue,
    after the answer. The prefill stays on the time to first token as before; the write no longer is.

    Storing is skipped (the text is computed in the prompt instead) while another process holds the writer
    lock past store_texts' wait, or while the store cannot be reached: an answer never fails for it.
    """
    ids = res.runner.tokenize(segment_text_for_kv(text))
    key = res.key_of(ids)
    stored = False
    kv: list[LayerKV] | None = None
    try:
        archive = res.archive()
        rec = archive.get_segment(key)
        if rec is None and (staged := res.writes.staged(key)) is not None:
            rec, kv = staged  # another query's stored miss, still queued to be written: a hit all the same
        elif rec is None and store and not archive.readonly:
            rec, kv = yield from prefill_text_steps(res, text, rows_per_step)  # what ingest would store
            res.writes.stage(rec, kv, functools.partial(_store_miss, res, rec, kv, warn))
            stored = True
        elif rec is None and store and warn is not None:  # an archive this user may not write: nothing stored
            warn("the archive is not writable: --store skipped, the passage computed in the prompt")
    except ArchiveBusyError:
        rec = None
    except ArchiveUnavailableError as exc:
        if warn is not None:
            warn(f"{exc}; computing the passage in the prompt")
        rec = None
    cached = rec is not None
    seg = Segment(ids, kv=kv, cached=cached, key=key, base_position=rec.base_position if rec else 0)
    return seg, SegmentInfo(key, None, len(ids), cached, stored=stored), rec


# ── the prompt ──
def build_prompt(
    res: Resources,
    question: str,
    passages: list[Segment],
    record_by_key: dict[str, SegmentRecord],
    opts: QueryOptions,
    warn: Warn,
) -> list[Segment]:
    """Instruction prefix + passages + question; segments whose blob is damaged are left uncached."""
    runner = res.runner
    prompt = assemble_prompt(runner, opts.template, question, passages)
    if opts.cache_prefix:
        use_archived_prefix(res, prompt[0], record_by_key)
    check_length(res, sum(len(s.token_ids) for s in prompt), opts)
    for seg in prompt:  # (a passage computed for this query, its KV in memory, has no blob yet)
        if seg.cached and seg.kv is None and not res.archive().payload_intact(record_by_key[str(seg.key)]):
            seg.cached = False
            warn(
                f"segment {str(seg.key)[:12]}: blob missing or truncated; recomputing it (run `kvblend verify "
                "--repair`)"
            )
    return prompt


def check_length(res: Resources, prompt_tokens: int, opts: QueryOptions) -> None:
    """Refuse a prompt that, with the tokens to generate, would not fit the model's context."""
    limit = res.runner.max_positions
    if limit and prompt_tokens + opts.sampling.max_new_tokens > limit:
        retrieved = opts.top_k > 0 and not (opts.docs or opts.segment_keys)
        raise ContextLengthError(prompt_tokens, opts.sampling.max_new_tokens, limit, retrieved)


# ── the instruction prefix: prefix-cached, as vLLM or LMCache would ──
def use_archived_prefix(res: Resources, prefix: Segment, record_by_key: dict[str, SegmentRecord]) -> None:
    """Mark the prompt's instruction prefix cached when the archive holds its KV.

    It sits at position 0 and was prefilled there, so its archived KV is exactly
    what this prompt would compute: no mode but `full` recomputes it (kvblend.fusion.plan).
    """
    prefix.key = res.key_of(prefix.token_ids)
    try:
        rec = res.archive().get_segment(prefix.key)
    except ArchiveUnavailableError:
        return  # computed in the prompt; the passages' lookups say why
    if rec is not None and list(rec.token_ids) == list(prefix.token_ids):
        prefix.cached, prefix.base_position = True, 0
        record_by_key[prefix.key] = rec


def archive_prefix(res: Resources, prefix: Segment, fused: FusionResult) -> None:
    """Store the prefix's KV from this fusion (computed fresh at positions 0..n-1 in every
    mode when it was not cached), so later queries with the same template reuse it.

    Opportunistic: skipped, without a warning, while another process holds the writer
    lock or when the archive is read-only; it costs no recompute, only an encode and a
    commit after the answer.
    """
    n = len(prefix.token_ids)
    if not n or n >= len(fused.token_ids) or prefix.key is None:
        return
    runner = res.runner
    dtype = storage_dtype(runner)
    layers = [
        (k[0, :, :n].to("cpu", dtype).contiguous(), v[0, :, :n].to("cpu", dtype).contiguous()) for k, v in fused.kv
    ]
    record = new_record(
        runner, prefix.key, runner.tokenizer.decode(prefix.token_ids), prefix.token_ids, res.kv_settings()
    )
    record.extra["role"] = "prefix"
    archive = res.archive()
    if archive.readonly:
        return  # an archive this user cannot write: answer from it, store nothing
    try:
        with archive.writer(wait=False):
            if not archive.has_segment(prefix.key):
                archive.put_segments([(record, layers)])
    except ArchiveBusyError:
        pass  # another writer is busy: the next query stores it


def _record_use(res: Resources, prompt: list[Segment], fused: FusionResult, opts: QueryOptions, warn: Warn) -> None:
    """After the answer: archive a freshly computed prefix, and touch the segments used (for gc)."""
    try:
        if opts.cache_prefix and not prompt[0].cached:
            archive_prefix(res, prompt[0], fused)
        res.archive().touch([s.key for s in prompt if s.cached and s.key is not None])
    except Exception as exc:  # bookkeeping must never fail an answered query
        warn(f"could not record segment use: {exc}")


def restore_segments(
    res: Resources, records: list[SegmentRecord], warn: Warn, rows_per_step: int | None = None
) -> Steps[None]:
    """Store again, prefilled alone, the passages whose KV could not be read (a cache evicted a layer, a blob was
    damaged), so the next query hits: after the answer, never on its time to first token. A passage is restored
    only under its own key (the same tokens, model and settings); an instruction prefix is archived by
    :func:`archive_prefix` instead."""
    texts_by_codec: dict[str, list[str]] = {}  # each under its own codec: an int4 segment comes back int4
    for rec in records:
        if (
            rec.extra.get("role") != "prefix"
            and rec.text
            and res.key_of(res.runner.tokenize(segment_text_for_kv(rec.text)), rec.codec) == rec.key
        ):
            texts_by_codec.setdefault(rec.codec, []).append(rec.text)
    if not texts_by_codec or res.archive().readonly:
        return
    try:
        for codec, texts in texts_by_codec.items():
            yield from store_texts_steps(res, texts, codec, replace=True, rows_per_step=rows_per_step)
    except (ArchiveBusyError, ArchiveError) as exc:  # bookkeeping: the answer stands
        warn(f"could not store the recomputed segments again: {exc}")


def recompute_alone(res: Resources, rec: SegmentRecord | None) -> list[LayerKV] | None:
    """A segment's KV as the archive held it, computed again: prefilled alone after the sink it was stored
    under (an instruction prefix at position 0, where it was computed), in the storage dtype. None where the
    archive's values cannot be reproduced exactly: a lossy codec (its rounding is not this), another sink."""
    if rec is None or not is_lossless(rec.codec):
        return None
    if rec.extra.get("role") == "prefix":
        sink: list[int] = []
    elif res.prefilled_under_sink(rec.extra):
        sink = res.sink_ids()
    else:
        return None
    if len(sink) != rec.base_position:
        return None
    return precompute_kv(res.runner, [list(rec.token_ids)], sink or None)[0]


def _store_miss(res: Resources, rec: SegmentRecord, kv: list[LayerKV], warn: Warn | None) -> None:
    """The queued write of a stored miss (see context_segment_steps); a failure is a warning (the query's, or
    else the one whoever drains the queue gives)."""
    try:
        store_prefilled(res, rec, kv)
    except (ArchiveBusyError, ArchiveError) as exc:  # the answer stands; the next query computes it again
        if warn is None:
            raise
        warn(f"could not store the passage {rec.key[:12]}: {exc}")


def write_back(res: Resources, rec: SegmentRecord, kv: list[LayerKV], warn: Warn) -> None:
    """Store a segment's recomputed KV again under its key and codec (a write job, run after the answer), so
    the next query reads it; skipped while another writer holds the lock or the archive is read-only."""
    archive = res.archive()
    if archive.readonly:
        return
    fresh = new_record(
        res.runner, rec.key, rec.text, list(rec.token_ids), res.kv_settings(rec.codec), rec.base_position
    )
    fresh.extra = dict(rec.extra)
    try:
        with archive.writer(wait=30.0):
            archive.put_segments([(fresh, kv)], codec=rec.codec)
    except (ArchiveBusyError, ArchiveError) as exc:  # bookkeeping: the answer stands
        warn(f"could not store the recomputed segment {rec.key[:12]} again: {exc}")


# ── fusion over the archive ──
def fuse_streaming(
    res: Resources,
    prompt: list[Segment],
    record_by_key: dict[str, SegmentRecord],
    opts: QueryOptions,
    blend_cfg: BlendConfig,
    warn: Warn,
    rows_per_step: int | None = None,
    recovered: list[str] | None = None,
) -> Steps[tuple[FusionResult, list[str]]]:
    """Fuse with the archive feed, in steps (fuse_steps). A segment whose KV fails mid-stream is prefilled
    alone, as ingest stored it, and fed from memory from the failed layer on (RecoveringFeed: the fusion goes
    on, planned once); only where that cannot reproduce the archive's KV (a lossy codec, another sink) or the
    store itself failed does the fusion start again with the segment recomputed in the prompt. Returns the
    fusion and the keys of the segments that could not be read (those restarted without it)."""
    runner = res.runner
    unreadable: list[str] = []
    while True:
        plan = plan_prompt(prompt, opts.mode)
        schedule = feed_schedule(prompt, plan, opts.mode, blend_cfg, runner.n_layers)
        feed = RecoveringFeed(
            functools.partial(
                ArchiveFeed,
                runner,
                res.archive(),
                prompt,
                record_by_key,
                plan.offsets,
                depth=opts.prefetch_depth,
                overlap=opts.loader_overlap,
            ),
            schedule,
            prompt,
            lambda seg: recompute_alone(res, record_by_key.get(str(seg.key))),
            lambda exc: warn(f"{exc}; recomputed that segment alone and went on (run `kvblend verify --repair`)"),
        )
        try:
            with feed:
                fused = yield from fuse_steps(runner, prompt, opts.mode, blend_cfg, feed, rows_per_step)
            fused.stream = feed.stats
            if recovered is not None:
                recovered.extend(feed.recovered)
            return fused, unreadable
        except SegmentUnavailable as exc:  # recompute_alone could not reproduce it, or the store went away
            if recovered is not None:
                recovered.extend(feed.recovered)
            if exc.every:
                warn(f"{exc}; recomputing every passage")
            else:
                warn(f"{exc}; recomputing that segment (run `kvblend verify --repair`)")
            for seg in prompt:
                if seg.key == exc.key or (exc.every and seg.cached):
                    seg.cached = False
                    if not exc.every and seg.key is not None:
                        unreadable.append(seg.key)
