"""`kvblend tune`: pick the ratio ``r = max(r_quality, r_hide)`` for this archive's storage, and the storage.

The workflow (:func:`run_tune`): find the profile of the archive's own location
on this machine, pick the context length to tune for, measure (or take) the
quality floor, decide the ratio from the delay model, price the profiled
storage, and store the result as a :class:`TunedSetting` under
:func:`~kvblend.archive.records.tuned_key`, where `kvblend query` finds it.
The CLI only parses options and renders the :class:`TuneResult`.
"""

from __future__ import annotations

import math
import os
import time
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

from kvblend.archive import Archive, resolve_location
from kvblend.archive.records import TUNED_VERSION, TunedRatio, location_key, tuned_key
from kvblend.defaults import DEFAULT_CHUNK_TOKENS, DEFAULT_RATIO, DEFAULT_SELECT, DEFAULT_TOP_K
from kvblend.errors import CorruptBlobError, UsageError
from kvblend.evaluation.records import QARecord
from kvblend.machine import machine_info
from kvblend.model.source import resolve_model_source, source_fingerprint
from kvblend.options import Select, choice
from kvblend.tuning.archive_prompts import archive_calibration
from kvblend.tuning.codecs import CodecDecision, choose_codec
from kvblend.tuning.delay import (
    DEFAULT_CALIBRATION_LIMIT,
    DEFAULT_KL_BOUND,
    DEFAULT_TOLERANCE,
    DEFAULT_TUNE_RATIOS,
    LayerTiming,
    choose_ratio,
    hide_ratio,
    quality_floor,
    ratio_table,
    recompute_time,
)
from kvblend.tuning.jsonable import check_version, from_fields
from kvblend.tuning.profile import (
    Profile,
    applicable_profiles,
    busy_warning,
    location_profile,
    readable_profiles,
    today,
)
from kvblend.tuning.quality import ArchivedPassage, Log, QualitySweep, load_calibration, measure_quality
from kvblend.tuning.storage import (
    DEFAULT_STORAGE_COSTS,
    StorageDecision,
    cheapest_storage,
    parse_costs,
)
from kvblend.types import Segment

#: Context lengths in the per-length table `tune` prints (plus the one tuned for).
TABLE_LENGTHS = (512, 1024, 2048, 3072, 4096, 8192)


# ───────────────────────────────── the decision ─────────────────────────────────


@dataclass
class TuneDecision:
    ratio: float
    r_quality: float
    r_quality_source: str  # calibration, given, fallback
    r_hide: float
    L: int
    L_source: str
    t_load_s: float
    t_full_layer_s: float
    t_recompute_s: float  # at the chosen ratio
    table: list[LayerTiming]
    profile: str | None
    notes: list[str] = field(default_factory=list)

    @property
    def bottleneck(self) -> str:
        return "loading" if self.t_load_s > self.t_recompute_s else "recompute"


def _decision_notes(r_hide: float, ratio: float, r_quality: float) -> list[str]:
    notes = []
    if r_hide >= 1.0:
        notes.append(
            "loading one layer takes longer than recomputing it in full: blending from this storage "
            "is slower than `--mode full`; move the archive to faster storage"
        )
    elif ratio >= 1.0:
        notes.append(
            "ratio 1.0 recomputes every token: blend is then exactly `--mode full`, reading no KV and saving nothing"
        )
    if ratio > r_quality + 1e-12:
        notes.append(
            f"loading hides recompute up to r = {r_hide:.3f}, so the extra recompute above the quality "
            f"floor {r_quality:g} is free"
        )
    else:
        notes.append(
            f"loading hides only r = {r_hide:.3f}: the quality floor {r_quality:g} sets the ratio and "
            "recompute, not loading, sets the pace"
        )
    return notes


def decide(
    profile: Profile,
    r_quality: float,
    L: int,
    lengths: Sequence[int] = TABLE_LENGTHS,
    r_quality_source: str = "calibration",
    L_source: str = "",
) -> TuneDecision:
    """r = max(r_quality, r_hide(L)) from a location's profile, with the per-length table behind it."""
    model, load = profile.cost_model, profile.load_model()
    t_load, full = load.time(L), model.cost(L)
    r_hide = hide_ratio(t_load, full)
    ratio = choose_ratio(r_quality, r_hide)
    table = ratio_table(load, model, sorted({*lengths, L}), ratio)
    return TuneDecision(
        ratio,
        r_quality,
        r_quality_source,
        r_hide,
        int(L),
        L_source,
        t_load,
        full,
        recompute_time(ratio, L, model),
        table,
        profile.name,
        _decision_notes(r_hide, ratio, r_quality),
    )


