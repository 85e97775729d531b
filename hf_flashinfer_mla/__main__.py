"""``python -m hf_flashinfer_mla``: what this machine would run, and why.

Prints the GPU and its compute capability, the FlashInfer / Transformers / torch versions, and the decode backend
``auto`` picks for common head counts and dtypes (with the reason wherever it falls back to PyTorch).
"""

from __future__ import annotations

import argparse
import importlib.metadata as md

import torch

from . import dispatch

HEADS = (8, 16, 20, 24, 32, 64, 96, 128)
DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def _version(name: str) -> str:
    try:
        return md.version(name)
    except md.PackageNotFoundError:
        return "not installed"


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--kv-lora-rank", type=int, default=512)
    parser.add_argument("--rope-dim", type=int, default=64)
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    print(f"torch {torch.__version__}, transformers {_version('transformers')}, "
          f"flashinfer-python {_version('flashinfer-python')}, hf-flashinfer-mla {_version('hf-flashinfer-mla')}")
    if device.type == "cuda":
        cc = dispatch.device_capability(device)
        print(f"device {device}: {torch.cuda.get_device_name(device)}, compute capability {cc[0]}.{cc[1]}")
    else:
        print(f"device {device}: no GPU; every decode runs on the PyTorch reference backend")
    requested = dispatch.requested_backend()
    print(f"requested backend: {requested} (${dispatch.ENV_VAR} or mla_backend=...)")
    print(f"latent: kv_lora_rank {args.kv_lora_rank} + rope {args.rope_dim}\n")
    print(f"{'dtype':<16}" + "".join(f"{h:>12}" for h in HEADS))
    reasons = {}
    for dtype in DTYPES:
        row = []
        for h in HEADS:
            try:
                chosen = dispatch.choose_backend(device, dtype, args.kv_lora_rank, args.rope_dim, h, requested)
            except dispatch.BackendUnavailableError as exc:
                chosen = "error"
                reasons[(dtype, h)] = str(exc)
            row.append(chosen)
            if chosen == "reference" and requested == "auto":
                pref = dispatch.preferred_kernel(dispatch.device_capability(device), h) if device.type == "cuda" else None
                why = dispatch.unavailable_reason(pref or "fa2", device, dtype, args.kv_lora_rank, args.rope_dim, h)
                reasons.setdefault(("reference", dtype), why)
        print(f"{str(dtype).replace('torch.', ''):<16}" + "".join(f"{c:>12}" for c in row))
    for key, why in reasons.items():
        if why:
            print(f"  {key[0] if isinstance(key[0], str) else key[0]} / {key[1]}: {why}")


if __name__ == "__main__":
    main()
