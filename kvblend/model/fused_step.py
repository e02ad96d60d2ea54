"""A decode step in one call into kvblend's C kernels (quant_gemv.c's `kvb_decode_step`).

Why: with the products and attention in C (kvblend.model.quant_kernels), a batch-1 decode step of
SmolLM2 over 3,656 keys on the 2-core Zen 4 EPYC still took 23 ms, of which 14-15 ms were those
kernels and 8 ms the ~25 small torch operations per layer around them (norms, RoPE, slicing, the KV
writes, residual adds, SiLU) plus reaching the kernels through Python 211 times. llama.cpp's C++ step
pays none of that. Here the layers run as one C loop over buffers of a few hundred floats; Python
keeps the embedding lookup (with Gemma's scale), the RoPE tables and the LM head (one product), as the
eager step does.

What it takes (:func:`fused_step`, checked once per runner): the CPU, fp32 compute, layers of one
structure without biases: pre-norm RMSNorms of one eps (Gemma's (1 + w) ones included), q/k norms or
none (Qwen3, Gemma 3), sandwich norms or none (Gemma 3), a SiLU or tanh-GELU MLP, a sliding window per
layer (Mistral, Phi-3, Gemma 3's local layers) and a RoPE table per layer (Gemma 3's two bases), one
attention scale; whose seven projections kvblend's kernels multiply (`--weights int4` or `int8`, or a
GGUF's own blocks: kvblend.model.gguf_blocks). Qwen2 (q/k/v biases) steps eagerly. Per step
(:meth:`FusedStep.takes`): at most 8 sequences, each with room in its KV buffers, all of one KV dtype.
Anything else steps eagerly (kvblend.generation.decode._step), and the tests hold the two to the same
logits for every family.
"""

from __future__ import annotations

import ctypes
import weakref
from collections.abc import Sequence
from typing import Any, Protocol

import torch

from kvblend.model import quant_kernels
from kvblend.model.runner import ModelRunner
from kvblend.model.weights import kernel_blocks

#: The C step handles this many sequences at once (quant_gemv.c's MAX_ROWS).
MAX_ROWS = 8
_PROJECTIONS = ("q", "k", "v", "o", "gate", "up", "down")


class StepKV(Protocol):
    """What the step reads of a sequence (kvblend.generation.DecodeState)."""

    k: list[torch.Tensor]
    v: list[torch.Tensor]
    length: int

    @property
    def capacity(self) -> int: ...


class _Linear(ctypes.Structure):
    _fields_ = [
        ("codes", ctypes.c_void_p),
        ("d", ctypes.c_void_p),
        ("m", ctypes.c_void_p),
        ("format", ctypes.c_int32),  # quant_gemv.c's KVB_Q8_0, KVB_Q4_1 or KVB_Q8_16
        ("n_in", ctypes.c_int32),
        ("n_out", ctypes.c_int32),
        ("unused", ctypes.c_int32),
    ]


class _Layer(ctypes.Structure):
    _fields_ = [
        ("input_norm", ctypes.c_void_p),
        ("post_norm", ctypes.c_void_p),
        *((name, _Linear) for name in _PROJECTIONS),
        ("q_norm", ctypes.c_void_p),  # NULL: none
        ("k_norm", ctypes.c_void_p),
        ("attn_out_norm", ctypes.c_void_p),  # Gemma's sandwich norms; NULL: none
        ("mlp_out_norm", ctypes.c_void_p),
        ("window", ctypes.c_int32),  # 0: every key
        ("rope_kind", ctypes.c_int32),
    ]


class _Shape(ctypes.Structure):
    _fields_ = [
        ("n_layers", ctypes.c_int32),
        ("dim", ctypes.c_int32),
        ("heads", ctypes.c_int32),
        ("kv_heads", ctypes.c_int32),
        ("head_dim", ctypes.c_int32),
        ("inter", ctypes.c_int32),
        ("half", ctypes.c_int32),
        ("gelu", ctypes.c_int32),
        ("eps", ctypes.c_float),
        ("scale", ctypes.c_float),
        ("rope_kinds", ctypes.c_int32),
        ("unused", ctypes.c_int32),
    ]


