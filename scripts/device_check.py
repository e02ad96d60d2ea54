"""The CUDA path, checked against the CPU and timed, in one run sized for a lent GPU's short lease.

CI never has a GPU; this is what runs when one is lent (scripts/device_check.sh
sets it up there). Weights are random (seeded) so that the check needs no model
download and fits the lease's transfer limit; the shapes are SmolLM2-135M's
(`--config`, its config.json) and the tiny test configs of every supported
family (`--tiny-configs`, JSON written by tests/support.py's tiny_config).
Random weights change no timing, and a parity check needs the same weights on
both devices, not good ones.

Parity (every family; CUDA fp32 and bf16 against the CPU's fp32):
* `full`, `blend` (ratio 0.15) and `reuse` fusions: the first token's logits, as KL(CPU ‖ CUDA)
  and the largest logit difference;
* decode: 12 greedy tokens on CUDA, eager and replayed from a CUDA graph, against the CPU's;
* each `--weights` format's decode step on CUDA against fp32's on CUDA (KL).

Timing (SmolLM2's shape, ~3,000-token prompt of six cached passages and an
uncached question, bf16 and fp32 on CUDA): TTFT of full, blend and reuse, and the
decode step at batch 1 (eager and CUDA graph) and batch 8, per weight format.

    python scripts/device_check.py --write-inputs .gpu     (here, before the lease)
    python scripts/device_check.py --config CONFIG.json --tiny-configs DIR --out OUT.json
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from kvblend.fusion import BlendConfig, fuse  # noqa: E402
from kvblend.generation import DecodeState, decode_step  # noqa: E402
from kvblend.model.config import ModelConfig  # noqa: E402
from kvblend.model.loading import avoid_cudnn_attention  # noqa: E402
from kvblend.model.runner import ModelRunner  # noqa: E402
from kvblend.model.transformer import Transformer  # noqa: E402
from kvblend.model.weights import WEIGHT_FORMATS, apply_weights  # noqa: E402
from kvblend.types import Segment  # noqa: E402

TARGET = "cuda"  # `--dry-run`: "cpu", to try the script where there is no GPU
PASSAGE = 480  # tokens per cached passage in the timed prompt: six of them and a question, ~3,000 tokens
MODES = {"full": None, "blend": BlendConfig.single(0.15), "reuse": None}


def random_weights(
    config: ModelConfig, seed: int, device: str = "cpu", dtype: torch.dtype = torch.float32
) -> dict[str, torch.Tensor]:
    """Seeded random tensors in the layout `Transformer(config)` expects, scaled so activations stay O(1)
    (drawn on `device` in `dtype`: a 3B shape's weights are drawn on the GPU in seconds)."""
    shapes = {name: t.shape for name, t in Transformer(config, set()).state_dict().items()}
    gen = torch.Generator(device=device).manual_seed(seed)
    tensors = {}
    for name, shape in sorted(shapes.items()):
        draw = torch.randn(shape, generator=gen, device=device, dtype=dtype)
        if name.endswith("norm.weight"):
            base = 0.0 if config.is_gemma else 1.0  # Gemma scales by 1 + weight
            tensors[name] = base + 0.3 * draw
        elif len(shape) == 2 and "embed" in name:
            tensors[name] = draw
        else:
            tensors[name] = draw / math.sqrt(shape[-1])
    return tensors


#: Larger Llama shapes (Llama 3.2 1B and 3B) for `--shapes`: does blend's saving outgrow its orchestration?
SHAPES = {
    "1b": dict(
        hidden_size=2048,
        intermediate_size=8192,
        num_hidden_layers=16,
        num_attention_heads=32,
        num_key_value_heads=8,
        head_dim=64,
        vocab_size=128256,
        tie_word_embeddings=True,
    ),
    "3b": dict(
        hidden_size=3072,
        intermediate_size=8192,
        num_hidden_layers=28,
        num_attention_heads=24,
        num_key_value_heads=8,
        head_dim=128,
        vocab_size=128256,
        tie_word_embeddings=True,
    ),
}


def capture_beside_a_loader(config: ModelConfig) -> dict:
    """A lone sequence's graph captured while another thread copies KV to the GPU on its own stream, as a
    server's archive loader does: the capture must succeed and replay what the eager step computes."""
    import threading

    runner = runner_on(config, random_weights(config, seed=6), TARGET, torch.bfloat16)
    segs = prompt(runner, [tokens(PASSAGE, config.vocab_size, 70 + i) for i in range(2)], [1, 2, 3], [4, 5, 6])
    fused = fuse(runner, segs, "full")
    stop = threading.Event()
    copies = [0]

    def loader() -> None:
        stream = torch.cuda.Stream() if TARGET == "cuda" else None
        host = torch.randn(3, 200, 64).pin_memory() if TARGET == "cuda" else torch.randn(3, 200, 64)
        while not stop.is_set():
            if stream is not None:
                with torch.cuda.stream(stream):
                    host.to(TARGET, non_blocking=True)
                stream.synchronize()
            copies[0] += 1

    thread = threading.Thread(target=loader, daemon=True)
    thread.start()
    try:
        graphed = greedy(runner, fused, 8, graphed=True)
    finally:
        stop.set()
        thread.join()
    eager = greedy(runner, fused, 8, graphed=False)
    return {
        "loader copies meanwhile": copies[0],
        "greedy agreement graph vs eager": sum(a == b for a, b in zip(graphed[0], eager[0])) / 8,
        "max step KL graph vs eager": max(kl(a, b) for a, b in zip(eager[1], graphed[1])),
    }


def batch_paths(config: ModelConfig) -> dict:
    """A decode step of k sequences: one eager batched pass against each sequence's graph replayed in turn,
    k = 1..16, on the timed prompt; and the two paths' logits for three sequences of different lengths."""
    runner = runner_on(
        config, random_weights(config, seed=7, device=TARGET, dtype=torch.bfloat16), TARGET, torch.bfloat16
    )
    passages = [tokens(PASSAGE, config.vocab_size, 80 + i) for i in range(6)]
    segs = prompt(runner, passages, tokens(40, config.vocab_size, 10), tokens(60, config.vocab_size, 11))
    out: dict = {}
    from kvblend.generation import decode

    limit = decode.GRAPHED_BATCH_MAX
    with torch.inference_mode():
        fused = [fuse(runner, segs[: 2 + i] + segs[-1:], "full") for i in range(3)]  # three lengths
        for graphed in (False, True):
            states = [DecodeState(runner, f, 8, graphed=graphed) for f in fused]
            rows = [decode_step(runner, states, [int(f.last_logits.argmax()) for f in fused]) for _ in range(4)]
            out[f"{'graphs' if graphed else 'eager'} logits"] = torch.stack(rows).float().cpu()
        graphs, eager = out.pop("graphs logits"), out.pop("eager logits")
        out["three ragged sequences, 4 steps: max KL graphs vs eager batch"] = max(
            kl(a, b) for a, b in zip(eager.reshape(-1, eager.shape[-1]), graphs.reshape(-1, graphs.shape[-1]))
        )
        out["three ragged sequences, 4 steps: same argmax"] = bool((graphs.argmax(-1) == eager.argmax(-1)).all())
        full = fuse(runner, segs, "full")
        token = int(full.last_logits.argmax())
        decode.GRAPHED_BATCH_MAX = 64  # measure the graphs past kvblend's own limit too
        try:
            for k in (1, 2, 4, 8, 12, 16):
                for graphed in (False, True):
                    states = [DecodeState(runner, full, 40, graphed=graphed) for _ in range(k)]
                    ms = 1000 * cuda_time(lambda: decode_step(runner, states, [token] * k), 20)
                    out[f"batch {k}, {'graphs in turn' if graphed else 'eager batched'} ms"] = ms
        finally:
            decode.GRAPHED_BATCH_MAX = limit
    return out


def sdpa_backends(config: ModelConfig) -> dict:
    """What cuDNN's attention costs at shapes it has not seen: cuDNN builds an execution plan per shape, and a
    decode step's key count is new at every step. Eager steps and fusions at fresh lengths (first sight) and
    again at the same lengths (plans cached), with cuDNN's SDPA on (torch's default) and off."""
    runner = runner_on(
        config, random_weights(config, seed=5, device=TARGET, dtype=torch.bfloat16), TARGET, torch.bfloat16
    )
    passages = [tokens(PASSAGE, config.vocab_size, 50 + i) for i in range(6)]
    kv = [runner.prefill_batch([p])[0] for p in passages]
    out: dict = {}
    for round_, cudnn in enumerate((True, False, True, False)):
        torch.backends.cuda.enable_cudnn_sdp(cudnn)  # after runner_on, which turns it off
        label = f"cuDNN SDPA {'on' if cudnn else 'off'}"
        tail = tokens(50 + 7 * round_, config.vocab_size, 60 + round_)  # a prompt length no round saw before
        segs = [
            Segment(tokens(40, config.vocab_size, 6)),
            *(Segment(p, kv=k) for p, k in zip(passages, kv)),
            Segment(tail),
        ]
        with torch.inference_mode():
            for mode in ("full", "blend"):
                synchronize()
                t0 = time.perf_counter()
                fused = fuse(runner, segs, mode, MODES[mode])
                synchronize()
                first = time.perf_counter() - t0
                again = cuda_time(lambda: fuse(runner, segs, mode, MODES[mode]), 3)
                out.setdefault(f"{label}: {mode} fusion, fresh length ms", []).append(1000 * first)
                out.setdefault(f"{label}: {mode} fusion, seen length ms", []).append(1000 * again)
            token = int(fused.last_logits.argmax())
            for seen in (False, True):
                state = DecodeState(runner, fused, 40, graphed=False)
                steps = []
                for _ in range(30):
                    synchronize()
                    t0 = time.perf_counter()
                    decode_step(runner, [state], [token])
                    synchronize()
                    steps.append(time.perf_counter() - t0)
                name = f"{label}: eager step, {'seen' if seen else 'fresh'} lengths ms"
                out.setdefault(name, []).append(1000 * statistics.median(steps))
    avoid_cudnn_attention()  # back to what kvblend runs with
    return out


def profile_blend(config: ModelConfig) -> str:
    """Where a 3,000-token blend fusion's time goes on this GPU (torch.profiler's top rows by host time)."""
    from torch.profiler import ProfilerActivity, profile

    runner = runner_on(config, random_weights(config, seed=4), TARGET, torch.bfloat16)
    passages = [tokens(PASSAGE, config.vocab_size, 40 + i) for i in range(6)]
    segs = prompt(runner, passages, tokens(40, config.vocab_size, 8), tokens(60, config.vocab_size, 9))
    for _ in range(2):
        fuse(runner, segs, "blend", MODES["blend"])
    synchronize()
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if TARGET == "cuda" else [])
    with profile(activities=activities) as prof:
        fuse(runner, segs, "blend", MODES["blend"])
        synchronize()
    return prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=25)


