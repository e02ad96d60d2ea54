"""What the pipeline gives back: ingest and query reports (the options it takes are kvblend.options').

Plain dataclasses with `to_dict` for `--json`: the CLI renders them, the
pipeline never prints.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

from kvblend.fusion import FusionResult
from kvblend.generation import Generation
from kvblend.options import QueryOptions

__all__ = ["IngestReport", "QueryOptions", "QueryResult", "SegmentInfo"]


@dataclass
class IngestReport:
    """What an ingest did: documents seen and skipped, segments prefilled or reused, bytes written."""

    documents: int = 0
    documents_unchanged: int = 0
    segments_new: int = 0
    segments_reused: int = 0
    tokens_new: int = 0
    tokens_total: int = 0
    bytes_written: int = 0
    raw_bytes: int = 0
    seconds: float = 0.0
    prefill_seconds: float = 0.0
    model_load_seconds: float = 0.0  # part of `seconds`, left out of the rate
    embeddings_restored: int = 0  # stored segments whose evicted retrieval embeddings were embedded again
    skipped: list[dict] = field(default_factory=list)
    # documents of a JSON(L) file or an archive, read again, that it no longer holds (a line deleted, a member
    # removed): forgotten, or they would be retrieved and cited as if still there
    removed: list[str] = field(default_factory=list)

    @property
    def tokens_per_s(self) -> float:
        """Ingest throughput: new tokens per second of work, not counting the model's one-off load."""
        working = self.seconds - self.model_load_seconds
        return self.tokens_new / working if working > 0 else 0.0

    @property
    def compression_ratio(self) -> float:
        return self.raw_bytes / self.bytes_written if self.bytes_written else 0.0

    def to_dict(self) -> dict:
        d = asdict(self)
        d["tokens_per_s"] = round(self.tokens_per_s, 1)
        d["compression_ratio"] = round(self.compression_ratio, 3)
        return d


@dataclass
class IngestPlan:
    """What an ingest would do (``ingest --dry-run``), nothing written: documents and segments new or already
    archived, and what the new ones would cost, estimated from a few segments prefilled and encoded here."""

    files: int = 0
    documents: int = 0
    documents_unchanged: int = 0
    segments_new: int = 0
    segments_reused: int = 0
    tokens_new: int = 0  # to prefill
    tokens_total: int = 0
    raw_bytes: int = 0  # the new segments' KV as plain 16-bit tensors
    estimated_bytes: int = 0  # as the chosen codec would store it, at the sample's bytes a token
    prefill_tokens_per_s: float = 0.0  # measured on the sample, on this machine, without the model's load
    estimated_seconds: float = 0.0  # tokens_new at that rate (an ingest also embeds and writes: a little more)
    sample_tokens: int = 0  # the new segments measured (the longest, up to ~2,000 tokens in one batch)
    disk_free_bytes: int | None = None  # where a local archive is or would be; None on Redis
    skipped: list[dict] = field(default_factory=list)
    would_remove: list[str] = field(default_factory=list)  # what the ingest would forget (IngestReport.removed)

    @property
    def fits(self) -> bool | None:
        """Whether the estimate fits the free disk space (None: not known, as on Redis)."""
        return None if self.disk_free_bytes is None else self.estimated_bytes <= self.disk_free_bytes

    def to_dict(self) -> dict:
        d = asdict(self)
        d["prefill_tokens_per_s"] = round(self.prefill_tokens_per_s, 1)
        d["estimated_seconds"] = round(self.estimated_seconds, 1)
        d["fits"] = self.fits
        return d


@dataclass
class SegmentInfo:
    """One passage of an answered prompt: where it came from and whether its KV was reused."""

    key: str
    document: str | None
    tokens: int
    cached: bool
    score: float | None = None
    stored: bool = False  # a context text missing from the archive: prefilled alone in this query and stored
    # Where in `document` the passage came from (None: not known, or no such structure): the pages it spans,
    # [first, last] (1-based), the section, the title of the nearest Markdown heading at or before it, and for a
    # spreadsheet or CSV file the rows it holds, [first, last] as the sheet numbers them.
    pages: list[int] | None = None
    section: str | None = None
    rows: list[int] | None = None
    sections: list[str] | None = None  # every section the passage holds, where more than one (section: the first)


@dataclass
class QueryResult:
    """An answer, the prompt it came from, and what it cost (TTFT, load wait, recompute share)."""

    answer: str
    mode: str
    ratio: float | None
    ttft_s: float
    load_wait_s: float
    prompt_tokens: int
    recomputed_tokens: int
    recompute_share: float
    segments: list[SegmentInfo]
    tokens_per_s: float
    timings: dict[str, float]
    warnings: list[str]
    prefix_cached: bool = False
    weights: str = "fp32"  # what the decode steps read (--weights; "auto" resolved)
    dtype: str = "float32"  # what the model computed in (--dtype; "auto" resolved)
    fusion: FusionResult | None = None
    generation: Generation | None = None

    @property
    def stages(self) -> dict[str, float]:
        """Where the fusion's time went (kvblend.fusion.fuse.StageClock), in seconds per stage."""
        return dict(self.fusion.stages) if self.fusion is not None else {}

    def to_dict(self) -> dict:
        return {
            "answer": self.answer,
            "mode": self.mode,
            "ratio": self.ratio,
            "ttft_s": round(self.ttft_s, 4),
            "load_wait_s": round(self.load_wait_s, 4),
            "prompt_tokens": self.prompt_tokens,
            "recomputed_tokens": self.recomputed_tokens,
            "recompute_share": round(self.recompute_share, 4),
            "segments": [asdict(s) for s in self.segments],
            "tokens_per_s": round(self.tokens_per_s, 2),
            "prefix_cached": self.prefix_cached,
            "weights": self.weights,
            "dtype": self.dtype,
            "timings": {k: round(v, 4) for k, v in self.timings.items()},
            "warnings": self.warnings,
            "stages": {k: round(v, 4) for k, v in self.stages.items()},
        }
