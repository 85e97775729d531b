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
    notes = []
    for dtype in DTYPES:
        row = []
        for h in HEADS:
            try:
                row.append(dispatch.choose_backend(device, dtype, args.kv_lora_rank, args.rope_dim, h, requested))
            except dispatch.BackendUnavailableError as exc:
                row.append("error")
                notes.append(f"{dtype} / {h} heads: {exc}")
        name = str(dtype).replace("torch.", "")
        print(f"{name:<16}" + "".join(f"{c:>12}" for c in row))
        if "reference" in row and requested == "auto":
            cc = dispatch.device_capability(device)
            kernel = (dispatch.preferred_kernel(cc, HEADS[0]) if cc else None) or "fa2"
            why = dispatch.unavailable_reason(kernel, device, dtype, args.kv_lora_rank, args.rope_dim, HEADS[0])
            notes.append(f"{name}: reference because {why}")
    for note in dict.fromkeys(notes):
        print(f"  {note}")


if __name__ == "__main__":
    main()
