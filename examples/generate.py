"""Generate with ``attn_implementation="flashinfer_mla"`` and with ``eager`` side by side.

With no arguments it builds a small DeepSeek-V3-style model from a config with random weights (nothing is
downloaded) and prints both generations, whether they match, and the decode time of each:

    python examples/generate.py
    python examples/generate.py --model /path/to/DeepSeek-V2-Lite-Chat --dtype bfloat16 --device cuda \
        --prompt "The capital of France is" --max-new-tokens 64

``--fp8-cache`` gives flashinfer_mla the FP8 latent cache (``MLALatentCache(config, dtype=torch.float8_e4m3fn)``):
half the cache memory; its tokens may then differ from eager's where logits are close.
"""

from __future__ import annotations

import argparse
import time

import torch
import transformers

import hf_flashinfer_mla  # noqa: F401  (registers attn_implementation="flashinfer_mla")

DTYPES = {"float64": torch.float64, "float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def tiny_deepseek_v3(dtype, device):
    """A 4-layer DeepSeek-V3-shaped model (q_lora, YaRN, MoE) with random weights: real structure, toy size."""
    config = transformers.DeepseekV3Config(
        vocab_size=1024, hidden_size=256, intermediate_size=512, moe_intermediate_size=128, num_hidden_layers=4,
        num_attention_heads=8, num_key_value_heads=8, n_routed_experts=8, num_experts_per_tok=2, n_shared_experts=1,
        n_group=1, topk_group=1, first_k_dense_replace=1, kv_lora_rank=64, q_lora_rank=96, qk_rope_head_dim=16,
        qk_nope_head_dim=32, v_head_dim=32, max_position_embeddings=4096, eos_token_id=None, pad_token_id=0,
        rope_scaling={"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 1024, "beta_fast": 32,
                      "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 1.0},
    )
    torch.manual_seed(0)
    experts = "eager" if dtype == torch.float64 else "grouped_mm"
    model = transformers.AutoModelForCausalLM.from_config(
        config, attn_implementation="flashinfer_mla", dtype=dtype, experts_implementation=experts
    )
    return model.to(device).eval(), None


def load(path, dtype, device):
    model = transformers.AutoModelForCausalLM.from_pretrained(
        path, attn_implementation="flashinfer_mla", dtype=dtype, device_map=device
    )
    return model.eval(), transformers.AutoTokenizer.from_pretrained(path)


def timed_generate(model, inputs, max_new_tokens, device, cache_dtype=None):
    """Generate greedily; returns the new tokens and the seconds per decode step (prefill excluded)."""
    def run(n):
        cache = {}
        if cache_dtype is not None:  # a fresh cache per call: generate() fills the one it is given
            cache = {"cache": hf_flashinfer_mla.MLALatentCache(model.config, dtype=cache_dtype)}
        if device.type == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        out = model.generate(**inputs, max_new_tokens=n, min_new_tokens=n, do_sample=False, **cache)
        if device.type == "cuda":
            torch.cuda.synchronize()
        return out, time.perf_counter() - start

    run(2)  # warm-up (kernels, planning caches)
    _, prefill = run(1)
    out, total = run(max_new_tokens)
    return out[:, inputs["input_ids"].shape[1]:], (total - prefill) / max(max_new_tokens - 1, 1)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", help="a local checkpoint; default: a small random DeepSeek-V3-style model")
    parser.add_argument("--prompt", action="append",
                        help="prompt text (repeat for a batch); ignored for the random model, which gets random ids")
    parser.add_argument("--max-new-tokens", type=int, default=24)
    parser.add_argument("--dtype", choices=DTYPES, default=None,
                        help="default: float32 on CPU, bfloat16 on GPU")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--attn", nargs="+", default=["flashinfer_mla", "eager"],
                        help="implementations to run side by side (first one is compared with the others)")
    parser.add_argument("--fp8-cache", action="store_true", help="flashinfer_mla runs on the FP8 latent cache")
    args = parser.parse_args()
    device = torch.device(args.device)
    dtype = DTYPES[args.dtype or ("bfloat16" if device.type == "cuda" else "float32")]

    if args.model:
        model, tokenizer = load(args.model, dtype, device)
        tokenizer.padding_side = "left"
        if tokenizer.pad_token is None:
            tokenizer.pad_token = tokenizer.eos_token
        inputs = tokenizer(args.prompt or ["The capital of France is"], return_tensors="pt", padding=True)
    else:
        model, tokenizer = tiny_deepseek_v3(dtype, device)
        g = torch.Generator().manual_seed(1)
        ids = torch.randint(1, 1024, (3, 12), generator=g)
        mask = torch.ones_like(ids)
        mask[1, :5] = 0  # a left-padded batch, as generate() sees it from a tokenizer
        mask[2, :9] = 0
        inputs = {"input_ids": ids * mask, "attention_mask": mask}
    inputs = {k: v.to(device) for k, v in inputs.items()}

    results = {}
    for attn in args.attn:
        model.set_attn_implementation(attn)
        fp8 = torch.float8_e4m3fn if args.fp8_cache and attn == "flashinfer_mla" else None
        results[attn] = timed_generate(model, inputs, args.max_new_tokens, device, fp8)

    print(f"model: {args.model or 'random DeepSeek-V3-style (4 layers)'}, {dtype}, {device}, "
          f"batch {inputs['input_ids'].shape[0]}, {args.max_new_tokens} new tokens")
    first = args.attn[0]
    for attn, (tokens, step) in results.items():
        text = [tokenizer.decode(t, skip_special_tokens=True) for t in tokens] if tokenizer else tokens.tolist()
        print(f"\n[{attn}] {step * 1e3:.2f} ms per decode step")
        for row in text:
            print(f"  {row}")
    for attn in args.attn[1:]:
        same = torch.equal(results[first][0], results[attn][0])
        print(f"\n{first} vs {attn}: tokens {'match' if same else 'DIFFER'}; decode step time "
              f"{attn} / {first} = {results[attn][1] / results[first][1]:.2f}")


if __name__ == "__main__":
    main()
