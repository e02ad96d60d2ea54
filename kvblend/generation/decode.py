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

from kvblend.model.attention import last_query, visible_keys
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


#: Up to this many sequences step by replaying each one's CUDA graph in turn rather than in one eager batched
#: pass. On an H100 (SmolLM2's shape, 2,980 tokens) a graph replay took 3.0-4.8 ms and an eager batch-8 step
#: 35 ms: eight replays cost about what one eager batch-8 step does, and fewer cost less (BENCHMARKS.md,
#: "On an H100"). Larger batches step eagerly, reading every weight once for all of them.
GRAPHED_BATCH_MAX = 8


def graphed_by_default(runner: ModelRunner) -> bool:
    """Whether a sequence's steps replay a CUDA graph unless told: on CUDA, where launches are the step,
    unless the runner was loaded with `--enforce-eager`."""
    return runner.device.type == "cuda" and runner.cuda_graphs


class DecodeState:
    """The prompt's KV in preallocated per-layer buffers, grown in place as tokens are decoded.

    A DynamicCache concatenates on every step (O(prompt) copies per token); writing
    into a buffer sized prompt + max_new_tokens keeps a decode step O(1) in copies.

    The buffers hold what the runner decodes with (ModelRunner.decode_kv_dtype: fp16 under int8 or
    int4 weights on the CPU, where kvblend's attention kernel reads it at half fp32's bytes; else the
    compute dtype, so `full` under fp32 weights decodes the model's own forward pass, up to the order of
    the attention kernel's sums) unless `kv_dtype` says otherwise.
    """

    def __init__(
        self,
        runner: ModelRunner,
        fused: PromptKV,
        max_new_tokens: int,
        kv_dtype: torch.dtype | None = None,
        graphed: bool | None = None,
    ):
        self.runner = runner
        # Whether its steps replay a captured CUDA graph (StaticStep, in batches of up to GRAPHED_BATCH_MAX:
        # decode_step); None: on CUDA, yes.
        self.graphed = graphed_by_default(runner) if graphed is None else graphed
        self._static: StaticStep | None = None
        self.length = len(fused.token_ids)
        capacity = self.length + max_new_tokens
        dtype = kv_dtype or runner.decode_kv_dtype
        self.k: list[torch.Tensor] = []
        self.v: list[torch.Tensor] = []
        # A static step attends over the whole buffer with a mask: the keys and values it masks must still be
        # finite (0 · NaN is NaN), so its buffers start zeroed.
        alloc = torch.zeros if self.graphed else torch.empty
        for k, v in fused.kv:
            shape = (*k.shape[:2], capacity, k.shape[3])
            kb = alloc(shape, dtype=dtype, device=runner.device)
            vb = alloc(shape, dtype=dtype, device=runner.device)
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
        self._static = None

    def static_step(self) -> StaticStep:
        """This sequence's static step (on CUDA captured at its first use; kept until release)."""
        if self._static is None:
            self._static = StaticStep(self, graph=self.runner.device.type == "cuda")
        return self._static

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

    On CUDA a small model's step is bound by kernel launches instead, so up to GRAPHED_BATCH_MAX sequences
    each replay their own captured step (StaticStep), in turn.
    """
    if len(states) <= GRAPHED_BATCH_MAX and all(st.graphed and st.length < st.capacity for st in states):
        return torch.stack([st.static_step().run(token) for st, token in zip(states, tokens)])
    if runner.fused_step is not None and (logits := runner.fused_step(states, tokens)) is not None:
        return logits  # the whole step in one C call (kvblend.model.fused_step), where it takes the batch
    with runner.decoding():
        return _step(runner, states, tokens)


def _step(runner: ModelRunner, states: list[DecodeState], tokens: list[int]) -> torch.Tensor:
    device = runner.device
    # Positions on the host too: attend() reads the query's position as a Python int, which from a CUDA
    # tensor would be a device sync per layer and sequence (30 per token for SmolLM2).
    host_positions = torch.tensor([[st.length] for st in states])
    positions = host_positions.to(device)
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
            outs.append(runner.attend(layer, q[i : i + 1], keys, values, query_positions=host_positions[i]))
        hidden = runner.finish_layer(layer, hidden, outs[0] if len(outs) == 1 else torch.cat(outs, dim=0))
    for st in states:
        st.length += 1
    return runner.logits(hidden)[:, -1]


class StaticStep:
    """One sequence's decode step with every shape fixed, replayed as a CUDA graph on CUDA.

    A decode step of a 135M model on a GPU is hundreds of tiny kernels (30 layers of norms, projections,
    RoPE, attention, MLP), each microseconds of work behind microseconds of launch: the launches are the
    step. Captured once as a CUDA graph, the whole step is one launch (gpt-fast's and vLLM's remedy). A
    graph replays fixed shapes and addresses, so the step reads what changes from two device tensors
    (the token and its position) and attends over the whole buffer, prompt + max_new_tokens, with keys
    past the position (or before a sliding window) masked out instead of sliced away: one step reads at
    most max_new_tokens more keys than the eager one, and the KV write is an index_copy_ at the position.

    On the CPU the same static step runs eagerly (`graph=False`): that is how the tests hold it to
    the eager step (`_step`) without a GPU. A batch of up to GRAPHED_BATCH_MAX such sequences replays
    their graphs in turn (decode_step); larger ones step eagerly, each sequence over its own ragged KV.
    """

    def __init__(self, state: DecodeState, graph: bool):
        runner = state.runner
        self.state, self.runner = state, runner
        device = runner.device
        self.token = torch.zeros((1, 1), dtype=torch.long, device=device)
        self.position = torch.zeros((1, 1), dtype=torch.long, device=device)
        self.graph: torch.cuda.CUDAGraph | None = None
        self.logits: torch.Tensor | None = None
        self._use_graph = graph

    def run(self, token: int) -> torch.Tensor:
        """Feed `token` at the sequence's next position; return its next-token logits [vocab] (fp32)."""
        self.token.fill_(token)
        self.position.fill_(self.state.length)
        if not self._use_graph:
            logits = self._forward()
        else:
            if self.graph is None:
                self._capture()
            assert self.graph is not None and self.logits is not None
            self.graph.replay()
            logits = self.logits.clone()  # the graph's output buffer is overwritten by the next replay
        self.state.length += 1
        return logits[0]

    def _capture(self) -> None:
        """Warm up on a side stream (allocator, cuBLAS handles, RoPE tables), then capture the step."""
        stream = torch.cuda.Stream(device=self.runner.device)
        stream.wait_stream(torch.cuda.current_stream(self.runner.device))
        with torch.cuda.stream(stream):
            for _ in range(2):  # each writes this step's K/V at this step's position: what replay writes too
                self._forward()
        torch.cuda.current_stream(self.runner.device).wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        # thread_local: a server's archive loader threads copy KV to the GPU on their own streams meanwhile;
        # under the default ("global") any CUDA call they make during the capture would fail it.
        with torch.cuda.graph(graph, capture_error_mode="thread_local"):
            self.logits = self._forward()
        self.graph = graph

    @torch.inference_mode()
    def _forward(self) -> torch.Tensor:
        runner, state = self.runner, self.state
        with runner.decoding():
            cos, sin = runner.rope(self.position)
            hidden = runner.embed(self.token)
            where = self.position.view(1)
            capacity = state.capacity
            visible = {w: visible_keys(where, capacity, w) for w in {runner.window(i) for i in range(runner.n_layers)}}
            for layer in range(runner.n_layers):
                q, k, v = runner.project_qkv(layer, hidden, cos, sin)
                kb, vb = state.k[layer], state.v[layer]
                kb.index_copy_(2, where, k.to(kb.dtype))
                vb.index_copy_(2, where, v.to(vb.dtype))
                out = last_query(q, kb, vb, runner.attention_scale(layer), visible[runner.window(layer)])
                hidden = runner.finish_layer(layer, hidden, out.transpose(1, 2).reshape(1, 1, -1))
            return runner.logits(hidden)[:, -1]
