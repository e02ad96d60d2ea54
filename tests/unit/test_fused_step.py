"""The decode step in one C call (kvblend.model.fused_step): for the models and weights it takes, its logits and
the K/V it writes are the eager step's up to the order of fp32 sums; every batch or model it does not take
steps eagerly, and so does every model when it is absent."""

from __future__ import annotations

import weakref

import pytest
import torch

from kvblend.generation import DecodeState
from kvblend.generation.decode import DecodePrompt, decode_step
from kvblend.model import quant_kernels
from kvblend.model.fused_step import MAX_ROWS, fused_step
from kvblend.model.weights import apply_weights
from support import native_model, random_tokens, tiny_runner

needs_kernels = pytest.mark.skipif(
    quant_kernels.kernels() is None, reason="no C compiler: kvblend's CPU kernels are not built here"
)


def _quantized(arch: str, fmt: str):
    runner = tiny_runner(arch)
    runner.weights = apply_weights(runner.model, fmt)
    return runner


def _smollm_shaped(fmt: str):
    """A Llama of SmolLM2's attention shape (head dim 64, three query heads per KV head), with norms that are
    not the identity (a norm applied in the wrong place changes the logits), under `fmt` weights."""
    import transformers as tf

    from kvblend.model import ModelRunner

    config = tf.LlamaConfig(
        hidden_size=192,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=3,
        num_key_value_heads=1,
        head_dim=64,
        vocab_size=300,
        max_position_embeddings=1024,
        rms_norm_eps=1e-5,
        architectures=["LlamaForCausalLM"],
    )
    torch.manual_seed(3)
    reference = tf.AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    with torch.no_grad():
        for name, param in reference.named_parameters():
            if name.endswith("norm.weight"):
                param.normal_(1.0, 0.3)
    runner = ModelRunner(native_model(reference), None, name="smollm-shaped")
    runner.weights = apply_weights(runner.model, fmt)
    return runner


def _states(runner, lengths: list[int], new_tokens: int, kv_dtype: torch.dtype | None = None) -> list[DecodeState]:
    """One decode state per prompt length, over the runner's own prefill of random tokens."""
    states = []
    for i, n in enumerate(lengths):
        ids = random_tokens(n, seed=20 + i)
        kv = [(k.unsqueeze(0), v.unsqueeze(0)) for k, v in runner.prefill_batch([ids])[0]]
        states.append(DecodeState(runner, DecodePrompt(kv, ids), new_tokens, kv_dtype))
    return states


def _decode(runner, states: list[DecodeState], steps: int) -> list[torch.Tensor]:
    """Greedy steps of every state at once; each step's logits [rows, vocab]."""
    tokens = [7 + i for i in range(len(states))]
    out = []
    for _ in range(steps):
        logits = decode_step(runner, states, tokens)
        out.append(logits)
        tokens = [int(t) for t in logits.argmax(-1)]
    return out


@needs_kernels
@pytest.mark.parametrize(
    "arch,fmt,kv_dtype",
    [
        ("llama", "int4", None),
        ("llama", "int4", torch.float32),
        ("llama", "int8", None),
        ("llama", "int8", torch.float32),
        # sandwich norms, (1 + w) norms, q/k norms, GELU, windows of 24 keys and two RoPE bases (Gemma 3); q/k
        # norms (Qwen3); a window over every layer (Mistral, Phi-3): the 30-token prompt runs past each window
        ("gemma3", "int4", None),
        ("gemma3", "int8", torch.float32),
        ("qwen3", "int4", None),
        ("mistral", "int4", None),
        ("phi3", "int8", None),
    ],
)
def test_the_c_step_computes_the_eager_steps_logits_and_kv(arch, fmt, kv_dtype):
    runner = _quantized(arch, fmt)
    step = fused_step(runner)
    assert step is not None
    lengths = [9, 30, 17]  # ragged: each sequence attends over its own keys
    eager_states, fused_states = _states(runner, lengths, 6, kv_dtype), _states(runner, lengths, 6, kv_dtype)
    assert step.takes(fused_states)
    runner.fused_step = None
    eager = _decode(runner, eager_states, 5)
    runner.fused_step = step
    fused = _decode(runner, fused_states, 5)
    for want, got in zip(eager, fused):
        assert got.shape == want.shape and got.dtype == torch.float32
        assert float((got - want).abs().max()) <= 1e-4 * float(want.abs().max()) + 1e-5
    for e, f in zip(eager_states, fused_states):
        assert e.length == f.length == lengths[eager_states.index(e)] + 5
        for layer in range(runner.n_layers):
            written = slice(0, e.length)
            for a, b in ((e.k, f.k), (e.v, f.v)):
                assert a[layer].dtype == b[layer].dtype
                assert torch.allclose(a[layer][:, :, written].float(), b[layer][:, :, written].float(), atol=2e-3, rtol=2e-3)


