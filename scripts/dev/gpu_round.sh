#!/usr/bin/env bash
# One device call: GPU tests, then the benchmarks behind the issue-4 targets. Logs under $OUT.
set -u
O=${OUT:-bench_out}; mkdir -p $O
date -u +"%Y-%m-%d %H:%M UTC" | tee $O/date.txt
timeout 240 python3 -m pytest -q -p no:logging tests/gpu -s 2>&1 | grep -E "^E |rel|passed|failed" | tee $O/gpu_tests.txt | tail -45
timeout 90 python3 scripts/bench_kernel.py --heads 16 128 --batch 128 --context 4096 --json $O/kernel.json 2>&1 | tail -16 > $O/kernel.txt
timeout 60 python3 scripts/bench_decode.py --model deepseek-v3-attn --layers 4 --batch 32 --context 4096 --json $O/v3_b32_c4096.json 2>&1 | tail -6 > $O/v3.txt
timeout 90 python3 scripts/bench_cudagraphs.py --json $O/cudagraphs.json 2>&1 | tail -7 > $O/cudagraphs.txt
timeout 150 python3 scripts/bench_decode.py --model deepseek-v2-lite --batch 64 --context 4096 --json $O/v2lite_b64_c4096.json 2>&1 | tail -6 > $O/v2lite.txt
timeout 120 python3 scripts/bench_decode.py --model deepseek-v3-attn --layers 4 --batch 32 --max-context-search --json $O/v3_maxctx.json 2>&1 | tail -12 > $O/maxctx.txt
tail -n +1 $O/kernel.txt $O/v3.txt $O/cudagraphs.txt $O/v2lite.txt $O/maxctx.txt
