"""kvblend's CPU kernels (kvblend.model.quant_kernels, quant_gemv.c): built with the machine's compiler on
first use, they must compute what the de-quantised fp32 weights and SDPA compute, for every shape the
decoder gives them, whatever the thread count; without a compiler kvblend falls back to torch's kernels."""

from __future__ import annotations

import os

import pytest
import torch
import torch.nn.functional as F

from kvblend.generation import DecodeState
from kvblend.generation.decode import DecodePrompt, decode_step
from kvblend.model import quant_kernels
from kvblend.model.attention import last_query
from kvblend.model.weights import Int4Linear, Int8Linear, Route, _linears, apply_weights
from support import random_tokens, tiny_runner

KERNELS = quant_kernels.kernels()
needs_kernels = pytest.mark.skipif(KERNELS is None, reason="no C compiler: kvblend's CPU kernels are not built here")


def _q4_1(n_out: int, n_in: int, seed: int = 0):
    """Random Q4_1 blocks in GGUF's layout, and the fp32 weight they de-quantise to."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randint(0, 16, (n_out, n_in // 32, 32), generator=g, dtype=torch.uint8)
    nibbles = (q[..., :16] | q[..., 16:] << 4).reshape(n_out, n_in // 2).contiguous()
    d = torch.rand(n_out, n_in // 32, generator=g) * 0.01
    m = -torch.rand(n_out, n_in // 32, generator=g) * 0.05
    return nibbles, d, m, (q.float() * d[..., None] + m[..., None]).reshape(n_out, n_in)


def _close(got: torch.Tensor, want: torch.Tensor) -> bool:
    """Equal up to fp32's rounding of sums taken in another order."""
    return float((got - want).abs().max()) <= 1e-5 * float(want.abs().max()) + 1e-6


@needs_kernels
@pytest.mark.parametrize("shape", [(1536, 576), (192, 576), (37, 96), (576, 1536)])
@pytest.mark.parametrize("rows", [1, 3, 8, 11])  # 11: past the kernel's 8 rows per pass
def test_q4_1_and_q8_0_products_equal_the_dequantised_weights(shape, rows):
    assert KERNELS is not None
    n_out, n_in = shape
    nibbles, d, m, w4 = _q4_1(n_out, n_in)
    codes = torch.randint(-127, 128, (n_out, n_in), dtype=torch.int8)
    w8 = (codes.float().view(n_out, -1, 32) * d[..., None]).reshape(n_out, n_in)
    x = torch.randn(rows, n_in)
    assert _close(KERNELS.q4_1(x, nibbles, d, m), x @ w4.T)
    assert _close(KERNELS.q8_0(x, codes, d), x @ w8.T)


@needs_kernels
def test_products_do_not_depend_on_the_thread_count():
    assert KERNELS is not None
    nibbles, d, m, _ = _q4_1(300, 640)
    x = torch.randn(2, 640)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = KERNELS.q4_1(x, nibbles, d, m)
        torch.set_num_threads(2)
        two = KERNELS.q4_1(x, nibbles, d, m)
    finally:
        torch.set_num_threads(before)
    assert torch.equal(one, two)  # each output is one thread's sum, in one order


@needs_kernels
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize(
    ("heads", "kv_heads", "hd", "n_keys"),
    [(9, 3, 64, 3656), (4, 1, 256, 700), (9, 3, 64, 1), (8, 8, 16, 255), (8, 2, 32, 256), (8, 2, 32, 257),
     (16, 1, 32, 300), (12, 1, 48, 90)],  # groups of 16 and 12: the kernel's path for uncommon group sizes
)
def test_decode_attention_equals_sdpa_over_the_same_keys(dtype, heads, kv_heads, hd, n_keys):
    assert KERNELS is not None
    torch.manual_seed(n_keys)
    q = torch.randn(1, heads, 1, hd)
    k_buf = (torch.randn(1, kv_heads, n_keys + 40, hd) * 3).to(dtype)  # a decode buffer with room left
    v_buf = torch.randn(1, kv_heads, n_keys + 40, hd).to(dtype)
    k, v = k_buf[:, :, :n_keys], v_buf[:, :, :n_keys]
    want = F.scaled_dot_product_attention(q, k.float(), v.float(), scale=hd**-0.5, enable_gqa=True)
    got = KERNELS.decode_attention(q, k, v, hd**-0.5)
    assert got is not None and got.shape == want.shape
    assert float((got - want).abs().max()) < 1e-5
    # a window's keys: a view that starts inside the buffer
    start = n_keys // 3
    want = F.scaled_dot_product_attention(
        q, k[:, :, start:].float(), v[:, :, start:].float(), scale=0.3, enable_gqa=True
    )
    assert torch.allclose(last_query(q, k[:, :, start:], v[:, :, start:], 0.3), want, atol=1e-5)


