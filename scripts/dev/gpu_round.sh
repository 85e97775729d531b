#!/usr/bin/env bash
# The GPU round behind BENCHMARKS.md: the whole GPU suite and the published benchmarks, in modes that each fit one
# device call of at most 10 minutes (each command is bounded by `timeout`; a mode's bound is the sum of its
# commands'). Name several modes to run them one after the other in one call. Run it from the repository root.
#
#   bash scripts/dev/gpu_round.sh suite host   # the whole tests/gpu in SUITE_WORKERS processes (6; each stopped at
#                                              # SUITE_TIMEOUT s, 480: gpu_suite_parallel.py; SUITE_ORDER="--seed 7
#                                              # --reverse": another split and order), then
#                                              # host time per step, layer and attention call (bench_host.py, V3
#                                              # shape, batch 32, 4k), twice; AB=DIR alternates it with the package
#                                              # in DIR/hf_flashinfer_mla (another revision: git archive REV
#                                              # hf_flashinfer_mla | tar x -C DIR), all timed by this bench_host.py;
#                                              # a LoRA on kv_b_proj against none (bench_adapters.py)
#   bash scripts/dev/gpu_round.sh grid kernel  # DeepSeek-V3's attention shape (4 layers): the eager-mode grid, batch
#                                              # 1/8/32/128 x 1k/4k/16k/32k; its batch-1 1k cell three more times;
#                                              # the CUDA-graph cell (batch 32, 4k) against sdpa (bench_decode.py);
#                                              # one layer per backend and cache layout (bench_kernel.py)
#   bash scripts/dev/gpu_round.sh prefill      # one layer's prefill: generate()'s SDPA against fa3's ragged prefill,
#                                              # 4k/16k/32k tokens, batch 1 and a left-padded batch of 4
#   bash scripts/dev/gpu_round.sh generate     # real static-cache generate() (bench_generate.py), the stop condition
#                                              # read a step late and every step: V3 shape 32 x 4k, 64 new tokens,
#                                              # against sdpa; DeepSeek-V2-Lite, 512-token prompts, batch 1 and 8
#   bash scripts/dev/gpu_round.sh depth        # the same 32 x 4k generate() cell at DeepSeek-V3's 61 layers
#   bash scripts/dev/gpu_round.sh serving      # 256 requests at once, DeepSeek-V2-Lite: continuous batching against
#                                              # static generate() batches (bench_serving.py)
#   bash scripts/dev/gpu_round.sh serving-cb   # continuous batching with every step its CUDA graphs take (steps
#                                              # mixing prefill chunks with decodes included), with graphs for
#                                              # all-decode steps only, and Transformers' own (sdpa over its paged
#                                              # MLA cache): serving-cb16 (16 requests, DeepSeek-V2-Lite and the V3
#                                              # shape), serving-cb256 (256 requests, V2-Lite, each mode within
#                                              # CB_LIMIT s; then the decode-only step at 64 x 4k against its
#                                              # bandwidth floor), serving-cb256-v3 (the same on the V3 shape)
#   bash scripts/dev/gpu_round.sh serving-v3   # the same on the V3 attention shape, with the SDPA-prefill A/B
#   bash scripts/dev/gpu_round.sh serving-mixed # DeepSeek-V2-Lite: the mixed-step graphs A/B at 16 requests,
#                                              # Transformers' own on sdpa at 256 within 50 s, then serving-mixed512
#                                              # (the A/B at 256 requests in steps of at most 512 tokens, 60 s each)
#   bash scripts/dev/gpu_round.sh serving-arrivals # the same A/B with 256 requests arriving at ARRIVAL_RATE per
#                                              # second (8): steps of a few prefill tokens beside many decodes,
#                                              # each mode within ARRIVAL_LIMIT s (180)
#   bash scripts/dev/gpu_round.sh serving-vs-sdpa # 256 requests at once, flashinfer_mla against Transformers' own on
#                                              # sdpa within VS_LIMIT s (50): requests finished and tokens produced;
#                                              # VS_MODELS="deepseek-v2-lite deepseek-v3-attn" runs both models
#   bash scripts/dev/gpu_round.sh serving-split # where the time of 256 requests at once goes: every step timed, the
#                                              # uncompiled (mixed) steps' GPU-busy time profiled, and the bound on
#                                              # what graphs for them could gain (bench_serving.py --step-split), on
#                                              # SPLIT_MODELS ("deepseek-v2-lite deepseek-v3-attn"), steps of at most
#                                              # SPLIT_TOKENS tokens (Transformers' 8192)
#   bash scripts/dev/gpu_round.sh serving-ab   # 256 requests at once, DeepSeek-V3's attention shape and V2-Lite
#                                              # (AB_MODELS): rows from the block tables with asynchronous batching,
#                                              # without it, and Transformers' read indices without it, each step's
#                                              # wall time split on the generation thread (loop_split.py); each mode
#                                              # within AB_LIMIT s (120)
#   bash scripts/dev/gpu_round.sh step-prep    # host time to prepare one decode step at 16/256 requests x 1k-8k
#                                              # tokens: Transformers' read indices against the block tables
#   bash scripts/dev/gpu_round.sh serving-sparse # DeepSeek-V3.2's attention with its indexer, 64 requests of 4k-32k
#                                              # tokens: continuous batching against generate() on batches of 8
#                                              # (flashinfer_mla and sdpa, prefill in chunks of 256), each within a
#                                              # time limit; SPARSE="REQUESTS MIN MAX NEW LIMIT" sets the load and
#                                              # the limit (64 4096 32768 256 120), SPARSE_MODES the modes,
#                                              # SPARSE_WARM=1 an untimed pass first (--warm-run)
#   bash scripts/dev/gpu_round.sh sparse       # DeepSeek-V3.2's attention with its indexer: the eager-mode grid,
#                                              # batch 1/8/32 x 8k-128k, then 160k at batch 32
#   bash scripts/dev/gpu_round.sh fp8          # the FP8 latent cache against bf16 (bench_fp8_cache.py); FP8 weights
#                                              # in every attention linear (bench_quantized.py)
#   bash scripts/dev/gpu_round.sh tp           # two GPUs (nvidia-h200-x2): the tensor-parallel and device_map tests
#   bash scripts/dev/gpu_round.sh tp-bench     # two GPUs: one GPU vs TP=2 vs a device_map split (bench_tp.py)
#   bash scripts/dev/gpu_round.sh bench        # every one-GPU benchmark mode in turn, for a machine without the
#                                              # 10-minute limit (grid kernel generate depth serving serving-v3
#                                              # sparse fp8)
#
# A round on the device tool, one call per line: `suite host`, `grid kernel`, `generate`, `depth`, then as the
# budget allows `serving`, `serving-cb`, `serving-v3`, `sparse`, `fp8`; `tp` and `tp-bench` on nvidia-h200-x2.
#
# Output: ${OUT:-bench_out}/env.txt (date, GPU, driver, CPU, versions, commit, modes), and per mode a folder with
# <mode>.log (every command, then its output) and the scripts' JSON. PACK=1 packs each mode into gpu_round_<mode>.tgz
# as it ends (the device tool brings back at most 8 files per call, and a call stopped at its limit keeps them).
# COMMIT=<sha> names the revision in env.txt where the tree's .git may not match it (a copied working tree).
#
# Needs a CUDA GPU with the package's dependencies: FlashInfer with the kernels the runs use (fa3/fa2 MLA decode;
# the FP8 latent's and continuous batching's prefill modules, listed by scripts/dev/devkit_modules.py) and
# Transformers, plus the test and bench extras. FlashInfer compiles a kernel on its first use; a GPU machine that
# cannot (no compiler, or no network for Transformers) gets them from a .devkit/ folder in the checkout (below).
set -uo pipefail

