"""Where does a compiled static-cache generate diverge from the uncompiled one? (dev diagnostic)"""
import sys, torch
sys.path.insert(0, "tests/gpu")
from transformers import CompileConfig
from test_gpu_backends import _model, _prompts, rel

model = _model("v3")
model.set_attn_implementation("flashinfer_mla")
ids, mask, _ = _prompts()
base = dict(input_ids=ids, attention_mask=mask, max_new_tokens=12, do_sample=False, cache_implementation="static",
            mla_backend="fa3", output_logits=True, return_dict_in_generate=True)
plain = model.generate(**base, disable_compile=True)
for mode in ("default", "reduce-overhead"):
    torch._dynamo.reset()
    for attempt in range(2):
        run = model.generate(**base, compile_config=CompileConfig(mode=mode))
        errs = [rel(a, b) for a, b in zip(run.logits, plain.logits)]
        print(mode, attempt, "per-step rel err:", " ".join(f"{e:.1e}" for e in errs), flush=True)
# teacher-forced: same tokens fed to both to isolate the attention
