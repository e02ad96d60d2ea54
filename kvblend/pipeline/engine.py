"""The engine: what the CLI and the Python API call. CLI → pipeline → archive / model / fusion.

`Engine` owns one archive and (lazily) one model, and the settings that make an
archive key. The workflows live next door — ingest.py (documents → archived KV)
and query.py (question → answer) — and know nothing about terminals: progress
and tokens leave through callbacks.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Callable, Iterable, Sequence

from kvblend.archive import Archive, SegmentRecord, codec_settings, resolve_archive_path, segment_key
from kvblend.defaults import (
    DEFAULT_BATCH_TOKENS,
    DEFAULT_CHECK_LAYERS,
    DEFAULT_CHUNK_TOKENS,
    DEFAULT_CODEC,
    DEFAULT_LEVEL,
    DEFAULT_RATIO,
    DEFAULT_SINK,
    SINK_TOKENS,
    SINKS,
)
from kvblend.errors import UsageError
from kvblend.fusion import BlendConfig
from kvblend.model.loading import load_model
from kvblend.model.prefill import storage_dtype
from kvblend.model.runner import ModelRunner
from kvblend.model.source import resolve_model_source, source_fingerprint
from kvblend.pipeline import ingest as ingest_workflow
from kvblend.pipeline import query as query_workflow
from kvblend.pipeline.results import IngestReport, QueryOptions, QueryResult
from kvblend.prompt import template_sink
from kvblend.retrieval import get_embedder
from kvblend.archive.names import tuned_key


class Engine:
    """One archive + one model. Cheap to create: the model loads on first use."""

    def __init__(
        self,
        archive: str | Path | None = None,
        model: str | None = None,
        compute: str | None = None,
        dtype: str | None = None,
        runner: ModelRunner | None = None,
        sink: str = DEFAULT_SINK,
    ):
        if sink not in SINKS:
            raise UsageError(f"--sink must be one of {', '.join(SINKS)}, not {sink!r}")
        self.sink = sink  # how new segments are prefilled (ingest, --store); reading honours each record's own
        self._sink_ids: list[int] | None = None
        self.archive_path = resolve_archive_path(str(archive) if archive else None)
        self.model_spec = model
        self.compute = compute
        self.dtype = dtype
        self._runner = runner
        self._archive: Archive | None = None
        self._doc_index: dict[str, str] | None = None
        self.model_load_s = 0.0
        if runner is not None:
            self.model_name, self.fingerprint = runner.name, runner.fingerprint
        else:
            source = resolve_model_source(model)
            self.model_name, self.fingerprint = source.name, source_fingerprint(source)

    # ── resources ──
    @property
    def runner(self) -> ModelRunner:
        if self._runner is None:
            t0 = time.perf_counter()
            self._runner = load_model(self.model_spec, self.compute, self.dtype)
            self.model_load_s = time.perf_counter() - t0
        return self._runner

    def archive(self, create: bool = True) -> Archive:
        if self._archive is None:
            # defer_binding: the model is checked now but recorded with the first stored segment,
            # so a run whose model fails to load leaves a new archive bound to nothing.
            self._archive = Archive.open(
                self.archive_path,
                create=create,
                model_name=self.model_name,
                model_fingerprint=self.fingerprint,
                defer_binding=True,
            )
        return self._archive

    def close(self) -> None:
        if self._archive is not None:
            self._archive.close()
            self._archive = None

    def __enter__(self) -> "Engine":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def warm_up(self) -> None:
        """Load model and embedder outside the timed region (TTFT excludes model load)."""
        _ = self.runner
        get_embedder()

    # ── keys ──
    def kv_settings(self, codec: str = DEFAULT_CODEC) -> dict:
        """Everything besides model and tokens that changes the KV a query reads back
        (a lossy codec does; see kvblend.archive.keys.codec_settings)."""
        dtype = str(storage_dtype(self.runner)).replace("torch.", "")
        return {"sink": self.sink_setting(), "dtype": dtype, **codec_settings(codec)}

    def sink_ids(self) -> list[int]:
        """The tokens new segments are prefilled after (their KV dropped): none, or with
        `template` the chat template's first SINK_TOKENS tokens, the same in every prompt, or
        with `prefix` the default template's whole instruction prefix.

        A chunk prefilled alone makes its own first token an attention sink, which it is
        not in the prompt; a short fixed sink takes that role instead (APE, CacheFocus).
        """
        if self.sink == "none":
            return []
        if self._sink_ids is None:
            self._sink_ids = template_sink(self.runner, SINK_TOKENS if self.sink == "template" else None)
        return self._sink_ids

    def sink_setting(self) -> str:
        """The sink's part of a segment key: "alone" (keys of archives made before sinks existed), or the sink's tokens."""
        ids = self.sink_ids()
        return "alone" if not ids else "tokens:" + ",".join(map(str, ids))

    def key_of(self, token_ids: Sequence[int], codec: str = DEFAULT_CODEC) -> str:
        """The archive key of these tokens' KV under this model and settings: one scheme for
        ingested segments, stored context files and the instruction prefix alike."""
        return segment_key(self.fingerprint, token_ids, self.kv_settings(codec))

    def refresh(self) -> None:
        """Forget what was cached from the index, so documents another process ingested
        since are seen: a long-running server calls this before each request."""
        self._doc_index = None

    def document_of(self, key: str) -> str | None:
        """The path of a document holding segment `key` (indexed once per engine)."""
        if self._doc_index is None:
            self._doc_index = {k: d.path for d in self.archive(create=False).iter_documents() for k in d.segment_keys}
        return self._doc_index.get(key)

    # ── workflows ──
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
        return ingest_workflow.ingest_paths(self, paths, chunk_tokens, codec, level, batch_tokens, wait_for_writer, on_progress)

    def store_texts(self, texts: Sequence[str], codec: str = DEFAULT_CODEC,
                    level: int = DEFAULT_LEVEL) -> list[SegmentRecord]:
        """Archive exact texts as segments (no splitting): for --context-file --store and the bench."""
        return ingest_workflow.store_texts(self, texts, codec, level)

    def query(
        self,
        question: str,
        opts: QueryOptions | None = None,
        on_token: Callable[[str], None] | None = None,
        on_warning: Callable[[str], None] | None = None,
    ) -> QueryResult:
        """Answer `question` from archived segments with the chosen mode."""
        return query_workflow.run_query(self, question, opts or QueryOptions(), on_token, on_warning)

    # ── blend settings ──
    def blend_config(self, opts: QueryOptions) -> tuple[BlendConfig, float]:
        """The blend settings a query runs with, and the ratio it reports."""
        ratio = opts.ratio if opts.ratio is not None else self.tuned_ratio(opts.select) or DEFAULT_RATIO
        layers = tuple(opts.check_layers or DEFAULT_CHECK_LAYERS)
        if len(layers) == 1:
            cfg = BlendConfig.single(ratio, layers[0], opts.deviation, opts.select)
        else:
            cfg = BlendConfig.gradual(ratio, layers, opts.deviation, opts.select)
        cfg.validate(self.runner.n_layers)
        return cfg, ratio

    def tuned_ratio(self, select: str) -> float | None:
        """The ratio `kvblend tune` stored for this model, compute device and archive location, if it was
        measured for the selection policy `select` (a floor found for one policy says nothing of another)."""
        if self._archive is None and not Archive.exists(self.archive_path):
            return None  # no archive yet: nothing was tuned, and asking must not create one
        entry = self.archive().get_tuned(tuned_key(self.model_name, self.runner.device.type, self.archive_path))
        if not entry:
            return None
        if not isinstance(entry, dict):  # a TunedSetting
            entry = {"ratio": entry.ratio, "select": entry.select}
        if entry.get("select", "hkvd") != select:  # stored before policies existed: measured with hkvd
            return None
        return float(entry["ratio"])