ROOT=$(pwd)
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1

# .devkit/kit.tgz (FlashInfer, apache-tvm-ffi and kernels compiled ahead of time, unpacked to /tmp/kit/site) and
# .devkit/wheels/*.whl (Transformers and what it needs beyond the machine's packages, installed to /tmp/site), ahead
# of the tree on PYTHONPATH. Without .devkit/ the machine's own packages run.
devkit() {
  if [ ! -d "$ROOT/.devkit" ]; then
    echo "no .devkit/: the installed FlashInfer and Transformers run"
    export PYTHONPATH=$ROOT${PYTHONPATH:+:$PYTHONPATH}
    return 0
  fi
  if [ -f "$ROOT/.devkit/kit.tgz" ] && [ ! -d /tmp/kit/site ]; then
    mkdir -p /tmp/kit && tar xzf "$ROOT/.devkit/kit.tgz" -C /tmp/kit || return 1
  fi
  if compgen -G "$ROOT/.devkit/wheels/*.whl" > /dev/null && [ ! -d /tmp/site ]; then
    python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site "$ROOT"/.devkit/wheels/*.whl \
      || return 1
  fi
  export PYTHONPATH=/tmp/kit/site:/tmp/site:$ROOT${PYTHONPATH:+:$PYTHONPATH}
}

usage() { sed -n '2,/^set -uo/p' "$0" | sed '$d' | sed 's/^# \{0,1\}//'; }

MODES="suite host grid kernel prefill generate depth serving serving-cb serving-cb16 serving-cb256 serving-cb256-v3"
MODES="$MODES serving-mixed serving-mixed512 serving-arrivals serving-vs-sdpa serving-split serving-ab step-prep"
MODES="$MODES serving-v3 serving-sparse sparse fp8 tp tp-bench bench"
if [ $# -eq 0 ] || [ "$1" = -h ] || [ "$1" = --help ]; then usage; exit $(( $# == 0 ? 2 : 0 )); fi
for m in "$@"; do
  case " $MODES " in *" $m "*) ;; *) echo "gpu_round.sh: unknown mode '$m' (modes: $MODES)" >&2; exit 2 ;; esac
done
set -- $(for m in "$@"; do [ "$m" = bench ] && echo grid kernel generate depth serving serving-v3 sparse fp8 \
  || echo "$m"; done)

O=${OUT:-bench_out}; mkdir -p "$O"; O=$(cd "$O" && pwd)
devkit || { echo "gpu_round.sh: the devkit could not be set up" >&2; exit 1; }
{ date -u +"%Y-%m-%d %H:%M UTC"
  nvidia-smi --query-gpu=name,driver_version --format=csv,noheader 2>&1
  lscpu 2>/dev/null | grep -E "^Model name|^CPU\(s\)"
  python3 -c "import torch, transformers, flashinfer; print('torch', torch.__version__, '| transformers',
    transformers.__version__, '| flashinfer', flashinfer.__version__)" 2>&1
  echo "commit ${COMMIT:-$(git -C "$ROOT" rev-parse --short HEAD 2>/dev/null || echo unknown)}"
  echo "modes $*"; } >> "$O/env.txt"
cat "$O/env.txt"

FAILED=0
# run SECONDS COMMAND...: COMMAND under `timeout`, appended to the mode's log after a line naming it.
run() {
  local limit=$1; shift
  echo "## $*" >> "$D/$MODE.log"
  timeout "$limit" "$@" >> "$D/$MODE.log" 2>&1
  local rc=$?
  if [ $rc -ne 0 ]; then echo "exit $rc" >> "$D/$MODE.log"; FAILED=1; fi
}
# The log's tables and verdicts, without progress lines and warnings.
show() { echo "== $MODE"; grep -v "^  \|Loading\|[Ww]arn" "$D/$MODE.log" | tail -"${1:-40}"; }

mode_suite() {
  local durations
  durations=$(ls "$ROOT"/benchmarks/gpu_suite_durations.json 2>/dev/null)
  run $((${SUITE_TIMEOUT:-480} + 20)) python3 scripts/dev/gpu_suite_parallel.py --workers "${SUITE_WORKERS:-6}" \
    --timeout "${SUITE_TIMEOUT:-480}" ${SUITE_ORDER:-} \
    ${durations:+--durations "$durations"} --out "$D"
  show 12
}

mode_host() {
  local order="this this" i=0 v pp want got
  [ -n "${AB:-}" ] && order="ab this ab this"
  for v in $order; do
    i=$((i + 1)) pp=$PYTHONPATH want=$ROOT/hf_flashinfer_mla
    if [ "$v" = ab ]; then pp=$(cd "$AB" && pwd):$PYTHONPATH; want=$(cd "$AB" && pwd)/hf_flashinfer_mla; fi
    # (from $D: `python3 -c` puts the working directory first on sys.path, which would find this tree's package)
    got=$(cd "$D" && PYTHONPATH=$pp python3 -c "import os, hf_flashinfer_mla as m; print(os.path.dirname(m.__file__))" \
      2>&1)
    echo "## run $i ($v) imports $got" >> "$D/$MODE.log"
    # (an A/B whose other package is missing would time this package twice under two names)
    if [ "$got" != "$want" ]; then echo "skipped: expected $want" >> "$D/$MODE.log"; FAILED=1; continue; fi
    PYTHONPATH=$pp run 60 python3 scripts/bench_host.py --model deepseek-v3-attn --batch 32 --context 4096 \
      --attn flashinfer_mla --steps 10 --out "$D" --name "host_${i}_$v.json"
  done
  run 120 python3 scripts/bench_adapters.py --model deepseek-v3-attn --batch 32 --context 4096 --rank 16 --out "$D"
  show 40
}

mode_grid() {
  run 230 python3 scripts/bench_decode.py --model deepseek-v3-attn --batch 1 8 32 128 \
    --context 1024 4096 16384 32768 --steps 6 --warmup 2 --time-limit 200 --out "$D" --name decode_eager.json
  run 60 python3 scripts/bench_decode.py --model deepseek-v3-attn --batch 1 --context 1024 1024 1024 --steps 10 \
    --warmup 3 --no-floor --out "$D" --name decode_b1_1k.json
  run 100 python3 scripts/bench_decode.py --graphs --batch 32 --context 4096 --attn flashinfer_mla sdpa \
    --steps 10 --time-limit 80 --out "$D" --name decode_graphs_target.json
  show 60
}

mode_kernel() {
  run 75 python3 scripts/bench_kernel.py --heads 16 128 --batch 128 --context 4096 --plan-reps 10 --iters 50 \
    --out "$D" --name kernel.json
  show 30
}

mode_prefill() {
  run 150 python3 scripts/bench_prefill.py --heads 16 128 --lengths 4096 16384 32768 --out "$D" --name prefill.json
  run 120 python3 scripts/bench_prefill.py --heads 16 128 --lengths 4096 16384 --batch 4 --pad 1024 --out "$D" \
    --name prefill_padded.json
  show 30
}

mode_generate() {
  run 280 python3 scripts/bench_generate.py --model deepseek-v3-attn --static --prompt 4096 --new 64 --batch 32 \
    --attn sdpa flashinfer_mla --stop-check every late --repeats 2 --out "$D" --name generate_v3_static.json
  run 240 python3 scripts/bench_generate.py --model deepseek-v2-lite --static --prompt 512 --new 64 --batch 1 8 \
    --attn sdpa flashinfer_mla --stop-check every late --repeats 2 --out "$D" --name generate_v2lite_static.json
  show 30
}

mode_depth() {
  run 540 python3 scripts/bench_generate.py --model deepseek-v3-attn --layers 61 --static --prompt 4096 --new 64 \
    --batch 32 --attn flashinfer_mla --stop-check every late --repeats 1 --out "$D" \
    --name generate_v3_61_layers_static.json
  show 12
}

mode_serving() {
  run 540 python3 scripts/bench_serving.py --model deepseek-v2-lite --no-progress --out "$D"
  show 20
}

mode_serving_cb() {
  mode_serving_cb16
  mode_serving_cb256
  mode_serving_cb256_v3
}

# Continuous batching with and without CUDA graphs against Transformers' own on sdpa, one process per model and load.
mode_serving_cb16() {
  local m
  for m in deepseek-v2-lite deepseek-v3-attn; do
    run 120 python3 scripts/bench_serving.py --model $m --requests 16 --no-progress --out "$D" \
      --modes cb-flashinfer_mla cb-flashinfer_mla-decode-graphs cb-sdpa --name "serving_cb_${m}_16.json"
  done
  show 40
}

# 256 requests: flashinfer_mla with every step its graphs take (mixed steps included), with graphs for all-decode
# steps only, and Transformers' own on sdpa, each within one time limit (CB_LIMIT seconds; the requests finished and
# the tokens produced by then); then the decode-only step at 64 requests x 4k in CUDA graphs against its bandwidth
# floor. serving-cb256-v3: the same requests on the V3 attention shape.
mode_serving_cb256() {
  local limit=${CB_LIMIT:-170}
  run $((limit + 220)) python3 scripts/bench_serving.py --model deepseek-v2-lite --no-progress --out "$D" \
    --modes cb-flashinfer_mla cb-flashinfer_mla-decode-graphs cb-sdpa --time-limit "$limit" \
    --name serving_cb_deepseek-v2-lite_256.json
  run 55 python3 scripts/bench_decode.py --graphs --batch 64 --context 4096 --attn flashinfer_mla --steps 10 \
    --time-limit 40 --out "$D" --name decode_graphs_b64_4k.json
  show 40
}

mode_serving_cb256_v3() {
  local limit=${CB_LIMIT:-100}
  run $((limit + 150)) python3 scripts/bench_serving.py --model deepseek-v3-attn --no-progress --out "$D" \
    --modes cb-flashinfer_mla cb-flashinfer_mla-decode-graphs cb-sdpa --time-limit "$limit" \
    --name serving_cb_deepseek-v3-attn_256.json
  show 40
}

# Mixed-step graphs where steps mix: DeepSeek-V2-Lite at 16 requests, and at 256 with steps of at most 512 tokens
# (prefill chunks beside many decodes), each A/B in one process; Transformers' own on sdpa at 256 within 50 s.
mode_serving_mixed() {
  run 100 python3 scripts/bench_serving.py --model deepseek-v2-lite --requests 16 --no-progress --out "$D" \
    --modes cb-flashinfer_mla cb-flashinfer_mla-decode-graphs --name serving_cb_deepseek-v2-lite_16.json
  run 150 python3 scripts/bench_serving.py --model deepseek-v2-lite --no-progress --out "$D" --modes cb-sdpa \
    --time-limit 50 --name serving_cb_deepseek-v2-lite_256_sdpa.json
  mode_serving_mixed512
}

mode_serving_mixed512() {
  run 300 python3 scripts/bench_serving.py --model deepseek-v2-lite --cb-max-batch-tokens 512 --no-progress \
    --out "$D" --modes cb-flashinfer_mla cb-flashinfer_mla-decode-graphs --time-limit 60 \
    --name serving_cb_deepseek-v2-lite_256_tokens512.json
  show 40
}

# 256 requests at once within one time limit (VS_LIMIT seconds, 50): flashinfer_mla (every step its graphs take)
# against Transformers' own on sdpa, the requests finished and the tokens produced by then, in one process per model
# (VS_MODELS, DeepSeek-V2-Lite by default).
mode_serving_vs_sdpa() {
  local m limit=${VS_LIMIT:-50}
  for m in ${VS_MODELS:-deepseek-v2-lite}; do
    run $((2 * limit + 90)) python3 scripts/bench_serving.py --model "$m" --no-progress --out "$D" \
      --modes cb-flashinfer_mla cb-sdpa --time-limit "$limit" --name "serving_cb_${m}_256_vs_sdpa.json"
  done
  show 30
}

# Mixed-step graphs where requests arrive over time (a Poisson process of ARRIVAL_RATE per second, 8 by default):
# DeepSeek-V2-Lite, 256 requests, every step its graphs take against all-decode steps only.
mode_serving_arrivals() {
  run $((2 * ${ARRIVAL_LIMIT:-180} + 60)) python3 scripts/bench_serving.py --model deepseek-v2-lite \
    --request-rate "${ARRIVAL_RATE:-8}" \
    --no-progress --out "$D" --modes cb-flashinfer_mla cb-flashinfer_mla-decode-graphs \
    --time-limit "${ARRIVAL_LIMIT:-180}" \
    --name serving_cb_deepseek-v2-lite_256_arrivals.json
  show 40
}

mode_serving_split() {
  local m tokens=${SPLIT_TOKENS:+--cb-max-batch-tokens $SPLIT_TOKENS}
  for m in ${SPLIT_MODELS:-deepseek-v2-lite deepseek-v3-attn}; do
    run 240 python3 scripts/bench_serving.py --model "$m" $tokens --no-progress --out "$D" \
      --modes cb-flashinfer_mla-decode-graphs --step-split --name "serving_cb_${m}_256_split${SPLIT_TOKENS:-}.json"
  done
  grep -v "Loading\|[Ww]arn" "$D/$MODE.log" | tail -40
}

# 256 requests at once (prompts of 128-4,096 tokens, 256 new): the default path (rows from the block tables,
# asynchronous batching) against the same without asynchronous batching and against Transformers' token-by-token read
# indices without it, each step's wall time split on the generation thread (--loop-split); AB_MODELS, AB_MODES,
# AB_LIMIT (s).
mode_serving_ab() {
  local m
  for m in ${AB_MODELS:-deepseek-v3-attn deepseek-v2-lite}; do
    run $((3 * ${AB_LIMIT:-120} + 120)) python3 scripts/bench_serving.py --model "$m" --no-progress --out "$D" \
      --modes ${AB_MODES:-cb-flashinfer_mla cb-flashinfer_mla-sync cb-flashinfer_mla-token-indices} --loop-split \
      --time-limit "${AB_LIMIT:-120}" --name "serving_cb_${m}_256_ab.json"
  done
  show 40
}

# Host time to prepare one decode step, Transformers' read indices against the block tables (no model runs).
mode_step_prep() {
  run 240 python3 scripts/bench_step_prep.py --device cuda --out "$D"
  show 16
}

mode_serving_v3() {
  run 540 python3 scripts/bench_serving.py --model deepseek-v3-attn --no-progress --out "$D" \
    --modes cb-flashinfer_mla cb-sdpa cb-flashinfer_mla-sdpa-prefill generate-flashinfer_mla generate-sdpa
  show 20
}

# One process per mode (a mode that runs out of memory or past its bound leaves the others' figures).
mode_serving_sparse() {
  local m load
  # requests, shortest and longest prompt, new tokens, each mode's time limit (the requests finished and the tokens
  # produced by then); each process is bounded at the limit plus 70 s (building the model, a prefill in flight)
  read -r -a load <<< "${SPARSE:-64 4096 32768 256 120}"
  for m in ${SPARSE_MODES:-cb-flashinfer_mla generate-flashinfer_mla generate-sdpa}; do
    run $((load[4] + 70)) python3 scripts/bench_serving.py --model deepseek-v32-attn --requests "${load[0]}" \
      --prompt-min "${load[1]}" --prompt-max "${load[2]}" --new "${load[3]}" --static-batch 8 --prefill-chunk 256 \
      --cb-max-batch-tokens 4096 --time-limit "${load[4]}" --no-progress --out "$D" --modes "$m" \
      ${SPARSE_WARM:+--warm-run} --name "serving_v32_$m.json"
  done
  show 40
}

mode_sparse() {
  run 330 python3 scripts/bench_decode.py --model deepseek-v32-attn --batch 1 8 32 \
    --context 8192 32768 65536 131072 --steps 5 --warmup 2 --time-limit 260 --out "$D" --name decode_v32.json
  run 60 python3 scripts/bench_decode.py --model deepseek-v32-attn --batch 32 --context 163840 \
    --attn flashinfer_mla --steps 3 --warmup 1 --no-floor --out "$D" --name decode_v32_longest.json
  show 40
}

mode_fp8() {
  run 400 python3 scripts/bench_fp8_cache.py --json "$D/fp8_cache.json"
  run 120 python3 scripts/bench_quantized.py --batch 32 --context 4096 --json "$D/quantized_fp8_weights.json"
  show 40
}

mode_tp() {
  run 540 python3 -m pytest -q -p no:cacheprovider -s tests/gpu/test_tensor_parallel.py tests/gpu/test_multi_gpu.py
  show 40
}

mode_tp_bench() {
  run 540 python3 scripts/bench_tp.py --out "$D"
  show 40
}

for MODE in "$@"; do
  D=$O/$MODE; mkdir -p "$D"
  "mode_${MODE//-/_}"
  # Each mode packed as it ends: a call stopped at its limit still brings back the modes it finished.
  if [ "${PACK:-0}" = 1 ]; then
    (cd "$O" && tar czf "gpu_round_$MODE.tgz" "$MODE" && rm -rf "$MODE") && echo "packed $O/gpu_round_$MODE.tgz"
  fi
done
exit $FAILED
