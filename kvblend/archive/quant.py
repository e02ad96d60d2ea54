"""Lossy KV codecs ``int8`` and ``int4``: group-wise asymmetric quantization (KIVI), then zstd.

Why this shape (measurements in codec.py's docstring and FORMAT.md 3.2):

* **K per channel.** Keys have outlier channels (SmolLM2: the largest channel
  of a head is 4-15x the median one in mean magnitude, and sits up to 10 std
  off zero); one scale per token would spend the whole code range on them. Each
  channel gets its own (scale, min), shared by a group of ``k_group`` consecutive
  tokens so the scales cost little.
* **V per token.** Values have milder channels (1.3-6.6x); their error lands in the
  attention output token by token, so each token gets (scale, min) per
  group of ``v_group`` channels.
* **Asymmetric min/max.** K channels sit off zero; symmetric codes waste half
  the range on values that never occur.
* **Scales and mins in the KV's own dtype** (fp16 here): exact enough, half
  of fp32, and never out of range for the values they describe (bf16 KV
  keeps bf16 scales).
* **int4 packing**: value ``i`` of the flattened tensor in a byte's low
  nibble and value ``i + N/2`` in its high nibble, so unpacking is two
  contiguous uint8 passes (splitting channel pairs instead meant strided
  writes, several times slower).
* **Dequantize as a multiply then an add**, each broadcasting one operand:
  torch vectorizes those, where an ``addcmul`` broadcasting both scale and
  min over a 32-channel group ran 3-4x slower.

Decoding is lazy: :class:`Quantized` holds codes and scales, and the loader
calls :meth:`Quantized.dequantize` with the prompt-wide layer as ``out``, so
dequantizing is the pass that builds the layer, not an extra one. torch is
imported inside the functions (listing an archive never loads it).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

from kvblend.errors import CorruptBlobError

if TYPE_CHECKING:
    import torch


@dataclass(frozen=True)
class Scheme:
    """One lossy codec: code width and scale-group sizes (tokens per K group, channels per V group)."""

    bits: int
    k_group: int
    v_group: int

    @property
    def levels(self) -> int:
        return (1 << self.bits) - 1


#: The lossy codecs. Group sizes chosen by measurement (codec.py): smaller groups
#: cost scale bytes, larger ones cost fidelity.
SCHEMES: dict[str, Scheme] = {"int8": Scheme(8, 64, 64), "int4": Scheme(4, 64, 32)}

#: Which axis a tensor's scale groups run along: K per channel (groups of tokens), V per token.
AXES = {"k": "tokens", "v": "channels"}


@dataclass(frozen=True)
class Quantized:
    """One tensor's codes and scales: ``x ≈ codes * scale + zero``, group by group.

    ``shape``/``dtype`` are those of the tensor it stands for ([kv_heads, n,
    head_dim]); ``axis`` "tokens": scale/zero are [H, ceil(n/group), D] (per
    channel, one row per group of tokens); "channels": [H, n, D/group].
    """

    codes: torch.Tensor  # uint8: [H, n, D] (8 bits), or the flat H·n·D/2 bytes of two codes each (4 bits)
    scale: torch.Tensor
    zero: torch.Tensor
    bits: int
    axis: str
    group: int
    shape: tuple[int, int, int]
    dtype: torch.dtype

    def to(self, device: Any = None, non_blocking: bool = False) -> Quantized:
        """Codes and scales moved (a quarter to a half of the fp16 bytes cross the bus)."""
        return replace(
            self,
            codes=self.codes.to(device, non_blocking=non_blocking),
            scale=self.scale.to(device, non_blocking=non_blocking),
            zero=self.zero.to(device, non_blocking=non_blocking),
        )

    def pin_memory(self) -> Quantized:
        return replace(self, codes=self.codes.pin_memory(), scale=self.scale.pin_memory(), zero=self.zero.pin_memory())

    def unpacked(self) -> torch.Tensor:
        """The codes as uint8 [H, n, D], one per value (int4: two contiguous uint8 passes)."""
        import numpy as np
        import torch

        if self.bits == 8:
            return self.codes
        half = self.codes.numel()
        out = torch.empty(2 * half, dtype=torch.uint8, device=self.codes.device)
        if out.device.type == "cpu":  # numpy's uint8 kernels: the two passes together ran ~8x faster
            src, dst = self.codes.numpy(), out.numpy()
            np.bitwise_and(src, 0x0F, out=dst[:half])
            np.right_shift(src, 4, out=dst[half:])
        else:
            torch.bitwise_and(self.codes, 0x0F, out=out[:half])
            torch.bitwise_right_shift(self.codes, 4, out=out[half:])
        return out.view(self.shape)

    def dequantize(self, out: torch.Tensor | None = None) -> torch.Tensor:
        """Write ``codes * scale + zero`` into ``out`` (any float dtype, may be a row slice); return it.

        Without ``out``: a new float32 tensor, computed in place in the codes'
        float copy (callers cast if they need the stored dtype).
        """
        values = self.unpacked().to(torch_float(out))
        if out is None:
            out = values
        fill = _fill_tokens if self.axis == "tokens" else _fill_channels
        fill(values, self.scale.to(out.dtype), self.zero.to(out.dtype), self.group, out)
        return out


def torch_float(out: torch.Tensor | None) -> torch.dtype:
    """The dtype to widen codes to: ``out``'s, else float32."""
    import torch

    return torch.float32 if out is None else out.dtype


