"""A sparse (DSA) indexer's scores over a paged cache, each query token over its own rows only.

For query token ``t`` with queries ``q[t] [H, D]``, head weights ``w[t] [H]`` and rows ``rows[first[t] + j]``,
``j < lens[t]``, of the indexer's keys::

    scores[t, j] = sum_h w[t, h] * relu(scale * q[t, h] . keys[rows[first[t] + j]])

in float32 from exact products, as Transformers' indexers compute it (``matmul(q.float(), k.float())``, relu, then
the weights' matmul), and ``-inf`` for ``j >= lens[t]`` up to ``width``. Their own call scores every query token
against every key their cache hands back, padded to the longest request: under continuous batching a CUDA graph
of 64 padded tokens over 16k rows scores a million pairs per layer in float32 where its requests have a sixth of
that. Here the work is each token's own rows: `scores` runs a Triton kernel on CUDA (one program per token and
slice of its rows; a token past whose rows a slice starts does nothing, so a graph's padding costs nothing), and
the same math in PyTorch elsewhere, which is also the kernel's oracle. FlashInfer's DSA indexers take FP8 keys or
Blackwell-only shapes, which would change which rows ties select against ``generate()``'s.
"""

from __future__ import annotations

import os

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # (the CPU build of torch comes without it: the PyTorch path runs)
    triton = None

BLOCK = 64  # rows per step of a program's loop
# Programs per query token, at most: a token's rows are spread over them (a decode token's up to `width`).
MAX_PROGRAMS = 32

if triton is not None:

    @triton.jit
    def _scores_kernel(q_ptr, w_ptr, keys_ptr, rows_ptr, first_ptr, lens_ptr, out_ptr, scale,
                       stride_qt, stride_qh, stride_wt, stride_k, stride_ot,
                       H: tl.constexpr, D: tl.constexpr, BLOCK: tl.constexpr, EXACT: tl.constexpr):
        t = tl.program_id(0)
        programs = tl.num_programs(1)
        length = tl.load(lens_ptr + t).to(tl.int32)
        first = tl.load(first_ptr + t)
        h = tl.arange(0, H)
        d = tl.arange(0, D)
        q = tl.load(q_ptr + t * stride_qt + h[:, None] * stride_qh + d[None, :])  # [H, D]
        w = tl.load(w_ptr + t * stride_wt + h)  # [H] float32
        for start in range(tl.program_id(1) * BLOCK, length, programs * BLOCK):
            n = start + tl.arange(0, BLOCK)
            valid = n < length
            rows = tl.load(rows_ptr + first + n, mask=valid, other=0).to(tl.int64)
            k = tl.load(keys_ptr + rows[:, None] * stride_k + d[None, :], mask=valid[:, None], other=0.0)
            if EXACT:  # (Triton's interpreter: its bf16 dot is not exact; float32 products of bf16 values are)
                s = tl.dot(q.to(tl.float32), tl.trans(k.to(tl.float32)), input_precision="ieee")
            else:  # (bf16/fp16 tensor cores: exact products, float32 sums)
                s = tl.dot(q, tl.trans(k.to(q.dtype)))
            s = tl.maximum(s * scale, 0.0)  # [H, BLOCK]
            tl.store(out_ptr + t * stride_ot + n, tl.sum(s * w[:, None], axis=0), mask=valid)


def kernel_serves(q: torch.Tensor, keys: torch.Tensor) -> bool:
    """Whether the Triton kernel runs these operands (else the PyTorch path): CUDA (or Triton's interpreter), 16-bit
    queries with keys of the same dtype, head count and width powers of two of at least 16 (its tiles')."""
    h, d = q.shape[-2:]
    return (triton is not None and (q.is_cuda or _interpreted()) and q.dtype in (torch.bfloat16, torch.float16)
            and keys.dtype == q.dtype and all(x >= 16 and x & (x - 1) == 0 for x in (h, d)))


def _interpreted() -> bool:
    return os.environ.get("TRITON_INTERPRET") == "1"


def scores(q: torch.Tensor, w: torch.Tensor, keys: torch.Tensor, rows: torch.Tensor, first: torch.Tensor,
           lens: torch.Tensor, width: int, scale: float, kernel: bool | None = None) -> torch.Tensor:
    """``[T, width]`` float32 scores (module docstring) of ``q [T, H, D]``, ``w [T, H]`` float32, over ``keys
    [N, D]`` (rows may be strided) at ``rows`` (positions -> key rows, integer) from ``first [T]`` for ``lens [T]``
    (integer, on the device; a graph's replay reads the ones written before it). `kernel`: force the Triton kernel
    or the PyTorch path (default: `kernel_serves`)."""
    if kernel if kernel is not None else kernel_serves(q, keys):
        t, h, d = q.shape
        out = torch.full((t, width), float("-inf"), dtype=torch.float32, device=q.device)
        # (the kernel steps through these one element at a time: an expanded view, stride 0, would be read past)
        rows, first, lens = rows.contiguous(), first.contiguous(), lens.contiguous()
        grid = (t, max(1, min(MAX_PROGRAMS, -(-width // BLOCK))))
        _scores_kernel[grid](q, w, keys, rows, first, lens, out, scale, q.stride(0), q.stride(1), w.stride(0),
                             keys.stride(0), out.stride(0), H=h, D=d, BLOCK=BLOCK, EXACT=_interpreted())
        return out
    j = torch.arange(width, device=q.device)
    valid = j < lens[:, None]
    k = keys[rows[first[:, None] + torch.where(valid, j, 0)]]  # [T, width, D]
    s = torch.relu(torch.matmul(q.float(), k.float().transpose(-1, -2)) * scale)  # [T, H, width]
    return torch.matmul(w.float()[:, None], s)[:, 0].masked_fill_(~valid, float("-inf"))
