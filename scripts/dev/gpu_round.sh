#!/usr/bin/env bash
# One device call (about 8 minutes on an H200, at most 9.5): every number behind BENCHMARKS.md, logs and JSON
# under $OUT. Expects the devkit bundle (FlashInfer's fa2/fa3 kernels compiled ahead of time) at /tmp/kit/site.
# The GPU tests are a separate call: python -m pytest -q tests/gpu -s (see README).
set -u
O=${OUT:-bench_out}; mkdir -p "$O"; O=$(cd "$O" && pwd)
export PYTHONPATH=/tmp/kit/site:$PWD:${PYTHONPATH:-}
cd scripts
date -u +"%Y-%m-%d %H:%M UTC" > "$O/date.txt"
python3 -c "import torch, transformers, flashinfer; from hf_flashinfer_mla import flashinfer_fa as f; \
print(torch.__version__, transformers.__version__, flashinfer.__version__, torch.cuda.get_device_name(), \
'planner:', 'generated module' if f.uses_generated_module() else 'public wrapper')" > "$O/versions.txt" 2>&1
run() { local limit=$1 log=$2; shift 2; timeout "$limit" python3 "$@" > "$O/$log" 2>&1 || echo "exit $? ($log)" >> "$O/$log"; }

# 1. One layer (H=16 and 128, B=128, 4k): bandwidth per layout (latent = generate()'s) and planning cost.
run 75 kernel.txt bench_kernel.py --heads 16 128 --batch 128 --context 4096 --plan-reps 10 --iters 30 --out "$O"
# 2. The issue-11 grid in eager mode: V3 attention shape, 4 layers, B x ctx, eager / sdpa / flashinfer_mla.
run 190 grid_eager.txt bench_decode.py --model deepseek-v3-attn --batch 32 1 8 128 --context 4096 1024 16384 32768 \
    --steps 6 --warmup 2 --time-limit 160 --out "$O"
# 3. CUDA graphs: the target cell as generate() compiles it (inductor, reduce-overhead; ~1 minute per cell to compile).
run 100 graphs_target.txt bench_decode.py --graphs --batch 32 --context 4096 --attn flashinfer_mla sdpa eager \
    --steps 10 --time-limit 75 --out "$O" --name decode_graphs_target.json
# 4. DeepSeek-V2-Lite, full depth, generate() from a 512-token prompt, 128 new tokens, batch 1.
run 100 generate.txt bench_generate.py --model deepseek-v2-lite --prompt 512 --new 128 --batch 1 --out "$O"
# 5. Host time per step and per layer (V3 shape, 4 layers, B=32, 4k), with profiler tables.
run 45 host.txt bench_host.py --model deepseek-v3-attn --batch 32 --context 4096 --out "$O"

for f in versions kernel grid_eager graphs_target generate host; do
    echo "== $f"; grep -v "^  " "$O/$f.txt" | tail -25
done
