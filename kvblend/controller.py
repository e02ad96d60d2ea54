"""The loading controller (design §2, paper §5.1): pick the recompute ratio and the storage tier.

Per layer, the fusor waits for the slower of two things: loading the layer's
cached KV (read + decompress) and recomputing the kept tokens. So

    T_load(L)         = B·L / read + B·L / decompress        (B = stored bytes per token-layer)
    T_recompute(r, L) = r · cost(L),   cost(L) = a·L + b·L²   (one layer's full prefill of L tokens)

``r_hide`` solves ``T_recompute(r, L) = T_load(L)``: any ratio up to it costs no
extra time to first token because loading dominates anyway. ``r_quality`` is the
smallest ratio whose measured quality loss against ``full`` stays within a
tolerance on a calibration set. The controller uses ``max(r_quality, r_hide)``.

Why ``r·cost(L)`` models selective recompute: with r·L kept tokens, the
projections and the MLP run on r·L rows (the ``a·L`` part scales by r), and r·L
queries attend to (on average half of) L causal keys, i.e. r·(b·L²) — also
linear in r. What the model leaves out: the check layers, which run on every
token (their cost is the same in every mode, so it does not move the balance
point of the other layers), and the block-sparse attention's overhead; ``kvblend
profile`` measures one selective layer at r = 0.15 and records the model's error
on it (``selective_check``) so the approximation is visible, not assumed.

This module is pure logic plus measurement functions; the CLI lives in
``kvblend.cli.controller_cmds``.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import hashlib
import math
import os
import platform
import secrets
import socket
import statistics
import time
from dataclasses import asdict, dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Callable, Iterable, Mapping, Sequence

from kvblend.errors import UsageError

#: Storage labels `profile --device` accepts besides a directory path.
DISK_LABELS = ("nvme", "ssd", "hdd")
RAM_LABEL = "ram"
DEVICE_LABELS = (*DISK_LABELS, RAM_LABEL)

#: Context lengths (tokens) whose per-layer prefill cost `profile` times.
DEFAULT_LENGTHS = (512, 1024, 2048, 4096)
QUICK_LENGTHS = (256, 512)
#: A typical prompt when nothing better is known: top-k 6 segments of 512 tokens.
TYPICAL_SEGMENTS = 6
TYPICAL_SEGMENT_TOKENS = 512
TYPICAL_PROMPT_TOKENS = TYPICAL_SEGMENTS * TYPICAL_SEGMENT_TOKENS
#: The ratio whose selective layer `profile` times to check the r·cost(L) model.
CHECK_RATIO = 0.15
#: The paper's r* (Figure 16) when no calibration was run.
PAPER_QUALITY_RATIO = 0.15
DEFAULT_RATIOS = (0.05, 0.1, 0.15, 0.2, 0.3)

MB = 1e6


# ───────────────────────────────── keys ─────────────────────────────────


def normalize_path(path: str | os.PathLike[str]) -> str:
    """Absolute, symlink-free spelling of a location, so the same place always gets the same key."""
    return os.path.realpath(os.path.expanduser(os.fspath(path)))


def tuned_key(model_name: str, compute: str, archive_path: str | os.PathLike[str]) -> str:
    """Name of the tuned settings for a model on a compute device type with the archive at a location.

    The archive location is part of the key because loading speed (and so the
    ratio) depends on where the archive is: move it to another disk and the
    tuned ratio no longer applies. The path is hashed so the key stays short.
    """
    where = hashlib.blake2b(normalize_path(archive_path).encode(), digest_size=8).hexdigest()
    return f"{model_name[:200]}|{compute}|{where}"


def profile_name(hostname: str, model_name: str, compute: str, storage_label: str,
                 storage_path: str | None) -> str:
    """One stored profile per (machine, model, compute, storage): re-profiling replaces it."""
    where = storage_label
    if storage_path is not None:
        where += "@" + hashlib.blake2b(storage_path.encode(), digest_size=6).hexdigest()
    return f"{hostname[:100]}|{model_name[:200]}|{compute}|{where[:100]}"


# ───────────────────────────────── delay model ─────────────────────────────────


@dataclass(frozen=True)
class CostModel:
    """One layer's full prefill of L tokens takes ``a·L + b·L²`` seconds."""

    a: float  # seconds per token (projections, MLP)
    b: float  # seconds per token² (attention)

    def cost(self, L: float) -> float:
        return self.a * L + self.b * L * L

    def to_dict(self) -> dict[str, float]:
        return {"a_s_per_token": self.a, "b_s_per_token2": self.b}

    @classmethod
    def from_any(cls, value: "CostModel | Mapping[str, Any] | Sequence[float]") -> "CostModel":
        if isinstance(value, CostModel):
            return value
        if isinstance(value, Mapping):
            if "layer_cost" in value:  # a whole profile
                return cls.from_any(value["layer_cost"])
            a = value.get("a_s_per_token", value.get("a"))
            b = value.get("b_s_per_token2", value.get("b", 0.0))
            if a is None:
                raise ValueError(f"not a cost model: {dict(value)!r}")
            return cls(float(a), float(b or 0.0))
        a, b = value
        return cls(float(a), float(b))

    @classmethod
    def from_point(cls, r: float, L: float, seconds: float) -> "CostModel":
        """The linear model through one observation 'recomputing r of L tokens takes `seconds`'."""
        return cls(seconds / r / L, 0.0)


