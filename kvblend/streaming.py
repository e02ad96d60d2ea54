"""Layer streaming: load layer i+1's cached KV from the archive while the fusor computes layer i.

A producer thread walks the layers the fusor will ask for, in order. For each
layer it reads and decompresses every cached segment's blob slice (a small
thread pool: file reads and zstd release the GIL), re-positions K to the
segment's offset in this prompt, lays the layer out for the whole prompt and
hands it over. A semaphore of `depth` slots bounds how many assembled layers
exist at once, so memory is a few layers, never the whole prompt's KV; the
high-water mark is recorded so tests can hold us to it.

On CUDA the decoded tensors are pinned and copied with non_blocking=True on a
side stream; the fusor waits on an event, not on the whole device.

A blob that is missing, truncated or fails its checksum raises
SegmentUnavailable in the fusor's thread, naming the segment: the engine then
recomputes that segment instead of trusting bad data.
"""

from __future__ import annotations

import queue
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Sequence

import torch

from kvblend.archive_format import Archive
from kvblend.errors import CorruptBlobError, KvblendError
from kvblend.fusor import Segment, assemble_layer, effective_cached
from kvblend.model import LayerKV, ModelRunner

DEFAULT_PREFETCH_DEPTH = 2


class SegmentUnavailable(KvblendError):
    """A cached segment's blob could not be used; recompute it."""

    def __init__(self, key: str, reason: str):
        super().__init__(f"segment {key[:12]}: {reason}")
        self.key = key
        self.reason = reason


@dataclass
class StreamStats:
    """What loading cost: the fusor's wait is the number that matters for TTFT."""

    wait_s: float = 0.0
    read_s: float = 0.0
    decompress_s: float = 0.0
    bytes_read: int = 0
    layers_loaded: int = 0
    high_water: int = 0
    per_layer_wait_s: list[float] = field(default_factory=list)


def layers_needed(mode: str, first_check_layer: int, n_layers: int) -> list[int]:
    """The layers whose cached KV the fusor will ask for, in order."""
    if mode == "full":
        return []
    if mode == "blend":
        return list(range(first_check_layer, n_layers))
    return list(range(n_layers))


class ArchiveFeed:
    """A CachedKVFeed that streams from the archive with bounded prefetch."""

    def __init__(
        self,
        runner: ModelRunner,
        archive: Archive,
        segments: Sequence[Segment],
        records: dict[str, object],
        offsets: Sequence[int],
        layers: Sequence[int],
        mode: str = "blend",
        depth: int = DEFAULT_PREFETCH_DEPTH,
        workers: int = 2,
    ):
        self.runner = runner
        self.archive = archive
        self.segments = list(segments)
        self.use = effective_cached(self.segments, mode)  # prefix mode loads only the first segment
        self.records = records
        self.offsets = list(offsets)
        self.total = sum(len(s.token_ids) for s in segments)
        self.layers = list(layers)
        self.depth = max(1, depth)
        self.stats = StreamStats()
        self._slots = threading.Semaphore(self.depth)
        self._held = 0
        self._held_lock = threading.Lock()
        self._queue: queue.Queue = queue.Queue()
        self._stop = threading.Event()
        self._pool = ThreadPoolExecutor(max_workers=max(1, workers), thread_name_prefix="kvblend-load")
        self._cuda = runner.device.type == "cuda"
        self._stream = torch.cuda.Stream(device=runner.device) if self._cuda else None
        self._thread = threading.Thread(target=self._produce, name="kvblend-stream", daemon=True)
        self._started = False

    # ── CachedKVFeed ──
    @property
    def wait_s(self) -> float:
        return self.stats.wait_s

    def start(self) -> "ArchiveFeed":
        if not self._started:
            self._started = True
            self._thread.start()
        return self

    def layer(self, index: int) -> LayerKV:
        self.start()
        t0 = time.perf_counter()
        got_index, payload, event = self._queue.get()
        waited = time.perf_counter() - t0
        self.stats.wait_s += waited
        self.stats.per_layer_wait_s.append(waited)
        with self._held_lock:
            self._held -= 1
        self._slots.release()
        if isinstance(payload, BaseException):
            self.close()
            raise payload
        if got_index != index:
            self.close()
            raise RuntimeError(f"layer stream out of order: wanted {index}, got {got_index}")
        if event is not None:
            torch.cuda.current_stream(self.runner.device).wait_event(event)
            for t in payload:
                t.record_stream(torch.cuda.current_stream(self.runner.device))
        return payload

    def close(self) -> None:
        self._stop.set()
        # Unblock a producer waiting for a slot.
        for _ in range(self.depth):
            self._slots.release()
        self._pool.shutdown(wait=False, cancel_futures=True)

    def __enter__(self) -> "ArchiveFeed":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.close()

    # ── producer ──
    def _produce(self) -> None:
        for index in self.layers:
            self._slots.acquire()
            if self._stop.is_set():
                return
            with self._held_lock:
                self._held += 1
                self.stats.high_water = max(self.stats.high_water, self._held)
            try:
                payload, event = self._load_layer(index)
            except BaseException as exc:  # handed to the fusor's thread, raised there
                self._queue.put((index, exc, None))
                return
            self._queue.put((index, payload, event))

    def _fetch(self, seg: Segment, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        record = self.records[seg.key]
        t0 = time.perf_counter()
        try:
            raw = self.archive.read_layer_raw(record, index)
        except CorruptBlobError as exc:
            raise SegmentUnavailable(seg.key, str(exc)) from exc
        except OSError as exc:
            raise SegmentUnavailable(seg.key, f"unreadable blob ({exc.strerror or exc})") from exc
        t1 = time.perf_counter()
        try:
            k, v = self.archive.decode(record, index, raw)
        except CorruptBlobError as exc:
            raise SegmentUnavailable(seg.key, str(exc)) from exc
        t2 = time.perf_counter()
        self.stats.read_s += t1 - t0
        self.stats.decompress_s += t2 - t1
        self.stats.bytes_read += len(raw)
        if self._cuda:
            k, v = k.pin_memory(), v.pin_memory()
        return k, v

    def _load_layer(self, index: int):
        cached = [(i, seg) for i, seg in enumerate(self.segments) if self.use[i]]
        futures = {i: self._pool.submit(self._fetch, seg, index) for i, seg in cached}
        fetched = {i: f.result() for i, f in futures.items()}
        self.stats.layers_loaded += 1

        def layer_of(i: int, seg: Segment, _layer: int):
            return fetched.get(i)

        if self._stream is not None:
            with torch.cuda.stream(self._stream):
                kv = assemble_layer(self.runner, self.segments, self.offsets, self.total, index, layer_of)
                event = torch.cuda.Event()
                event.record(self._stream)
            return kv, event
        return assemble_layer(self.runner, self.segments, self.offsets, self.total, index, layer_of), None
