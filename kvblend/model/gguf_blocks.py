"""A GGUF's quantized projections in the block layouts kvblend's CPU kernels multiply, bit for bit the file's weights.

Why: most GGUFs are not one format. A "Q4_K_M" file (llama.cpp's most common
4-bit recipe, and the shipped Gemma 3 270M) mixes Q4_K, Q6_K, Q5_0 and Q8_0
tensors. kvblend de-quantises the file to fp32 for prefill; without this module
its decode then streamed those fp32 weights (Gemma 3 270M: 9 tokens/s, its tied
262k-row head alone 670 MB a step), or `--weights int4` re-quantised them into
Q4_1, which changes the model (a third of greedy tokens differed).

Each GGUF block type below is re-expressed, exactly, in one of quant_gemv.c's
three layouts (blocks of 32 input weights, fp32 scales):

* Q8_0 → Q8_0, Q5_0 and Q4_0 → Q8_0 (``w = d·q``, the codes re-centred to int8);
* Q4_1 → Q4_1, Q4_K → Q4_1 (a Q4_K sub-block of 32 is ``d·sc·q − dmin·m``: a
  Q4_1 block with scale ``d·sc`` and minimum ``−dmin·m``, both exact in fp32);
* Q6_K → Q8_16 (int8 codes ``q − 32`` with a scale ``d·sc`` per 16 weights).

The codes are recovered from gguf's own de-quantisation (the values
transformers loads) and the block's scales, and every tensor is then checked:
its blocks, de-quantised, must equal the loaded fp32 weight exactly, or the
tensor is not taken. So a decode step multiplies the same numbers `full`'s
prefill does, and only the order of the sums differs. Other types (F16, Q5_1,
Q5_K, Q2_K, Q3_K, the IQ formats) are not taken, and a file that holds them
keeps the formats it had before (kvblend.model.weights.native_format).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

#: GGUF's per-layer tensor names → the decoder's module paths (kvblend.model.transformer, HF's names).
LAYER_TENSORS = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
HEAD = "lm_head"
_CHECK_ROWS = 8192  # rows de-quantised at a time when checking against the loaded weight
#: The cache's format; a cache of another (older rules) is made again, never read.
_CACHE_VERSION = "1"
_VERSION_KEY = "__kvblend_gguf_blocks__"
#: Each layout's codes dtype, how many input weights a scale covers, and quant_gemv.c's number for it (KVB_*).
_LAYOUTS = {"q4_1": (torch.uint8, 32, 1), "q8_0": (torch.int8, 32, 0), "q8_16": (torch.int8, 16, 2)}


@dataclass(frozen=True)
class Blocks:
    """One [n_out, n_in] weight in a kernel layout: "q4_1" (nibbles [out, in/2] uint8, d and m [out, in/32]),
    "q8_0" (codes [out, in] int8, d [out, in/32]) or "q8_16" (codes [out, in] int8, d [out, in/16])."""

    layout: str
    codes: torch.Tensor
    d: torch.Tensor
    m: torch.Tensor | None = None

    @property
    def shape(self) -> tuple[int, int]:
        n_out, width = self.codes.shape
        return n_out, width * 2 if self.layout == "q4_1" else width

    def dequantised(self, rows: slice = slice(None)) -> torch.Tensor:
        """The fp32 weights these blocks hold (rows `rows`), computed as gguf de-quantises: d·q (+ m)."""
        d = self.d[rows]
        if self.layout == "q4_1":
            nib = self.codes[rows]
            q = torch.cat([nib.view(-1, 16) & 0x0F, nib.view(-1, 16) >> 4], dim=1).float()  # block order
            assert self.m is not None
            return (q * d.reshape(-1, 1) + self.m[rows].reshape(-1, 1)).view(d.shape[0], -1)
        per = 16 if self.layout == "q8_16" else 32
        q = self.codes[rows].float().view(-1, per)
        return (q * d.reshape(-1, 1)).view(d.shape[0], -1)

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.codes, self.d, self.m) if t is not None)

    @property
    def kernel_format(self) -> int:
        """quant_gemv.c's number for this layout (a kvb_linear's `format`)."""
        return _LAYOUTS[self.layout][2]

    def check(self) -> None:
        """ValueError unless these tensors are what the kernels read through raw pointers for this layout
        (quant_kernels.check_blocks, the products' own check): codes, scales, and Q4_1's minimums."""
        from kvblend.model import quant_kernels

        if self.layout not in _LAYOUTS or self.codes.dim() != 2 or (self.m is not None) != (self.layout == "q4_1"):
            raise ValueError(f"not {self.layout} blocks")
        dtype, per, _ = _LAYOUTS[self.layout]
        scales = (self.d,) if self.m is None else (self.d, self.m)
        n_in = self.shape[1]
        quant_kernels.check_blocks(n_in, self.codes, dtype, self.codes.shape[1], *scales, scale_block=per)


def cached_gguf_blocks(
    path: Path, cache: Path, loaded: dict[str, torch.Tensor], heads: int, kv_heads: int
) -> dict[str, Blocks]:
    """gguf_blocks, kept in `cache` (a safetensors file beside the GGUF's converted checkpoint, written once
    and renamed into place): reading a GGUF's header takes seconds (Gemma 3's 262k-token vocabulary), the
    cached blocks a fraction of one. A cache of another version, or whose tensors do not fit the loaded
    weights (names, dtypes, shapes; the first layer's blocks de-quantised and compared), is made again;
    where the cache cannot be written the blocks are still returned."""
    found = read_block_cache(cache, loaded)
    if found is not None:
        return found[0]
    blocks = gguf_blocks(path, loaded, heads, kv_heads)
    write_block_cache(cache, blocks)
    return blocks


def read_block_cache(
    cache: Path, loaded: dict[str, torch.Tensor], exact: bool = True
) -> tuple[dict[str, Blocks], dict[str, str]] | None:
    """Blocks kept by write_block_cache, with the notes written beside them; None where the file is missing,
    unreadable, of another version, or does not fit `loaded` (names, dtypes, shapes; where `exact`, the first
    layer's blocks must also de-quantise to the loaded weights bit for bit)."""
    from safetensors import SafetensorError, safe_open

    try:
        with safe_open(str(cache), framework="pt") as f:
            layouts = dict(f.metadata() or {})
            if layouts.pop(_VERSION_KEY, None) != _CACHE_VERSION:
                return None
            notes = {k: layouts.pop(k) for k in [k for k in layouts if k.startswith("__")]}
            names = set(f.keys())
            blocks = {}
            for name, layout in layouts.items():
                parts = [f"{name}.{part}" for part in ("codes", "d", "m")]
                m = f.get_tensor(parts[2]) if parts[2] in names else None
                blocks[name] = Blocks(layout, f.get_tensor(parts[0]), f.get_tensor(parts[1]), m)
    except (OSError, SafetensorError, ValueError):
        return None
    if not all(name in loaded and _fits(b, loaded[name]) for name, b in blocks.items()):
        return None
    first = [name for name in blocks if name.startswith("model.layers.0.")]
    if exact and not all(_equal(blocks[name], loaded[name]) for name in first):
        return None
    return blocks, notes


def _fits(blocks: Blocks, weight: torch.Tensor) -> bool:
    """Are these blocks, as read from a cache, what their layout says for a weight of this shape?"""
    try:
        blocks.check()
    except ValueError:
        return False
    return weight.dim() == 2 and blocks.shape == tuple(weight.shape)


def write_block_cache(cache: Path, blocks: dict[str, Blocks], notes: dict[str, str] | None = None) -> None:
    """Keep `blocks` (and `notes`, keys starting "__") in `cache`: written to a temporary name, renamed into
    place; where it cannot be written, nothing is, and nothing fails."""
    import tempfile

    from safetensors import SafetensorError
    from safetensors.torch import save_file

    tensors = {}
    for name, b in blocks.items():
        tensors[f"{name}.codes"], tensors[f"{name}.d"] = b.codes, b.d
        if b.m is not None:
            tensors[f"{name}.m"] = b.m
    try:
        cache.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=cache.parent, prefix=".blocks-", suffix=".part")
    except OSError:
        return  # a read-only cache: the blocks serve this process only
    os.close(fd)
    try:
        metadata = {name: b.layout for name, b in blocks.items()}
        save_file(tensors, tmp, metadata={**metadata, **(notes or {}), _VERSION_KEY: _CACHE_VERSION})
        with open(tmp, "rb") as written:  # on disk before it has the name readers trust (a crash: no file)
            os.fsync(written.fileno())
        os.replace(tmp, cache)
    except (OSError, SafetensorError):  # a full disk, a vanished directory: this process keeps its blocks
        pass
    finally:
        Path(tmp).unlink(missing_ok=True)


def gguf_blocks(path: Path, loaded: dict[str, torch.Tensor], heads: int, kv_heads: int) -> dict[str, Blocks]:
    """The kernel blocks of every projection (and the LM head) whose GGUF type this module re-expresses and
    whose blocks equal `loaded[name]` (the fp32 weights, by module path: "model.layers.3.self_attn.q_proj",
    "lm_head") exactly. Rows are tried in the file's order and in the order transformers un-permutes Llama's
    q/k rows into; a tensor matching neither is left out."""
    from gguf import GGUFReader

    reader = plain_array_reader(GGUFReader)(path)
    tensors = {t.name: t for t in reader.tensors}
    wanted: dict[str, str] = {}
    for name in loaded:
        gguf_name = _gguf_name(name, tensors)
        if gguf_name is not None:
            wanted[name] = gguf_name
    found: dict[str, Blocks] = {}
    for name, gguf_name in wanted.items():
        tensor = tensors[gguf_name]
        blocks = _blocks(tensor.tensor_type.name, np.asarray(tensor.data), tensor)
        if blocks is None or blocks.shape != tuple(loaded[name].shape):
            continue
        group = kv_heads if name.endswith("k_proj") else heads
        for order in (None, _unpermuted_rows(blocks.shape[0], group)):
            candidate = blocks if order is None else _rows(blocks, order)
            if candidate is not None and _equal(candidate, loaded[name]):
                found[name] = candidate
                break
    return found


def _gguf_name(module: str, tensors: dict) -> str | None:
    if module == HEAD:
        found = [n for n in ("output.weight", "token_embd.weight") if n in tensors]
        return found[0] if found else None
    parts = module.split(".")  # model.layers.<i>.<owner>.<name>
    if len(parts) != 5 or parts[:2] != ["model", "layers"]:
        return None
    for gguf_part, path in LAYER_TENSORS.items():
        if path == ".".join(parts[3:]):
            name = f"blk.{parts[2]}.{gguf_part}.weight"
            return name if name in tensors else None
    return None


def _blocks(kind: str, raw: np.ndarray, tensor) -> Blocks | None:
    """The kernel layout of one GGUF tensor's raw blocks (rows of bytes), or None for a type not re-expressed."""
    if raw.dtype != np.uint8 or raw.ndim != 2:
        return None
    n_out = raw.shape[0]
    if kind == "Q8_0":  # 2-byte fp16 d, 32 int8 codes
        b = raw.reshape(n_out, -1, 34)
        d = _f16(b[..., 0:2])
        codes = b[..., 2:].copy().view(np.int8).reshape(n_out, -1)
        return Blocks("q8_0", torch.from_numpy(codes), torch.from_numpy(d))
    if kind not in ("Q4_0", "Q5_0", "Q4_1", "Q4_K", "Q6_K"):
        return None
    from gguf.quants import dequantize

    values = dequantize(raw, tensor.tensor_type).astype(np.float32, copy=False)  # what transformers loaded
    n_in = values.shape[1]
    if kind in ("Q4_0", "Q5_0"):  # w = d·(q − 8) or d·(q − 16): int8 codes under Q8_0's scale
        size = 18 if kind == "Q4_0" else 22
        d = _f16(raw.reshape(n_out, -1, size)[..., 0:2])
        return _q8(values, d, 32, "q8_0")
    if kind == "Q6_K":  # per 256: ql[128], qh[64], scales int8[16], d fp16; w = d·sc·(q − 32) per 16
        b = raw.reshape(n_out, -1, 210)
        d = _f16(b[..., 208:210])
        sc = b[..., 192:208].view(np.int8).astype(np.float32)
        return _q8(values, (d[..., None] * sc).reshape(n_out, -1), 16, "q8_16")
    if kind == "Q4_1":  # d, m fp16; w = d·q + m
        b = raw.reshape(n_out, -1, 20)
        return _q4(values, _f16(b[..., 0:2]), _f16(b[..., 2:4]))
    # Q4_K, per 256: d, dmin fp16, 12 bytes of 6-bit scales and minimums, 128 bytes of codes;
    # sub-block j of 32: w = d·sc_j·q − dmin·m_j
    b = raw.reshape(n_out, -1, 144)
    d, dmin = _f16(b[..., 0:2]), _f16(b[..., 2:4])
    sc, mn = _k4_scales(b[..., 4:16])
    scale = (d[..., None] * sc).reshape(n_out, -1)
    low = -(dmin[..., None] * mn).reshape(n_out, -1)
    assert scale.shape[1] * 32 == n_in
    return _q4(values, scale, low)


def _f16(pairs: np.ndarray) -> np.ndarray:
    """Little-endian fp16 from [..., 2] bytes, as fp32 (exact)."""
    return np.ascontiguousarray(pairs).view(np.float16)[..., 0].astype(np.float32)


def _k4_scales(packed: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Q4_K's eight 6-bit scales and minimums per super-block, from its 12 packed bytes (ggml's get_scale_min_k4)."""
    s = packed.astype(np.uint8)
    sc = np.empty(s.shape[:-1] + (8,), dtype=np.float32)
    mn = np.empty_like(sc)
    sc[..., :4] = s[..., 0:4] & 63
    mn[..., :4] = s[..., 4:8] & 63
    sc[..., 4:] = (s[..., 8:12] & 0x0F) | ((s[..., 0:4] >> 6) << 4)
    mn[..., 4:] = (s[..., 8:12] >> 4) | ((s[..., 4:8] >> 6) << 4)
    return sc, mn


def _q8(values: np.ndarray, d: np.ndarray, per: int, layout: str) -> Blocks | None:
    n_out, n_in = values.shape
    v = values.reshape(n_out, n_in // per, per)
    safe = np.where(d != 0, d, 1).astype(np.float32)
    q = np.rint(v / safe[..., None])
    if np.abs(q).max(initial=0) > 127:
        return None
    codes = q.astype(np.int8).reshape(n_out, n_in)
    return Blocks(layout, torch.from_numpy(codes), torch.from_numpy(np.ascontiguousarray(d, dtype=np.float32)))


def _q4(values: np.ndarray, d: np.ndarray, low: np.ndarray) -> Blocks | None:
    n_out, n_in = values.shape
    v = values.reshape(n_out, n_in // 32, 32)
    safe = np.where(d != 0, d, 1).astype(np.float32)
    q = np.rint((v - low[..., None]) / safe[..., None])
    if q.min(initial=0) < 0 or q.max(initial=0) > 15:
        return None
    q = q.astype(np.uint8)
    nibbles = (q[..., :16] | (q[..., 16:] << 4)).reshape(n_out, n_in // 2)
    return Blocks(
        "q4_1",
        torch.from_numpy(np.ascontiguousarray(nibbles)),
        torch.from_numpy(np.ascontiguousarray(d, dtype=np.float32)),
        torch.from_numpy(np.ascontiguousarray(low, dtype=np.float32)),
    )


def _unpermuted_rows(n_out: int, heads: int) -> torch.Tensor | None:
    """The row order transformers gives a Llama GGUF's q/k weights (llama.cpp stores each head's rotary
    pairs interleaved; transformers' reverse_permute_weights undoes it): loaded row r is file row order[r]."""
    if heads <= 0 or n_out % (2 * heads):
        return None
    half = n_out // heads // 2
    return torch.arange(n_out).view(heads, half, 2).transpose(1, 2).reshape(-1)


def _rows(blocks: Blocks, order: torch.Tensor | None) -> Blocks | None:
    if order is None:
        return None
    m = None if blocks.m is None else blocks.m[order].contiguous()
    return Blocks(blocks.layout, blocks.codes[order].contiguous(), blocks.d[order].contiguous(), m)


def _equal(blocks: Blocks, weight: torch.Tensor) -> bool:
    """Do the blocks hold exactly `weight` (fp32, as loaded)? Checked in slices of rows (a 262k-row head)."""
    if weight.dtype != torch.float32 or weight.device.type != "cpu":
        return False
    for start in range(0, weight.shape[0], _CHECK_ROWS):
        rows = slice(start, start + _CHECK_ROWS)
        if not torch.equal(blocks.dequantised(rows), weight[rows]):
            return False
    return True


def plain_array_reader(reader: type) -> type:
    """gguf's GGUFReader, slicing the file through a plain ndarray view of its memory map instead of the
    np.memmap itself: the same bytes, fields and tensors (its parts are views of the same mapping), without
    np.memmap's Python-level __getitem__/__array_finalize__ on each of the ~800k slices a 262k-entry
    vocabulary takes. Gemma 3's file parsed in 13.8 s that way and parses in 4.3 s this way (2-core AMD EPYC).
    `_get` is the reader's one slicing helper (gguf 0.19.0, pinned); its logic is kept, only the array differs."""

    class PlainArrayReader(reader):
        def _get(self, offset: int, dtype: Any, count: int = 1, override_order: Any = None) -> Any:
            plain = self.__dict__.get("_plain_data")
            if plain is None:
                plain = self.__dict__["_plain_data"] = self.data.view(np.ndarray)
            dtype, count = np.dtype(dtype), int(count)
            arr = plain[offset : offset + dtype.itemsize * count].view(dtype)[:count]
            return arr.view(arr.dtype.newbyteorder(self.byte_order if override_order is None else override_order))

    return PlainArrayReader
