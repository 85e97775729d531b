#!/usr/bin/env bash
# The last device calls of a session, each bounded under 10 minutes; logs and JSON under $OUT.
#   bash scripts/dev/gpu_final.sh tp      # nvidia-h200-x2: tests/gpu/test_tensor_parallel.py, the eager grid, V2-Lite generate()
#   bash scripts/dev/gpu_final.sh last    # nvidia-h200-x2: the TP tests again, one layer, the CUDA-graph target cell
#   bash scripts/dev/gpu_final.sh rest    # one layer per layout, the CUDA-graph target cell, host time per step
# (the rest of tests/gpu: scripts/dev/gpu_tests.sh single)
set -u
O=${OUT:-bench_out}; mkdir -p "$O"; O=$(cd "$O" && pwd)
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
{ date -u +"%Y-%m-%d %H:%M UTC"; sha256sum hf_flashinfer_mla/*.py | sha256sum; } > "$O/date_$1.txt"
run() { local limit=$1 log=$2; shift 2; timeout "$limit" "$@" > "$O/$log" 2>&1 || echo "exit $? ($log)" >> "$O/$log"; }
case "$1" in
  tp)
    run 240 gpu_tests_tp.txt python3 -m pytest -q -p no:cacheprovider tests/gpu/test_tensor_parallel.py -s
    cd scripts
    run 180 grid_eager.txt python3 bench_decode.py --model deepseek-v3-attn --batch 32 1 8 128 \
        --context 4096 1024 16384 32768 --steps 6 --warmup 2 --time-limit 150 --out "$O"
    run 110 generate.txt python3 bench_generate.py --model deepseek-v2-lite --prompt 512 --new 128 --batch 1 --out "$O"
    logs="gpu_tests_tp grid_eager generate" ;;
  last)  # nvidia-h200-x2: the tensor-parallel tests, then one layer per layout and the CUDA-graph target cell
    run 320 gpu_tests_tp.txt python3 -m pytest -q -p no:cacheprovider tests/gpu/test_tensor_parallel.py -s
    cd scripts
    run 45 kernel.txt python3 bench_kernel.py --heads 16 --batch 128 --context 4096 --plan-reps 10 --iters 50 --out "$O"
    run 110 graphs_target.txt python3 bench_decode.py --graphs --batch 32 --context 4096 --attn flashinfer_mla sdpa \
        --steps 10 --time-limit 80 --out "$O" --name decode_graphs_target.json
    logs="gpu_tests_tp kernel graphs_target" ;;
  rest)
    cd scripts
    run 75 kernel.txt python3 bench_kernel.py --heads 16 128 --batch 128 --context 4096 --plan-reps 10 --iters 50 --out "$O"
    run 110 graphs_target.txt python3 bench_decode.py --graphs --batch 32 --context 4096 --attn flashinfer_mla sdpa eager \
        --steps 10 --time-limit 80 --out "$O" --name decode_graphs_target.json
    run 50 host.txt python3 bench_host.py --model deepseek-v3-attn --batch 32 --context 4096 --out "$O"
    logs="kernel graphs_target host" ;;
esac
for f in $logs; do echo "== $f"; grep -v "^  \|Loading\|^WARNING\|warn" "$O/$f.txt" | tail -24; done
