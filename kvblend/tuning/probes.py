"""The three measurements behind a profile: storage read, codec decompression, per-layer prefill.

Each probe times what the query path really does: reads follow the loader's
order (layer by layer, one ``pread`` per segment), decompression goes through
the archive's own codec, and prefill runs the model's own layer functions.
Cold reads need the file out of the page cache without root: ``fsync`` then
``POSIX_FADV_DONTNEED``, and ``mincore`` (through ctypes) reports how much
stayed cached, so a "cold" number that was not cold shows.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import math
import mmap
import os
import secrets
import statistics
import time
from collections.abc import Callable, Sequence
from contextlib import suppress
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from kvblend.archive import decode_layer
from kvblend.archive.blobs import PROFILE_SCRATCH_PREFIX, PROFILE_SCRATCH_SUFFIX, stale_profile_scratch
from kvblend.archive.quant import Quantized
from kvblend.archive.store import Store
from kvblend.defaults import DEFAULT_RATIO
from kvblend.errors import KvblendError, UsageError
from kvblend.tuning.delay import MB, fit_cost_model, recompute_time
from kvblend.tuning.profile import LayerCost, LengthTiming, SelectiveCheck

Layout = list[list[tuple[int, int]]]  # per segment, per layer: (offset, length) in the scratch file


# ───────────────────────────────── page cache ─────────────────────────────────


def _libc() -> ctypes.CDLL:
    libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
    libc.mmap.restype = ctypes.c_void_p
    libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
    libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
    libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
    return libc


def resident_fraction(fd: int, size: int) -> float | None:
    """Fraction of the file's pages in the page cache (mincore), or None if it cannot be asked."""
    if size <= 0:
        return None
    try:
        libc = _libc()
        addr = libc.mmap(None, size, mmap.PROT_READ, mmap.MAP_SHARED, fd, 0)
        if addr in (None, ctypes.c_void_p(-1).value):
            return None
        try:
            pages = (size + mmap.PAGESIZE - 1) // mmap.PAGESIZE
            vec = (ctypes.c_ubyte * pages)()
            if libc.mincore(ctypes.c_void_p(addr), size, vec) != 0:
                return None
            return sum(b & 1 for b in vec) / pages
        finally:
            libc.munmap(ctypes.c_void_p(addr), size)
    except Exception:  # no libc, no mincore: the profile just lacks the residency number
        return None


def evict_page_cache(fd: int) -> None:
    """Drop the file's clean pages from the page cache (fsync first so they are clean)."""
    os.fsync(fd)
    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)


# ───────────────────────────────── storage ─────────────────────────────────


@dataclass
class ReadMeasurement:
    read_cold_MBps: float | None
    read_warm_MBps: float
    scratch_bytes: int
    reads: int  # preads per pass (one per layer per segment)
    cold_resident_fraction: float | None = None  # page-cache residency right after eviction (0 = truly cold)
    cold_runs_MBps: list[float] = field(default_factory=list)
    warm_runs_MBps: list[float] = field(default_factory=list)


def _write_scratch(fd: int, segments: Sequence[Sequence[bytes]]) -> Layout:
    """Each segment's per-layer payloads back to back (segment-major, like one blob file per segment)."""
    layout: Layout = []
    offset = 0
    for seg in segments:
        layout.append([])
        for p in seg:
            os.pwrite(fd, p, offset)
            layout[-1].append((offset, len(p)))
            offset += len(p)
    os.fsync(fd)
    return layout


def _read_pass(fd: int, layout: Layout) -> float:
    """Read every payload once in the loader's order (layer by layer, every segment's slice); seconds."""
    n_layers = max(len(seg) for seg in layout)
    t0 = time.perf_counter()
    for layer in range(n_layers):
        for seg in layout:
            if layer >= len(seg):
                continue
            offset, length = seg[layer]
            if len(os.pread(fd, length, offset)) != length:
                raise OSError(f"short read of the profile scratch file at offset {offset}")
    return time.perf_counter() - t0


