#!/usr/bin/env bash
# One device call on nvidia-h200-x2 (~9 minutes): two lanes side by side, one per GPU, logs under $OUT.
#   lane A (GPU 0): A/B of the package at HEAD against an older copy in ab_old/ (git archive REV hf_flashinfer_mla |
#                   tar x -C ab_old), alternating: eager cells B {1, 32} x ctx {1k, 4k} (two rounds), then CUDA graphs
#                   at B=32 ctx 4k; then host time per step and layer at HEAD (bench_host.py).
#   lane B (GPU 1): HEAD only: the issue-11 eager grid, the CUDA-graph target cell (flashinfer_mla and sdpa),
#                   DeepSeek-V2-Lite generate() at batch 1.
# The two lanes share the host (32 cores): A/B ratios are measured within lane A.
set -u
O=${OUT:-bench_out}; mkdir -p "$O/json"; O=$(cd "$O" && pwd)
ROOT=$PWD
{ date -u +"%Y-%m-%d %H:%M UTC"; sha256sum hf_flashinfer_mla/*.py | sha256sum; sha256sum ab_old/hf_flashinfer_mla/*.py | sha256sum;
  nvidia-smi --query-gpu=name,driver_version --format=csv,noheader; lscpu | grep -E "Model name|^CPU\(s\)"; } > "$O/date_lanes.txt"
run() { local log=$1 limit=$2; shift 2; echo "## $*" >> "$O/$log"; timeout "$limit" "$@" >> "$O/$log" 2>&1 || echo "exit $?" >> "$O/$log"; }
cd scripts
lane_a() {
  export CUDA_VISIBLE_DEVICES=0
  for round in 1 2; do
    for v in old new; do
      pp=$PYTHONPATH; [ $v = old ] && pp=$ROOT/ab_old:$PYTHONPATH
      echo "== $v round $round" >> "$O/lane_a.txt"
      PYTHONPATH=$pp run lane_a.txt 60 python3 bench_decode.py --model deepseek-v3-attn --batch 1 32 --context 1024 4096 \
          --attn sdpa flashinfer_mla --steps 20 --warmup 3 --time-limit 45 --no-floor --out "$O/json" --name ab_${v}_${round}.json
    done
  done
  for v in old new; do
    pp=$PYTHONPATH; [ $v = old ] && pp=$ROOT/ab_old:$PYTHONPATH
    echo "== $v graphs" >> "$O/lane_a.txt"
    PYTHONPATH=$pp run lane_a.txt 110 python3 bench_decode.py --graphs --batch 32 --context 4096 --attn flashinfer_mla \
        --steps 20 --time-limit 90 --out "$O/json" --name ab_graphs_${v}.json
  done
  run lane_a.txt 60 python3 bench_host.py --model deepseek-v3-attn --batch 32 --context 4096 --out "$O/json"
}
lane_b() {
  export CUDA_VISIBLE_DEVICES=1
  run lane_b.txt 200 python3 bench_decode.py --model deepseek-v3-attn --batch 32 1 8 128 --context 4096 1024 16384 32768 \
      --steps 8 --warmup 2 --time-limit 180 --out "$O/json"
  run lane_b.txt 130 python3 bench_decode.py --graphs --batch 32 --context 4096 --attn flashinfer_mla sdpa \
      --steps 10 --time-limit 110 --out "$O/json" --name decode_graphs_target.json
  run lane_b.txt 170 python3 bench_generate.py --model deepseek-v2-lite --prompt 512 --new 128 --batch 1 --out "$O/json"
}
lane_a & lane_b & wait
(cd "$O" && tar czf json.tgz json && rm -rf json)
grep -E "^==|^##|flashinfer_mla:|sdpa:|eager:|exit|Error|host|tok/s" "$O/lane_a.txt" | grep -v "^  \|Loading" | tail -40
grep -E "^##|exit|Error|x floor|speedup|tok/s| B=|attn|flashinfer_mla|sdpa" "$O/lane_b.txt" | grep -v "Loading" | tail -60
