#!/usr/bin/env bash
# The 2026-12-01 device calls (one H200). Expects the devkit bundle unpacked at /tmp/kit/site and, where the host's
# Transformers is older than 5.24, the wheel installed under /tmp/site (see README "Tests and benchmarks"). Logs and
# JSON under $OUT.
#   bash scripts/dev/gpu_session.sh tests   # the whole tests/gpu
#   bash scripts/dev/gpu_session.sh sparse  # tests/gpu/test_gpu_sparse.py, then the DeepSeek-V3.2-shape decode grid
#                                           # (eager, sdpa, flashinfer_mla; batch 1/8/32 x 8k-128k, then 160k at 32)
#   bash scripts/dev/gpu_session.sh serving # tests/gpu/test_gpu_continuous_batching.py, the serving benchmark
#                                           # (DeepSeek-V2-Lite, 256 requests), one CUDA-graph cell of the V3.2 shape
#   bash scripts/dev/gpu_session.sh hostab  # host time per layer, this package against ab_old/ (two rounds, alternated),
#                                           # then the serving benchmark again
#   bash scripts/dev/gpu_session.sh bench   # host time per layer, this package against the revision unpacked in
#                                           # ab_old/ (git archive REV hf_flashinfer_mla scripts) and, where there is
#                                           # one, the revision in ab_mid/ (alternated with this one, both timed by
#                                           # this revision's bench_host.py, the attention function too); the V3 grid
#                                           # (eager mode); the CUDA-graph target cell; DeepSeek-V2-Lite static-cache
#                                           # generate() at batch 1 and 8
#   bash scripts/dev/gpu_session.sh cb      # tests/gpu/test_gpu_continuous_batching.py (ragged prefill included), the
#                                           # serving benchmark on the V3 attention shape (the three modes and the
#                                           # SDPA-prefill A/B), the host-time profile of a CUDA-graph step (32 x 4k)
#   bash scripts/dev/gpu_session.sh cbv2    # the serving benchmark on DeepSeek-V2-Lite: ragged prefill A/B
#   bash scripts/dev/gpu_session.sh round   # the new GPU test of warmed-up static generate(); V2-Lite static
#                                           # generate() at batch 1 and 8; the CUDA-graph target cell; host per layer
#                                           # against ab_old/; four V3-shape eager cells
#   bash scripts/dev/gpu_session.sh replay  # where a CUDA-graph step's time goes (V3 shape, 32 x 4k): kernels per
#                                           # category and the host's segments, flashinfer_mla and sdpa; with
#                                           # REPLAY_PROFILE=1 also a cProfile of the step and the target cell
#   bash scripts/dev/gpu_session.sh grid    # the V3-shape eager grid; its batch-1 1k cell three more times (the
#                                           # cell closest to even); the CUDA-graph target cell
#   bash scripts/dev/gpu_session.sh gen     # V2-Lite static-cache generate() at batch 1 and 8; host per layer
#                                           # against ab_old/ (alternated: old new old new)
#   bash scripts/dev/gpu_session.sh genb    # V2-Lite static-cache generate() at batch 1 and 8 (three repeats); the
#                                           # CUDA-graph target cell
#   bash scripts/dev/gpu_session.sh genab   # V2-Lite static-cache generate() at batch 1 and 8, each cell compiled
#                                           # from a clean slate, sdpa first; then batch 1 flashinfer_mla first
#   bash scripts/dev/gpu_session.sh genlayers # V2-Lite static generate() at batch 1 and 8 (sdpa first); then
#                                           # flashinfer_mla over Transformers' own DynamicLayer (--layout
#                                           # transformers) and over its latent layers, V3 shape, batch 1/32 x 4k/32k
#   bash scripts/dev/gpu_session.sh hostreplay # host per layer against ab_old/ (old, new), then `replay`
#   bash scripts/dev/gpu_session.sh hostfn  # host per layer against ab_old/, both timed by this revision's
#                                           # bench_host.py (the attention function alone too), alternated
#   bash scripts/dev/gpu_session.sh depth   # the CUDA-graph target cell (V3 shape, 32 x 4k) at 16 and 61 layers
#                                           # (DeepSeek-V3's depth, dense layers), flashinfer_mla only; then hostfn
#   bash scripts/dev/gpu_session.sh late    # generate() reading its stop condition a step late against every step
#                                           # (Transformers 5.24+), real generate() calls: V3 shape at 4 layers,
#                                           # 32 x 4k, static (sdpa too); V2-Lite static at batch 1 and 8
#   bash scripts/dev/gpu_session.sh late61  # the same 32 x 4k cell at DeepSeek-V3's depth (61 dense layers)
#   bash scripts/dev/gpu_session.sh rerecord # why static generate() records CUDA graphs again (probe_rerecord.py):
#                                           # V3 shape 32 x 4k (flashinfer_mla, sdpa) and V2-Lite batch 8, with a
#                                           # new cache per call, the cache allocated before the prefill, and one
#                                           # StaticCache kept across calls
#   bash scripts/dev/gpu_session.sh kept    # real generate() with a new static cache per call against one kept
#                                           # across calls (bench_generate --cache new kept): V3 shape 32 x 4k
#                                           # (flashinfer_mla, sdpa), V2-Lite static at batch 1 and 8
set -uo pipefail
O=${OUT:-bench_out}; mkdir -p "$O"; O=$(cd "$O" && pwd)
ROOT=$PWD
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
{ date -u +"%Y-%m-%d %H:%M UTC"; nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
  python3 -c "import torch, transformers, flashinfer; print(torch.__version__, transformers.__version__, flashinfer.__version__)"
  echo "package sha256: $(export LC_ALL=C; cat hf_flashinfer_mla/*.py hf_flashinfer_mla/kernels/*.py | sha256sum | cut -c1-16)"; } > "$O/date_$1.txt" 2>&1
