"""Extra FlashInfer JIT modules for the device kit: ``python3 ../shared/devkit/build_kit.py --extra-modules
scripts/dev/devkit_modules.py``. The FP8 latent cache (``MLALatentCache(..., dtype=torch.float8_e4m3fn)``) runs
fa3 with a bf16/fp16 query over an ``float8_e4m3fn`` latent, a module the default kit does not build."""


def modules():
    import torch
    from flashinfer.jit import gen_batch_mla_module

    return [
        (lambda d=dt: gen_batch_mla_module("fa3", d, torch.float8_e4m3fn, d, torch.int32, 512, 64, False), "9.0a")
        for dt in (torch.bfloat16, torch.float16)
    ]
