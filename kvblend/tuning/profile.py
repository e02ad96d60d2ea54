"""What `kvblend profile` stores, :class:`Profile`, and which stored profiles apply here.

A profile is one (machine, model, compute device, storage location): the
storage's read rate (cold and warm), the codec's decompression rate, the
stored KV bytes per token-layer, and the per-layer prefill cost fit. `tune`
reads profiles to price loading against recompute (:mod:`kvblend.tuning.delay`).

Profiles are stored in the archive as versioned JSON dicts (:meth:`Profile.to_dict`).
This module imports no torch, so `profile --show` and `tune` read profiles
without it; measuring one is :mod:`kvblend.tuning.profiling`.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable, Mapping
from dataclasses import asdict, dataclass, field
from datetime import UTC, datetime
from typing import Any

from kvblend.archive import Archive, Location, resolve_location
from kvblend.archive.records import location_key
from kvblend.defaults import DEFAULT_CHUNK_TOKENS, DEFAULT_TOP_K, NATIVE_WEIGHTS
from kvblend.errors import KvblendError, UsageError
from kvblend.machine import Machine, machine_info, same_machine
from kvblend.model.source import resolve_model_source, source_fingerprint
from kvblend.tuning.delay import CostModel, LoadModel
from kvblend.tuning.jsonable import check_version, from_fields

PROFILE_VERSION = 1

#: Storage labels `profile --device` accepts besides a directory path.
DISK_LABELS = ("nvme", "ssd", "hdd")
RAM_LABEL = "ram"
REDIS_LABEL = "redis"  # an archive on Redis: the network and the server's memory
DEVICE_LABELS = (*DISK_LABELS, RAM_LABEL, REDIS_LABEL)

#: A typical prompt when nothing better is known: top-k segments of the default chunk size.
TYPICAL_PROMPT_TOKENS = DEFAULT_TOP_K * DEFAULT_CHUNK_TOKENS


def today() -> str:
    """Local time, ISO 8601, for humans reading a stored profile or setting."""
    return datetime.now(UTC).astimezone().isoformat(timespec="seconds")


# ───────────────────────────────── the record ─────────────────────────────────


@dataclass
class ModelInfo:
    """The model measured: its identity (fingerprint) and the shape that sets KV bytes per token."""

    name: str
    fingerprint: str | None
    n_layers: int = 0
    kv_heads: int = 0
    head_dim: int = 0
    dtype: str = ""
    max_positions: int | None = None


@dataclass
class StorageInfo:
    """Where the read rate was measured, and the raw runs behind the medians."""

    label: str
    path: str | None  # None: an in-memory tier
    label_source: str = "given"  # given, guessed from /sys, default
    filesystem: dict[str, str] | None = None
    scratch_bytes: int = 0
    reads_per_pass: int = 0
    cold_resident_fraction: float | None = None  # page-cache residency right after eviction (0 = truly cold)
    cold_runs_MBps: list[float] = field(default_factory=list)
    warm_runs_MBps: list[float] = field(default_factory=list)


@dataclass
class SampleInfo:
    """The KV written to the scratch file: archived segments, a real prefill, or random numbers."""

    source: str
    tokens: int
    segment_bytes: int
    bytes_per_token_layer: float


@dataclass
class LoadAvg:
    """1-minute load before and after: a busy machine makes compute timings pessimistic."""

    before: float | None
    after: float | None
    cores: int | None


@dataclass
class LengthTiming:
    """One measured full-layer prefill at context length L, and the fit's value there."""

    L: int
    layer_s: float
    s_per_token: float = 0.0
    fit_s: float = 0.0


@dataclass
class SelectiveCheck:
    """One timed selective layer (r·L queries over L keys) against the model's r·cost(L)."""

    ratio: float
    L: int
    measured_s: float
    predicted_s: float
    measured_over_predicted: float


