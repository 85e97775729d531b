"""``python -m hf_flashinfer_mla``: what this machine would run, and why.

Prints the GPU and its compute capability, the FlashInfer / Transformers / torch versions, and the decode backend
for common dtypes and numbers of query heads per device, then, below the table, why wherever it is not the GPU's own
kernel. The whole table is computed before anything is printed, so no log line lands inside it.
"""

from __future__ import annotations

import argparse
import importlib.metadata as md
import sys

import torch

from . import capabilities, registration
from .errors import BackendUnavailableError, TransformersVersionError
from .models import CHECKPOINT_MODEL_TYPES

HEADS = (8, 16, 20, 24, 32, 64, 96, 128)
DTYPES = (torch.bfloat16, torch.float16, torch.float32)
WIDTH = 11
PROG = "python -m hf_flashinfer_mla"
DESCRIPTION = (
    "What this machine would run, and why: the GPU and its compute capability, the torch, Transformers and "
    "FlashInfer versions, and the decode backend attn_implementation=\"flashinfer_mla\" picks for each dtype and "
    "number of query heads per device, with the reason wherever it is not the GPU's own kernel."
)


def _version(name: str) -> str:
    try:
        return md.version(name)
    except md.PackageNotFoundError:
        return "not installed"


def _table(device, rank, rope, requested):
    """``(rows, notes)``: per dtype the backend of each head count, and per distinct reason the cells it explains."""
    rows, notes = {}, {}
    for dtype in DTYPES:
        name = str(dtype).removeprefix("torch.")
        row = []
        for h in HEADS:
            try:
                backend, reason = capabilities.backend_and_reason(device, dtype, rank, rope, h, requested)
            except BackendUnavailableError as exc:
                backend, reason = "error", str(exc)
            row.append(backend)
            if reason:
                notes.setdefault((backend, reason), {}).setdefault(name, []).append(h)
        rows[name] = row
    return rows, notes


def _where(cells: dict[str, list[int]]) -> str:
    """``{"bfloat16": [8, 16], "float16": [8, 16]}`` -> ``"bfloat16, float16: 8, 16 heads"``."""
    by_heads: dict[tuple[int, ...], list[str]] = {}
    for dtype, heads in cells.items():
        by_heads.setdefault(tuple(heads), []).append(dtype)
    return "; ".join(
        f"{', '.join(dtypes)}: {'every head count' if heads == HEADS else ', '.join(map(str, heads)) + ' heads'}"
        for heads, dtypes in by_heads.items()
    )


def _fail(message: str) -> None:
    """One line on stderr and exit status 2, as argparse does for a bad argument (without the usage block)."""
    print(f"{PROG}: error: {message}", file=sys.stderr)
    sys.exit(2)


def device_problem(text: str) -> str | None:
    """Why this machine cannot run on the torch device `text` names (one line, after ``--device ``), or None."""
    try:
        device = torch.device(text)
    except (RuntimeError, ValueError):
        return f"{text!r} is not a device name torch knows (e.g. cpu, cuda, cuda:1)"
    if device.type == "cuda":
        if not torch.cuda.is_available():
            why = ("this torch build has no CUDA" if torch.version.cuda is None
                   else f"torch (CUDA {torch.version.cuda}) sees no CUDA GPU")
            return f"{text}: {why} (torch {torch.__version__}); use --device cpu"
        count = torch.cuda.device_count()
        if device.index is not None and device.index >= count:
            return (f"{text}: there is no CUDA device {device.index}; this machine has {count} "
                    f"(cuda:0{f' to cuda:{count - 1}' if count > 1 else ''})")
    return None


def _device(text: str) -> torch.device:
    """The torch device `text` names, or exit 2 with one line saying why this machine has no such device."""
    problem = device_problem(text)
    if problem is not None:
        _fail(f"--device {problem}")
    return torch.device(text)


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog=PROG, description=DESCRIPTION)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu",
                        help="the device to report on: cpu, cuda or cuda:N (default here: %(default)s)")
    parser.add_argument("--kv-lora-rank", type=int, default=512, metavar="N",
                        help="latent width per token, the model config's kv_lora_rank (default: %(default)s, "
                             "DeepSeek-V2/V3; MiniCPM3 has 256)")
    parser.add_argument("--rope-dim", type=int, default=64, metavar="N",
                        help="rotary key width per token, the model config's qk_rope_head_dim (default: %(default)s; "
                             "MiniCPM3 has 32)")
    return parser


def main(argv=None) -> None:
    args = _parser().parse_args(argv)
    if args.kv_lora_rank < 1:
        _fail(f"--kv-lora-rank {args.kv_lora_rank}: the latent width must be at least 1 (the model config's "
              "kv_lora_rank, e.g. 512)")
    if args.rope_dim < 0:
        _fail(f"--rope-dim {args.rope_dim}: the rotary key width must be 0 or more (the model config's "
              "qk_rope_head_dim, e.g. 64; 0 for a model without rope)")
    device = _device(args.device)
    try:
        requested = capabilities.requested_backend()  # the environment's choice, if any
    except BackendUnavailableError as exc:
        _fail(f"{exc}, or unset it")
    rows, notes = _table(device, args.kv_lora_rank, args.rope_dim, requested)

    print(f"torch {torch.__version__}, transformers {_version('transformers')}, "
          f"flashinfer-python {_version('flashinfer-python')}, hf-flashinfer-mla {_version('hf-flashinfer-mla')}")
    for feature in registration.UNAVAILABLE:  # (a Transformers outside the tested releases: what it refuses)
        try:
            registration.require(feature)
        except TransformersVersionError as refusal:
            print(refusal)
    if device.type == "cuda":
        cc = capabilities.device_capability(device)
        print(f"device {device}: {torch.cuda.get_device_name(device)}, compute capability {cc[0]}.{cc[1]}")
    else:
        print(f"device {device}: no GPU; every decode runs on the PyTorch reference backend")
    print(f"requested backend: {requested} (${capabilities.ENV_VAR}; mla_backend=... at load or per call overrides it)")
    print(f"model types (a checkpoint's config.json \"model_type\"): {', '.join(CHECKPOINT_MODEL_TYPES)}")
    print(f"latent: kv_lora_rank {args.kv_lora_rank} + rope {args.rope_dim}\n")
    print("decode backend by dtype and number of query heads per device:")
    print(f"{'dtype':<{WIDTH}}" + "".join(f"{f'{h} heads':>{WIDTH}}" for h in HEADS))
    for name, row in rows.items():
        print(f"{name:<{WIDTH}}" + "".join(f"{backend:>{WIDTH}}" for backend in row))
    if notes:
        print()
    for (backend, reason), cells in notes.items():
        where = _where(cells)
        print(f"{backend} because {reason} ({where})" if backend != "error" else f"error ({where}): {reason}")


if __name__ == "__main__":
    main()
