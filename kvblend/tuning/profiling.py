"""Measuring a profile: what `kvblend profile` runs (storage read, codec, per-layer prefill).

Kept apart from :mod:`kvblend.tuning.profile` because measuring needs torch
and a model, while reading stored profiles needs neither.
"""

from __future__ import annotations

import math
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from kvblend.archive import (
    CODECS,
    Archive,
    decode_layer,
    encode_layer,
    resolve_location,
)
from kvblend.archive.records import normalize_path, profile_name
from kvblend.defaults import DEFAULT_CODEC, DEFAULT_LEVEL
from kvblend.errors import UsageError
from kvblend.machine import filesystem_of, guess_disk_label, loadavg, machine_info
from kvblend.model import load_model
from kvblend.model.loading import pick_dtype
from kvblend.model.weights import WEIGHT_FORMATS
from kvblend.tuning import probes
from kvblend.tuning.profile import (
    DEVICE_LABELS,
    DISK_LABELS,
    RAM_LABEL,
    REDIS_LABEL,
    TYPICAL_PROMPT_TOKENS,
    LoadAvg,
    ModelInfo,
    Profile,
    SampleInfo,
    StorageInfo,
    today,
)
from kvblend.tuning.sample import SampleKV, sample_segments

#: Context lengths (tokens) whose per-layer prefill cost `profile` times.
DEFAULT_LENGTHS = (512, 1024, 2048, 4096)
QUICK_LENGTHS = (256, 512)

Log = Callable[[str], None]


@dataclass(frozen=True)
class ProfileSettings:
    """How much `profile` measures; `quick()` is for tests and a first look."""

    lengths: tuple[int, ...] = DEFAULT_LENGTHS
    repeats: int = 2
    sample_tokens: int = 512
    sample: str = "prefill"  # prefill: real KV of prose; random: random-normal fp16
    scratch_bytes: int = 64 * 1000 * 1000
    cold_runs: int = 3
    warm_runs: int = 3
    decompress_seconds: float = 0.5
    decode_context_tokens: int = 2000  # the prompt each weight format's decode step runs over
    decode_steps: int = 8
    decode_batches: tuple[int, ...] = (1, 2, 4, 8)  # `auto` converts decode batches up to the largest that pays
    prefill_context_tokens: int = 512  # the prompt each compute dtype prefills (`--dtype auto`)
    prefill_repeats: int = 2

    @classmethod
    def quick(cls) -> ProfileSettings:
        return cls(
            lengths=QUICK_LENGTHS,
            repeats=2,
            sample_tokens=256,
            sample="random",
            scratch_bytes=8 * 1000 * 1000,
            cold_runs=1,
            warm_runs=2,
            decompress_seconds=0.1,
            decode_context_tokens=128,
            decode_steps=2,
            decode_batches=(1,),
            prefill_context_tokens=64,
            prefill_repeats=1,
        )


def _locate(archive, device: str | None, label: str | None) -> tuple[str | None, str, str]:
    """(directory, URL or None for RAM, storage label, where the label came from) for `--device`/`--label`."""
    if archive.location.is_redis and device in (None, REDIS_LABEL):
        return archive.location.key, label or REDIS_LABEL, "given" if label else "the archive is on Redis"
    if device is None or device in DISK_LABELS:
        where: str | None = archive.location.key
        store_label = label or device
    elif device == RAM_LABEL:
        where, store_label = None, label or RAM_LABEL
    else:
        where = normalize_path(device)
        if not os.path.isdir(where):
            raise UsageError(f"--device must be nvme, ssd, hdd, ram or an existing directory, not {device!r}")
        store_label = label
    if store_label is not None:
        return where, store_label, "given"
    guessed = guess_disk_label(where) if where else None
    return (where, guessed, "guessed from /sys") if guessed else (where, "disk", "default")


def _stored_bytes_per_token_layer(archive, n_layers: int, fallback: float) -> float:
    """The archive's real bytes per token-layer when it holds segments, else the sample's."""
    try:
        st = archive.stats()
        if st.tokens:
            return st.bytes_per_token_stored / n_layers
    except Exception:  # a damaged archive is `verify`'s business, not the profiler's
        pass
    return fallback


