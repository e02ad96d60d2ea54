"""The benchmark harness behind `kvblend bench`: QA records → runs of every mode → metrics.

No terminal code here: the CLI (kvblend.cli.bench_cmds) and scripts call
:func:`load_records`, :func:`run_bench` / :func:`run_variants` and
:func:`plot_report`, and progress leaves through a callback.

How a record is run (the same for every record):

1. Its first ``chunks`` passages (``"{title}\\n\\n{text}"``) are archived as
   segments with :meth:`Engine.store_texts` (prefilled alone; outside timing).
2. Set-up that is not timed comes next (the in-memory KV of the sink
   variants), so a record's timed runs follow each other.
3. Every run — ``full``, each mode, each blend ratio, each variant — goes
   through once, in an order rotated by the record's index, so machine-load
   drift and "who goes first" effects spread over all modes alike. ``full``
   is the reference: its answer, its first-token logits, and its first
   ``answer_kl_tokens`` (16) greedy answer tokens. Runs that happen to come
   before it keep their fused KV until it has run, then are scored.

One fusion per run, two decodes over it (the cheapest honest scheme):

* The *free-running* decode: :meth:`Engine.query` with identical options for
  every mode (greedy, same ``max_new_tokens``, no logits kept), so TTFT comes
  from the same kind of run everywhere. Its answer gives F1 vs gold and
  EM / ROUGE-L vs full's answer; its fusion gives the first-token KL and the
  recompute share.
* The *teacher-forced* decode: :func:`kvblend.generate.generate` again over
  the *same* fused KV (``QueryResult.fusion``; decoding copies the KV, it does
  not modify it), with ``forced_tokens`` = full's first ≤16 answer tokens and
  ``keep_logits``. Answer KL is the mean over those positions of
  KL(full ‖ mode); position 0 is the first token. ``full`` goes through the
  same forced decode on its own fusion, so its reference logits and everyone
  else's come from identical code. This costs ≤16 decode steps per run, not a
  second prefill/fusion. When full's answer is empty (it stops at once),
  answer KL falls back to the first-token KL (the one position there is).

Every run of a record must produce exactly full's prompt token ids; a mismatch
is a bug and raises. TTFT is :attr:`QueryResult.ttft_s` (segment lookup, prompt
assembly, KV streaming, fusion, first token; model load excluded), after one
untimed warm-up query per mode family on a one-passage prompt. Engine warnings
(e.g. a damaged blob recomputed) are kept in the report: they change what was
measured.

Variants (``variants=True``, at ``variant_ratio``): deviation on K / V / both,
check layer 1 / 2 / gradual 1,2,3 (all through the archive, like the main
runs), and the sink policy — chunks prefilled *alone* vs after the prompt's
shared instruction prefix (``shared-prefix``: prefix KV dropped, base position
= prefix length), compared for reuse and blend in memory (both policies on the
same in-memory path, so their TTFTs compare with each other, not with the
archive rows). Identical configurations (e.g. blend@0.15 deviation k check
layer 1) run once and are reported under each name.
"""

from __future__ import annotations

import datetime as _dt
import json
import math
import os
import platform
import socket
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Sequence

import torch

from kvblend.documents import read_user_text
from kvblend.errors import UsageError
from kvblend.fusor import DEFAULT_DEVIATION, DEVIATIONS, MODES, Segment, fuse
from kvblend.generate import SamplingConfig, generate
from kvblend.metrics import exact_match, f1_score, kl_divergence, mean_token_kl, percentile, rouge_l
from kvblend.prompt import MUSIQUE_TEMPLATE, PromptTemplate, assemble_prompt, segment_text_for_kv

DEFAULT_MODES = ("full", "prefix", "reuse", "blend")
DEFAULT_RATIOS = (0.05, 0.15, 0.3)
DEFAULT_CHUNKS = 6
DEFAULT_MAX_NEW_TOKENS = 32
ANSWER_KL_TOKENS = 16
DEFAULT_VARIANT_RATIO = 0.15
SINK_POLICIES = ("alone", "shared-prefix")
BENCH_DEVIATION = DEFAULT_DEVIATION  # the engine's defaults, spelled out so variants name them
BENCH_CHECK_LAYERS = (1,)


# ───────────────────────────────── records ─────────────────────────────────


@dataclass
class QARecord:
    """One QA item: passages (title, text) in retrieval order, a question, gold answers."""

    question: str
    passages: list[tuple[str, str]]
    answers: list[str]

    def passage_texts(self, chunks: int) -> list[str]:
        return [f"{title}\n\n{text}" for title, text in self.passages[:chunks]]