@needs_kernels
def test_attention_shapes_the_kernel_does_not_take_fall_back_to_torch():
    assert KERNELS is not None
    q, k, v = torch.randn(1, 4, 1, 24), torch.randn(1, 2, 30, 24), torch.randn(1, 2, 30, 24)  # hd % 16 != 0
    assert KERNELS.decode_attention(q, k, v, 0.2) is None
    want = F.scaled_dot_product_attention(q, k, v, scale=0.2, enable_gqa=True)
    assert torch.allclose(last_query(q, k, v, 0.2), want, atol=1e-6)
    two = torch.randn(2, 4, 1, 32), torch.randn(2, 2, 30, 32), torch.randn(2, 2, 30, 32)  # a batch of two
    assert KERNELS.decode_attention(*two, 0.2) is None


@needs_kernels
def test_int_layers_on_the_cpu_hold_gguf_blocks_and_find_their_codes_again():
    nibbles, d, m, w4 = _q4_1(48, 128, seed=3)
    d, m = d.half().float(), m.half().float()  # GGUF keeps fp16 scales; a loader widens them
    # back to codes, to rebuild w with blocks that span 0..15 (as a Q4_1 block's codes do)
    q = torch.cat([(nibbles & 15).view(48, 4, 16), (nibbles >> 4).view(48, 4, 16)], -1).float()
    q[..., 0], q[..., 1] = 0, 15
    w4 = (q * d[..., None] + m[..., None]).view(48, 128)
    layer = Int4Linear(w4, None, Route())
    assert layer.kernels is not None and layer.max_error == 0.0
    assert torch.equal(layer.nibbles, (q[..., :16].to(torch.uint8) | q[..., 16:].to(torch.uint8) << 4).view(48, 64))
    codes = torch.randint(-127, 128, (40, 96), dtype=torch.int8)
    codes[:, ::32] = 127  # each block reaches ±127: its scale is amax / 127, as Q8_0's
    scales = (torch.rand(40, 3) * 0.01 + 1e-3).half().float()
    w8 = (codes.float().view(40, 3, 32) * scales[..., None]).view(40, 96)
    layer8 = Int8Linear(w8, None, Route())
    assert layer8.kernels is not None and layer8.max_error == 0.0 and torch.equal(layer8.codes, codes)
    x = torch.randn(2, 96)
    route = layer8.route
    route.decoding = True
    assert _close(layer8(x), x @ w8.T)


@needs_kernels
@pytest.mark.parametrize("fmt", ["int8", "int4"])
def test_quantized_weights_decode_over_16_bit_kv_with_fp32_answers_close(fmt):
    ids = random_tokens(60, seed=11)
    base = tiny_runner("llama")
    runner = tiny_runner("llama")
    runner.weights = apply_weights(runner.model, fmt)
    assert base.decode_kv_dtype == torch.float32 and runner.decode_kv_dtype == torch.float16
    kv = [(k.unsqueeze(0), v.unsqueeze(0)) for k, v in base.prefill_batch([ids[:-1]])[0]]
    states = [DecodeState(r, DecodePrompt(kv, ids[:-1]), 4) for r in (base, runner)]
    assert states[0].k[0].dtype == torch.float32 and states[1].k[0].dtype == torch.float16
    ref, got = (decode_step(r, [st], [ids[-1]]) for r, st in zip((base, runner), states))
    assert torch.allclose(F.softmax(ref, -1), F.softmax(got, -1), atol=2e-2)
    assert not torch.equal(ref, got)


