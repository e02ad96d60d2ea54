"""The layer-by-layer runner on tiny random-weight models: its steps compose to the HF forward pass,
its attention kernels equal plain masked attention, and K re-positioning composes like RoPE."""

from __future__ import annotations

import math

import pytest
import torch

from support import ARCHS, tiny_runner
from kvblend.model.attention import (
    QUERY_BLOCK,
    QueryBlockPlanner,
    block_rows,
    dense_suffix,
    is_short_suffix,
    last_query,
    sparse_queries,
)

ATOL = 1e-4


def random_ids(n: int, seed: int) -> torch.Tensor:
    return torch.randint(3, 290, (1, n), generator=torch.Generator().manual_seed(seed))


@pytest.fixture(params=ARCHS)
def runner(request):
    return tiny_runner(request.param)


@torch.inference_mode()
def layer_by_layer_logits(runner, ids: torch.Tensor) -> torch.Tensor:
    """embed → (project_qkv → attend → finish_layer) per layer → logits, for every position."""
    cos, sin = runner.rope(torch.arange(ids.shape[1])[None])
    hidden = runner.embed(ids)
    for layer in range(runner.n_layers):
        q, k, v = runner.project_qkv(layer, hidden, cos, sin)
        hidden = runner.finish_layer(layer, hidden, runner.attend(layer, q, k, v))
    return runner.logits(hidden)[0]


def test_step_chain_equals_the_models_own_forward(runner):
    ids = random_ids(70, 1)  # longer than the tiny Mistral's 24-token window: its mask is exercised
    with torch.inference_mode():
        expected = runner.reference(ids).logits[0].float()
    assert torch.allclose(layer_by_layer_logits(runner, ids), expected, atol=ATOL)


def test_attend_on_a_subset_of_queries_equals_those_rows_of_full_attention(runner):
    """Scattered queries (blend after its check layer) see exactly what they see in full causal attention."""
    T = 150
    ids = random_ids(T, 2)
    cos, sin = runner.rope(torch.arange(T)[None])
    with torch.inference_mode():
        hidden = runner.embed(ids)
        q, k, v = runner.project_qkv(0, hidden, cos, sin)
        full = runner.attend(0, q, k, v)
        for positions in (torch.tensor([0, 3, 40, 41, 99, 149]), torch.arange(1, T, 2), torch.arange(20, T)):
            part = runner.attend(0, q[:, :, positions], k, v, query_positions=positions)
            assert torch.allclose(part, full[:, positions], atol=ATOL), positions


def masked_attention(q, k, v, positions: torch.Tensor, window: int | None, scale: float) -> torch.Tensor:
    """Textbook attention: explicit GQA head repeat, causal (and window) mask on absolute positions."""
    groups = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
    delta = positions[:, None] - torch.arange(k.shape[2])[None, :]
    allowed = delta >= 0
    if window is not None:
        allowed &= delta < window
    scores = (q @ k.transpose(-1, -2)) * scale
    scores = scores.masked_fill(~allowed, float("-inf"))
    return torch.softmax(scores, dim=-1) @ v


@pytest.mark.parametrize("window", [None, 17])
def test_sparse_query_kernel_equals_dense_masked_attention(window):
    g = torch.Generator().manual_seed(3)
    n_keys, hd = 300, 16
    q_all = torch.randn(1, 4, n_keys, hd, generator=g)
    k = torch.randn(1, 2, n_keys, hd, generator=g)
    v = torch.randn(1, 2, n_keys, hd, generator=g)
    positions = torch.sort(torch.randperm(n_keys, generator=g)[: 2 * QUERY_BLOCK + 9]).values  # 3 blocks
    q = q_all[:, :, positions]
    blocks = QueryBlockPlanner(torch.float32).plan(positions, n_keys, window)
    assert len(blocks) == 3
    got = sparse_queries(q, k, v, blocks, hd**-0.5)
    assert torch.allclose(got, masked_attention(q, k, v, positions, window, hd**-0.5), atol=1e-5)


def test_block_plan_is_memoised_for_the_same_query_tensor():
    planner = QueryBlockPlanner(torch.float32)
    positions = torch.arange(10, 200, 3)
    first = planner.plan(positions, 200, None)
    assert planner.plan(positions, 200, None) is first
    assert planner.plan(positions.clone(), 200, None) is not first  # identity, not equality: a new set