def load_records(path: str | os.PathLike[str], limit: int | None = None) -> list[QARecord]:
    """Read a QA file (a JSON list of ``{"ctxs": [{"title","text"}], "question", "answers"}``).

    Raises UsageError, with one line naming the problem, for a missing or
    unreadable file, invalid JSON, or records that do not follow the schema.
    """
    if limit is not None and limit < 1:
        raise UsageError(f"--limit must be at least 1, not {limit}")
    p = Path(path)
    raw = read_user_text(p, "dataset file")
    try:
        data = json.loads(raw)
    except json.JSONDecodeError as exc:
        raise UsageError(f"dataset {p} is not valid JSON (line {exc.lineno}: {exc.msg})") from None
    expected = 'a JSON list of {"ctxs": [{"title", "text"}, ...], "question", "answers"}'
    if not isinstance(data, list) or not data:
        raise UsageError(f"dataset {p} must be {expected}")
    records: list[QARecord] = []
    for i, item in enumerate(data[:limit] if limit else data):
        where = f"dataset {p}, record {i}"
        if not isinstance(item, dict):
            raise UsageError(f"{where} is not an object; expected {expected}")
        missing = [k for k in ("ctxs", "question", "answers") if k not in item]
        if missing:
            raise UsageError(f"{where} lacks {', '.join(repr(m) for m in missing)}; expected {expected}")
        question, answers, ctxs = item["question"], item["answers"], item["ctxs"]
        if not isinstance(question, str) or not question.strip():
            raise UsageError(f"{where}: 'question' must be a non-empty string")
        if isinstance(answers, str):
            answers = [answers]
        if not isinstance(answers, list) or not answers or not all(isinstance(a, str) for a in answers):
            raise UsageError(f"{where}: 'answers' must be a non-empty list of strings")
        if not isinstance(ctxs, list) or not ctxs:
            raise UsageError(f"{where}: 'ctxs' must be a non-empty list of passages")
        passages = []
        for j, c in enumerate(ctxs):
            if not isinstance(c, dict) or not isinstance(c.get("text"), str) or not isinstance(c.get("title", ""), str):
                raise UsageError(f"{where}: ctxs[{j}] must be an object with string 'title' and 'text'")
            if not c["text"].strip():
                raise UsageError(f"{where}: ctxs[{j}] has an empty 'text'")
            passages.append((c.get("title", "") or "", c["text"]))
        records.append(QARecord(question.strip(), passages, list(answers)))
    return records


def parse_modes(text: str | Sequence[str]) -> tuple[str, ...]:
    """'full,reuse,blend' → ('full', 'reuse', 'blend'); unknown or repeated modes are errors."""
    items = [m.strip() for m in (text.split(",") if isinstance(text, str) else text) if m.strip()]
    if not items:
        raise UsageError("--modes needs at least one mode")
    for m in items:
        if m not in MODES:
            raise UsageError(f"unknown mode {m!r} in --modes; choose from {', '.join(MODES)}")
    if len(set(items)) != len(items):
        raise UsageError("--modes lists a mode twice")
    return tuple(items)


def parse_ratios(text: str | Sequence[float]) -> tuple[float, ...]:
    """'0.05,0.15' → (0.05, 0.15); each in (0, 1]."""
    if isinstance(text, str):
        try:
            values = [float(x) for x in text.split(",") if x.strip()]
        except ValueError:
            raise UsageError(f"--ratios takes comma-separated numbers in (0, 1], not {text!r}") from None
    else:
        values = [float(x) for x in text]
    if not values:
        raise UsageError("--ratios needs at least one ratio")
    for r in values:
        check_ratio(r, "--ratios")
    return tuple(dict.fromkeys(values))


def check_ratio(r: float, flag: str) -> float:
    if math.isnan(r) or not 0.0 < r <= 1.0:
        raise UsageError(f"{flag}: a recompute ratio must be in (0, 1], not {r:g}")
    return r


# ───────────────────────────────── runs ─────────────────────────────────


