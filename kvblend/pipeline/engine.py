"""The engine: what the CLI and the Python API call. CLI → pipeline → archive / model / fusion.

`Engine` is the pipeline's resources (resources.py: one archive, one lazily
loaded model, the key scheme) plus its workflows: ingest.py (documents →
archived KV) and query.py (question → answer). The workflows take the
resources, not the engine, so imports run one way; they know nothing about
terminals: progress and tokens leave through callbacks.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from pathlib import Path

from kvblend.archive import SegmentRecord
from kvblend.defaults import (
    DEFAULT_BATCH_TOKENS,
    DEFAULT_CHUNK_TOKENS,
    DEFAULT_CODEC,
    DEFAULT_LEVEL,
)
from kvblend.options import QueryOptions
from kvblend.pipeline import ingest as ingest_workflow
from kvblend.pipeline import query as query_workflow
from kvblend.pipeline.resources import Resources
from kvblend.pipeline.results import IngestPlan, IngestReport, QueryResult


class Engine(Resources):
    """One archive + one model, and what can be done with them. Cheap to create: the model loads on first use."""

    def ingest(
        self,
        paths: Iterable[str | Path],
        chunk_tokens: int = DEFAULT_CHUNK_TOKENS,
        codec: str = DEFAULT_CODEC,
        level: int = DEFAULT_LEVEL,
        batch_tokens: int = DEFAULT_BATCH_TOKENS,
        wait_for_writer: bool | float = False,
        on_progress: Callable[[dict], None] | None = None,
    ) -> IngestReport:
        """Segment, prefill and archive documents; unchanged segments are not recomputed."""
        return ingest_workflow.ingest_paths(
            self, paths, chunk_tokens, codec, level, batch_tokens, wait_for_writer, on_progress
        )

    def plan_ingest(
        self,
        paths: Iterable[str | Path],
        chunk_tokens: int = DEFAULT_CHUNK_TOKENS,
        codec: str = DEFAULT_CODEC,
        level: int = DEFAULT_LEVEL,
        on_progress: Callable[[dict], None] | None = None,
    ) -> IngestPlan:
        """What :meth:`ingest` would prefill and store, and its cost estimated here; nothing is written."""
        return ingest_workflow.plan_ingest(self, paths, chunk_tokens, codec, level, on_progress)

    def store_texts(
        self, texts: Sequence[str], codec: str = DEFAULT_CODEC, level: int = DEFAULT_LEVEL
    ) -> list[SegmentRecord]:
        """Archive exact texts as segments (no splitting): for --context-file --store and the bench."""
        return ingest_workflow.store_texts(self, texts, codec, level)

    def query(
        self,
        question: str,
        opts: QueryOptions | None = None,
        on_token: Callable[[str], None] | None = None,
        on_warning: Callable[[str], None] | None = None,
    ) -> QueryResult:
        """Answer `question` from archived segments with the chosen mode, then run the writes it queued (archive
        the prefix, touch, restore) before returning, so the next query finds them, as when they ran inline;
        a failed write is a warning in the result, never a lost answer."""
        result = query_workflow.run_query(self, question, opts or QueryOptions(), on_token, on_warning)
        self.writes.drain(result.warnings.append if on_warning is None else _both(result.warnings.append, on_warning))
        return result


def _both(first: Callable[[str], None], second: Callable[[str], None]) -> Callable[[str], None]:
    def warn(msg: str) -> None:
        first(msg)
        second(msg)

    return warn
