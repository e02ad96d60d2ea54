"""What every workflow works with: one archive and one model, each opened on first use, and the key scheme
they imply.

The workflows (ingest.py, query.py) take a :class:`Resources` and nothing above
it; the :class:`~kvblend.pipeline.engine.Engine` facade is these resources plus
the workflows, so imports run one way: engine → ingest, query → resources.
Opening is lazy because it is expensive and often unneeded: re-ingesting an
unchanged tree never loads the model, and a bad `--archive` fails before it does.
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Self

from kvblend.archive import Archive, KeyScheme, Location, resolve_location
from kvblend.archive.records import TunedRatio, tuned_key
from kvblend.defaults import (
    DEFAULT_CODEC,
    DEFAULT_RATIO,
    DEFAULT_SINK,
    SINK_TOKENS,
)
from kvblend.errors import ArchiveUnavailableError, UsageError
from kvblend.fusion import BlendConfig
from kvblend.model.loading import load_model
from kvblend.model.prefill import storage_dtype
from kvblend.model.runner import ModelRunner
from kvblend.model.source import resolve_model_source, source_fingerprint
from kvblend.model.weights import DEFAULT_DECODE_ROWS, check_weights
from kvblend.options import QueryOptions, Sink, choice
from kvblend.pipeline.writebehind import WriteBehind
from kvblend.prompt import template_sink
from kvblend.retrieval import get_embedder


class Resources:
    """One archive + one model. Cheap to create: the model loads on first use."""

    def __init__(
        self,
        archive: str | Path | Location | None = None,
        model: str | None = None,
        compute: str | None = None,
        dtype: str | None = None,
        runner: ModelRunner | None = None,
        sink: str = DEFAULT_SINK,
        weights: str | None = None,
        decode_rows: int = DEFAULT_DECODE_ROWS,
        cuda_graphs: bool = True,
    ):
        self.sink = choice(Sink, sink, "--sink")  # how new segments are prefilled; reads honour each record's own
        self.location = resolve_location(archive)
        self.model_spec = model
        self.compute = compute
        self.dtype = dtype
        # what decode steps read (kvblend.model.weights): the CLI resolves `auto` from the stored profiles
        self.weights = check_weights(weights, allow_auto=False, allow_native=True)
        self.decode_rows = decode_rows
        self.cuda_graphs = cuda_graphs  # False: `--enforce-eager`
        self._runner = runner
        self._archive: Archive | None = None
        self._keys: KeyScheme | None = None
        self._doc_index: dict[str, tuple[str, dict]] | None = None  # segment key -> (document name, its source)
        self.model_load_s = 0.0
        self.writes = WriteBehind()  # every write a query causes, run after its answer (writebehind.py)
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
            self._runner = load_model(
                self.model_spec, self.compute, self.dtype, self.weights, self.decode_rows, self.cuda_graphs
            )
            self.model_load_s = time.perf_counter() - t0
        return self._runner

    def archive(self, create: bool = True) -> Archive:
        if self._archive is None:
            # defer_binding: the model is checked now but recorded with the first stored segment,
            # so a run whose model fails to load leaves a new archive bound to nothing.
            self._archive = Archive.open(
                self.location,
                create=create,
                model_name=self.model_name,
                model_fingerprint=self.fingerprint,
                defer_binding=True,
            )
        return self._archive

    def close(self) -> None:
        """Run the writes still queued behind answers (nothing a query meant to write is lost), then close."""
        if self.writes:
            self.writes.drain()
        if self._archive is not None:
            self._archive.close()
            self._archive = None

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def warm_up(self) -> None:
        """Load model and embedder outside the timed region (TTFT excludes model load)."""
        _ = self.runner
        get_embedder()

    # ── keys ──
    @property
    def keys(self) -> KeyScheme:
        """How this model and these settings key KV (loads the model: the dtype and the sink come from it)."""
        if self._keys is None:
            dtype = str(storage_dtype(self.runner)).replace("torch.", "")
            self._keys = KeyScheme(self.fingerprint, dtype, tuple(self._sink_tokens()))
        return self._keys

    def sink_ids(self) -> list[int]:
        """The tokens new segments are prefilled after (their KV dropped); see :meth:`_sink_tokens`."""
        return [] if self.sink == Sink.none else list(self.keys.sink_ids)

    def _sink_tokens(self) -> list[int]:
        """The tokens new segments are prefilled after (their KV dropped): none, or with
        `template` the chat template's first SINK_TOKENS tokens, the same in every prompt, or
        with `prefix` the default template's whole instruction prefix.

        A chunk prefilled alone makes its own first token an attention sink, which it is
        not in the prompt; a short fixed sink takes that role instead (APE, CacheFocus).
        """
        if self.sink == Sink.none:
            return []
        if self.runner.tokenizer is None:
            raise UsageError(f"--sink {self.sink.value} takes its tokens from the model's tokenizer: this one has none")
        return template_sink(self.runner, SINK_TOKENS if self.sink == Sink.template else None)

    def prefilled_under_sink(self, extra: Mapping[str, object]) -> bool:
        """Whether a segment whose record carries `extra` was prefilled under this sink.

        By the policy's name where the record has one, so `ingest` skips an unchanged
        document without loading the model (the sink's tokens come from its tokenizer);
        records written before the name was stored are compared by their tokens.
        """
        stored = extra.get("sink", "alone")
        if self.sink == Sink.none:
            return stored == "alone"
        if stored == "alone":
            return False
        if "sink_policy" in extra:
            return extra["sink_policy"] == self.sink.value
        return stored == self.keys.sink_setting

    def kv_settings(self, codec: str = DEFAULT_CODEC) -> dict:
        """Everything besides model and tokens that changes the KV a query reads back."""
        return self.keys.settings(codec)

    def key_of(self, token_ids: Sequence[int], codec: str = DEFAULT_CODEC) -> str:
        """The archive key of these tokens' KV under this model and settings: one scheme for
        ingested segments, stored context files and the instruction prefix alike."""
        return self.keys.key_of(token_ids, codec)

    # ── what the archive holds ──
    def refresh(self) -> None:
        """Forget what was cached from the index, so documents another process ingested
        since are seen: a long-running server calls this before each request."""
        self._doc_index = None

    def document_of(self, key: str) -> str | None:
        """The name of a document holding segment `key` (indexed once per engine)."""
        found = self.origin_of(key)
        return None if found is None else found[0]

    def origin_of(self, key: str) -> tuple[str, dict] | None:
        """The document holding segment `key` and where in it the segment came from (its source:
        ``{"pages", "section", "rows"}``, see DocumentRecord), indexed once per engine. A segment several documents
        share is reported in one of them, the same one every time."""
        if self._doc_index is None:
            self._doc_index = {
                k: (d.display_name, d.source(i))
                for d in self.archive(create=False).iter_documents()
                for i, k in enumerate(d.segment_keys)
            }
        return self._doc_index.get(key)

    # ── blend settings ──
    def blend_config(self, opts: QueryOptions) -> tuple[BlendConfig, float]:
        """The blend settings a query runs with, and the ratio it reports."""
        ratio = opts.ratio if opts.ratio is not None else self.tuned_ratio(opts.select) or DEFAULT_RATIO
        layers = tuple(opts.check_layers or ())  # none: the policy's default (BlendConfig.gradual)
        cfg = BlendConfig.gradual(ratio, layers, opts.deviation, opts.select)
        cfg.validate(self.runner.n_layers)
        return cfg, ratio

    def tuned_ratio(self, select: str) -> float | None:
        """The ratio `kvblend tune` stored for this model, compute device and archive location, if it was
        measured for the selection policy `select` (a floor found for one policy says nothing of another)."""
        if self._archive is None and not Archive.exists(self.location):
            return None  # no archive yet: nothing was tuned, and asking must not create one
        compute = self.runner.device.type
        try:
            # Under the name the archive's model was bound by: the same weights reached by another name (the
            # GGUF's path for `gemma3-270m`) share its fingerprint, and so its archive and tuned ratio (it was
            # silently dropped); then the name given, as settings were stored before. For each, the policy's own
            # key, then the one every policy's setting was stored under before.
            names = dict.fromkeys(n for n in (self.archive().model_name, self.model_name) if n)
            for key in dict.fromkeys(
                k
                for name in names
                for k in (tuned_key(name, compute, self.location, select), tuned_key(name, compute, self.location))
            ):
                tuned = TunedRatio.from_stored(self.archive().get_tuned(key))
                if tuned is not None and tuned.select == select:
                    return tuned.ratio
        except ArchiveUnavailableError:
            pass  # advice, not a requirement: the default ratio answers while the store is away
        return None