def fit_cost_model(lengths: Sequence[float], seconds: Sequence[float]) -> CostModel:
    """Least-squares fit of ``seconds ≈ a·L + b·L²`` with a, b ≥ 0, in relative error.

    Rows are divided by the measured time so short and long contexts count
    equally; a negative coefficient (noise) is dropped and the other refitted.
    """
    import numpy as np

    if len(lengths) != len(seconds) or not lengths:
        raise ValueError("need matching, non-empty lengths and timings")
    L = np.asarray(lengths, dtype=np.float64)
    y = np.asarray(seconds, dtype=np.float64)
    w = 1.0 / np.maximum(y, 1e-12)
    if len(L) >= 2:
        X = np.stack([L, L * L], axis=1) * w[:, None]
        (a, b), *_ = np.linalg.lstsq(X, y * w, rcond=None)
        if a >= 0 and b >= 0:
            return CostModel(float(a), float(b))
    # one point, or a negative coefficient: the best of the single-term fits
    a_only = float(np.sum(L * w * w * y) / np.sum((L * w) ** 2))
    b_only = float(np.sum(L * L * w * w * y) / np.sum((L * L * w) ** 2))
    err_a = float(np.sum(((a_only * L - y) * w) ** 2))
    err_b = float(np.sum(((b_only * L * L - y) * w) ** 2))
    return CostModel(max(a_only, 0.0), 0.0) if err_a <= err_b else CostModel(0.0, max(b_only, 0.0))


def load_time(
    bytes_per_token_layer: float,
    L: float,
    read_MBps: float,
    decompress_MBps: float | None = None,
) -> float:
    """Seconds to load one layer's cached KV for L tokens: read the stored bytes, then decompress them.

    ``bytes_per_token_layer`` is what is *stored* (compressed) per token and
    layer, ``read_MBps`` the storage's read rate and ``decompress_MBps`` the
    codec's rate in MB of compressed input per second (None or 0: no codec).
    """
    if read_MBps <= 0:
        raise ValueError("read throughput must be positive")
    nbytes = bytes_per_token_layer * L
    t = nbytes / (read_MBps * MB)
    if decompress_MBps:
        t += nbytes / (decompress_MBps * MB)
    return t


def recompute_time(r: float, L: float, cost_model: CostModel | Mapping[str, Any] | Sequence[float]) -> float:
    """Seconds to recompute a fraction r of L tokens in one layer: ``r · cost(L)`` (see module doc)."""
    return r * CostModel.from_any(cost_model).cost(L)


def hide_ratio(t_load: float, full_recompute: float) -> float:
    """The ratio r with ``r · full_recompute = t_load``, clipped to [0, 1].

    ``full_recompute`` is one layer's full prefill time at the same L
    (``cost(L)``, or ``recompute_time(1, L, model)``). Recomputing up to this
    fraction is hidden behind loading; 1.0 means loading is slower than even a
    full recompute.
    """
    if full_recompute <= 0:
        return 1.0
    return min(1.0, max(0.0, t_load / full_recompute))


def choose_ratio(r_quality: float | None, r_hide: float | None) -> float:
    """``max(r_quality, r_hide)`` in (0, 1]: never below the quality floor, and free recompute is taken."""
    candidates = [r for r in (r_quality, r_hide) if r is not None and not math.isnan(r)]
    if not candidates:
        return PAPER_QUALITY_RATIO
    return min(1.0, max(candidates))


def quality_floor(
    results_by_ratio: Mapping[float, Mapping[str, float]],
    tolerance: float = 0.02,
    kl_bound: float = 0.1,
) -> float | None:
    """The smallest ratio that, *like every larger ratio tested*, stays within the quality bounds.

    ``results_by_ratio[r]`` holds ``f1_drop`` (mean F1 of ``full`` minus mean F1
    at r; negative is an improvement) and ``kl`` (mean first-token KL from
    ``full``). A ratio passes when ``f1_drop <= tolerance`` and ``kl <=
    kl_bound`` (a missing ``f1_drop``, None, fails). Requiring the larger ratios to pass as well keeps a lucky small
    ratio on a small calibration set from being chosen while a larger one
    fails. None when the largest ratio tested fails.
    """
    floor = None
    for r in sorted(results_by_ratio, reverse=True):
        if _passes(results_by_ratio[r], tolerance, kl_bound):
            floor = r
        else:
            break
    return floor


def _passes(res: Mapping[str, Any], tolerance: float, kl_bound: float) -> bool:
    """Within both bounds; a ratio whose F1 was not measured (None) does not pass."""
    f1_drop, kl = res.get("f1_drop"), res.get("kl")
    return f1_drop is not None and kl is not None and f1_drop <= tolerance + 1e-12 and kl <= kl_bound


# ───────────────────────────────── profiles → delays ─────────────────────────────────


def profile_load_time(profile: Mapping[str, Any], L: float, cold: bool = True) -> float:
    """T_load of one layer of L tokens from the storage a profile measured."""
    read = profile["read_cold_MBps"] if cold else profile["read_warm_MBps"]
    return load_time(profile["kv_bytes_per_token_layer"], L, read, profile.get("decompress_MBps"))


def ratio_table(
    profile: Mapping[str, Any],
    lengths: Iterable[int],
    ratio: float | None = None,
    cost_model: CostModel | Mapping[str, Any] | None = None,
) -> list[dict[str, float]]:
    """Per context length: T_load, full layer cost, r_hide, and (with ``ratio``) T_recompute(ratio)."""
    model = CostModel.from_any(cost_model if cost_model is not None else profile)
    rows = []
    for L in lengths:
        t_load = profile_load_time(profile, L)
        full = model.cost(L)
        row = {"L": int(L), "t_load_s": t_load, "t_full_layer_s": full, "r_hide": hide_ratio(t_load, full)}
        if ratio is not None:
            row["t_recompute_s"] = recompute_time(ratio, L, model)
            row["hidden"] = row["t_recompute_s"] >= t_load
        rows.append(row)
    return rows


@dataclass
class StorageOption:
    label: str
    price_per_GB_month: float
    t_load_s: float
    t_recompute_s: float
    hides: bool  # loading adds no delay: T_load ≤ T_recompute(ratio)
    monthly_cost: float | None = None
    profile: str | None = None

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass
class StorageDecision:
    choice: StorageOption | None
    candidates: list[StorageOption] = field(default_factory=list)
    unprofiled: list[str] = field(default_factory=list)  # cost keys with no profile

    def to_dict(self) -> dict[str, Any]:
        return {
            "choice": self.choice.to_dict() if self.choice else None,
            "candidates": [c.to_dict() for c in self.candidates],
            "unprofiled": self.unprofiled,
        }


