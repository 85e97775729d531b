"""Host overhead at small batch: decode step time per backend (V3 attention shape, 4 layers)."""
import sys, pathlib, statistics, time, torch
sys.path.insert(0, str(pathlib.Path(__file__).parents[1]))
import bench_decode
import hf_flashinfer_mla  # noqa
from torch.profiler import profile, ProfilerActivity

cfg = bench_decode.build_config("deepseek-v3-attn", 4)
model = bench_decode.build_model(cfg, torch.bfloat16, torch.device("cuda"), None)

def step_ms(attn, backend, B, S, n=20, prof=False):
    model.set_attn_implementation(attn)
    cache = hf_flashinfer_mla.MLALatentCache(config=cfg) if attn == "flashinfer_mla" else __import__("transformers").DynamicCache(config=cfg)
    bench_decode.fill_cache(cache, cfg, B, S + 8, torch.bfloat16, torch.device("cuda")); cache.crop(-8)
    tok = torch.randint(1, cfg.vocab_size, (B, 1), device="cuda")
    mask = torch.ones(B, S + 1, dtype=torch.long, device="cuda")
    kw = dict(mla_backend=backend) if backend else {}
    ts = []
    with torch.no_grad():
        for _ in range(n + 3):
            torch.cuda.synchronize(); t = time.perf_counter()
            model(input_ids=tok, attention_mask=mask, cache=cache, use_cache=True, **kw)
            torch.cuda.synchronize(); ts.append(time.perf_counter() - t); cache.crop(-1)
        if prof:
            with profile(activities=[ProfilerActivity.CPU]) as p:
                for _ in range(3):
                    model(input_ids=tok, attention_mask=mask, cache=cache, use_cache=True, **kw); cache.crop(-1)
                torch.cuda.synchronize()
            print(p.key_averages().table(sort_by="cpu_time_total", row_limit=25, max_name_column_width=70))
    return statistics.median(ts[3:]) * 1e3

for B, S in ((1, 1024), (1, 16384), (8, 4096), (32, 4096)):
    row = [f"B={B} S={S}:"]
    for attn, be in (("sdpa", None), ("eager", None), ("flashinfer_mla", "fa3"), ("flashinfer_mla", "reference")):
        row.append(f"{attn}/{be or '-'} {step_ms(attn, be, B, S):.2f}")
    print("  ".join(row), flush=True)
step_ms("flashinfer_mla", "fa3", 1, 1024, n=5, prof=True)
