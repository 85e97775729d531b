#!/usr/bin/env python3
"""Which attention implementation departs from the others on ``generate(prefill_chunk_size=N)`` over a left-padded
batch: on the GPU suite's DeepSeek-V3-shaped model (``tests/gpu/test_gpu_backends.py``, bf16), eager, sdpa and
flashinfer_mla (its own backend and the reference) with and without chunked prefill, each against eager without
chunking: the relative error and top-1 agreement of all the logits and of the prefill's logits alone, and whether
they are finite.

    python scripts/dev/probe_chunks_gpu.py [--chunk 8] [--new 16] [--lengths 70 3 37]
"""

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "tests", "gpu"))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--chunk", type=int, default=8, help="prefill_chunk_size of the chunked runs")
    p.add_argument("--new", type=int, default=16, help="new tokens per run")
    p.add_argument("--lengths", type=int, nargs="+", default=[70, 3, 37], help="prompt lengths (left-padded batch)")
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        p.error("needs a CUDA GPU (the GPU suite's model)")
    import test_gpu_backends as t

    model = t._model("v3")
    ids, mask, _ = t._prompts(lengths=tuple(args.lengths))

    def gen(attn, chunk, **kw):
        model.set_attn_implementation(attn)
        with torch.no_grad():
            out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=args.new, do_sample=False,
                                 prefill_chunk_size=chunk, output_logits=True, return_dict_in_generate=True, **kw)
        return torch.stack(out.logits, 1).float()

    c = args.chunk
    base = gen("eager", None)
    for name, attn, chunk, kw in [(f"eager chunk{c}", "eager", c, {}), ("sdpa", "sdpa", None, {}),
                                  (f"sdpa chunk{c}", "sdpa", c, {}), ("fi", "flashinfer_mla", None, {}),
                                  (f"fi chunk{c}", "flashinfer_mla", c, {}),
                                  (f"fi chunk{c} reference", "flashinfer_mla", c, {"mla_backend": "reference"}),
                                  ("fi reference", "flashinfer_mla", None, {"mla_backend": "reference"})]:
        out = gen(attn, chunk, **kw)
        err, top1 = t._compare(out, base)
        first = t._compare(out[:, :1], base[:, :1])
        print(f"{name:22s} vs eager (no chunks): rel {err:.2e} top1 {top1:.3f}; prefill's logits rel {first[0]:.2e}; "
              f"finite {bool(torch.isfinite(out).all())}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