def test_dense_suffix_kernel_equals_dense_masked_attention():
    g = torch.Generator().manual_seed(4)
    n_keys, skip, hd = 120, 25, 8
    q = torch.randn(1, 4, n_keys - skip, hd, generator=g)
    k = torch.randn(1, 2, n_keys, hd, generator=g)
    v = torch.randn(1, 2, n_keys, hd, generator=g)
    positions = torch.arange(skip, n_keys)
    assert is_short_suffix(positions, n_keys)
    assert not is_short_suffix(torch.arange(n_keys // 2, n_keys), n_keys)  # too many skipped rows
    assert not is_short_suffix(torch.arange(skip, n_keys - 1), n_keys)  # not a suffix
    got = dense_suffix(q, k, v, hd**-0.5)
    assert torch.allclose(got, masked_attention(q, k, v, positions, None, hd**-0.5), atol=1e-5)


@pytest.mark.parametrize("dtype, atol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
def test_last_query_kernel_equals_sdpa_over_a_slice_of_a_decode_buffer(dtype, atol):
    """Decoding's kernel: one query over the first keys of a larger buffer, grouped query heads."""
    g = torch.Generator().manual_seed(5)
    hd, used = 8, 70
    q = torch.randn(1, 6, 1, hd, generator=g).to(dtype)
    k_buf = torch.randn(1, 2, 100, hd, generator=g).to(dtype)
    v_buf = torch.randn(1, 2, 100, hd, generator=g).to(dtype)
    k, v = k_buf[:, :, :used], v_buf[:, :, :used]
    got = last_query(q, k, v, hd**-0.5)
    positions = torch.tensor([used - 1])
    want = masked_attention(q.float(), k.float(), v.float(), positions, None, hd**-0.5)
    assert got.shape == (1, 6, 1, hd) and got.dtype == dtype
    assert torch.allclose(got.float(), want, atol=atol)


def layer0_k(runner, ids: list[int]) -> torch.Tensor:
    return runner.prefill_batch([ids])[0][0][0]  # layer 0's K, [kv_heads, n, hd]


@pytest.mark.parametrize("a,b", [(5, 37), (-11, 200), (300, -300)])
def test_reposition_composes_like_rope(runner, a, b):
    """R(b)·R(a) = R(a+b) on post-RoPE K, in the fp32 in-place path and the allocating one."""
    k = layer0_k(runner, random_ids(30, 5)[0].tolist())
    twice = runner.reposition(runner.reposition(k, a), b)
    once = runner.reposition(k, a + b)
    assert torch.allclose(twice, once, atol=ATOL)
    into = torch.empty_like(k, dtype=torch.float32)
    assert torch.allclose(runner.reposition(k, a + b, out=into), once, atol=1e-6)
    if a + b == 0:
        assert torch.equal(once, k)
    else:
        assert not torch.allclose(once, k, atol=1e-3)  # a real rotation, not the identity


def test_reposition_equals_k_prefilled_at_the_new_position(runner):
    ids = random_ids(25, 6)[0].tolist()
    at_zero = layer0_k(runner, ids)
    at_offset = runner.prefill_batch([ids], start_position=123)[0][0][0]
    assert torch.allclose(runner.reposition(at_zero, 123), at_offset, atol=ATOL)
    half = torch.empty_like(at_zero, dtype=torch.bfloat16)  # a 16-bit destination: rotated in fp32, then rounded
    runner.reposition(at_zero, 123, out=half)
    assert math.isclose(float((half.float() - at_offset).abs().max()), 0.0, abs_tol=0.05)


def test_block_plan_keeps_one_plan_per_window_for_the_same_queries():
    """Gemma's local and global layers alternate over one kept query set: each window's plan is built once."""
    planner = QueryBlockPlanner(torch.float32)
    positions = torch.arange(50, 200, 3)
    local, dense = planner.plan(positions, 200, 17), planner.plan(positions, 200, None)
    assert planner.plan(positions, 200, 17) is local and planner.plan(positions, 200, None) is dense
    assert local[0].lo > 0 and dense[0].lo == 0


def test_blocks_are_small_on_the_cpu_and_one_call_on_a_gpu_where_the_mask_fits():
    assert block_rows(torch.device("cpu"), 3000) == QUERY_BLOCK
    assert block_rows(torch.device("cuda"), 3000) >= 3000  # a 3,000-token prefill: one attention call a layer
    assert QUERY_BLOCK <= block_rows(torch.device("cuda"), 1 << 20) < 1 << 20  # a long prompt: bounded masks
