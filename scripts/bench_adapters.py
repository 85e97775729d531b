#!/usr/bin/env python3
"""What a PEFT LoRA on ``kv_b_proj`` costs a decode step: the same model with and without the adapter, alternated in
one process (ratios side by side).

flashinfer_mla applies a LoRA's factors live in the absorbed form (``hf_flashinfer_mla/adapters.py``): per layer
and adapter, two rank-r GEMMs on the query and two on the output, read from the adapter's tensors at every step.
Decode steps are driven as ``generate()`` drives them (`bench_common.decode_steps`). The adapter is injected with
``peft.inject_adapter_in_model`` (random factors); "without" swaps each layer's ``kv_b_proj`` back to the LoRA's base
layer, so both modes run the same weights and cache.

    python scripts/bench_adapters.py                                  # tiny model on the CPU
    python scripts/bench_adapters.py --model deepseek-v3-attn --device cuda --batch 32 --context 4096 --out out
"""

from __future__ import annotations

import argparse
import statistics
import sys

import torch

import bench_common as bc


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--model", default="tiny", choices=bc.MODEL_NAMES)
    p.add_argument("--layers", type=int, default=None, help="override the preset's depth")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--dtype", default=None, choices=list(bc.DTYPES), help="default: bfloat16 on CUDA, else float32")
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--context", type=int, default=256, help="cached tokens before the timed steps")
    p.add_argument("--rank", type=int, default=16, help="the LoRA's rank r")
    p.add_argument("--adapters", type=int, default=1, help="adapters active at once (1: the usual case)")
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--repeats", type=int, default=3, help="alternations of without / with")
    p.add_argument("--out", default=None, help="directory for bench_adapters.json")
    args = p.parse_args(argv)
    if args.rank < 1 or args.adapters < 1 or args.batch < 1 or args.context < 1 or args.steps < 1:
        p.error("--rank, --adapters, --batch, --context and --steps must be positive")
    try:
        import peft
    except ImportError:
        p.error('bench_adapters.py needs peft: pip install "hf-flashinfer-mla[test]"')

    device = bc.resolve_device(args.device)
    dtype = bc.DTYPES[args.dtype] if args.dtype else (torch.bfloat16 if device.type == "cuda" else torch.float32)
    config = bc.build_config(args.model, args.layers)
    model = bc.build_model(config, dtype, device)
    model.set_attn_implementation("flashinfer_mla")
    names = [f"adapter{i}" for i in range(args.adapters)]
    for name in names:
        lora = peft.LoraConfig(target_modules=["kv_b_proj"], r=args.rank, lora_alpha=2 * args.rank,
                               init_lora_weights=False)
        model = peft.inject_adapter_in_model(lora, model, adapter_name=name)
    attentions = [m for m in model.modules() if hasattr(m, "kv_b_proj")]
    loras = [m.kv_b_proj for m in attentions]
    for proj in loras:
        proj.set_adapter(names)
    model.to(device=device, dtype=dtype).eval()

    def use(adapted: bool) -> None:
        for attn, proj in zip(attentions, loras):
            attn.kv_b_proj = proj if adapted else proj.base_layer

    cache = bc.make_cache("dynamic", "flashinfer_mla", config, args.context + args.warmup + args.steps)
    bc.fill_cache(cache, config, args.batch, args.context, dtype, device)
    runs = {"without": [], "with": []}
    for _ in range(args.repeats):
        for mode in runs:
            use(mode == "with")
            runs[mode].append(bc.decode_steps(model, cache, args.batch, args.context, args.warmup, args.steps))
    medians = {mode: statistics.median(r["ms_median"] for r in rs) for mode, rs in runs.items()}
    host = {mode: statistics.median(r["host_ms_median"] for r in rs) for mode, rs in runs.items()}
    layers = len(attentions)
    rows = [[mode, bc.fmt(medians[mode], ".3f"), bc.fmt(host[mode], ".3f"),
             bc.fmt((medians[mode] - medians["without"]) / layers * 1e3, ".1f"),
             bc.fmt(medians[mode] / medians["without"], ".3f")] for mode in runs]
    print(f"{args.model} ({layers} MLA layers), {device}, {dtype}, batch {args.batch}, context {args.context}, "
          f"LoRA r={args.rank} x {args.adapters} on kv_b_proj; medians of {args.repeats} alternated runs of "
          f"{args.steps} steps")
    bc.print_table(["kv_b_proj", "step ms", "host ms", "added us/layer", "vs without"], rows)
    results = [{"kv_b_proj": mode, "status": "ok", "layers": layers, "rank": args.rank, "adapters": args.adapters,
                "step_ms_median": medians[mode], "host_ms_median": host[mode],
                "ratio": medians[mode] / medians["without"], "runs": runs[mode]} for mode in runs]
    path = bc.write_json(args.out, "bench_adapters.json",
                         {"metadata": bc.environment(device, args), "results": results})
    if path:
        print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
