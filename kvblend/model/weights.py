"""Weight formats for the decoder's linear layers: fp32, weight-only bf16, int8 and int4 (`--weights`).

A decode step of a small model reads every weight once per token, so its time
follows the bytes the weights take, wherever the kernel that reads them is
fast enough to keep up. Prefill is the opposite: hundreds of rows per weight,
bound by arithmetic, where a CPU without native bf16 or int4 arithmetic loses
(SmolLM2 on a 2-core AMD EPYC, AVX2: a 3,000-token prefill takes 8.6 s with
fp32 weights and 39.8 s with bf16 ones; one decode row takes half the time
with bf16 weights, eight rows 1.4x longer). So a converted layer keeps the
weight it was loaded with and routes by the call: a decode step of at most
:attr:`Route.max_rows` sequences reads the converted weight, everything else
(prefill, blend's recompute, the probe) the loaded one. The KV kvblend makes
and archives is therefore the loaded weights' under every format, and
archive keys do not change with `--weights`; what a format changes is the
answer's tokens after the first.

The formats:

* ``fp32``: the checkpoint's tensors as loaded (the default where nothing
  measured better: see ``auto`` below).
* ``bf16``: weights in bf16, activations in the compute dtype, cast around each
  matmul. Pays where the CPU multiplies bf16 natively (AMX, AVX512-BF16) or on CUDA.
* ``int8``: on the CPU, GGUF's Q8_0: a symmetric scale per 32 input weights,
  multiplied by kvblend's own kernel (kvblend.model.quant_kernels); on CUDA, or
  where no C compiler built that kernel, one symmetric scale per output row for
  torch's ``_weight_int8pack_mm`` (gpt-fast's int8 path).
* ``int4``: groups of 32 input weights with a scale and a minimum each,
  ``w = d·q + m`` with ``q`` in 0..15: exactly GGUF's Q4_1. A GGUF in Q4_1 has
  been de-quantised to fp32 on load, and re-quantising those weights gives
  back the file's codes and scales bit for bit (:attr:`WeightReport.max_error`
  is then 0.0: ``full`` stays the model in the file). On the CPU kvblend's
  kernel multiplies those blocks as GGUF lays them out, in fp32; without it,
  torch's ``_weight_int4pack_mm_for_cpu``, which takes the scale and ``m + 8·d``
  as its "zero" (it centres codes at 8).

The embedding stays as loaded (a lookup reads one row per token); a tied LM head
gets its own quantized copy, in int8 under ``int4`` (as llama.cpp's 4-bit files keep
their output matrix at 6 or 8 bits: SmolLM2's GGUF holds it in Q8_0, which the CPU's
int8 reproduces exactly). Norms, biases and RoPE tables are untouched.

Why kernels of our own on the CPU: torch 2.13's weight-only int8 and int4 CPU
kernels run 7-11x slower than fp32's matmul on a 2-core AMD EPYC, so they
decoded slower than fp32; kvblend's read the 4- and 8-bit blocks at the speed
of their bytes (BENCHMARKS.md, "Decode beside llama.cpp").

On CUDA, int4 runs torch's fused tinygemm kernel (`_weight_int4pack_mm`, bf16 activations, scales rounded
to bf16) and int8 `_weight_int8pack_mm` where the torch build has it for CUDA; each layer checks its kernel
once against the de-quantising path at load and falls back to that path (correct, not fused) where the
kernel is missing or disagrees.

``gguf`` (what ``auto`` resolves to, with no profile, for a GGUF of mixed block types such as a Q4_K_M
file; a user may name it too): each projection and the LM head multiplied in the file's own blocks, exactly
(kvblend.model.gguf_blocks re-expresses Q4_K, Q6_K, Q5_0, Q4_0 in the kernels' layouts). A file with any
projection of a type it does not take (Q5_K, Q3_K, F16, ...) decodes fp32 as before; an LM head of such a
type keeps its loaded weight.

``auto`` is resolved by the caller from what ``kvblend profile`` measured on
this machine (kvblend.tuning): the fastest decode step among the formats whose
next-token KL against fp32 stays within :data:`AUTO_MAX_KL`; fp32 when nothing
was measured. A server's batches above the size where the converted weights
pay read the loaded weights, so a greedy answer can depend on how many requests
shared its steps.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import nn
from torch.nn import functional as F

from kvblend.defaults import NATIVE_WEIGHTS
from kvblend.errors import UsageError
from kvblend.model import quant_kernels
from kvblend.model.gguf_blocks import HEAD, Blocks, cached_gguf_blocks, read_block_cache, write_block_cache

#: What ``auto`` resolves to for a GGUF whose mixed block types the kernels multiply as they are (native_format).
GGUF_WEIGHTS = "gguf"
#: The formats `--weights` takes besides "auto" and GGUF_WEIGHTS (what `profile` measures, each converted).
WEIGHT_FORMATS = ("fp32", "bf16", "int8", "int4")
DEFAULT_WEIGHTS = "fp32"
#: Decode batches up to this many rows read the converted weights unless `kvblend profile` measured otherwise.
DEFAULT_DECODE_ROWS = 8
#: Q4_1's block: 32 consecutive input weights share a scale and a minimum.
INT4_GROUP = 32
#: torch's CPU int4 packing works on tiles of 16 output rows.
INT4_CPU_TILE = 16
#: `auto` takes no format whose first-token KL against fp32 exceeds this (nats, on the profile's prompt).
AUTO_MAX_KL = 0.01

_LINEARS = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj")
_MLP = ("mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")


def check_weights(name: str | None, allow_auto: bool = True, allow_native: bool = False) -> str:
    """The format named by `--weights` (None: the default), or a one-line UsageError. NATIVE_WEIGHTS is let
    through where asked (the loader and the engine: it comes from `auto`, never from a user). Where no profile
    measured this machine, `auto` is the checkpoint's own format where kvblend's CPU kernels multiply it exactly
    (a Q4_1 GGUF: int4; Q8_0: int8), as vLLM runs a quantized checkpoint in its own format unless told; fp32
    elsewhere (native_format)."""
    if name is None:
        return DEFAULT_WEIGHTS
    if name == NATIVE_WEIGHTS and allow_native:
        return name
    allowed = (*WEIGHT_FORMATS, GGUF_WEIGHTS, *(("auto",) if allow_auto else ()))
    if name not in allowed:
        raise UsageError(f"--weights must be one of {', '.join(allowed)}, not {name!r}")
    return name


class Route:
    """Which weights a converted layer reads, shared by all of a model's layers.

    `decoding` is set only around a decode step (ModelRunner.decoding); `max_rows` is the largest
    batch for which the converted weights were measured faster (kvblend profile), 8 unless told."""

    def __init__(self, max_rows: int = DEFAULT_DECODE_ROWS):
        self.decoding = False
        self.max_rows = max_rows

    def converted(self, rows: int) -> bool:
        return self.decoding and rows <= self.max_rows


class ConvertedLinear(nn.Module):
    """A linear layer held twice: as loaded (`weight`, for prefill) and converted (for decode rows)."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, route: Route):
        super().__init__()
        self.weight = weight
        self.bias = bias
        self.route = route
        self.max_error = 0.0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, x.shape[-1])
        if not self.route.converted(flat.shape[0]):
            return F.linear(x, self.weight, self.bias)
        y = self.converted_matmul(flat).view(*x.shape[:-1], -1)
        return y if self.bias is None else y + self.bias

    def converted_matmul(self, flat: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def converted_bytes(self) -> int:
        """What the converted copy takes: the bytes a decode step streams for this layer."""
        return sum(_bytes(t) for t in vars(self).values() if isinstance(t, torch.Tensor))


class BF16Linear(ConvertedLinear):
    """Weight-only bf16: the weight is held in bf16, the activation is cast to it and the result back."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, route: Route):
        super().__init__(weight, bias, route)
        self.bf16 = weight.detach().to(torch.bfloat16)
        self.max_error = float((self.bf16.float() - weight.float()).abs().max())

    def converted_matmul(self, flat: torch.Tensor) -> torch.Tensor:
        return F.linear(flat.to(torch.bfloat16), self.bf16).to(flat.dtype)


class Int8Linear(ConvertedLinear):
    """Weight-only int8: on the CPU with kvblend's kernel, Q8_0's blocks (a symmetric scale per 32 input
    weights); else one symmetric scale per output row, for torch's kernel."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, route: Route):
        super().__init__(weight, bias, route)
        w = weight.detach().float()
        n_out, n_in = w.shape
        self.kernels = quant_kernels.kernels() if weight.device.type == "cpu" and n_in % INT4_GROUP == 0 else None
        if self.kernels is not None:
            q, d, self.max_error = _q8_0_blocks(w)
            self.codes = q.to(torch.int8).view(n_out, n_in).contiguous()
            self.d = d.contiguous()
            return
        scale = w.abs().amax(dim=1).clamp_min(1e-12) / 127.0
        self.codes = torch.round(w / scale[:, None]).clamp_(-128, 127).to(torch.int8).contiguous()
        self.scale = scale.to(weight.dtype).contiguous()
        self.max_error = float((self.codes.float() * scale[:, None] - w).abs().max())
        # torch's fused kernel where this build has it for the device (always on the CPU), checked once
        # against the de-quantising path; else that path.
        self.fused = weight.device.type == "cpu" or _kernel_agrees(self._fused_matmul, self._dequantised, weight)

    def converted_matmul(self, flat: torch.Tensor) -> torch.Tensor:
        if self.kernels is not None:
            return self.kernels.q8_0(flat.float(), self.codes, self.d).to(flat.dtype)
        return self._fused_matmul(flat) if self.fused else self._dequantised(flat)

    def _fused_matmul(self, flat: torch.Tensor) -> torch.Tensor:
        return torch.ops.aten._weight_int8pack_mm(flat, self.codes, self.scale.to(flat.dtype))

    def _dequantised(self, flat: torch.Tensor) -> torch.Tensor:
        return F.linear(flat, self.codes.to(flat.dtype)) * self.scale.to(flat.dtype)


class Int4Linear(ConvertedLinear):
    """Weight-only int4 in Q4_1's layout: groups of 32 input weights, w = d·q + m, q in 0..15."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, route: Route):
        super().__init__(weight, bias, route)
        n_out, n_in = weight.shape
        w = weight.detach().float()
        q, d, low, self.max_error = _q4_1_blocks(w)
        self.on_cpu = weight.device.type == "cpu"
        self.kernels = quant_kernels.kernels() if self.on_cpu else None
        if self.kernels is not None:  # kvblend's own kernel: GGUF's block as it is, two codes to a byte
            blocks = q.to(torch.uint8)
            self.nibbles = (blocks[..., :16] | blocks[..., 16:] << 4).reshape(n_out, n_in // 2).contiguous()
            self.d, self.low = d.contiguous(), low.contiguous()
            return
        codes = q.to(torch.int32).view(n_out, n_in)  # torch's packings start from one code per int
        if self.on_cpu:
            self.packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes, 1)
            # [groups, out, 2]: the scale, and the kernel's "zero" m + 8·d (it computes (q - 8)·d + zero).
            self.scale_zero = torch.stack([d, low + 8 * d], dim=-1).transpose(0, 1).contiguous()
        else:
            self.codes = codes.to(torch.uint8)
            self.d, self.low = d, low
            self.gpu_packed: tuple[torch.Tensor, torch.Tensor] | None = None
            try:  # CUDA's int4 kernel (tinygemm, as gpt-fast uses): codes two to a byte, high nibble first
                pairs = (codes[:, ::2] << 4 | codes[:, 1::2]).to(torch.uint8)
                tiles = next(t for t in (8, 4, 2) if n_in % (t * 16) == 0)
                packed = torch.ops.aten._convert_weight_to_int4pack(pairs.contiguous(), tiles)
                zeros = torch.stack([d, low + 8 * d], dim=-1).transpose(0, 1).to(torch.bfloat16).contiguous()
                self.gpu_packed = (packed, zeros)
            except (RuntimeError, StopIteration, NotImplementedError):
                pass
            if self.gpu_packed is not None and not _kernel_agrees(self._tinygemm, self._dequantised, weight):
                self.gpu_packed = None

    def converted_matmul(self, flat: torch.Tensor) -> torch.Tensor:
        if self.kernels is not None:
            return self.kernels.q4_1(flat.float(), self.nibbles, self.d, self.low).to(flat.dtype)
        if self.on_cpu:
            out = torch.ops.aten._weight_int4pack_mm_for_cpu(flat.float(), self.packed, INT4_GROUP, self.scale_zero)
            return out.to(flat.dtype)
        return self._tinygemm(flat) if self.gpu_packed is not None else self._dequantised(flat)

    def _tinygemm(self, flat: torch.Tensor) -> torch.Tensor:
        """CUDA's fused int4 matmul: bf16 activations, the scales and zeros rounded to bf16."""
        assert self.gpu_packed is not None
        packed, zeros = self.gpu_packed
        return torch.ops.aten._weight_int4pack_mm(flat.to(torch.bfloat16), packed, INT4_GROUP, zeros).to(flat.dtype)

    def _dequantised(self, flat: torch.Tensor) -> torch.Tensor:
        n_out, n_in = self.codes.shape
        groups = self.codes.view(n_out, -1, INT4_GROUP).float() * self.d[..., None] + self.low[..., None]
        return F.linear(flat, groups.view(n_out, n_in).to(flat.dtype))


class BlockLinear(ConvertedLinear):
    """A projection multiplied in its GGUF file's own blocks (kvblend.model.gguf_blocks): Q4_1, Q8_0 or Q8_16,
    holding exactly the loaded weight (checked when the blocks were made), so `max_error` is 0."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, route: Route, blocks: Blocks):
        super().__init__(weight, bias, route)
        kernels = quant_kernels.kernels()
        assert kernels is not None, "GGUF blocks are only made where the CPU kernels are built"
        self.kernels = kernels
        self.layout = blocks.layout
        self.codes, self.d = blocks.codes, blocks.d
        if blocks.m is not None:
            self.low = blocks.m

    def converted_matmul(self, flat: torch.Tensor) -> torch.Tensor:
        x = flat.float()
        if self.layout == "q4_1":
            y = self.kernels.q4_1(x, self.codes, self.d, self.low)
        elif self.layout == "q8_16":
            y = self.kernels.q8_16(x, self.codes, self.d)
        else:
            y = self.kernels.q8_0(x, self.codes, self.d)
        return y.to(flat.dtype)


def _kernel_agrees(kernel, reference, weight: torch.Tensor) -> bool:
    """Does a fused kernel exist for this device and compute what the de-quantising path does? One call on
    random rows, within bf16's rounding; any error (no kernel for this device or torch build): no."""
    try:
        rows = torch.randn(4, weight.shape[1], device=weight.device, dtype=weight.dtype)
        got, want = kernel(rows).float(), reference(rows).float()
    except (RuntimeError, NotImplementedError):
        return False
    return bool(torch.isfinite(got).all()) and float((got - want).norm() / want.norm().clamp_min(1e-12)) < 2e-2


@dataclass(frozen=True)
class WeightReport:
    """What a format did to the weights: how many layers it converted, its largest rounding, and the
    bytes a decode step streams now. `route` switches the converted layers on around decode steps."""

    weights: str
    layers: int
    kept: int  # projections left as loaded (a shape int4 cannot pack: int4_packable)
    max_error: float  # largest |converted - loaded| over the converted projections (0.0: exact)
    bytes: int  # what a decode step streams: the projections' and the LM head's weights, as decode reads them
    head: str = "fp32"  # the LM head's format
    head_error: float = 0.0
    route: Route | None = field(default=None, compare=False, repr=False)


def apply_weights(
    model: nn.Module,
    weights: str,
    max_rows: int = DEFAULT_DECODE_ROWS,
    blocks: dict[str, Blocks] | None = None,
    cache: Path | None = None,
) -> WeightReport:
    """Give the decoder's projections and the LM head of a loaded Transformer a converted copy, in place.
    Under GGUF_WEIGHTS, `blocks` (file_blocks) are those copies, by module path. Under int4 or int8 on the CPU's
    kernels, `cache` (a directory of this model's own, the converted GGUF's) keeps the conversion for the next
    load: SmolLM2's took ~0.65 s of a 0.9 s load, every `kvblend query` (_cached_conversion)."""
    if weights == GGUF_WEIGHTS:
        return _apply_blocks(model, blocks or {}, Route(max_rows))
    if cache is not None and weights in ("int4", "int8") and _on_kernels(model):
        return _cached_conversion(model, weights, max_rows, cache / f"{weights}.safetensors")
    weights = check_weights(weights, allow_auto=False)
    head_weight = _weight_of(model.lm_head)  # type: ignore[arg-type]
    if weights == "fp32":
        loaded = [_weight_of(m) for _, _, m in _linears(model)] + [head_weight]
        return WeightReport("fp32", 0, 0, 0.0, sum(_bytes(t) for t in loaded))
    route = Route(max_rows)
    layers = kept = total = 0
    worst = 0.0
    for parent, name, linear in _linears(model):
        weight = _weight_of(linear)
        if weights == "int4" and not int4_packable(weight):
            kept += 1
            total += _bytes(weight)
            continue
        new = _convert(weights, weight, getattr(linear, "bias", None), route)
        worst = max(worst, new.max_error)
        setattr(parent, name, new)
        layers += 1
        total += new.converted_bytes()
    head_format = "int8" if weights == "int4" else weights
    head = _convert(head_format, head_weight, None, route)
    model.lm_head = head
    total += head.converted_bytes()
    return WeightReport(weights, layers, kept, worst, total, head_format, head.max_error, route)


def _on_kernels(model: nn.Module) -> bool:
    weight = _weight_of(model.lm_head)  # type: ignore[arg-type]
    return weight.device.type == "cpu" and weight.dtype == torch.float32 and quant_kernels.kernels() is not None


def _cached_conversion(model: nn.Module, weights: str, max_rows: int, cache: Path) -> WeightReport:
    """apply_weights for int4 or int8 on the CPU's kernels, read from `cache` where an earlier load kept it
    (the same model: the cache sits in its fingerprint's directory), else converted and then kept. Only a
    conversion whose every projection and head went to the kernels' blocks is kept; the modules built from
    the cache are the ones a conversion builds, with the same blocks and the same recorded errors."""
    import json

    places = dict(zip(_linear_paths(model), _linears(model)))
    loaded = _loaded_weights(model)
    found = _kept_conversion(cache, loaded, weights)
    if found is None:
        report = apply_weights(model, weights, max_rows)
        modules = {path: getattr(parent, name) for path, (parent, name, _) in places.items()}
        modules[HEAD] = model.lm_head
        kept = {path: kernel_blocks(module) for path, module in modules.items()}
        if all(b is not None for b in kept.values()):
            errors = {path: float(getattr(module, "max_error", 0.0)) for path, module in modules.items()}
            blocks = {path: b for path, b in kept.items() if b is not None}
            notes = {"__format": weights, "__quantiser": _QUANTISER, "__errors": json.dumps(errors)}
            write_block_cache(cache, blocks, notes)
        return report
    blocks, errors = found
    route = Route(max_rows)
    worst = total = 0.0
    for path, (parent, name, linear) in places.items():
        new = _from_blocks(_weight_of(linear), getattr(linear, "bias", None), route, blocks[path], errors[path])
        setattr(parent, name, new)
        worst = max(worst, new.max_error)
        total += new.converted_bytes()
    head = _from_blocks(loaded[HEAD], None, route, blocks[HEAD], errors[HEAD])
    model.lm_head = head
    total += head.converted_bytes()
    head_format = "int8" if blocks[HEAD].layout == "q8_0" else "int4"
    return WeightReport(weights, len(places), 0, worst, int(total), head_format, head.max_error, route)


#: The rules _q4_1_blocks and _q8_0_blocks quantise by; a kept conversion made under others is made again.
_QUANTISER = "1"


def _kept_conversion(
    cache: Path, loaded: dict[str, torch.Tensor], weights: str
) -> tuple[dict[str, Blocks], dict[str, float]] | None:
    """A kept conversion of these weights to `weights`, and each module's recorded error; None (convert again)
    where there is none, or it is of another format or quantiser, lacks a module, holds a layout the format
    does not make, or its first layer's blocks do not give the errors recorded for them (they then came from
    other weights: the errors are |de-quantised − loaded| computed as the conversion computes them)."""
    import json

    found = read_block_cache(cache, loaded, exact=False)
    if found is None:
        return None
    blocks, notes = found
    if notes.get("__format") != weights or notes.get("__quantiser") != _QUANTISER or set(blocks) != set(loaded):
        return None
    try:
        errors = {path: float(e) for path, e in json.loads(notes["__errors"]).items()}
    except (KeyError, ValueError, TypeError, AttributeError):
        return None
    projections = "q4_1" if weights == "int4" else "q8_0"
    if any(b.layout != (projections if path != HEAD else "q8_0") for path, b in blocks.items()):
        return None
    if set(errors) != set(blocks):
        return None
    for path in (p for p in blocks if p.startswith("model.layers.0.")):
        if float((blocks[path].dequantised() - loaded[path].float()).abs().max()) != errors[path]:
            return None
    return blocks, errors


def kernel_blocks(module: nn.Module) -> Blocks | None:
    """A converted module's blocks as the CPU's kernels read them (None: not converted to them): int4's Q4_1,
    int8's Q8_0, or a GGUF's own blocks. What a kept conversion stores and the C decode step points into."""
    if isinstance(module, Int4Linear) and module.kernels is not None:
        return Blocks("q4_1", module.nibbles, module.d, module.low)
    if isinstance(module, Int8Linear) and module.kernels is not None:
        return Blocks("q8_0", module.codes, module.d)
    if isinstance(module, BlockLinear):
        return Blocks(module.layout, module.codes, module.d, getattr(module, "low", None))
    return None


def _from_blocks(
    weight: torch.Tensor, bias: torch.Tensor | None, route: Route, blocks: Blocks, max_error: float
) -> ConvertedLinear:
    """The Int4Linear or Int8Linear a conversion of `weight` builds on the CPU's kernels, from its kept blocks."""
    module: Int4Linear | Int8Linear
    if blocks.layout == "q4_1":
        module = Int4Linear.__new__(Int4Linear)
        ConvertedLinear.__init__(module, weight, bias, route)
        module.on_cpu = True
        module.nibbles, module.d, module.low = blocks.codes, blocks.d, blocks.m  # type: ignore[assignment]
    else:
        module = Int8Linear.__new__(Int8Linear)
        ConvertedLinear.__init__(module, weight, bias, route)
        module.codes, module.d = blocks.codes, blocks.d
    module.kernels = quant_kernels.kernels()
    module.max_error = max_error
    return module


def _apply_blocks(model: nn.Module, blocks: dict[str, Blocks], route: Route) -> WeightReport:
    layers = kept = total = 0
    for path, (parent, name, linear) in zip(_linear_paths(model), _linears(model)):
        weight = _weight_of(linear)
        if path not in blocks:
            kept += 1
            total += _bytes(weight)
            continue
        setattr(parent, name, BlockLinear(weight, getattr(linear, "bias", None), route, blocks[path]))
        layers += 1
        total += blocks[path].nbytes()
    head_format = "fp32"
    if HEAD in blocks:
        model.lm_head = BlockLinear(_weight_of(model.lm_head), None, route, blocks[HEAD])  # type: ignore[arg-type]
        head_format = blocks[HEAD].layout
        total += blocks[HEAD].nbytes()
    else:
        total += _bytes(_weight_of(model.lm_head))  # type: ignore[arg-type]
    return WeightReport(GGUF_WEIGHTS, layers, kept, 0.0, total, head_format, 0.0, route)


def file_blocks(model: nn.Module, gguf: Path, cache: Path, heads: int, kv_heads: int) -> dict[str, Blocks] | None:
    """The GGUF's own blocks for every projection and the LM head of a loaded Transformer (fp32, CPU), where
    the kernels are built and every projection's block type is one they multiply exactly; else None. `cache`
    keeps them between loads (kvblend.model.gguf_blocks.cached_gguf_blocks)."""
    weights = [_weight_of(m) for _, _, m in _linears(model)]
    if not weights or weights[0].device.type != "cpu" or weights[0].dtype != torch.float32:
        return None
    if quant_kernels.kernels() is None:
        return None
    found = cached_gguf_blocks(gguf, cache, _loaded_weights(model), heads, kv_heads)
    return found if all(path in found for path in _linear_paths(model)) else None


def native_format(model: nn.Module) -> str:
    """The format a loaded model's weights already are, exactly, where kvblend's CPU kernels multiply it:
    "int4" if the first and last layers' projections are Q4_1 blocks (re-quantising them loses nothing),
    "int8" if they are Q8_0 blocks, else "fp32" (a Q4_K or mixed GGUF, safetensors, a GPU: the weights as
    loaded). Two layers stand for all: a GGUF quantizes its projections alike, and WeightReport.max_error
    then says what the conversion of every layer found."""
    weights = [_weight_of(m) for _, _, m in _linears(model)]
    if not weights or weights[0].device.type != "cpu" or quant_kernels.kernels() is None:
        return "fp32"
    per_layer = len(_LINEARS) + len(_MLP)
    sample = [w.detach().float() for w in weights[:per_layer] + weights[-per_layer:]]
    if any(w.shape[1] % INT4_GROUP for w in sample):
        return "fp32"
    if all(_q4_1_blocks(w)[-1] == 0.0 for w in sample):
        return "int4"
    if all(_q8_0_blocks(w)[-1] == 0.0 for w in sample):
        return "int8"
    return "fp32"


def _q4_1_blocks(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, float]:
    """Q4_1's codes, scales and minimums of a [out, in] weight (w ≈ d·q + m per block of 32), and the largest
    |d·q + m - w| (0.0: w already was Q4_1)."""
    n_out, n_in = w.shape
    blocks = w.view(n_out, n_in // INT4_GROUP, INT4_GROUP)
    low, high = blocks.amin(-1), blocks.amax(-1)
    d = (high - low) / 15.0
    safe = torch.where(d > 0, d, torch.ones_like(d))
    q = torch.round((blocks - low[..., None]) / safe[..., None]).clamp_(0, 15)
    return q, d, low, float((q * d[..., None] + low[..., None] - blocks).abs().max())


def _q8_0_blocks(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, float]:
    """Q8_0's codes and scales of a [out, in] weight (w ≈ d·q per block of 32, q in -127..127), and the
    largest |d·q - w| (0.0: w already was Q8_0)."""
    n_out, n_in = w.shape
    blocks = w.view(n_out, n_in // INT4_GROUP, INT4_GROUP)
    d = blocks.abs().amax(-1) / 127.0
    safe = torch.where(d > 0, d, torch.ones_like(d))
    q = torch.round(blocks / safe[..., None]).clamp_(-127, 127)
    return q, d, float((q * d[..., None] - blocks).abs().max())


def int4_packable(weight: torch.Tensor) -> bool:
    """Can an int4 kernel hold this [out, in] weight? Inputs in whole groups of 32, and where torch's CPU
    kernel stands in for kvblend's (no compiler), outputs in multiples of 16 (its packing's tile); other
    layers keep the weight as loaded."""
    n_out, n_in = weight.shape
    if n_in % INT4_GROUP:
        return False
    return weight.device.type != "cpu" or quant_kernels.kernels() is not None or n_out % INT4_CPU_TILE == 0


def _weight_of(linear: nn.Module) -> torch.Tensor:
    weight = linear.weight
    assert isinstance(weight, torch.Tensor)
    return weight


def _bytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def _convert(weights: str, weight: torch.Tensor, bias: torch.Tensor | None, route: Route) -> ConvertedLinear:
    if weights == "bf16":
        return BF16Linear(weight, bias, route)
    if weights == "int8":
        return Int8Linear(weight, bias, route)
    return Int4Linear(weight, bias, route)


def _linear_paths(model: nn.Module) -> list[str]:
    """The module path of each projection _linears yields, in its order ("model.layers.3.self_attn.q_proj")."""
    return [f"model.layers.{i}.{path}" for i in range(len(model.model.layers)) for path in (*_LINEARS, *_MLP)]  # type: ignore[union-attr,arg-type]


def _loaded_weights(model: nn.Module) -> dict[str, torch.Tensor]:
    """Each projection's weight as loaded, by module path, and the LM head's (HEAD): what kept blocks answer to."""
    loaded = {path: _weight_of(m) for path, (_, _, m) in zip(_linear_paths(model), _linears(model))}
    loaded[HEAD] = _weight_of(model.lm_head)  # type: ignore[arg-type]
    return loaded


def _linears(model: nn.Module) -> Iterator[tuple[nn.Module, str, nn.Module]]:
    """(parent, attribute, module) of every layer's projections: with the LM head, what a decode step streams."""
    for layer in model.model.layers:  # type: ignore[union-attr]
        for path in (*_LINEARS, *_MLP):
            owner, name = path.split(".")
            parent = getattr(layer, owner)
            yield parent, name, getattr(parent, name)