cat "$O/date_$1.txt"
run() { local limit=$1 log=$2; shift 2; echo "## $*" >> "$O/$log"; timeout "$limit" "$@" >> "$O/$log" 2>&1 || echo "exit $?" >> "$O/$log"; }
# Host time per layer, this package against the revision unpacked in ab_old/, in the order given (old*, new*).
# HOST_AB_SCRIPTS=new runs the old package with this revision's bench_host.py too, which also times the attention
# function alone (it wraps whatever function is registered as "flashinfer_mla").
host_ab() {
  local limit=$1 v pp; shift
  for v in "$@"; do
    if [ "${v%2}" = old ]; then
      pp=$ROOT/ab_old:$PYTHONPATH
      if [ "${HOST_AB_SCRIPTS:-old}" = new ]; then cd "$ROOT/scripts"; else cd "$ROOT/ab_old/scripts"; fi
    elif [ "${v%2}" = mid ]; then  # a second revision, in ab_mid/, always timed by this revision's bench_host.py
      cd "$ROOT/scripts"; pp=$ROOT/ab_mid:$PYTHONPATH
    else cd "$ROOT/scripts"; pp=$PYTHONPATH; fi
    # An A/B with the old revision missing would time this package twice under two names (seen 2026-12-04, on a
    # checkout without ab_old/): skip the run and say so.
    local want=$ROOT/hf_flashinfer_mla
    case "$v" in old*) want=$ROOT/ab_old/hf_flashinfer_mla ;; mid*) want=$ROOT/ab_mid/hf_flashinfer_mla ;; esac
    local got; got=$(PYTHONPATH=$pp python3 -c "import hf_flashinfer_mla, os; print(os.path.dirname(hf_flashinfer_mla.__file__))" 2>&1)
    echo "$v: $got" >> "$O/host_ab.txt"
    if [ "$got" != "$want" ]; then
      echo "$v: SKIPPED, imported $got instead of $want (for old/mid: git archive REV hf_flashinfer_mla scripts | tar x -C ${want%/hf_flashinfer_mla})" | tee -a "$O/host_ab.txt"
      continue
    fi
    PYTHONPATH=$pp run "$limit" host_ab.txt python3 bench_host.py --model deepseek-v3-attn --batch 32 --context 4096 \
      --attn flashinfer_mla --steps 10 --out "$O" --name "host_${v}.json"
    echo "== $v" >> "$O/host_ab.txt"
  done
  cd "$ROOT/scripts"
}
case "$1" in
  tests)
    timeout 560 python3 -m pytest -q -p no:cacheprovider tests/gpu -s 2>&1 | tee "$O/gpu_tests.txt" \
      | grep -E "rel|compiles|passed|failed|Error|error" | tail -70 ;;
  sparse)
    timeout 200 python3 -m pytest -q -p no:cacheprovider tests/gpu/test_gpu_sparse.py -s 2>&1 | tee "$O/gpu_sparse_tests.txt" \
      | grep -E "rel|passed|failed|Error|error" | tail -30
    cd "$ROOT/scripts"
    run 330 sparse_grid.txt python3 bench_decode.py --model deepseek-v32-attn --batch 1 8 32 \
        --context 8192 32768 65536 131072 --steps 5 --warmup 2 --time-limit 260 --out "$O" --name decode_v32.json
    run 60 sparse_longest.txt python3 bench_decode.py --model deepseek-v32-attn --batch 32 --context 163840 \
        --attn flashinfer_mla --steps 3 --warmup 1 --no-floor --out "$O" --name decode_v32_longest.json
    for f in sparse_grid sparse_longest; do echo "== $f"; grep -v "^  \|Loading" "$O/$f.txt" | tail -25; done ;;
  serving)
    timeout 140 python3 -m pytest -q -p no:cacheprovider tests/gpu/test_gpu_continuous_batching.py -s 2>&1 \
      | tee "$O/gpu_cb_tests.txt" | grep -E "rel|passed|failed|Error|error" | tail -20
    cd "$ROOT/scripts"
    run 300 serving.txt python3 bench_serving.py --model deepseek-v2-lite --no-progress --out "$O"
    run 100 sparse_graphs.txt python3 bench_decode.py --graphs --model deepseek-v32-attn --batch 1 32 --context 32768 \
        --attn flashinfer_mla --steps 5 --no-floor --time-limit 60 --out "$O" --name decode_v32_graphs.json
    for f in serving sparse_graphs; do echo "== $f"; grep -v "^  \|Loading" "$O/$f.txt" | tail -25; done ;;
  cb)
    timeout 150 python3 -m pytest -q -p no:cacheprovider tests/gpu/test_gpu_continuous_batching.py -s 2>&1 \
      | tee "$O/gpu_cb_tests.txt" | grep -E "rel|passed|failed|Error|error" | tail -20
    cd "$ROOT/scripts"
    run 330 serving_v3.txt python3 bench_serving.py --model deepseek-v3-attn --no-progress --out "$O" \
        --modes cb-flashinfer_mla cb-flashinfer_mla-sdpa-prefill generate-flashinfer_mla generate-sdpa
    run 90 profile_graphs.txt python3 dev/profile_step.py --graphs --cells 32x4096 --attn flashinfer_mla sdpa \
        --out "$O" --name profile_graphs.txt
    for f in serving_v3 profile_graphs; do echo "== $f"; grep -v "^  \|Loading" "$O/$f.txt" | tail -25; done
    grep "^==" "$O/profile_graphs.txt" ;;
  cbv2)
    cd "$ROOT/scripts"
    run 560 serving_v2.txt python3 bench_serving.py --model deepseek-v2-lite --no-progress --out "$O" \
        --modes cb-flashinfer_mla cb-flashinfer_mla-sdpa-prefill
    echo "== serving_v2"; grep -v "^  \|Loading" "$O/serving_v2.txt" | tail -25 ;;
  hostab)
    host_ab 60 old new old2 new2
    run 300 serving.txt python3 bench_serving.py --model deepseek-v2-lite --no-progress --out "$O"
    for f in host_ab serving; do echo "== $f"; grep -v "^  \|Loading" "$O/$f.txt" | tail -40; done ;;
  replay)
    cd "$ROOT/scripts"
    run 200 replay.txt python3 dev/profile_replay.py --cells 32x4096 --attn flashinfer_mla sdpa --steps 20 --top 12 \
        --segments transformers.generation.utils:create_masks_for_generate \
        hf_flashinfer_mla.rows:GrowingMask.take_next hf_flashinfer_mla.plan:StepPlan.make_current \
        hf_flashinfer_mla.plan:StepPlan.load_graph_slots hf_flashinfer_mla.plan:StepPlan.plan_next \
        --out "$O" --name replay.json
    grep -A12 "^== \|categories\|host per step" "$O/replay.txt" | grep -v "^  \|Loading\|warn"
    if [ "${REPLAY_PROFILE:-}" = 1 ]; then  # cProfile of the host's step (torch's compiled call included)
      run 90 profile_graphs.txt python3 dev/profile_step.py --graphs --cells 32x4096 --attn flashinfer_mla \
          --out "$O" --name profile_graphs.txt
      run 100 graphs.txt python3 bench_decode.py --graphs --batch 32 --context 4096 --attn flashinfer_mla sdpa \
          --steps 10 --time-limit 80 --out "$O" --name decode_graphs_target.json
      for f in profile_graphs graphs; do echo "== $f"; grep -v "^  \|Loading\|warn" "$O/$f.txt" | tail -40; done
    fi ;;
  bench)
    if [ -d "$ROOT/ab_mid" ]; then host_ab 50 old mid new mid2 new2; else host_ab 50 old new; fi
    run 170 grid.txt python3 bench_decode.py --model deepseek-v3-attn --batch 1 8 32 128 --context 1024 4096 16384 32768 \
        --steps 6 --warmup 2 --time-limit 140 --out "$O" --name decode_eager.json
    run 100 graphs.txt python3 bench_decode.py --graphs --batch 32 --context 4096 --attn flashinfer_mla sdpa \
        --steps 10 --time-limit 80 --out "$O" --name decode_graphs_target.json
    run 190 generate.txt python3 bench_generate.py --model deepseek-v2-lite --static --prompt 512 --new 64 --batch 1 8 \
        --attn sdpa flashinfer_mla --repeats 3 --out "$O" --name generate_v2lite_static.json
    for f in host_ab grid graphs generate; do echo "== $f"; grep -v "^  \|Loading" "$O/$f.txt" | tail -30; done ;;
  round)
    timeout 110 python3 -m pytest -q -p no:cacheprovider tests/gpu/test_gpu_graphs.py -k records_no -s 2>&1 \
      | tee "$O/gpu_graphs_test.txt" | grep -E "recordings|passed|failed|Error" | tail -8
    cd "$ROOT/scripts"
    run 300 generate.txt python3 bench_generate.py --model deepseek-v2-lite --static --prompt 512 --new 64 --batch 1 8 \
        --attn sdpa flashinfer_mla --repeats 2 --out "$O" --name generate_v2lite_static.json
    run 85 graphs.txt python3 bench_decode.py --graphs --batch 32 --context 4096 --attn flashinfer_mla sdpa \
        --steps 10 --time-limit 70 --out "$O" --name decode_graphs_target.json
    host_ab 45 old new
    run 50 eager.txt python3 bench_decode.py --model deepseek-v3-attn --batch 1 32 --context 1024 4096 --steps 6 \
        --warmup 2 --time-limit 40 --out "$O" --name decode_eager_cells.json
    for f in generate graphs host_ab eager; do echo "== $f"; grep -v "^  \|Loading\|warn" "$O/$f.txt" | tail -22; done ;;
  grid)
    cd "$ROOT/scripts"
    run 230 grid.txt python3 bench_decode.py --model deepseek-v3-attn --batch 1 8 32 128 --context 1024 4096 16384 32768 \
        --steps 6 --warmup 2 --time-limit 200 --out "$O" --name decode_eager.json
    run 60 b1.txt python3 bench_decode.py --model deepseek-v3-attn --batch 1 --context 1024 1024 1024 --steps 10 \
        --warmup 3 --no-floor --out "$O" --name decode_b1_1k.json
    run 100 graphs.txt python3 bench_decode.py --graphs --batch 32 --context 4096 --attn flashinfer_mla sdpa \
        --steps 10 --time-limit 80 --out "$O" --name decode_graphs_target.json
    for f in grid b1 graphs; do echo "== $f"; grep -v "^  \|Loading\|warn" "$O/$f.txt" | tail -26; done ;;
  genb)
    cd "$ROOT/scripts"
    run 420 generate.txt python3 bench_generate.py --model deepseek-v2-lite --static --prompt 512 --new 64 --batch 1 8 \
        --attn sdpa flashinfer_mla --repeats 3 --out "$O" --name generate_v2lite_static.json
    run 100 graphs.txt python3 bench_decode.py --graphs --batch 32 --context 4096 --attn flashinfer_mla sdpa \
        --steps 10 --time-limit 80 --out "$O" --name decode_graphs_target.json
    for f in generate graphs; do echo "== $f"; grep -v "^  \|Loading\|warn" "$O/$f.txt" | tail -22; done ;;
  genab)  # V2-Lite static generate() with each cell compiled from a clean slate, in both orders
    cd "$ROOT/scripts"
    run 300 generate.txt python3 bench_generate.py --model deepseek-v2-lite --static --prompt 512 --new 64 --batch 1 8 \
        --attn sdpa flashinfer_mla --repeats 3 --out "$O" --name generate_v2lite_static_sdpa_first.json
    run 200 generate.txt python3 bench_generate.py --model deepseek-v2-lite --static --prompt 512 --new 64 --batch 1 \
        --attn flashinfer_mla sdpa --repeats 3 --out "$O" --name generate_v2lite_static_fi_first.json
    echo "== generate"; grep -v "^  \|Loading\|warn" "$O/generate.txt" | tail -30 ;;
  genlayers)  # V2-Lite static generate() (sdpa first, each cell from a clean slate); then flashinfer_mla over
              # Transformers' own concatenating layers against the package's latent layers (V3 shape, eager mode)
    cd "$ROOT/scripts"
    run 300 generate.txt python3 bench_generate.py --model deepseek-v2-lite --static --prompt 512 --new 64 --batch 1 8 \
        --attn sdpa flashinfer_mla --repeats 3 --out "$O" --name generate_v2lite_static.json
    for l in transformers auto; do
      run 110 layers.txt python3 bench_decode.py --model deepseek-v3-attn --batch 1 32 --context 4096 32768 \
          --attn flashinfer_mla --layout $l --steps 10 --warmup 2 --time-limit 90 --out "$O" --name layers_$l.json
    done
    for f in generate layers; do echo "== $f"; grep -v "^  \|Loading\|warn" "$O/$f.txt" | tail -30; done ;;
  hostreplay)  # host per layer against ab_old/ (both timed by this revision's bench_host.py), then `replay`
    HOST_AB_SCRIPTS=new host_ab 45 old new
    echo "== host_ab"; grep -v "^  \|Loading\|warn" "$O/host_ab.txt" | tail -30
    (cd "$ROOT" && bash scripts/dev/gpu_session.sh replay) ;;
  hostfn)
    HOST_AB_SCRIPTS=new host_ab 45 old new old2 new2
    echo "== host_ab"; grep -v "^  \|Loading\|warn" "$O/host_ab.txt" | tail -40 ;;
  depth)  # the per-step host time before a replay is fixed; the kernels grow with the depth
    cd "$ROOT/scripts"
    run 100 depth.txt python3 bench_decode.py --graphs --layers 16 --batch 32 --context 4096 --attn flashinfer_mla \
        --steps 10 --out "$O" --name decode_graphs_16_layers.json
    run 330 depth.txt python3 bench_decode.py --graphs --layers 61 --batch 32 --context 4096 --attn flashinfer_mla \
        --steps 10 --out "$O" --name decode_graphs_61_layers.json
    echo "== depth"; grep -v "^  \|Loading\|warn" "$O/depth.txt" | tail -20
    (cd "$ROOT" && bash scripts/dev/gpu_session.sh hostfn) ;;
  gen)
    cd "$ROOT/scripts"
    run 330 generate.txt python3 bench_generate.py --model deepseek-v2-lite --static --prompt 512 --new 64 --batch 1 8 \
        --attn sdpa flashinfer_mla --repeats 2 --out "$O" --name generate_v2lite_static.json
    host_ab 45 old new old2 new2
    for f in generate host_ab; do echo "== $f"; grep -v "^  \|Loading\|warn" "$O/$f.txt" | tail -40; done ;;
  late)
    cd "$ROOT/scripts"
    run 300 late.txt python3 bench_generate.py --model deepseek-v3-attn --static --prompt 4096 --new 64 --batch 32 \
        --attn sdpa flashinfer_mla --stop-check every late --repeats 2 --out "$O" --name generate_v3_static.json
    run 240 late.txt python3 bench_generate.py --model deepseek-v2-lite --static --prompt 512 --new 64 --batch 1 8 \
        --attn sdpa flashinfer_mla --stop-check every late --repeats 2 --out "$O" --name generate_v2lite_static.json
    echo "== late"; grep -v "^  \|Loading\|warn" "$O/late.txt" | tail -40 ;;
  late61)
    cd "$ROOT/scripts"
    run 560 late61.txt python3 bench_generate.py --model deepseek-v3-attn --layers 61 --static --prompt 4096 \
        --new 128 --batch 32 --attn flashinfer_mla --stop-check every late --repeats 1 --out "$O" \
        --name generate_v3_61_layers_static.json
    echo "== late61"; grep -v "^  \|Loading\|warn" "$O/late61.txt" | tail -20 ;;
  kept)
    cd "$ROOT/scripts"
    run 300 kept.txt python3 bench_generate.py --model deepseek-v3-attn --static --prompt 4096 --new 64 --batch 32 \
        --attn sdpa flashinfer_mla --cache new kept --repeats 3 --out "$O" --name generate_v3_static_kept.json
    run 280 kept.txt python3 bench_generate.py --model deepseek-v2-lite --static --prompt 512 --new 64 --batch 1 8 \
        --attn sdpa flashinfer_mla --cache new kept --repeats 3 --out "$O" --name generate_v2lite_static_kept.json
    echo "== kept"; grep -v "^  \|Loading\|warn" "$O/kept.txt" | tail -30 ;;
  rerecord)
    cd "$ROOT/scripts"
    for how in new early-init reuse-cache; do
      flag=; [ "$how" != new ] && flag=--$how
      mkdir -p "$O/v3_$how" "$O/v2_$how"
      timeout 200 python3 dev/probe_rerecord.py --model deepseek-v3-attn --layers 4 --batch 32 --prompt 4096 \
          --new 64 --calls 5 --attn flashinfer_mla sdpa $flag --out "$O/v3_$how" > /dev/null 2>&1
      timeout 130 python3 dev/probe_rerecord.py --model deepseek-v2-lite --batch 8 --prompt 512 --new 64 \
          --calls 5 --attn flashinfer_mla $flag --out "$O/v2_$how" > /dev/null 2>&1
      for d in v3 v2; do  # (the summary only: the whole cudagraph-tree log runs to tens of MB)
        echo "== $d $how"; awk '/^-- full log --/{exit} {print}' "$O/${d}_$how/probe_rerecord.txt" \
          | tee "$O/${d}_$how/probe_rerecord_summary.txt" | grep "^=="
        rm -f "$O/${d}_$how/probe_rerecord.txt"
      done
    done ;;
esac