def runner_on(
    config: ModelConfig, tensors: dict, device: str, dtype: torch.dtype, weights: str = "fp32"
) -> ModelRunner:
    if device == "cuda":
        avoid_cudnn_attention()  # as load_model does on CUDA (sdpa_backends measures both ways)
    model = Transformer.from_state_dict(config, {k: v.clone() for k, v in tensors.items()})
    model.to(device=device, dtype=dtype)
    return ModelRunner(model, None, name=config.architecture, weights=apply_weights(model, weights))


def fused_layers(runner: ModelRunner) -> str:
    """How many converted layers run torch's fused kernel rather than the de-quantising fallback."""
    from kvblend.model.weights import Int4Linear, Int8Linear

    mods = [m for m in runner.model.modules() if isinstance(m, (Int4Linear, Int8Linear))]
    fused = sum(1 for m in mods if getattr(m, "fused", False) or getattr(m, "gpu_packed", None) is not None)
    return f"{fused}/{len(mods)}"


def tokens(n: int, vocab: int, seed: int) -> list[int]:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(3, vocab - 1, (n,), generator=gen).tolist()


def prompt(runner: ModelRunner, passages: list[list[int]], head: list[int], tail: list[int]) -> list[Segment]:
    """Uncached head, the passages with their KV prefilled alone on this runner's device, uncached tail."""
    kv = [runner.prefill_batch([p])[0] for p in passages]
    return [Segment(head), *(Segment(p, kv=k) for p, k in zip(passages, kv)), Segment(tail)]


