"""Host time of one continuous-batching decode step's preparation, with the rows of every request listed token by
token in Python (Transformers' read indices) against laid out from the cache's block tables.

Transformers prepares each step on the host (``ContinuousBatchingIOs.prepare_batch_tensors``): the step's tokens,
positions, lengths, write indices, and for the paged attention the read indices of every request's every cached row,
as Python lists (``FullAttentionCacheAllocator.get_read_indices``). With ``flashinfer_mla`` the latent allocator
lists none; the package's step (``paged_attention.prepare_step``) takes each request's blocks instead, a few values
per request, and lays the rows out on the device before the forward (``PagedStep.launch``). This script times both
on one process and one cache, for a decode step of R requests with C cached tokens each:

* ``prepare``: ``prepare_batch_tensors`` (Transformers' loop and this package's seam after it), host only;
* ``launch``: the step's device work (the rows written into the cache's rows buffer); on a CPU it runs on the host
  too, on a GPU (``--device cuda``) it is a few kernel launches, timed on the host (the device is synchronized
  between steps, outside the timed parts).

No model runs: a tiny latent width (the host work depends on requests and rows, not on their width) and
Transformers' default pages of 256 tokens. Prints a table and writes JSON under ``--out``.

    python scripts/bench_step_prep.py --requests 16 256 --contexts 1024 2048 4096 8192
    python scripts/bench_step_prep.py --device cuda
"""

from __future__ import annotations

import argparse
import json
import pathlib
import statistics
import time

import torch
from transformers import CONFIG_MAPPING, ContinuousBatchingConfig, LogitsProcessorList
from transformers.generation.continuous_batching.cache import PagedAttentionCache
from transformers.generation.continuous_batching.cb_logits_processors import ContinuousBatchingLogitsProcessorList
from transformers.generation.continuous_batching.input_outputs import ContinuousBatchingIOs
from transformers.generation.continuous_batching.requests import RequestStatus, create_warmup_future_states

import hf_flashinfer_mla  # noqa: F401  (registers flashinfer_mla and its seams)
from hf_flashinfer_mla import paged_attention, paged_cache

try:
    from transformers.generation.continuous_batching.distributed import DistributedHelper
except ImportError:  # (releases that keep it in cache.py)
    from transformers.generation.continuous_batching.cache import DistributedHelper

MODES = {"token-indices": False, "block-tables": True}


def latent_config():
    config = CONFIG_MAPPING["deepseek_v3"](
        vocab_size=64, hidden_size=64, intermediate_size=64, moe_intermediate_size=32, num_hidden_layers=1,
        num_attention_heads=4, num_key_value_heads=4, kv_lora_rank=32, q_lora_rank=None, qk_rope_head_dim=8,
        qk_nope_head_dim=8, v_head_dim=8, head_dim=8, n_routed_experts=2, num_experts_per_tok=1,
        first_k_dense_replace=1)
    config._attn_implementation = "flashinfer_mla"
    return config