@dataclass
class LayerCost:
    """cost(L) = a·L + b·L² fitted to `per_length`, on layer `layer`."""

    a_s_per_token: float
    b_s_per_token2: float
    layer: int = 0
    per_length: list[LengthTiming] = field(default_factory=list)
    selective_check: SelectiveCheck | None = None

    @property
    def model(self) -> CostModel:
        return CostModel(self.a_s_per_token, self.b_s_per_token2)

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> LayerCost:
        check = d.get("selective_check")
        return cls(
            float(d["a_s_per_token"]),
            float(d.get("b_s_per_token2") or 0.0),
            int(d.get("layer", 0)),
            [from_fields(LengthTiming, r) for r in d.get("per_length", [])],
            from_fields(SelectiveCheck, check) if check else None,
        )


@dataclass
class Profile:
    """One (machine, model, compute, storage) measurement; see the module docstring."""

    name: str
    created: float  # time.time(); the latest profile of a location wins
    machine: Machine
    model: ModelInfo
    compute: str  # cpu / cuda
    storage: StorageInfo
    read_cold_MBps: float | None
    read_warm_MBps: float
    kv_bytes_per_token_layer: float
    layer_cost: LayerCost
    date: str = ""
    codec: str | None = None
    decompress_MBps: float | None = None  # MB of compressed input per second
    decompress_raw_MBps: float | None = None  # MB of decoded KV per second
    compression_ratio: float | None = None
    kv_raw_bytes_per_token_layer: int | None = None
    sample: SampleInfo | None = None
    layer_cost_ref_tokens: int | None = None
    layer_cost_s_per_token: float | None = None
    quick: bool = False
    load_avg: LoadAvg | None = None
    seconds: float = 0.0
    # Every codec on the same sample KV: {codec: {stored_fraction (of fp16), decompress_MBps (compressed
    # in), decompress_raw_MBps}}, so `tune` can price re-ingesting with another codec (empty: not measured).
    codecs: dict[str, dict[str, float]] = field(default_factory=dict)
    # Every weight format's decode step (kvblend.model.weights): {format: {step_ms_1, step_ms_8, kl, same_top}}
    # against fp32 at the same step, and what `--weights auto` takes from it (empty: not measured).
    weights: dict[str, dict[str, float]] = field(default_factory=dict)
    weights_context_tokens: int = 0
    # Every compute dtype's prefill (`--dtype`): {dtype: {prefill_ms, kl, same_top}} against fp32 over the same
    # prompt, and what `--dtype auto` takes from it (empty: not measured).
    prefill_dtypes: dict[str, dict[str, float]] = field(default_factory=dict)
    prefill_context_tokens: int = 0

    def weights_choice(self) -> tuple[str, int]:
        """`--weights auto`: the fastest batch-1 decode step among the formats within AUTO_MAX_KL of fp32,
        and the largest measured batch at which it still beats fp32 (1 if none: decode batches of one)."""
        from kvblend.model.weights import AUTO_MAX_KL, DEFAULT_WEIGHTS

        fp32 = self.weights.get("fp32")
        if not fp32:
            return DEFAULT_WEIGHTS, 1
        fit = {f: m for f, m in self.weights.items() if m.get("kl", 1.0) <= AUTO_MAX_KL and "step_ms_1" in m}
        best = min(fit, key=lambda f: fit[f]["step_ms_1"], default=DEFAULT_WEIGHTS)
        rows = 1
        for batch in sorted(int(k.removeprefix("step_ms_")) for k in fit.get(best, {}) if k.startswith("step_ms_")):
            if fit[best][f"step_ms_{batch}"] >= fp32.get(f"step_ms_{batch}", 0.0):
                break
            rows = batch
        return best, rows

    def dtype_choice(self) -> str | None:
        """`--dtype auto`: the fastest measured prefill among the dtypes within AUTO_MAX_KL of fp32's next token;
        None (the device's default dtype) where none was measured."""
        from kvblend.model.weights import AUTO_MAX_KL

        fit = {d: m for d, m in self.prefill_dtypes.items() if m.get("kl", 1.0) <= AUTO_MAX_KL and "prefill_ms" in m}
        return min(fit, key=lambda d: fit[d]["prefill_ms"]) if fit else None

    @property
    def cost_model(self) -> CostModel:
        return self.layer_cost.model

    def load_model(self, cold: bool = True, codec: str | None = None) -> LoadModel:
        """Loading from this location, from a cold (default) or warm page cache.

        ``codec``: as if the archive were stored with that codec (its bytes and
        decode rate as profiled); default, or unprofiled: the archive as it is.
        """
        read = (self.read_cold_MBps if cold else self.read_warm_MBps) or self.read_warm_MBps or 0.0
        rates = self.codecs.get(codec) if codec and codec != self.codec else None
        if rates is None or not self.kv_raw_bytes_per_token_layer:
            return LoadModel(self.kv_bytes_per_token_layer, read, self.decompress_MBps)
        return LoadModel(self.kv_raw_bytes_per_token_layer * rates["stored_fraction"], read, rates["decompress_MBps"])

    def to_dict(self) -> dict[str, Any]:
        return {"version": PROFILE_VERSION, **asdict(self)}

    @classmethod
    def from_dict(cls, d: Mapping[str, Any], name: str | None = None) -> Profile:
        """Read a stored profile; `name` (its store key) fills in a profile stored without one."""
        check_version(d, PROFILE_VERSION, "profile")
        label = d.get("name") or name or "?"
        try:
            layer_cost = LayerCost.from_dict(d["layer_cost"])
        except (KeyError, TypeError) as exc:
            raise KvblendError(f"stored profile {label!r} lacks its layer cost fit ({exc})") from None
        nested = {
            "name": label,
            "machine": Machine.from_dict(d.get("machine") or {}),
            "model": from_fields(ModelInfo, d.get("model") or {}),
            "storage": from_fields(StorageInfo, d.get("storage") or {}),
            "layer_cost": layer_cost,
            "sample": from_fields(SampleInfo, d["sample"]) if d.get("sample") else None,
            "load_avg": from_fields(LoadAvg, d["load_avg"]) if d.get("load_avg") else None,
        }
        return from_fields(cls, {**d, **nested})