def storage_label(profile: Mapping[str, Any]) -> str:
    storage = profile.get("storage")
    if isinstance(storage, Mapping):
        return str(storage.get("label", ""))
    return str(storage or "")


def latest_by_label(profiles: Iterable[Mapping[str, Any]]) -> dict[str, Mapping[str, Any]]:
    """The most recent profile of each storage label."""
    best: dict[str, Mapping[str, Any]] = {}
    for p in profiles:
        label = storage_label(p)
        if label not in best or p.get("created", 0) >= best[label].get("created", 0):
            best[label] = p
    return best


def cheapest_storage(
    profiles: Iterable[Mapping[str, Any]],
    costs: Mapping[str, float],
    ratio: float,
    L: float,
    cost_model: CostModel | Mapping[str, Any] | None = None,
    archive_bytes: float | None = None,
) -> StorageDecision:
    """Among profiled locations priced in ``costs`` ($/GB-month), the cheapest whose loading hides recompute.

    A location qualifies when ``T_load(L) <= T_recompute(ratio, L)`` (loading
    adds nothing to time to first token). Recompute cost comes from
    ``cost_model`` when given (the compute device in use), else from each
    profile. With ``archive_bytes``, each option carries its monthly cost.
    ``choice`` is None when no priced location hides recompute.
    """
    latest = latest_by_label(profiles)
    options = []
    for label, price in costs.items():
        p = latest.get(label)
        if p is None:
            continue
        model = CostModel.from_any(cost_model if cost_model is not None else p)
        t_load = profile_load_time(p, L)
        t_rec = recompute_time(ratio, L, model)
        monthly = archive_bytes / 1e9 * price if archive_bytes is not None else None
        options.append(StorageOption(label, float(price), t_load, t_rec, t_load <= t_rec, monthly, p.get("name")))
    options.sort(key=lambda o: (o.price_per_GB_month, o.t_load_s))
    hiding = [o for o in options if o.hides]
    return StorageDecision(hiding[0] if hiding else None, options,
                           [label for label in costs if label not in latest])


def parse_costs(text: str) -> dict[str, float]:
    """'ram=5,nvme=0.1,hdd=0.02' → {'ram': 5.0, ...} ($ per GB-month)."""
    costs: dict[str, float] = {}
    for part in (text or "").split(","):
        if not part.strip():
            continue
        label, sep, value = part.partition("=")
        try:
            price = float(value)
        except ValueError:
            price = -1.0
        if not sep or not label.strip() or price < 0 or math.isnan(price):
            raise UsageError(f"--storage-costs takes label=$/GB-month pairs like ram=5,nvme=0.1, not {part!r}")
        costs[label.strip()] = price
    return costs


def parse_ratios(text: str) -> list[float]:
    try:
        ratios = sorted({float(x) for x in text.split(",") if x.strip()})
    except ValueError:
        raise UsageError(f"--ratios takes comma-separated fractions like 0.05,0.15,0.3, not {text!r}") from None
    if not ratios or any(not 0 < r <= 1 for r in ratios):
        raise UsageError("--ratios must be fractions in (0, 1]")
    return ratios


# ───────────────────────────────── machine identity ─────────────────────────────────


def cpu_model() -> str:
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
            for line in f:
                if line.lower().startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def gpu_name() -> str | None:
    try:
        import torch

        if torch.cuda.is_available():
            return torch.cuda.get_device_name(0)
    except Exception:  # no driver, broken CUDA install: the profile just says "no GPU"
        pass
    return None


def machine_info() -> dict[str, Any]:
    return {"hostname": socket.gethostname(), "cpu": cpu_model(), "cores": os.cpu_count(), "gpu": gpu_name()}


def same_machine(a: Mapping[str, Any], b: Mapping[str, Any]) -> bool:
    return a.get("hostname") == b.get("hostname") and a.get("cpu") == b.get("cpu") and a.get("gpu") == b.get("gpu")


def filesystem_of(path: str) -> dict[str, str] | None:
    """The mount (device, mount point, fs type) holding `path`, from /proc/self/mounts."""
    best = None
    try:
        with open("/proc/self/mounts", encoding="utf-8", errors="replace") as f:
            for line in f:
                parts = line.split()
                if len(parts) < 3:
                    continue
                mnt = parts[1].replace("\\040", " ")
                if (path == mnt or path.startswith(mnt.rstrip("/") + "/")) and (best is None or len(mnt) >= len(best[1])):
                    best = (parts[0], mnt, parts[2])
    except OSError:
        return None
    return {"device": best[0], "mount": best[1], "fs_type": best[2]} if best else None


# ───────────────────────────────── measurement: storage ─────────────────────────────────


def _resident_fraction(fd: int, size: int) -> float | None:
    """Fraction of the file's pages in the page cache (mincore), or None if it cannot be asked."""
    if size <= 0:
        return None
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
        libc.mmap.restype = ctypes.c_void_p
        libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
        libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
        libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
        import mmap as _mmap

        addr = libc.mmap(None, size, _mmap.PROT_READ, _mmap.MAP_SHARED, fd, 0)
        if addr in (None, ctypes.c_void_p(-1).value):
            return None
        try:
            page = os.sysconf("SC_PAGE_SIZE")
            pages = (size + page - 1) // page
            vec = (ctypes.c_ubyte * pages)()
            if libc.mincore(ctypes.c_void_p(addr), size, vec) != 0:
                return None
            return sum(b & 1 for b in vec) / pages
        finally:
            libc.munmap(ctypes.c_void_p(addr), size)
    except Exception:
        return None


def evict_page_cache(fd: int) -> None:
    """Drop the file's clean pages from the page cache (fsync first so they are clean)."""
    os.fsync(fd)
    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)


