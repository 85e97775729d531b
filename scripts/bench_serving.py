"""Serving benchmark: many requests arriving at once, continuous batching against static generate() batches.

Random weights (nothing is downloaded). `--requests` prompts of random lengths in [--prompt-min, --prompt-max]
(fixed seed) all arrive at t0 (or, with `--request-rate R`, as a Poisson process of R per second: continuous
batching's steps then mix a few prefill tokens with many decodes); each generates `--new` tokens greedily (EOS
off). Modes, in one run:

  cb-flashinfer_mla        model.init_continuous_batching() with attn_implementation="flashinfer_mla" (the paged
                           latent cache of hf_flashinfer_mla.paged_cache), every request added at t0; its decode
                           steps in CUDA graphs where Transformers turns them on (a CUDA GPU, fa3/fa2 decode)
  cb-flashinfer_mla-decode-graphs
                           the same with only the steps in which every request decodes in CUDA graphs (steps that
                           mix prefill chunks with decodes run uncompiled): the A/B of mixed-step graphs
                           (``paged_attention.graph_pays``)
  cb-flashinfer_mla-no-graphs
                           the same with use_cuda_graph=False: every step runs the package's Python per layer
  cb-flashinfer_mla-sync   the same without asynchronous batching (the host prepares a step once it has read the
                           previous step's tokens)
  cb-flashinfer_mla-token-indices
                           the same without asynchronous batching and with every request's rows listed by
                           Transformers token by token in Python each step (``paged_cache.ROWS_FROM_BLOCK_TABLES``
                           off), instead of laid out from the block tables: the A/B of both
  cb-flashinfer_mla-sparse-expanded
                           a sparse (DSA) model's prefill chunks expanded through kv_b_proj and attended with SDPA
                           under the indexer's selection as a mask, one request at a time, instead of every query
                           token absorbed over its selected rows (``paged_attention.SPARSE_CHUNKS_ABSORBED``): the A/B
                           of both
  cb-flashinfer_mla-indexer-forward
                           a DeepSeek-V3.2-style indexer run by its own forward per request group, scoring each
                           token over its group's longest rows (a graph's padding tokens included), instead of over
                           each token's own rows (``paged_indexer.SCORES_OVER_OWN_ROWS``): the A/B of both
  cb-sdpa                  the same with attn_implementation="sdpa": Transformers' own paging of the MLA latent
                           (its MLACacheAllocator, 5.25+; skipped before), its own defaults for CUDA graphs and
                           asynchronous batching (5.25: both off for sdpa, which needs an attention mask); never
                           switched to a flash attention
  generate-flashinfer_mla  generate() on left-padded static batches of --static-batch requests, one after the other
                           (--prefill-chunk: their prompts prefilled in chunks of that many tokens, which a sparse
                           model's indexer needs at long contexts)
  generate-sdpa            the same with attn_implementation="sdpa"
  cb-flashinfer_mla-sdpa-prefill
                           (not run by default) cb-flashinfer_mla with its prefill chunks on SDPA, one request at a
                           time, instead of FlashInfer's ragged prefill: the A/B of ``kernels/ragged.py``

Reported per mode: total output tokens/s (all new tokens / wall time from t0), time to first token and inter-token
latency (p50, p99; a static batch's requests wait for the batches before them), peak GPU memory; for the cb modes
also the attention, CUDA graphs (varlen, decode) and asynchronous batching the manager resolved, and for
flashinfer_mla its steps: all, in graphs, and in graphs with prefill chunks. With `--time-limit S` a mode that has not
finished by S seconds stops there (status time-limit): the requests finished, the tokens produced by then (unfinished
requests' included) over its wall time, and the latencies of those tokens (TTFT over the requests that had one).
With `--warm-run` each mode is timed in its steady state: after an untimed pass at the same prompt lengths (graphs
captured, kernels compiled and loaded, memory pools grown), which a cold start pays within its timed pass.

    python scripts/bench_serving.py --model deepseek-v2-lite --out bench_out
    python scripts/bench_serving.py --model deepseek-v3-attn --out bench_out
    python scripts/bench_serving.py --model deepseek-v32-attn --requests 64 --prompt-min 4096 --prompt-max 32768 \
        --static-batch 8 --prefill-chunk 256 --modes cb-flashinfer_mla generate-flashinfer_mla generate-sdpa
    python scripts/bench_serving.py --model tiny --device cpu --dtype float32 --requests 6 --prompt-min 4 \\
        --prompt-max 12 --new 3 --static-batch 4           # CPU smoke test
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import torch

import bench_common as bc

MODES = ("cb-flashinfer_mla", "cb-flashinfer_mla-decode-graphs", "cb-flashinfer_mla-no-graphs", "cb-sdpa",
         "generate-flashinfer_mla", "generate-sdpa")
AB_MODES = ("cb-flashinfer_mla-sdpa-prefill", "cb-flashinfer_mla-sync", "cb-flashinfer_mla-token-indices",
            "cb-flashinfer_mla-sparse-expanded", "cb-flashinfer_mla-indexer-forward")


def percentile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(q / 100 * (len(ordered) - 1))))]


def make_prompts(args, vocab: int, seed: int | None = None) -> list[list[int]]:
    """`args.requests` prompts of random tokens; their lengths depend on `args.seed` alone, their tokens on `seed`
    (default: `args.seed`): a warm pass's prompts have the timed pass's lengths and share no prefix with them."""
    g = torch.Generator().manual_seed(args.seed)
    lengths = torch.randint(args.prompt_min, args.prompt_max + 1, (args.requests,), generator=g)
    if seed is not None and seed != args.seed:
        g = torch.Generator().manual_seed(seed)
    return [torch.randint(1, vocab, (int(n),), generator=g).tolist() for n in lengths]


def arrival_times(args) -> list[float]:
    """Seconds after t0 at which each request arrives: all at t0, or a Poisson process of `--request-rate` requests
    per second (exponential gaps, fixed seed), the first at t0."""
    if not args.request_rate:
        return [0.0] * args.requests
    g = torch.Generator().manual_seed(args.seed + 1)
    gaps = torch.empty(args.requests).exponential_(args.request_rate, generator=g)
    gaps[0] = 0.0
    return gaps.cumsum(0).tolist()


def progress(total: int, desc: str, enabled: bool):
    from tqdm.auto import tqdm

    return tqdm(total=total, desc=desc, unit="req", disable=not enabled, file=sys.stderr)


def run_cb(model, attn, prompts, args, device, sdpa_prefill=False, graphs=True, mixed_graphs=True,
           asynchronous=None, token_indices=False, sparse_expanded=False, indexer_forward=False) -> dict:
    from loop_split import LoopSplit
    from step_split import StepSplit

    from hf_flashinfer_mla import paged_attention, paged_cache, paged_indexer
    from hf_flashinfer_mla.kernels import ragged

    # The A/B switches: with no head dims "supported", paged_attention.py prefills every chunk on SDPA (its
    # fallback); with graph_pays admitting only steps in which every request decodes, mixed steps run uncompiled.
    loop = LoopSplit(device).install() if args.loop_split and attn == "flashinfer_mla" else None
    supported, pays, prepare = ragged.supported_dims, paged_attention.graph_pays, paged_attention.prepare_step
    paged_cache.ROWS_FROM_BLOCK_TABLES = not token_indices
    paged_attention.SPARSE_CHUNKS_ABSORBED = not sparse_expanded
    paged_indexer.SCORES_OVER_OWN_ROWS = not indexer_forward
    if sdpa_prefill:
        ragged.supported_dims = lambda qk, vo: False
    if not mixed_graphs:
        paged_attention.graph_pays = lambda q_lens, k_lens: bool((q_lens == 1).all())
    steps = {"steps": 0, "graphed_steps": 0, "graphed_mixed_steps": 0}
    split = None

    def measure():  # (the timed pass starts: what the warm pass counted is dropped)
        nonlocal split
        steps.update(dict.fromkeys(steps, 0))
        # (with a warm pass before, every graph the timed pass replays exists: its replays can be profiled too)
        split = StepSplit(device, graphed=args.warm_run) if args.step_split and attn == "flashinfer_mla" else None
        if loop is not None:
            loop.steps.clear()
            loop.events.clear()

    def counted(io):  # (every step of the package's, as its seam on prepare_batch_tensors hands it over)
        if split is not None:
            split.boundary()
        prepare(io)
        step = next((a.step for a in io.cache.cache_allocators.values() if hasattr(a, "step")), None)
        if step is not None:
            mixed = bool((step.q_lens > 1).any())
            steps["steps"] += 1
            steps["graphed_steps"] += step.graphed
            steps["graphed_mixed_steps"] += step.graphed and mixed
            if split is not None:
                split.classify(mixed, step.graphed, int(step.q_lens.sum()))

    paged_attention.prepare_step = counted
    try:
        warm = make_prompts(args, model.config.vocab_size, seed=args.seed + 1) if args.warm_run else None
        got = _run_cb(model, attn, prompts, args, device, graphs, asynchronous, warm, measure)
        if steps["steps"]:
            got["setup"].update(steps)
        if split is not None:
            split.discard()
            got["setup"]["step_split"] = split.report(got["wall_s"])
        if loop is not None:
            got["setup"]["loop_split"] = loop.report()
        return got
    finally:
        ragged.supported_dims, paged_attention.graph_pays, paged_attention.prepare_step = supported, pays, prepare
        paged_cache.ROWS_FROM_BLOCK_TABLES = paged_attention.SPARSE_CHUNKS_ABSORBED = True
        paged_indexer.SCORES_OVER_OWN_ROWS = True
        if loop is not None:
            loop.uninstall()


def produced_by_running(manager, running) -> list[tuple[str, int, list[float]]]:
    """The requests still running that have generated tokens so far: each one's id, tokens and their times (read from
    the scheduler's request states: a time-limited mode counts them beside the finished requests)."""
    processor = manager.batch_processor
    if processor is None:
        return []
    for _ in range(5):  # (the generation thread may change the dict while it is copied)
        try:
            states = dict(processor.scheduler.active_requests)
            break
        except RuntimeError:
            continue
    else:
        return []
    return [(r, len(states[r].generated_tokens), list(states[r].timestamps or [])) for r in running
            if r in states and states[r].generated_tokens]


