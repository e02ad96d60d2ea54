"""Weight formats for decode (kvblend.model.weights) on tiny random-weight models.

What must hold: prefill (and so every archived KV) reads the weights as loaded under every format; a
decode step reads the converted copy, whose logits stay close to fp32's; int4 reproduces weights that
are already Q4_1 codes bit for bit; `auto` takes what a stored profile measured."""

from __future__ import annotations

import pytest
import torch

from support import random_tokens, tiny_runner
from kvblend.defaults import NATIVE_WEIGHTS
from kvblend.errors import UsageError
from kvblend.generation import DecodeState
from kvblend.generation.decode import DecodePrompt, decode_step
from kvblend.evaluation.metrics import kl_divergence
from kvblend.model.weights import (
    INT4_GROUP,
    WEIGHT_FORMATS,
    Int4Linear,
    Route,
    apply_weights,
    check_weights,
)
from kvblend.archive import Archive, resolve_location
from kvblend.machine import Machine, machine_info
from kvblend.model import quant_kernels
from kvblend.model.attention import last_query
from kvblend.tuning.profile import Profile, weights_choice
from tuning_helpers import synthetic_profile


def _decode_logits(runner, ids, batch=1, kv_dtype=None):
    """Prefill ids[:-1] with the runner, then one decode step of ids[-1] for `batch` copies."""
    kv = [(k.unsqueeze(0), v.unsqueeze(0)) for k, v in runner.prefill_batch([ids[:-1]])[0]]
    states = [DecodeState(runner, DecodePrompt(kv, ids[:-1]), 2, kv_dtype) for _ in range(batch)]
    return kv, decode_step(runner, states, [ids[-1]] * batch)


@pytest.mark.parametrize("arch", ["llama", "qwen2", "gemma3"])
@pytest.mark.parametrize("fmt", ["bf16", "int8", "int4"])
def test_decode_reads_converted_weights_and_prefill_the_loaded_ones(arch, fmt):
    ids = random_tokens(40, seed=3)
    base = tiny_runner(arch)
    ref_kv, ref = _decode_logits(base, ids)
    runner = tiny_runner(arch)
    report = apply_weights(runner.model, fmt)
    runner.weights = report
    kv, logits = _decode_logits(runner, ids)
    # the KV a prefill makes (what the archive stores) is the loaded weights', bit for bit
    assert all(torch.equal(a[0], b[0]) and torch.equal(a[1], b[1]) for a, b in zip(kv, ref_kv))
    assert report.layers == 7 * runner.n_layers and report.kept == 0
    assert report.head == ("int8" if fmt == "int4" else fmt)
    assert not torch.equal(logits, ref)  # the decode step did read the converted copy
    assert kl_divergence(ref[0], logits[0]) < 0.05
    assert (
        report.bytes
        < sum(p.numel() * 4 for n, p in base.model.named_parameters() if n.endswith("proj.weight"))
        + base.model.lm_head.weight.numel() * 4
    )


