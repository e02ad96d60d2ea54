"""Lossy codecs end to end with the real model and the installed CLI: ingest with int4, a lossless context
file stored beside it, verify and stats per codec, a damaged int4 blob found by `verify` and recomputed by
`query`, then a re-ingest with lossless (new segments, the document moved over, the int4 ones gone)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from support import DOCS, run_cli as run


def _flip_layer_byte(arc: Path, key: str, layer: int) -> None:
    show = json.loads(run("show", key, "--archive", arc, "--json", check=True).stdout)
    blob = arc / show["blob"]
    data = bytearray(blob.read_bytes())
    offset = sum(show["layer_bytes"][:layer]) + show["layer_bytes"][layer] // 2
    data[offset] ^= 0xFF
    blob.write_bytes(bytes(data))


def test_int4_archive_mixes_with_lossless_and_survives_a_damaged_blob(tmp_path):
    docs, arc = tmp_path / "docs", tmp_path / "arc"
    docs.mkdir()
    shutil.copy(DOCS / "plants.md", docs / "plants.md")
    ingest = ("ingest", docs, "--archive", arc, "--chunk-tokens", "128", "--json")
    first = json.loads(run(*ingest, "--codec", "int4", check=True).stdout)
    n = first["segments_new"]
    assert n >= 2 and first["bytes_written"] < 0.4 * first["raw_bytes"]  # the 0.30x target is a benchmark (BENCHMARKS.md), not a test
    again = json.loads(run(*ingest, "--codec", "int4", check=True).stdout)
    assert again["documents_unchanged"] == 1 and again["segments_new"] == 0

    # A mixed archive: a lossless context file stored beside the int4 document.
    ctx = tmp_path / "ctx.txt"
    ctx.write_text("The Tern-4 sonar is assembled in the Harwick plant, managed by Ada Ruiz.\n")
    question = ("query", "Who manages the plant where the Tern-4 sonar is built?", "--archive", arc,
                "--doc", docs / "plants.md", "--context-file", ctx, "--store", "--max-tokens", "4", "--json")
    answer = json.loads(run(*question, check=True).stdout)
    assert answer["answer"].strip() and not answer["warnings"]
    stats = json.loads(run("stats", "--archive", arc, "--json", check=True).stdout)
    assert {"int4", "zstd-shuffle"} <= set(stats["bytes_per_token_by_codec"])
    assert stats["bytes_per_token_by_codec"]["int4"] < 0.30 * stats["bytes_per_token_raw"]
    verified = json.loads(run("verify", "--deep", "--archive", arc, "--json", check=True).stdout)
    assert verified["ok"] and verified["codecs"]["int4"] == n

    # A bit flip in an int4 blob: verify names the segment, query warns and recomputes it.
    key = answer["segments"][0]["key"]
    _flip_layer_byte(arc, key, 3)
    proc = run("verify", "--archive", arc, "--json")
    assert proc.returncode == 1 and {p["segment"] for p in json.loads(proc.stdout)["problems"]} == {key}
    damaged = json.loads(run(*question, check=True).stdout)
    assert damaged["answer"].strip()
    assert any(key[:12] in w and "recomput" in w for w in damaged["warnings"])
    assert run("verify", "--archive", arc).returncode == 0  # stored again under its own key, as int4
    assert not json.loads(run(*question, check=True).stdout)["warnings"]

    # Another kind of codec: new segments (own keys); the document now points at them; the int4 ones go
    # (the lossless context file stays).
    moved = json.loads(run(*ingest, "--codec", "lossless", check=True).stdout)
    assert moved["segments_new"] == n and moved["documents_unchanged"] == 0
    stats = json.loads(run("stats", "--archive", arc, "--json", check=True).stdout)
    assert set(stats["bytes_per_token_by_codec"]) == {"zstd-shuffle"}
    assert run("verify", "--archive", arc).returncode == 0


def test_int4_and_its_int8_head_hold_the_gguf_files_own_blocks(default_runner):
    """On the CPU `--weights int4` multiplies the bundled GGUF's Q4_1 blocks as the file holds them, and its
    LM head the file's Q8_0 embedding: codes and scales read back from the file, byte for byte."""
    import numpy as np
    import pytest
    from gguf import GGUFReader

    from kvblend.model import quant_kernels
    from kvblend.model.source import resolve_model_source
    from kvblend.model.weights import Int4Linear, Int8Linear, Route

    if quant_kernels.kernels() is None:
        pytest.skip("no C compiler: kvblend's CPU kernels are not built here")
    source = resolve_model_source(None)
    tensors = {t.name: t for t in GGUFReader(str(source.directory / (source.gguf_file or ""))).tensors}
    layer = default_runner.layers[3]
    for name, module in (("attn_v", layer.self_attn.v_proj), ("ffn_down", layer.mlp.down_proj)):
        raw = np.asarray(tensors[f"blk.3.{name}.weight"].data).reshape(module.weight.shape[0], -1, 20)  # d, m, 16 B
        int4 = Int4Linear(module.weight, None, Route())
        assert int4.max_error == 0.0
        assert np.array_equal(int4.nibbles.numpy().reshape(raw.shape[0], -1, 16), raw[..., 4:])
        assert np.array_equal(int4.d.numpy(), raw[..., 0:2].copy().view(np.float16)[..., 0].astype(np.float32))
        assert np.array_equal(int4.low.numpy(), raw[..., 2:4].copy().view(np.float16)[..., 0].astype(np.float32))
    head = default_runner.model.lm_head.weight
    raw = np.asarray(tensors["token_embd.weight"].data).reshape(head.shape[0], -1, 34)  # d, 32 codes
    int8 = Int8Linear(head, None, Route())
    assert int8.max_error == 0.0
    assert np.array_equal(int8.codes.numpy().reshape(raw.shape[0], -1, 32), raw[..., 2:].view(np.int8))