def _run_cb(model, attn, prompts, args, device, graphs: bool, asynchronous: bool | None = None, warm=None,
            measure=lambda: None) -> dict:
    from transformers import ContinuousBatchingConfig, GenerationConfig

    model.set_attn_implementation(attn)
    gen = GenerationConfig(max_new_tokens=args.new, do_sample=False, eos_token_id=-1, pad_token_id=0)
    # Graphs and asynchronous batching stay Transformers' choice for the attention at hand (recorded below), unless
    # graphs are turned off. Its default switch from sdpa to an installed flash attention is off: cb-sdpa must
    # measure sdpa.
    cb = ContinuousBatchingConfig(page_size=args.cb_page_size, max_batch_tokens=args.cb_max_batch_tokens,
                                  max_memory_percent=args.cb_memory, num_blocks=args.cb_num_blocks,
                                  auto_switch_to_flash=False, use_cuda_graph=None if graphs else False,
                                  use_async_batching=asynchronous)
    manager = model.init_continuous_batching(generation_config=gen, continuous_batching_config=cb)
    resolved = manager.continuous_batching_config
    setup = {"attn_implementation": model.config._attn_implementation,
             "cuda_graphs": list(resolved.cuda_graph_booleans), "async_batching": bool(resolved.use_async_batching)}
    manager.start()
    if warm:  # (untimed, through the same manager: its graphs are captured here, at the timed pass's shapes)
        left = {manager.add_request(p, max_new_tokens=args.new) for p in warm}
        while left:
            out = manager.get_result(timeout=1.0)
            if out is None:
                if not manager.is_running():
                    raise RuntimeError("the continuous batching loop stopped in the warm pass")
            elif out.error is not None:
                raise RuntimeError(f"the warm pass's request {out.request_id} failed: {out.error}")
            elif out.is_finished():
                left.discard(out.request_id)
    measure()
    ttft, itl, tokens = [], [], 0
    arrivals, arrived, ids = arrival_times(args), {}, []
    try:
        t0 = time.perf_counter()
        pending = set()
        with progress(len(prompts), f"cb-{attn}", args.progress) as bar:
            while pending or len(ids) < len(prompts):
                now = time.perf_counter() - t0
                if args.time_limit and now > args.time_limit:
                    # (reported as "time-limit": the requests finished by then, and every token produced by then,
                    # those of the requests still running included)
                    for rid, produced, stamps in produced_by_running(manager, pending):
                        tokens += produced
                        ttft += [stamps[0] - arrived[rid]] if stamps else []
                        itl += [b - a for a, b in zip(stamps, stamps[1:])]
                    for rid in pending:  # (else the manager's stop would wait for them to finish)
                        manager.cancel_request(rid)
                    break
                while len(ids) < len(prompts) and arrivals[len(ids)] <= now:  # (the requests due by now)
                    rid = manager.add_request(prompts[len(ids)], max_new_tokens=args.new, record_timestamps=True)
                    ids.append(rid)
                    pending.add(rid)
                    arrived[rid] = t0 + arrivals[len(ids) - 1]
                due = arrivals[len(ids)] - now if len(ids) < len(prompts) else 1.0
                out = manager.get_result(timeout=max(0.0, min(1.0, due)))
                if out is None:
                    if not manager.is_running():
                        raise RuntimeError("the continuous batching loop stopped")
                    continue
                if not out.is_finished() or out.request_id not in pending:
                    continue
                if out.error is not None:
                    raise RuntimeError(f"request {out.request_id} failed: {out.error}")
                pending.discard(out.request_id)
                bar.update(1)
                tokens += len(out.generated_tokens)
                stamps = out.timestamps or []
                if stamps:
                    ttft.append(stamps[0] - arrived[out.request_id])
                    itl += [b - a for a, b in zip(stamps, stamps[1:])]
        bc.synchronize(device)
        wall = time.perf_counter() - t0
    finally:
        manager.stop(block=True, timeout=60)
        # Nothing kept on the model: the next cb mode builds its own manager, and with it a paged cache laid out for
        # its attention (flashinfer_mla's latent rows and Transformers' MLA rows are not interchangeable).
        model.destroy_cached_continuous_batching_manager()
    setup["finished_requests"] = len(ids) - len(pending)
    cut = bool(pending) or len(ids) < len(prompts)
    return {"wall_s": wall, "tokens": tokens, "ttft": ttft, "itl": itl, "setup": setup, "cut": cut}