@dataclass(frozen=True)
class RunSpec:
    """One way of answering: a mode, and for blend its ratio, deviation and check layers.

    `sink` says how the cached chunks were prefilled; `source` whether their KV
    streams from the archive (the engine's path) or is held in memory.
    """

    mode: str
    ratio: float | None = None
    deviation: str = BENCH_DEVIATION
    check_layers: tuple[int, ...] = BENCH_CHECK_LAYERS
    sink: str = "alone"
    source: str = "archive"

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise UsageError(f"mode must be one of {', '.join(MODES)}, not {self.mode!r}")
        if self.mode != "blend":  # the blend knobs do not apply: normalise so equal runs compare equal
            object.__setattr__(self, "ratio", None)
            object.__setattr__(self, "deviation", BENCH_DEVIATION)
            object.__setattr__(self, "check_layers", BENCH_CHECK_LAYERS)
        elif self.ratio is None:
            raise UsageError("a blend run needs a ratio")
        if self.deviation not in DEVIATIONS:
            raise UsageError(f"deviation must be one of {', '.join(DEVIATIONS)}")
        if self.sink not in SINK_POLICIES:
            raise UsageError(f"sink policy must be one of {', '.join(SINK_POLICIES)}")
        if self.source not in ("archive", "memory"):
            raise UsageError("source must be archive or memory")
        if self.sink != "alone" and self.source != "memory":
            raise UsageError("the archive stores chunks prefilled alone; other sink policies run in memory")

    @property
    def label(self) -> str:
        text = self.mode if self.ratio is None else f"{self.mode}@{self.ratio:g}"
        if self.mode == "blend" and (self.deviation != BENCH_DEVIATION or self.check_layers != BENCH_CHECK_LAYERS):
            text += f" dev={self.deviation} L={','.join(map(str, self.check_layers))}"
        if self.source == "memory":
            text += f" [{self.sink}, in memory]"
        return text


FULL = RunSpec("full")


@dataclass
class RunRecord:
    """One run on one record: what it answered and what it cost, scored against full at run time."""

    record: int
    spec: RunSpec
    answer: str
    golds: list[str]
    ttft_s: float
    recompute_share: float
    kl_vs_full: float
    answer_kl_vs_full: float
    prompt_tokens: int = 0


@dataclass
class BenchReport:
    model: str
    machine: str
    command: str
    date: str
    records: int
    results: list[dict]
    variants: list[dict] | None = None
    settings: dict = field(default_factory=dict)
    runs: list[RunRecord] = field(default_factory=list)  # per record × run, for scripts
    full_answers: dict[int, str] = field(default_factory=dict)
    questions: list[str] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)

    def per_record(self) -> list[dict]:
        """Every run's answer and numbers, record by record (for `--answers`, and eyeballing)."""
        rows = []
        for i, question in enumerate(self.questions):
            mine = [r for r in self.runs if r.record == i]
            rows.append({
                "record": i,
                "question": question,
                "gold": mine[0].golds if mine else [],
                "runs": [{
                    "run": r.spec.label, "mode": r.spec.mode, "ratio": r.spec.ratio, "answer": r.answer,
                    "f1": round(f1_score(r.answer, r.golds), 4), "kl_vs_full": round(r.kl_vs_full, 6),
                    "answer_kl_vs_full": round(r.answer_kl_vs_full, 6), "ttft_s": round(r.ttft_s, 4),
                    "recompute_share": round(r.recompute_share, 4),
                } for r in mine],
            })
        return rows

    def to_dict(self, answers: bool = False) -> dict:
        d = {
            "model": self.model,
            "machine": self.machine,
            "command": self.command,
            "date": self.date,
            "records": self.records,
            "settings": self.settings,
            "results": self.results,
        }
        if self.variants is not None:
            d["variants"] = self.variants
        if self.warnings:
            d["warnings"] = self.warnings
        if answers:
            d["per_record"] = self.per_record()
        return d


def main_specs(modes: Sequence[str], ratios: Sequence[float]) -> list[RunSpec]:
    """The runs of the main table: each mode, blend once per ratio; full always (it is the reference)."""
    specs = [FULL]
    for m in modes:
        if m == "blend":
            specs.extend(RunSpec("blend", r) for r in ratios)
        elif m != "full":
            specs.append(RunSpec(m))
    return specs


def variant_specs(ratio: float = DEFAULT_VARIANT_RATIO) -> list[tuple[str, str, RunSpec]]:
    """(group, name, spec) for the fusor-choice comparison, all at `ratio`."""
    rows: list[tuple[str, str, RunSpec]] = []
    for dev in DEVIATIONS:
        rows.append(("deviation", dev, RunSpec("blend", ratio, deviation=dev)))
    for layers in ((1,), (2,), (1, 2, 3)):
        name = ",".join(map(str, layers)) + (" (gradual)" if len(layers) > 1 else "")
        rows.append(("check_layers", name, RunSpec("blend", ratio, check_layers=layers)))
    for sink in SINK_POLICIES:
        rows.append(("sink", f"{sink} reuse", RunSpec("reuse", sink=sink, source="memory")))
        rows.append(("sink", f"{sink} blend@{ratio:g}", RunSpec("blend", ratio, sink=sink, source="memory")))
    return rows


