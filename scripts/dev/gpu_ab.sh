#!/usr/bin/env bash
# One device call (~8 minutes on an H200, 9.5 at most). First an A/B on one machine: the package at HEAD against an
# older copy unpacked in ab_old/ (git archive REV hf_flashinfer_mla | tar x -C ab_old), alternating, two rounds, the
# same two cells. Then, on HEAD: the issue-11 eager grid, the CUDA-graph target cell, host time per step and layer,
# and the host cost of each piece of a plan. All text goes to ab.txt; JSON under $OUT (the A/B's in ab_json.tgz).
set -u
O=${OUT:-bench_out}; mkdir -p "$O/ab"; O=$(cd "$O" && pwd)
ROOT=$PWD
{ date -u +"%Y-%m-%d %H:%M UTC"; sha256sum hf_flashinfer_mla/*.py | sha256sum; sha256sum ab_old/hf_flashinfer_mla/*.py | sha256sum;
  nvidia-smi --query-gpu=name,driver_version --format=csv,noheader; lscpu | grep -E "Model name|^CPU\(s\)"; } > "$O/date_ab.txt"
run() { local limit=$1; shift; echo "## $*" >> "$O/ab.txt"; timeout "$limit" "$@" >> "$O/ab.txt" 2>&1 || echo "exit $?" >> "$O/ab.txt"; }
cd scripts
for round in 1 2; do
  for v in old new; do
    pp=$PYTHONPATH; [ $v = old ] && pp=$ROOT/ab_old:$PYTHONPATH
    echo "== $v round $round" >> "$O/ab.txt"
    PYTHONPATH=$pp run 45 python3 bench_decode.py --model deepseek-v3-attn --batch 1 32 --context 1024 4096 \
        --attn sdpa flashinfer_mla --steps 20 --warmup 3 --time-limit 30 --no-floor --out "$O/ab" --name decode_${v}_${round}.json
  done
done
(cd "$O" && tar czf ab_json.tgz ab && rm -rf ab)
run 190 python3 bench_decode.py --model deepseek-v3-attn --batch 32 1 8 128 --context 4096 1024 16384 32768 \
    --steps 6 --warmup 2 --time-limit 160 --out "$O"
run 110 python3 bench_decode.py --graphs --batch 32 --context 4096 --attn flashinfer_mla sdpa \
    --steps 10 --time-limit 80 --out "$O" --name decode_graphs_target.json
run 50 python3 bench_host.py --model deepseek-v3-attn --batch 32 --context 4096 --out "$O"
run 40 python3 dev/plan_micro.py
grep -E "^==|^##|flashinfer_mla:|sdpa:|eager:|exit|deepseek|host|plan|ms" "$O/ab.txt" | grep -v "^  \|Loading" | tail -90