class StepTimes:
    """A generate() streamer that records when each step's tokens exist (its first call is the prompt)."""

    def __init__(self, device):
        self.device, self.times = device, []

    def put(self, value):
        bc.synchronize(self.device)
        self.times.append(time.perf_counter())

    def end(self):
        pass


def run_static(model, attn, prompts, args, device) -> dict:
    model.set_attn_implementation(attn)
    if args.warm_run:  # (untimed: one batch of other prompts of the first batch's lengths, its one-time costs paid)
        warm = make_prompts(args, model.config.vocab_size, seed=args.seed + 1)[: args.static_batch]
        _generate(model, warm, args, device, StepTimes(device), None)
    ttft, itl, tokens, finished = [], [], 0, 0
    t0 = time.perf_counter()
    with progress(len(prompts), f"generate-{attn}", args.progress) as bar:
        for start in range(0, len(prompts), args.static_batch):
            left = None if not args.time_limit else args.time_limit - (time.perf_counter() - t0)
            if left is not None and left <= 0:
                break
            batch = prompts[start : start + args.static_batch]
            steps = StepTimes(device)
            new = _generate(model, batch, args, device, steps, left)
            tokens += new * len(batch)
            finished += len(batch) if new == args.new else 0
            stamps = steps.times[1:]  # after the prompt
            ttft += [stamps[0] - t0] * len(batch)
            itl += [b - a for a, b in zip(stamps, stamps[1:])] * len(batch)
            bar.update(len(batch))
    wall = time.perf_counter() - t0
    return {"wall_s": wall, "tokens": tokens, "ttft": ttft, "itl": itl, "finished_requests": finished,
            "cut": finished < len(prompts)}


