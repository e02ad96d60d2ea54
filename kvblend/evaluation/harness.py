"""The one harness: QA records → runs of every mode → scored against full. `kvblend bench` and
`kvblend tune`'s quality sweep both go through :class:`RecordRunner`, so they share the prompt
template, the decoding and the metrics.

How a record is run (the same for every record):

1. Its first ``chunks`` passages (``"{title}\\n\\n{text}"``) are archived as
   segments with ``Engine.store_texts`` (prefilled alone; outside timing) when
   a run streams from the archive; runs "in memory" prefill them here instead.
2. Set-up that is not timed comes next (the in-memory KV), so a record's timed
   runs follow each other.
3. Every run goes through once, in an order rotated by the record's index, so
   machine-load drift and "who goes first" effects spread over all modes alike.
   ``full`` is the reference: its answer, its first-token logits, and its first
   ``answer_kl_tokens`` greedy answer tokens. Runs that happen to come before
   it keep their fused KV until it has run, then are scored. A caller may hand
   in a reference from an earlier call (tune's sweep runs ratio by ratio).

One fusion per run, two decodes over it (the cheapest honest scheme):

* The *free-running* decode (greedy, the same ``max_new_tokens`` for every
  mode): its answer gives F1 vs gold and EM / ROUGE-L vs full's answer; its
  fusion gives the first-token KL and the recompute share; TTFT covers segment
  lookup, prompt assembly, KV streaming, fusion and the first token.
* The *teacher-forced* decode over the *same* fused KV (decoding copies the KV)
  with full's first ≤ ``answer_kl_tokens`` answer tokens: answer KL is the mean
  over those positions of KL(full ‖ mode). ``full`` goes through the same forced
  decode, so reference and candidates come from identical code. With
  ``answer_kl_tokens=0`` (tune), or when full's answer is empty, answer KL is
  the first-token KL.

Every run of a record must produce exactly full's prompt token ids; a mismatch
is a bug and raises. Engine warnings (e.g. a damaged blob recomputed) are kept:
they change what was measured.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from kvblend.archive import SegmentRecord
from kvblend.defaults import DEFAULT_CODEC
from kvblend.errors import UsageError
from kvblend.evaluation.drift import stale_reading
from kvblend.evaluation.metrics import first_divergence, kl_divergence, token_kls
from kvblend.evaluation.records import (
    ANSWER_KL_TOKENS,
    DEFAULT_BENCH_MAX_NEW_TOKENS,
    QARecord,
)
from kvblend.evaluation.specs import FULL, RunRecord, RunSpec
from kvblend.fusion import BlendConfig, FusionResult, fuse
from kvblend.generation import SamplingConfig, generate
from kvblend.model.prefill import precompute_kv
from kvblend.pipeline import QueryOptions
from kvblend.prompt import (
    MUSIQUE_TEMPLATE,
    PromptTemplate,
    assemble_prompt,
    segment_text_for_kv,
    split_template,
    template_sink,
)
from kvblend.types import Segment

ProgressFn = Callable[[int, int, str], None]
MemoryKV = dict[str, list[Segment]]  # sink policy → the record's passages with in-memory KV


class PromptTooLong(UsageError):
    """A record's prompt plus its answer does not fit the model's context."""


def blend_config(spec: RunSpec, n_layers: int) -> BlendConfig:
    """The fusor's configuration for a blend spec, validated (a bad check layer fails before any work).

    Gradual filtering over one check layer is the single-layer configuration
    (its ratio schedule is just ``(ratio,)``), so one constructor serves both.
    """
    if spec.ratio is None:
        raise UsageError("a blend run needs a ratio")
    cfg = BlendConfig.gradual(spec.ratio, spec.check_layers, spec.deviation, spec.select)
    cfg.validate(n_layers)
    return cfg


@dataclass
class Reference:
    """Full's run on one record: what every other run of the record is scored against."""

    spec: RunSpec
    ids: list[int]  # the prompt's token ids
    first: torch.Tensor  # first-token logits (float32, CPU)
    forced: list[int]  # full's first answer tokens, teacher-forced through every run
    steps: torch.Tensor | None  # full's logits at those positions, [n, vocab]
    answer: str


@dataclass
class Answer:
    """One free-running run, before it is scored."""

    text: str
    token_ids: list[int]
    fusion: FusionResult
    ttft_s: float
    recompute_share: float
    prompt_tokens: int
    stream: Any = None  # the archive feed's StreamStats, when KV streamed from the archive