# ───────────────────────────────── which profiles apply ─────────────────────────────────


def busy_warning(profile: Profile) -> str | None:
    """A line when the machine was busy while profiling (1-minute load, ours included, above the core count)."""
    la = profile.load_avg
    if la is None:
        return None
    cores = la.cores or 1
    worst = max([x for x in (la.before, la.after) if x is not None], default=None)
    if worst is not None and worst > cores and profile.compute == "cpu":
        return (
            f"the machine was busy (1-min load {worst:.1f} on {cores} cores): prefill timings are likely "
            "pessimistic; re-run `kvblend profile` when it is idle"
        )
    return None


def profile_flags(
    profile: Profile, machine: Machine, fingerprint: str | None, model_changed_at: float | None = None
) -> list[str]:
    """Why a stored profile may not apply here: another machine, another model, or a model
    file replaced after the profile was measured (its costs may no longer hold)."""
    flags = []
    if not same_machine(profile.machine, machine):
        flags.append("other machine")
    fp = profile.model.fingerprint
    if fingerprint and fp and fp != fingerprint:
        flags.append("other model")
    elif model_changed_at and profile.created < model_changed_at:
        flags.append("older than the model")
    return flags


def applicable_profiles(
    profiles: Iterable[Profile], machine: Machine, fingerprint: str | None, compute: str
) -> list[Profile]:
    """Profiles measured on this machine, with this model, on this compute device type."""
    return [p for p in profiles if not profile_flags(p, machine, fingerprint) and p.compute == compute]


def readable_profiles(archive: Archive, unreadable: dict[str, str] | None = None) -> list[Profile]:
    """The archive's stored profiles, leaving out any this version cannot read (a newer kvblend's on a node
    sharing the archive, say: it is not this machine's, and must not stop this one's commands). Those left out
    go into `unreadable` (name → why) where it is given."""
    profiles = []
    for name, stored in archive.iter_profiles():
        try:
            profiles.append(Profile.from_dict(stored, name))
        except KvblendError as e:
            if unreadable is not None:
                unreadable[name] = str(e)
    return profiles