class FusedStep:
    """A runner's layers as the C step reads them: the addresses of the runner's tensors, which it keeps alive
    (`_tensors`) for as long as it may hand them to C, and uses only while the runner holds the weights report
    it was built from (a later `apply_weights` replaces the modules: the step then goes eager)."""

    def __init__(
        self,
        runner: ModelRunner,
        kernels: quant_kernels.QuantKernels,
        layers: Any,
        shapes: dict,
        tensors: list[torch.Tensor],
    ):
        # Weakly: the runner holds this step (ModelRunner.fused_step), and a cycle would keep a dropped runner's
        # weights alive until the cycle collector ran (kvblend profile loads one format after another).
        self._runner = weakref.ref(runner)
        self._report = runner.weights
        self._kernels = kernels
        self._layers = layers  # ctypes array of _Layer, pointing into `_tensors`
        self._tensors = tensors
        self._shapes = shapes  # KV dtype → _Shape
        # Sequences whose buffers were checked, by identity: the addresses checked (a state's buffers change only
        # when it is released, and then its addresses do). Addresses only, so a released state's buffers are freed.
        self._checked: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()

    @property
    def runner(self) -> ModelRunner:
        runner = self._runner()
        if runner is None:
            raise RuntimeError("the model this decode step was built for is gone")
        return runner

    def takes(self, states: Sequence[StepKV]) -> bool:
        """Can this batch step here? At most MAX_ROWS sequences (and no more than the converted weights are
        routed for), each with room for one more token, all with contiguous KV buffers of one dtype, on the
        weights the step was built from."""
        return self._take(states) is not None

    def _take(self, states: Sequence[StepKV]) -> tuple[torch.dtype, list[tuple[list[int], list[int]]]] | None:
        """:meth:`takes`' answer with what the step needs of a batch it takes: the KV dtype and each sequence's
        buffer addresses."""
        runner = self._runner()
        if runner is None or runner.weights is not self._report or self._report is None:
            return None
        route = self._report.route
        if not states or len(states) > MAX_ROWS or route is None or len(states) > route.max_rows:
            return None
        dtype = states[0].k[0].dtype if states[0].k else None
        if dtype is None or dtype not in self._shapes:
            return None
        buffers = []
        for st in states:
            addresses = self._buffers(runner, st, dtype)
            if addresses is None:
                return None
            buffers.append(addresses)
        return dtype, buffers

    def _buffers(self, runner: ModelRunner, st: StepKV, dtype: torch.dtype) -> tuple[list[int], list[int]] | None:
        """The addresses of a sequence's per-layer K and V buffers, if the C side may write at st.length and
        read every layer through layer 0's strides. Shapes are checked once per set of addresses."""
        if st.length >= st.capacity or not st.k or st.k[0].dtype != dtype:
            return None
        addresses = ([t.data_ptr() for t in st.k], [t.data_ptr() for t in st.v])
        seen = self._checked.get(st)
        if seen is not None and seen == (addresses, st.capacity):
            return addresses
        shape = (1, runner.n_kv_heads, st.capacity, runner.head_dim)
        fits = len(st.k) == len(st.v) == runner.n_layers and all(
            t.dtype == dtype and t.shape == shape and t.is_contiguous() and t.device.type == "cpu"
            for t in (*st.k, *st.v)
        )
        if not fits:
            return None
        self._checked[st] = (addresses, st.capacity)
        return addresses

    @torch.inference_mode()
    def __call__(self, states: Sequence[StepKV], tokens: Sequence[int]) -> torch.Tensor | None:
        """One token for each sequence: next-token logits [len(states), vocab], fp32; None, with nothing done,
        for a batch the step does not take (:meth:`takes`), which then steps eagerly."""
        rows = len(states)
        if len(tokens) != rows:
            raise ValueError(f"{len(tokens)} tokens for {rows} sequences")
        # The buffer lists, held here: C runs without the GIL, and a release() meanwhile must not free them.
        held = [(st.k, st.v) for st in states]
        taken = self._take(states)
        if taken is None:
            return None
        runner, (dtype, buffers) = self.runner, taken
        positions = torch.tensor([[st.length] for st in states])
        cos, sin = runner.rope(positions)
        hidden = runner.embed(torch.tensor([[t] for t in tokens])).reshape(rows, -1).contiguous()
        if hidden.shape != (rows, runner.config.hidden_size) or hidden.dtype != torch.float32:
            raise ValueError(f"the C decode step needs fp32 hidden states [{rows}, {runner.config.hidden_size}]")
        k_ptrs = _layer_major([b[0] for b in buffers])
        v_ptrs = _layer_major([b[1] for b in buffers])
        strides = (ctypes.c_int64 * rows)(*(st.k[0].stride(1) for st in states))
        where = (ctypes.c_int64 * rows)(*(st.length for st in states))
        cos, sin = cos.reshape(rows, -1).contiguous(), sin.reshape(rows, -1).contiguous()
        self._kernels.decode_step(self._shapes[dtype], self._layers, hidden, cos, sin, (k_ptrs, v_ptrs), strides, where)
        del held
        for st in states:
            st.length += 1
        with runner.decoding():
            return runner.logits(hidden.view(rows, 1, -1))[:, -1]


def _layer_major(addresses: list[list[int]]) -> ctypes.Array:
    """Per-sequence lists of per-layer addresses as the C side reads them: layer l of sequence r at l·rows + r."""
    flat = [a for layer in zip(*addresses) for a in layer]
    return (ctypes.c_void_p * len(flat))(*flat)