def kl(p_logits: torch.Tensor, q_logits: torch.Tensor) -> float:
    p = torch.log_softmax(p_logits.double().cpu(), -1)
    q = torch.log_softmax(q_logits.double().cpu(), -1)
    return float((p.exp() * (p - q)).sum())


def greedy(runner: ModelRunner, fused, n: int, graphed: bool) -> tuple[list[int], list[torch.Tensor]]:
    state = DecodeState(runner, fused, n, graphed=graphed)
    token, out, logits = int(fused.last_logits.argmax()), [], []
    with torch.inference_mode():
        for _ in range(n):
            out.append(token)
            row = decode_step(runner, [state], [token])[0]
            logits.append(row.float().cpu())
            token = int(row.argmax())
    return out, logits


def parity(
    name: str, config: ModelConfig, sizes: tuple[int, int, int], real: tuple[dict, list[list[int]]] | None = None
) -> dict:
    """CPU fp32 against CUDA fp32 and bf16 on the same weights: random ones, or `real` (a checkpoint's
    tensors and passages of real text in its tokens)."""
    n_passages, passage, steps = sizes
    tensors = random_weights(config, seed=1) if real is None else real[0]
    if real is None:
        passages = [tokens(passage, config.vocab_size, 10 + i) for i in range(n_passages)]
    else:
        passages = real[1][:n_passages]
    head, tail = tokens(6, config.vocab_size, 2), tokens(12, config.vocab_size, 3)
    cpu = runner_on(config, tensors, "cpu", torch.float32)
    result: dict = {"model": name}
    cpu_prompt = prompt(cpu, passages, head, tail)
    reference = {mode: fuse(cpu, cpu_prompt, mode, blend) for mode, blend in MODES.items()}
    cpu_tokens, cpu_logits = greedy(cpu, reference["full"], steps, graphed=False)
    for dtype_name, dtype in (("fp32", torch.float32), ("bf16", torch.bfloat16)):
        gpu = runner_on(config, tensors, TARGET, dtype)
        gpu_prompt = prompt(gpu, passages, head, tail)
        fusions = {}
        for mode, blend in MODES.items():
            fused = fusions[mode] = fuse(gpu, gpu_prompt, mode, blend)
            result[f"{dtype_name} {mode} first-token KL"] = kl(reference[mode].last_logits, fused.last_logits)
            result[f"{dtype_name} {mode} max |Δlogit|"] = float(
                (reference[mode].last_logits - fused.last_logits.float().cpu()).abs().max()
            )
            if mode == "blend":
                result[f"{dtype_name} blend recompute share"] = fused.recompute_share
                result["cpu blend recompute share"] = reference[mode].recompute_share
        runs = {graphed: greedy(gpu, fusions["full"], steps, graphed) for graphed in (False, True)}
        for graphed, (got, logits) in runs.items():
            label = f"{dtype_name} decode {'graph' if graphed else 'eager'}"
            result[f"{label} greedy agreement"] = sum(a == b for a, b in zip(got, cpu_tokens)) / steps
            result[f"{label} mean step KL"] = statistics.fmean(kl(a, b) for a, b in zip(cpu_logits, logits))
        fp32_logits = runs[False][1][:4]  # the loaded weights' first eager steps: what each format is held to
        for weights in WEIGHT_FORMATS[1:]:
            quant = runner_on(config, tensors, TARGET, dtype, weights)
            q_logits = greedy(quant, fuse(quant, gpu_prompt, "full"), 4, graphed=True)[1]
            result[f"{dtype_name} weights {weights} step KL vs fp32"] = statistics.fmean(
                kl(a, b) for a, b in zip(fp32_logits, q_logits)
            )
        del gpu
        empty_cache()
    return result