def latest_measured(
    location: Location, fingerprint: str | None, compute: str | None, measured: Callable[[Profile], bool]
) -> Profile | None:
    """The latest profile stored at `location` that applies to this machine, model and compute device and that
    measured what `measured` asks for; None where none did. Reads the archive without writing it."""
    from kvblend.model.loading import pick_compute_device

    device = pick_compute_device(compute).type
    try:
        with Archive.open(location, create=False, readonly=True) as ar:
            stored = readable_profiles(ar)
    except KvblendError:
        return None
    found = [p for p in applicable_profiles(stored, machine_info(), fingerprint, device) if measured(p)]
    return max(found, key=lambda p: p.created) if found else None


def weights_choice(location: Location, fingerprint: str | None, compute: str | None) -> tuple[str, int]:
    """`--weights auto` for a model on this machine: the latest applicable profile that measured decode
    weights decides (Profile.weights_choice); when none did, the checkpoint's own format where kvblend's
    CPU kernels run it exactly, else fp32 (NATIVE_WEIGHTS, resolved as the model loads)."""
    from kvblend.model.weights import DEFAULT_DECODE_ROWS

    profile = latest_measured(location, fingerprint, compute, lambda p: bool(p.weights))
    return profile.weights_choice() if profile else (NATIVE_WEIGHTS, DEFAULT_DECODE_ROWS)


def dtype_choice(location: Location, fingerprint: str | None, compute: str | None) -> str | None:
    """`--dtype auto` for a model on this machine: the latest applicable profile that measured prefill dtypes
    decides (Profile.dtype_choice); None, the device's default dtype, when none did."""
    profile = latest_measured(location, fingerprint, compute, lambda p: bool(p.prefill_dtypes))
    return profile.dtype_choice() if profile else None


def location_profile(profiles: Iterable[Profile], archive_path: str | os.PathLike[str] | Location) -> Profile | None:
    """The latest profile of the archive's own location."""
    here = location_key(archive_path)
    mine = [p for p in profiles if p.storage.path == here]
    return max(mine, key=lambda p: p.created) if mine else None


# ───────────────────────────────── `profile --show` ─────────────────────────────────


@dataclass
class ProfileListing:
    """The profiles stored in an archive, each with why it may not apply on this machine."""

    archive: str
    machine: Machine
    model_fingerprint: str | None
    profiles: list[Profile]
    flags: list[list[str]]  # per profile, in the same order
    unreadable: dict[str, str] = field(default_factory=dict)  # profiles this version cannot read: name → why

    def to_dict(self) -> dict[str, Any]:
        return {
            "archive": self.archive,
            "machine": self.machine.to_dict(),
            "model_fingerprint": self.model_fingerprint,
            "profiles": [{**p.to_dict(), "flags": f} for p, f in zip(self.profiles, self.flags)],
            "unreadable": self.unreadable,
        }


def _model_identity(model: str | None) -> tuple[str | None, float | None]:
    """(fingerprint, when its weights last changed) of the model named, or of the default one if installed."""
    try:
        source = resolve_model_source(model)
        weights = source.directory / (source.gguf_file or "config.json")
        return source_fingerprint(source), weights.stat().st_mtime
    except Exception:
        if model is not None:
            raise
        return None, None


def list_profiles(archive: str | os.PathLike[str] | None, model: str | None = None) -> ProfileListing:
    """Every stored profile, oldest first, flagged against this machine and the model.

    Without `model`, profiles are judged against the model the archive was built
    with (not the default model, which may be another).
    """
    path = resolve_location(archive)
    if not Archive.exists(path):
        raise UsageError(f"no archive at {path}: run `kvblend profile` or `kvblend ingest` first")
    fingerprint, changed_at = _model_identity(model)
    machine = machine_info()
    unreadable: dict[str, str] = {}
    with Archive.open(path, create=False) as ar:
        profiles = readable_profiles(ar, unreadable)
        if model is None:
            fingerprint = ar.model_fingerprint or fingerprint
    profiles.sort(key=lambda p: p.created)
    flags = [profile_flags(p, machine, fingerprint, changed_at) for p in profiles]
    return ProfileListing(str(path), machine, fingerprint, profiles, flags, unreadable)
