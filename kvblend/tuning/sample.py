"""The KV `profile` writes to its scratch file: archived payloads when there are any, else made here.

Read and decompression rates depend on what is stored (zstd compresses real KV
and random numbers very differently), so the best sample is the archive's own
segments. An empty archive gets a real prefill of prose (the calibration
passages), or random-normal fp16 for ``--quick``, encoded with the archive's codec.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from importlib.resources import as_file

import torch

from kvblend.archive import encode_layer
from kvblend.evaluation.records import load_records
from kvblend.model.prefill import precompute_kv
from kvblend.tuning.quality import calibration_file


@dataclass
class SampleKV:
    segments: list[list[bytes]]  # per segment, one encoded payload per layer
    tokens: int
    codec: str
    source: str  # archive, prefill, random-normal fp16

    @property
    def stored_bytes(self) -> int:
        return sum(len(p) for seg in self.segments for p in seg)


def archive_sample(archive, limit_bytes: int) -> SampleKV | None:
    """Real payloads of archived segments (up to `limit_bytes`, one codec), or None for an empty archive."""
    segments, tokens, codec, total = [], 0, None, 0
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
    return SampleKV(segments, tokens, str(codec), "archive") if segments else None


def random_kv_layers(runner, n_tokens: int, seed: int = 0) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Random-normal fp16 K/V of the model's shape, one pair per layer (the --quick stand-in)."""
    g = torch.Generator().manual_seed(seed)
    shape = (runner.n_kv_heads, n_tokens, runner.head_dim)
    return [
        (torch.randn(shape, generator=g).half(), torch.randn(shape, generator=g).half()) for _ in range(runner.n_layers)
    ]


def sample_text() -> str:
    """Prose to prefill for real-looking KV: the bundled calibration passages."""
    with as_file(calibration_file()) as path:
        records = load_records(path)
    return "\n\n".join(sorted({text for rec in records for _, text in rec.passages}))


def prefill_kv_layers(runner, n_tokens: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """KV of a real prefill of `n_tokens` tokens of prose, in the archive's storage dtype."""
    ids = runner.tokenize(sample_text())
    while len(ids) < n_tokens:
        ids = ids + ids
    return precompute_kv(runner, [ids[:n_tokens]])[0]


def sample_segments(runner, archive, settings, codec: str, level: int, log: Callable[[str], None]) -> SampleKV:
    """The archive's payloads, else one segment of `settings.sample` KV encoded with `codec`."""
    found = archive_sample(archive, settings.scratch_bytes)
    if found is not None:
        return found
    log(f"sample KV: {settings.sample} ({settings.sample_tokens} tokens)")
    if settings.sample == "prefill":
        layers, source = prefill_kv_layers(runner, settings.sample_tokens), "prefill"
    else:
        layers, source = random_kv_layers(runner, settings.sample_tokens), "random-normal fp16"
    return SampleKV([[encode_layer(k, v, codec, level) for k, v in layers]], settings.sample_tokens, codec, source)