def synchronize() -> None:
    if TARGET == "cuda":
        torch.cuda.synchronize()


def empty_cache() -> None:
    if TARGET == "cuda":
        torch.cuda.empty_cache()


def cuda_time(fn, repeat: int) -> float:
    """Median seconds of `fn()` over `repeat` runs after one warm-up, synchronised around each."""
    fn()
    synchronize()
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        synchronize()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def timings(config: ModelConfig, dtypes: tuple[str, ...] = ("bf16", "fp32")) -> dict:
    """TTFT of each mode and decode steps on SmolLM2's shape, ~3,000 tokens, per dtype and weight format."""
    tensors = random_weights(
        config, seed=2, device=TARGET, dtype=torch.bfloat16 if dtypes == ("bf16",) else torch.float32
    )
    passages = [tokens(PASSAGE, config.vocab_size, 20 + i) for i in range(6)]
    head, tail = tokens(40, config.vocab_size, 4), tokens(60, config.vocab_size, 5)
    rows: dict = {}
    for dtype_name, dtype in (("bf16", torch.bfloat16), ("fp32", torch.float32)):
        if dtype_name not in dtypes:
            continue
        for weights in WEIGHT_FORMATS:
            if dtype_name == "fp32" and weights != "fp32":
                continue
            runner = runner_on(config, tensors, TARGET, dtype, weights)
            segs = prompt(runner, passages, head, tail)
            row: dict = {
                "context_tokens": sum(len(s.token_ids) for s in segs),
                "fused kernel layers": fused_layers(runner),
            }
            with torch.inference_mode():
                if weights == "fp32":
                    for mode, blend in MODES.items():
                        row[f"TTFT {mode} ms"] = 1000 * cuda_time(lambda: fuse(runner, segs, mode, blend), 5)
                fused = fuse(runner, segs, "full")
                token = int(fused.last_logits.argmax())
                for graphed in (False, True):
                    state = DecodeState(runner, fused, 200, graphed=graphed)
                    row[f"batch-1 step {'graph' if graphed else 'eager'} ms"] = 1000 * cuda_time(
                        lambda: decode_step(runner, [state], [token]), 60
                    )
                states = [DecodeState(runner, fused, 40, graphed=False) for _ in range(8)]  # one eager pass
                row["batch-8 step ms"] = 1000 * cuda_time(lambda: decode_step(runner, states, [token] * 8), 20)
            rows[f"{dtype_name} compute, {weights} weights"] = row
            del runner, segs, fused
            empty_cache()
    return rows