def _mean(xs: Sequence[float]) -> float:
    return sum(xs) / len(xs) if xs else math.nan


def summarize_spec(runs: Sequence[RunRecord], full_answers: dict[int, str]) -> dict:
    """Aggregate one spec's runs: means over records, TTFT median and p90.

    F1 is against the gold answers (max over them); EM and ROUGE-L against
    full's own answer on the same record.
    """
    if not runs:
        raise ValueError("no runs to summarize")
    spec = runs[0].spec
    ttfts = [r.ttft_s for r in runs]
    return {
        "mode": spec.mode,
        "ratio": spec.ratio,
        "f1": _mean([f1_score(r.answer, r.golds) for r in runs]),
        "em_vs_full": _mean([exact_match(r.answer, full_answers[r.record]) for r in runs]),
        "rouge_l_vs_full": _mean([rouge_l(r.answer, full_answers[r.record]) for r in runs]),
        "kl_vs_full": _mean([r.kl_vs_full for r in runs]),
        "answer_kl_vs_full": _mean([r.answer_kl_vs_full for r in runs]),
        "ttft_median_s": percentile(ttfts, 50),
        "ttft_p90_s": percentile(ttfts, 90),
        "recompute_share": _mean([r.recompute_share for r in runs]),
    }


def summarize(runs: Sequence[RunRecord], full_answers: dict[int, str], specs: Sequence[RunSpec] | None = None) -> list[dict]:
    """One summary per spec (in `specs` order, else first-seen order)."""
    by_spec: dict[RunSpec, list[RunRecord]] = {}
    for r in runs:
        by_spec.setdefault(r.spec, []).append(r)
    order = list(specs) if specs is not None else list(by_spec)
    return [summarize_spec(by_spec[s], full_answers) for s in order if s in by_spec]


def _rounded(d: dict, digits: int = 6) -> dict:
    return {k: (round(v, digits) if isinstance(v, float) and math.isfinite(v) else v) for k, v in d.items()}


# ───────────────────────────────── machine ─────────────────────────────────


def describe_machine(runner=None) -> str:
    """One line: host, CPU, cores, memory, the compute device, torch."""
    cpu = platform.processor() or platform.machine() or "cpu"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    mem = ""
    try:
        kb = int(Path("/proc/meminfo").read_text().split()[1])
        mem = f", {kb / 2**20:.0f} GiB RAM"
    except (OSError, ValueError, IndexError):
        pass
    compute = ""
    if runner is not None:
        dev = runner.device
        name = torch.cuda.get_device_name(dev) if dev.type == "cuda" else "CPU"
        compute = f", compute {dev.type} ({name}, {str(runner.dtype).replace('torch.', '')})"
    try:
        load = ", load %.2f" % os.getloadavg()[0]
    except OSError:
        load = ""
    return f"{socket.gethostname()}: {cpu}, {os.cpu_count()} cores{mem}{compute}, torch {torch.__version__}{load}"


# ───────────────────────────────── the runner ─────────────────────────────────

ProgressFn = Callable[[int, int, str], None]