@dataclass
class ReadMeasurement:
    read_cold_MBps: float | None
    read_warm_MBps: float
    scratch_bytes: int
    reads: int  # preads per pass (one per layer per segment)
    cold_resident_fraction: float | None = None  # page-cache residency right after eviction (0 = truly cold)
    cold_runs_MBps: list[float] = field(default_factory=list)
    warm_runs_MBps: list[float] = field(default_factory=list)


def _read_pass(fd: int, layout: list[list[tuple[int, int]]]) -> float:
    """Read every payload once in the loader's order (layer by layer, every segment's slice); seconds."""
    n_layers = max(len(seg) for seg in layout)
    t0 = time.perf_counter()
    for layer in range(n_layers):
        for seg in layout:
            if layer >= len(seg):
                continue
            offset, length = seg[layer]
            data = os.pread(fd, length, offset)
            if len(data) != length:
                raise OSError(f"short read of the profile scratch file ({len(data)} of {length} bytes)")
    return time.perf_counter() - t0


def measure_disk_read(
    directory: str | os.PathLike[str],
    segments: Sequence[Sequence[bytes]],
    cold_runs: int = 3,
    warm_runs: int = 3,
) -> ReadMeasurement:
    """Cold and warm read throughput of a directory's storage, in the archive's layout.

    Writes each segment's per-layer payloads back to back (segment-major, like
    one blob file per segment) into a scratch file inside ``directory``, then
    reads them back as the loader does: for each layer, one contiguous
    ``pread`` per segment. Cold runs evict the file from the page
    cache first (fsync + POSIX_FADV_DONTNEED) and record how much stayed
    resident; warm runs read it again from the cache. The file is always deleted.
    """
    directory = Path(directory)
    if not directory.is_dir():
        raise UsageError(f"--device: no such directory: {directory}")
    total = sum(len(p) for seg in segments for p in seg)
    if total == 0:
        raise ValueError("nothing to write: no payloads")
    try:
        free = os.statvfs(directory)
        if free.f_bavail * free.f_frsize < 2 * total:
            raise UsageError(f"not enough free space in {directory} for a {total / MB:.0f} MB profile scratch file")
    except OSError:
        pass
    path = directory / f".kvblend-profile-{os.getpid()}-{secrets.token_hex(4)}.scratch"
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | getattr(os, "O_CLOEXEC", 0), 0o600)
    except PermissionError:
        raise UsageError(f"cannot write a scratch file in {directory} (permission denied)") from None
    try:
        layout: list[list[tuple[int, int]]] = []
        offset = 0
        for seg in segments:
            layout.append([])
            for p in seg:
                os.pwrite(fd, p, offset)
                layout[-1].append((offset, len(p)))
                offset += len(p)
        os.fsync(fd)
        cold, resident = [], []
        for _ in range(cold_runs):
            evict_page_cache(fd)
            frac = _resident_fraction(fd, total)
            if frac is not None:
                resident.append(frac)
            cold.append(total / _read_pass(fd, layout) / MB)
        _read_pass(fd, layout)  # make sure it is cached
        warm = [total / _read_pass(fd, layout) / MB for _ in range(max(1, warm_runs))]
    finally:
        os.close(fd)
        try:
            path.unlink()
        except FileNotFoundError:
            pass
    return ReadMeasurement(
        read_cold_MBps=statistics.median(cold) if cold else None,
        read_warm_MBps=statistics.median(warm),
        scratch_bytes=total,
        reads=sum(len(seg) for seg in segments),
        cold_resident_fraction=max(resident) if resident else None,
        cold_runs_MBps=cold,
        warm_runs_MBps=warm,
    )


def measure_ram_read(segments: Sequence[Sequence[bytes]], runs: int = 3) -> ReadMeasurement:
    """An in-memory tier: the payloads are already in RAM, so 'reading' is a copy (memcpy rate)."""
    import numpy as np

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


# ───────────────────────────────── measurement: codec ─────────────────────────────────


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


def measure_decompress(payloads: Sequence[bytes], codec: str, min_seconds: float = 0.3) -> DecompressMeasurement:
    """Decode every payload (zstd + safetensors + unshuffle, as the loader does) until ``min_seconds``."""
    from kvblend.archive_format.codec import decode_layer

    compressed = sum(len(p) for p in payloads)
    raw = 0
    for p in payloads:  # warm-up, and the raw size
        k, v = decode_layer(p, codec)
        raw += k.numel() * k.element_size() + v.numel() * v.element_size()
    passes, elapsed = 0, 0.0
    t0 = time.perf_counter()
    while passes < 1 or elapsed < min_seconds:
        for p in payloads:
            decode_layer(p, codec)
        passes += 1
        elapsed = time.perf_counter() - t0
    return DecompressMeasurement(
        decompress_MBps=passes * compressed / elapsed / MB,
        decompress_raw_MBps=passes * raw / elapsed / MB,
        compressed_bytes=compressed,
        raw_bytes=raw,
        codec=codec,
    )


# ───────────────────────────────── measurement: compute ─────────────────────────────────


def _sync(device) -> None:
    if getattr(device, "type", str(device)) == "cuda":
        import torch

        torch.cuda.synchronize(device)


def _best_time(fn: Callable[[], None], device, repeats: int) -> float:
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


