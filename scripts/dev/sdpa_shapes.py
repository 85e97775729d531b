#!/usr/bin/env python3
"""Why sdpa's decode steps cost more when the cache grows (as in generate()) than at a fixed length: the host time of
torch's scaled_dot_product_attention at DeepSeek-V3's decode shape (128 heads, q/k head dim 192, v head dim 128),
at a fixed key length against a key length that grows by one per call, with each backend torch allows.

    python scripts/dev/sdpa_shapes.py [--cells 1x1024 32x4096] [--steps 20]
"""

import argparse
import time

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel


def timed(q, k, v, grow: bool, steps: int = 20) -> float:
    times = []
    for i in range(steps):
        n = k.shape[2] - steps + (i if grow else 0)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        F.scaled_dot_product_attention(q, k[:, :, :n], v[:, :, :n])
        torch.cuda.synchronize()
        times.append((time.perf_counter() - t0) * 1e3)
    return sorted(times)[len(times) // 2]


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--cells", nargs="+", default=["1x1024", "32x4096"], help="BATCHxCONTEXT (key length)")
    p.add_argument("--steps", type=int, default=20, help="timed calls per measurement (median)")
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        p.error("needs a CUDA GPU")
    dev, dt = torch.device("cuda"), torch.bfloat16
    for batch, ctx in (tuple(map(int, cell.split("x"))) for cell in args.cells):
        q = torch.randn(batch, 128, 1, 192, device=dev, dtype=dt)
        k = torch.randn(batch, 128, ctx + args.steps, 192, device=dev, dtype=dt)
        v = torch.randn(batch, 128, ctx + args.steps, 128, device=dev, dtype=dt)
        names = {int(b): b.name for b in (SDPBackend.MATH, SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION,
                                          SDPBackend.CUDNN_ATTENTION)}
        choice = torch._fused_sdp_choice(q, k, v)
        print(f"B={batch} ctx={ctx}: torch picks {names.get(int(choice), choice)}")
        for name, backends in (("default", None), ("no cuDNN", [SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]),
                               ("cuDNN only", [SDPBackend.CUDNN_ATTENTION])):
            for grow in (False, True):
                try:
                    if backends is None:
                        ms = timed(q, k, v, grow, args.steps)
                    else:
                        with sdpa_kernel(backends):
                            ms = timed(q, k, v, grow, args.steps)
                    print(f"  {name:10s} {'growing' if grow else 'fixed':8s} key length: {ms:8.3f} ms per call")
                except RuntimeError as exc:
                    print(f"  {name:10s} {'growing' if grow else 'fixed':8s}: {type(exc).__name__}: {str(exc)[:80]}")


if __name__ == "__main__":
    main()
