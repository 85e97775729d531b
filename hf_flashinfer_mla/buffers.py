"""Device-owned buffers the FlashInfer kernels need, one set per device, allocated on first use.

All three live for the whole process: kernels write scratch into them on every call and a captured CUDA graph keeps
their addresses, so they are never freed or replaced except to grow, or by `hf_flashinfer_mla.reset()`, which frees
torch's CUDA graphs first. Keeping one per device matters when a model is split across GPUs: a kernel must never be
handed another device's memory.
"""

from __future__ import annotations

import torch

# FlashInfer's documented starting size for the float workspace of its MLA wrappers and trtllm-gen decode.
WORKSPACE_BYTES = 128 * 1024 * 1024

_workspaces: dict[torch.device, torch.Tensor] = {}
_counters: dict[torch.device, torch.Tensor] = {}
_identities: dict[torch.device, torch.Tensor] = {}


def _key(device: torch.device | str) -> torch.device:
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    return device


def workspace_buffer(device: torch.device | str) -> torch.Tensor:
    """The float workspace of `device`: intermediate results of split-KV kernels (zeroed once, trtllm-gen
    keeps semaphores in it)."""
    device = _key(device)
    if device not in _workspaces:
        _workspaces[device] = torch.zeros(WORKSPACE_BYTES, dtype=torch.uint8, device=device)
    return _workspaces[device]


def multi_ctas_kv_counter_buffer(min_bytes: int, device: torch.device | str) -> torch.Tensor:
    """The zero-initialised ``uint8`` semaphore buffer trtllm-gen's multi-CTA KV split counts in, on `device`.

    The kernel resets every counter it used before it exits, so the buffer is zeroed once at allocation and then
    reused by every launch on that device (FlashInfer's functional entry point would otherwise allocate and zero a
    new one per call). It only grows: a request for more bytes than it holds replaces it by a larger zeroed buffer,
    any other request returns it as it is. `trtllm.counter_buffer` asks for a worst case (a power-of-two token count,
    at least 1024 tokens), so that a decode loop does not re-size it from call to call.
    """
    device = _key(device)
    buf = _counters.get(device)
    if buf is None or buf.numel() < min_bytes:
        buf = torch.zeros(max(int(min_bytes), 1), dtype=torch.uint8, device=device)
        _counters[device] = buf
    return buf


def identity_rows(device: torch.device | str, rows: int) -> torch.Tensor:
    """``arange`` (int32, at least `rows` long) on `device`: the page indices of a cache whose rows the fa2/fa3
    kernels address in place (``kernels/fa.addressing``), so that no step builds indices of its own.

    It grows in whole MiB when a larger cache asks. A step holds the tensor it planned with, so replacing it never
    frees indices a queued kernel still reads."""
    device = _key(device)
    buf = _identities.get(device)
    if buf is None or buf.numel() < rows:
        size = -(-max(int(rows), 1) // 2**18) * 2**18  # 2**18 int32 indices = 1 MiB
        buf = _identities[device] = torch.arange(size, dtype=torch.int32, device=device)
    return buf


def held(device: torch.device | str) -> dict[str, torch.Tensor]:
    """The buffers allocated on `device` so far, by name (``workspace``, ``counter``, ``identity``)."""
    device = _key(device)
    return {name: kept[device] for name, kept in (("workspace", _workspaces), ("counter", _counters),
                                                  ("identity", _identities)) if device in kept}


def reset() -> None:
    """Drop every device's buffers (their memory is freed once no plan still holds them). Only safe once no
    captured graph can replay: see `hf_flashinfer_mla.reset`."""
    for kept in (_workspaces, _counters, _identities):
        kept.clear()
