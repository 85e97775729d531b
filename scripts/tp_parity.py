#!/usr/bin/env python3
"""Tensor-parallel parity: an MLA checkpoint loaded with Transformers' ``tp_plan="auto"`` under torchrun, against
the same checkpoint on one device.

Launched once per side by ``tests/test_tensor_parallel_cpu.py`` (gloo, float64) and
``tests/gpu/test_tensor_parallel.py`` (NCCL, bf16); usable by hand on any checkpoint:

    python scripts/tp_parity.py make --shape v2-lite --ckpt /tmp/tp/v2-lite       # random weights, saved once
    python scripts/tp_parity.py run --ckpt /tmp/tp/v2-lite --out /tmp/tp/tp1      # one device (cuda:0 / cpu)
    torchrun --nproc-per-node 2 scripts/tp_parity.py run --ckpt /tmp/tp/v2-lite --out /tmp/tp/tp2
    python scripts/tp_parity.py compare /tmp/tp/tp1/v2-lite.pt /tmp/tp/tp2/v2-lite.pt

``run`` loads each checkpoint (with ``tp_plan="auto"`` when ``WORLD_SIZE`` > 1, i.e. under torchrun), and for each
``--attn`` implementation: prefills a left-padded batch and feeds ``--steps`` teacher-forced decode tokens one step
at a time (``DynamicCache``), then runs a greedy ``generate()`` on an unpadded batch (its default cache).
Rank 0 writes ``OUT/NAME.pt`` (a ``torch.save`` dict: logits on the CPU, tokens, top-2 margins) and
``OUT/NAME.pt.json`` (tokens, what each rank holds, what the attention function received, whether all ranks
ended with the same logits). Both sides load from disk: ``from_pretrained`` is the only way Transformers shards a
model, and loading the same files keeps the two sides' weights bit-identical.

``--attn flashinfer_mla:roll-heads`` is a control: the attention function gets its query heads rolled by one
(query head h meets key/value head h+1), i.e. heads misaligned with ``kv_b_proj``'s shard, the class of fault a
tensor-parallel MLA bug produces. The comparison must flag it; the JSON counts the decode calls it was applied to.
It records teacher-forced logits only (no greedy run).

A checkpoint given as ``DIR@attn-plan`` also gets its MLA attention sharded by heads, through Transformers' own
mechanism (``DistributedConfig(tp_plan={...})``, merged into the model's ``base_model_tp_plan``): a prototype for
DeepSeek-V3 / Kimi-K2 and Mistral 4, whose shipped plans leave attention replicated. See `mla_attention_tp_plan`.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time

import torch

SCRIPTS = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, SCRIPTS)

DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32, "float64": torch.float64}
# GPU-sized shapes (random weights), from bench_common.py's presets with a few test-friendly overrides: no EOS (so
# greedy runs have a fixed length), pad id 0, and wider random init (peaked logits; the GPU tests use 0.05 too).
SHAPES = {"v2-lite": "deepseek-v2-lite", "v3-attn": "deepseek-v3-attn"}
FAULTS = ("roll-heads",)


# ------------------------------------------------------------------------------------------------------- plans
def mla_attention_tp_plan(config) -> dict[str, str]:
    """Plan entries that shard MLA attention by heads, as Transformers' deepseek_v2/glm4_moe_lite/minicpm3 plans do.

    For model types whose shipped ``base_model_tp_plan`` replicates attention (deepseek_v3 = V3/R1/Kimi-K2,
    mistral4). Passed as ``DistributedConfig(tp_plan=...)``, Transformers merges it into the model's plan. Not for
    kimi_linear: its linear-attention layers are also called ``self_attn`` and own a ``q_proj``/``o_proj`` that
    such wildcard entries would shard wrongly.
    """
    if config.model_type not in ("deepseek_v3", "mistral4"):
        raise ValueError(f"no head-sharded MLA plan prototype for model_type {config.model_type!r}")
    attn = "model.layers.*.self_attn."
    query = "q_proj" if getattr(config, "q_lora_rank", None) is None else "q_b_proj"
    return {
        attn + query: "colwise",  # query heads split across ranks
        attn + "kv_b_proj": "colwise",  # the same heads' W_UK/W_UV
        attn + "o_proj": "rowwise",  # partial outputs summed (one all-reduce per layer)
        attn + "kv_a_proj_with_mqa": "mla_kv_a_proj",  # latent replicated; rope part's gradient all-reduced
    }


def supports_plan_override() -> bool:
    """Whether this Transformers takes ``DistributedConfig(tp_plan={...})`` (5.2x; the GPU host's 5.17 may not)."""
    try:
        from transformers import DistributedConfig
    except ImportError:
        return False
    return "tp_plan" in getattr(DistributedConfig, "__dataclass_fields__", {})


def tp_load_kwargs(extra_plan: dict | None) -> dict:
    """``from_pretrained`` keywords for tensor parallelism across ``WORLD_SIZE`` ranks.

    Transformers 5.2x takes ``distributed_config=DistributedConfig(tp_plan=...)`` (a dict overrides individual
    rules of the model's plan); older releases take ``tp_plan="auto"``.
    """
    if supports_plan_override():
        from transformers import DistributedConfig

        return {"distributed_config": DistributedConfig(tp_plan=extra_plan or "auto")}
    if extra_plan:
        raise SystemExit("DIR@attn-plan needs a transformers release with DistributedConfig(tp_plan={...})")
    return {"tp_plan": "auto"}


# ------------------------------------------------------------------------------------------------------- make
def make_checkpoint(shape: str, ckpt: str, dtype: torch.dtype, device: str, layers: int | None = None,
                    vocab: int | None = None, seed: int = 0) -> None:
    """Build `shape` with random weights directly on `device` and save it to `ckpt` (skipped if already there)."""
    import transformers
    from bench_common import build_config

    if os.path.exists(os.path.join(ckpt, "config.json")):
        print(f"{ckpt}: exists, reused")
        return
    config = build_config(SHAPES[shape], layers)
    config.update(dict(eos_token_id=None, pad_token_id=0, bos_token_id=None, initializer_range=0.05))
    if vocab:
        config.vocab_size = vocab
    torch.manual_seed(seed)
    t0 = time.perf_counter()
    with torch.device(device):
        model = transformers.AutoModelForCausalLM.from_config(config, dtype=dtype)
    tmp = ckpt.rstrip("/") + ".partial"
    model.save_pretrained(tmp)
    os.replace(tmp, ckpt)  # a killed run leaves no half-written checkpoint that looks complete
    n = sum(p.numel() for p in model.parameters())
    print(f"{ckpt}: {shape}, {config.num_hidden_layers} layers, {n / 1e9:.2f} B params, "
          f"{time.perf_counter() - t0:.0f} s")


# ------------------------------------------------------------------------------------------------------- run
@dataclasses.dataclass
class Probe:
    """Wraps the registered flashinfer_mla attention function: records what it receives, optionally injects a fault."""

    fault: str | None = None
    query_heads: set = dataclasses.field(default_factory=set)
    latent_inputs: int = 0
    decode_calls: int = 0
    faulted: int = 0

    def install(self):
        from transformers import AttentionInterface
        from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

        from hf_flashinfer_mla.models import ATTN_NAME

        real = ALL_ATTENTION_FUNCTIONS[ATTN_NAME]

        def probed(module, query, key, value, *args, **kwargs):
            self.query_heads.add(query.shape[1])
            self.latent_inputs += key.shape[1] == 1  # the hook hands over the latent, not per-head keys
            if query.shape[2] <= 8:
                self.decode_calls += 1
                if self.fault == "roll-heads":
                    if query.shape[1] < 2:
                        raise RuntimeError("roll-heads needs at least two heads per rank")
                    query = query.roll(1, dims=1)
                    self.faulted += 1
            return real(module, query, key, value, *args, **kwargs)

        AttentionInterface.register(ATTN_NAME, probed)
        return lambda: AttentionInterface.register(ATTN_NAME, real)

    def summary(self) -> dict:
        return {"query_heads": sorted(self.query_heads), "latent_inputs": self.latent_inputs,
                "decode_calls": self.decode_calls, "faulted": self.faulted}


def inputs(vocab: int, lengths, steps: int, gen_batch: int, gen_prompt: int, seed: int = 1):
    """Left-padded prompts + their mask, teacher-forced tokens, and unpadded generate() prompts (same on every rank)."""
    g = torch.Generator().manual_seed(seed)
    width = max(lengths)
    ids = torch.zeros(len(lengths), width, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, n in enumerate(lengths):
        ids[i, width - n:] = torch.randint(1, vocab, (n,), generator=g)
        mask[i, width - n:] = 1
    forced = torch.randint(1, vocab, (len(lengths), steps), generator=g)
    gen_ids = torch.randint(1, vocab, (gen_batch, gen_prompt), generator=g)
    return ids, mask, forced, gen_ids


@torch.no_grad()
def teacher_forced(model, ids, mask, forced, cache_kw: str) -> torch.Tensor:
    """Prefill, then one forced token per step through the same DynamicCache; logits [B, T, V] on the CPU, in
    float32 or the model's dtype if wider (float64 parity would vanish in float32 rounding)."""
    from transformers import DynamicCache

    cache = DynamicCache(config=model.config)
    pos = (mask.cumsum(-1) - 1).clamp(min=0)
    model(input_ids=ids, attention_mask=mask, position_ids=pos, use_cache=True, **{cache_kw: cache})
    steps = []
    for t in range(forced.shape[1]):
        mask = torch.cat([mask, torch.ones_like(mask[:, :1])], dim=-1)
        pos = pos[:, -1:] + 1
        out = model(input_ids=forced[:, t:t + 1], attention_mask=mask, position_ids=pos, use_cache=True,
                    logits_to_keep=1, **{cache_kw: cache})
        steps.append(out.logits[:, -1].to(torch.promote_types(out.logits.dtype, torch.float32)).cpu())
    return torch.stack(steps, dim=1)


def describe_attention(model) -> dict:
    """What this rank holds for the first MLA attention: kv_b_proj/o_proj as DTensor or not, global vs local rows."""
    from torch.distributed.tensor import DTensor

    from hf_flashinfer_mla.models import is_mla_attention

    module = next(m for m in model.modules() if is_mla_attention(m))
    held = {"module_num_heads": getattr(module, "num_heads", None)}
    for name in ("q_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj", "o_proj"):
        proj = getattr(module, name, None)
        if proj is None:
            continue
        w = proj.weight
        local = w.to_local() if isinstance(w, DTensor) else w
        held[name] = {"dtensor": isinstance(w, DTensor), "global": list(w.shape), "local": list(local.shape),
                      "placements": [str(p) for p in w.placements] if isinstance(w, DTensor) else None}
    return held


def run(args) -> int:
    import hf_flashinfer_mla  # noqa: F401  (registers attn_implementation="flashinfer_mla")

    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world > 1 and args.device == "cpu" and not torch.distributed.is_initialized():
        torch.distributed.init_process_group("gloo")  # what Transformers picks on a CPU mesh; explicit for clarity
    os.makedirs(args.out, exist_ok=True)
    for spec in args.ckpt:
        path, _, variant = spec.partition("@")
        if variant not in ("", "attn-plan"):
            raise SystemExit(f"unknown checkpoint variant {variant!r} in {spec!r}; known: attn-plan")
        name = os.path.basename(path.rstrip("/")) + (f"@{variant}" if variant else "")
        run_checkpoint(args, path, variant == "attn-plan", os.path.join(args.out, name + ".pt"))
    if world > 1:
        torch.distributed.barrier()
        torch.distributed.destroy_process_group()
    return 0


def run_checkpoint(args, ckpt: str, attn_plan: bool, out_path: str) -> None:
    import gc

    import transformers

    from bench_common import cache_kwarg

    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    dtype = DTYPES[args.dtype]
    config = transformers.AutoConfig.from_pretrained(ckpt)
    extra_plan = mla_attention_tp_plan(config) if attn_plan else None
    kwargs = dict(dtype=dtype, attn_implementation="eager")
    if args.experts_impl:
        kwargs["experts_implementation"] = args.experts_impl
    if world > 1:
        kwargs.update(tp_load_kwargs(extra_plan))
    else:
        kwargs["device_map"] = args.device if args.device == "cpu" else "cuda:0"
    t0 = time.perf_counter()
    # The saved architecture, not AutoModelForCausalLM: Transformers 5.24 does not map mistral4 there.
    cls = getattr(transformers, (config.architectures or ["AutoModelForCausalLM"])[0])
    model = cls.from_pretrained(ckpt, **kwargs).eval()
    load_s = time.perf_counter() - t0
    device = model.device
    ids, mask, forced, gen_ids = (t.to(device) for t in inputs(
        config.vocab_size, args.lengths, args.steps, args.gen_batch, args.gen_prompt, args.seed))
    cache_kw = cache_kwarg(model)
    results = {"runs": {}}
    meta = {"world_size": world, "device": str(device), "dtype": args.dtype, "model_type": config.model_type,
            "num_attention_heads": config.num_attention_heads, "ckpt": ckpt, "load_seconds": load_s,
            "attn_tp_plan": extra_plan, "torch": str(torch.__version__), "transformers": str(transformers.__version__),
            "held": describe_attention(model), "runs": {}}
    for spec in args.attn:
        attn, _, fault = spec.partition(":")
        if fault and fault not in FAULTS:
            raise SystemExit(f"unknown fault {fault!r}; known: {FAULTS}")
        model.set_attn_implementation(attn)
        probe = Probe(fault or None)
        restore = probe.install()
        try:
            t0 = time.perf_counter()
            logits = teacher_forced(model, ids, mask, forced, cache_kw)
            tf_s = time.perf_counter() - t0
            if fault:  # the control needs the logits only
                results["runs"][spec] = {"logits": logits}
                meta["runs"][spec] = {"probe": probe.summary(), "teacher_forced_seconds": tf_s}
                continue
            with torch.no_grad():
                out = model.generate(input_ids=gen_ids, attention_mask=torch.ones_like(gen_ids),
                                     max_new_tokens=args.gen_tokens, do_sample=False, output_logits=True,
                                     return_dict_in_generate=True)
        finally:
            restore()
        top2 = torch.stack(out.logits, dim=1).float().topk(2, dim=-1).values
        run = {"logits": logits, "tokens": out.sequences[:, gen_ids.shape[1]:].cpu(),
               "margins": (top2[..., 0] - top2[..., 1]).cpu()}
        results["runs"][spec] = run
        meta["runs"][spec] = {"probe": probe.summary(), "teacher_forced_seconds": tf_s,
                              "tokens": run["tokens"].tolist()}
        if attn == "flashinfer_mla" and device.type == "cuda" and probe.query_heads:
            from hf_flashinfer_mla.capabilities import choose_backend, requested_backend

            meta["runs"][spec]["backend_for_local_heads"] = choose_backend(
                device, dtype, config.kv_lora_rank, config.qk_rope_head_dim, max(probe.query_heads),
                requested_backend(None, config))
        print(f"[rank {rank}] {os.path.basename(ckpt)} {spec}: {probe.summary()}, teacher-forced {tf_s:.1f} s",
              flush=True)
    if world > 1:
        # Every rank must end with the same logits (lm_head's output is gathered): checked, not assumed.
        fingerprint = [(spec, r["logits"].double().sum().item(), r.get("tokens", torch.zeros(0)).tolist())
                       for spec, r in results["runs"].items()]
        fingerprints, held = [None] * world, [None] * world
        torch.distributed.all_gather_object(fingerprints, fingerprint)
        torch.distributed.all_gather_object(held, meta["held"])
        meta["ranks_agree"] = all(f == fingerprints[0] for f in fingerprints)
        meta["held_by_rank"] = held
    if rank == 0:
        results["meta"] = meta
        torch.save(results, out_path)
        with open(out_path + ".json", "w") as f:
            json.dump(meta, f, indent=1, default=str)
        print(f"wrote {out_path} and {out_path}.json", flush=True)
    del model
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


# ------------------------------------------------------------------------------------------------------- compare
def compare_logits(ours: torch.Tensor, oracle: torch.Tensor) -> tuple[float, float]:
    """(relative Frobenius error, fraction of positions whose argmax agrees)."""
    err = ((ours.double() - oracle.double()).norm() / oracle.double().norm()).item()
    top1 = (ours.argmax(-1) == oracle.argmax(-1)).double().mean().item()
    return err, top1


def greedy_divergence(ours: dict, oracle: dict, noise: float) -> list[dict]:
    """Per sequence: the first step where greedy tokens differ, and whether the oracle was near-tied there.

    In bf16 with random weights, two correct runs can pick different tokens where the top two logits are closer
    than the numerical noise between them; after that the sequences legitimately differ. `noise` is the largest
    |logit difference| measured between the two sides on the teacher-forced steps.
    """
    rows = []
    for i in range(oracle["tokens"].shape[0]):
        diff = (ours["tokens"][i] != oracle["tokens"][i]).nonzero()
        step = int(diff[0]) if len(diff) else None
        margin = float(oracle["margins"][i, step]) if step is not None else None
        rows.append({"first_diff": step, "oracle_margin": margin,
                     "near_tie": step is not None and margin <= 2 * noise})
    return rows


def compare(one: dict, many: dict, spec: str, oracle_spec: str | None = None) -> dict:
    """Run `spec` of `many` against run `oracle_spec` (default: the same) of `one`: logits, then greedy tokens."""
    a, b = many["runs"][spec], one["runs"][oracle_spec or spec]
    err, top1 = compare_logits(a["logits"], b["logits"])
    noise = (a["logits"] - b["logits"]).abs().max().item()
    result = {"rel_err": err, "top1": top1, "max_abs_diff": noise, "tokens_equal": None, "greedy": []}
    if "tokens" in a and "tokens" in b:  # faulted runs record no greedy run
        result.update(tokens_equal=torch.equal(a["tokens"], b["tokens"]), greedy=greedy_divergence(a, b, noise))
    return result


def compare_main(args) -> int:
    one, many = (torch.load(path, weights_only=True) for path in (args.one, args.many))
    oracles = [spec for spec in one["runs"] if ":" not in spec]  # faulted runs are no oracle
    print(f"{'TP=' + str(many['meta']['world_size']):<26} {'TP=1':<15} {'rel err':>9} {'top-1':>6} {'tokens':>7}  "
          "first greedy difference per sequence (step, oracle's top-2 margin)")
    for spec in many["runs"]:
        for oracle in oracles:
            r = compare(one, many, spec, oracle)
            diffs = ", ".join("-" if g["first_diff"] is None else f"{g['first_diff']} ({g['oracle_margin']:.3g})"
                              for g in r["greedy"])
            print(f"{spec:<26} {oracle:<15} {r['rel_err']:9.2e} {r['top1']:6.3f} {str(r['tokens_equal']):>7}  "
                  f"{diffs}")
    return 0


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="cmd", required=True)
    m = sub.add_parser("make", help="save a random-weight checkpoint of a GPU-sized shape")
    m.add_argument("--shape", choices=sorted(SHAPES), required=True)
    m.add_argument("--ckpt", required=True)
    m.add_argument("--layers", type=int, default=None, help="default: the preset's (27 for v2-lite, 4 for v3-attn)")
    m.add_argument("--vocab", type=int, default=None)
    m.add_argument("--dtype", default="bfloat16", choices=sorted(DTYPES))
    m.add_argument("--device", default="cuda")
    r = sub.add_parser("run", help="load CKPT (sharded under torchrun) and record logits and tokens")
    r.add_argument("--ckpt", nargs="+", required=True,
                   help="checkpoint dirs; DIR@attn-plan also shards attention by heads (see mla_attention_tp_plan)")
    r.add_argument("--out", required=True, help="directory: rank 0 writes NAME.pt and NAME.pt.json per checkpoint")
    r.add_argument("--attn", nargs="+", default=["flashinfer_mla", "eager"],
                   help="implementations, in order; NAME:roll-heads injects the control fault")
    r.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    r.add_argument("--dtype", default="bfloat16", choices=sorted(DTYPES))
    r.add_argument("--experts-impl", default=None, help='e.g. "eager" (needed for float64 MoE on the CPU)')
    r.add_argument("--lengths", type=int, nargs="+", default=[37, 20, 64, 5], help="left-padded prompt lengths")
    r.add_argument("--steps", type=int, default=64, help="teacher-forced decode steps")
    r.add_argument("--gen-batch", type=int, default=2)
    r.add_argument("--gen-prompt", type=int, default=16)
    r.add_argument("--gen-tokens", type=int, default=16)
    r.add_argument("--seed", type=int, default=1)
    c = sub.add_parser("compare", help="print TP=N against TP=1")
    c.add_argument("one")
    c.add_argument("many")
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.cmd == "make":
        make_checkpoint(args.shape, args.ckpt, DTYPES[args.dtype], args.device, args.layers, args.vocab)
        return 0
    if args.cmd == "run":
        return run(args)
    return compare_main(args)


if __name__ == "__main__":
    sys.exit(main())
