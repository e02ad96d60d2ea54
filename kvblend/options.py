"""What a user can ask for, typed: the choices as enums and the options of a query, checked in one place.

Every command, the Python API and the server build a :class:`QueryOptions` and
call its :meth:`~QueryOptions.validate` before any model loads, so a bad value
is the same one-line error wherever it comes from. The enums are what typer
shows as choices (``--mode [full|prefix|reuse|blend]``) and what the server's
schema checks against; their values are the words users type.

No torch and nothing above the bottom layer is imported here (kvblend.defaults
and kvblend.errors only): `kvblend --help` renders these choices without
loading a model.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from enum import StrEnum

from kvblend.defaults import (
    DEFAULT_CODEC,
    DEFAULT_DEVIATION,
    DEFAULT_MAX_NEW_TOKENS,
    DEFAULT_MODE,
    DEFAULT_PREFETCH_DEPTH,
    DEFAULT_SELECT,
    DEFAULT_TOP_K,
)
from kvblend.errors import UsageError


class Mode(StrEnum):
    """How a prompt's KV is built (design.md §1)."""

    full = "full"  # every token, every layer: the reference
    prefix = "prefix"  # only a cached first segment reused
    reuse = "reuse"  # every cached segment's KV as is
    blend = "blend"  # cached KV, the tokens that matter recomputed


class Select(StrEnum):
    """Blend's token selection policy (kvblend.fusion.policies): which cached tokens it recomputes."""

    hkvd = "hkvd"
    heads = "heads"
    question = "question"
    question_hkvd = "question+hkvd"
    probe = "probe"

    @property
    def scores_before_layer_0(self) -> bool:
        """Whether the policy scores in a pass of its own and so may select before layer 0 (a token's
        layer-0 KV does not depend on the others: no layer's KV can rank them there)."""
        return self is Select.probe


class Deviation(StrEnum):
    """HKVD's measure of how far a token's cached KV is from its fresh KV."""

    k = "k"
    v = "v"
    kv = "kv"


class Sink(StrEnum):
    """What a segment is prefilled after (its KV dropped): nothing, the template's first tokens, or the
    default template's whole instruction prefix."""

    none = "none"
    template = "template"
    prefix = "prefix"


class ComputeDtype(StrEnum):
    """The dtype the model computes in (vLLM's `--dtype`); unset: fp32 on CPU, bf16 on CUDA.

    bf16 halves what a decode step reads and runs natively where a CPU has AMX or AVX512-BF16, so it
    can be much faster than fp32; without AVX-512 it is several times slower, and its answers drift
    further from fp32's (see BENCHMARKS.md). `auto`: what `kvblend profile` measured fastest on this
    machine among the dtypes within fidelity bounds of fp32 (the device's default where none was).
    """

    auto = "auto"
    fp32 = "fp32"
    bf16 = "bf16"
    fp16 = "fp16"


class WeightsFormat(StrEnum):
    """How decode steps read the linear layers' weights (llama.cpp's and vLLM's quantization choice;
    kvblend.model.weights). `auto`: what `kvblend profile` measured fastest on this machine."""

    auto = "auto"
    fp32 = "fp32"
    bf16 = "bf16"
    int8 = "int8"
    int4 = "int4"
    gguf = "gguf"  # a GGUF's own blocks, exactly (kvblend.model.gguf_blocks)


class Codec(StrEnum):
    """How a segment's KV is stored (kvblend.archive.codec); `lossless` names the default lossless codec."""

    lossless = "lossless"
    zstd_shuffle = "zstd-shuffle"
    zstd = "zstd"
    int8 = "int8"
    int4 = "int4"

    @property
    def canonical(self) -> str:
        """The name records hold (aliases resolved)."""
        return DEFAULT_CODEC if self is Codec.lossless else self.value


MODES: tuple[str, ...] = tuple(m.value for m in Mode)
SELECTIONS: tuple[str, ...] = tuple(s.value for s in Select)
DEVIATIONS: tuple[str, ...] = tuple(d.value for d in Deviation)
SINKS: tuple[str, ...] = tuple(s.value for s in Sink)


def choice(enum: type[StrEnum], value: object, flag: str) -> StrEnum:
    """`value` as a member of `enum`, or a usage error naming the flag and every choice."""
    try:
        return enum(str(value)) if isinstance(value, str) else enum(value)  # type: ignore[arg-type]
    except ValueError:
        names = ", ".join(m.value for m in enum)
        raise UsageError(f"{flag} must be one of {names}, not {value!r}") from None


def check_ratio(ratio: float, flag: str = "--ratio") -> float:
    """A recompute ratio in (0, 1]; NaN compares false with everything, so the check is written to fail for it."""
    if not (isinstance(ratio, (int, float)) and not isinstance(ratio, bool) and 0.0 < ratio <= 1.0):
        raise UsageError(f"{flag} must be in (0, 1], not {ratio}")
    return float(ratio)


def check_check_layers(layers: tuple[int, ...], select: Select, flag: str = "--check-layers") -> tuple[int, ...]:
    """Distinct ascending check layers; layer 0 only for a policy that scores before it (the model's depth is
    checked by BlendConfig.validate once the model is known)."""
    if not layers:
        raise UsageError(f"{flag} needs at least one layer")
    if list(layers) != sorted(set(layers)) or layers[0] < 0:
        raise UsageError(f"{flag} must be distinct, ascending layer numbers >= 0, not {','.join(map(str, layers))}")
    if layers[0] == 0 and not select.scores_before_layer_0:
        raise UsageError(
            f"{flag} 0 cannot tell which tokens matter for --select {select}: a token's layer-0 KV "
            "does not depend on the other tokens; use 1 or deeper (or --select probe)"
        )
    return layers


