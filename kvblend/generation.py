"""Generation from a fused KV: first token from the fusor's logits, then ordinary decoding.

The fused KV goes into preallocated per-layer buffers and every further token
is one pass of the same layer steps the fusor uses (kvblend.model.runner). Our own
loop (rather than `generate`) starts from logits we already have, streams
tokens to a callback, times the first token exactly, and avoids DynamicCache's
per-step concatenation (9 tok/s → see BENCHMARKS.md on a 3k-token prompt).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

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
    if sampling.greedy:
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
        return decode_step(self.runner, [self], [token])[0]

    @property
    def capacity(self) -> int:
        return self.k[0].shape[2]


@torch.inference_mode()
def decode_step(runner: ModelRunner, states: list[DecodeState], tokens: list[int]) -> torch.Tensor:
    """One token for each of several sequences, in one forward pass: every weight is read once for all of them.

    On a CPU, decoding a small model is bound by reading its weights, so a batch of eight costs little more
    than one. Each sequence keeps its own KV buffers and position (ragged lengths, no padding): the
    projections and MLPs run batched, and each sequence's one query attends over its own keys, exactly as it
    would alone. Returns next-token logits, [len(states), vocab] in float32.
    """
    device = runner.device
    positions = torch.tensor([[st.length] for st in states], device=device)
    cos, sin = runner.rope(positions)
    hidden = runner.embed(torch.tensor([[t] for t in tokens], device=device))
    for layer in range(runner.n_layers):
        q, k, v = runner.project_qkv(layer, hidden, cos, sin)
        outs = []
        for i, st in enumerate(states):
            p = st.length
            st.k[layer][:, :, p : p + 1] = k[i : i + 1]
            st.v[layer][:, :, p : p + 1] = v[i : i + 1]
            keys, values = st.k[layer][:, :, : p + 1], st.v[layer][:, :, : p + 1]
            # One query at the newest position sees every key (inside any sliding window).
            outs.append(runner.attend(layer, q[i : i + 1], keys, values, query_positions=positions[i]))
        hidden = runner.finish_layer(layer, hidden, outs[0] if len(outs) == 1 else torch.cat(outs, dim=0))
    for st in states:
        st.length += 1
    return runner.logits(hidden)[:, -1]


def logprobs_of(logits: torch.Tensor, token: int, top: int = 0) -> tuple[float, list[tuple[int, float]]]:
    """The chosen token's log-probability under the model's distribution, and the `top` most likely tokens with
    theirs (OpenAI's `logprobs` / `top_logprobs`), from the same logits the sampler used."""
    logp = torch.log_softmax(logits.float(), dim=-1)
    alternatives: list[tuple[int, float]] = []
    if top:
        values, ids = torch.topk(logp, top)
        alternatives = [(int(i), float(v)) for i, v in zip(ids, values)]
    return float(logp[token]), alternatives


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
            on_token(text[len(emitted) :])
            emitted = text
        if step + 1 == limit:
            break
        if state is None:
            state = DecodeState(runner, fused, limit)
        logits = state.step(token)
    decode_s = time.perf_counter() - start
    text = runner.tokenizer.decode(tokens, skip_special_tokens=True)
    return Generation(tokens, text.strip(), first_s, decode_s, stopped, step_logits)
