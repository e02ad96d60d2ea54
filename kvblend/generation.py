"""Generation from a fused KV: first token from the fusor's logits, then ordinary decoding.

The fused KV goes into preallocated per-layer buffers and every further token
is one pass of the same layer steps the fusor uses (kvblend.model.runner). Our own
loop (rather than `generate`) starts from logits we already have, streams
tokens to a callback, times the first token exactly, and avoids DynamicCache's
per-step concatenation (9 tok/s → see BENCHMARKS.md on a 3k-token prompt).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable

import torch

from kvblend.fusion.fuse import FusionResult
from kvblend.model.runner import ModelRunner
from kvblend.options import SamplingConfig


@dataclass
class Generation:
    token_ids: list[int]
    text: str
    first_token_s: float  # from the start of decoding to the first token being known
    decode_s: float
    stopped_on_eos: bool
    step_logits: list[torch.Tensor] = field(default_factory=list)

    @property
    def tokens_per_s(self) -> float:
        rest = len(self.token_ids) - 1
        return rest / self.decode_s if rest > 0 and self.decode_s > 0 else 0.0


def next_token(logits: torch.Tensor, sampling: SamplingConfig, generator: torch.Generator | None) -> int:
    """Greedy argmax, or temperature + nucleus sampling."""
    if sampling.temperature <= 0:
        return int(torch.argmax(logits))
    probs = torch.softmax(logits.float() / sampling.temperature, dim=-1)
    if sampling.top_p < 1.0:
        sorted_p, order = torch.sort(probs, descending=True)
        keep = torch.cumsum(sorted_p, dim=-1) - sorted_p < sampling.top_p
        sorted_p = torch.where(keep, sorted_p, torch.zeros_like(sorted_p))
        probs = torch.zeros_like(probs).scatter(-1, order, sorted_p)
    return int(torch.multinomial(probs / probs.sum(), 1, generator=generator))


class DecodeState:
    """The prompt's KV in preallocated per-layer buffers, grown in place as tokens are decoded.

    A DynamicCache concatenates on every step (O(prompt) copies per token); writing
    into a buffer sized prompt + max_new_tokens keeps a decode step O(1) in copies.
    """

    def __init__(self, runner: ModelRunner, fused: FusionResult, max_new_tokens: int):
        self.runner = runner
        self.length = len(fused.token_ids)
        capacity = self.length + max_new_tokens
        self.k: list[torch.Tensor] = []
        self.v: list[torch.Tensor] = []
        for k, v in fused.kv:
            kb = torch.empty((*k.shape[:2], capacity, k.shape[3]), dtype=runner.dtype, device=runner.device)
            vb = torch.empty_like(kb)
            kb[:, :, : self.length] = k
            vb[:, :, : self.length] = v
            self.k.append(kb)
            self.v.append(vb)

    def step(self, token: int) -> torch.Tensor:
        """Feed one token at the next position; return the next-token logits."""
        r = self.runner
        p = self.length
        pos = torch.tensor([[p]], device=r.device)
        cos, sin = r.rope(pos)
        hidden = r.embed(torch.tensor([[token]], device=r.device))
        for layer in range(r.n_layers):
            q, k, v = r.project_qkv(layer, hidden, cos, sin)
            self.k[layer][:, :, p : p + 1] = k
            self.v[layer][:, :, p : p + 1] = v
            keys, values = self.k[layer][:, :, : p + 1], self.v[layer][:, :, : p + 1]
            # One query at the newest position sees every key (inside any sliding window).
            attn = r.attend(layer, q, keys, values, query_positions=pos[0])
            hidden = r.finish_layer(layer, hidden, attn)
        self.length += 1
        return r.logits(hidden)[0, -1]


@torch.inference_mode()
def generate(
    runner: ModelRunner,
    fused: FusionResult,
    sampling: SamplingConfig = SamplingConfig(),
    on_token: Callable[[str], None] | None = None,
    keep_logits: bool = False,
    forced_tokens: list[int] | None = None,
) -> Generation:
    """Decode from `fused`. `forced_tokens` teacher-forces a given continuation (for answer KL)."""
    sampling.validate()
    generator = None
    if sampling.seed is not None:
        generator = torch.Generator(device="cpu").manual_seed(sampling.seed)
    stops = runner.stop_token_ids
    limit = len(forced_tokens) if forced_tokens is not None else sampling.max_new_tokens
    state: DecodeState | None = None  # built after the first token is out: it is not on the TTFT path
    logits = fused.last_logits
    tokens: list[int] = []
    step_logits: list[torch.Tensor] = []
    start = time.perf_counter()
    first_s = 0.0
    stopped = False
    emitted = ""
    for step in range(limit):
        if keep_logits:
            step_logits.append(logits.detach().float().cpu())
        token = forced_tokens[step] if forced_tokens is not None else next_token(logits.cpu(), sampling, generator)
        if step == 0:
            first_s = time.perf_counter() - start
        if token in stops and forced_tokens is None:
            stopped = True
            break
        tokens.append(token)
        if on_token is not None:
            text = runner.tokenizer.decode(tokens, skip_special_tokens=True)
            on_token(text[len(emitted):])
            emitted = text
        if step + 1 == limit:
            break
        if state is None:
            state = DecodeState(runner, fused, limit)
        logits = state.step(token)
    decode_s = time.perf_counter() - start
    text = runner.tokenizer.decode(tokens, skip_special_tokens=True)
    return Generation(tokens, text.strip(), first_s, decode_s, stopped, step_logits)