def _open_scratch(directory: Path, total: int) -> tuple[int, Path]:
    """A new scratch file in `directory`, after checking there is room for it."""
    if not directory.is_dir():
        raise UsageError(f"--device: no such directory: {directory}")
    try:
        free = os.statvfs(directory)
        if free.f_bavail * free.f_frsize < 2 * total:
            raise UsageError(f"not enough free space in {directory} for a {total / MB:.0f} MB profile scratch file")
    except OSError:
        pass
    for name, _ in stale_profile_scratch(directory):  # what a killed profile left here
        with suppress(OSError):
            (directory / name).unlink()
    path = directory / f"{PROFILE_SCRATCH_PREFIX}{os.getpid()}-{secrets.token_hex(4)}{PROFILE_SCRATCH_SUFFIX}"
    try:
        return os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | getattr(os, "O_CLOEXEC", 0), 0o600), path
    except OSError as e:  # permission denied, a read-only file system, ...
        raise UsageError(f"cannot write a scratch file in {directory} ({(e.strerror or str(e)).lower()})") from None


def measure_disk_read(
    directory: str | os.PathLike[str], segments: Sequence[Sequence[bytes]], cold_runs: int = 3, warm_runs: int = 3
) -> ReadMeasurement:
    """Cold and warm read throughput of a directory's storage, in the archive's layout.

    Writes the payloads into a scratch file inside ``directory``, then reads
    them back as the loader does. Cold runs evict the file from the page cache
    first and record how much stayed resident; warm runs read it again from
    the cache. The file is always deleted.
    """
    total = sum(len(p) for seg in segments for p in seg)
    if total == 0:
        raise ValueError("nothing to write: no payloads")
    fd, path = _open_scratch(Path(directory), total)
    try:
        try:
            layout = _write_scratch(fd, segments)
        except OSError as e:  # the disk filled up meanwhile, an I/O error
            raise KvblendError(f"cannot write the profile scratch file in {directory}: {e.strerror or e}") from None
        cold, resident = [], []
        for _ in range(cold_runs):
            evict_page_cache(fd)
            frac = resident_fraction(fd, total)
            if frac is not None:
                resident.append(frac)
            cold.append(total / _read_pass(fd, layout) / MB)
        _read_pass(fd, layout)  # make sure it is cached
        warm = [total / _read_pass(fd, layout) / MB for _ in range(max(1, warm_runs))]
    finally:
        os.close(fd)
        path.unlink(missing_ok=True)
    return ReadMeasurement(
        statistics.median(cold) if cold else None,
        statistics.median(warm),
        total,
        sum(len(seg) for seg in segments),
        max(resident) if resident else None,
        cold,
        warm,
    )


def measure_ram_read(segments: Sequence[Sequence[bytes]], runs: int = 3) -> ReadMeasurement:
    """An in-memory tier: the payloads are already in RAM, so 'reading' is a copy (memcpy rate)."""
    arrays = [np.frombuffer(p, dtype=np.uint8) for seg in segments for p in seg]
    total = sum(a.nbytes for a in arrays)
    for a in arrays:
        a.copy()  # touch once
    rates = []
    for _ in range(max(1, runs)):
        t0 = time.perf_counter()
        for a in arrays:
            a.copy()
        rates.append(total / (time.perf_counter() - t0) / MB)
    rate = statistics.median(rates)
    return ReadMeasurement(rate, rate, total, len(arrays), None, rates, rates)


def measure_store_read(store: Store, segments: Sequence[Sequence[bytes]], runs: int = 3) -> ReadMeasurement | None:
    """Through the archive's store, for a store no disk probe can measure (a network store such as Redis):
    scratch payloads written there, then read back as the loader reads them. Its memory has no page cache to
    evict: cold = warm. None for a store of files in a directory (measure_disk_read measures those)."""
    rates = store.measure_reads(segments, runs=max(1, runs))
    if rates is None:
        return None
    rate = statistics.median(rates)
    total = sum(len(p) for seg in segments for p in seg)
    return ReadMeasurement(rate, rate, total, sum(len(seg) for seg in segments), None, rates, rates)


