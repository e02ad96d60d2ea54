"""`kvblend bench`'s workflow: every mode (and variant) on every record through the harness, then aggregated.

Each spec runs once per record (identical configurations asked for under
several names share their run), after one untimed warm-up query per mode
family on a one-passage prompt; TTFT excludes model load. Variants
(deviation k / v / kv, check layer 1 / 2 / gradual 1,2,3, and the sink policy
in memory) run in the same pass, sharing full's reference.
"""

from __future__ import annotations

import dataclasses
import datetime as dt
from collections.abc import Sequence

from kvblend.defaults import DEFAULT_CODEC, DEFAULT_RATIO, DEFAULT_SELECT
from kvblend.errors import UsageError
from kvblend.evaluation.harness import ProgressFn, RecordRunner, blend_config
from kvblend.evaluation.records import (
    ANSWER_KL_TOKENS,
    DEFAULT_BENCH_MAX_NEW_TOKENS,
    DEFAULT_BENCH_MODES,
    DEFAULT_BENCH_RATIOS,
    DEFAULT_CHUNKS,
    DEFAULT_VARIANT_RATIO,
    PARETO_RATIOS,
    QARecord,
    parse_codecs,
    parse_modes,
    parse_ratios,
)
from kvblend.evaluation.specs import FULL, RunRecord, RunSpec, main_specs, variant_specs
from kvblend.evaluation.summary import BenchReport, mean, rounded, summarize
from kvblend.generation import SamplingConfig
from kvblend.machine import describe_machine
from kvblend.options import NAMED_TEMPLATES, QueryOptions, check_ratio
from kvblend.prompt import MUSIQUE_TEMPLATE, PromptTemplate


def _warm_up(engine, record: QARecord, template: PromptTemplate, codecs: Sequence[str] = (DEFAULT_CODEC,)) -> None:
    """Untimed: load model and embedder, and run the archive path once on a one-passage prompt
    (blend once per codec, so no codec's first run pays for first-use set-up)."""
    engine.warm_up()
    for i, codec in enumerate(dict.fromkeys([DEFAULT_CODEC, *codecs])):
        keys = [s.key for s in engine.store_texts(record.passage_texts(1), codec=codec)]
        for mode in ("full", "blend") if i == 0 else ("blend",):
            engine.query(
                record.question,
                QueryOptions(
                    mode=mode,
                    ratio=DEFAULT_RATIO if mode == "blend" else None,
                    segment_keys=keys,
                    template=template,
                    sampling=SamplingConfig(max_new_tokens=2),
                ),
            )


def record_sources(record: QARecord, chunks: int) -> list[dict]:
    """The passages a record's prompts hold (its first `chunks`), as a query reports where its segments came
    from: the QA file names each passage's document by its title; a passage has no pages or section."""
    unknown = {"pages": None, "section": None, "sections": None, "rows": None}
    return [{"document": title or None, **unknown} for title, _ in record.passages[:chunks]]


def _check_settings(chunks: int, max_new_tokens: int, answer_kl_tokens: int, variant_ratio: float) -> None:
    if chunks < 1:
        raise UsageError(f"--chunks must be at least 1, not {chunks}")
    if max_new_tokens < 1:
        raise UsageError("--max-tokens must be at least 1")
    if answer_kl_tokens < 1:
        raise UsageError("answer KL needs at least one token")
    check_ratio(variant_ratio, "--variant-ratio")


def _variant_rows(
    vrows: list[tuple[str, str, RunSpec]], runs: list[RunRecord], full_answers: dict[int, str], archive_sink: str
) -> list[dict]:
    unique = list(dict.fromkeys(s for _, _, s in vrows))  # a spec named twice ran (and is summarised) once
    by_spec = dict(zip(unique, summarize(runs, full_answers, unique)))
    rows = []
    for group, name, spec in vrows:
        blend = spec.mode == "blend"
        row = {
            "group": group,
            "name": name,
            "deviation": spec.deviation if blend else None,
            "check_layers": list(spec.check_layers) if blend else None,
            # the sink the passages were prefilled after: the archive's (bench's --sink) where they came from it
            "sink": archive_sink if spec.source == "archive" else spec.sink,
            "kv_source": spec.source,
        }
        rows.append(rounded({**row, **by_spec[spec]}))
    return rows


def template_name(template: PromptTemplate) -> str:
    """What a report calls the prompt template: musique, default, or the one of them with another system prompt."""
    for name, known in NAMED_TEMPLATES.items():
        if template == known:
            return name
        if dataclasses.replace(template, system=known.system) == known:
            return f"{name} + --system"
    return "custom"


