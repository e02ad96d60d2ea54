"""Decoding on tiny random-weight models: each step's logits are the HF forward pass's on the
extended sequence, greedy decoding is the argmax chain, and teacher forcing returns step logits."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from support import ARCHS, random_tokens, tiny_runner
from kvblend.errors import UsageError
from kvblend.fusion import BlendConfig, fuse
from kvblend.generation import DecodeState, SamplingConfig, generate
from kvblend.generation.decode import StaticStep
from kvblend.types import Segment

ATOL = 1e-4
STOP = 299  # the stub tokenizer's end of sequence


class StubTokenizer:
    """Just what generation asks a tokenizer for: decode, and the ids that stop it."""

    eos_token_id = STOP
    unk_token_id = None

    def decode(self, ids, skip_special_tokens: bool = True) -> str:
        return " ".join(f"t{i}" for i in ids)

    def convert_tokens_to_ids(self, token: str):
        return None


@pytest.fixture(params=ARCHS)
def runner(request):
    r = tiny_runner(request.param)
    r.tokenizer = StubTokenizer()
    r.config = dataclasses.replace(r.config, eos_token_ids=())  # the tiny configs' EOS would stop decoding
    return r


def prompt_of(runner) -> list[Segment]:
    """A cached chunk between uncached pieces, 50 tokens: past the tiny Mistral's 24-token window."""
    chunk = random_tokens(30, 3)
    return [Segment(random_tokens(8, 1)), Segment(chunk, kv=runner.prefill_batch([chunk])[0]), Segment(random_tokens(12, 2))]


def hf_last_logits(runner, ids: list[int]) -> torch.Tensor:
    with torch.inference_mode():
        return runner.reference(torch.tensor([ids])).logits[0, -1].float()


@pytest.mark.parametrize("mode", ["full", "blend"])
def test_decode_steps_equal_the_forward_pass_on_the_extended_sequence(runner, mode):
    fused = fuse(runner, prompt_of(runner), mode, BlendConfig.single(1.0))  # ratio 1: blend is full
    ids = list(fused.token_ids)
    assert torch.allclose(fused.last_logits, hf_last_logits(runner, ids), atol=ATOL)
    state = DecodeState(runner, fused, max_new_tokens=4)
    with torch.inference_mode():
        for token in random_tokens(4, 7):
            ids.append(token)
            assert torch.allclose(state.step(token), hf_last_logits(runner, ids), atol=ATOL), len(ids)
    assert state.length == len(ids)


def test_the_static_step_a_cuda_graph_replays_equals_the_forward_pass(runner):
    """The step CUDA captures (every shape fixed: one query over the whole buffer, masked past the position
    and outside a sliding window) run eagerly here: the same logits as the model on the extended sequence.
    6 steps past a 50-token prompt cross the tiny Mistral's and Gemma's 24-token windows."""
    fused = fuse(runner, prompt_of(runner), "full")
    ids = list(fused.token_ids)
    state = DecodeState(runner, fused, max_new_tokens=6, graphed=True)  # graphed on the CPU: eager, same shapes
    with torch.inference_mode():
        for token in random_tokens(6, 9):
            ids.append(token)
            assert torch.allclose(state.step(token), hf_last_logits(runner, ids), atol=ATOL), len(ids)
    assert state.length == len(ids) == state.capacity
    half = DecodeState(runner, fused, max_new_tokens=2, kv_dtype=torch.float16, graphed=True)  # widened K/V
    eager = DecodeState(runner, fused, max_new_tokens=2, kv_dtype=torch.float16, graphed=False)
    with torch.inference_mode():
        for token in (5, 6):
            assert torch.allclose(half.step(token), eager.step(token), atol=ATOL)


def test_generation_through_the_static_step_is_the_eager_generation(runner, monkeypatch):
    """`generate` (the CLI's and server's sequence path) with every lone step taken by the static step, as on
    CUDA: the same tokens and step logits as the eager steps."""
    fused = fuse(runner, prompt_of(runner), "full")
    sampling = SamplingConfig(max_new_tokens=6)
    eager = generate(runner, fused, sampling, keep_logits=True)
    monkeypatch.setattr("kvblend.generation.decode.graphed_by_default", lambda runner: True)
    fed = []
    run = StaticStep.run
    monkeypatch.setattr(StaticStep, "run", lambda self, token: fed.append(token) or run(self, token))
    static = generate(runner, fused, sampling, keep_logits=True)
    assert static.token_ids == eager.token_ids and len(static.token_ids) >= 2
    assert fed == static.token_ids[: len(static.step_logits) - 1]  # every step after the first went through it
    assert all(torch.allclose(a, b, atol=ATOL) for a, b in zip(static.step_logits, eager.step_logits))


def test_cuda_graphs_by_default_on_cuda_unless_enforce_eager():
    """Who replays graphs when DecodeState is not told: CUDA runners, unless loaded with `--enforce-eager`."""
    from types import SimpleNamespace

    from kvblend.generation.decode import graphed_by_default

    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    assert graphed_by_default(SimpleNamespace(device=cuda, cuda_graphs=True))
    assert not graphed_by_default(SimpleNamespace(device=cuda, cuda_graphs=False))
    assert not graphed_by_default(SimpleNamespace(device=cpu, cuda_graphs=True))


def test_greedy_generation_is_the_argmax_chain_and_deterministic(runner):
    fused = fuse(runner, prompt_of(runner), "full")
    sampling = SamplingConfig(max_new_tokens=6)
    first = generate(runner, fused, sampling)
    again = generate(runner, fused, sampling)
    ids, expected = list(fused.token_ids), []
    for _ in range(6):
        token = int(torch.argmax(hf_last_logits(runner, ids)))
        if token == STOP:
            break
        expected.append(token)
        ids.append(token)
    assert expected and first.token_ids == expected
    assert again.token_ids == first.token_ids and again.text == first.text
    assert first.text == StubTokenizer().decode(expected)


def test_sampling_with_a_seed_is_reproducible(runner):
    fused = fuse(runner, prompt_of(runner), "full")
    sampling = SamplingConfig(max_new_tokens=5, temperature=1.5, top_p=0.9, seed=11)
    assert generate(runner, fused, sampling).token_ids == generate(runner, fused, sampling).token_ids


def test_forced_tokens_teacher_force_and_return_each_steps_logits(runner):
    fused = fuse(runner, prompt_of(runner), "full")
    forced = random_tokens(4, 9) + [STOP]  # a stop token does not end a forced continuation
    gen = generate(runner, fused, SamplingConfig(max_new_tokens=1), keep_logits=True, forced_tokens=forced)
    assert gen.token_ids == forced and not gen.stopped_on_eos
    assert len(gen.step_logits) == len(forced)
    ids = list(fused.token_ids)
    for step, token in enumerate(forced):
        assert torch.allclose(gen.step_logits[step], hf_last_logits(runner, ids), atol=ATOL), step
        ids.append(token)


def test_bad_sampling_settings_are_refused():
    for bad in (SamplingConfig(max_new_tokens=0), SamplingConfig(temperature=-1), SamplingConfig(top_p=0)):
        with pytest.raises(UsageError):
            bad.validate()


def test_the_byte_level_alphabet_is_gpt2s():
    """logprobs' `bytes` read byte-level BPE pieces through GPT-2's alphabet, kept here without transformers."""
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    from kvblend.generation.sequence import _byte_decoder

    assert _byte_decoder() == {char: byte for byte, char in bytes_to_unicode().items()}