# ───────────────────────────────── codec ─────────────────────────────────


@dataclass
class DecompressMeasurement:
    decompress_MBps: float  # MB of compressed input per second
    decompress_raw_MBps: float  # MB of decoded KV per second
    compressed_bytes: int
    raw_bytes: int
    codec: str

    @property
    def compression_ratio(self) -> float:
        return self.raw_bytes / self.compressed_bytes if self.compressed_bytes else 0.0


def _decode_like_loader(payload: bytes, codec: str) -> tuple[torch.Tensor, torch.Tensor]:
    """zstd + safetensors (+ unshuffle), and for a lossy codec the dequantization into fp32 that the
    loader does while it builds the layer: the whole per-codec cost of turning bytes into KV."""
    k, v = decode_layer(payload, codec, lazy=True)
    if isinstance(k, Quantized):
        return k.dequantize(), v.dequantize()
    return k, v


def measure_decompress(payloads: Sequence[bytes], codec: str, min_seconds: float = 0.3) -> DecompressMeasurement:
    """Decode every payload as the loader does (see _decode_like_loader) until ``min_seconds``.

    ``raw`` counts the KV at 2 bytes a value (fp16), whatever the codec, so
    raw MB/s compare across codecs.
    """
    compressed = sum(len(p) for p in payloads)
    raw = 0
    for p in payloads:  # warm-up, and the raw size
        k, v = _decode_like_loader(p, codec)
        raw += 2 * (k.numel() + v.numel())
    passes, elapsed = 0, 0.0
    t0 = time.perf_counter()
    while passes < 1 or elapsed < min_seconds:
        for p in payloads:
            _decode_like_loader(p, codec)
        passes += 1
        elapsed = time.perf_counter() - t0
    return DecompressMeasurement(
        passes * compressed / elapsed / MB, passes * raw / elapsed / MB, compressed, raw, codec
    )


# ───────────────────────────────── compute ─────────────────────────────────


def _sync(device: torch.device) -> None:
    """Wait for the device's queued work: a CUDA call returns once its kernels are queued, not run."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _best_time(fn: Callable[[], None], device: torch.device, repeats: int) -> float:
    """Minimum of `repeats` timed calls after one warm-up (the least-disturbed run on a shared box)."""
    fn()
    _sync(device)
    best = math.inf
    for _ in range(max(1, repeats)):
        t0 = time.perf_counter()
        fn()
        _sync(device)
        best = min(best, time.perf_counter() - t0)
    return best


def _random_hidden(runner, L: int, g: torch.Generator):
    """Hidden states of the model's width at positions 0..L-1, and their RoPE tables."""
    hidden = torch.randn(1, L, runner.config.hidden_size, generator=g).to(runner.device, runner.dtype)
    cos, sin = runner.rope(torch.arange(L, device=runner.device)[None])
    return hidden, cos, sin


def _time_full_layer(runner, layer: int, L: int, repeats: int, g: torch.Generator) -> float:
    hidden, cos, sin = _random_hidden(runner, L, g)

    def full_pass() -> None:
        q, k, v = runner.project_qkv(layer, hidden, cos, sin)
        runner.finish_layer(layer, hidden, runner.attend(layer, q, k, v))

    return _best_time(full_pass, runner.device, repeats)


