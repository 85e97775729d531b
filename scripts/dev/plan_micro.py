#!/usr/bin/env python3
"""Host cost of the pieces of one fa3 plan, and whether any of them waits for the GPU (development tool).

Each piece is timed on the host (median of --reps) twice: with the GPU idle, and right after queueing a 50 ms
``torch.cuda._sleep``: a piece that waits for the GPU (an implicit sync, e.g. freeing pinned memory) then takes
~50 ms.
"""

from __future__ import annotations

import statistics
import sys
import time

import torch


def timed(fn, reps, busy):
    out = []
    for _ in range(reps):
        torch.cuda.synchronize()
        if busy:
            torch.cuda._sleep(int(50e-3 * 1.98e9))  # ~50 ms of GPU clock cycles
        t0 = time.perf_counter()
        fn()
        out.append((time.perf_counter() - t0) * 1e3)
    torch.cuda.synchronize()
    return statistics.median(out)


def main() -> int:
    from hf_flashinfer_mla import flashinfer_fa as fa
    from hf_flashinfer_mla.metadata import KVRanges, StepPlan

    dev = torch.device("cuda")
    reps = 20
    eng = fa.generated_fa(dev, "fa3", 128, torch.bfloat16, 512, 64)
    batch, ctx = 32, 4096
    plan = StepPlan(torch.ones(batch, 1, 1, ctx, dtype=torch.bool, device=dev))
    plan.ranges = KVRanges(torch.zeros(batch, dtype=torch.long), ctx)
    rows = fa.paged_rows(plan, dev)
    ws = eng.new_workspace()
    scratch = torch.empty(fa.INT_WORKSPACE_BYTES, dtype=torch.uint8, pin_memory=True)
    raw = eng.module._module
    args = (eng.float_workspace, ws, scratch, rows.qo_indptr, rows.kv_indptr, rows.kv_len, 128, 512, False)
    staged = int(raw.plan(*args)[1])
    pieces = {
        "pinned empty 8 MiB": lambda: torch.empty(fa.INT_WORKSPACE_BYTES, dtype=torch.uint8, pin_memory=True),
        f"pinned empty {staged} B": lambda: torch.empty(staged, dtype=torch.uint8, pin_memory=True),
        "validate_workload (skipped for decode)": lambda: eng.surface.validate_workload(rows.qo_indptr, rows.kv_len, 128, False, dev,
                                                                   "fa3", torch.bfloat16),
        "native plan only": lambda: raw.plan(*args),
        "staged copy to GPU": lambda: ws[:staged].copy_(scratch[:staged], non_blocking=True),
        "proxy plan (FlashInfer staging)": lambda: eng.module.plan_with_staged_workspace_bytes(*args),
        "GeneratedFa.plan": lambda: eng.plan(rows, rows.kv_indptr, False, ws),
        "compact kv_indices (public wrapper only)": lambda: rows.kv_indices(ctx, dev),
        "addressing (identity)": lambda: rows.addressing(ctx, dev),
        "FaStep (rows + plan + workspace)": lambda: fa.FaStep(rows, False, dev, "fa3", 128, torch.bfloat16, 512, 64,
                                                              (ctx,), 0.1),
    }
    print(f"staged bytes per plan: {staged}")
    print(f"{'piece':40s} {'idle ms':>9s} {'busy GPU ms':>12s}")
    for name, fn in pieces.items():
        fn()
        print(f"{name:40s} {timed(fn, reps, False):9.3f} {timed(fn, reps, True):12.3f}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