class _RecordRunner:
    """Runs the specs of one record against full's reference."""

    def __init__(self, engine, template: PromptTemplate, max_new_tokens: int, answer_kl_tokens: int, chunks: int):
        self.engine = engine
        self.runner = engine.runner
        self.template = template
        self.sampling = SamplingConfig(max_new_tokens=max_new_tokens)
        self.answer_kl_tokens = answer_kl_tokens
        self.chunks = chunks
        self.warnings: list[str] = []  # the engine's (e.g. a blob recomputed): they change what was measured

    def store(self, record: QARecord) -> list[str]:
        """Archive the record's passages; the keys, in passage order."""
        texts = record.passage_texts(self.chunks)
        stored = self.engine.store_texts(texts)
        if len(stored) != len(texts) or any(s is None for s in stored):
            raise RuntimeError("store_texts did not return a segment for every passage")
        return [s.key for s in stored]

    def options(self, spec: RunSpec, keys: list[str]):
        from kvblend.engine import QueryOptions

        return QueryOptions(
            mode=spec.mode,
            ratio=spec.ratio,
            check_layers=spec.check_layers if spec.mode == "blend" else None,
            deviation=spec.deviation,
            segment_keys=list(keys),
            template=self.template,
            sampling=self.sampling,
        )

    def forced_logits(self, fusion, tokens: list[int]) -> torch.Tensor | None:
        """Teacher-force `tokens` from a fused KV; the logits before each one ([n, vocab])."""
        if not tokens:
            return None
        gen = generate(self.runner, fusion, SamplingConfig(max_new_tokens=len(tokens)),
                       keep_logits=True, forced_tokens=list(tokens))
        return torch.stack(gen.step_logits)

    def answer(self, question: str, spec: RunSpec, keys: list[str], memory_kv: Callable[[str], list[Segment]]):
        """(answer, token ids, fusion, ttft_s, recompute_share, prompt_tokens) of one free-running run."""
        if spec.source == "archive":
            res = self.engine.query(question, self.options(spec, keys))
            self.warnings.extend(f"{spec.label}: {w}" for w in res.warnings)
            return res.answer, res.generation.token_ids, res.fusion, res.ttft_s, res.recompute_share, res.prompt_tokens
        passages = memory_kv(spec.sink)  # prefilled before the record's timed runs
        cfg, _ = self.engine.blend_config(self.options(spec, keys)) if spec.mode == "blend" else (None, None)
        t0 = time.perf_counter()
        prompt = assemble_prompt(self.runner, self.template, question, list(passages))
        fused = fuse(self.runner, prompt, spec.mode, cfg)
        t1 = time.perf_counter()
        gen = generate(self.runner, fused, self.sampling)
        ttft = (t1 - t0) + gen.first_token_s
        return gen.text, gen.token_ids, fused, ttft, fused.recompute_share, len(fused.token_ids)

    def run(self, index: int, record: QARecord, specs: Sequence[RunSpec], on_run: Callable[[RunSpec], None]) -> tuple[str, list[RunRecord]]:
        """All `specs` on one record, in an order rotated by `index`; scored against full's run."""
        keys = self.store(record)
        # Untimed set-up first, so the timed runs of a record follow each other.
        memory = {s.sink: self.memory_segments(record, s.sink) for s in specs if s.source == "memory"}
        order = list(dict.fromkeys([FULL, *specs]))
        shift = index % len(order)
        order = order[shift:] + order[:shift]

        ref: dict = {}
        pending: list[tuple] = []  # runs finished before full's: scored once the reference exists
        out: list[RunRecord] = []

        def score(spec, answer, fused, ttft, share, n, steps=None) -> RunRecord:
            if list(fused.token_ids) != ref["ids"]:
                raise RuntimeError(f"{spec.label} ran on a different prompt than full ({n} vs {len(ref['ids'])} tokens)")
            kl = kl_divergence(ref["first"], fused.last_logits.detach().float().cpu())
            if ref["steps"] is None:  # full stopped at once: the first position is its whole answer
                answer_kl = kl
            else:
                answer_kl = mean_token_kl(ref["steps"], steps if steps is not None else self.forced_logits(fused, ref["forced"]))
            return RunRecord(index, spec, answer, list(record.answers), ttft, share, kl, answer_kl, n)

        for spec in order:
            answer, tokens, fused, ttft, share, n = self.answer(record.question, spec, keys, memory.get)
            if spec == FULL:
                ref["forced"] = list(tokens[: self.answer_kl_tokens])
                ref["first"] = fused.last_logits.detach().float().cpu()
                ref["steps"] = self.forced_logits(fused, ref["forced"])
                ref["ids"] = list(fused.token_ids)
                ref["answer"] = answer
                out.append(score(spec, answer, fused, ttft, share, n, steps=ref["steps"]))  # 0 by construction
                for item in pending:
                    out.append(score(*item))
                pending.clear()
            elif ref:
                out.append(score(spec, answer, fused, ttft, share, n))
            else:
                pending.append((spec, answer, fused, ttft, share, n))  # keeps its fused KV until full has run
            del fused
            on_run(spec)
        out.sort(key=lambda r: order.index(r.spec))
        return ref["answer"], out

    def memory_segments(self, record: QARecord, sink: str) -> list[Segment]:
        """The record's passages with KV prefilled under `sink`, like the archive stores it (fp16/bf16, CPU)."""
        from kvblend.precompute import precompute_kv
        from kvblend.prompt import split_template

        ids = [self.runner.tokenize(segment_text_for_kv(t)) for t in record.passage_texts(self.chunks)]
        prefix: list[int] = []
        if sink == "shared-prefix":
            before, _ = split_template(self.runner, self.template, record.question)
            prefix = self.runner.tokenize(before)  # the prompt's instruction prefix: fixed across records
        kvs = precompute_kv(self.runner, ids, sink_prefix=prefix or None)
        return [Segment(i, kv=kv, base_position=len(prefix), key=f"{sink}:{n}") for n, (i, kv) in enumerate(zip(ids, kvs))]


