"""Codec tests: lossless round trips, payload layout, refusal of damaged or mislabeled data (lossy codecs: test_quant*.py)."""

from __future__ import annotations

import json

import pytest
import torch
import zstandard
from safetensors.torch import load

from support import run_in_threads
from kvblend.archive import codec as C
from kvblend.errors import CorruptBlobError, UsageError

DTYPES = [torch.float16, torch.bfloat16, torch.float32]


def _bits(t: torch.Tensor) -> torch.Tensor:
    """Integer view, so NaN payloads and -0.0 are compared exactly."""
    return t.view({2: torch.int16, 4: torch.int32}[t.element_size()])


def _kv(dtype: torch.dtype, heads: int = 2, n: int = 33, dim: int = 16, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    k = (torch.randn(heads, n, dim, generator=g) * 3).to(dtype)
    v = torch.randn(heads, n, dim, generator=g).to(dtype)
    # special values must survive too
    k[0, 0, :4] = torch.tensor([float("inf"), float("-inf"), float("nan"), -0.0]).to(dtype)
    v[0, 0, 0] = torch.finfo(dtype).tiny / 4  # subnormal
    return k, v


@pytest.mark.parametrize("codec", C.LOSSLESS_CODECS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("level", [3, -1, -7])  # negative: zstd's fast mode (`ingest --level -1`)
def test_round_trip_is_bit_identical(codec, dtype, level):
    k, v = _kv(dtype)
    k2, v2 = C.decode_layer(C.encode_layer(k, v, codec, level), codec)
    assert k2.dtype == dtype and v2.dtype == dtype
    assert k2.shape == k.shape and v2.shape == v.shape
    assert torch.equal(_bits(k2), _bits(k)) and torch.equal(_bits(v2), _bits(v))


@pytest.mark.parametrize("codec", C.LOSSLESS_CODECS)
def test_non_contiguous_shared_and_empty_inputs(codec):
    base = torch.randn(16, 2, 10).half()
    k = base.permute(1, 2, 0)  # non-contiguous view [2, 10, 16]
    k2, v2 = C.decode_layer(C.encode_layer(k, k, codec), codec)  # k and v share memory
    assert torch.equal(_bits(k2), _bits(k)) and torch.equal(_bits(v2), _bits(k))
    e = torch.zeros(2, 0, 8, dtype=torch.bfloat16)
    ke, ve = C.decode_layer(C.encode_layer(e, e, codec), codec)
    assert ke.shape == (2, 0, 8) and ve.dtype == torch.bfloat16


def test_shuffle_payload_is_safetensors_with_byte_planes():
    k, v = _kv(torch.float16)
    raw = zstandard.ZstdDecompressor().decompress(C.encode_layer(k, v, "zstd-shuffle"))
    tensors = load(raw)  # a plain safetensors file, readable by any tool
    header = json.loads(raw[8 : 8 + int.from_bytes(raw[:8], "little")])
    meta = json.loads(header["__metadata__"]["kvblend"])
    assert meta["codec"] == "zstd-shuffle" and meta["k_dtype"] == "float16" and meta["k_shape"] == "2,33,16"
    planes = tensors["k"]
    assert planes.dtype == torch.uint8 and planes.numel() == 2 * k.numel()
    raw_bytes = k.contiguous().view(torch.uint8).reshape(-1)
    assert torch.equal(planes[: k.numel()], raw_bytes[0::2])  # all low bytes first
    assert torch.equal(planes[k.numel() :], raw_bytes[1::2])  # then all high bytes


def test_plain_payload_keeps_tensors_as_is():
    k, v = _kv(torch.bfloat16)
    raw = zstandard.ZstdDecompressor().decompress(C.encode_layer(k, v, "zstd"))
    tensors = load(raw)
    assert tensors["k"].dtype == torch.bfloat16 and torch.equal(_bits(tensors["k"]), _bits(k))


@pytest.mark.parametrize("n_tokens", [16, 128, 600])
def test_default_codec_compresses_random_normal_fp16_better(n_tokens):
    # 600 tokens makes planes larger than zstd's 128 KiB block; 16 and 128 smaller.
    g = torch.Generator().manual_seed(1)
    k, v = (torch.randn(3, n_tokens, 64, generator=g).half() for _ in range(2))
    sizes = {c: len(C.encode_layer(k, v, c)) for c in C.LOSSLESS_CODECS}
    assert C.DEFAULT_CODEC == min(sizes, key=sizes.get)
    assert sizes["zstd-shuffle"] < 0.95 * sizes["zstd"]


def test_identical_kv_gives_identical_bytes():
    k, v = _kv(torch.float16)
    for codec in C.LOSSLESS_CODECS:
        assert C.encode_layer(k, v, codec) == C.encode_layer(k.clone(), v.clone(), codec)


def test_refuses_unknown_codec_and_mislabeled_or_damaged_payloads():
    k, v = _kv(torch.float16)
    with pytest.raises(UsageError, match="unknown codec"):
        C.encode_layer(k, v, "lz4")
    data = C.encode_layer(k, v, "zstd")
    with pytest.raises(CorruptBlobError, match="codec"):
        C.decode_layer(data, "zstd-shuffle")
    damaged = bytearray(data)
    damaged[len(damaged) // 2] ^= 0xFF
    damaged = bytes(damaged[: len(damaged) - 7])
    with pytest.raises(CorruptBlobError):
        C.decode_layer(damaged, "zstd")
    with pytest.raises(CorruptBlobError):
        C.decode_layer(b"not zstd at all", "zstd")
    with pytest.raises(UsageError, match="dtype"):
        C.encode_layer(k.int(), v.int(), "zstd")
    with pytest.raises(ValueError):
        C.encode_layer(k, v[:, :3], "zstd")


def test_threads_share_nothing_and_agree():
    k, v = _kv(torch.float16, n=64)
    expected = C.encode_layer(k, v, "zstd-shuffle")
    results: list[bytes] = []

    def work() -> None:
        for _ in range(5):
            data = C.encode_layer(k, v, "zstd-shuffle")
            k2, _ = C.decode_layer(data, "zstd-shuffle")
            assert torch.equal(_bits(k2), _bits(k))
            results.append(data)

    errors = run_in_threads(work)
    assert not errors and len(results) == 20 and all(r == expected for r in results)