def _time_selective_layer(runner, layer: int, L: int, ratio: float, repeats: int, g: torch.Generator) -> float:
    """What the fusor does in a layer after the check layer: r·L queries, their KV patched into L keys."""
    n_keep = max(1, int(round(ratio * L)))
    keep = torch.sort(torch.randperm(L - 1, generator=g)[: n_keep - 1]).values
    keep = torch.cat([keep, torch.tensor([L - 1])]).to(runner.device)
    hidden, cos, sin = _random_hidden(runner, L, g)
    _, k_all, v_all = runner.project_qkv(layer, hidden, cos, sin)
    h_keep, c_keep, s_keep = hidden[:, keep], cos[:, keep], sin[:, keep]

    def selective_pass() -> None:
        q, k, v = runner.project_qkv(layer, h_keep, c_keep, s_keep)
        k_all[:, :, keep], v_all[:, :, keep] = k, v  # patch the loaded KV in place
        runner.finish_layer(layer, h_keep, runner.attend(layer, q, k_all, v_all, query_positions=keep))

    return _best_time(selective_pass, runner.device, repeats)


def measure_layer_cost(
    runner,
    lengths: Sequence[int],
    repeats: int = 2,
    layer: int | None = None,
    check_ratio: float | None = DEFAULT_RATIO,
    seed: int = 0,
) -> LayerCost:
    """Time one decoder layer's full prefill at each length and fit cost(L) = a·L + b·L².

    The pass is the model's own: ``project_qkv`` + causal ``attend`` +
    ``finish_layer`` on random hidden states of the model's scale. With
    ``check_ratio``, also time the selective pass at the longest length, to
    show how close ``r·cost(L)`` comes.
    """
    layer = runner.n_layers // 2 if layer is None else layer
    max_len = runner.max_positions or max(lengths)
    lengths = sorted({min(int(L), max_len) for L in lengths})
    g = torch.Generator(device="cpu").manual_seed(seed)
    with torch.inference_mode():
        rows = [LengthTiming(L, _time_full_layer(runner, layer, L, repeats, g)) for L in lengths]
        model = fit_cost_model([r.L for r in rows], [r.layer_s for r in rows])
        for r in rows:
            r.s_per_token, r.fit_s = r.layer_s / r.L, model.cost(r.L)
        cost = LayerCost(model.a, model.b, layer, rows)
        if check_ratio:
            L = lengths[-1]
            measured = _time_selective_layer(runner, layer, L, check_ratio, repeats, g)
            predicted = recompute_time(check_ratio, L, model)
            cost.selective_check = SelectiveCheck(check_ratio, L, measured, predicted, measured / predicted)
    return cost


# ───────────────────────────────── decode weights ─────────────────────────────────


def measure_decode_weights(
    load: Callable[[str], Any], context_tokens: int, steps: int, batches: Sequence[int] = (1, 8)
) -> dict[str, dict[str, float]]:
    """Per weight format (kvblend.model.weights): the median decode step at each batch size over a
    `context_tokens` prompt, and the next-token KL and top-token agreement against fp32's at that step.

    `load(fmt)` returns a runner holding the format for batches of any size. Every format decodes the
    same random prompt's KV, made by the loaded weights (prefill never reads the converted copy). One
    format's runner is held at a time beside fp32's, so measuring costs two models' memory, not five.
    The checkpoint's own format (NATIVE_WEIGHTS) is measured too where it is none of the others: a GGUF of
    mixed block types in its own blocks ("gguf", kvblend.model.gguf_blocks), which `auto` can then pick.
    """
    from kvblend.defaults import NATIVE_WEIGHTS
    from kvblend.generation.decode import DecodePrompt, DecodeState, decode_step
    from kvblend.model.weights import WEIGHT_FORMATS

    base = load("fp32")
    ids = _random_prompt(base, context_tokens)
    prompt = DecodePrompt(_prefill(base, ids[:-1]), ids[:-1])
    reference = _next_logits(base, prompt, ids[-1])
    result: dict[str, dict[str, float]] = {}
    for fmt in (*WEIGHT_FORMATS, NATIVE_WEIGHTS):
        runner = base if fmt == "fp32" else load(fmt)
        if fmt == NATIVE_WEIGHTS:
            fmt = runner.weights_name  # what the checkpoint's own format resolved to
            if fmt in result:
                continue
        measured = _against(reference, _next_logits(runner, prompt, ids[-1]))
        for batch in batches:
            states = [DecodeState(runner, prompt, steps + 2) for _ in range(batch)]
            decode_step(runner, states, [ids[-1]] * batch)  # warm-up (on CUDA: the graphs' capture)
            _sync(runner.device)
            times = []
            for _ in range(steps):
                t0 = time.perf_counter()
                decode_step(runner, states, [ids[-1]] * batch)
                _sync(runner.device)  # on CUDA the step was only queued: 0.15 ms "steps" on an H100 without this
                times.append(time.perf_counter() - t0)
            measured[f"step_ms_{batch}"] = statistics.median(times) * 1000
        result[fmt] = measured
        del runner
    return result


