"""The archive feed: load layer i+1's cached KV from the archive while the fusor computes layer i.

Loading a layer has two stages: *fetch* (pread + checksum of every needed
segment's compressed slice: I/O, little CPU) and *build* (decompress, widen,
re-position K to the segment's offset in this prompt, lay the layer out for
the whole prompt: CPU). A producer thread fetches ahead, in layer order; a
semaphore of `depth` slots bounds how many fetched layers exist at once, so
memory is a few layers, never the whole prompt's KV, and the high-water mark
is recorded so tests can hold us to it.

Where the build stage runs depends on whether it can overlap compute for free:

- **overlap** (CUDA, or a CPU host with cores the fusor does not use): the
  producer also builds, so layer i+1 is ready when layer i finishes. On CUDA
  the decoded tensors are pinned and copied with non_blocking=True on a side
  stream; the fusor waits on an event, not on the whole device.
- **on demand** (CPU compute on every core, e.g. this project's 2-core hosts):
  building on a third thread would preempt one of torch's threads, and every
  parallel op then waits for the preempted one, which measured slower than
  not overlapping at all (BENCHMARKS.md, notes). So only I/O runs ahead, and
  the layer is built in the fusor's thread when it asks for it, while torch's
  threads are idle anyway. That time counts as load wait.

A blob that is missing, truncated or fails its checksum raises
SegmentUnavailable in the fusor's thread, naming the segment: the query pipeline
then recomputes that segment instead of trusting bad data (RecoveringFeed: the
segment's KV prefilled alone, fed from memory from the failed layer on, the
fusion going on where it was). A segment whose `kv` is in memory is never read.
"""

from __future__ import annotations

import os
import queue
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import torch

from kvblend.archive import Archive, SegmentRecord
from kvblend.defaults import DEFAULT_PREFETCH_DEPTH
from kvblend.errors import ArchiveUnavailableError, CorruptBlobError, KvblendError
from kvblend.feeds.memory import assemble_layer
from kvblend.model.runner import ModelRunner
from kvblend.types import LayerKV, Segment


class SegmentUnavailable(KvblendError):
    """A cached segment's blob could not be used; recompute it."""

    def __init__(self, key: str, reason: str, every: bool = False):
        super().__init__(reason if every else f"segment {key[:12]}: {reason}")
        self.key = key
        self.reason = reason
        self.every = every  # the store itself failed: no cached segment can be read


@dataclass
class StreamStats:
    """What loading cost: the fusor's wait is the number that matters for TTFT."""

    wait_s: float = 0.0
    read_s: float = 0.0
    decompress_s: float = 0.0
    build_s: float = 0.0  # decode + dequantize + widen + re-position: stored bytes → prompt-wide layer
    bytes_read: int = 0
    raw_bytes: int = 0  # what bytes_read stands for as uncompressed KV in the stored dtype
    layers_loaded: int = 0
    high_water: int = 0
    build: str = "overlap"  # where decompress + re-position ran: "overlap" or "on-demand"
    per_layer_wait_s: list[float] = field(default_factory=list)


def spare_cores_for_loading(device: torch.device) -> bool:
    """Can building layers overlap compute without taking cores from the fusor?"""
    if device.type == "cuda":
        return True
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        cores = os.cpu_count() or 1
    return cores > torch.get_num_threads()