def streaming(config: ModelConfig, workdir: Path) -> dict:
    """Blend and reuse fused from KV streamed off a real archive on disk (ArchiveFeed: its CUDA copy stream,
    built ahead and on demand) against the same fusion from memory: the logits must be equal bit for bit."""
    from kvblend.archive import Archive, SegmentRecord
    from kvblend.feeds.archive import ArchiveFeed
    from kvblend.fusion import feed_schedule, plan_prompt
    from kvblend.model.prefill import precompute_kv, storage_dtype

    runner = runner_on(config, random_weights(config, seed=3), TARGET, torch.bfloat16)
    chunks = [tokens(PASSAGE, config.vocab_size, 30 + i) for i in range(6)]
    kvs = precompute_kv(runner, chunks)
    segs = [Segment(tokens(40, config.vocab_size, 6), key="head")]
    segs += [Segment(c, kv=kv, key=f"chunk{i}") for i, (c, kv) in enumerate(zip(chunks, kvs))]
    segs.append(Segment(tokens(60, config.vocab_size, 7), key="question"))
    archive = Archive.open(workdir / "archive", create=True, model_name="random", model_fingerprint="random")
    dtype = str(storage_dtype(runner)).replace("torch.", "")
    with archive.writer():
        archive.put_segments(
            [
                (
                    SegmentRecord(
                        key=s.key,
                        n_tokens=len(s.token_ids),
                        token_ids=s.token_ids,
                        dtype=dtype,
                        n_layers=runner.n_layers,
                        kv_heads=runner.n_kv_heads,
                        head_dim=runner.head_dim,
                    ),
                    s.kv,
                )
                for s in segs
                if s.kv is not None
            ]
        )
    records = {s.key: archive.get_segment(s.key) for s in segs if s.kv is not None}
    streamed = [Segment(s.token_ids, cached=s.kv is not None, key=s.key) for s in segs]
    out: dict = {}
    for mode, blend in (("blend", BlendConfig.single(0.15)), ("reuse", BlendConfig())):
        local = fuse(runner, segs, mode, blend)
        plan = plan_prompt(segs, mode)
        schedule = feed_schedule(segs, plan, mode, blend, runner.n_layers)
        for overlap in (True, False):

            def run():
                with ArchiveFeed(runner, archive, streamed, records, plan.offsets, schedule, overlap=overlap) as feed:
                    return fuse(runner, streamed, mode, blend, feed=feed)

            remote = run()
            label = f"{mode} streamed ({'built ahead' if overlap else 'on demand'})"
            out[f"{label} equals in-memory"] = bool(torch.equal(local.last_logits, remote.last_logits))
            out[f"{label} TTFT ms"] = 1000 * cuda_time(run, 3)
        out[f"{mode} in-memory TTFT ms"] = 1000 * cuda_time(lambda: fuse(runner, segs, mode, blend), 3)
    archive.close()
    return out