@dataclass(frozen=True)
class PromptTemplate:
    """Where passages and question go. `{question}` is filled into `after_passages`."""

    system: str = "You are a helpful assistant. Answer using only the passages you are given."
    before_passages: str = "Read the passages, then answer the question.\nPassages:\n"
    after_passages: str = "\nQuestion: {question}\nAnswer in a few words."


# The paper's MuSiQue layout (design §5, shared/data/README.md), inside the chat template.
MUSIQUE_TEMPLATE = PromptTemplate(
    system="You are a helpful assistant.",
    before_passages=(
        "You will be asked a question after reading several passages. Please directly answer the "
        "question based on the given passages. Do NOT repeat the question. The answer should be "
        "within 5 words.\nPassages:\n"
    ),
    after_passages=(
        "\n\nAnswer the question directly based on the given passages. Do NOT repeat the question. "
        "The answer should be within 5 words. \nQuestion: {question}\nAnswer:"
    ),
)

#: The templates `bench --template` names (and reports name), by name.
NAMED_TEMPLATES: dict[str, PromptTemplate] = {"musique": MUSIQUE_TEMPLATE, "default": PromptTemplate()}


@dataclass(frozen=True)
class SamplingConfig:
    """Greedy by default (temperature 0); temperature/top_p for sampling."""

    max_new_tokens: int = DEFAULT_MAX_NEW_TOKENS
    temperature: float = 0.0
    top_p: float = 1.0
    seed: int | None = None

    def validate(self) -> None:
        """Refuse values the sampler cannot use, before any model loads.

        NaN compares false with everything, so each check is written to fail
        for it; inf would make the softmax all NaN (a traceback mid-decode).
        """
        if self.max_new_tokens < 1:
            raise UsageError(f"--max-tokens must be at least 1, not {self.max_new_tokens}")
        if not (math.isfinite(self.temperature) and self.temperature >= 0):
            raise UsageError(f"--temperature must be a finite number >= 0 (0 = greedy), not {self.temperature}")
        if not (math.isfinite(self.top_p) and 0 < self.top_p <= 1):
            raise UsageError(f"--top-p must be in (0, 1], not {self.top_p}")
        if self.seed is not None and not 0 <= self.seed < 2**63:
            raise UsageError(f"--seed must be between 0 and 2^63-1, not {self.seed}")

    @property
    def greedy(self) -> bool:
        """Below vLLM's 1e-5 sampling is greedy: the distribution is a point mass on the argmax long before
        logits / temperature overflow fp32 (a server hung on temperature 1e-39, sampling from inf)."""
        return self.temperature < 1e-5


@dataclass(frozen=True)
class QueryOptions:
    """Everything a query can be told; the defaults are what `kvblend query` does unflagged.

    Strings are accepted where an enum is declared (``QueryOptions(mode="full")``) and
    lists where a tuple is: both are normalised on construction, so options compare
    and hash by value. An unknown word is reported by :meth:`validate`, with the flag's
    vocabulary, not by the constructor.
    """

    mode: str = Mode(DEFAULT_MODE)  # a Mode (a plain string is converted on construction); likewise below
    ratio: float | None = None  # None: tuned ratio if any, else DEFAULT_RATIO
    check_layers: Sequence[int] | None = None
    deviation: str = Deviation(DEFAULT_DEVIATION)
    select: str = Select(DEFAULT_SELECT)
    top_k: int = DEFAULT_TOP_K
    docs: Sequence[str] = ()  # tuples once constructed (lists are converted), so options hash by value
    segment_keys: Sequence[str] = ()
    context_texts: Sequence[str] = ()
    store_context: bool = False
    template: PromptTemplate = field(default_factory=PromptTemplate)
    sampling: SamplingConfig = field(default_factory=SamplingConfig)
    prefetch_depth: int = DEFAULT_PREFETCH_DEPTH
    loader_overlap: bool | None = None  # build layers on loader threads; None: where cores are spare
    cache_prefix: bool = True  # reuse (and after first use, archive) the instruction prefix's exact KV
    restore_missing: bool = True  # a segment whose KV could not be read (evicted, damaged) is stored again
    max_stored_tokens: int | None = None  # new passages stored by one query, at most (None: no bound)
    keep_step_logits: bool = False
    forced_tokens: Sequence[int] | None = None

    def __post_init__(self) -> None:
        for name, enum in (("mode", Mode), ("deviation", Deviation), ("select", Select)):
            value = getattr(self, name)
            if not isinstance(value, enum) and value in {m.value for m in enum}:
                object.__setattr__(self, name, enum(value))
        for name in ("docs", "segment_keys", "context_texts", "check_layers", "forced_tokens"):
            value = getattr(self, name)
            if isinstance(value, list):
                object.__setattr__(self, name, tuple(value))

    def validate(self) -> QueryOptions:
        """Refuse what no query can run, in the flags' words; returns self, so a caller can chain it."""
        choice(Mode, self.mode, "--mode")
        select = choice(Select, self.select, "--select")
        choice(Deviation, self.deviation, "--deviation")
        if self.ratio is not None:
            check_ratio(self.ratio)
        if self.check_layers is not None:
            check_check_layers(tuple(self.check_layers), Select(select))
        if self.top_k < 0 or (self.top_k == 0 and not (self.docs or self.segment_keys or self.context_texts)):
            raise UsageError(f"--top-k must be at least 1 (0 only beside pinned passages), not {self.top_k}")
        if self.prefetch_depth < 1:
            raise UsageError("prefetch depth must be at least 1")
        self.sampling.validate()
        return self
