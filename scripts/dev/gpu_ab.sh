#!/usr/bin/env bash
# A/B on one machine: the package at HEAD against an older copy unpacked in ab_old/ (git archive REV hf_flashinfer_mla
# | tar x -C ab_old), alternating, the same cells; then host profiles and planning pieces of HEAD. ~7 minutes on an
# H200 (9 at most). Logs and JSON under $OUT; ab.txt has the tables.
set -u
O=${OUT:-bench_out}; mkdir -p "$O"; O=$(cd "$O" && pwd)
ROOT=$PWD
{ date -u +"%Y-%m-%d %H:%M UTC"; sha256sum hf_flashinfer_mla/*.py | sha256sum; sha256sum ab_old/hf_flashinfer_mla/*.py | sha256sum;
  nvidia-smi --query-gpu=name,driver_version --format=csv,noheader; lscpu | grep -E "Model name|^CPU\(s\)"; } > "$O/date_ab.txt"
run() { local limit=$1 log=$2; shift 2; timeout "$limit" "$@" >> "$O/$log" 2>&1 || echo "exit $? ($log)" >> "$O/$log"; }
cd scripts
for round in 1 2; do
  for v in old new; do
    pp=$PYTHONPATH; [ $v = old ] && pp=$ROOT/ab_old:$PYTHONPATH
    echo "== $v round $round" >> "$O/ab.txt"
    PYTHONPATH=$pp run 80 ab.txt python3 bench_decode.py --model deepseek-v3-attn --batch 1 32 --context 1024 4096 \
        --attn sdpa flashinfer_mla --steps 10 --warmup 3 --time-limit 60 --no-floor --out "$O" --name decode_${v}_${round}.json
  done
done
run 40 plan_micro.txt python3 dev/plan_micro.py
cd "$ROOT"
run 80 profile.txt python3 scripts/dev/profile_step.py --cells 1x1024 --steps 20 --out "$O" --name profile_eager.txt
run 150 gpu_backends.txt python3 -m pytest -q -x -p no:cacheprovider tests/gpu/test_gpu_backends.py
grep -E "^==|flashinfer_mla:|sdpa:|exit" "$O/ab.txt"; cat "$O/plan_micro.txt"; grep "==" "$O/profile_eager.txt"
tail -3 "$O/gpu_backends.txt"
