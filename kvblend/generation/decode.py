"""A decode step: one token for each of several sequences in one forward pass, each over its own KV.

The fused KV goes into preallocated per-layer buffers and every further token
is one pass of the same layer steps the fusor uses (kvblend.model.runner).
Our own step (rather than `generate`) starts from logits we already have and
avoids DynamicCache's per-step concatenation (9 tok/s → see BENCHMARKS.md on
a 3k-token prompt). This is the model-execution half of decoding; what a
sequence does with its logits is kvblend.generation.sequence's.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch

from kvblend.model.runner import ModelRunner
from kvblend.types import LayerKV


class PromptKV(Protocol):
    """What decoding reads of a fused prompt (a kvblend.fusion.FusionResult, or a profile's random one)."""

    kv: list[LayerKV]  # per layer, [1, kv_heads, T, head_dim]
    token_ids: list[int]


@dataclass
class DecodePrompt:
    """A PromptKV made by hand: a prompt's per-layer KV and its token ids, with no fusion behind them
    (a profile's timing prompt, tests)."""

    kv: list[LayerKV]
    token_ids: list[int]


class DecodeState:
    """The prompt's KV in preallocated per-layer buffers, grown in place as tokens are decoded.

    A DynamicCache concatenates on every step (O(prompt) copies per token); writing
    into a buffer sized prompt + max_new_tokens keeps a decode step O(1) in copies.

    The buffers hold the compute dtype unless `kv_dtype` says otherwise. 16-bit KV under fp32 compute
    halves what a step reads of a ~3,700-token prompt (about what bf16 weights read), but on the 2-core
    AMD EPYC VM it did not pay: a batch-1 step took 50.2 ms with fp16 KV against 49.3 ms with fp32 KV,
    a batch-8 step 305 against 282 ms (bf16 weights, interleaved; BENCHMARKS.md, "Decode beside
    llama.cpp"), so the default keeps fp32 and `full` decodes exactly as the model's forward pass does.
    """

    def __init__(self, runner: ModelRunner, fused: PromptKV, max_new_tokens: int, kv_dtype: torch.dtype | None = None):
        self.runner = runner
        self.length = len(fused.token_ids)
        capacity = self.length + max_new_tokens
        dtype = kv_dtype or runner.dtype
        self.k: list[torch.Tensor] = []
        self.v: list[torch.Tensor] = []
        for k, v in fused.kv:
            kb = torch.empty((*k.shape[:2], capacity, k.shape[3]), dtype=dtype, device=runner.device)
            vb = torch.empty_like(kb)
            kb[:, :, : self.length] = k
            vb[:, :, : self.length] = v
            self.k.append(kb)
            self.v.append(vb)

    def step(self, token: int) -> torch.Tensor:
        """Feed one token at the next position; return the next-token logits."""
        return decode_step(self.runner, [self], [token])[0]

    def release(self) -> None:
        """Free the KV buffers now, not when the garbage collector gets to them (a server's finished request)."""
        self.k, self.v = [], []

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
    with runner.decoding():
        return _step(runner, states, tokens)


def _step(runner: ModelRunner, states: list[DecodeState], tokens: list[int]) -> torch.Tensor:
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