def test_without_a_compiler_or_when_switched_off_there_are_no_kernels(monkeypatch, tmp_path):
    build = quant_kernels.kernels.__wrapped__  # the uncached builder
    monkeypatch.setenv("KVBLEND_MODEL_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv("CC", str(tmp_path / "no-such-compiler"))
    assert build() is None
    monkeypatch.delenv("CC")
    monkeypatch.setenv("KVBLEND_CPU_KERNELS", "0")
    assert build() is None
    assert not (tmp_path / "cache").exists()  # nothing was compiled


@needs_kernels
def test_the_library_is_compiled_once_into_the_model_cache(monkeypatch, tmp_path):
    monkeypatch.setenv("KVBLEND_MODEL_CACHE", str(tmp_path))
    first = quant_kernels.kernels.__wrapped__()
    assert first is not None and first.path.parent == tmp_path / "kernels"
    built = first.path.stat().st_mtime_ns
    again = quant_kernels.kernels.__wrapped__()
    assert again is not None and again.path == first.path and again.path.stat().st_mtime_ns == built
    assert [p.name for p in (tmp_path / "kernels").iterdir()] == [first.path.name]  # no leftover part files


@needs_kernels
def test_native_format_finds_q4_1_and_q8_0_weights_and_nothing_else():
    from kvblend.model.weights import native_format

    runner = tiny_runner("llama")
    assert native_format(runner.model) == "fp32"  # random weights: no block format holds them exactly
    for _, _, linear in list(_linears(runner.model)):
        w = linear.weight.data
        n_out, n_in = w.shape
        blocks = w.view(n_out, n_in // 32, 32)
        low = blocks.amin(-1, keepdim=True).half().float()  # GGUF keeps fp16 scales and minimums
        d = ((blocks.amax(-1, keepdim=True) - low) / 15).half().float()
        q = torch.round((blocks - low) / d).clamp(0, 15)
        q[..., 0], q[..., 1] = 0, 15  # a Q4_1 block's codes span 0..15
        linear.weight.data = (q * d + low).view(n_out, n_in)  # Q4_1, as a loader de-quantises it
    assert native_format(runner.model) == "int4"
    for _, _, linear in list(_linears(runner.model)):
        w = linear.weight.data
        d = (w.view(w.shape[0], -1, 32).abs().amax(-1, keepdim=True) / 127).half().float()
        q = torch.round(w.view(w.shape[0], -1, 32) / d).clamp(-127, 127)
        q[..., 0] = 127  # a Q8_0 block's largest code is ±127
        linear.weight.data = (q * d).view(w.shape)  # Q8_0
    assert native_format(runner.model) == "int8"


@needs_kernels
def test_a_nan_or_inf_key_spreads_as_in_sdpa_and_is_never_hidden():
    assert KERNELS is not None
    torch.manual_seed(1)
    q = torch.randn(1, 4, 1, 32)
    q[..., 3] = 1.0  # so an inf key's score is +inf, which SDPA turns into NaN
    for bad in (float("nan"), float("inf")):
        k, v = torch.randn(1, 2, 300, 32), torch.randn(1, 2, 300, 32)
        k[0, 0, 5, 3] = bad  # not a chunk's first key: the kernel's max and exp must carry it
        got = KERNELS.decode_attention(q, k, v, 0.2)
        want = F.scaled_dot_product_attention(q, k, v, scale=0.2, enable_gqa=True)
        assert got is not None
        assert torch.equal(torch.isnan(got[0, :2]), torch.isnan(want[0, :2]))  # kv head 0's query heads
        assert torch.isnan(got[0, :2]).all()
        assert torch.allclose(got[0, 2:], want[0, 2:], atol=1e-5)  # kv head 1 unharmed


def test_native_is_the_loaders_word_and_no_format_of_its_own():
    from kvblend.errors import UsageError
    from kvblend.defaults import NATIVE_WEIGHTS
    from kvblend.model.weights import check_weights

    assert check_weights(NATIVE_WEIGHTS, allow_auto=False, allow_native=True) == NATIVE_WEIGHTS
    with pytest.raises(UsageError):
        check_weights(NATIVE_WEIGHTS)  # not a --weights choice
    with pytest.raises(UsageError):
        apply_weights(tiny_runner("llama").model, NATIVE_WEIGHTS)


@needs_kernels
def test_attention_fits_the_shapes_the_kernel_takes():
    assert KERNELS is not None
    assert KERNELS.attention_fits(9, 3, 64) and KERNELS.attention_fits(4, 1, 256)
    assert not KERNELS.attention_fits(32, 1, 64)  # 32 query heads per KV head: over the kernel's 16
    assert not KERNELS.attention_fits(8, 3, 64) and not KERNELS.attention_fits(8, 2, 24)


@needs_kernels
def test_the_built_library_is_readable_by_others_and_a_shared_directory_is_not_trusted(monkeypatch, tmp_path):
    monkeypatch.setenv("KVBLEND_MODEL_CACHE", str(tmp_path / "cache"))
    old = os.umask(0o022)
    try:
        built = quant_kernels.kernels.__wrapped__()
    finally:
        os.umask(old)
    assert built is not None and built.path.stat().st_mode & 0o044 == 0o044  # others sharing the cache load it
    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(0o777)
    assert not quant_kernels._trusted(shared)
    shared.chmod(0o700)
    assert quant_kernels._trusted(shared)