def _generate(model, batch: list[list[int]], args, device, steps: StepTimes, left: float | None) -> int:
    """One left-padded static batch through generate(); the new tokens each request got."""
    width = max(len(p) for p in batch)
    ids = torch.zeros(len(batch), width, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, p in enumerate(batch):
        ids[i, width - len(p):], mask[i, width - len(p):] = torch.tensor(p), 1
    chunked = {"prefill_chunk_size": args.prefill_chunk} if args.prefill_chunk else {}
    # (max_time: generate() stops the batch in flight at the limit, checked after each step; a prefill in progress
    # runs to its end)
    limited = {"max_time": left} if left is not None else {}
    out = model.generate(input_ids=ids.to(device), attention_mask=mask.to(device), max_new_tokens=args.new,
                         min_new_tokens=args.new, do_sample=False, eos_token_id=None, pad_token_id=0,
                         streamer=steps, **chunked, **limited)
    return out.shape[1] - width


def unpageable(attn: str) -> str | None:
    """Why Transformers' continuous batching cannot page the MLA latent for `attn` (None: it can). Up to 5.24 only
    this package's allocator holds it; 5.25 adds its own for eager/sdpa/flash."""
    import transformers

    from hf_flashinfer_mla import paged_cache

    if attn == "flashinfer_mla" or paged_cache.TRANSFORMERS_MLA_ALLOCATOR is not None:
        return None
    return f"Transformers {transformers.__version__} cannot page an MLA model's cache for {attn} (5.25+ can)"


def run(mode, model, prompts, args, device) -> dict:
    rec = {"mode": mode, "status": "ok"}
    kind, attn = mode.split("-", 1)
    prefill_ab, graphs = attn.endswith("-sdpa-prefill"), not attn.endswith("-no-graphs")
    mixed_graphs = not attn.endswith("-decode-graphs")
    token_indices, sparse_expanded = attn.endswith("-token-indices"), attn.endswith("-sparse-expanded")
    indexer_forward = attn.endswith("-indexer-forward")
    asynchronous = False if attn.endswith(("-sync", "-token-indices")) else None
    for suffix in ("-sdpa-prefill", "-no-graphs", "-decode-graphs", "-sync", "-token-indices", "-sparse-expanded",
                   "-indexer-forward"):
        attn = attn.removesuffix(suffix)
    why = unpageable(attn) if kind == "cb" else None
    if why:
        return {**rec, "status": "skipped", "message": why}
    bc.free_memory(device)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    try:
        if kind == "cb":
            got = run_cb(model, attn, prompts, args, device, sdpa_prefill=prefill_ab, graphs=graphs,
                         mixed_graphs=mixed_graphs, asynchronous=asynchronous, token_indices=token_indices,
                         sparse_expanded=sparse_expanded, indexer_forward=indexer_forward)
            rec.update(got["setup"])
        else:
            got = run_static(model, attn, prompts, args, device)
            rec["finished_requests"] = got["finished_requests"]
        rec.update(
            wall_s=got["wall_s"], output_tokens=got["tokens"], tokens_per_s=got["tokens"] / got["wall_s"],
            ttft_p50_s=percentile(got["ttft"], 50), ttft_p99_s=percentile(got["ttft"], 99),
            itl_p50_ms=None if not got["itl"] else 1e3 * percentile(got["itl"], 50),
            itl_p99_ms=None if not got["itl"] else 1e3 * percentile(got["itl"], 99),
            itl_mean_ms=None if not got["itl"] else 1e3 * statistics.fmean(got["itl"]),
        )
        if got["cut"]:
            # Not every request finished within --time-limit: what finished, the tokens produced by then (the
            # unfinished requests' too) over the wall time, and the latencies of every token produced: TTFT over the
            # requests that had a first token by then (their count beside it; the others waited longer).
            rec.update(status="time-limit", requests_with_tokens=len(got["ttft"]),
                       message=f"{rec['finished_requests']} of {len(prompts)} requests finished, "
                               f"{len(got['ttft'])} had tokens, and {got['tokens']} tokens were produced within "
                               f"--time-limit {args.time_limit:g} s")
    except Exception as exc:  # noqa: BLE001  (an OOM or a failure is a result of its cell, the others still run)
        rec.update(bc.failure(exc))
        if bc.is_fatal_cuda_error(exc):
            raise
    if device.type == "cuda":
        rec["peak_memory_mib"] = torch.cuda.max_memory_allocated(device) / bc.MIB
    bc.free_memory(device)
    return rec


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="deepseek-v2-lite", choices=bc.MODEL_NAMES)
    p.add_argument("--layers", type=int, default=None)
    p.add_argument("--requests", type=int, default=256)
    p.add_argument("--prompt-min", type=int, default=128)
    p.add_argument("--prompt-max", type=int, default=4096)
    p.add_argument("--new", type=int, default=256)
    p.add_argument("--static-batch", type=int, default=32)
    p.add_argument("--request-rate", type=float, default=None,
                   help="cb modes: requests arrive as a Poisson process of this many per second (TTFT from each "
                        "request's arrival) instead of all at t0; the generate modes refuse it")
    p.add_argument("--prefill-chunk", type=int, default=None,
                   help="generate() modes: prefill_chunk_size (default: the whole prompt at once)")
    p.add_argument("--modes", nargs="+", default=list(MODES), choices=MODES + AB_MODES)
    p.add_argument("--cb-page-size", type=int, default=256)
    p.add_argument("--cb-max-batch-tokens", type=int, default=None, help="default: Transformers' (8192)")
    p.add_argument("--cb-memory", type=float, default=None, help="max_memory_percent (default: Transformers')")
    p.add_argument("--cb-num-blocks", type=int, default=None)
    p.add_argument("--time-limit", type=float, default=None,
                   help="end each mode after this many seconds (status time-limit: the requests finished and the "
                        "tokens produced by then, unfinished requests' included); a generate() batch stops at its "
                        "next step past the limit, a prefill in progress runs to its end")
    p.add_argument("--step-split", action="store_true",
                   help="cb flashinfer_mla modes: time every step (device synchronized at its ends) and profile the "
                        "uncompiled ones' GPU-busy time (with --warm-run, the graphed ones' too); report per kind of "
                        "step, its top kernels and the bound on what CUDA graphs for them could gain (step_split.py)")
    p.add_argument("--loop-split", action="store_true",
                   help="cb flashinfer_mla modes: each step's wall time split into Transformers' scheduling and batch "
                        "preparation, the package's step plan, the forward, the wait for the GPU and the request "
                        "updates, timed on the generation thread, with the step's GPU span (loop_split.py)")
    p.add_argument("--warm-run", action="store_true",
                   help="steady state: cb modes run the load once untimed first, through the same manager "
                        "(prompts of the same lengths, other tokens), so that the timed pass replays graphs captured "
                        "before it (with --step-split its graphed steps are profiled too); generate modes run one "
                        "untimed batch of the first batch's lengths")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--dtype", default="bfloat16", choices=sorted(bc.DTYPES))
    p.add_argument("--device", default="cuda")
    p.add_argument("--experts-impl", default=None)
    p.add_argument("--no-progress", dest="progress", action="store_false", help="no progress bars")
    p.add_argument("--out", default=None)
    p.add_argument("--name", default=None, help="JSON file name (default: serving_<model>.json)")
    args = p.parse_args(argv)
    if not 1 <= args.prompt_min <= args.prompt_max or args.new < 1 or args.requests < 1:
        p.error("need 1 <= --prompt-min <= --prompt-max, --new >= 1 and --requests >= 1")
    if args.request_rate is not None and (args.request_rate <= 0 or any(m.startswith("generate") for m in args.modes)):
        p.error("--request-rate must be > 0 and applies to the cb modes only (static batches wait for no arrivals)")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    device, dtype = bc.resolve_device(args.device), bc.DTYPES[args.dtype]
    name = args.name or f"serving_{args.model}.json"
    payload = {"metadata": bc.environment(device, args), "results": []}
    config = bc.build_config(args.model, args.layers)
    config.eos_token_id = None
    model = bc.build_model(config, dtype, device, args.experts_impl)
    prompts = make_prompts(args, config.vocab_size)
    for mode in args.modes:
        rec = run(mode, model, prompts, args, device)
        payload["results"].append(rec)
        shown = f"{rec['tokens_per_s']:.1f} tok/s" if rec["status"] == "ok" else rec["status"]
        shown += f": {rec['message']}" if rec.get("message") else ""
        print(f"  {args.model} {mode}: {shown}", flush=True)
        if rec.get("step_split"):
            split = rec["step_split"]
            for kind, r in split["kinds"].items():
                busy = f", GPU busy {r['gpu_busy_s']:.2f} s" if "gpu_busy_s" in r else ""
                print(f"    {kind} steps: {r['steps']}, {r['tokens']} tokens, wall {r['wall_s']:.2f} s{busy}")
            bound = "none" if split["graph_bound"] is None else f"{split['graph_bound']:.3f}x"
            print(f"    uncompiled steps' host share {split['saveable_s']:.2f} s of "
                  f"{split['wall_s_without_profiler']:.2f} s: graphs for them gain at most {bound}", flush=True)
            for kind, top in split["top_kernels_s"].items():
                n = split["kinds"][kind]["steps"]
                print(f"    {kind}: top kernels, ms per step: " + "; ".join(
                    f"{1e3 * t / n:.3f} {name[:90]}" for name, t in top[:8]), flush=True)
        if rec.get("loop_split"):
            for kind, r in rec["loop_split"]["kinds"].items():
                phases = ", ".join(f"{p} {ms:.2f}" for p, ms in r["phases_ms"].items())
                gpu = f", GPU span {r['gpu_span_ms']:.2f} ms" if "gpu_span_ms" in r else ""
                print(f"    {kind}: {r['steps']} steps, {r['wall_ms']:.2f} ms each{gpu} ({phases})", flush=True)
        bc.write_json(args.out, name, payload)
    rows = []
    for r in payload["results"]:
        shown = r["status"] in ("ok", "time-limit")
        rows.append([r["mode"], *(bc.fmt(r.get(k) if shown else None, f) for k, f in (
                         ("tokens_per_s", ".1f"), ("ttft_p50_s", ".2f"), ("ttft_p99_s", ".2f"), ("itl_p50_ms", ".1f"),
                         ("itl_p99_ms", ".1f"))),
                     bc.fmt(r.get("peak_memory_mib"), ".0f"),
                     f"{r['graphed_steps']}/{r['steps']} ({r['graphed_mixed_steps']} mixed)" if "steps" in r else "",
                     "" if r["status"] == "ok" else
                     f"TIME-LIMIT ({r['finished_requests']}/{args.requests} finished, {r['requests_with_tokens']} "
                     f"with tokens)" if r["status"] == "time-limit" else r["status"].upper()])
    print()
    arriving = f"arriving at {args.request_rate}/s" if args.request_rate else "at once"
    bc.print_table(["mode", "out tok/s", "TTFT p50 s", "TTFT p99 s", "ITL p50 ms", "ITL p99 ms", "peak MiB",
                    "steps in graphs", ""],
                   rows, [f"{args.model}: {args.requests} requests {arriving}, prompts {args.prompt_min}-"
                          f"{args.prompt_max} tokens, {args.new} new tokens each, greedy; static batches of "
                          f"{args.static_batch}"])
    path = bc.write_json(args.out, name, payload)
    if path:
        print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