@needs_kernels
@pytest.mark.parametrize("fmt", ["int4", "int8"])
def test_a_full_batch_of_long_prompts_at_smollm2s_head_shape(fmt):
    """Eight sequences, some past one 256-key chunk of the attention, head dim 64 in runs of four vectors,
    GQA groups of three, and norms that weigh: the C step's logits are the eager step's."""
    runner = _smollm_shaped(fmt)
    step = fused_step(runner)
    assert step is not None
    lengths = [300, 5, 257, 40, 513, 128, 256, 90]
    eager_states, fused_states = _states(runner, lengths, 4), _states(runner, lengths, 4)
    runner.fused_step = None
    eager = _decode(runner, eager_states, 3)
    runner.fused_step = step
    fused = _decode(runner, fused_states, 3)
    for want, got in zip(eager, fused):
        assert float((got - want).abs().max()) <= 1e-4 * float(want.abs().max()) + 1e-5


@needs_kernels
def test_the_step_holds_no_buffer_alive_and_goes_eager_on_new_weights():
    runner = _quantized("llama", "int4")
    runner.fused_step = step = fused_step(runner)
    assert step is not None
    states = _states(runner, [10, 12], 4)
    decode_step(runner, states, [5, 6])
    buffer = weakref.ref(states[0].k[0])
    states[0].release()
    assert buffer() is None  # release() frees the KV now, not when the step forgets the state
    assert not step.takes(states)
    runner.weights = apply_weights(runner.model, "int8")  # the modules the step pointed into are replaced
    assert not step.takes(states[1:])
    assert decode_step(runner, states[1:], [7]).shape == (1, 300)  # eagerly, over the new weights


@needs_kernels
def test_a_batch_the_c_step_does_not_take_steps_eagerly_with_the_same_result():
    runner = _quantized("llama", "int4")
    step = runner.fused_step = fused_step(runner)
    assert step is not None
    full = _states(runner, [12], 1)  # room for one token: the second step has none
    assert step.takes(full)
    decode_step(runner, full, [5])
    assert not step.takes(full)
    assert not step.takes(_states(runner, [5] * (MAX_ROWS + 1), 2))
    assert not step.takes([*_states(runner, [5], 2), *_states(runner, [6], 2, torch.float32)])  # mixed KV dtypes
    assert not step.takes([])
    with pytest.raises(ValueError):
        step(_states(runner, [10, 12], 4), [5])  # one token for two sequences
    runner.weights.route.max_rows = 1  # `kvblend profile` measured the converted weights only up to one row
    two = _states(runner, [8, 10], 3)
    assert not step.takes(two) and step.takes(two[:1])
    logits = decode_step(runner, two, [3, 4])  # eagerly, over the loaded weights
    assert logits.shape[0] == 2 and torch.isfinite(logits).all()


@needs_kernels
def test_a_model_the_c_step_does_not_compute_has_none():
    """q/k/v biases (Qwen2) are not what the C step computes."""
    assert fused_step(_quantized("qwen2", "int4")) is None


@needs_kernels
def test_fp32_or_bf16_weights_have_no_c_step():
    assert fused_step(tiny_runner("llama")) is None
    assert fused_step(_quantized("llama", "fp32")) is None
    assert fused_step(_quantized("llama", "bf16")) is None


def test_without_kernels_there_is_no_c_step(monkeypatch):
    monkeypatch.setenv("KVBLEND_CPU_KERNELS", "0")
    quant_kernels.kernels.cache_clear()
    try:
        runner = _quantized("llama", "int4")
        assert fused_step(runner) is None
    finally:
        monkeypatch.delenv("KVBLEND_CPU_KERNELS")
        quant_kernels.kernels.cache_clear()