def test_the_bundled_model_decodes_in_one_c_call_as_it_does_step_by_step():
    """The bundled model under its default (native int4) weights steps through kvblend.model.fused_step, whose
    greedy tokens and logits are those of the eager step over the same kernels, one sequence or three."""
    import pytest
    import torch

    from kvblend.defaults import NATIVE_WEIGHTS
    from kvblend.generation import DecodeState
    from kvblend.generation.decode import DecodePrompt, decode_step
    from kvblend.model import load_model, quant_kernels

    if quant_kernels.kernels() is None:
        pytest.skip("no C compiler: kvblend's CPU kernels are not built here")
    runner = load_model(compute="cpu", weights=NATIVE_WEIGHTS)
    step = runner.fused_step
    assert runner.weights_name == "int4" and step is not None
    text = "The Eiffel Tower is in Paris. The Colosseum is in Rome. Question: where is the Colosseum? Answer:"
    prompts = [runner.tokenize(text * n) for n in (1, 3, 2)]
    prompt_kv = []
    for ids in prompts:
        kv = [(k.unsqueeze(0), v.unsqueeze(0)) for k, v in runner.prefill_batch([ids[:-1]])[0]]
        prompt_kv.append(DecodePrompt(kv, ids[:-1]))

    def greedy(rows: int, fused: bool) -> tuple[list[list[int]], list[torch.Tensor]]:
        runner.fused_step = step if fused else None
        try:
            states = [DecodeState(runner, p, 12) for p in prompt_kv[:rows]]
            tokens, out, logits = [p[-1] for p in prompts[:rows]], [], []
            for _ in range(12):
                step_logits = decode_step(runner, states, tokens)
                logits.append(step_logits)
                tokens = [int(t) for t in step_logits.argmax(-1)]
                out.append(tokens)
            return out, logits
        finally:
            runner.fused_step = step

    for rows in (1, 3):
        (want, want_logits), (got, got_logits) = greedy(rows, False), greedy(rows, True)
        assert got == want
        assert float((got_logits[0] - want_logits[0]).abs().max()) < 1e-2