def write_inputs(folder: Path) -> None:
    """Here, before a lease: the bundled model's config and tokenizer (folder/smol), every family's tiny
    test config (folder/tiny) and Gemma 3 270M's config (folder/shapes, for `--shape-configs`), which the GPU
    machine cannot make (it has neither the models nor our pins)."""
    import shutil

    sys.path.insert(0, str(ROOT / "tests"))
    from support import ARCHS, tiny_config

    from kvblend.model import load_model

    from kvblend.model.loading import cached_conversion

    runner = load_model(None, "cpu")  # converts the GGUF into the model cache if it is not there yet
    converted = cached_conversion(runner.name, runner.fingerprint)
    assert converted is not None, "the bundled GGUF's conversion is not in the model cache"
    (folder / "smol").mkdir(parents=True, exist_ok=True)
    (folder / "tiny").mkdir(parents=True, exist_ok=True)
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json"):
        shutil.copy(converted / name, folder / "smol" / name)
    for arch in ARCHS:
        (folder / "tiny" / f"{arch}.json").write_text(json.dumps(tiny_config(arch).to_dict()))
    gemma = load_model("gemma3-270m", "cpu")
    gemma_converted = cached_conversion(gemma.name, gemma.fingerprint)
    assert gemma_converted is not None, "Gemma 3 270M's conversion is not in the model cache"
    (folder / "shapes").mkdir(parents=True, exist_ok=True)
    shutil.copy(gemma_converted / "config.json", folder / "shapes" / "gemma3-270m.json")


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser()
    if argv is None and sys.argv[1:2] == ["--write-inputs"]:
        write_inputs(Path(sys.argv[2]) if len(sys.argv) > 2 else ROOT / ".gpu")
        return {}
    parser.add_argument("--config", type=Path, required=True, help="SmolLM2's config.json (the timed shape)")
    parser.add_argument("--tiny-configs", type=Path, required=True, help="folder of tiny <arch>.json configs")
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--dry-run", action="store_true", help="no GPU: run every step on the CPU (trying the script)")
    parser.add_argument("--skip-timings", action="store_true")
    parser.add_argument("--skip-parity", action="store_true")
    parser.add_argument("--skip-streaming", action="store_true")
    parser.add_argument("--shapes", default="", help="also time these larger shapes in bf16 (1b,3b)")
    parser.add_argument("--profile", action="store_true", help="profile one blend fusion of the timed prompt")
    parser.add_argument("--sdpa", action="store_true", help="time fresh and seen shapes with cuDNN's SDPA on and off")
    parser.add_argument("--skip-smol-timings", action="store_true")
    parser.add_argument("--batch", action="store_true", help="batched eager step against graphs in turn, k = 1..16")
    parser.add_argument("--capture", action="store_true", help="capture a graph while a loader thread copies KV")
    parser.add_argument("--model", help="also check a real checkpoint (a GGUF or HF folder) on the bundled documents")
    parser.add_argument(
        "--shape-configs",
        default="",
        help="config.json files of other real models (comma-separated): parity and timings at that exact shape, "
        "random weights (Gemma 3 270M's: a 512-token window inside the prompt, 262k vocabulary)",
    )
    args = parser.parse_args(argv)
    global TARGET, PASSAGE
    if args.dry_run:
        TARGET, PASSAGE = "cpu", 40
    elif not torch.cuda.is_available():
        sys.exit("device_check: no CUDA device")
    torch.manual_seed(0)
    report: dict = {
        "gpu": torch.cuda.get_device_properties(0).name if TARGET == "cuda" else "none (dry run)",
        "torch": torch.__version__,
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "parity": [],
        "timings": {},
        "errors": [],
    }
    smol = ModelConfig.from_dict(json.loads(args.config.read_text()))
    jobs = (
        []
        if args.skip_parity
        else [
            (p.stem, ModelConfig.from_dict(json.loads(p.read_text())), (3, 30, 12))
            for p in sorted(args.tiny_configs.glob("*.json"))
        ]
    )
    others = {
        Path(p).stem: ModelConfig.from_dict(json.loads(Path(p).read_text())) for p in args.shape_configs.split(",") if p
    }
    if not args.skip_parity:
        jobs.append(("SmolLM2-135M shape", smol, (4, 200, 12)))
        # six 200-token passages: ~1,230 tokens, so a 512-token window cuts through the prompt
        jobs += [(f"{name} shape", config, (6, 200, 12)) for name, config in others.items()]
    real = None
    if args.model:
        from kvblend.model import load_model

        loaded = load_model(args.model, "cpu")
        text = " ".join(p.read_text() for p in sorted((ROOT / "kvblend" / "data" / "docs").glob("*.md")))
        ids = loaded.tokenize(text)
        real = (
            {k: v.float() for k, v in loaded.model.state_dict().items()},
            [ids[i : i + 200] for i in range(0, 1200, 200)],
        )
        jobs = [(f"{loaded.name} (real weights)", loaded.config, (4, 200, 16)), *jobs]
    for name, config, sizes in jobs:
        try:
            t0 = time.perf_counter()
            row = parity(name, config, sizes, real if "real weights" in name else None)
            row["seconds"] = time.perf_counter() - t0
            report["parity"].append(row)
            print(json.dumps(row), flush=True)
        except Exception as e:  # one family's failure must not hide the others' results
            report["errors"].append(f"parity {name}: {type(e).__name__}: {e}")
            print(report["errors"][-1], flush=True)
        args.out.write_text(json.dumps(report, indent=1))
    import tempfile

    with tempfile.TemporaryDirectory() as workdir:
        try:
            if args.skip_streaming:
                raise LookupError("skipped")
            report["streaming"] = streaming(smol, Path(workdir))
            print(json.dumps(report["streaming"]), flush=True)
        except Exception as e:
            report["errors"].append(f"streaming: {type(e).__name__}: {e}")
    args.out.write_text(json.dumps(report, indent=1))
    try:
        report["timings"] = {} if args.skip_timings or args.skip_smol_timings else timings(smol)
    except Exception as e:
        report["errors"].append(f"timings: {type(e).__name__}: {e}")
    args.out.write_text(json.dumps(report, indent=1))
    for shape in filter(None, args.shapes.split(",")) if not args.skip_timings else ():
        try:
            config = ModelConfig.from_dict({**json.loads(args.config.read_text()), **SHAPES[shape]})
            for name, row in timings(config, ("bf16",)).items():
                report["timings"][f"{shape} shape, {name}"] = row
        except Exception as e:
            report["errors"].append(f"timings {shape}: {type(e).__name__}: {e}")
        args.out.write_text(json.dumps(report, indent=1))
        empty_cache()
    for name, config in others.items() if not args.skip_timings else ():
        try:
            for row_name, row in timings(config).items():
                report["timings"][f"{name} shape, {row_name}"] = row
        except Exception as e:
            report["errors"].append(f"timings {name}: {type(e).__name__}: {e}")
        args.out.write_text(json.dumps(report, indent=1))
        empty_cache()
    if args.capture:
        try:
            report["capture"] = capture_beside_a_loader(smol)
            print(json.dumps(report["capture"]), flush=True)
        except Exception as e:
            report["errors"].append(f"capture: {type(e).__name__}: {e}")
        args.out.write_text(json.dumps(report, indent=1))
    if args.batch:
        try:
            report["batch"] = batch_paths(smol)
            for k, v in report["batch"].items():
                print(k, round(v, 3))
        except Exception as e:
            report["errors"].append(f"batch: {type(e).__name__}: {e}")
        args.out.write_text(json.dumps(report, indent=1))
    if args.sdpa:
        try:
            report["sdpa"] = sdpa_backends(smol)
            for shape in filter(None, args.shapes.split(",")):
                config = ModelConfig.from_dict({**json.loads(args.config.read_text()), **SHAPES[shape]})
                report["sdpa"].update({f"{shape} shape, {k}": v for k, v in sdpa_backends(config).items()})
                empty_cache()
            for k, v in report["sdpa"].items():
                print(k, [round(x, 2) for x in v])
        except Exception as e:
            report["errors"].append(f"sdpa: {type(e).__name__}: {e}")
        args.out.write_text(json.dumps(report, indent=1))
    if args.profile:
        report["profile"] = profile_blend(smol)
        print(report["profile"])
        args.out.write_text(json.dumps(report, indent=1))
    for name, row in report["timings"].items():
        print(name, json.dumps({k: round(v, 3) if isinstance(v, float) else v for k, v in row.items()}))
    for err in report["errors"]:
        print("ERROR", err)
    return report


if __name__ == "__main__":
    main()