def build_profile(
    runner,
    archive,
    device: str | None = None,
    settings: ProfileSettings = ProfileSettings(),
    label: str | None = None,
    codec: str | None = None,
    level: int | None = None,
    log: Log | None = None,
    load_weights: Callable[[str], Any] | None = None,
    load_dtype: Callable[[str], Any] | None = None,
) -> Profile:
    """Measure storage read, codec decompression, per-layer prefill cost; with `load_weights` (a weight
    format → a runner holding it) each weight format's decode step, and with `load_dtype` (a compute dtype →
    a runner computing in it) each dtype's prefill.

    ``device``: None or a disk label (nvme/ssd/hdd) profiles the archive's own
    directory, ``ram`` an in-memory tier, anything else is a directory to
    profile. ``label`` names the location (default: the disk label given,
    or guessed from /sys for a path).
    """
    log = log or (lambda _msg: None)
    started, load_before = time.perf_counter(), loadavg()
    where, store_label, label_source = _locate(archive, device, label)
    sample = sample_segments(
        runner, archive, settings, codec or DEFAULT_CODEC, DEFAULT_LEVEL if level is None else level, log
    )
    n_layers = len(sample.segments[0])
    copies = max(1, math.ceil(settings.scratch_bytes / sample.stored_bytes))
    scratch = [seg for _ in range(copies) for seg in sample.segments]

    log(f"storage: {store_label} ({where or 'in memory'}), {len(scratch)} segments × {n_layers} layers")
    if where is None:
        reads = probes.measure_ram_read(scratch, runs=settings.warm_runs)
    else:  # the archive's own store measures itself where no disk probe can (Redis)
        own = where == archive.location.key
        through = probes.measure_store_read(archive.store, scratch, runs=settings.warm_runs) if own else None
        reads = through or probes.measure_disk_read(
            where, scratch, cold_runs=settings.cold_runs, warm_runs=settings.warm_runs
        )
    log(f"codec: {sample.codec}")
    dec = probes.measure_decompress(
        [p for seg in sample.segments[:4] for p in seg], sample.codec, settings.decompress_seconds
    )
    log(f"codecs: {', '.join(CODECS)} on the same KV")
    codecs = measure_codecs(sample, DEFAULT_LEVEL if level is None else level, settings.decompress_seconds)
    log(f"compute: {runner.device.type}, lengths {', '.join(map(str, settings.lengths))}")
    cost = probes.measure_layer_cost(runner, settings.lengths, settings.repeats)
    weights: dict[str, dict[str, float]] = {}
    context = 0
    if load_weights is not None:
        context = min(settings.decode_context_tokens, (runner.max_positions or 1 << 20) - 1)
        log(f"decode: weights {', '.join(WEIGHT_FORMATS)} and the checkpoint's own over a {context}-token prompt")
        weights = probes.measure_decode_weights(load_weights, context, settings.decode_steps, settings.decode_batches)
    dtypes: dict[str, dict[str, float]] = {}
    prefill_context = 0
    if load_dtype is not None:
        prefill_context = min(settings.prefill_context_tokens, (runner.max_positions or 1 << 20) - 1)
        names = prefill_dtypes(runner.device.type)
        log(f"prefill: dtypes {', '.join(names)} over a {prefill_context}-token prompt")
        dtypes = probes.measure_prefill_dtypes(load_dtype, names, prefill_context, settings.prefill_repeats)

    sample_per_token_layer = sample.stored_bytes / (sample.tokens * n_layers)
    ref_L = min(TYPICAL_PROMPT_TOKENS, runner.max_positions or TYPICAL_PROMPT_TOKENS)
    machine = machine_info()
    return Profile(
        name=profile_name(machine.hostname, runner.name, runner.device.type, store_label, where),
        created=time.time(),
        date=today(),
        machine=machine,
        model=ModelInfo(
            runner.name,
            runner.fingerprint,
            runner.n_layers,
            runner.n_kv_heads,
            runner.head_dim,
            runner.dtype_name,
            runner.max_positions,
        ),
        compute=runner.device.type,
        storage=StorageInfo(
            store_label,
            where,
            label_source,
            filesystem_of(where) if where and not archive.location.is_redis else None,
            reads.scratch_bytes,
            reads.reads,
            reads.cold_resident_fraction,
            reads.cold_runs_MBps,
            reads.warm_runs_MBps,
        ),
        read_cold_MBps=reads.read_cold_MBps,
        read_warm_MBps=reads.read_warm_MBps,
        codec=sample.codec,
        decompress_MBps=dec.decompress_MBps,
        decompress_raw_MBps=dec.decompress_raw_MBps,
        compression_ratio=dec.compression_ratio,
        kv_bytes_per_token_layer=_stored_bytes_per_token_layer(archive, n_layers, sample_per_token_layer),
        kv_raw_bytes_per_token_layer=2 * 2 * runner.n_kv_heads * runner.head_dim,  # K and V, fp16
        sample=SampleInfo(
            sample.source, sample.tokens, max(1, sample.stored_bytes // len(sample.segments)), sample_per_token_layer
        ),
        layer_cost=cost,
        layer_cost_ref_tokens=ref_L,
        layer_cost_s_per_token=cost.model.cost(ref_L) / ref_L,
        quick=settings == ProfileSettings.quick(),
        load_avg=LoadAvg(load_before, loadavg(), os.cpu_count()),
        seconds=time.perf_counter() - started,
        codecs=codecs,
        weights=weights,
        weights_context_tokens=context,
        prefill_dtypes=dtypes,
        prefill_context_tokens=prefill_context,
    )


def prefill_dtypes(device: str) -> tuple[str, ...]:
    """The compute dtypes `profile` races for `--dtype auto`: fp16 only where it is native (CUDA)."""
    return ("fp32", "bf16", "fp16") if device == "cuda" else ("fp32", "bf16")


def measure_codecs(sample: SampleKV, level: int, seconds: float, segments: int = 2) -> dict[str, dict[str, float]]:
    """Every codec on the same KV (the sample's first segments): its size as a fraction of fp16, and
    its decode rate as the loader decodes, so `tune` can weigh fewer bytes against decode time."""
    payloads = [p for seg in sample.segments[:segments] for p in seg]
    layers = [decode_layer(p, sample.codec) for p in payloads]
    raw = sum(2 * (k.numel() + v.numel()) for k, v in layers)
    rates = {}
    for codec in CODECS:
        encoded = payloads if codec == sample.codec else [encode_layer(k, v, codec, level) for k, v in layers]
        dec = probes.measure_decompress(encoded, codec, seconds)
        rates[codec] = {
            "stored_fraction": dec.compressed_bytes / raw,
            "decompress_MBps": dec.decompress_MBps,
            "decompress_raw_MBps": dec.decompress_raw_MBps,
        }
    return rates


def run_profile(
    archive: str | os.PathLike[str] | None,
    model: str | None = None,
    compute: str | None = None,
    device: str | None = None,
    label: str | None = None,
    quick: bool = False,
    log: Log | None = None,
) -> Profile:
    """`kvblend profile`: measure this machine for the model and store the profile in the archive.

    Bad `--device`/`--label` values fail before the model loads.
    """
    if label is not None and not label.strip():
        raise UsageError("--label must not be empty")
    if device is not None and device not in DEVICE_LABELS and not os.path.isdir(os.path.expanduser(device)):
        raise UsageError(f"--device must be nvme, ssd, hdd, ram or an existing directory, not {device!r}")
    path = resolve_location(archive)
    if device == REDIS_LABEL and not path.is_redis:
        raise UsageError(f"--device redis measures an archive on Redis (--archive redis://...); {path} is a directory")
    runner = load_model(model, compute)
    settings = ProfileSettings.quick() if quick else ProfileSettings()

    def load_weights(fmt: str):
        return runner if fmt == "fp32" else load_model(model, compute, None, fmt, decode_rows=1 << 30)

    def load_dtype(dtype: str):
        return runner if pick_dtype(runner.device, dtype) == runner.dtype else load_model(model, compute, dtype)

    with Archive.open(path, create=True, model_name=runner.name, model_fingerprint=runner.fingerprint) as ar:
        profile = build_profile(
            runner,
            ar,
            device=device,
            settings=settings,
            label=label,
            log=log,
            load_weights=load_weights,
            load_dtype=load_dtype,
        )
        ar.put_profile(profile.name, profile.to_dict())
    return profile
