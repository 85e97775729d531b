#!/usr/bin/env bash
# The last device call of the 2026-11-30 session (nvidia-h200-x2, ~9 minutes): the GPU tests fixed after the first
# round, then the benchmarks behind BENCHMARKS.md, each bounded. Logs under $OUT.
set -u
O=${OUT:-bench_out}; mkdir -p "$O"; O=$(cd "$O" && pwd)
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
date -u +"%Y-%m-%d %H:%M UTC" > "$O/date.txt"
run() { local limit=$1 log=$2; shift 2; timeout "$limit" "$@" > "$O/$log" 2>&1 || echo "exit $? ($log)" >> "$O/$log"; }
run 120 tests_rerun.txt python3 -m pytest -q -p no:cacheprovider -s tests/gpu/test_multi_gpu.py \
    tests/gpu/test_gpu_fp8_cache.py tests/gpu/test_gpu_backends.py -k "split_model or fp8 or (multi_token_decode and 8-)"
cd scripts
run 40 kernel.txt python3 bench_kernel.py --heads 16 --batch 128 --context 4096 --plan-reps 10 --iters 30 --out "$O"
run 150 grid_eager.txt python3 bench_decode.py --model deepseek-v3-attn --batch 32 1 8 128 \
    --context 4096 1024 16384 32768 --steps 5 --warmup 2 --time-limit 130 --out "$O"
run 90 graphs_target.txt python3 bench_decode.py --graphs --batch 32 --context 4096 --attn flashinfer_mla sdpa eager \
    --steps 10 --time-limit 70 --out "$O" --name decode_graphs_target.json
run 80 generate.txt python3 bench_generate.py --model deepseek-v2-lite --prompt 512 --new 128 --batch 1 --out "$O"
run 90 fp8.txt python3 bench_fp8_cache.py --json "$O/fp8_cache.json"
for f in tests_rerun kernel grid_eager graphs_target generate fp8; do
    echo "== $f"; grep -v "^  \|Loading\|^WARNING\|warn" "$O/$f.txt" | tail -22
done
