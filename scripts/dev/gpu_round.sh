#!/usr/bin/env bash
# One device call: CUDA-graph tests, kernel benchmark, V3 target, CUDA-graph benchmark. Logs under $OUT.
set -u
O=${OUT:-bench_out}; mkdir -p $O
timeout 200 python3 -m pytest -q -p no:logging tests/gpu -s -k "cuda_graphs or graphs_equal" 2>&1 | grep -E "^E |cuda graphs|passed|failed" | head -30 | tee $O/cudagraph_tests.txt
timeout 120 python3 scripts/bench_kernel.py --heads 16 128 --batch 128 --context 4096 --json $O/kernel.json 2>&1 | tail -25 | tee $O/kernel.txt
timeout 150 python3 scripts/bench_decode.py --model deepseek-v3-attn --layers 4 --batch 32 --context 4096 --json $O/v3_b32_c4096.json 2>&1 | tail -12 | tee $O/v3.txt
timeout 150 python3 scripts/bench_cudagraphs.py --json $O/cudagraphs.json 2>&1 | tail -8 | tee $O/cudagraphs.txt