# ───────────────────────────────── what is stored ─────────────────────────────────


@dataclass
class ModelRef:
    name: str
    fingerprint: str | None


@dataclass
class TunedSetting:
    """What `tune` stores for (model, compute, archive location); `query` reads ``ratio``."""

    ratio: float
    r_quality: float
    r_quality_source: str
    r_hide: float
    L: int
    L_source: str
    t_load_s: float
    t_recompute_s: float
    bottleneck: str
    table: list[LayerTiming]
    date: str
    created: float
    profile: str | None
    model: ModelRef
    compute: str
    archive: str
    tolerance: float
    kl_bound: float  # as a fraction of reuse's KL
    quality: QualitySweep | None
    storage: StorageDecision
    archive_bytes: int | None
    notes: list[str] = field(default_factory=list)
    codec: CodecDecision | None = None  # the archive's codec, and a smaller one if storage sets the pace
    # the selection policy the quality floor was measured for; a query with another policy does not take
    # this ratio (settings stored before policies existed were measured with hkvd)
    select: str = "hkvd"
    calibration: str = ""  # where the calibration prompts came from (CalibrationSet.source)

    def to_dict(self) -> dict[str, Any]:
        d = {"version": TUNED_VERSION, **asdict(self)}
        d["quality"] = self.quality.to_dict() if self.quality else None  # ratio keys as strings
        return d

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> TunedSetting:
        check_version(d, TUNED_VERSION, "tuned setting")
        if TunedRatio.from_stored(d) is None:
            raise UsageError(f"tuned setting has no usable ratio: {d.get('ratio')!r}")
        return from_fields(
            cls,
            {
                **d,
                "table": [LayerTiming.from_dict(r) for r in d.get("table", [])],
                "model": from_fields(ModelRef, d.get("model") or {}),
                "quality": QualitySweep.from_dict(d["quality"]) if d.get("quality") else None,
                "storage": StorageDecision.from_dict(d.get("storage") or {}),
                "codec": CodecDecision.from_dict(d["codec"]) if d.get("codec") else None,
            },
        )


# ───────────────────────────────── the workflow ─────────────────────────────────


@dataclass(frozen=True)
class TuneRequest:
    """`kvblend tune`'s options, parsed; :meth:`check` rejects bad values before any work."""

    archive: str | os.PathLike[str] | None = None
    model: str | None = None
    compute: str | None = None
    # None: prompts from the archive's own passages (the bundled set when it has none); BUNDLED: the bundled set
    calibration: str | os.PathLike[str] | None = None
    limit: int = DEFAULT_CALIBRATION_LIMIT
    tolerance: float = DEFAULT_TOLERANCE
    kl_bound: float = DEFAULT_KL_BOUND
    ratios: tuple[float, ...] = DEFAULT_TUNE_RATIOS
    r_quality: float | None = None  # given: no calibration
    context_tokens: int | None = None
    costs: Mapping[str, float] = field(default_factory=lambda: parse_costs(DEFAULT_STORAGE_COSTS))
    archive_bytes: int | None = None  # None: the archive's size
    select: str = DEFAULT_SELECT  # blend's selection policy the quality floor is measured for
    top_k: int = DEFAULT_TOP_K  # passages a query stitches: the context length tuned for, the calibration's prompts

    def check(self) -> None:
        choice(Select, self.select, "--select")
        if self.limit < 1:
            raise UsageError("--limit must be at least 1")
        if self.top_k < 1:
            raise UsageError("--top-k must be at least 1")
        for flag, value in (("--tolerance", self.tolerance), ("--kl-bound", self.kl_bound)):
            if not (math.isfinite(value) and value >= 0):  # NaN passed `< 0`, and was stored as invalid JSON
                raise UsageError(f"{flag} must be a finite number >= 0, not {value}")
        if self.r_quality is not None and not 0 < self.r_quality <= 1:
            raise UsageError("--r-quality must be in (0, 1]")
        if self.r_quality is None and any(r >= 1 for r in self.ratios):
            # 1.0 is full prefill: it always passes, so it became the floor and every later query cost as much
            # as `--mode full` (calibration never stores 1.0; the user may, knowingly)
            raise UsageError(
                "--ratios must be below 1 (ratio 1 is full prefill, which always passes); "
                "pass --r-quality 1 to store it"
            )
        if self.context_tokens is not None and self.context_tokens < 1:
            raise UsageError("--context-tokens must be at least 1")


@dataclass
class TuneResult:
    setting: TunedSetting
    key: str  # where it is stored (tuned_key)
    decision: TuneDecision


