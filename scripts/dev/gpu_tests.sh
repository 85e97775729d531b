#!/usr/bin/env bash
# The whole GPU suite in two device calls (each under 10 minutes), after the devkit bundle and the Transformers wheel
# are unpacked (see README "Tests and benchmarks"). Logs under $OUT.
#   bash scripts/dev/gpu_tests.sh single   # every tests/gpu file except tensor parallelism (1 or 2 GPUs): ~5 min on
#                                          # an H200 before test_gpu_graphs.py, whose inductor compiles add (est.) 1-2
#   bash scripts/dev/gpu_tests.sh tp       # tests/gpu/test_tensor_parallel.py (2 GPUs)
set -uo pipefail
O=${OUT:-bench_out}; mkdir -p "$O"
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
date -u +"%Y-%m-%d %H:%M UTC" | tee "$O/date_$1.txt"
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee -a "$O/date_$1.txt"
python3 -c "import torch, transformers, flashinfer; print(torch.__version__, transformers.__version__, flashinfer.__version__)" | tee -a "$O/date_$1.txt"
case "$1" in
  single) timeout 540 python3 -m pytest -q -p no:cacheprovider tests/gpu -s --ignore=tests/gpu/test_tensor_parallel.py \
            2>&1 | tee "$O/gpu_tests_single.txt" | grep -E "rel|compiles|passed|failed|Error|error" | tail -80 ;;
  tp)     timeout 540 python3 -m pytest -q -p no:cacheprovider tests/gpu/test_tensor_parallel.py -s \
            2>&1 | tee "$O/gpu_tests_tp.txt" | tail -60 ;;
esac