def measure_prefill_dtypes(
    load: Callable[[str], Any], dtypes: Sequence[str], context_tokens: int, repeats: int
) -> dict[str, dict[str, float]]:
    """Per compute dtype (`--dtype`): the median prefill of a `context_tokens` random prompt through every layer,
    and the next-token KL and top-token agreement against fp32's after it.

    Whether bf16 prefill pays is the machine's to say: 1.4x faster than fp32 on an AMD EPYC with AVX512-BF16,
    3.9x slower on one without AVX-512 (BENCHMARKS.md). The KL covers the dtype's whole effect on a prompt: its
    arithmetic and its KV's precision, read by a decode step in the same dtype. `load(dtype)` returns a runner
    computing in it; one is held at a time beside fp32's.
    """
    from kvblend.generation.decode import DecodePrompt

    base = load("fp32")
    ids = _random_prompt(base, context_tokens)
    prompt, last = ids[:-1], ids[-1]
    reference = _next_logits(base, DecodePrompt(_prefill(base, prompt), prompt), last)
    result: dict[str, dict[str, float]] = {}
    for dtype in dtypes:
        runner = base if dtype == "fp32" else load(dtype)
        # fp32's logits are the reference (whose prefill warmed it up); another dtype's run is its warm-up too
        logits = (
            reference if runner is base else _next_logits(runner, DecodePrompt(_prefill(runner, prompt), prompt), last)
        )
        times = []
        for _ in range(max(1, repeats)):
            t0 = time.perf_counter()
            _prefill(runner, prompt)
            _sync(runner.device)
            times.append(time.perf_counter() - t0)
        result[dtype] = {"prefill_ms": statistics.median(times) * 1000, **_against(reference, logits)}
        del runner
    return result


def _random_prompt(runner: Any, tokens: int) -> list[int]:
    """`tokens` reproducible ids clear of the vocabulary's special ends: one prompt every setting is timed on."""
    g = torch.Generator(device="cpu").manual_seed(0)
    return torch.randint(100, max(101, runner.config.vocab_size - 100), (tokens,), generator=g).tolist()


def _prefill(runner: Any, ids: list[int]) -> list:
    """The prompt's per-layer KV, batched as a decode step reads it."""
    return [(k.unsqueeze(0), v.unsqueeze(0)) for k, v in runner.prefill_batch([ids])[0]]


def _next_logits(runner: Any, prompt: Any, token: int) -> torch.Tensor:
    """The logits of one decode step of `token` after `prompt` (a DecodePrompt)."""
    from kvblend.generation.decode import DecodeState, decode_step

    return decode_step(runner, [DecodeState(runner, prompt, 1)], [token])[0].float()


def _against(reference: torch.Tensor, logits: torch.Tensor) -> dict[str, float]:
    """How far a setting's next-token logits are from fp32's: KL, and whether the top token is the same."""
    from kvblend.evaluation.metrics import kl_divergence

    return {
        "kl": kl_divergence(reference, logits),
        "same_top": float(int(logits.argmax()) == int(reference.argmax())),
    }
