"""The FlashInfer JIT modules the GPU runs use beyond fa3/fa2 MLA decode, for a GPU machine that cannot compile them
on first use and gets them compiled ahead of time (``gpu_round.sh``'s ``.devkit/``).

* The FP8 latent cache (``MLALatentCache(..., dtype=torch.float8_e4m3fn)``) runs fa3 with a bf16/fp16 query over an
  ``float8_e4m3fn`` latent, a module the default kit does not build.
* Continuous batching's prefill chunks (``paged_attention.py``) run FlashInfer's ragged prefill on fa3 with DeepSeek's
  expanded head dims (query/key 192, value 128), bf16. Its sources include cutlass's ``curand_kernel.h``: on a
  build machine whose CUDA toolkit lacks cuRAND's headers, copy them from PyPI's ``nvidia-curand`` wheel
  (``nvidia/cu13/include/curand*.h``) into ``/usr/local/cuda/include`` first.

`modules` returns them as ``(generator, CUDA architecture)`` pairs, for the tool that compiles them (it runs this
file with ``runpy``); run directly, the file lists them.
"""

import argparse


def modules():
    import torch
    from flashinfer.jit import gen_batch_mla_module
    from flashinfer.jit.attention.modules import gen_batch_prefill_module

    fp8 = [
        (lambda d=dt: gen_batch_mla_module("fa3", d, torch.float8_e4m3fn, d, torch.int32, 512, 64, False), "9.0a")
        for dt in (torch.bfloat16, torch.float16)
    ]
    bf16 = torch.bfloat16
    ragged = [(lambda: gen_batch_prefill_module("fa3", bf16, bf16, bf16, torch.int32, 192, 128, 0, False, False,
                                                False), "9.0a")]
    return fp8 + ragged


# The modules `modules` builds, as text (listing them needs no FlashInfer).
LISTED = (
    "fa3 batch MLA, bfloat16 query over a float8_e4m3fn latent (512 + 64), sm90a",
    "fa3 batch MLA, float16 query over a float8_e4m3fn latent (512 + 64), sm90a",
    "fa3 ragged prefill, bfloat16, query/key head dim 192, value head dim 128, sm90a",
)


def main(argv=None) -> None:
    argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter).parse_args(argv)
    print("\n".join(LISTED))


if __name__ == "__main__":
    main()