def typical_prompt_tokens(archive: Archive, top_k: int = DEFAULT_TOP_K) -> tuple[int, str]:
    """The context length to tune for: top-k × the archive's mean segment size, else top-k × the chunk size."""
    n = tokens = 0
    # documents' segments only: the instruction prefix a query archived, or a client's stored passage, is none
    # that retrieval picks (many short stored passages pulled the length tuned for down)
    retrievable = {key for doc in archive.iter_documents() for key in doc.segment_keys}
    for rec in archive.iter_segments():
        if rec.key not in retrievable:
            continue
        n += 1
        tokens += rec.n_tokens
    if n:
        return int(round(top_k * tokens / n)), f"{top_k} × the archive's mean segment ({tokens / n:.0f} tokens)"
    return top_k * DEFAULT_CHUNK_TOKENS, f"{top_k} × {DEFAULT_CHUNK_TOKENS} tokens (archive has no segments)"


def _context_length(ar: Archive, here: Profile, given: int | None, top_k: int) -> tuple[int, str]:
    L, source = (given, "--context-tokens") if given is not None else typical_prompt_tokens(ar, top_k)
    max_pos = here.model.max_positions or 0
    if max_pos and max_pos < L:
        return max_pos, source + f", capped at the model's context {max_pos}"
    return L, source


def _profile_notes(here: Profile) -> list[str]:
    notes = []
    warning = busy_warning(here)
    if warning:
        notes.append("profile: " + warning)
    if here.quick:
        notes.append("the profile is a --quick one (short contexts): run `kvblend profile` for a better cost fit")
    return notes


#: `--calibration` value that asks for the calibration set bundled with kvblend.
BUNDLED = "bundled"


@dataclass
class CalibrationSet:
    records: list[QARecord]
    source: str  # "archive: …", "bundled" or the file's path
    notes: list[str] = field(default_factory=list)


def calibration_set(req: TuneRequest, ar: Archive) -> CalibrationSet:
    """The prompts the quality floor is measured on: a given file, the bundled set, or by default prompts made
    of the archive's own passages (kvblend.tuning.archive_prompts), which look like the queries it will serve."""
    if req.calibration is not None and str(req.calibration) != BUNDLED:
        return CalibrationSet(load_calibration(req.calibration, req.limit), str(req.calibration))
    if req.calibration is None:
        records = archive_calibration(ar.iter_segments(), req.limit, req.top_k)
        if records:
            most = max(len(r.passages) for r in records)
            prompts = f"{len(records)} prompt" + ("s" if len(records) != 1 else "")
            return CalibrationSet(records, f"archive: {prompts} of up to {most} of its passages")
        note = "the archive has no passage to ask about: calibrated on the bundled set (MuSiQue)"
        return CalibrationSet(load_calibration(None, req.limit), BUNDLED, [note])
    return CalibrationSet(load_calibration(None, req.limit), BUNDLED)


def _quality_floor(
    req: TuneRequest, calibration: CalibrationSet, log: Log, ar: Archive
) -> tuple[QualitySweep, float, str, list[str]]:
    """(sweep, r_quality, its source, notes) from the calibration set."""
    records = calibration.records
    ratios = ", ".join(f"{r:g}" for r in req.ratios)
    log(f"calibration ({calibration.source}): {len(records)} prompts × ratios {ratios} vs full")
    from kvblend.model import load_model  # torch: only once the options and the archive have been checked

    runner = load_model(req.model, req.compute)
    quality = measure_quality(
        runner,
        records,
        req.ratios,
        tolerance=req.tolerance,
        kl_bound_vs_reuse=req.kl_bound,
        log=log,
        select=req.select,
        archived=archived_passages(ar, runner.n_layers),
    )
    floor, source, notes = floor_or_default(quality, req.tolerance, req.kl_bound)
    return quality, floor, source, calibration.notes + notes


def archived_passages(ar: Archive, n_layers: int) -> ArchivedPassage:
    """The stored KV of archived segments, read once each (calibration prompts share passages): what the sweep
    measures blending on is then exactly what queries read, the archive's codec and sink included, and the
    passages are not prefilled again."""
    read: dict[str, Segment | None] = {}

    def passage(key: str) -> Segment | None:
        if key not in read:
            read[key] = _stored_segment(ar, key, n_layers)
        return read[key]

    return passage


