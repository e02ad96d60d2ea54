"""What every test shares: fixture paths, tiny random-weight models, and one way to run the CLI.

Tests run the *installed* `kvblend` console script in a subprocess, as a user
meets it; `run_cli` is the only way tests invoke the command line (calls that
must succeed run the same `main()` in a process forked from clihost's host).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
FIXTURES = REPO / "fixtures"  # test-only data (MuSiQue passages)
QUESTIONS = (
    REPO / "kvblend" / "data" / "questions.json"
)  # the bundled documents' two-hop questions (the demo asks some)
PACKAGE_DATA = REPO / "kvblend" / "data"  # shipped with the package: demo docs, calibration set
DOCS = PACKAGE_DATA / "docs"
CALIBRATION = PACKAGE_DATA / "calibration.json"

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
ARCHS = ["llama", "mistral", "qwen2", "qwen3", "gemma3", "phi3"]


def tiny_config(arch: str):
    """A tiny config of `arch`, with the architecture's distinguishing features switched on."""
    import transformers as tf

    if arch == "llama":
        # Llama-3 rope scaling, so re-positioning is checked against a non-trivial RoPE.
        rope = {
            "rope_type": "llama3",
            "rope_theta": 500000.0,
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 64,
        }
        return tf.LlamaConfig(**TINY, rope_parameters=rope, architectures=["LlamaForCausalLM"])
    if arch == "mistral":
        # A sliding window shorter than the test prompts, so the window mask is exercised.
        return tf.MistralConfig(**TINY, sliding_window=24, architectures=["MistralForCausalLM"])
    if arch == "qwen2":
        return tf.Qwen2Config(**TINY, architectures=["Qwen2ForCausalLM"])  # q/k/v bias on
    if arch == "qwen3":
        return tf.Qwen3Config(**TINY, head_dim=16, architectures=["Qwen3ForCausalLM"])  # q_norm/k_norm
    if arch == "gemma3":
        # Local layers (window 24, shorter than the test prompts, RoPE base 10k) around one global layer
        # (base 1M), as Gemma 3 interleaves them; q/k norms, sandwich norms, scaled embeddings, GELU MLP.
        rope = {
            "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
            "full_attention": {"rope_type": "default", "rope_theta": 1000000.0},
        }
        layer_types = ["sliding_attention", "full_attention", "sliding_attention", "sliding_attention"]
        return tf.Gemma3TextConfig(
            **TINY,
            head_dim=16,
            query_pre_attn_scalar=16,
            sliding_window=24,
            layer_types=layer_types,
            rope_parameters=rope,
            architectures=["Gemma3ForCausalLM"],
        )
    if arch == "phi3":
        # Fused qkv_proj and gate_up_proj, and a window over every layer (Phi-3 mini's is 2,047 tokens)
        return tf.Phi3Config(
            **TINY, sliding_window=24, pad_token_id=0, bos_token_id=1, eos_token_id=2, architectures=["Phi3ForCausalLM"]
        )
    raise ValueError(arch)


def tiny_reference(arch: str, seed: int = 0):
    """transformers' own model of `arch` with random weights: what `tiny_runner(arch, seed)` must compute."""
    import torch
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(tiny_config(arch), dtype=torch.float32).eval()
    if arch == "gemma3":  # its norms start as the identity (weight 0 means scale 1): give each its own scale,
        with torch.no_grad():  # so a norm applied in the wrong place changes the logits
            for name, param in model.named_parameters():
                if name.endswith("norm.weight"):
                    param.normal_(0.0, 0.3)
    return model


def native_model(hf_model):
    """kvblend's Transformer holding a transformers model's weights and config (as a checkpoint would)."""
    from kvblend.model.config import ModelConfig
    from kvblend.model.transformer import Transformer

    config = ModelConfig.from_dict(hf_model.config.to_dict())
    tensors = {name: t.detach().clone() for name, t in hf_model.state_dict().items()}
    return Transformer.from_state_dict(config, tensors).to(next(hf_model.parameters()).dtype)


def tiny_runner(arch: str, seed: int = 0):
    """A layer-by-layer runner over a tiny random-weight model of `arch` (no download)."""
    from kvblend.model import ModelRunner

    reference = tiny_reference(arch, seed)
    runner = ModelRunner(native_model(reference), None, name=f"tiny-{arch}")
    runner.reference = reference  # type: ignore[attr-defined]  # the same weights in transformers, to compare with
    return runner