def measure_layer_cost(
    runner,
    lengths: Sequence[int],
    repeats: int = 2,
    layer: int | None = None,
    check_ratio: float | None = CHECK_RATIO,
    seed: int = 0,
) -> dict[str, Any]:
    """Time one decoder layer's full prefill at each length and fit cost(L) = a·L + b·L².

    The pass is the model's own: ``project_qkv`` + causal ``attend`` +
    ``finish_layer`` on random hidden states of the model's scale. With
    ``check_ratio``, also time the selective pass the fusor runs (r·L queries
    attending over L keys) at the longest length, to show how close
    ``r·cost(L)`` comes.
    """
    import torch

    layer = runner.n_layers // 2 if layer is None else layer
    max_len = runner.max_positions or max(lengths)
    lengths = sorted({min(int(L), max_len) for L in lengths})
    hidden_size = runner.config.hidden_size
    g = torch.Generator(device="cpu").manual_seed(seed)
    rows = []
    with torch.inference_mode():
        for L in lengths:
            hidden = torch.randn(1, L, hidden_size, generator=g).to(runner.device, runner.dtype)
            cos, sin = runner.rope(torch.arange(L, device=runner.device)[None])

            def full_pass() -> None:
                q, k, v = runner.project_qkv(layer, hidden, cos, sin)
                runner.finish_layer(layer, hidden, runner.attend(layer, q, k, v))

            rows.append({"L": L, "layer_s": _best_time(full_pass, runner.device, repeats)})
        model = fit_cost_model([r["L"] for r in rows], [r["layer_s"] for r in rows])
        for r in rows:
            r["s_per_token"] = r["layer_s"] / r["L"]
            r["fit_s"] = model.cost(r["L"])
        result: dict[str, Any] = {**model.to_dict(), "layer": layer, "per_length": rows}
        if check_ratio:
            L = lengths[-1]
            n_keep = max(1, int(round(check_ratio * L)))
            keep = torch.sort(torch.randperm(L - 1, generator=g)[: n_keep - 1]).values
            keep = torch.cat([keep, torch.tensor([L - 1])]).to(runner.device)
            hidden = torch.randn(1, L, hidden_size, generator=g).to(runner.device, runner.dtype)
            cos, sin = runner.rope(torch.arange(L, device=runner.device)[None])
            _, k_all, v_all = runner.project_qkv(layer, hidden, cos, sin)
            h_keep, c_keep, s_keep = hidden[:, keep], cos[:, keep], sin[:, keep]

            def selective_pass() -> None:  # what the fusor does in a layer after the check layer
                q, k, v = runner.project_qkv(layer, h_keep, c_keep, s_keep)
                k_all[:, :, keep], v_all[:, :, keep] = k, v  # patch the loaded KV in place
                runner.finish_layer(layer, h_keep, runner.attend(layer, q, k_all, v_all, query_positions=keep))

            measured = _best_time(selective_pass, runner.device, repeats)
            predicted = recompute_time(check_ratio, L, model)
            result["selective_check"] = {"ratio": check_ratio, "L": L, "measured_s": measured,
                                         "predicted_s": predicted, "measured_over_predicted": measured / predicted}
    return result


# ───────────────────────────────── sample KV for the scratch file ─────────────────────────────────


def random_kv_layers(runner, n_tokens: int, seed: int = 0) -> list[tuple[Any, Any]]:
    """Random-normal fp16 K/V of the model's shape, one pair per layer (the --quick stand-in)."""
    import torch

    g = torch.Generator().manual_seed(seed)
    shape = (runner.n_kv_heads, n_tokens, runner.head_dim)
    return [(torch.randn(shape, generator=g).half(), torch.randn(shape, generator=g).half())
            for _ in range(runner.n_layers)]


def sample_text() -> str:
    """Prose to prefill for real-looking KV: the calibration passages when available."""
    import json

    fixture = Path(__file__).resolve().parent.parent / "fixtures" / "calibration.json"
    try:
        records = json.loads(fixture.read_text(encoding="utf-8"))
        texts = {c["text"] for r in records for c in r.get("ctxs", [])}
        if texts:
            return "\n\n".join(sorted(texts))
    except (OSError, ValueError, KeyError, TypeError):
        pass
    return (
        "The harbour office opens at seven. Ships arriving after dark must call the pilot station on "
        "channel twelve and wait at the outer buoy until a pilot boards. Cargo manifests are checked "
        "against the customs list before any container leaves the quay, and refrigerated units are "
        "connected to shore power within thirty minutes of unloading. "
    ) * 40


def prefill_kv_layers(runner, n_tokens: int) -> list[tuple[Any, Any]]:
    """KV of a real prefill of `n_tokens` tokens of prose, in the archive's storage dtype."""
    from kvblend.precompute import precompute_kv

    ids = runner.tokenize(sample_text())
    while len(ids) < n_tokens:
        ids = ids + ids
    return precompute_kv(runner, [ids[:n_tokens]])[0]


def today() -> str:
    return datetime.now(timezone.utc).astimezone().isoformat(timespec="seconds")


# ───────────────────────────────── a whole profile ─────────────────────────────────


def guess_disk_label(path: str) -> str | None:
    """nvme / hdd / ssd for the block device holding `path` (from /sys), or None when unknowable."""
    try:
        st = os.stat(path)
        node = Path(f"/sys/dev/block/{os.major(st.st_dev)}:{os.minor(st.st_dev)}").resolve()
        if not node.exists():
            return None
        for d in (node, node.parent):  # a partition's queue/ lives in its parent disk
            rot = d / "queue" / "rotational"
            if rot.is_file():
                if d.name.startswith("nvme"):
                    return "nvme"
                return "hdd" if rot.read_text().strip() == "1" else "ssd"
    except (OSError, ValueError):
        pass
    return None


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

    @classmethod
    def quick(cls) -> "ProfileSettings":
        return cls(lengths=QUICK_LENGTHS, repeats=2, sample_tokens=256, sample="random",
                   scratch_bytes=8 * 1000 * 1000, cold_runs=1, warm_runs=2, decompress_seconds=0.1)


def _archive_sample(archive, limit_bytes: int) -> tuple[list[list[bytes]], int, str | None]:
    """Real payloads of archived segments (up to `limit_bytes`): (segments, tokens, codec)."""
    segments, tokens, codec = [], 0, None
    total = 0
    for rec in archive.iter_segments():
        if codec is not None and rec.codec != codec:
            continue
        try:
            seg = [archive.read_layer_raw(rec, i) for i in range(len(rec.layers))]
        except Exception:  # a corrupt blob is `verify`'s business, not the profiler's
            continue
        codec = rec.codec
        segments.append(seg)
        tokens += rec.n_tokens
        total += sum(len(p) for p in seg)
        if total >= limit_bytes:
            break
    return segments, tokens, codec


