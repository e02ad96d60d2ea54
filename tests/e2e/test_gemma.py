"""Gemma 3 270M, the second real model family (bundled by `make install`; Gemma terms apply), end to end through
the installed script: ingest, query in every mode, bench and serve. Its sliding-window layers, two RoPE bases,
sandwich norms and scaled embeddings all run in the runner that the tiny-config unit tests check exactly.

One model per command, as users run it; the commands share one archive so the module pays for one ingest.
"""

from __future__ import annotations

import json
import time

import pytest

from serve_support import Server
from support import CALIBRATION, FIXTURES, one_line_error, run_cli

GEMMA = "gemma3-270m"
MANUAL = FIXTURES / "documents" / "manual.pdf"


@pytest.fixture(scope="module")
def gemma_archive(tmp_path_factory):
    """The PDF manual ingested under Gemma 3 (one segment a page, so page 3 is a segment of its own)."""
    archive = tmp_path_factory.mktemp("gemma") / "archive"
    proc = run_cli("ingest", MANUAL, "--archive", archive, "--model", GEMMA, "--chunk-tokens", "128",
                   "--compute", "cpu", "--json", check=True)
    report = json.loads(proc.stdout)
    assert report["segments_new"] >= 4 and report["skipped"] == []
    return archive


def test_gemma_answers_from_the_page_that_holds_the_fact(gemma_archive):
    """`query` in full and blend (prefix and reuse run in the bench test below: one model load per command)."""
    answers = {}
    for mode in ("full", "blend"):
        proc = run_cli("query", "What is the Orca-7 pump's maximum pressure?", "--archive", gemma_archive,
                       "--model", GEMMA, "--mode", mode, "--top-k", "2", "--max-tokens", "12", "--compute", "cpu",
                       "--json", check=True)
        result = json.loads(proc.stdout)
        assert result["mode"] == mode
        assert any(s["pages"] == [3, 3] and s["document"].endswith("manual.pdf") for s in result["segments"])
        if mode != "full":
            assert all(s["cached"] for s in result["segments"])
        answers[mode] = result["answer"]
    assert "412" in answers["full"], answers  # the base model reads the page: the fact is in full's answer
    assert answers["blend"].strip(), answers


def test_gemma_bench_and_serve(gemma_archive, tmp_path):
    proc = run_cli("bench", CALIBRATION, "--limit", "1", "--chunks", "2", "--modes", "full,prefix,reuse,blend",
                   "--ratios", "0.3", "--max-tokens", "6", "--model", GEMMA, "--compute", "cpu", "--json",
                   check=True)
    report = json.loads(proc.stdout)
    rows = {r["mode"]: r for r in report["results"]}
    assert rows["full"]["kl_vs_full"] == 0 and 0 < rows["blend"]["recompute_share"] < 0.6
    assert rows["prefix"]["kl_vs_full"] < 1e-6 and rows["prefix"]["em_vs_full"] == 1  # prefix mode is exact
    assert rows["reuse"]["recompute_share"] < rows["blend"]["recompute_share"]
    assert report["model"].startswith(GEMMA)

    server = Server(gemma_archive, tmp_path / "serve.log", 8, "--model", GEMMA)
    try:
        reply = server.client().chat.completions.create(
            model=GEMMA, messages=[{"role": "user", "content": "What is the Orca-7 pump's maximum pressure?"}],
            max_tokens=8, temperature=0, extra_body={"kvblend": {"top_k": 2}})
        assert reply.choices[0].message.content.strip()
        segments = reply.model_extra["kvblend"]["segments"]
        assert any(s["pages"] == [3, 3] for s in segments), segments
    finally:
        server.stop()


def test_an_unsupported_gguf_is_refused_from_its_header(tmp_path):
    """A model family without a runner is refused by name before any weights are read or converted."""
    import gguf

    path = tmp_path / "gemma2.gguf"
    writer = gguf.GGUFWriter(str(path), "gemma2")  # attention soft-capping: no runner
    writer.add_block_count(2)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.close()
    started = time.monotonic()
    proc = run_cli("ingest", FIXTURES / "documents" / "quickstart.md", "--model", path, "--archive", tmp_path / "a")
    line = one_line_error(proc)
    assert "unsupported architecture gemma2" in line and "Gemma3ForCausalLM" in line
    assert time.monotonic() - started < 20  # no conversion was attempted (Gemma's takes ~22 s on 2 cores)


def test_gemma_decodes_in_its_gguf_blocks_as_in_fp32(gemma_archive):
    """With no profile (`--weights auto`), Gemma 3's Q4_K_M file (Q5_0, Q4_K, Q6_K and Q8_0 tensors) decodes in
    its own blocks, each checked equal to the weights prefill reads: a quarter of fp32's bytes a step, and the
    same greedy tokens as its fp32 weights. (After the module's ingest, which made the blocks' cache.)"""
    import torch

    from kvblend.defaults import NATIVE_WEIGHTS
    from kvblend.fusion import fuse
    from kvblend.generation import DecodeState, decode_step
    from kvblend.model import load_model
    from kvblend.types import Segment

    native, fp32 = (load_model(GEMMA, "cpu", None, w) for w in (NATIVE_WEIGHTS, "fp32"))
    report = native.weights
    assert load_model(GEMMA, "cpu", None, "gguf").weights == report  # `--weights gguf` by name: the same
    assert report.weights == "gguf" and report.kept == 0 and report.layers == 7 * native.n_layers
    assert report.head == "q8_0" and report.bytes < 0.3 * fp32.weights.bytes
    from kvblend.model.weights import BlockLinear

    converted = [m for m in native.model.modules() if isinstance(m, BlockLinear)]
    assert len(converted) == 7 * native.n_layers + 1  # every projection and the head, each exactly the weights
    assert all(torch.equal(m.converted_matmul(torch.eye(m.weight.shape[1])[:8]), m.weight[:, :8].T) for m in converted)
    assert native.fused_step is not None  # Gemma's sandwich norms, GELU, windows and two RoPE bases, in C
    # a base model's answer ends at its line: every run of line breaks the vocabulary writes as one token (1 to 31)
    breaks = native.line_break_ids
    assert len(breaks) >= 30 and {native.tokenize("\n")[0], native.tokenize("\n" * 5)[0]} <= breaks <= \
        native.stop_token_ids
    tokens, logits = {}, {}
    for name, runner in (("gguf", native), ("fp32", fp32)):
        with torch.inference_mode():
            fused = fuse(runner, [Segment(runner.tokenize("The Orca-7 pump is rated for a maximum pressure of"))],
                         "full")
            state = DecodeState(runner, fused, 12, torch.float32)
            token, out, seen = int(fused.last_logits.argmax()), [], []
            for _ in range(10):
                step = decode_step(runner, [state], [token])[0]
                seen.append(step)
                token = int(step.argmax())
                out.append(token)
        tokens[name], logits[name] = out, torch.stack(seen)
    assert tokens["gguf"] == tokens["fp32"]
    diff = float((logits["gguf"] - logits["fp32"]).abs().max())
    assert diff <= 1e-3 * float(logits["fp32"].abs().max()), diff  # the order of fp32 sums, nothing more
