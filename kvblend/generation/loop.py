"""The decode loop: `step` advances a batch of sequences by one token; `generate` steps one sequence to its end.

`step` is the only place a decode step happens. The server calls it on every
sequence that is decoding (kvblend.serve.executor) and `kvblend query`, bench
and tune call `generate`, which calls it on their one sequence: the same
model step (kvblend.generation.decode) and the same output processor
(kvblend.generation.sequence) either way.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from kvblend.errors import NonFiniteLogitsError
from kvblend.fusion.fuse import FusionResult
from kvblend.generation.decode import decode_step
from kvblend.generation.sequence import Delta, Generation, OutputParams, Sequence
from kvblend.model.runner import ModelRunner
from kvblend.options import SamplingConfig


@torch.inference_mode()
def step(runner: ModelRunner, sequences: list[Sequence]) -> list[Delta]:
    """One token for each unfinished sequence: one batched forward pass (each over its own KV), then each
    sequence's sampling, stop rules and detokenizing. Returns what each sequence adds, in order."""
    logits = decode_step(runner, [s.decode_state() for s in sequences], [s.last_token for s in sequences])
    deltas = []
    for s, row in zip(sequences, logits):
        try:
            deltas.append(s.accept(row))
        except NonFiniteLogitsError as e:  # this sequence ends with its error; the batch's others go on
            s.error, s.finish = e, "error"
            deltas.append(Delta(""))
    return deltas


@torch.inference_mode()
def generate(
    runner: ModelRunner,
    fused: FusionResult,
    sampling: SamplingConfig = SamplingConfig(),
    on_token: Callable[[str], None] | None = None,
    keep_logits: bool = False,
    forced_tokens: list[int] | None = None,
) -> Generation:
    """Decode from `fused`: the first token from its logits, then one `step` per token. `on_token` gets the
    text as it becomes whole characters; `forced_tokens` teacher-forces a given continuation (for answer KL)."""
    sampling.validate()
    forced = tuple(forced_tokens) if forced_tokens is not None else None
    seq = Sequence(runner, fused, OutputParams(sampling, forced_tokens=forced, keep_logits=keep_logits))
    delta = seq.accept(fused.last_logits)
    while True:
        if on_token is not None and delta.text:
            on_token(delta.text)
        if seq.finished:
            break
        [delta] = step(runner, [seq])
        if seq.error is not None:
            seq.release()
            raise seq.error
    seq.release()
    return seq.generation(seq.text.strip())
