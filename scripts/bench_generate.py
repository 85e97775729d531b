#!/usr/bin/env python3
"""Whole-model ``generate()`` throughput: tokens/s of flashinfer_mla against sdpa (and eager), as a user runs it.

For each ``--attn`` and ``--batch``: random prompts of ``--prompt`` tokens, greedy ``generate()`` of ``--new``
tokens (``min_new_tokens`` pins the length), default cache (``--static``: ``cache_implementation="static"``, which
compiles the decode step with CUDA graphs; each cell then starts from ``torch.compiler.reset()``, so that neither
implementation runs beside the other's compiled code). Each configuration runs once as warm-up, then ``--repeats``
times for ``--new`` tokens and for 1 token; reported (medians):

* ``tok/s``: batch x new tokens / the whole call (prefill included);
* ``decode tok/s``: batch x (new - 1) / (time for new tokens - time for 1 token), i.e. the decode steps alone.

    python scripts/bench_generate.py --model deepseek-v2-lite --prompt 512 --new 128 --batch 1 --out out
    python scripts/bench_generate.py --model tiny --device cpu --dtype float32 --prompt 16 --new 4 --repeats 1
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import sys
import time

import torch

import bench_common as bc


def timed_generate(model, ids, new, static, device) -> float:
    kwargs = dict(cache_implementation="static") if static else {}
    bc.synchronize(device)
    t0 = time.perf_counter()
    with torch.inference_mode():
        out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=new,
                             min_new_tokens=new, do_sample=False, pad_token_id=0, **kwargs)
    bc.synchronize(device)
    assert out.shape[1] == ids.shape[1] + new
    return time.perf_counter() - t0


@contextlib.contextmanager
def counted_captures():
    """The CUDA-graph captures (torch.cuda.CUDAGraph.capture_end calls) made inside the block, as a list."""
    captures = []
    if not torch.cuda.is_available():
        yield captures
        return
    graph = torch.cuda.graphs.CUDAGraph
    real = graph.capture_end

    def capture_end(self, *args, **kwargs):
        captures.append(1)
        return real(self, *args, **kwargs)

    graph.capture_end = capture_end
    try:
        yield captures
    finally:
        graph.capture_end = real


def run(model, attn, batch, args, device) -> dict:
    rec = {"attn": attn, "batch": batch, "prompt": args.prompt, "new": args.new, "static": args.static,
           "order": args.attn.index(attn), "status": "ok"}
    try:
        if args.static:
            # Each cell compiles from a clean slate: with the previous implementation's compiled step still cached,
            # dynamo keeps two entries for the one compiled call (their guards differ in the attention
            # implementation) and CUDA-graph trees keep the other's pools, so whichever runs second would pay for
            # the first (in earlier rounds the second of the two lost 7-10% at batch 1, whichever it was).
            torch.compiler.reset()
        model.set_attn_implementation(attn)
        gen = torch.Generator().manual_seed(batch)
        ids = torch.randint(1, model.config.vocab_size, (batch, args.prompt), generator=gen).to(device)
        # Warm-up (kernels, compilation). A static cache is sized from prompt + new tokens, and torch compiles (and
        # CUDA graphs record) per cache length, so a static run warms up twice at the length it then times.
        for _ in range(2 if args.static else 1):
            timed_generate(model, ids, args.new if args.static else min(args.new, 8), args.static, device)
        with counted_captures() as captures:  # CUDA graphs recorded during the timed calls (0 in a steady state)
            full = [timed_generate(model, ids, args.new, args.static, device) for _ in range(args.repeats)]
        rec["graphs_recorded_timed"] = len(captures)
        if args.static:  # the one-token run has a cache length of its own: warm it up too
            timed_generate(model, ids, 1, args.static, device)
        one = [timed_generate(model, ids, 1, args.static, device) for _ in range(args.repeats)]
        t_full, t_one = statistics.median(full), statistics.median(one)
        rec.update(seconds_all=full, seconds_one_token=one, tokens_per_s=batch * args.new / t_full,
                   decode_tokens_per_s=batch * (args.new - 1) / max(t_full - t_one, 1e-9),
                   decode_ms_per_step=(t_full - t_one) / (args.new - 1) * 1e3)
    except Exception as exc:  # noqa: BLE001
        rec.update(bc.failure(exc))
    bc.free_memory(device)
    return rec


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="deepseek-v2-lite", choices=bc.MODEL_NAMES)
    p.add_argument("--layers", type=int, default=None)
    p.add_argument("--prompt", type=int, default=512)
    p.add_argument("--new", type=int, default=128)
    p.add_argument("--batch", nargs="+", type=int, default=[1])
    p.add_argument("--attn", nargs="+", default=["sdpa", "flashinfer_mla"], choices=bc.ATTNS)
    p.add_argument("--static", action="store_true", help='cache_implementation="static" (CUDA graphs)')
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--dtype", default="bfloat16", choices=sorted(bc.DTYPES))
    p.add_argument("--device", default="cuda")
    p.add_argument("--experts-impl", default=None)
    p.add_argument("--out", default=None)
    p.add_argument("--name", default=None, help="JSON file name (default: generate_<model>.json)")
    args = p.parse_args(argv)
    if args.new < 2 or args.repeats < 1:
        p.error("--new must be >= 2 and --repeats >= 1")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    device, dtype = bc.resolve_device(args.device), bc.DTYPES[args.dtype]
    name = args.name or f"generate_{args.model}{'_static' if args.static else ''}.json"
    payload = {"metadata": bc.environment(device, args), "results": []}
    model = bc.build_model(bc.build_config(args.model, args.layers), dtype, device, args.experts_impl)
    for batch in args.batch:
        for attn in args.attn:
            rec = run(model, attn, batch, args, device)
            payload["results"].append(rec)
            shown = f"{rec['tokens_per_s']:.1f} tok/s" if rec["status"] == "ok" else rec["status"]
            print(f"  {args.model} B={batch} {attn}: {shown}", flush=True)
            bc.write_json(args.out, name, payload)
    rows, by = [], {(r["batch"], r["attn"]): r for r in payload["results"]}
    for r in payload["results"]:
        base = by.get((r["batch"], "sdpa"))
        ratio = (r["decode_tokens_per_s"] / base["decode_tokens_per_s"]
                 if r["status"] == "ok" and base and base["status"] == "ok" else None)
        ok = r["status"] == "ok"
        rows.append([args.model, str(r["batch"]), r["attn"], bc.fmt(r.get("tokens_per_s") if ok else None, ".1f"),
                     bc.fmt(r.get("decode_tokens_per_s") if ok else None, ".1f"),
                     bc.fmt(r.get("decode_ms_per_step") if ok else None), bc.fmt(ratio),
                     str(r.get("graphs_recorded_timed", "")), "" if ok else r["status"].upper()])
    print()
    bc.print_table(["model", "B", "attn", "tok/s", "decode tok/s", "ms/step", "vs sdpa", "graphs rec.", ""], rows,
                   [f"prompt {args.prompt} tokens, {args.new} new tokens, greedy; vs sdpa = decode tok/s ratio; "
                    "graphs rec. = CUDA graphs recorded during the timed full-length calls (0: a steady state)"])
    path = bc.write_json(args.out, name, payload)
    if path:
        print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
