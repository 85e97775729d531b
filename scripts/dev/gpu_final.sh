#!/usr/bin/env bash
set -u
O=${OUT:-bench_out}; mkdir -p $O
timeout 100 python3 scripts/dev/profile_step.py > $O/profile.txt 2>&1
timeout 240 python3 scripts/bench_decode.py --model deepseek-v3-attn --layers 4 --batch 1 8 32 128 --context 1024 4096 16384 32768 --steps 6 --warmup 2 --time-limit 220 --json $O/decode_v3attn.json --plot $O/decode_v3attn.png 2>&1 | tail -22 > $O/grid_v3.txt
timeout 150 python3 scripts/bench_decode.py --model glm-4.7-flash --layers 8 --batch 32 --context 4096 --json $O/glm.json 2>&1 | tail -6 > $O/glm.txt
tail -n +1 $O/grid_v3.txt $O/glm.txt; grep -E "Self CPU time total|Self CUDA time total" $O/profile.txt