def test_int4_reproduces_q4_1_codes_exactly_and_rounds_other_weights():
    torch.manual_seed(0)
    n_out, n_in = 48, 4 * INT4_GROUP
    codes = torch.randint(0, 16, (n_out, n_in // INT4_GROUP, INT4_GROUP)).float()
    codes[..., 0], codes[..., 1] = 0, 15  # Q4_1 blocks span their codes: min at 0, max at 15
    # Q4_1 stores d and m in fp16, and a loader de-quantises d·q + m in fp32
    d = (torch.rand(n_out, n_in // INT4_GROUP, 1) * 0.01 + 1e-3).half().float()
    m = (torch.randn(n_out, n_in // INT4_GROUP, 1) * 0.05).half().float()
    q4_1 = (codes * d + m).view(n_out, n_in)
    route = Route()
    layer = Int4Linear(q4_1, None, route)
    assert layer.max_error == 0.0  # the file's own codes and scales, found again
    x = torch.randn(3, n_in)
    route.decoding = True
    assert torch.allclose(layer(x), x @ q4_1.T, atol=1e-4)
    route.decoding = False
    assert torch.equal(layer(x), torch.nn.functional.linear(x, q4_1))  # outside decode: the loaded weight
    assert Int4Linear(torch.randn(n_out, n_in), None, Route()).max_error > 0


def test_converted_weights_serve_only_decode_batches_up_to_max_rows():
    ids = random_tokens(30, seed=5)
    base = tiny_runner("llama")
    _, ref = _decode_logits(base, ids, batch=2)
    runner = tiny_runner("llama")
    runner.weights = apply_weights(runner.model, "int8", max_rows=1)
    # fp32 decode KV, as the reference's (int8 decodes over fp16 KV on the CPU: test_quant_kernels)
    _, two = _decode_logits(runner, ids, batch=2, kv_dtype=torch.float32)
    assert torch.equal(two, ref)  # a batch of two is over max_rows: the loaded weights, exactly
    _, one = _decode_logits(runner, ids, batch=1)
    assert not torch.equal(one[0], ref[0])


@pytest.mark.parametrize("own_kernel", [True, False])
def test_a_layer_int4_cannot_pack_is_kept_as_loaded(own_kernel, monkeypatch):
    if own_kernel and quant_kernels.kernels() is None:
        pytest.skip("no C compiler: kvblend's CPU kernels are not built here")
    if not own_kernel:  # torch's CPU int4 kernel instead, as on a machine without a C compiler
        monkeypatch.setattr(quant_kernels, "kernels", lambda: None)
    runner = tiny_runner("llama")
    layers = runner.model.model.layers
    layers[0].mlp.down_proj.weight = torch.nn.Parameter(torch.randn(64, 100), requires_grad=False)  # in % 32
    layers[1].mlp.up_proj.weight = torch.nn.Parameter(torch.randn(120, 64), requires_grad=False)  # out % 16
    report = apply_weights(runner.model, "int4")
    kept = 1 if own_kernel else 2  # kvblend's kernel takes any number of outputs, torch's multiples of 16
    assert report.kept == kept and report.layers == 7 * runner.n_layers - kept
    assert isinstance(layers[0].mlp.down_proj, torch.nn.Module) and not isinstance(layers[0].mlp.down_proj, Int4Linear)
    assert isinstance(layers[1].mlp.up_proj, Int4Linear) == own_kernel


def test_prefill_after_decode_steps_and_after_a_failed_one_reads_the_loaded_weights():
    ids = random_tokens(40, seed=9)
    base_kv = tiny_runner("qwen2").prefill_batch([ids])[0]
    runner = tiny_runner("qwen2")
    runner.weights = apply_weights(runner.model, "int8")
    _decode_logits(runner, ids)
    with pytest.raises(RuntimeError):
        with runner.decoding():
            raise RuntimeError("a step failed")
    assert not runner.weights.route.decoding
    kv = runner.prefill_batch([ids])[0]
    assert all(torch.equal(a[0], b[0]) and torch.equal(a[1], b[1]) for a, b in zip(kv, base_kv))


def test_check_weights_names_the_choices():
    assert check_weights(None) == "fp32" and check_weights("auto") == "auto"
    with pytest.raises(UsageError, match="--weights must be one of fp32, bf16, int8, int4, gguf, auto"):
        check_weights("int5")
    with pytest.raises(UsageError):
        check_weights("auto", allow_auto=False)


def _with_weights(weights: dict, **kw) -> Profile:
    profile = synthetic_profile("ram", 0.01, 0.05, **kw)
    profile.weights = weights
    return profile


def test_auto_takes_the_fastest_format_within_the_kl_bound_and_the_batches_where_it_pays():
    measured = {
        "fp32": {"kl": 0.0, "step_ms_1": 80.0, "step_ms_2": 100.0, "step_ms_4": 110.0, "step_ms_8": 200.0},
        "bf16": {"kl": 0.001, "step_ms_1": 45.0, "step_ms_2": 60.0, "step_ms_4": 120.0, "step_ms_8": 150.0},
        "int8": {"kl": 0.004, "step_ms_1": 110.0, "step_ms_2": 130.0, "step_ms_4": 150.0, "step_ms_8": 400.0},
        "int4": {"kl": 0.5, "step_ms_1": 20.0, "step_ms_2": 30.0, "step_ms_4": 40.0, "step_ms_8": 60.0},
    }
    # int4 is fastest but drifts past the bound; bf16 pays at batches 1 and 2, not 4: 8 alone does not count
    assert _with_weights(measured).weights_choice() == ("bf16", 2)
    assert _with_weights({}).weights_choice() == ("fp32", 1)
    slow = {f: {**m, "step_ms_1": 500.0} for f, m in measured.items() if f != "fp32"} | {"fp32": measured["fp32"]}
    assert _with_weights(slow).weights_choice()[0] == "fp32"
    assert set(WEIGHT_FORMATS) == set(measured)


def test_auto_reads_the_latest_profile_of_this_machine_and_model_from_the_archive(tmp_path):
    path = tmp_path / "archive"
    location = resolve_location(path)
    assert weights_choice(location, "fp", "cpu") == (NATIVE_WEIGHTS, 8)  # no archive yet: the checkpoint's own format
    measured = {"fp32": {"kl": 0.0, "step_ms_1": 80.0}, "bf16": {"kl": 0.001, "step_ms_1": 45.0}}
    older = _with_weights({**measured, "int8": {"kl": 0.001, "step_ms_1": 40.0}}, machine=machine_info(), created=1.0)
    latest = _with_weights(measured, machine=machine_info(), created=2.0)
    elsewhere = _with_weights(
        {"fp32": {"kl": 0.0, "step_ms_1": 9.0}, "int4": {"kl": 0.0, "step_ms_1": 1.0}},
        machine=Machine("far", "?", None, None),
        created=3.0,
    )
    with Archive.open(path, create=True) as ar:
        for name, p in (("older", older), ("latest", latest), ("elsewhere", elsewhere)):
            ar.put_profile(name, p.to_dict())
    assert weights_choice(location, "fp", "cpu") == ("bf16", 1)
    assert weights_choice(location, "another model", "cpu") == (NATIVE_WEIGHTS, 8)


def test_decode_buffers_can_hold_16_bit_kv_and_attend_as_fp32_would():
    ids = random_tokens(30, seed=7)
    runner = tiny_runner("llama")
    kv = [(k.unsqueeze(0), v.unsqueeze(0)) for k, v in runner.prefill_batch([ids])[0]]
    assert DecodeState(runner, DecodePrompt(kv, ids), 2).k[0].dtype == torch.float32  # default: the model exactly
    half = DecodeState(runner, DecodePrompt(kv, ids), 2, kv_dtype=torch.float16)
    assert half.k[0].dtype == torch.float16
    exact = DecodeState(runner, DecodePrompt(kv, ids), 2)
    assert torch.allclose(half.step(ids[-1]), exact.step(ids[-1]), atol=2e-3)
    # the 16-bit decode attention equals SDPA over the same (rounded) keys and values in fp32
    torch.manual_seed(0)
    q = torch.randn(2, 4, 1, 16)
    k, v = torch.randn(2, 2, 50, 16).half(), torch.randn(2, 2, 50, 16).half()
    want = torch.nn.functional.scaled_dot_product_attention(q, k.float(), v.float(), scale=0.25, enable_gqa=True)
    assert torch.allclose(last_query(q, k, v, 0.25), want, atol=1e-5)


@pytest.mark.skipif(quant_kernels.kernels() is None, reason="no C compiler: kvblend's CPU kernels are not built here")
@pytest.mark.parametrize("fmt", ["int4", "int8"])
def test_a_kept_conversion_builds_the_same_modules_and_report_as_converting(fmt, tmp_path, monkeypatch):
    """int4/int8 on the CPU's kernels are kept beside a GGUF's converted checkpoint: the next load builds the
    modules a conversion builds (the same blocks, errors and report) without converting; a cache of the other
    format, or a damaged one, is converted again."""
    import kvblend.model.weights as weights_module

    converted = tiny_runner("llama")
    report = apply_weights(converted.model, fmt, cache=tmp_path)
    assert (tmp_path / f"{fmt}.safetensors").is_file()

    def no_conversion(*args, **kwargs):
        raise AssertionError("converted again instead of reading the kept blocks")

    kept = tiny_runner("llama")
    with monkeypatch.context() as m:
        m.setattr(weights_module, "_q4_1_blocks", no_conversion)
        m.setattr(weights_module, "_q8_0_blocks", no_conversion)
        again = apply_weights(kept.model, fmt, cache=tmp_path)
    assert again == report and again.layers == 7 * kept.n_layers and again.kept == 0
    for (name, a), b in zip(converted.model.named_modules(), kept.model.modules()):
        assert type(a) is type(b), name
        for attr in ("nibbles", "codes", "d", "low"):
            if hasattr(a, attr):
                assert torch.equal(getattr(a, attr), getattr(b, attr)), (name, attr)
        if hasattr(a, "max_error"):
            assert a.max_error == b.max_error
    converted.weights, kept.weights = report, again
    x = torch.randn(3, 64)
    with converted.decoding(), kept.decoding():  # the heads' kernels, on the same blocks
        assert torch.equal(converted.model.lm_head(x), kept.model.lm_head(x))
        assert not torch.equal(converted.model.lm_head(x), torch.nn.functional.linear(x, kept.model.lm_head.weight))

    other = "int8" if fmt == "int4" else "int4"
    (tmp_path / f"{fmt}.safetensors").rename(tmp_path / f"{other}.safetensors")  # the other format's
    assert apply_weights(tiny_runner("llama").model, other, cache=tmp_path).weights == other  # converted, not read
    (tmp_path / f"{fmt}.safetensors").write_bytes(b"damaged")
    assert apply_weights(tiny_runner("llama").model, fmt, cache=tmp_path) == report
    # kept blocks whose first layer does not give the recorded errors came from other weights: converted again
    import json

    from safetensors import safe_open
    from safetensors.torch import save_file

    path = tmp_path / f"{fmt}.safetensors"
    with safe_open(str(path), framework="pt") as f:
        notes, tensors = dict(f.metadata()), {k: f.get_tensor(k) for k in f.keys()}
    fresh = tiny_runner("llama").model
    loaded = {p: m.weight for p, m in fresh.named_modules() if p.startswith("model.layers.") and p.endswith("_proj")}
    loaded["lm_head"] = fresh.lm_head.weight
    assert weights_module._kept_conversion(path, loaded, fmt) is not None
    errors = json.loads(notes["__errors"])
    errors["model.layers.0.self_attn.q_proj"] += 1e-3
    save_file(tensors, str(path), metadata={**notes, "__errors": json.dumps(errors)})
    assert weights_module._kept_conversion(path, loaded, fmt) is None
    save_file(tensors, str(path), metadata={**notes, "__quantiser": "0"})
    assert weights_module._kept_conversion(path, loaded, fmt) is None