def build_profile(
    runner,
    archive,
    device: str | None = None,
    settings: ProfileSettings = ProfileSettings(),
    label: str | None = None,
    codec: str | None = None,
    level: int | None = None,
    log: Callable[[str], None] | None = None,
) -> dict[str, Any]:
    """Measure storage read, codec decompression and per-layer prefill cost; return the profile dict.

    ``device``: None or a disk label (nvme/ssd/hdd) profiles the archive's own
    directory, ``ram`` an in-memory tier, anything else is a directory to
    profile. ``label`` names the location (default: the disk label given,
    or guessed from /sys for a path).
    """
    from kvblend.archive_format.codec import DEFAULT_CODEC, DEFAULT_LEVEL, encode_layer

    log = log or (lambda _msg: None)
    started = time.perf_counter()
    load_before = _loadavg()
    codec = codec or DEFAULT_CODEC
    level = DEFAULT_LEVEL if level is None else level

    # where
    if device is None or device in DISK_LABELS:
        where: str | None = normalize_path(archive.path)
        store_label = label or device
    elif device == RAM_LABEL:
        where, store_label = None, label or RAM_LABEL
    else:
        where = normalize_path(device)
        if not os.path.isdir(where):
            raise UsageError(f"--device must be nvme, ssd, hdd, ram or an existing directory, not {device!r}")
        store_label = label
    label_source = "given"
    if store_label is None:
        guessed = guess_disk_label(where) if where else None
        # virtual disks (virtio, cloud volumes) often claim to be rotational: a guess, and labelled so
        store_label, label_source = (guessed, "guessed from /sys") if guessed else ("disk", "default")

    # what: payloads in the archive's layout
    raw_per_token_layer = 2 * 2 * runner.n_kv_heads * runner.head_dim  # K and V, fp16
    segments, tokens, arch_codec = _archive_sample(archive, settings.scratch_bytes)
    if segments:
        sample_source, codec = "archive", arch_codec or codec
        n_layers = len(segments[0])
    else:
        log(f"sample KV: {settings.sample} ({settings.sample_tokens} tokens)")
        if settings.sample == "prefill":
            layers, sample_source = prefill_kv_layers(runner, settings.sample_tokens), "prefill"
        else:
            layers, sample_source = random_kv_layers(runner, settings.sample_tokens), "random-normal fp16"
        one = [encode_layer(k, v, codec, level) for k, v in layers]
        segments, tokens, n_layers = [one], settings.sample_tokens, len(one)
    stored = sum(len(p) for seg in segments for p in seg)
    sample_bytes_per_token_layer = stored / (tokens * n_layers)
    per_segment = max(1, stored // len(segments))
    copies = max(1, math.ceil(settings.scratch_bytes / stored))
    scratch = [seg for _ in range(copies) for seg in segments]

    # (a) storage
    log(f"storage: {store_label} ({where or 'in memory'}), {len(scratch)} segments × {n_layers} layers")
    if where is None:
        reads = measure_ram_read(scratch, runs=settings.warm_runs)
        fs = None
    else:
        reads = measure_disk_read(where, scratch, cold_runs=settings.cold_runs, warm_runs=settings.warm_runs)
        fs = filesystem_of(where)
    # (b) codec
    log(f"codec: {codec}")
    dec = measure_decompress(segments[0] if len(segments) == 1 else [p for seg in segments[:4] for p in seg],
                             codec, settings.decompress_seconds)
    # (c) compute
    log(f"compute: {runner.device.type}, lengths {', '.join(map(str, settings.lengths))}")
    cost = measure_layer_cost(runner, settings.lengths, settings.repeats)

    # bytes per token-layer: the archive's real number when it has segments
    kv_bytes = sample_bytes_per_token_layer
    try:
        st = archive.stats()
        if st.get("tokens"):
            kv_bytes = st["bytes_per_token_stored"] / n_layers
    except Exception:
        pass

    model = CostModel.from_any(cost)
    ref_L = min(TYPICAL_PROMPT_TOKENS, runner.max_positions or TYPICAL_PROMPT_TOKENS)
    machine = machine_info()
    profile = {
        "date": today(),
        "created": time.time(),
        "machine": machine,
        "model": {
            "name": runner.name,
            "fingerprint": runner.fingerprint,
            "n_layers": runner.n_layers,
            "kv_heads": runner.n_kv_heads,
            "head_dim": runner.head_dim,
            "dtype": str(runner.dtype).replace("torch.", ""),
            "max_positions": runner.max_positions,
        },
        "compute": runner.device.type,
        "storage": {
            "label": store_label,
            "label_source": label_source,
            "path": where,
            "filesystem": fs,
            "scratch_bytes": reads.scratch_bytes,
            "reads_per_pass": reads.reads,
            "cold_resident_fraction": reads.cold_resident_fraction,
            "cold_runs_MBps": reads.cold_runs_MBps,
            "warm_runs_MBps": reads.warm_runs_MBps,
        },
        "read_cold_MBps": reads.read_cold_MBps,
        "read_warm_MBps": reads.read_warm_MBps,
        "codec": codec,
        "decompress_MBps": dec.decompress_MBps,
        "decompress_raw_MBps": dec.decompress_raw_MBps,
        "compression_ratio": dec.compression_ratio,
        "kv_bytes_per_token_layer": kv_bytes,
        "kv_raw_bytes_per_token_layer": raw_per_token_layer,
        "sample": {"source": sample_source, "tokens": tokens, "segment_bytes": per_segment,
                   "bytes_per_token_layer": sample_bytes_per_token_layer},
        "layer_cost": cost,
        "layer_cost_ref_tokens": ref_L,
        "layer_cost_s_per_token": model.cost(ref_L) / ref_L,
        "quick": settings == ProfileSettings.quick(),
        # other processes competing for the cores make compute timings pessimistic; recorded so it shows
        "load_avg": {"before": load_before, "after": _loadavg(), "cores": os.cpu_count()},
        "seconds": 0.0,
    }
    profile["name"] = profile_name(machine["hostname"], runner.name, runner.device.type, store_label, where)
    profile["seconds"] = time.perf_counter() - started
    return profile


def _loadavg() -> float | None:
    try:
        return round(os.getloadavg()[0], 2)
    except OSError:
        return None


def busy_warning(profile: Mapping[str, Any]) -> str | None:
    """A line when the machine was busy while profiling (1-minute load, ours included, above the core count)."""
    la = profile.get("load_avg") or {}
    cores = la.get("cores") or 1
    worst = max([x for x in (la.get("before"), la.get("after")) if x is not None], default=None)
    if worst is not None and worst > cores and profile.get("compute") == "cpu":
        return (f"the machine was busy (1-min load {worst:.1f} on {cores} cores): prefill timings are likely "
                "pessimistic; re-run `kvblend profile` when it is idle")
    return None


def profile_flags(profile: Mapping[str, Any], machine: Mapping[str, Any], fingerprint: str | None,
                  model_changed_at: float | None = None) -> list[str]:
    """Why a stored profile may not apply here: another machine, another model, or a model
    file replaced after the profile was measured (its costs may no longer hold)."""
    flags = []
    if not same_machine(profile.get("machine", {}), machine):
        flags.append("other machine")
    fp = profile.get("model", {}).get("fingerprint")
    if fingerprint and fp and fp != fingerprint:
        flags.append("other model")
    elif model_changed_at and profile.get("created", 0) < model_changed_at:
        flags.append("older than the model")
    return flags


def applicable_profiles(
    profiles: Iterable[Mapping[str, Any]], machine: Mapping[str, Any], fingerprint: str | None, compute: str
) -> list[Mapping[str, Any]]:
    """Profiles measured on this machine, with this model, on this compute device type."""
    return [p for p in profiles
            if not profile_flags(p, machine, fingerprint) and p.get("compute") == compute]


def location_profile(profiles: Iterable[Mapping[str, Any]], archive_path) -> Mapping[str, Any] | None:
    """The latest profile of the archive's own location."""
    here = normalize_path(archive_path)
    mine = [p for p in profiles if (p.get("storage") or {}).get("path") == here]
    return max(mine, key=lambda p: p.get("created", 0)) if mine else None


def typical_prompt_tokens(archive, top_k: int = TYPICAL_SEGMENTS) -> tuple[int, str]:
    """The context length to tune for: top-k × the archive's mean segment size, else 6 × 512."""
    n = tokens = 0
    try:
        for rec in archive.iter_segments():
            n += 1
            tokens += rec.n_tokens
    except Exception:
        n = 0
    if n:
        return int(round(top_k * tokens / n)), f"{top_k} × the archive's mean segment ({tokens / n:.0f} tokens)"
    return TYPICAL_PROMPT_TOKENS, f"{TYPICAL_SEGMENTS} × {TYPICAL_SEGMENT_TOKENS} tokens (archive has no segments)"


# ───────────────────────────────── measurement: quality floor ─────────────────────────────────


def default_calibration_path() -> Path:
    return Path(__file__).resolve().parent.parent / "fixtures" / "calibration.json"


def load_calibration(path: str | os.PathLike[str], limit: int | None = None) -> list[dict]:
    """MuSiQue-schema records: {"ctxs": [{"title", "text"}], "question", "answers"}."""
    import json

    p = Path(path)
    try:
        data = json.loads(p.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise UsageError(f"--calibration: no such file: {p}") from None
    except ValueError as e:
        raise UsageError(f"--calibration: {p} is not JSON ({e})") from None
    if isinstance(data, dict):
        data = data.get("data") or data.get("records") or [data]
    records = []
    for i, rec in enumerate(data):
        ok = (isinstance(rec, dict) and isinstance(rec.get("question"), str) and rec.get("ctxs")
              and all(isinstance(c, dict) and "text" in c for c in rec["ctxs"]))
        if not ok:
            raise UsageError(f"--calibration: record {i} of {p} lacks question/ctxs[].text (MuSiQue schema)")
        answers = rec.get("answers") or rec.get("answer") or []
        records.append({**rec, "answers": [answers] if isinstance(answers, str) else list(answers)})
    if limit is not None:
        if limit < 1:
            raise UsageError("--limit must be at least 1")
        records = records[:limit]
    if not records:
        raise UsageError(f"--calibration: {p} holds no records")
    return records


def measure_quality(
    runner,
    records: Sequence[Mapping[str, Any]],
    ratios: Sequence[float],
    max_new_tokens: int = 16,
    check_layer: int = 1,
    tolerance: float | None = None,
    kl_bound_vs_reuse: float | None = None,
    log: Callable[[str], None] | None = None,
) -> dict[str, Any]:
    """Quality of `blend` at each ratio against `full` on calibration records.

    Each context is prefilled alone (as the archive stores it), the prompt is
    assembled with the MuSiQue template, and ``full`` and ``blend`` at every
    ratio are fused from the same segments. Per ratio: mean first-token KL from
    ``full``, mean F1 vs the gold answers (greedy, ``max_new_tokens``), its drop
    from ``full``'s F1, and how often the answer equals ``full``'s.

    ``reuse`` (no recompute) is measured too: its mean KL is the yardstick for
    the KL bound, because an absolute KL means little across models and
    prompt lengths while "blend removes most of reuse's deviation" does. The
    returned ``kl_bound`` is ``kl_bound_vs_reuse × reuse_kl``.

    With ``tolerance`` and ``kl_bound_vs_reuse`` the sweep saves work without changing
    :func:`quality_floor`'s answer: ratios run from the largest down and stop
    after the first that fails (no smaller ratio can be the floor then).
    Ratios never run are listed in ``skipped``.
    """
    from kvblend.fusor import BlendConfig, Segment, fuse
    from kvblend.generate import SamplingConfig, generate
    from kvblend.metrics import f1_score, kl_divergence
    from kvblend.precompute import precompute_kv
    from kvblend.prompt import MUSIQUE_TEMPLATE, assemble_prompt, segment_text_for_kv

    log = log or (lambda _msg: None)
    early_stop = tolerance is not None and kl_bound_vs_reuse is not None
    sampling = SamplingConfig(max_new_tokens=max_new_tokens)
    started = time.perf_counter()

    # the reference: every record's prompt, full's first-token logits and answer
    cache: dict[str, tuple[list[int], Any]] = {}
    cases = []  # (prompt, answers, full_logits, full_answer, full_f1)
    for n, rec in enumerate(records, 1):
        texts = [segment_text_for_kv(f"{c['title']}\n\n{c['text']}" if c.get("title") else c["text"])
                 for c in rec["ctxs"]]
        todo = list(dict.fromkeys(t for t in texts if t not in cache))
        if todo:
            ids = [runner.tokenize(t) for t in todo]
            for t, i, kv in zip(todo, ids, precompute_kv(runner, ids)):
                cache[t] = (i, kv)
        passages = [Segment(cache[t][0], kv=cache[t][1], key=f"ctx{j}") for j, t in enumerate(texts)]
        prompt = assemble_prompt(runner, MUSIQUE_TEMPLATE, rec["question"], passages)
        if runner.max_positions and sum(len(s.token_ids) for s in prompt) + max_new_tokens > runner.max_positions:
            log(f"record {n}: prompt longer than the model's context; skipped")
            continue
        full = fuse(runner, prompt, "full")
        answer = generate(runner, full, sampling).text
        cases.append((prompt, rec["answers"], full.last_logits, answer, f1_score(answer, rec["answers"])))
        del full
        log(f"full {n}/{len(records)}: {sum(len(s.token_ids) for s in prompt)} tokens, F1 {cases[-1][4]:.2f}")
    if not cases:
        raise UsageError("no calibration record fits the model's context")
    mean = statistics.fmean
    f1_full = mean(c[4] for c in cases)
    reuse_kl = mean(kl_divergence(c[2], fuse(runner, c[0], "reuse").last_logits) for c in cases)
    kl_bound = None if kl_bound_vs_reuse is None else kl_bound_vs_reuse * reuse_kl
    log(f"reuse: KL {reuse_kl:.4f}" + ("" if kl_bound is None else f" → KL bound {kl_bound:.4f}"))

    results: dict[float, dict[str, Any]] = {}
    order = sorted(ratios, reverse=True) if early_stop else list(ratios)
    for r in order:
        kls, f1s, same = [], [], []
        for prompt, answers, full_logits, full_answer, _f1 in cases:
            cand = fuse(runner, prompt, "blend", BlendConfig.single(r, check_layer))
            kls.append(kl_divergence(full_logits, cand.last_logits))
            answer = generate(runner, cand, sampling).text
            del cand
            f1s.append(f1_score(answer, answers))
            same.append(float(answer == full_answer))
        res = {"kl": mean(kls), "kl_max": max(kls), "f1": mean(f1s), "f1_drop": f1_full - mean(f1s),
               "same_as_full": mean(same)}
        results[r] = res
        log(f"r={r:g}: KL {res['kl']:.4f}, F1 {res['f1']:.3f} (drop {res['f1_drop']:+.3f}), "
            f"same answer as full {res['same_as_full']:.0%}")
        if early_stop and not _passes(res, tolerance, kl_bound):
            break
    skipped = [r for r in ratios if r not in results]
    return {"records": len(cases), "full_f1": f1_full, "reuse_kl": reuse_kl, "kl_bound": kl_bound,
            "by_ratio": dict(sorted(results.items())),
            "skipped": skipped, "seconds": time.perf_counter() - started}


# ───────────────────────────────── the tune decision ─────────────────────────────────


@dataclass
class TuneDecision:
    ratio: float
    r_quality: float
    r_quality_source: str  # "calibration", "given", "fallback"
    r_hide: float
    L: int
    L_source: str
    t_load_s: float
    t_full_layer_s: float
    t_recompute_s: float  # at the chosen ratio
    table: list[dict[str, Any]]
    profile: str | None
    notes: list[str] = field(default_factory=list)

    @property
    def bottleneck(self) -> str:
        return "loading" if self.t_load_s > self.t_recompute_s else "recompute"

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["bottleneck"] = self.bottleneck
        return d


def decide(
    profile: Mapping[str, Any],
    r_quality: float,
    L: int,
    lengths: Sequence[int] = (512, 1024, 2048, 3072, 4096, 8192),
    r_quality_source: str = "calibration",
    L_source: str = "",
) -> TuneDecision:
    """r = max(r_quality, r_hide(L)) from a location's profile, with the per-length table behind it."""
    model = CostModel.from_any(profile)
    t_load = profile_load_time(profile, L)
    full = model.cost(L)
    r_hide = hide_ratio(t_load, full)
    ratio = choose_ratio(r_quality, r_hide)
    table = ratio_table(profile, sorted({*lengths, L}), ratio, model)
    notes = []
    if r_hide >= 1.0:
        notes.append("loading one layer takes longer than recomputing it in full: blending from this storage "
                     "is slower than `--mode full`; move the archive to faster storage")
    if ratio > r_quality + 1e-12:
        notes.append(f"loading hides recompute up to r = {r_hide:.3f}, so the extra recompute above the quality "
                     f"floor {r_quality:g} is free")
    else:
        notes.append(f"loading hides only r = {r_hide:.3f}: the quality floor {r_quality:g} sets the ratio and "
                     "recompute, not loading, sets the pace")
    return TuneDecision(ratio, r_quality, r_quality_source, r_hide, int(L), L_source, t_load, full,
                        recompute_time(ratio, L, model), table, profile.get("name"), notes)
