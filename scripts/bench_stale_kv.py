"""Where a model's stale KV is wrong, and how much recomputing a token repairs it (issue 32, Gemma 3).

CacheBlend's premise is that a chunk prefilled alone has KV close to its KV in the prompt for
most tokens, so recomputing the few that deviate most recovers full's answer. This script
tests the premise per model, in memory (passages prefilled after the instruction prefix, as
`ingest --sink prefix` archives them), on the first records of musique_dev:

1. *Oracle patching.* `reuse` runs with full's exact KV patched into the cached passages for
   one group of layers or tokens at a time, everything else stale. The first-token KL from
   full that remains says where the error that matters lives: local vs global layers, the
   three thirds of the depth, the last 512 tokens before the question vs the rest.
2. *Repair by recomputation.* Blend at the default setting; per layer, the relative error
   ‖V − V_full‖ / ‖V_full‖ of the selected tokens before (stale) and after recomputation, and
   of the tokens left stale.

    .venv/bin/python scripts/bench_stale_kv.py --model gemma3-270m --limit 3
    .venv/bin/python scripts/bench_stale_kv.py --limit 3          # the default model
"""

from __future__ import annotations

import argparse
import statistics
import sys
from collections.abc import Callable
from datetime import datetime, timezone

import torch

sys.path.insert(0, __file__.rsplit("/", 1)[0])
from benchlib import SHARED_DATA, command_line, machine, write_result  # noqa: E402

from kvblend.defaults import DEFAULT_RATIO  # noqa: E402
from kvblend.evaluation.harness import RecordRunner, blend_config  # noqa: E402
from kvblend.evaluation.metrics import kl_divergence  # noqa: E402
from kvblend.evaluation.records import DEFAULT_CHUNKS, load_records  # noqa: E402
from kvblend.evaluation.specs import RunSpec  # noqa: E402
from kvblend.fusion import fuse, plan_prompt  # noqa: E402
from kvblend.model import load_model  # noqa: E402
from kvblend.prompt import MUSIQUE_TEMPLATE, assemble_prompt  # noqa: E402
from kvblend.types import Segment  # noqa: E402

TAIL = 512  # Gemma 3's window: the tokens the answer's first step sees in a local layer
Patch = Callable[[int, torch.Tensor], torch.Tensor]  # (layer, prompt positions) → bool: take full's KV