def _warm_up(engine, record: QARecord, template: PromptTemplate) -> None:
    """Untimed: load model and embedder, and run the archive path once on a one-passage prompt."""
    from kvblend.engine import QueryOptions

    engine.warm_up()
    keys = [s.key for s in engine.store_texts(record.passage_texts(1))]
    for mode in ("full", "blend"):
        engine.query(record.question, QueryOptions(mode=mode, ratio=0.15 if mode == "blend" else None,
                                                   segment_keys=keys, template=template,
                                                   sampling=SamplingConfig(max_new_tokens=2)))


def run_bench(
    engine,
    records: Sequence[QARecord],
    modes: Sequence[str] = DEFAULT_MODES,
    ratios: Sequence[float] = DEFAULT_RATIOS,
    *,
    chunks: int = DEFAULT_CHUNKS,
    max_new_tokens: int = DEFAULT_MAX_NEW_TOKENS,
    answer_kl_tokens: int = ANSWER_KL_TOKENS,
    variants: bool = False,
    variant_ratio: float = DEFAULT_VARIANT_RATIO,
    main: bool = True,
    template: PromptTemplate = MUSIQUE_TEMPLATE,
    command: str = "",
    on_progress: ProgressFn | None = None,
    warm_up: bool = True,
) -> BenchReport:
    """Answer every record with every mode (and blend ratio) through `engine`; aggregate.

    With `variants`, the fusor-choice comparison runs in the same pass (sharing
    full's reference and identical runs); with ``main=False`` only the variants.
    See the module docstring for the scheme.
    """
    if not records:
        raise UsageError("no records to benchmark")
    if chunks < 1:
        raise UsageError(f"--chunks must be at least 1, not {chunks}")
    if max_new_tokens < 1:
        raise UsageError("--max-tokens must be at least 1")
    if answer_kl_tokens < 1:
        raise UsageError("answer KL needs at least one token")
    modes = parse_modes(modes)
    ratios = parse_ratios(ratios) if "blend" in modes else ()
    check_ratio(variant_ratio, "--variant-ratio")
    mains = main_specs(modes, ratios) if main else [FULL]
    vrows = variant_specs(variant_ratio) if variants else []
    specs = list(dict.fromkeys([*mains, *(s for _, _, s in vrows)]))
    if any(s.mode == "blend" for s in specs):  # fail before any work on a bad check layer
        for s in specs:
            if s.mode == "blend":
                engine.blend_config(_RecordRunner(engine, template, 1, 1, chunks).options(s, []))

    if warm_up:
        _warm_up(engine, records[0], template)
    rr = _RecordRunner(engine, template, max_new_tokens, answer_kl_tokens, chunks)
    total = len(records) * len(specs)
    done = 0
    runs: list[RunRecord] = []
    full_answers: dict[int, str] = {}
    for i, record in enumerate(records):

        def on_run(spec: RunSpec, i=i) -> None:
            nonlocal done
            done += 1
            if on_progress:
                on_progress(done, total, f"record {i + 1}/{len(records)} {spec.label}")

        before = len(rr.warnings)
        full_answers[i], rec_runs = rr.run(i, record, specs, on_run)
        rr.warnings[before:] = [f"record {i}, {w}" for w in rr.warnings[before:]]
        runs.extend(rec_runs)

    results = [_rounded(d) for d in summarize(runs, full_answers, mains)] if main else []
    variant_out = None
    if variants:
        by_spec = {s: d for s, d in zip(specs, summarize(runs, full_answers, specs))}
        variant_out = []
        for group, name, spec in vrows:
            row = {"group": group, "name": name, "deviation": spec.deviation if spec.mode == "blend" else None,
                   "check_layers": list(spec.check_layers) if spec.mode == "blend" else None,
                   "sink": spec.sink, "kv_source": spec.source}
            variant_out.append(_rounded({**row, **by_spec[spec]}))
    settings = {
        "chunks": chunks,
        "template": "musique" if template == MUSIQUE_TEMPLATE else "custom",
        "max_new_tokens": max_new_tokens,
        "decoding": "greedy",
        "answer_kl_tokens": answer_kl_tokens,
        "modes": list(modes),
        "ratios": list(ratios),
        "variant_ratio": variant_ratio if variants else None,
        "archive": str(engine.archive_path),
        "compute": engine.runner.device.type,
        "dtype": str(engine.runner.dtype).replace("torch.", ""),
        "mean_prompt_tokens": round(_mean([r.prompt_tokens for r in runs if r.spec == FULL]), 1),
    }
    return BenchReport(
        model=engine.model_name,
        machine=describe_machine(engine.runner),
        command=command,
        date=_dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        records=len(records),
        results=results,
        variants=variant_out,
        settings=settings,
        runs=runs,
        full_answers=full_answers,
        questions=[r.question for r in records],
        warnings=list(rr.warnings),
    )


