#!/usr/bin/env python3
"""Whether two compiles of one static-cache ``generate()`` give bitwise the same logits: the question behind the
one failure of ``test_generate_static_cache_graphs_equal_compiled_without_graphs`` (2026-12-02).

Inductor benchmarks the block sizes of its reduction kernels on the GPU the first time it runs them and keeps the
fastest; those sizes change the rounding. This compiles the test's model (DeepSeek-V3's attention shape, two layers,
bf16, random weights, flashinfer_mla on fa3) several times, each from an empty inductor cache (so each compile
benchmarks again), with inductor's deterministic mode off and then on, optionally while another process loads the
GPU (``--load``: the suite's other workers), and prints for each compile the reduction kernels it benchmarked and
whether its logits equal the first compile's.

    python scripts/dev/probe_autotune.py --compiles 3 --load --out OUT
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import subprocess
import sys
import tempfile

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
LOAD = "import torch\na = torch.randn(8192, 8192, device='cuda', dtype=torch.bfloat16)\nwhile True: a @ a\n"


def compile_once(model, ids, mask, deterministic: bool) -> tuple[torch.Tensor, int]:
    """One static-cache generate() compiled (mode "default", as the test's first run) from an empty inductor
    cache; its logits and the number of reduction kernels inductor benchmarked."""
    from torch._inductor.codecache import PyCodeCache
    from transformers import CompileConfig

    os.environ["TORCHINDUCTOR_CACHE_DIR"] = cache = tempfile.mkdtemp(prefix="inductor_")
    PyCodeCache.cache_clear()
    torch._dynamo.reset()
    with torch._inductor.config.patch(deterministic=deterministic, fx_graph_cache=False):
        out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=24, do_sample=False,
                             cache_implementation="static", compile_config=CompileConfig(mode="default"),
                             output_logits=True, return_dict_in_generate=True)
    tuned = 0
    for path in glob.glob(os.path.join(cache, "**", "*.best_config"), recursive=True):
        source = path[: -len(".best_config")] + ".py"
        text = open(source).read() if os.path.exists(source) else ""
        tuned += "reduction" in text and "triton_heuristics.pointwise" not in text
    return torch.stack(out.logits).float().cpu(), tuned


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--compiles", type=int, default=3)
    p.add_argument("--load", action="store_true", help="a second process runs bf16 matmuls meanwhile")
    p.add_argument("--out", default="probe_out")
    args = p.parse_args(argv)
    os.makedirs(args.out, exist_ok=True)
    sys.path.insert(0, os.path.join(HERE, "..", "..", "tests", "gpu"))
    import hf_flashinfer_mla  # noqa: F401  (registers flashinfer_mla)
    from test_gpu_backends import _model, _prompts

    model = _model("v3")
    model.set_attn_implementation("flashinfer_mla")
    ids, mask, _ = _prompts()
    load = subprocess.Popen([sys.executable, "-c", LOAD]) if args.load else None
    rows = []
    try:
        for deterministic in (False, True):
            first = None
            for k in range(args.compiles):
                logits, tuned = compile_once(model, ids, mask, deterministic)
                first = logits if first is None else first
                differs = [t for t in range(logits.shape[0]) if not torch.equal(logits[t], first[t])]
                row = dict(deterministic=deterministic, compile=k, reductions_benchmarked=tuned,
                           equal_to_first=not differs, first_differing_step=differs[0] if differs else None,
                           max_abs_diff=float((logits - first).abs().max()))
                rows.append(row)
                print(json.dumps(row), flush=True)
    finally:
        if load is not None:
            load.kill()
    with open(os.path.join(args.out, "probe_autotune.json"), "w") as f:
        json.dump(rows, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
