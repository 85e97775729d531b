"""Generate with attn_implementation="flashinfer_mla", "eager" and "sdpa" side by side, and compare them.

With no arguments it builds a small DeepSeek-V3-style model with random weights (nothing is downloaded), generates
greedily for a left-padded batch of three prompts with each implementation, and prints:

* a table: each implementation's milliseconds per decode step (prefill excluded), the median of --repeats timed runs
  after --warmup untimed ones, and its speed relative to eager;
* the new tokens of every row, the implementations' lines next to each other (a "*" marks a token that differs from
  eager's);
* a verdict: flashinfer_mla's logits and tokens against eager's, beside sdpa's against eager's, which is the spread
  between Transformers' own implementations (in bfloat16 and float16 greedy tokens may differ wherever two logits
  are close; the yardstick says how much of that any implementation shows).

Logits are compared at the steps where both runs had generated the same tokens so far (the same context); tokens
are compared at every step. In float64, Transformers' eager gives NaN logits on left-padded rows (a known
Transformers issue: eager's softmax runs in float32, where float64's masking value becomes -inf, so fully masked
padding positions turn into NaN and reach the cache); eager's rows are then each prompt generated alone, unpadded,
and the script says so.

    python examples/generate.py
    python examples/generate.py --dtype bfloat16
    python examples/generate.py --model /path/to/DeepSeek-V2-Lite-Chat --dtype bfloat16 --device cuda \
        --prompt "The capital of France is" --max-new-tokens 64

--fp8-cache gives flashinfer_mla the FP8 latent cache (MLALatentCache(config, dtype=torch.float8_e4m3fn)): half the
cache memory; its tokens may then differ from eager's where logits are close.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import textwrap
import time

import torch
import transformers

import hf_flashinfer_mla  # registers attn_implementation="flashinfer_mla"

PROG = "python examples/generate.py"
DESCRIPTION = (
    'Generate with attn_implementation="flashinfer_mla", "eager" and "sdpa" side by side: milliseconds per decode '
    "step (median of repeated runs after a warm-up), the new tokens of each row, and a verdict comparing "
    "flashinfer_mla's logits and tokens with eager's, beside sdpa's (Transformers' own spread). With no --model it "
    "runs a small random DeepSeek-V3-style model built from a config: nothing is downloaded."
)
EPILOG = """examples:
  python examples/generate.py
  python examples/generate.py --dtype bfloat16
  python examples/generate.py --model /path/to/DeepSeek-V2-Lite-Chat --dtype bfloat16 --device cuda \\
      --prompt "The capital of France is" --max-new-tokens 64"""
DTYPES = {"float64": torch.float64, "float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
REFERENCE = "eager"  # the implementation the others are compared with
YARDSTICK = "sdpa"  # Transformers' other implementation: its difference from eager is the spread to expect


def fail(message: str) -> None:
    """One line on stderr and exit status 2, as argparse does for a bad argument (without the usage block)."""
    print(f"{PROG}: error: {message}", file=sys.stderr)
    sys.exit(2)


def parse_device(text: str) -> torch.device:
    """The torch device `text` names, or exit 2 with one line saying why this machine cannot run on it."""
    try:
        device = torch.device(text)
    except (RuntimeError, ValueError):
        fail(f"--device {text!r} is not a device name torch knows (e.g. cpu, cuda, cuda:1)")
    if device.type == "cuda":
        if not torch.cuda.is_available():
            why = ("this torch build has no CUDA" if torch.version.cuda is None
                   else f"torch (CUDA {torch.version.cuda}) sees no CUDA GPU")
            fail(f"--device {text}: {why} (torch {torch.__version__}); use --device cpu")
        count = torch.cuda.device_count()
        if device.index is not None and device.index >= count:
            fail(f"--device {text}: there is no CUDA device {device.index}; this machine has {count} "
                 f"(cuda:0{f' to cuda:{count - 1}' if count > 1 else ''})")
    elif device.type != "cpu":
        try:
            torch.empty(1, device=device)
        except Exception as exc:  # noqa: BLE001  (whatever the backend raises, it becomes the one line)
            fail(f"--device {text}: {str(exc).splitlines()[0] if str(exc) else type(exc).__name__}")
    return device


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


def check_model_path(path: str) -> None:
    """Exit 2 with one line unless `path` is a checkpoint directory (a Hub id, ``org/name``, is left to
    Transformers)."""
    local = os.path.isabs(path) or path.startswith((".", "~")) or path.count("/") > 1 or "\\" in path
    expanded = os.path.expanduser(path)
    if os.path.isdir(expanded):
        if not os.path.isfile(os.path.join(expanded, "config.json")):
            fail(f"--model {path}: the directory has no config.json; give a checkpoint directory (config.json, "
                 "weights and tokenizer files)")
    elif os.path.exists(expanded):
        fail(f"--model {path}: not a directory; give a checkpoint directory (config.json, weights and tokenizer files)")
    elif local:
        fail(f"--model {path}: no such directory; give a local checkpoint directory, or leave --model out for the "
             "small random model")


def load(path, dtype, device):
    try:
        model = transformers.AutoModelForCausalLM.from_pretrained(
            os.path.expanduser(path), attn_implementation="flashinfer_mla", dtype=dtype, device_map=device
        )
        tokenizer = transformers.AutoTokenizer.from_pretrained(os.path.expanduser(path))
    except (OSError, hf_flashinfer_mla.UnsupportedModelError) as exc:  # not found, no weights, not an MLA model
        fail(f"--model {path}: {' '.join(str(exc).split())}")
    return model.eval(), tokenizer


class StepClock(transformers.LogitsProcessor):
    """Notes the time whenever generate() has the logits of a step (after the prefill, then after each decode step);
    changes nothing. generate() reads each step's tokens on the host before the next step, so on a GPU the host clock
    advances with the device."""

    def __init__(self):
        self.stamps = []

    def __call__(self, input_ids, scores):
        self.stamps.append(time.perf_counter())
        return scores


def greedy(model, inputs, max_new_tokens, cache_dtype=None, clock=None):
    """`generate()` greedily, exactly `max_new_tokens` tokens; returns ``(new tokens [B, T], logits [B, T, V])``."""
    kwargs = {}
    if cache_dtype is not None:  # a fresh cache per call: generate() fills the one it is given
        kwargs["cache"] = hf_flashinfer_mla.MLALatentCache(model.config, dtype=cache_dtype)
    if clock is not None:
        kwargs["logits_processor"] = transformers.LogitsProcessorList([clock])
    out = model.generate(**inputs, max_new_tokens=max_new_tokens, min_new_tokens=max_new_tokens, do_sample=False,
                         output_logits=True, return_dict_in_generate=True, **kwargs)
    return out.sequences[:, inputs["input_ids"].shape[1]:], torch.stack(out.logits, dim=1)


def timed_greedy(model, inputs, max_new_tokens, device, cache_dtype, warmup, repeats):
    """``(tokens, logits, ms per decode step)``: the median over `repeats` runs after `warmup` untimed ones."""
    for _ in range(warmup):  # kernels, planning caches, allocator
        greedy(model, inputs, max_new_tokens, cache_dtype)
    per_step = []
    for _ in range(repeats):
        clock = StepClock()
        tokens, logits = greedy(model, inputs, max_new_tokens, cache_dtype, clock)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        # stamps[0]: the prefill's logits; stamps[-1]: the last decode step's. Between them, max_new_tokens - 1 steps.
        per_step.append((clock.stamps[-1] - clock.stamps[0]) / (len(clock.stamps) - 1) * 1e3)
    return tokens, logits, statistics.median(per_step)


def eager_rows_alone(model, inputs, rows, max_new_tokens):
    """Each of `rows` generated on its own, unpadded, with eager: ``{row: (tokens [T], logits [T, V])}``."""
    model.set_attn_implementation(REFERENCE)
    alone = {}
    for r in rows:
        keep = inputs["attention_mask"][r].bool()
        single = {"input_ids": inputs["input_ids"][r][keep][None],
                  "attention_mask": inputs["attention_mask"][r][keep][None]}
        tokens, logits = greedy(model, single, max_new_tokens)
        alone[r] = (tokens[0], logits[0])
    return alone


def compare(ours, theirs):
    """``(max |logit diff| where the context was the same, positions compared, tokens differing, positions)``."""
    (tok_a, log_a), (tok_b, log_b) = ours, theirs
    same = tok_a == tok_b
    # Step t of a row saw the same context in both runs iff the tokens before t are equal.
    context = torch.cat([torch.ones_like(same[:, :1]), same[:, :-1].cumprod(dim=1).bool()], dim=1)
    diff = (log_a.double() - log_b.double()).abs().amax(dim=-1)[context]
    worst = float("nan") if diff.isnan().any() else (diff.max().item() if diff.numel() else float("nan"))
    return worst, int(context.sum()), int((~same).sum()), same.numel()


def describe(result) -> tuple[str, str]:
    worst, compared, differ, total = result
    logits = f"{worst:.3g}" + (f" (over the {compared} positions with the same context)" if compared < total else "")
    return logits, f"{differ} of {total}"


def show(tokens_row, tokenizer, marks) -> str:
    if tokenizer is not None:
        text = tokenizer.decode(tokens_row, skip_special_tokens=True).replace("\n", "\\n")
        return repr(text) + ("  (* differs from eager)" if marks.any() else "")
    return " ".join(f"{t}{'*' if m else ''}" for t, m in zip(tokens_row.tolist(), marks.tolist()))


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog=PROG, description=textwrap.fill(DESCRIPTION, 79), epilog=EPILOG,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", metavar="PATH",
                        help="a local checkpoint directory; default: a small random DeepSeek-V3-style model")
    parser.add_argument("--prompt", action="append", metavar="TEXT",
                        help="prompt text, repeat for a batch (with --model; the random model gets random token ids)")
    parser.add_argument("--max-new-tokens", type=int, default=24, metavar="N",
                        help="tokens to generate per row, at least 2 (default: %(default)s)")
    parser.add_argument("--dtype", choices=DTYPES, default=None,
                        help="weights and activations; default: float32 on CPU, bfloat16 on CUDA")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu",
                        help="where to run: cpu, cuda or cuda:N (default here: %(default)s)")
    parser.add_argument("--attn", nargs="+", default=["flashinfer_mla", REFERENCE, YARDSTICK], metavar="IMPL",
                        help="attention implementations to run, compared with eager when it is listed, otherwise "
                             f"with the first (default: {' '.join(['flashinfer_mla', REFERENCE, YARDSTICK])})")
    parser.add_argument("--repeats", type=int, default=5, metavar="N",
                        help="timed runs per implementation; the table shows their median (default: %(default)s)")
    parser.add_argument("--warmup", type=int, default=1, metavar="N",
                        help="untimed runs per implementation before the timed ones (default: %(default)s)")
    parser.add_argument("--fp8-cache", action="store_true", help="flashinfer_mla runs on the FP8 latent cache")
    return parser


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    if args.max_new_tokens < 2:
        fail("--max-new-tokens must be at least 2 (a decode step needs a token after the prefill's)")
    if args.repeats < 1 or args.warmup < 0:
        fail("--repeats must be at least 1 and --warmup at least 0")
    if args.prompt and not args.model:
        fail("--prompt needs --model (a checkpoint with a tokenizer); the random model has none and runs on random "
             "token ids")
    if args.model:
        check_model_path(args.model)
    if args.fp8_cache and "flashinfer_mla" not in args.attn:
        fail("--fp8-cache gives flashinfer_mla the FP8 latent cache: add flashinfer_mla to --attn")
    from transformers import AttentionInterface

    unknown = [a for a in args.attn if a not in ("eager", *AttentionInterface._global_mapping)]
    if unknown:
        fail(f"--attn {' '.join(unknown)}: not an attention implementation; choose among eager, "
             f"{', '.join(sorted(AttentionInterface._global_mapping))}")
    device = parse_device(args.device)
    dtype = DTYPES[args.dtype or ("bfloat16" if device.type == "cuda" else "float32")]

    if args.model:
        model, tokenizer = load(args.model, dtype, device)
        tokenizer.padding_side = "left"
        if tokenizer.pad_token is None:
            tokenizer.pad_token = tokenizer.eos_token
        inputs = tokenizer(args.prompt or ["The capital of France is"], return_tensors="pt", padding=True)
        inputs = {"input_ids": inputs["input_ids"], "attention_mask": inputs["attention_mask"]}
    else:
        model, tokenizer = tiny_deepseek_v3(dtype, device)
        g = torch.Generator().manual_seed(1)
        ids = torch.randint(1, 1024, (3, 12), generator=g)
        mask = torch.ones_like(ids)
        mask[1, :5] = 0  # a left-padded batch, as generate() sees it from a tokenizer
        mask[2, :9] = 0
        inputs = {"input_ids": ids * mask, "attention_mask": mask}
    inputs = {k: v.to(device) for k, v in inputs.items()}
    n = args.max_new_tokens

    results, ms = {}, {}
    for attn in args.attn:
        model.set_attn_implementation(attn)
        fp8 = torch.float8_e4m3fn if args.fp8_cache and attn == "flashinfer_mla" else None
        tokens, logits, ms[attn] = timed_greedy(model, inputs, n, device, fp8, args.warmup, args.repeats)
        results[attn] = (tokens.cpu(), logits.float().cpu() if dtype != torch.float64 else logits.cpu())

    notes, labels = [], {attn: attn for attn in args.attn}
    ref = REFERENCE if REFERENCE in results else args.attn[0]
    padded = (inputs["attention_mask"] == 0).any(dim=1).cpu()
    if ref == REFERENCE:
        bad = [r for r in range(len(padded)) if not torch.isfinite(results[ref][1][r]).all()]
        if bad and all(padded[r] for r in bad):
            alone = eager_rows_alone(model, inputs, bad, n)
            tokens, logits = (t.clone() for t in results[ref])
            for r, (t, lg) in alone.items():
                tokens[r], logits[r] = t.cpu(), lg.to(logits.dtype).cpu()
            results[ref] = (tokens, logits)
            labels[ref] = f"{REFERENCE} [1]"
            rows = ", ".join(map(str, bad))
            why = (", a known Transformers issue in float64 (its softmax runs in float32, where the masking value "
                   "becomes -inf: fully masked padding positions turn into NaN and reach the cache)"
                   if dtype == torch.float64 else "")
            notes.append(f"[1] {REFERENCE} gives NaN logits on the left-padded row(s) {rows} of the batch{why}; "
                         f"its row(s) {rows} here are each prompt generated alone, unpadded, with {REFERENCE}")
        elif bad:
            notes.append(f"{REFERENCE}'s logits are not finite on row(s) {', '.join(map(str, bad))}")

    batch = inputs["input_ids"].shape[0]
    pads = [str(r) for r in range(batch) if padded[r]]
    print(f"\nmodel: {args.model or 'random DeepSeek-V3-style (4 layers, random weights)'}, "
          f"{str(dtype).removeprefix('torch.')} on {device}, batch {batch}"
          + (f" ({'rows' if len(pads) > 1 else 'row'} {', '.join(pads)} left-padded)" if pads else "")
          + f", {n} new tokens per row"
          + (", flashinfer_mla on the FP8 latent cache" if args.fp8_cache else ""))
    width = max(len(label) for label in labels.values())
    head = f"ms per decode step (median of {args.repeats})"
    print(f"\n{'implementation':<{max(width, 14)}}  {head}  speed vs {ref}")
    for attn in args.attn:
        print(f"{attn:<{max(width, 14)}}  {ms[attn]:>{len(head)}.2f}  {ms[ref] / ms[attn]:>{len(ref) + 8}.2f}x")
    print(f"(prefill excluded; {args.warmup} untimed warm-up run(s) first)")

    print(f"\nnew tokens per row ({'*' if tokenizer is None else 'marked'} where different from {ref}'s):")
    ref_tokens = results[ref][0]
    for r in range(batch):
        for i, attn in enumerate(args.attn):
            row = results[attn][0][r]
            print(f"{f'row {r}' if i == 0 else '':<6} {labels[attn]:<{width}}  "
                  f"{show(row, tokenizer, row != ref_tokens[r])}")
    for note in notes:
        print(note)

    others = [a for a in args.attn if a != ref and a != YARDSTICK] or [a for a in args.attn if a != ref]
    yard = YARDSTICK if YARDSTICK in results and YARDSTICK != ref and YARDSTICK in args.attn else None
    print()
    for attn in others:
        logits, tokens = describe(compare(results[attn], results[ref]))
        line = f"verdict: {attn} vs {ref}: max |logit diff| {logits}, tokens differ in {tokens} positions"
        if yard and yard != attn:
            y_logits, y_tokens = describe(compare(results[yard], results[ref]))
            line += f"; {yard} vs {ref} (Transformers' own spread): {y_logits}, {y_tokens}"
        print(line)
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except hf_flashinfer_mla.FlashInferMLAError as error:  # (its message names the fix: one line is enough)
        fail(str(error))