def run_variants(engine, records: Sequence[QARecord], ratio: float = DEFAULT_VARIANT_RATIO, **kwargs) -> BenchReport:
    """Only the fusor-choice comparison (deviation, check layers, sink policy) at `ratio`."""
    return run_bench(engine, records, modes=("full",), ratios=(), variants=True, variant_ratio=ratio, main=False, **kwargs)


# ───────────────────────────────── plot ─────────────────────────────────


def check_plot_available() -> None:
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        raise UsageError("--plot needs matplotlib: pip install 'kvblend[plot]' (or pip install matplotlib)") from None


# mode → (color, marker, filled, size): prefix hollow and larger, so it shows around full when they coincide
_STYLE = {"full": ("black", "s", True, 7), "prefix": ("tab:gray", "D", False, 12),
          "reuse": ("tab:red", "v", True, 9), "blend": ("tab:blue", "o", True, 8)}


def plot_report(report: BenchReport | dict, path: str | os.PathLike[str]) -> Path:
    """Quality vs TTFT (the paper's Fig. 12/16 shape): F1 and answer KL against median TTFT, per mode."""
    check_plot_available()
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    data = report.to_dict() if isinstance(report, BenchReport) else report
    results = [r for r in data["results"] if r.get("ttft_median_s") is not None]
    n_tok = data.get("settings", {}).get("answer_kl_tokens", ANSWER_KL_TOKENS)
    fig = Figure(figsize=(11, 4.8), dpi=150)
    FigureCanvasAgg(fig)
    axes = fig.subplots(1, 2)
    panels = [("f1", "F1 vs gold answers (mean)", "answer quality: higher is better"),
              ("answer_kl_vs_full", f"answer KL from full (nats, mean over ≤{n_tok} tokens)",
               "divergence from full: lower is better")]
    x_max = max((r["ttft_median_s"] for r in results), default=1.0) or 1.0
    for ax, (key, ylabel, title) in zip(axes, panels):
        for mode in ("full", "prefix", "reuse", "blend"):
            rows = sorted((r for r in results if r["mode"] == mode), key=lambda r: r["ttft_median_s"])
            if not rows:
                continue
            color, marker, filled, size = _STYLE[mode]
            xs = [r["ttft_median_s"] for r in rows]
            ys = [r[key] for r in rows]
            label = mode if mode != "blend" else "blend (recompute ratio r)"
            ax.plot(xs, ys, marker=marker, color=color, linestyle="-" if len(rows) > 1 else "none",
                    markersize=size, markerfacecolor=color if filled else "none", markeredgewidth=1.5,
                    label=label, zorder=3 if filled else 2, clip_on=False)
            if mode == "blend":
                for j, r in enumerate(rows):  # alternate above/below so neighbouring labels do not collide
                    ax.annotate(f"r={r['ratio']:g}", (r["ttft_median_s"], r[key]), textcoords="offset points",
                                xytext=(4, 8 if j % 2 == 0 else -14), fontsize=8, color=color)
        ax.set_xlabel("TTFT, median over records (s)")
        ax.set_ylabel(ylabel)
        ax.set_title(title, fontsize=9, color="dimgray")
        ax.grid(True, alpha=0.3)
        ax.set_xlim(0, x_max * 1.1)
        if key == "f1":
            ax.set_ylim(-0.08, 1.04)
        else:
            top = max((r[key] for r in results if math.isfinite(r[key])), default=0.0)
            top = top * 1.15 if top > 0 else 1.0
            ax.set_ylim(-0.04 * top, top)
        ax.legend(fontsize=8, loc="best")
    fig.suptitle(f"{data['model']}: quality vs time to first token ({data['records']} records)", fontsize=11)
    fig.text(0.5, 0.008, data.get("machine", ""), ha="center", fontsize=6.5, color="dimgray")
    fig.tight_layout(rect=(0, 0.03, 1, 0.96))
    out = Path(path)
    fig.savefig(out)
    return out


# ───────────────────────────────── markdown (BENCHMARKS.md) ─────────────────────────────────


