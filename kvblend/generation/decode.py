"""A decode step: one token for each of several sequences in one forward pass, each over its own KV.

The fused KV goes into preallocated per-layer buffers and every further token
is one pass of the same layer steps the fusor uses (kvblend.model.runner).
Our own step (rather than `generate`) starts from logits we already have and
avoids DynamicCache's per-step concatenation (9 tok/s → see BENCHMARKS.md on
a 3k-token prompt). This is the model-execution half of decoding; what a
sequence does with its logits is kvblend.generation.sequence's.
"""

from __future__ import annotations

import torch

from kvblend.fusion.fuse import FusionResult
from kvblend.model.runner import ModelRunner


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