def run_bench(
    engine,
    records: Sequence[QARecord],
    modes: Sequence[str] = DEFAULT_BENCH_MODES,
    ratios: Sequence[float] = DEFAULT_BENCH_RATIOS,
    *,
    chunks: int = DEFAULT_CHUNKS,
    max_new_tokens: int = DEFAULT_BENCH_MAX_NEW_TOKENS,
    answer_kl_tokens: int = ANSWER_KL_TOKENS,
    variants: bool = False,
    variant_ratio: float = DEFAULT_VARIANT_RATIO,
    main: bool = True,
    template: PromptTemplate = MUSIQUE_TEMPLATE,
    command: str = "",
    on_progress: ProgressFn | None = None,
    warm_up: bool = True,
    codecs: Sequence[str] = (DEFAULT_CODEC,),
    select: str = DEFAULT_SELECT,
    pareto: bool = False,
    pareto_ratios: Sequence[float] = PARETO_RATIOS,
    first_record: int = 0,
) -> BenchReport:
    """Answer every record with every mode (and blend ratio) through `engine`; aggregate.

    With `variants`, the fusor-choice comparison runs in the same pass; with
    ``main=False`` only the variants (full still runs: it is the reference).
    ``codecs``: reuse and blend run once per codec on the same records (each
    codec's passages archived under their own keys); full runs once. With
    ``pareto``, every selection policy's ratio sweep (kvblend.evaluation.pareto)
    runs after, on the same records, into the report's ``pareto`` (over ``pareto_ratios``).
    ``first_record``: the number of ``records[0]`` in its dataset (``--offset``), which names records in
    warnings and per-record output.
    """
    if not records:
        raise UsageError("no records to benchmark")
    _check_settings(chunks, max_new_tokens, answer_kl_tokens, variant_ratio)
    modes = parse_modes(modes)
    ratios = parse_ratios(ratios) if "blend" in modes else ()
    codecs = parse_codecs(codecs)
    mains = main_specs(modes, ratios, codecs, select) if main else [FULL]
    vrows = variant_specs(variant_ratio) if variants else []
    specs = list(dict.fromkeys([*mains, *(s for _, _, s in vrows)]))
    for s in specs:  # fail before any work on a bad check layer
        if s.mode == "blend":
            blend_config(s, engine.runner.n_layers)
    if warm_up:
        _warm_up(engine, records[0], template, codecs)

    rr = RecordRunner(engine.runner, template, max_new_tokens, answer_kl_tokens, chunks, engine=engine)
    total, done = len(records) * len(specs), 0
    runs: list[RunRecord] = []
    full_answers: dict[int, str] = {}
    for i, record in enumerate(records):

        def on_run(spec: RunSpec, i: int = i) -> None:
            nonlocal done
            done += 1
            if on_progress:
                on_progress(done, total, f"record {i + 1}/{len(records)} {spec.label}")

        before = len(rr.warnings)
        reference, rec_runs = rr.run(i, record, specs, on_run)
        full_answers[i] = reference.answer
        rr.warnings[before:] = [f"record {first_record + i}, {w}" for w in rr.warnings[before:]]
        runs.extend(rec_runs)

    settings = {
        "chunks": chunks,
        "template": template_name(template),
        "system": template.system,
        "sink": str(engine.sink),
        "max_new_tokens": max_new_tokens,
        "decoding": "greedy",
        "answer_kl_tokens": min(answer_kl_tokens, max_new_tokens),  # the positions it is taken over
        "modes": list(modes),
        "ratios": list(ratios),
        "codecs": list(codecs),
        "variant_ratio": variant_ratio if variants else None,
        "select": select,
        "archive": str(engine.location),
        "compute": engine.runner.device.type,
        "dtype": engine.runner.dtype_name,
        "weights": engine.runner.weights_name,
        # what a codec's bytes/token compares with: K and V of every layer in fp16
        "raw_bytes_per_token": 2 * 2 * engine.runner.n_layers * engine.runner.n_kv_heads * engine.runner.head_dim,
        "mean_prompt_tokens": round(mean([r.prompt_tokens for r in runs if r.spec == FULL]), 1),
        "mean_passages": round(mean([len(r.passages[:chunks]) for r in records]), 1),  # records may hold fewer
    }
    sweep = None
    if pareto:
        from kvblend.evaluation.pareto import run_pareto

        sweep = run_pareto(
            engine,
            records,
            ratios=parse_ratios(pareto_ratios, "--pareto-ratios"),
            chunks=chunks,
            template=template,
            on_progress=on_progress,
        )
    return BenchReport(
        pareto=sweep,
        model=engine.model_name,
        machine=describe_machine(engine.runner),
        command=command,
        date=dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
        records=len(records),
        results=[rounded(d) for d in summarize(runs, full_answers, mains)] if main else [],
        variants=_variant_rows(vrows, runs, full_answers, str(engine.sink)) if variants else None,
        settings=settings,
        runs=runs,
        full_answers=full_answers,
        questions=[r.question for r in records],
        sources=[record_sources(r, chunks) for r in records],
        first_record=first_record,
        warnings=list(rr.warnings),
    )


def run_variants(engine, records: Sequence[QARecord], ratio: float = DEFAULT_VARIANT_RATIO, **kwargs) -> BenchReport:
    """Only the fusor-choice comparison (deviation, check layers, sink policy) at `ratio`."""
    return run_bench(
        engine, records, modes=("full",), ratios=(), variants=True, variant_ratio=ratio, main=False, **kwargs
    )