class ArchiveFeed:
    """A CachedKVFeed that streams from the archive with bounded prefetch."""

    def __init__(
        self,
        runner: ModelRunner,
        archive: Archive,
        segments: Sequence[Segment],
        records: dict[str, SegmentRecord],
        offsets: Sequence[int],
        schedule: dict[int, list[bool]],
        depth: int = DEFAULT_PREFETCH_DEPTH,
        workers: int = 2,
        overlap: bool | None = None,
    ):
        self.runner = runner
        self.archive = archive
        self.segments = list(segments)
        self.schedule = schedule  # layer -> which segments' KV it needs (fusion.feed_schedule)
        self.records = records
        self.offsets = list(offsets)
        self.total = sum(len(s.token_ids) for s in segments)
        self.layers = list(schedule)
        self.depth = max(1, depth)
        self.overlap = spare_cores_for_loading(runner.device) if overlap is None else overlap
        self.stats = StreamStats(build="overlap" if self.overlap else "on-demand")
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

    def start(self) -> ArchiveFeed:
        if not self._started:
            self._started = True
            self._thread.start()
        return self

    def layer(self, index: int) -> LayerKV:
        self.start()
        t0 = time.perf_counter()
        got_index, payload, event = self._queue.get()
        with self._held_lock:
            self._held -= 1
        self._slots.release()
        if isinstance(payload, BaseException):
            self.close()
            raise payload
        if got_index != index:
            self.close()
            raise RuntimeError(f"layer stream out of order: wanted {index}, got {got_index}")
        if not self.overlap:
            try:
                payload = self._build(index, payload)
            except BaseException:
                self.close()
                raise
        waited = time.perf_counter() - t0
        self.stats.wait_s += waited
        self.stats.per_layer_wait_s.append(waited)
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

    def __enter__(self) -> ArchiveFeed:
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

    def _load_layer(self, index: int):
        """The producer's share of a layer: fetch it, and build it too when building overlaps."""
        raw = self._fetch_layer(index)
        self.stats.layers_loaded += 1
        if not self.overlap:
            return raw, None
        if self._stream is not None:
            with torch.cuda.stream(self._stream):
                kv = self._build(index, raw)
                event = torch.cuda.Event()
                event.record(self._stream)
            return kv, event
        return self._build(index, raw), None

    def _fetch_layer(self, index: int) -> dict[int, bytes]:
        """Checksummed encoded payloads of the segments this layer needs: one batched read (a pread each from
        local blobs; one pipelined round trip from Redis)."""
        # a segment whose KV is already in memory (recomputed after its blob failed) is not read again
        needed = [i for i, flag in enumerate(self.schedule[index]) if flag and self.segments[i].kv is None]
        records = [self.records[str(self.segments[i].key)] for i in needed]
        t0 = time.perf_counter()
        try:
            results = self.archive.read_layers_raw(records, index)
        except ArchiveUnavailableError as exc:  # the store went away: every cached segment is recomputed
            raise SegmentUnavailable(records[0].key if records else "", str(exc), every=True) from exc
        except OSError as exc:
            raise SegmentUnavailable(records[0].key, f"unreadable blob ({exc.strerror or exc})") from exc
        self.stats.read_s += time.perf_counter() - t0
        raw: dict[int, bytes] = {}
        for i, rec, result in zip(needed, records, results):
            if isinstance(result, CorruptBlobError):
                raise SegmentUnavailable(rec.key, str(result))
            raw[i] = result
            self.stats.bytes_read += len(result)
            self.stats.raw_bytes += rec.raw_layer_bytes
        return raw

    def _decode(self, seg: Segment, index: int, raw: bytes) -> tuple[torch.Tensor, torch.Tensor]:
        t0 = time.perf_counter()
        try:
            k, v = self.archive.decode(self.records[str(seg.key)], index, raw, lazy=True)  # lossy: still codes
        except CorruptBlobError as exc:
            raise SegmentUnavailable(str(seg.key), str(exc)) from exc
        self.stats.decompress_s += time.perf_counter() - t0
        if self._cuda:
            k, v = k.pin_memory(), v.pin_memory()
        return k, v

    def _build(self, index: int, raw: dict[int, bytes]) -> LayerKV:
        """Decompress, widen and re-position every fetched segment into the prompt-wide layer.

        Ahead of the fusor, segments decode in parallel on the loader pool (zstd releases
        the GIL). On demand, all in this thread: the fusor's torch threads are idle then,
        and a pool measured slower (its threads' torch ops start OpenMP teams of their own).
        A lossy codec's codes are dequantized by assemble_layer as it writes them into place.
        """
        t0 = time.perf_counter()
        if self.overlap:
            decoded = dict(zip(raw, self._pool.map(lambda i: self._decode(self.segments[i], index, raw[i]), raw)))
        else:
            decoded = {i: self._decode(self.segments[i], index, data) for i, data in raw.items()}
        wanted = self.schedule[index]

        def layer_of(i: int, seg: Segment, layer: int) -> LayerKV | None:
            if i in decoded:
                return decoded[i]
            return seg.kv[layer] if seg.kv is not None and wanted[i] else None

        layer = assemble_layer(self.runner, self.segments, self.offsets, self.total, index, layer_of)
        self.stats.build_s += time.perf_counter() - t0
        return layer


class RecoveringFeed:
    """An archive feed that survives a segment failing mid-stream without restarting the fusion.

    When layer l of segment S cannot be read, `recompute(S)` computes S's KV the way ingest stored it
    (prefilled alone, after the same sink: for a lossless codec exactly the archive's bytes), S is fed
    from memory from then on, and a fresh archive feed over layers l.. takes over the stream, so the
    fusor receives layer l as if nothing had happened: no second plan, no layer computed twice. The
    layers before l already came from the archive and equal what S's recomputation gives, so nothing the
    fusion decided there (a selection at a check layer) changes. `recompute` returns None where the
    archive's KV cannot be reproduced (a lossy codec, another sink): the failure is raised, and the
    caller restarts the fusion without S as before. A failure of the store itself (`every`) is raised too.
    """

    def __init__(
        self,
        open_feed: Callable[[dict[int, list[bool]]], ArchiveFeed],
        schedule: dict[int, list[bool]],
        segments: Sequence[Segment],
        recompute: Callable[[Segment], list[LayerKV] | None],
        on_recovered: Callable[[SegmentUnavailable], None] | None = None,
    ):
        self._open, self._schedule, self._segments = open_feed, schedule, list(segments)
        self._recompute, self._on_recovered = recompute, on_recovered
        self.feed = open_feed(schedule)
        self.stats = self.feed.stats
        self.recovered: list[str] = []  # keys of the segments recomputed in place

    @property
    def wait_s(self) -> float:
        return self.stats.wait_s

    def layer(self, index: int) -> LayerKV:
        while True:
            try:
                return self.feed.layer(index)
            except SegmentUnavailable as exc:
                seg = next((s for s in self._segments if s.key == exc.key and s.kv is None), None)
                kv = None if exc.every or seg is None else self._recompute(seg)
                if seg is None or kv is None:
                    raise
                seg.kv = kv
                self.recovered.append(str(seg.key))
                if self._on_recovered is not None:
                    self._on_recovered(exc)
                self.feed.close()
                self.feed = self._open({layer: need for layer, need in self._schedule.items() if layer >= index})
                self.feed.stats = self.stats  # one account of what loading cost, across the feeds
                self.feed.start()

    def __enter__(self) -> RecoveringFeed:
        self.feed.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.feed.close()