def _md_num(x, digits: int = 3) -> str:
    return "—" if x is None or (isinstance(x, float) and not math.isfinite(x)) else f"{x:.{digits}f}"


def _md_table(headers: list[str], rows: list[list[str]], numeric_from: int) -> str:
    align = ["---" if i < numeric_from else "---:" for i in range(len(headers))]
    lines = ["| " + " | ".join(headers) + " |", "| " + " | ".join(align) + " |"]
    lines += ["| " + " | ".join(r) + " |" for r in rows]
    return "\n".join(lines)


def _md_settings(data: dict) -> str:
    s = data.get("settings", {})
    return (
        f"{data.get('records', '?')} records × {s.get('chunks', '?')} passages "
        f"(~{s.get('mean_prompt_tokens', 0):.0f} prompt tokens), {data.get('model', '?')}, "
        f"compute {s.get('compute', '?')}/{s.get('dtype', '?')}; greedy, ≤{s.get('max_new_tokens', '?')} new tokens, "
        f"same prompt token ids for every mode; modes interleaved per record."
    )


def markdown_results(data: dict) -> str:
    """The main table of a `kvblend bench --json` report, as markdown (used by scripts/bench_all.py)."""
    rows_in = data.get("results") or []
    if not rows_in:
        return "(no results)"
    full = next((r for r in rows_in if r["mode"] == "full"), None)
    rows = []
    for r in rows_in:
        speed = (full["ttft_median_s"] / r["ttft_median_s"]) if full and r["ttft_median_s"] else None
        rows.append([
            r["mode"], "—" if r["ratio"] is None else f"{r['ratio']:g}", _md_num(r["f1"]), _md_num(r["em_vs_full"]),
            _md_num(r["rouge_l_vs_full"]), _md_num(r["kl_vs_full"], 4), _md_num(r["answer_kl_vs_full"], 4),
            _md_num(r["ttft_median_s"]), _md_num(r["ttft_p90_s"]), "—" if speed is None else f"{speed:.2f}×",
            f"{r['recompute_share']:.1%}",
        ])
    n_tok = data.get("settings", {}).get("answer_kl_tokens", ANSWER_KL_TOKENS)
    return "\n".join([
        _md_settings(data),
        "",
        _md_table(["mode", "ratio", "F1 (gold)", "EM vs full", "ROUGE-L vs full", "KL 1st token", "answer KL",
                   "TTFT p50 (s)", "TTFT p90 (s)", "speed-up vs full (p50)", "recompute share"], rows, 2),
        "",
        "F1: SQuAD token F1 against the gold answers (max over them). EM / ROUGE-L vs full: agreement with "
        "full's own answer on the same record. KL (nats) from full's distribution: of the first token, and "
        f"averaged over full's first ≤{n_tok} answer tokens fed to every mode (teacher forcing on the same fused KV). "
        "TTFT: KV streamed from the on-disk archive + fusion + first token; model load excluded. "
        "Recompute share: token-layers computed / prompt tokens × layers.",
    ])


def markdown_variants(data: dict) -> str:
    """The fusor-variant table of a `kvblend bench --variants --json` report, as markdown."""
    rows_in = data.get("variants") or []
    if not rows_in:
        return "(no variants)"
    rows, last = [], None
    for r in rows_in:
        rows.append([
            r["group"] if r["group"] != last else "", r["name"], r["mode"], _md_num(r["f1"]), _md_num(r["em_vs_full"]),
            _md_num(r["rouge_l_vs_full"]), _md_num(r["kl_vs_full"], 4), _md_num(r["answer_kl_vs_full"], 4), _md_num(r["ttft_median_s"]),
            f"{r['recompute_share']:.1%}", r.get("kv_source", ""),
        ])
        last = r["group"]
    ratio = data.get("settings", {}).get("variant_ratio")
    return "\n".join([
        _md_settings(data) + (f" Blend at ratio {ratio:g}." if ratio is not None else ""),
        "",
        _md_table(["group", "variant", "mode", "F1 (gold)", "EM vs full", "ROUGE-L vs full", "KL 1st token", "answer KL",
                   "TTFT p50 (s)", "recompute share", "KV from"], rows, 3),
        "",
        "deviation: HKVD scored on K, V, or both (each normalised by its mean). check_layers: where tokens are "
        "selected (1,2,3 = gradual filtering, ratios shrinking to the target). sink: chunks prefilled alone (what the "
        "archive stores) vs after the prompt's shared instruction prefix (its KV dropped); these rows hold the KV in "
        "memory, so their TTFTs compare with each other only." + (f" Note: {data['note']}." if data.get("note") else ""),
    ])