def _stored_segment(ar: Archive, key: str, n_layers: int) -> Segment | None:
    """A segment with every layer of its stored KV; None when it does not read back whole (then prefilled)."""
    rec = ar.get_segment(key)
    if rec is None:
        return None
    try:
        kv = [ar.read_layer(rec, layer) for layer in range(n_layers)]
    except CorruptBlobError:
        return None
    return Segment(list(rec.token_ids), kv=kv, key=key, base_position=rec.base_position)


def floor_or_default(sweep: QualitySweep, tolerance: float, kl_bound_vs_reuse: float) -> tuple[float, str, list[str]]:
    """(r_quality, its source, notes): the sweep's quality floor, or, when even the largest ratio tested misses
    the bounds, the default ratio, said in one line with what was measured.

    Why not 1.0 (recompute everything), as the floor's definition would have it: a calibration set that no ratio
    satisfies says more about the set (unlike the user's prompts, or a bound too tight for this model) than about
    the archive, and storing 1.0 would make every later query silently cost as much as `--mode full`."""
    floor = quality_floor(sweep.by_ratio, tolerance, sweep.kl_bound)
    if floor is not None:
        return floor, "calibration", []
    top = max(sweep.by_ratio)
    v = sweep.by_ratio[top]
    bound = "no bound" if sweep.kl_bound is None else f"≤ {sweep.kl_bound:.3f} = {kl_bound_vs_reuse:g}× reuse's"
    drop = "not measured" if v.f1_drop is None else f"{v.f1_drop:+.3f}"
    return (
        DEFAULT_RATIO,
        "fallback",
        [
            f"no ratio up to {top:g} met the bounds (at {top:g}: KL {v.kl:.3f} vs {bound}, F1 drop {drop} vs "
            f"≤ {tolerance:g}); kept the default ratio {DEFAULT_RATIO:g} — pass --r-quality, --ratios or "
            "--kl-bound to choose otherwise"
        ],
    )


def run_tune(req: TuneRequest, log: Log | None = None) -> TuneResult:
    """Decide and store the tuned setting for the archive's location (see the module doc)."""
    req.check()
    log = log or (lambda _msg: None)
    path = resolve_location(req.archive)
    if not Archive.exists(path):
        raise UsageError(f"no archive at {path}: run `kvblend profile` first")
    source = resolve_model_source(req.model)
    fingerprint = source_fingerprint(source)
    from kvblend.model.loading import pick_compute_device  # torch: after the checks above, which need none

    compute = pick_compute_device(req.compute).type
    with Archive.open(path, create=False, model_name=source.name, model_fingerprint=fingerprint) as ar:
        ar.store.check_writable()  # the setting is stored at the end: say so before minutes of calibration
        stored = readable_profiles(ar)  # a newer kvblend's profile is another node's: not this one's to tune by
        profiles = applicable_profiles(stored, machine_info(), fingerprint, compute)
        here = location_profile(profiles, path)
        if here is None:
            raise UsageError(
                f"no profile of this archive's location ({path}) for {source.name} on {compute} "
                f"on this machine: run `kvblend profile --archive {path}` first"
            )
        L, L_source = _context_length(ar, here, req.context_tokens, req.top_k)
        size = req.archive_bytes if req.archive_bytes is not None else ar.size_bytes()
        notes = _profile_notes(here)
        quality, calibration = None, ""
        if req.r_quality is not None:
            rq, rq_source = req.r_quality, "given"
        else:
            prompts = calibration_set(req, ar)
            quality, rq, rq_source, more = _quality_floor(req, prompts, log, ar)
            notes, calibration = notes + more, prompts.source
        decision = decide(here, rq, L, r_quality_source=rq_source, L_source=L_source)
        codec = choose_codec(here, rq, L, here.cost_model)
        decision.notes = notes + decision.notes + ([codec.note] if codec.note else [])
        storage = cheapest_storage(
            profiles, req.costs, decision.ratio, L, cost_model=here.cost_model, archive_bytes=size
        )
        setting = TunedSetting(
            decision.ratio,
            decision.r_quality,
            rq_source,
            decision.r_hide,
            decision.L,
            L_source,
            decision.t_load_s,
            decision.t_recompute_s,
            decision.bottleneck,
            decision.table,
            today(),
            time.time(),
            here.name,
            ModelRef(source.name, fingerprint),
            compute,
            location_key(path),
            req.tolerance,
            req.kl_bound,
            quality,
            storage,
            size,
            decision.notes,
            codec,
            req.select,
            calibration,
        )
        # under the name the archive's model was bound by, which every name of those weights finds (a query
        # giving the GGUF's path, say)
        key = tuned_key(ar.model_name or source.name, compute, path, req.select)
        ar.put_tuned(key, setting.to_dict())
    return TuneResult(setting, key, decision)
