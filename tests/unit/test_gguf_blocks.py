"""A GGUF's own blocks (kvblend.model.gguf_blocks): each block type, re-expressed in the kernels' layouts, holds
exactly the values gguf de-quantises (what transformers loads), and the kernels multiply them as F.linear
multiplies those values; a file's tensors are matched to the loaded weights, in the file's row order or in the
one transformers un-permutes Llama's q/k rows into, or left out; the blocks are cached; and decode steps over
them, eager and in the C step, give the logits of the same weights in fp32."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType, GGUFWriter
from gguf.quants import dequantize

from kvblend.model import gguf_blocks as gb
from kvblend.model import quant_kernels
from kvblend.model.fused_step import fused_step
from kvblend.model.weights import GGUF_WEIGHTS, BlockLinear, apply_weights
from support import tiny_runner

needs_kernels = pytest.mark.skipif(
    quant_kernels.kernels() is None, reason="no C compiler: kvblend's CPU kernels are not built here"
)

# type: (bytes a block, weights a block, byte ranges of its fp16 scales, the layout it becomes)
KINDS = {
    "Q8_0": (34, 32, [(0, 2)], "q8_0"),
    "Q4_0": (18, 32, [(0, 2)], "q8_0"),
    "Q5_0": (22, 32, [(0, 2)], "q8_0"),
    "Q4_1": (20, 32, [(0, 2), (2, 4)], "q4_1"),
    "Q4_K": (144, 256, [(0, 2), (2, 4)], "q4_1"),
    "Q6_K": (210, 256, [(208, 210)], "q8_16"),
}


def random_raw(kind: str, n_out: int, n_in: int, seed: int) -> np.ndarray:
    """Random blocks of `kind` (every byte pattern is a valid block once its fp16 scales are finite)."""
    size, per, scales, _ = KINDS[kind]
    rng = np.random.default_rng(seed)
    raw = rng.integers(0, 256, (n_out, n_in // per, size), dtype=np.uint8)
    for a, b in scales:
        raw[..., a:b] = rng.uniform(0.001, 0.05, (n_out, n_in // per, 1)).astype(np.float16).view(np.uint8)
    return raw.reshape(n_out, -1)


def blocks_of(kind: str, raw: np.ndarray) -> gb.Blocks | None:
    return gb._blocks(kind, raw, SimpleNamespace(tensor_type=GGMLQuantizationType[kind]))


@pytest.mark.parametrize("kind", list(KINDS))
def test_each_block_type_holds_exactly_what_gguf_dequantises(kind):
    raw = random_raw(kind, 48, 512, seed=list(KINDS).index(kind))
    blocks = blocks_of(kind, raw)
    assert blocks is not None and blocks.layout == KINDS[kind][3] and blocks.shape == (48, 512)
    want = torch.from_numpy(dequantize(raw, GGMLQuantizationType[kind]).astype(np.float32))
    assert torch.equal(blocks.dequantised(), want)
    assert torch.equal(blocks.dequantised(slice(5, 9)), want[5:9])


@needs_kernels
@pytest.mark.parametrize("kind", list(KINDS))
@pytest.mark.parametrize("rows", [1, 3, 11])  # 11: two passes of the kernel's 8 rows
def test_the_kernels_multiply_the_blocks_as_f_linear_multiplies_their_values(kind, rows):
    raw = random_raw(kind, 40, 768, seed=rows)
    blocks = blocks_of(kind, raw)
    assert blocks is not None
    weight = blocks.dequantised()
    linear = BlockLinear(torch.nn.Parameter(weight), None, SimpleNamespace(converted=lambda n: True), blocks)
    x = torch.randn(rows, 768, generator=torch.Generator().manual_seed(rows))
    got, want = linear(x), torch.nn.functional.linear(x, weight)
    assert got.shape == want.shape
    assert float((got - want).abs().max()) <= 1e-5 * float(want.abs().max()) + 1e-6


def test_types_it_does_not_re_express_are_left_out():
    assert blocks_of("Q5_1", np.zeros((4, 24 * 2), dtype=np.uint8)) is None
    assert gb._blocks("F16", np.zeros((4, 64), dtype=np.float16), None) is None


def _write_gguf(path, tensors: dict[str, np.ndarray], kinds: dict[str, str]) -> None:
    writer = GGUFWriter(str(path), "llama")
    for name, raw in tensors.items():
        writer.add_tensor(name, raw, raw_dtype=GGMLQuantizationType[kinds[name]])
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def test_a_files_tensors_match_the_loaded_weights_or_are_left_out_and_are_cached(tmp_path, monkeypatch):
    kinds = {
        "blk.0.attn_q.weight": "Q8_0",  # loaded in transformers' un-permuted row order (Llama's q/k)
        "blk.0.attn_k.weight": "Q4_K",
        "blk.0.ffn_down.weight": "Q6_K",  # loaded with one weight changed: not what the file holds
        "token_embd.weight": "Q5_0",  # the tied LM head
    }
    raws = {
        "blk.0.attn_q.weight": random_raw("Q8_0", 16, 256, 1),
        "blk.0.attn_k.weight": random_raw("Q4_K", 8, 256, 2),
        "blk.0.ffn_down.weight": random_raw("Q6_K", 8, 512, 3),
        "token_embd.weight": random_raw("Q5_0", 40, 256, 4),
    }
    path = tmp_path / "tiny.gguf"
    _write_gguf(path, raws, kinds)
    values = {n: torch.from_numpy(dequantize(r, GGMLQuantizationType[kinds[n]]).astype(np.float32)) for n, r in raws.items()}
    from transformers.modeling_gguf_pytorch_utils import LlamaTensorProcessor

    # the q rows as transformers loads a Llama GGUF's (its own un-permutation, not kvblend's)
    q_loaded = LlamaTensorProcessor()._reverse_permute_weights(values["blk.0.attn_q.weight"].numpy(), 2, 2)
    assert not np.array_equal(q_loaded, values["blk.0.attn_q.weight"].numpy())
    down = values["blk.0.ffn_down.weight"].clone()
    down[3, 7] += 1e-3
    loaded = {
        "model.layers.0.self_attn.q_proj": torch.from_numpy(np.ascontiguousarray(q_loaded)),
        "model.layers.0.self_attn.k_proj": values["blk.0.attn_k.weight"],
        "model.layers.0.mlp.down_proj": down,
        "model.layers.0.mlp.up_proj": torch.zeros(8, 256),  # not in the file
        "lm_head": values["token_embd.weight"],
    }
    found = gb.gguf_blocks(path, loaded, heads=2, kv_heads=1)
    assert set(found) == {"model.layers.0.self_attn.q_proj", "model.layers.0.self_attn.k_proj", "lm_head"}
    for name, blocks in found.items():
        assert torch.equal(blocks.dequantised(), loaded[name])
    assert found["lm_head"].layout == "q8_0" and found["model.layers.0.self_attn.k_proj"].layout == "q4_1"

    cache = tmp_path / "decode-blocks" / "gguf.safetensors"  # its folder is made on the first write
    first = gb.cached_gguf_blocks(path, cache, loaded, 2, 1)
    assert cache.is_file() and set(first) == set(found)
    from safetensors.torch import load_file, save_file

    tensors = load_file(str(cache))  # as written, for the damaged caches below
    monkeypatch.setattr(gb, "gguf_blocks", lambda *a: pytest.fail("read the file again instead of the cache"))
    again = gb.cached_gguf_blocks(path, cache, loaded, 2, 1)
    for name in found:
        assert torch.equal(again[name].dequantised(), loaded[name])
    # a cache whose shapes no longer fit the model, of another version, or unreadable, is made again, not used
    monkeypatch.undo()
    other = dict(loaded, lm_head=torch.zeros(40, 512))
    assert "lm_head" not in gb.cached_gguf_blocks(path, cache, other, 2, 1)
    save_file(tensors, str(cache), metadata={"lm_head": "q8_0", gb._VERSION_KEY: "0"})
    assert gb.read_block_cache(cache, loaded) is None
    save_file({"lm_head.codes": tensors["lm_head.codes"]}, str(cache), metadata={"lm_head": "q4_1", gb._VERSION_KEY: gb._CACHE_VERSION})
    assert gb.read_block_cache(cache, loaded) is None  # a q4_1 entry of int8 codes, without scales
    cache.write_bytes(b"not safetensors")
    assert set(gb.cached_gguf_blocks(path, cache, loaded, 2, 1)) == set(found)


def test_a_cache_that_cannot_be_written_still_gives_the_blocks(tmp_path):
    raws = {"token_embd.weight": random_raw("Q8_0", 8, 64, 9)}
    path = tmp_path / "head.gguf"
    _write_gguf(path, raws, {"token_embd.weight": "Q8_0"})
    loaded = {"lm_head": torch.from_numpy(dequantize(raws["token_embd.weight"], GGMLQuantizationType.Q8_0))}
    (tmp_path / "a-file").write_text("")
    unwritable = tmp_path / "a-file" / "gguf.safetensors"  # its folder cannot be made: a file is in the way
    assert set(gb.cached_gguf_blocks(path, unwritable, loaded, 1, 1)) == {"lm_head"}
    assert not unwritable.exists()


def _blocks_runner(seed: int = 0):
    """A tiny Llama whose every projection (and head) is random blocks of the three layouts, in turn, and whose
    fp32 weights are those blocks' values."""
    runner = tiny_runner("llama", seed)
    gen = torch.Generator().manual_seed(seed)
    layouts = ["q4_1", "q8_0", "q8_16"]
    blocks: dict[str, gb.Blocks] = {}
    named = dict(runner.model.named_modules())
    paths = [n for n in named if n.startswith("model.layers.") and n.endswith("_proj")] + ["lm_head"]
    for i, path in enumerate(paths):
        weight = named[path].weight
        n_out, n_in = weight.shape
        layout = layouts[i % 3]
        if layout == "q4_1":
            codes = torch.randint(0, 256, (n_out, n_in // 2), dtype=torch.uint8, generator=gen)
            d = torch.rand(n_out, n_in // 32, generator=gen) * 0.02
            m = -torch.rand(n_out, n_in // 32, generator=gen) * 0.1
            b = gb.Blocks(layout, codes, d, m)
        else:
            codes = torch.randint(-127, 128, (n_out, n_in), dtype=torch.int8, generator=gen)
            per = 16 if layout == "q8_16" else 32
            b = gb.Blocks(layout, codes, torch.rand(n_out, n_in // per, generator=gen) * 0.002)
        with torch.no_grad():
            weight.copy_(b.dequantised())
        blocks[path] = b
    return runner, blocks


@needs_kernels
def test_decode_over_the_blocks_eager_and_in_the_c_step_gives_the_fp32_logits():
    from kvblend.generation import DecodeState
    from kvblend.generation.decode import DecodePrompt, decode_step
    from support import random_tokens

    runner, blocks = _blocks_runner()
    ids = random_tokens(21, seed=5)

    def steps(r, n=5):
        kv = [(k.unsqueeze(0), v.unsqueeze(0)) for k, v in r.prefill_batch([ids])[0]]
        state = DecodeState(r, DecodePrompt(kv, ids), n + 1, torch.float32)
        token, out = 7, []
        for _ in range(n):
            logits = decode_step(r, [state], [token])
            out.append(logits)
            token = int(logits.argmax())
        return out

    reference = steps(runner)  # the fp32 weights (the blocks' values)
    runner.weights = apply_weights(runner.model, GGUF_WEIGHTS, blocks=blocks)
    assert runner.weights.weights == "gguf" and runner.weights.kept == 0
    assert runner.weights.head == blocks["lm_head"].layout
    assert runner.weights.layers == 7 * runner.n_layers
    step = fused_step(runner)
    assert step is not None  # a Llama in Q4_1/Q8_0/Q8_16 blocks: the C step takes it
    kv = [(k.unsqueeze(0), v.unsqueeze(0)) for k, v in runner.prefill_batch([ids])[0]]
    assert step.takes([DecodeState(runner, DecodePrompt(kv, ids), 6, torch.float32)])
    for fused in (None, step):
        runner.fused_step = fused
        for want, got in zip(reference, steps(runner)):
            assert float((got - want).abs().max()) <= 1e-4 * float(want.abs().max()) + 1e-5


@needs_kernels
def test_profile_measures_a_ggufs_own_blocks_and_auto_can_take_them():
    """`kvblend profile` times the checkpoint's own format beside the four `--weights` formats where it is
    none of them (a GGUF's own blocks), so `--weights auto` can choose it: exact, its KL from fp32 is ~0."""
    from kvblend.defaults import NATIVE_WEIGHTS
    from kvblend.model.weights import check_weights
    from kvblend.tuning.probes import measure_decode_weights
    from kvblend.tuning.profile import Profile

    def load(fmt: str):
        runner, blocks = _blocks_runner()
        if fmt == NATIVE_WEIGHTS:
            runner.weights = apply_weights(runner.model, GGUF_WEIGHTS, blocks=blocks)
        elif fmt != "fp32":
            runner.weights = apply_weights(runner.model, fmt)
        runner.fused_step = fused_step(runner)
        return runner

    measured = measure_decode_weights(load, 40, 2, (1, 2))
    assert set(measured) == {"fp32", "bf16", "int8", "int4", "gguf"}
    assert measured["gguf"]["kl"] < 1e-6 and measured["gguf"]["step_ms_1"] > 0
    # what auto takes: the fastest within the KL bound; made the fastest here, it is the GGUF's blocks
    measured["gguf"]["step_ms_1"] = measured["gguf"]["step_ms_2"] = 1e-3
    assert Profile.weights_choice(SimpleNamespace(weights=measured))[0] == "gguf"
    assert check_weights("gguf", allow_auto=False, allow_native=True) == "gguf"  # what the engine is handed
    assert check_weights("gguf") == "gguf"  # and a user's value


def test_weights_gguf_for_a_model_that_is_not_a_gguf_is_one_line_before_any_load(tmp_path):
    """`--weights gguf` names the file's own blocks: a checkpoint directory has none, said before any weight loads
    (by the loader, and by the CLI before it opens or creates an archive)."""
    from support import one_line_error, run_cli
    from kvblend.errors import UsageError
    from kvblend.model.loading import load_model
    from support import tiny_reference

    tiny_reference("llama").save_pretrained(tmp_path)
    with pytest.raises(UsageError, match="--weights gguf decodes a GGUF's own blocks; .* is not a GGUF"):
        load_model(str(tmp_path), compute="cpu", weights="gguf")
    proc = run_cli("serve", "--model", tmp_path, "--weights", "gguf", "--archive", tmp_path / "archive", timeout=60)
    line = one_line_error(proc)
    assert proc.returncode == 2 and "is not a GGUF" in line and not (tmp_path / "archive").exists()