def fused_step(runner: ModelRunner) -> FusedStep | None:
    """The C step for this runner, or None where its model or weights are not what the step computes."""
    if runner.device.type != "cpu" or runner.dtype != torch.float32:
        return None
    if runner.weights_name not in ("int4", "int8", "gguf"):
        return None
    kernels = quant_kernels.kernels()
    if kernels is None or not _step_shaped(runner):
        return None
    layers = (_Layer * runner.n_layers)()
    tensors: list[torch.Tensor] = []
    for i, block in enumerate(runner.layers):
        attn, mlp = block.self_attn, block.mlp
        modules = (attn.q_proj, attn.k_proj, attn.v_proj, attn.o_proj, mlp.gate_proj, mlp.up_proj, mlp.down_proj)
        described = [_describe(m, kernels, tensors) for m in modules]
        if any(d is None for d in described) or not _dims_fit(runner, described):
            return None
        sandwich = hasattr(block, "pre_feedforward_layernorm")
        norms = [
            block.input_layernorm,
            block.pre_feedforward_layernorm if sandwich else block.post_attention_layernorm,
            getattr(attn, "q_norm", None),
            getattr(attn, "k_norm", None),
            block.post_attention_layernorm if sandwich else None,
            block.post_feedforward_layernorm if sandwich else None,
        ]
        weights = [None if n is None else _norm_weight(n) for n in norms]
        tensors += [w for w in weights if w is not None]
        addresses = [None if w is None else w.data_ptr() for w in weights]
        layers[i] = _Layer(*addresses[:2], *described, *addresses[2:], runner.window(i) or 0, runner.rope_kind(i))
    cfg = runner.config
    shapes = {}
    for dtype, half in ((torch.float16, 1), (torch.float32, 0)):
        shape = _Shape(
            runner.n_layers,
            cfg.hidden_size,
            runner.n_heads,
            runner.n_kv_heads,
            runner.head_dim,
            cfg.intermediate_size,
            half,
            int(runner.layers[0].mlp.gelu),
            float(runner.layers[0].input_layernorm.eps),
            runner.attention_scale(0),
            runner.rope_kinds,
            0,
        )
        if kernels.step_takes(shape):
            shapes[dtype] = shape
    return FusedStep(runner, kernels, layers, shapes, tensors) if shapes else None


def _norm_weight(norm: Any) -> torch.Tensor:
    """A norm's weight as the C step multiplies it: Gemma's norms scale by (1 + weight), computed here once
    in fp32 as its RMSNorm computes it; the others by the weight itself."""
    return (1.0 + norm.weight.float()).contiguous() if norm.gemma else norm.weight


def _step_shaped(runner: ModelRunner) -> bool:
    """What the C step computes: RMSNorms of one eps in fp32 (Gemma's (1 + w) ones too), the same layer
    structure throughout (q/k norms in every layer or none, sandwich norms in every layer or none), one
    attention scale, a SiLU or tanh-GELU MLP; windows and several RoPE kinds (Gemma 3's local and global
    layers) are per layer. The embedding's scale, the final norm and any final soft-cap stay in Python."""
    block = runner.layers[0]
    sandwich, qk = hasattr(block, "pre_feedforward_layernorm"), hasattr(block.self_attn, "q_norm")
    names = ["input_layernorm", "post_attention_layernorm"]
    names += ["pre_feedforward_layernorm", "post_feedforward_layernorm"] if sandwich else []
    norms = [getattr(blk, n) for blk in runner.layers for n in names]
    if qk:
        norms += [getattr(blk.self_attn, n, None) for blk in runner.layers for n in ("q_norm", "k_norm")]
    same = all(
        hasattr(blk, "pre_feedforward_layernorm") == sandwich
        and hasattr(blk.self_attn, "q_norm") == qk
        and blk.mlp.gelu == block.mlp.gelu
        for blk in runner.layers
    )
    return (
        same
        and all(
            n is not None and n.eps == norms[0].eps and n.weight.dtype == torch.float32 and n.weight.is_contiguous()
            for n in norms
        )
        and len({runner.attention_scale(i) for i in range(runner.n_layers)}) == 1
    )


def _dims_fit(runner: ModelRunner, linears: list[Any]) -> bool:
    """Each projection's (n_in, n_out) is what the C step assumes of its place in the layer."""
    d, i = runner.config.hidden_size, runner.config.intermediate_size
    q, kv = runner.n_heads * runner.head_dim, runner.n_kv_heads * runner.head_dim
    want = [(d, q), (d, kv), (d, kv), (q, d), (d, i), (d, i), (i, d)]
    return [(lin.n_in, lin.n_out) for lin in linears] == want


def _describe(module: Any, kernels: quant_kernels.QuantKernels, tensors: list[torch.Tensor]) -> _Linear | None:
    """A projection as the C step reads it, if kvblend's kernel multiplies it (int4's Q4_1, int8's Q8_0, or a
    GGUF's own Q4_1/Q8_0/Q8_16 blocks); its blocks checked as the product checks them
    (kvblend.model.quant_kernels), and kept in `tensors`."""
    if getattr(module, "bias", None) is not None or getattr(module, "kernels", None) is not kernels:
        return None
    blocks = kernel_blocks(module)
    if blocks is None:
        return None
    try:
        blocks.check()
    except ValueError:
        return None
    n_out, n_in = blocks.shape
    tensors += [t for t in (blocks.codes, blocks.d, blocks.m) if t is not None]
    minimums = None if blocks.m is None else blocks.m.data_ptr()
    return _Linear(blocks.codes.data_ptr(), blocks.d.data_ptr(), minimums, blocks.kernel_format, n_in, n_out, 0)
