"""Profile one flashinfer_mla decode step (V3 attention shape, 4 layers, B=32, ctx 4096): CPU vs GPU time."""
import sys, pathlib, torch
sys.path.insert(0, str(pathlib.Path(__file__).parents[1]))
import bench_decode
import hf_flashinfer_mla  # noqa
from torch.profiler import profile, ProfilerActivity

cfg = bench_decode.build_config("deepseek-v3-attn", 4)
model = bench_decode.build_model(cfg, torch.bfloat16, torch.device("cuda"), None)
model.set_attn_implementation("flashinfer_mla")
B, S = 32, 4096
cache = hf_flashinfer_mla.MLALatentCache(config=cfg)
bench_decode.fill_cache(cache, cfg, B, S, torch.bfloat16, torch.device("cuda"))
tok = torch.randint(1, cfg.vocab_size, (B, 1), device="cuda")
mask = torch.ones(B, S + 1, dtype=torch.long, device="cuda")
with torch.no_grad():
    for _ in range(3):
        model(input_ids=tok, attention_mask=mask, cache=cache, use_cache=True); cache.crop(-1)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(5):
            model(input_ids=tok, attention_mask=mask, cache=cache, use_cache=True); cache.crop(-1)
        torch.cuda.synchronize()
print(prof.key_averages().table(sort_by="self_cuda_time_total", row_limit=12, max_name_column_width=60))
print(prof.key_averages().table(sort_by="cpu_time_total", row_limit=14, max_name_column_width=60))