def reference_checkpoint(runner):
    """transformers' own model of a runner loaded by load_model (the converted GGUF, for the bundled model)."""
    import torch
    from transformers import AutoModelForCausalLM

    from kvblend.model.loading import cached_conversion

    directory = cached_conversion(runner.name, runner.fingerprint)
    if directory is None:
        raise FileNotFoundError(f"no converted checkpoint of {runner.name}")
    return AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32).eval()


def kvblend_script() -> list[str]:
    """The installed console script (next to this interpreter), as a user runs it."""
    script = Path(sys.executable).with_name("kvblend")
    if script.is_file():
        return [str(script)]
    found = shutil.which("kvblend")
    if found is None:
        raise RuntimeError("the kvblend console script is not installed: run `make install`")
    return [found]


def run_cli(
    *args, timeout: float = 900, check: bool = False, env: dict | None = None, input: str | None = None
) -> subprocess.CompletedProcess:
    """Run `kvblend ARGS...` in a subprocess; `check` raises with stderr on a non-zero exit.

    A call the test requires to succeed (`check`) in the test's own environment runs in a child forked from
    clihost's host, which has kvblend and torch imported already (the same `main()`, ~2 s of CPU less per model
    command). Every other call, the ones whose exit status and error line a test examines, runs the installed
    script in a fresh interpreter, as a user meets it."""
    full_env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", **(env or {})}
    argv = list(map(str, args))
    proc = None
    if check and not env and os.environ.get("KVBLEND_TEST_HOST", "1") != "0":
        proc = _host().run(argv, full_env, input, timeout)
    if proc is None:
        proc = subprocess.run(
            [*kvblend_script(), *argv], capture_output=True, text=True, timeout=timeout, env=full_env, input=input
        )
    if check and proc.returncode != 0:
        raise AssertionError(f"kvblend {' '.join(argv)} exited {proc.returncode}:\n{proc.stderr}")
    return proc


_HOST = None


def _host():
    """This test process's clihost.Host, started on first use and closed at exit."""
    global _HOST
    if _HOST is None:
        import atexit

        from clihost import Host

        _HOST = Host()
        atexit.register(_HOST.close)
    return _HOST


def one_line_error(proc: subprocess.CompletedProcess) -> str:
    """Assert the command failed with exactly one line on stderr and no traceback; return it."""
    assert proc.returncode != 0, proc.stdout
    lines = [line for line in proc.stderr.strip().splitlines() if line.strip()]
    assert "Traceback" not in proc.stderr, proc.stderr
    assert len(lines) == 1, proc.stderr
    return lines[0]


def run_in_threads(work, n: int = 4) -> list[BaseException]:
    """Run `work()` in `n` threads at once; return what any of them raised (assertions included),
    so a failure inside a thread fails the test instead of being printed and lost."""
    import threading

    errors: list[BaseException] = []

    def guarded() -> None:
        try:
            work()
        except BaseException as e:  # surfaced to the caller
            errors.append(e)

    threads = [threading.Thread(target=guarded) for _ in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return errors


def random_tokens(n: int, seed: int) -> list[int]:
    """`n` token ids of the tiny models' vocabulary, reproducible from `seed`."""
    import torch

    return torch.randint(3, 290, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def cached_prompt(runner, chunk_lengths: list[int]) -> list:
    """[uncached 6-token prefix] + one cached chunk per length (prefilled alone, 16-bit as archived)
    + [uncached 8-token question]: the shape of every blended prompt."""
    from kvblend.model.prefill import precompute_kv
    from kvblend.types import Segment

    chunks = [random_tokens(n, 40 + i) for i, n in enumerate(chunk_lengths)]
    kvs = precompute_kv(runner, chunks)
    segs = [Segment(random_tokens(6, 1), key="prefix")]
    segs += [Segment(c, kv=kv, key=f"chunk{i}") for i, (c, kv) in enumerate(zip(chunks, kvs))]
    return segs + [Segment(random_tokens(8, 2), key="question")]


def flip_layer_byte(archive, key_or_record, layer: int) -> None:
    """Flip one byte in the middle of a segment's stored layer, as a bit rot or a torn write would: the layer's
    checksum then fails when it is read (the archive's blob file is edited in place, its record left as it was)."""
    rec = archive.get_segment(key_or_record) if isinstance(key_or_record, str) else key_or_record
    entry = rec.layers[layer]
    blob = archive.path / rec.blob
    data = bytearray(blob.read_bytes())
    data[entry.offset + entry.length // 2] ^= 0xFF
    blob.write_bytes(bytes(data))
