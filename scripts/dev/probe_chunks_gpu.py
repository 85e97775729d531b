"""Which implementation departs from the others on generate(prefill_chunk_size=8) over a left-padded batch (H200,
bf16, the GPU suite's v3 model): each run against eager without chunking."""
import sys

import torch

sys.path.insert(0, "tests/gpu")
import test_gpu_backends as t  # noqa: E402

model = t._model("v3")
ids, mask, _ = t._prompts(lengths=(70, 3, 37))


def gen(attn, chunk, **kw):
    model.set_attn_implementation(attn)
    with torch.no_grad():
        out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=16, do_sample=False,
                             prefill_chunk_size=chunk, output_logits=True, return_dict_in_generate=True, **kw)
    return torch.stack(out.logits, 1).float()


base = gen("eager", None)
for name, attn, chunk, kw in [("eager chunk8", "eager", 8, {}), ("sdpa", "sdpa", None, {}),
                              ("sdpa chunk8", "sdpa", 8, {}), ("fi", "flashinfer_mla", None, {}),
                              ("fi chunk8", "flashinfer_mla", 8, {}),
                              ("fi chunk8 reference", "flashinfer_mla", 8, {"mla_backend": "reference"}),
                              ("fi reference", "flashinfer_mla", None, {"mla_backend": "reference"})]:
    out = gen(attn, chunk, **kw)
    err, top1 = t._compare(out, base)
    first = t._compare(out[:, :1], base[:, :1])
    print(f"{name:22s} vs eager (no chunks): rel {err:.2e} top1 {top1:.3f}; prefill's logits rel {first[0]:.2e}; "
          f"finite {bool(torch.isfinite(out).all())}")
