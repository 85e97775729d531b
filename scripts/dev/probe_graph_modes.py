#!/usr/bin/env python3
"""Whether a compiled static-cache decode step gives the same logits with CUDA graphs as without, and where they part
if not, on the rows of the GPU test ``test_generate_static_cache_graphs_equal_compiled_without_graphs``
(``tests/gpu/test_gpu_backends.py``): the kernel first, then the two compiled ``generate()`` calls.

1. ``kernel``: fa3 over the test's rows at each of its 24 steps (B=4, left padding 27/44/0/59, a static cache of
   88 rows), planned fresh and through a CUDA-graph slot, each run `--reps` times on the same operands: any
   output that is not bitwise the first fresh one is counted, per step and row.
2. ``generate``: the test's two compiled generate() calls (mode "default", then "reduce-overhead", after
   ``torch._dynamo.reset()``), `--loops` times, optionally with a checker on every slot run outside a capture
   (``--check``: the slot's output against a step planned afresh from the mask, bitwise), per step and row the
   relative error between the two runs' logits, and the Triton kernels of one source that the two compiles ran with
   other launch configs. The flags set inductor's options (see ``--help``); ``--load`` stands in for the GPU suite's
   other workers.

    python scripts/dev/probe_graph_modes.py --part kernel generate --load --out OUT
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
LOAD = "import torch\na = torch.randn(8192, 8192, device='cuda', dtype=torch.bfloat16)\nwhile True: a @ a\n"
FIRST, WIDTH, STEPS, HEADS, RANK, ROPE = (27, 44, 0, 59), 64, 24, 128, 512, 64


def kernel_part(reps: int) -> list[dict]:
    from hf_flashinfer_mla.kernels import fa, graphs
    from hf_flashinfer_mla.plan import StepPlan, layer_of

    dev, b = torch.device("cuda"), len(FIRST)
    pitch = WIDTH + STEPS
    g = torch.Generator(device=dev).manual_seed(0)
    kv = torch.randn(b, 1, pitch, RANK, device=dev, dtype=torch.bfloat16, generator=g)
    kr = torch.randn(b, 1, pitch, ROPE, device=dev, dtype=torch.bfloat16, generator=g)
    q_lat = torch.randn(HEADS, b, RANK, device=dev, dtype=torch.bfloat16, generator=g)
    q_pe = torch.randn(b, HEADS, ROPE, device=dev, dtype=torch.bfloat16, generator=g)
    scale = 192 ** -0.5
    layer = layer_of(q_lat, kv, kr, scale)
    slot = graphs.GraphSlot(fa, "fa3", layer, b, 1)
    first = torch.tensor(FIRST, device=dev)
    rows = []
    for t in range(1, STEPS + 1):
        width = WIDTH + t
        j = torch.arange(pitch, device=dev)
        mask = ((j >= first[:, None]) & (j < width))[:, None, None, :]
        outs = []
        for _ in range(reps):
            step = StepPlan(mask)
            outs.append(("fresh", step.route(("k", t), layer, "fa3", False).run(q_lat, q_pe, kv, kr)))
            step = StepPlan(mask)
            slot.load(step)
            outs.append(("slot", slot.run(q_lat, q_pe, kv, kr)))
        ref = outs[0][1]
        bad = {"fresh": [0] * b, "slot": [0] * b}
        for kind, out in outs:
            for r in range(b):
                bad[kind][r] += not torch.equal(out[:, r], ref[:, r])
        row = dict(step=t, route=outs[0][0], fresh_mismatches_per_row=bad["fresh"],
                   slot_mismatches_per_row=bad["slot"], reps=reps)
        rows.append(row)
        print(json.dumps(row), flush=True)
    return rows


def kernel_configs() -> dict[int, tuple[str, str, str]]:
    """Every Triton kernel inductor has loaded in this process (by object): its name, a hash of its source and the
    launch config it runs with (the one its autotuning kept)."""
    import hashlib

    from torch._inductor.codecache import PyCodeCache
    from torch._inductor.runtime.triton_heuristics import CachingAutotuner

    found = {}
    for module in [*PyCodeCache.modules, *PyCodeCache.modules_no_attr.values()]:
        for name, value in list(vars(module).items()):
            if isinstance(value, CachingAutotuner) and hasattr(value, "fn"):
                src = getattr(value.fn, "src", "") or ""
                configs = [str(getattr(x, "config", x)) for x in value.launchers] or [str(c) for c in value.configs]
                meta = getattr(value, "inductor_meta", {}) or {}
                detail = dict(size_hints=str(getattr(value, "size_hints", None)),
                              heuristic=str(getattr(value, "heuristic_type", None)),
                              candidates=len(getattr(value, "configs", None) or []),
                              deterministic=meta.get("deterministic"),
                              autotune_cache=str(getattr(value, "autotune_cache", None))[:80],
                              reduction_hint=str(meta.get("reduction_hint")))
                found[id(value)] = (name, hashlib.sha1(src.encode()).hexdigest()[:10], " | ".join(configs), detail)
    return found


def generate_part(loops: int, check: bool) -> list[dict]:
    import hf_flashinfer_mla
    from hf_flashinfer_mla import compiled as compiled_mod
    from hf_flashinfer_mla.plan import StepPlan
    from test_gpu_backends import _model, _prompts, rel
    from transformers import CompileConfig

    findings = []
    if check:
        real_run = compiled_mod.GraphSlotRoute.run

        def checked(self, q_lat, q_pe, kv_latent, k_rot, mask):
            out = real_run(self, q_lat, q_pe, kv_latent, k_rot, mask)
            if self.backend != "reference" and not torch.cuda.is_current_stream_capturing():
                fresh = StepPlan(mask.clone()).route(("check",), self.layer, self.backend, False)
                again = fresh.run(q_lat, q_pe, kv_latent, k_rot)
                b = mask.shape[0]
                o, a = out.view(out.shape[0], b, -1), again.view(again.shape[0], b, -1)
                bad = [r for r in range(b) if not torch.equal(o[:, r], a[:, r])]
                if bad:
                    holder = self.slot.holder()
                    findings.append(dict(rows=bad, holder_lens=None if holder is None else holder.rows().lens.tolist(),
                                         mask_lens=mask[:, 0, -1].sum(-1).tolist()))
            return out

        compiled_mod.GraphSlotRoute.run = checked
    model = _model("v3")
    model.set_attn_implementation("flashinfer_mla")
    ids, mask, _ = _prompts()
    rows = []
    for loop in range(loops):
        hf_flashinfer_mla.reset()
        runs, kernels = {}, {}
        for mode in ("default", "reduce-overhead"):
            torch._dynamo.reset()
            before = len(findings)
            known = kernel_configs()
            runs[mode] = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=STEPS, do_sample=False,
                                        cache_implementation="static", compile_config=CompileConfig(mode=mode),
                                        output_logits=True, return_dict_in_generate=True)
            now = kernel_configs()
            kernels[mode] = {v[1]: v for k, v in now.items() if k not in known}  # this compile's new kernels
            print(json.dumps(dict(loop=loop, mode=mode, new_kernels=len(kernels[mode]),
                                  checker_mismatches=findings[before:][:5], checker_count=len(findings) - before)),
                  flush=True)
        a, b = torch.stack(runs["reduce-overhead"].logits), torch.stack(runs["default"].logits)
        table = [[0.0 if torch.equal(a[t, r], b[t, r]) else round(rel(a[t, r], b[t, r]), 5)
                  for r in range(a.shape[1])] for t in range(a.shape[0])]
        row = dict(loop=loop, tokens_equal=torch.equal(runs["reduce-overhead"].sequences, runs["default"].sequences),
                   first_differing_step=next((t for t, r in enumerate(table) if any(r)), None), rel_err=table)
        common = set(kernels["default"]) & set(kernels["reduce-overhead"])
        row["kernels_with_other_configs"] = [(kernels["default"][h][0], kernels["default"][h][2],
                                              kernels["reduce-overhead"][h][2], kernels["default"][h][3],
                                              kernels["reduce-overhead"][h][3]) for h in sorted(common)
                                             if kernels["default"][h][2] != kernels["reduce-overhead"][h][2]]
        row["kernels_in_one_compile_only"] = {m: sorted(v[0] for h, v in kernels[m].items() if h not in common)
                                              for m in kernels}
        rows.append(row)
        print(json.dumps({k: v for k, v in row.items() if k != "rel_err"}), flush=True)
        if row["first_differing_step"] is not None:
            for t, r in enumerate(table):
                print(f"  step {t:2d}: " + " ".join(f"{x:.1e}" for x in r), flush=True)
    return rows


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--part", nargs="+", default=["kernel", "generate"], choices=["kernel", "generate"])
    p.add_argument("--reps", type=int, default=20, help="kernel part: runs of each step's operands")
    p.add_argument("--loops", type=int, default=3, help="generate part: repeats of the two compiled calls")
    p.add_argument("--check", action="store_true",
                   help="generate part: every slot run outside a capture against a step planned afresh, bitwise")
    p.add_argument("--deterministic", action="store_true", help="compile under inductor's deterministic mode")
    p.add_argument("--no-benchmarking", action="store_true",
                   help="no compile-time benchmarking at all: pointwise configs (triton.autotune_pointwise) and matmul "
                        "padding (shape_padding) from heuristics only")
    p.add_argument("--filter-reductions", action="store_true",
                   help="one config per reduction kernel (inductor's test_configs.force_filter_reduction_configs)")
    p.add_argument("--isolated", action="store_true",
                   help="no compile artifact or autotuning result read from inductor's caches (FX graph, AOTAutograd, "
                        "autotune)")
    p.add_argument("--load", action="store_true", help="a second process runs bf16 matmuls meanwhile")
    p.add_argument("--out", default="probe_out", help="directory for the JSON and the log")
    args = p.parse_args(argv)
    os.makedirs(args.out, exist_ok=True)
    sys.path.insert(0, os.path.join(HERE, "..", "..", "tests", "gpu"))
    import hf_flashinfer_mla  # noqa: F401  (registers flashinfer_mla)

    load = subprocess.Popen([sys.executable, "-c", LOAD]) if args.load else None
    result = {}
    try:
        patch = dict(deterministic=args.deterministic)
        if args.no_benchmarking:
            patch.update({"triton.autotune_pointwise": False, "shape_padding": False})
        if args.filter_reductions:
            patch["test_configs.force_filter_reduction_configs"] = True
        if args.isolated:
            patch.update({"fx_graph_cache": False, "autotune_local_cache": False})
            torch._functorch.config.enable_autograd_cache = False
        with torch._inductor.config.patch(patch):
            if "kernel" in args.part:
                result["kernel"] = kernel_part(args.reps)
            if "generate" in args.part:
                result["generate"] = generate_part(args.loops, args.check)
    finally:
        if load is not None:
            load.kill()
    with open(os.path.join(args.out, "probe_graph_modes.json"), "w") as f:
        json.dump(result, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
