#!/usr/bin/env bash
# One device call on nvidia-h200-x2 after the single-GPU suite: the tensor-parallel suite, then FlashInfer 0.7.2.post1's
# run of the CUDA-graph generate() test on HEAD and on the package in ab_old/ side by side (one GPU each, own inductor
# caches), then the CUDA-graph target cell on HEAD, then sdpa_shapes.py. Needs both kits unpacked: /tmp/kit (0.7.4), /tmp/kit722.
set -u
O=${OUT:-bench_out}; mkdir -p "$O"; O=$(cd "$O" && pwd); ROOT=$PWD
{ date -u +"%Y-%m-%d %H:%M UTC"; sha256sum hf_flashinfer_mla/*.py | sha256sum; sha256sum ab_old/hf_flashinfer_mla/*.py | sha256sum; } > "$O/date_final.txt"
PYTHONPATH=/tmp/kit/site:/tmp/site:$ROOT bash scripts/dev/gpu_tests.sh tp | tail -8
T=tests/gpu/test_gpu_backends.py::test_generate_static_cache_graphs_equal_compiled_without_graphs
(CUDA_VISIBLE_DEVICES=0 TORCHINDUCTOR_CACHE_DIR=/tmp/ind_new PYTHONPATH=/tmp/kit722/site:/tmp/site:$ROOT \
   timeout 150 python3 -m pytest -q -p no:cacheprovider -s "$T" > "$O/fi0722_graphs_new.txt" 2>&1) &
(CUDA_VISIBLE_DEVICES=1 TORCHINDUCTOR_CACHE_DIR=/tmp/ind_old PYTHONPATH=/tmp/kit722/site:/tmp/site:$ROOT/ab_old:$ROOT \
   timeout 150 python3 -m pytest -q -p no:cacheprovider -s "$T" > "$O/fi0722_graphs_old.txt" 2>&1) &
wait
grep -hE "rel err|passed|failed" "$O"/fi0722_graphs_*.txt
cd scripts && PYTHONPATH=/tmp/kit/site:/tmp/site:$ROOT timeout 130 python3 bench_decode.py --graphs --batch 32 --context 4096 \
   --attn flashinfer_mla sdpa --steps 20 --time-limit 110 --out "$O" --name decode_graphs_target.json 2>&1 | tail -4
cd "$ROOT" && PYTHONPATH=/tmp/kit/site:/tmp/site:$ROOT timeout 40 python3 scripts/dev/sdpa_shapes.py > "$O/sdpa_shapes.txt" 2>&1
cat "$O/sdpa_shapes.txt"