class RecordRunner:
    """Runs specs on records against a reference spec (archive runs need an engine, memory runs do not)."""

    def __init__(
        self,
        runner,
        template: PromptTemplate = MUSIQUE_TEMPLATE,
        max_new_tokens: int = DEFAULT_BENCH_MAX_NEW_TOKENS,
        answer_kl_tokens: int = ANSWER_KL_TOKENS,
        chunks: int | None = None,
        engine=None,
        reference_spec: RunSpec = FULL,
    ):
        self.runner = runner
        self.engine = engine
        self.template = template
        self.sampling = SamplingConfig(max_new_tokens=max_new_tokens)
        self.answer_kl_tokens = answer_kl_tokens
        self.chunks = chunks
        self.reference_spec = reference_spec
        self.warnings: list[str] = []  # the engine's (e.g. a blob recomputed): they change what was measured

    # ── set-up ──
    def store(self, record: QARecord, codec: str = DEFAULT_CODEC) -> list[SegmentRecord]:
        """Archive the record's passages with `codec` (a lossy codec's segments have keys of their own)."""
        texts = record.passage_texts(self.chunks)
        stored = self.engine.store_texts(texts, codec=codec)
        if len(stored) != len(texts) or any(s is None for s in stored):
            raise RuntimeError("store_texts did not return a segment for every passage")
        return stored

    def memory_segments(self, record: QARecord, sink: str) -> list[Segment]:
        """The record's passages with KV prefilled under `sink`, like the archive stores it (fp16/bf16, CPU)."""
        ids = [self.runner.tokenize(segment_text_for_kv(t)) for t in record.passage_texts(self.chunks)]
        prefix: list[int] = []
        if sink == "template":
            prefix = template_sink(self.runner)  # what `ingest --sink template` prefills after
        elif sink == "shared-prefix":
            before, _ = split_template(self.runner, self.template, record.question)
            prefix = self.runner.tokenize(before)  # the prompt's instruction prefix: fixed across records
        kvs = precompute_kv(self.runner, ids, sink_prefix=prefix or None)
        return [
            Segment(i, kv=kv, base_position=len(prefix), key=f"{sink}:{n}") for n, (i, kv) in enumerate(zip(ids, kvs))
        ]

    # ── one run ──
    def options(self, spec: RunSpec, keys: list[str]) -> QueryOptions:
        return QueryOptions(
            mode=spec.mode,
            ratio=spec.ratio,
            check_layers=spec.check_layers if spec.mode == "blend" else None,
            deviation=spec.deviation,
            select=spec.select,
            segment_keys=list(keys),
            template=self.template,
            sampling=self.sampling,
        )

    def answer(self, question: str, spec: RunSpec, keys: list[str], memory: MemoryKV) -> Answer:
        """One free-running run: through the engine (archive) or fused here from in-memory KV."""
        if spec.source == "archive":
            res = self.engine.query(question, self.options(spec, keys))
            self.warnings.extend(f"{spec.label}: {w}" for w in res.warnings)
            return Answer(
                res.answer,
                res.generation.token_ids,
                res.fusion,
                res.ttft_s,
                res.recompute_share,
                res.prompt_tokens,
                getattr(res.fusion, "stream", None),
            )
        cfg = blend_config(spec, self.runner.n_layers) if spec.mode == "blend" else None
        t0 = time.perf_counter()
        prompt = assemble_prompt(self.runner, self.template, question, list(memory[spec.sink]))
        self._check_fits(prompt)
        fused = fuse(self.runner, prompt, spec.mode, cfg)
        t1 = time.perf_counter()
        gen = generate(self.runner, fused, self.sampling)
        return Answer(
            gen.text, gen.token_ids, fused, (t1 - t0) + gen.first_token_s, fused.recompute_share, len(fused.token_ids)
        )

    def _check_fits(self, prompt: Sequence[Segment]) -> None:
        limit = self.runner.max_positions
        n = sum(len(s.token_ids) for s in prompt)
        if limit and n + self.sampling.max_new_tokens > limit:
            raise PromptTooLong(f"a {n}-token prompt and its answer exceed the model's context ({limit})")

    def forced_logits(self, fusion: FusionResult, tokens: list[int]) -> torch.Tensor | None:
        """Teacher-force `tokens` from a fused KV; the logits before each one ([n, vocab])."""
        if not tokens:
            return None
        gen = generate(
            self.runner,
            fusion,
            SamplingConfig(max_new_tokens=len(tokens)),
            keep_logits=True,
            forced_tokens=list(tokens),
        )
        return torch.stack(gen.step_logits)

    # ── scoring ──
    def _reference(self, spec: RunSpec, ans: Answer) -> Reference:
        forced = list(ans.token_ids[: self.answer_kl_tokens])
        return Reference(
            spec,
            list(ans.fusion.token_ids),
            ans.fusion.last_logits.detach().float().cpu(),
            forced,
            self.forced_logits(ans.fusion, forced),
            ans.text,
        )

    def _score(
        self,
        index: int,
        record: QARecord,
        ref: Reference,
        spec: RunSpec,
        ans: Answer,
        steps: torch.Tensor | None = None,
        stored: Sequence[SegmentRecord] = (),
    ) -> RunRecord:
        if list(ans.fusion.token_ids) != ref.ids:
            raise RuntimeError(
                f"{spec.label} ran on a different prompt than full ({ans.prompt_tokens} vs {len(ref.ids)} tokens)"
            )
        kl = kl_divergence(ref.first, ans.fusion.last_logits.detach().float().cpu())
        position_kls, diverges_at, stale = [kl], None, None
        if ref.steps is None:  # full stopped at once (or no forcing asked): the first position is all there is
            answer_kl = kl
        else:
            forced = steps if steps is not None else self.forced_logits(ans.fusion, ref.forced)
            position_kls = token_kls(ref.steps, forced)  # computed once: answer KL is their mean
            answer_kl = statistics.fmean(position_kls)
            diverges_at = first_divergence(ref.forced, forced)
            if diverges_at is not None:  # what the step that left full's answer read (stale KV or not)
                stale = stale_reading(self.runner, ans.fusion, ref.forced, diverges_at)
        reads = spec.mode in ("reuse", "blend") and spec.source == "archive"  # the passages' KV came from disk
        return RunRecord(
            index,
            spec,
            ans.text,
            list(record.answers),
            ans.ttft_s,
            ans.recompute_share,
            kl,
            answer_kl,
            ans.prompt_tokens,
            sum(r.stored_bytes for r in stored) if reads else 0,
            sum(r.n_tokens for r in stored) if reads else 0,
            ans.stream if reads else None,
            position_kls,
            diverges_at,
            stale,
        )

    def run(
        self,
        index: int,
        record: QARecord,
        specs: Sequence[RunSpec],
        on_run: Callable[[RunSpec], None] | None = None,
        reference: Reference | None = None,
        memory: MemoryKV | None = None,
    ) -> tuple[Reference, list[RunRecord]]:
        """All `specs` on one record, in an order rotated by `index`; scored against the reference run.

        Without `reference`, the reference spec runs too (and its record is
        returned). `memory` caches the record's in-memory KV across calls.
        """
        if reference is None:
            todo = list(dict.fromkeys([self.reference_spec, *specs]))
        else:
            todo = [s for s in dict.fromkeys(specs) if s != reference.spec]
        stored = {c: self.store(record, c) for c in dict.fromkeys(s.codec for s in todo if s.source == "archive")}
        keys = {c: [r.key for r in recs] for c, recs in stored.items()}
        memory = {} if memory is None else memory
        for s in todo:  # untimed set-up first, so the timed runs of a record follow each other
            if s.source == "memory" and s.sink not in memory:
                memory[s.sink] = self.memory_segments(record, s.sink)
        shift = index % len(todo) if todo else 0
        order = todo[shift:] + todo[:shift]
        pending: list[tuple[RunSpec, Answer]] = []  # runs finished before the reference: scored once it exists
        out: list[RunRecord] = []
        for spec in order:
            ans = self.answer(record.question, spec, keys.get(spec.codec, []), memory)
            if reference is None and spec == self.reference_spec:
                reference = self._reference(spec, ans)
                out.append(self._score(index, record, reference, spec, ans, steps=reference.steps))
                out.extend(
                    self._score(index, record, reference, s, a, stored=stored.get(s.codec, ())) for s, a in pending
                )
                pending.clear()
            elif reference is not None:
                out.append(self._score(index, record, reference, spec, ans, stored=stored.get(spec.codec, ())))
            else:
                pending.append((spec, ans))  # keeps its fused KV until the reference has run
            del ans
            if on_run:
                on_run(spec)
        out.sort(key=lambda r: order.index(r.spec))
        assert reference is not None, "the reference spec runs on every record"
        return reference, out
