"""Lossy codecs (int8, int4) on tiny tensors: error bounds, outlier channels, payload layout, refusals."""

from __future__ import annotations

import json

import pytest
import torch
import zstandard
from safetensors.torch import load

from kvblend.archive import codec as C
from kvblend.archive.quant import SCHEMES, Quantized, quantize
from kvblend.errors import CorruptBlobError, UsageError

LOSSY = ["int8", "int4"]


def kv_with_outliers(n: int = 70, heads: int = 2, dim: int = 16, seed: int = 0, dtype=torch.float16):
    """K with two outlier channels (large and off zero, as real keys have), V plain."""
    g = torch.Generator().manual_seed(seed)
    k = torch.randn(heads, n, dim, generator=g)
    k[..., 3] = k[..., 3] * 12 + 40  # an outlier channel with a large mean
    k[..., 11] = k[..., 11] * 25  # and a wide one
    v = torch.randn(heads, n, dim, generator=g)
    return k.to(dtype), v.to(dtype)


def step_bound(x: torch.Tensor, bits: int, axis: str, group: int) -> torch.Tensor:
    """Per element: half a quantization step of its group, plus fp16 rounding of the stored scale and min."""
    h, n, d = x.shape
    x = x.float()
    if axis == "tokens":
        pad = -n % group
        xp = torch.cat([x, x[:, -1:].expand(h, pad, d)], 1) if pad else x
        g = xp.view(h, -1, group, d)
        rng = (g.amax(2, keepdim=True) - g.amin(2, keepdim=True)).expand_as(g).reshape(h, -1, d)[:, :n]
        mag = g.abs().amax(2, keepdim=True).expand_as(g).reshape(h, -1, d)[:, :n]
    else:
        g = x.view(h, n, d // group, group)
        rng = (g.amax(3, keepdim=True) - g.amin(3, keepdim=True)).expand_as(g).reshape(h, n, d)
        mag = g.abs().amax(3, keepdim=True).expand_as(g).reshape(h, n, d)
    levels = (1 << bits) - 1
    return rng / levels * (0.5 + levels * 2**-10) + mag * 2**-10 + 1e-6


@pytest.mark.parametrize("codec", LOSSY)
@pytest.mark.parametrize("n", [1, 31, 32, 70])
def test_round_trip_error_within_half_a_step_of_each_group(codec, n):
    k, v = kv_with_outliers(n)
    scheme = SCHEMES[codec]
    k2, v2 = C.decode_layer(C.encode_layer(k, v, codec), codec)
    assert k2.dtype == k.dtype and k2.shape == k.shape and v2.shape == v.shape
    for x, y, name in ((k, k2, "k"), (v, v2, "v")):
        axis = "tokens" if name == "k" else "channels"
        group = quantize(x, scheme.bits, axis, scheme.k_group if name == "k" else scheme.v_group).group
        bound = step_bound(x, scheme.bits, axis, group) + x.float().abs() * 2**-10  # + the fp16 output rounding
        assert ((y.float() - x.float()).abs() <= bound).all(), name


@pytest.mark.parametrize("codec, limit", [("int8", 0.01), ("int4", 0.12)])
def test_per_channel_keys_keep_outlier_channels_from_swamping_the_rest(codec, limit):
    """Per-channel K scales: the small channels keep their own precision beside 40± outliers."""
    k, v = kv_with_outliers(256)
    k2, _ = C.decode_layer(C.encode_layer(k, v, codec), codec)
    small = [c for c in range(k.shape[-1]) if c not in (3, 11)]
    err = (k2[..., small].float() - k[..., small].float()).norm() / k[..., small].float().norm()
    assert err < limit
    # one scale per token (V's layout) would have to span the outliers: far worse on the small channels
    per_token = quantize(k, SCHEMES[codec].bits, "channels", k.shape[-1]).dequantize()
    err_token = (per_token[..., small] - k[..., small].float()).norm() / k[..., small].float().norm()
    assert err_token > 4 * err


def test_sizes_against_fp16():
    k, v = (torch.randn(3, 512, 64, generator=torch.Generator().manual_seed(s)).half() for s in (1, 2))
    raw = 2 * k.numel() * 2
    assert len(C.encode_layer(k, v, "int8")) < 0.55 * raw
    assert len(C.encode_layer(k, v, "int4")) < 0.32 * raw  # random normal; real KV compresses better


@pytest.mark.parametrize("codec", LOSSY)
def test_lazy_decode_dequantizes_into_a_strided_destination(codec):
    """What the loader does: codes written straight into the prompt-wide layer's rows (fp32), = eager decode."""
    k, v = kv_with_outliers(45)
    data = C.encode_layer(k, v, codec)
    qk, qv = C.decode_layer(data, codec, lazy=True)
    assert isinstance(qk, Quantized) and qk.shape == tuple(k.shape) and qk.dtype == k.dtype
    layer = torch.full((1, 2, 100, 16), 7.0)
    qv.dequantize(out=layer[0, :, 20:65])
    eager_k, eager_v = C.decode_layer(data, codec)
    assert torch.equal(layer[0, :, 20:65].half(), eager_v)
    assert (layer[0, :, :20] == 7).all() and (layer[0, :, 65:] == 7).all()  # nothing written outside the rows
    assert torch.equal(qk.dequantize().half(), eager_k)


@pytest.mark.parametrize("codec", LOSSY)
def test_payload_is_safetensors_with_codes_scales_and_its_codec(codec):
    k, v = kv_with_outliers(40)
    raw = zstandard.ZstdDecompressor().decompress(C.encode_layer(k, v, codec))
    tensors = load(raw)
    meta = json.loads(json.loads(raw[8 : 8 + int.from_bytes(raw[:8], "little")])["__metadata__"]["kvblend"])
    assert meta["codec"] == codec and meta["k_shape"] == "2,40,16" and meta["k_dtype"] == "float16"
    shape = (2, 40, 16) if codec == "int8" else (2 * 40 * 16 // 2,)  # int4: two values a byte, flat
    assert tensors["k"].dtype == torch.uint8 and tuple(tensors["k"].shape) == shape
    assert tensors["k_scale"].dtype == torch.float16 and tensors["v_min"].dtype == torch.float16
    assert C.describe_payload(raw)["codec"] == codec  # a rebuilt index gets the codec from the blob


def test_bf16_kv_keeps_bf16_scales_and_round_trips():
    k, v = kv_with_outliers(33, dtype=torch.bfloat16)
    k2, v2 = C.decode_layer(C.encode_layer(k, v, "int8"), "int8")
    assert k2.dtype == torch.bfloat16 and (k2.float() - k.float()).abs().max() < 1.0


def test_identical_kv_gives_identical_bytes_and_empty_segments_work():
    k, v = kv_with_outliers(20)
    for codec in LOSSY:
        assert C.encode_layer(k, v, codec) == C.encode_layer(k.clone(), v.clone(), codec)
        e = torch.zeros(2, 0, 16, dtype=torch.float16)
        ke, ve = C.decode_layer(C.encode_layer(e, e, codec), codec)
        assert ke.shape == (2, 0, 16) and ve.dtype == torch.float16


def test_lossless_alias_and_unknown_names():
    assert C.check_codec("lossless") == C.DEFAULT_CODEC and C.is_lossless("lossless")
    assert not C.is_lossless("int4")
    with pytest.raises(UsageError, match="unknown codec 'int3'.*int8, int4, lossless"):
        C.check_codec("int3")
    k, v = kv_with_outliers(8)
    data = C.encode_layer(k, v, "lossless")  # written under its canonical name
    assert C.describe_payload(zstandard.ZstdDecompressor().decompress(data))["codec"] == C.DEFAULT_CODEC


def test_a_payload_is_never_decoded_as_another_codec():
    k, v = kv_with_outliers(8)
    for written, claimed in (("int8", "int4"), ("int4", "int8"), ("int4", "zstd-shuffle"), ("zstd", "int8")):
        with pytest.raises(CorruptBlobError, match="codec"):
            C.decode_layer(C.encode_layer(k, v, written), claimed)


def test_non_finite_kv_is_refused_for_lossy_codecs():
    k, v = kv_with_outliers(8)
    k[0, 0, 0] = float("inf")
    with pytest.raises(ValueError, match="lossless"):
        C.encode_layer(k, v, "int8")


def test_tampered_scales_or_codes_are_corrupt_not_misread():
    """Shapes in a payload that do not fit its declared shape are refused, not broadcast."""
    from safetensors.torch import save

    k, v = kv_with_outliers(40)
    raw = zstandard.ZstdDecompressor().decompress(C.encode_layer(k, v, "int4"))
    tensors = load(raw)
    header = json.loads(raw[8 : 8 + int.from_bytes(raw[:8], "little")])["__metadata__"]
    for name, bad in (("k_scale", tensors["k_scale"][..., :1].contiguous()), ("v", tensors["v"][:100].contiguous())):
        forged = save({**tensors, name: bad}, metadata=header)
        with pytest.raises(CorruptBlobError):
            C.decode_safetensors(forged, "int4")