def _scale_shift(values: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, out: torch.Tensor) -> None:
    import torch

    torch.mul(values, scale, out=out)
    out.add_(zero)


def _fill_tokens(values: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, group: int, out: torch.Tensor) -> None:
    """Per-channel scales over groups of ``group`` tokens: whole groups in one pass, the short tail in another."""
    n = values.shape[1]
    full = n // group
    if full:
        m = full * group
        _scale_shift(
            values[:, :m].unflatten(1, (full, group)),
            scale[:, :full, None],
            zero[:, :full, None],
            out[:, :m].unflatten(1, (full, group)),
        )
    if n > full * group:
        _scale_shift(values[:, full * group :], scale[:, full:], zero[:, full:], out[:, full * group :])


def _fill_channels(
    values: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, group: int, out: torch.Tensor
) -> None:
    """Per-token scales over groups of ``group`` consecutive channels."""
    split = (values.shape[-1] // group, group)
    _scale_shift(values.unflatten(-1, split), scale[..., None], zero[..., None], out.unflatten(-1, split))


def effective_group(axis: str, group: int, shape: tuple[int, int, int]) -> int:
    """The group size a tensor of this shape can use: the largest divisor of head_dim up to ``group`` for
    channel groups (tiny test models have small heads); any size for token groups (the last may be short)."""
    if axis == "tokens":
        return max(1, group)
    g = max(1, min(group, shape[2]))
    while shape[2] % g:
        g -= 1
    return g


def quantize(x: torch.Tensor, bits: int, axis: str, group: int) -> Quantized:
    """Asymmetric min/max quantization of ``x`` [H, n, D] to ``bits`` with groups along ``axis``.

    Codes are computed against the scale and min as stored (rounded to the KV
    dtype), so the round-trip error stays within half a step of the stored scale.
    """
    import torch

    h, n, d = (int(s) for s in x.shape)
    if bits == 4 and d % 2:
        raise ValueError(f"int4 packs values in pairs; head_dim {d} is odd")
    x32 = x.detach().float()
    if not bool(torch.isfinite(x32).all()):
        raise ValueError("KV holds inf or NaN; it cannot be quantized (store it with a lossless codec)")
    group = effective_group(axis, group, (h, n, d))
    levels = (1 << bits) - 1
    grouped = _grouped(x32, axis, group)
    red = 2 if axis == "tokens" else 3
    if grouped.numel() == 0:  # no tokens: no groups (min/max of nothing is undefined)
        empty = torch.zeros(tuple(s for i, s in enumerate(grouped.shape) if i != red), dtype=x.dtype)
        codes = torch.zeros((h, n, d) if bits == 8 else (0,), dtype=torch.uint8)
        return Quantized(codes, empty, empty.clone(), bits, axis, group, (h, n, d), x.dtype)
    zero = grouped.amin(red).to(x.dtype)
    scale = ((grouped.amax(red) - zero.float()) / levels).to(x.dtype)
    step = torch.where(scale == 0, torch.ones_like(scale, dtype=torch.float32), scale.float())
    codes = (grouped - zero.float().unsqueeze(red)).div_(step.unsqueeze(red)).round_().clamp_(0, levels)
    codes = codes.to(torch.uint8).reshape(h, -1, d)[:, :n]
    if bits == 4:  # the first half of the values in the low nibbles, the second in the high ones
        flat = codes.reshape(-1)
        half = flat.numel() // 2
        codes = flat[:half] | (flat[half:] << 4)
    return Quantized(codes.contiguous(), scale.contiguous(), zero.contiguous(), bits, axis, group, (h, n, d), x.dtype)


def _grouped(x32: torch.Tensor, axis: str, group: int) -> torch.Tensor:
    """``x`` viewed as groups: tokens → [H, G, group, D] (tail padded with its last token),
    channels → [H, n, D/g, g]."""
    import torch

    h, n, d = x32.shape
    if axis == "channels":
        return x32.view(h, n, d // group, group)
    pad = -n % group
    if pad:
        x32 = torch.cat([x32, x32[:, -1:].expand(h, pad, d)], 1)
    return x32.view(h, (n + pad) // group, group, d)


def payload_tensors(k: torch.Tensor, v: torch.Tensor, scheme: Scheme, info: dict[str, object]) -> dict:
    """K and V quantized as the payload stores them: ``{name}`` codes, ``{name}_scale``, ``{name}_min``.

    The group sizes actually used go into the metadata (``k_group``,
    ``v_group``), so a reader never depends on today's defaults.
    """
    tensors = {}
    for name, t, group in (("k", k, scheme.k_group), ("v", v, scheme.v_group)):
        q = quantize(t, scheme.bits, AXES[name], group)
        tensors.update({name: q.codes, f"{name}_scale": q.scale, f"{name}_min": q.zero})
        info[f"{name}_group"] = q.group
    return tensors


def from_payload(
    tensors: dict, meta: dict, name: str, dtype: torch.dtype, shape: list[int], scheme: Scheme
) -> Quantized:
    """Tensor ``name`` of a decoded payload as :class:`Quantized`, every shape checked (else CorruptBlobError)."""
    import torch

    codes, scale, zero = tensors.get(name), tensors.get(f"{name}_scale"), tensors.get(f"{name}_min")
    if codes is None or scale is None or zero is None:
        raise CorruptBlobError(f"quantized payload lacks {name}, {name}_scale or {name}_min")
    h, n, d = shape
    axis, group = AXES[name], meta.get(f"{name}_group")
    if not isinstance(group, int) or group < 1 or (axis == "channels" and d % group):
        raise CorruptBlobError(f"payload metadata has no valid {name}_group")
    want_codes = (h, n, d) if scheme.bits == 8 else (h * n * d // 2,)
    want_scale = (h, -(-n // group), d) if axis == "tokens" else (h, n, d // group)
    if codes.dtype != torch.uint8 or tuple(codes.shape) != want_codes:
        raise CorruptBlobError(f"{name} codes are {codes.dtype} {tuple(codes.shape)}, expected uint8 {want_codes}")
    for what, t in (("scale", scale), ("min", zero)):
        if t.dtype != dtype or tuple(t.shape) != want_scale:
            raise CorruptBlobError(f"{name}_{what} is {t.dtype} {tuple(t.shape)}, expected {dtype} {want_scale}")
    return Quantized(codes, scale, zero, scheme.bits, axis, group, (h, n, d), dtype)
