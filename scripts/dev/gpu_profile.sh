#!/usr/bin/env bash
# Host-time profiles of a decode step, eager mode and CUDA graphs (one nvidia-h200 call, ~3 minutes). $OUT gets
# profile_eager.txt, profile_graphs.txt and log.txt.
set -u
O=${OUT:-bench_out}; mkdir -p "$O"; O=$(cd "$O" && pwd)
run() { local limit=$1; shift; timeout "$limit" "$@" >> "$O/log.txt" 2>&1 || echo "exit $?" >> "$O/log.txt"; }
date -u +"%Y-%m-%d %H:%M UTC" > "$O/log.txt"
run 150 python3 scripts/dev/profile_step.py --cells 1x1024 32x4096 --steps 20 --out "$O" --name profile_eager.txt
run 200 python3 scripts/dev/profile_step.py --graphs --cells 32x4096 1x1024 --steps 20 --out "$O" \
    --name profile_graphs.txt
grep -h "==" "$O"/profile_*.txt