def build(requests: int, context: int, page_size: int, device: torch.device = torch.device("cpu")):
    config = latent_config()
    blocks = requests * (-(-(context + 1) // page_size)) + 8
    cb = ContinuousBatchingConfig(page_size=page_size, num_blocks=blocks, max_batch_tokens=max(256, requests),
                                  max_memory_percent=0.5, max_blocks_per_request=0)
    cb.max_requests_per_batch = requests
    cache = PagedAttentionCache(config, cb, device, DistributedHelper(None, None), dtype=torch.bfloat16)
    processors = ContinuousBatchingLogitsProcessorList(LogitsProcessorList())
    io = ContinuousBatchingIOs(cache, config, cb, device, torch.bfloat16, processors)
    states = create_warmup_future_states(requests, RequestStatus.DECODING, 1, context - 1, cache)
    if len(states) != requests:
        raise SystemExit(f"the cache holds {len(states)} of {requests} requests of {context} tokens")
    return cache, io, processors, states


def one_step(cache, io, processors, states, context: int) -> tuple[float, float]:
    for fs in states:  # (prepare_batch_tensors advances each request: put it back at the same step)
        fs.state.position_offset = context - 1
        fs.state.tokens_to_process = [0]
    if io.device.type == "cuda":
        torch.cuda.synchronize(io.device)
    t0 = time.perf_counter()
    io.prepare_batch_tensors(states, processors, False, len(states), len(states) * (context - 1), False)
    t1 = time.perf_counter()
    paged_attention.launch_steps(cache, io.compute_stream)
    t2 = time.perf_counter()
    if io.device.type == "cuda":
        torch.cuda.synchronize(io.device)
    return t1 - t0, t2 - t1


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=int, nargs="+", default=[16, 256])
    parser.add_argument("--contexts", type=int, nargs="+", default=[1024, 2048, 4096, 8192])
    parser.add_argument("--page-size", type=int, default=256, help="tokens per page (Transformers' default: 256)")
    parser.add_argument("--steps", type=int, default=15, help="timed steps per mode and cell (median reported)")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--out", default="bench_out")
    args = parser.parse_args()
    torch.set_num_threads(1)
    device = torch.device(args.device)

    rows = []
    for requests in args.requests:
        for context in args.contexts:
            cache, io, processors, states = build(requests, context, args.page_size, device)
            times = {mode: ([], []) for mode in MODES}
            expected = None
            for i in range(args.steps + 2):  # (the first two rounds warm up)
                for mode, from_tables in MODES.items():  # alternated, on the same cache and requests
                    paged_cache.ROWS_FROM_BLOCK_TABLES = from_tables
                    prep, launch = one_step(cache, io, processors, states, context)
                    step = next(a.step for a in cache.cache_allocators.values() if hasattr(a, "step"))
                    allocator = next(a for a in cache.cache_allocators.values() if hasattr(a, "step"))
                    laid = (allocator.rows[: step.pages.end] if step.tables is not None else
                            io.read_index_storage[allocator.index, : step.pages.end]).cpu()
                    if expected is None:
                        expected = laid.clone()
                    elif not torch.equal(laid, expected):  # both ways must name the same rows
                        raise SystemExit(f"{mode}: the step's rows differ from the other way's")
                    if i >= 2:
                        times[mode][0].append(prep)
                        times[mode][1].append(launch)
            paged_cache.ROWS_FROM_BLOCK_TABLES = True
            row = {"requests": requests, "context": context, "rows": int(expected.numel())}
            for mode, (prep, launch) in times.items():
                row[f"{mode}_prepare_ms"] = 1e3 * statistics.median(prep)
                row[f"{mode}_launch_ms"] = 1e3 * statistics.median(launch)
            row["prepare_ratio"] = row["token-indices_prepare_ms"] / row["block-tables_prepare_ms"]
            rows.append(row)
            print(f"R={requests:4d} C={context:5d}: token indices {row['token-indices_prepare_ms']:8.2f} ms, "
                  f"block tables {row['block-tables_prepare_ms']:6.2f} ms (+ {row['block-tables_launch_ms']:.2f} ms "
                  f"laying out rows on {device.type})", flush=True)

    print("\nHost time to prepare one decode step (median of %d, ms; page size %d)" % (args.steps, args.page_size))
    print(f"| requests | context | rows | token indices | block tables | ratio | block tables: rows laid out "
          f"({device.type}) |")
    print("|---:|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        print(f"| {r['requests']} | {r['context']} | {r['rows']:,} | {r['token-indices_prepare_ms']:.2f} | "
              f"{r['block-tables_prepare_ms']:.2f} | {r['prepare_ratio']:.1f}x | {r['block-tables_launch_ms']:.2f} |")
    out = pathlib.Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    meta = {"torch": torch.__version__, "transformers": __import__("transformers").__version__,
            "page_size": args.page_size, "steps": args.steps, "device": str(device),
            "gpu": torch.cuda.get_device_name(device) if device.type == "cuda" else None}
    (out / f"step_prep_{device.type}.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
    print(f"\nwrote {out / f'step_prep_{device.type}.json'}")


if __name__ == "__main__":
    main()