def patch_cases(runner, T: int) -> dict[str, Patch]:
    """Name → which (layer, position) pairs get full's exact KV."""
    n = runner.n_layers
    global_layers = [runner.config.window(layer) is None for layer in range(n)]
    third = [range(0, n // 3), range(n // 3, 2 * n // 3), range(2 * n // 3, n)]

    def layers(keep: Callable[[int], bool]) -> Patch:
        return lambda layer, p: torch.full_like(p, keep(layer), dtype=torch.bool)

    cases: dict[str, Patch] = {"none (reuse)": layers(lambda layer: False)}
    if any(global_layers) and not all(global_layers):
        cases["global layers"] = layers(lambda layer: global_layers[layer])
        cases["local layers"] = layers(lambda layer: not global_layers[layer])
    for r in third:
        cases[f"layers {r.start}-{r.stop - 1}"] = layers(lambda layer, r=r: layer in r)
    cases[f"last {TAIL} tokens"] = lambda layer, p: p >= T - TAIL
    cases[f"tokens before the last {TAIL}"] = lambda layer, p: p < T - TAIL
    return cases


def patched(runner, prompt: list[Segment], offsets: list[int], full_kv, which: Patch) -> list[Segment]:
    """The prompt's segments with full's KV (moved back to each segment's base position) where `which` says."""
    out = []
    for seg, off in zip(prompt, offsets):
        if seg.kv is None:
            out.append(seg)
            continue
        n_tok, delta = len(seg.token_ids), off - seg.base_position
        positions = torch.arange(off, off + n_tok)
        layers = []
        for layer, (k, v) in enumerate(seg.kv):
            mask = which(layer, positions)
            if mask.any():
                exact_k = runner.reposition(full_kv[layer][0][0, :, off : off + n_tok].float(), -delta, layer=layer)
                exact_v = full_kv[layer][1][0, :, off : off + n_tok]
                k = torch.where(mask[None, :, None], exact_k.to(k.dtype), k)
                v = torch.where(mask[None, :, None], exact_v.to(v.dtype), v)
            layers.append((k, v))
        out.append(Segment(seg.token_ids, kv=layers, base_position=seg.base_position, key=seg.key))
    return out


def relative_v_error(kv, full_kv, layer: int) -> torch.Tensor:
    """[T] ‖V − V_full‖ / ‖V_full‖ per position (over heads and head dims)."""
    v, ref = kv[layer][1][0].float(), full_kv[layer][1][0].float()
    return (v - ref).norm(dim=(0, 2)) / ref.norm(dim=(0, 2)).clamp_min(1e-12)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default=None)
    ap.add_argument("--data", default=str(SHARED_DATA / "musique_dev.json"))
    ap.add_argument("--limit", type=int, default=3)
    ap.add_argument("--ratio", type=float, default=DEFAULT_RATIO)
    args = ap.parse_args()

    runner = load_model(args.model)
    records = load_records(args.data, args.limit)
    harness = RecordRunner(runner, chunks=DEFAULT_CHUNKS)  # the bench's 6 passages
    blend_spec = RunSpec("blend", ratio=args.ratio, source="memory", sink="shared-prefix")
    cfg = blend_config(blend_spec, runner.n_layers)
    n = runner.n_layers
    probe_layers = sorted({0, n // 3, n // 2, 2 * n // 3, n - 1})
    kls: dict[str, list[float]] = {}
    repair: dict[int, dict[str, list[float]]] = {layer: {} for layer in probe_layers}
    blend_kl: list[float] = []
    for i, record in enumerate(records):
        segments = harness.memory_segments(record, "shared-prefix")
        prompt = assemble_prompt(runner, MUSIQUE_TEMPLATE, record.question, list(segments))
        full = fuse(runner, prompt, "full")
        T = len(full.token_ids)
        plan = plan_prompt(prompt, "reuse")
        for name, which in patch_cases(runner, T).items():
            res = fuse(runner, patched(runner, prompt, plan.offsets, full.kv, which), "reuse")
            kls.setdefault(name, []).append(kl_divergence(full.last_logits, res.last_logits))
        reuse = fuse(runner, prompt, "reuse")
        blend = fuse(runner, prompt, "blend", cfg)
        blend_kl.append(kl_divergence(full.last_logits, blend.last_logits))
        selected = torch.zeros(T, dtype=torch.bool)
        selected[blend.selected] = True
        cached = plan.cached_mask
        for layer in probe_layers:
            stale, fresh = relative_v_error(reuse.kv, full.kv, layer), relative_v_error(blend.kv, full.kv, layer)
            cell = repair[layer]
            cell.setdefault("selected, stale", []).append(float(stale[selected & cached].mean()))
            cell.setdefault("selected, recomputed", []).append(float(fresh[selected & cached].mean()))
            cell.setdefault("left stale", []).append(float(stale[cached & ~selected].mean()))
        reuse_kl = kls["none (reuse)"][-1]
        print(f"record {i}: T={T}, reuse KL {reuse_kl:.4f}, blend KL {blend_kl[-1]:.4f}", file=sys.stderr)

    mean = statistics.fmean
    reuse_kl = mean(kls["none (reuse)"])
    date = datetime.now(timezone.utc).isoformat(timespec="seconds")
    print(f"`{command_line()}`  \nMachine: {machine()}  \nDate: {date}")
    print(f"Model {runner.name}, musique_dev records 0-{len(records) - 1}, 6 passages each\n")
    print("| full's exact KV patched into | first-token KL | share of reuse's |\n|---|---:|---:|")
    for name, values in kls.items():
        print(f"| {name} | {mean(values):.4f} | {mean(values) / reuse_kl:.2f} |")
    blend_mean = mean(blend_kl)
    print(f"| (blend @ {args.ratio:g}, default policy, for scale) | {blend_mean:.4f} | {blend_mean / reuse_kl:.2f} |")
    print("\n| layer | selected tokens, stale V error | after recomputation | tokens left stale |")
    print("|---:|---:|---:|---:|")
    for layer, cell in repair.items():
        row = " | ".join(f"{mean(cell[k]):.3f}" for k in ("selected, stale", "selected, recomputed", "left stale"))
        print(f"| {layer} | {row} |")
    write_result(
        f"stale-kv-{runner.name}",
        {
            "command": command_line(),
            "machine": machine(),
            "date": date,
            "model": runner.name,
            "records": len(records),
            "patch_kl": kls,
            "blend_kl": blend_kl,
            "repair": {str(k): v for k, v in repair.items()},
        },
    )


if __name__ == "__main__":
    main()
