"""Weight absorption: the per-head key and value halves of ``kv_b_proj``.

``kv_b_proj`` maps the ``kv_lora_rank``-wide latent to ``H * (qk_nope + v_head_dim)`` values; per head the first
``qk_nope`` output rows are W_UK and the next ``v_head_dim`` rows W_UV. Absorbed decode computes
``q_lat = q_nope @ W_UK`` (a ``kv_lora_rank``-wide query), attends over the cached latent, and maps the latent
output back with W_UV.

Where the dense matrix comes from:

* A plain ``nn.Linear`` (bf16/fp16/fp32 checkpoints): W_UK and W_UV are *views of the live weight*, so they are
  never stale (a view reads the weight's current values), gradients reach ``kv_b_proj.weight`` exactly as with
  sdpa, and ``.to()``/``deepcopy``/``save_pretrained`` see only the model's own tensors. Slicing them costs about as
  much host time as a kernel launch, so outside autograd the views of each layer are kept in `_views` (weakly, off
  the module) until its weight is another tensor or lives in other memory; ``.to()`` drops them at once (the hook
  in ``models.py``), and a weight replaced otherwise is let go at its layer's next decode. Under tensor parallelism
  the weight is a DTensor; its local shard (this rank's heads) is used.
* A PEFT LoRA layer: its base layer is absorbed as either kind here is, and its adapters' factors are applied
  live, at rank r, on top (``adapters.py``): nothing derived from an adapter can go stale, hot-swaps through
  ``.data`` included.
* Any other module (FP8, bitsandbytes, GPTQ/AWQ, compressed-tensors, a custom linear): the dense matrix is derived
  once, in the activation dtype, with the quantizer's own dequantize function where there is one (`DEQUANTIZERS`)
  and otherwise format-blind, by running the module on the identity basis of its input width (``proj(I) -
  proj(0)`` is exactly ``W^T``). The copy is a non-persistent buffer of ``kv_b_proj``: it moves with ``.to()``, is
  never saved, and is re-derived when any parameter or buffer of the module changes (identity or version; a write
  through ``weight.data`` is the one change no key sees). It costs ``rows * kv_lora_rank`` activation-dtype values
  per layer (32 MiB per layer for DeepSeek-V3 in bf16), paid only by layers that decode. Such a module gives no
  absorbed path when its parameters need gradients, or when its forward is not linear (dropout in train mode, say).

Where no absorbed weight can be trusted to compute what the module computes, the attention expands the latent
through the module itself, as sdpa does (`absorbed_weights` returns None, after one warning saying why,
`unabsorbable`): forward hooks on the module or on every module, or its forward replaced on the instance (PEFT's
per-row ``adapter_names``, pruning, a user's hook, an accelerate ``ModelHook``; tensor parallelism's hooks and
accelerate's device alignment are the exceptions: the local shards and the attention's device handling account for
them), weights offloaded to the meta
device (accelerate's CPU or disk offload loads them only inside the module's forward), and, for a derived copy,
state no key can watch (an ``nn.Linear`` subclass's plain attributes, inference tensors, whose in-place changes
leave no version behind).
"""

from __future__ import annotations

import dataclasses
import logging
import weakref
from dataclasses import dataclass
from typing import Callable

import torch
import transformers.utils.logging  # noqa: F401  (adds `info_once` to loggers)
from torch import nn
from torch.multiprocessing.reductions import StorageWeakRef
from torch.nn.modules import module as _nn_module

from . import adapters

logger = logging.getLogger("hf_flashinfer_mla")

# A documented cache: each attention module's W_UK/W_UV views of its plain kv_b_proj weight (or its LoRA's base),
# for inference, with what the views depend on (`_Views`; a view follows the weight's values). Weak, and kept off
# the module, so an entry dies with its module and deepcopy or a state dict never sees it.
_views: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()

_DENSE = "_flashinfer_mla_dense"  # buffer name on kv_b_proj: [rows, rank] (+1 row: the bias) in the activation dtype

# A documented cache: for each kv_b_proj with a derived copy (or found unfit for one), the key of the state it was
# looked at in (`_source_key`), whether the copy holds a bias row (None: no copy), and weak references to the
# storages of that state. Weak and off the module: a deepcopy or a reloaded module derives its own copy.
_derived: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


@dataclass(frozen=True)
class AbsorbedWeights:
    w_uk: torch.Tensor  # [H, qk_nope_head_dim, kv_lora_rank]
    w_uv_t: torch.Tensor  # [H, kv_lora_rank, v_head_dim]: W_UV transposed, as the projection multiplies by it
    v_bias: torch.Tensor | None  # [H, v_head_dim]; a key bias cancels in the softmax (without sinks)
    num_heads: int
    biased: bool = False  # kv_b_proj adds a bias (to keys, values or both)
    lora: tuple[adapters.LoraTerm, ...] = ()  # a PEFT LoRA's adapters, applied live on top (``adapters.py``)


try:
    from torch.distributed.tensor import DTensor
except ImportError:  # a torch built without distributed support
    class DTensor:  # noqa: D101  (nothing is an instance)
        pass


def _local(t: torch.Tensor | None) -> torch.Tensor | None:
    """The local shard of a DTensor (tensor parallelism), any other tensor unchanged (differentiable)."""
    return t.to_local() if isinstance(t, DTensor) else t


def _is_plain_linear(proj: nn.Module) -> bool:
    return type(proj) is nn.Linear and proj.weight.is_floating_point() and proj.weight.element_size() > 1


def absorbed_weights(module: nn.Module, dtype: torch.dtype, sinks: bool = False) -> AbsorbedWeights | None:
    """W_UK / W_UV of ``module.kv_b_proj`` in `dtype`, or None where the latent must be expanded instead.

    Call once per layer and step: for a plain linear it only slices the live weight. With attention `sinks` a bias
    does not commute with the softmax (a key bias shifts the scores against the sink's logit, and the value bias
    counts only the weights' mass outside the sink), so a biased kv_b_proj is expanded instead, as eager does.
    """
    weights = _absorbed_weights(module, dtype)
    if weights is not None and sinks and weights.biased:
        logger.warning_once("flashinfer_mla: decode expands the latent through kv_b_proj itself, as eager does, "
                            "instead of absorbing its weights: kv_b_proj has a bias and the layer has attention "
                            "sinks, with which a bias does not factor out of the softmax.")
        return None
    return weights


def _absorbed_weights(module: nn.Module, dtype: torch.dtype) -> AbsorbedWeights | None:
    proj = module._modules["kv_b_proj"]  # (read off the dicts, not through nn.Module.__getattr__: it costs)
    if not adapters.is_lora(proj):
        return _base_weights(module, proj, proj, dtype)
    # A PEFT LoRA layer: its base absorbed as any kv_b_proj, its adapters applied live (``adapters.py``).
    base = _base_weights(module, proj, proj._modules["base_layer"], dtype)
    if base is None:
        return None
    terms = adapters.lora_terms(proj, base.num_heads, module.qk_nope_head_dim, dtype)
    if isinstance(terms, str):
        logger.warning_once(f"flashinfer_mla: decode expands the latent through kv_b_proj itself, as sdpa does, "
                            f"instead of absorbing its weights: {terms}.")
        return None
    if not terms:
        return base
    return dataclasses.replace(base, lora=terms, biased=base.biased or any(t.v_bias is not None for t in terms))


def _base_weights(module: nn.Module, proj: nn.Module, linear: nn.Module, dtype: torch.dtype
                  ) -> AbsorbedWeights | None:
    """W_UK / W_UV of `linear`: `proj` itself, or the base layer of the LoRA layer `proj`."""
    inference = not (torch.is_grad_enabled() or torch.compiler.is_compiling())
    # (autograd: each forward's graph gets its own views; a compiled graph holds its own)
    hit = _views.get(module) if inference else None
    if hit is not None and hit.proj is proj and hit.linear is linear and type(linear) is nn.Linear:
        # (a class can be swapped on an instance)
        weight, bias = linear._parameters.get("weight"), linear._parameters.get("bias")
        if (weight is hit.weight and bias is hit.bias and _storage(weight, bias, hit.sharded) == hit.storage
                and _hooks_key(proj, linear) == hit.hooks):
            return hit.views
    if _is_plain_linear(linear):
        if not _absorbable(proj):
            return None
        weight, bias = _local(linear.weight), _local(linear.bias)
        if not inference:
            return _split(module, weight, bias)
        views = _split(module, weight, bias)
        sharded = isinstance(linear.weight, DTensor)
        _views[module] = _Views(proj, linear, linear.weight, linear.bias, sharded,
                                _storage(linear.weight, linear.bias, sharded), _hooks_key(proj, linear), views)
        return views
    if torch.is_grad_enabled() and any(p.requires_grad for p in linear.parameters()):
        return None  # a derived copy would carry no gradient to the module's own parameters
    if linear is not proj and not _absorbable(proj):
        return None
    dense = _dense_copy(linear, module.kv_lora_rank, dtype)
    if dense is None:
        return None
    weight, bias = dense
    return _split(module, weight, bias)


@dataclass(frozen=True, eq=False)
class _Views:
    """An entry of `_views`: the views of one layer's plain weight and everything they depend on."""

    proj: nn.Module  # the layer's kv_b_proj
    linear: nn.Linear  # whose weight they view: kv_b_proj itself, or a LoRA layer's base
    weight: torch.Tensor
    bias: torch.Tensor | None
    sharded: bool  # DTensors (tensor parallelism): their local shards are what move
    storage: tuple  # `_storage` of weight and bias
    hooks: tuple  # `_hooks_key` of kv_b_proj and the linear
    views: AbsorbedWeights


def forget_views(module: nn.Module) -> None:
    """Drop the views `_views` keeps of `module`'s kv_b_proj weight (called before ``.to()`` moves it)."""
    _views.pop(module, None)


def _absorbable(proj: nn.Module) -> bool:
    """`unabsorbable`'s verdict, warned about once per reason."""
    reason = unabsorbable(proj)
    if reason is not None:
        logger.warning_once(f"flashinfer_mla: decode expands the latent through kv_b_proj itself, as sdpa does, "
                            f"instead of absorbing its weights: {reason}.")
    return reason is None


def unabsorbable(proj: nn.Module) -> str | None:
    """Why no absorbed weight computes what `proj` computes (see the module's docstring), or None."""
    own = [h for m in proj.modules() for h in (*m._forward_pre_hooks.values(), *m._forward_hooks.values())]
    every = [*_nn_module._global_forward_pre_hooks.values(), *_nn_module._global_forward_hooks.values()]
    names = sorted({_name(h) for h in own if not _where(h).startswith("torch.distributed")})
    if names:
        return f"it has forward hooks ({', '.join(names)}) that absorbed decode would skip"
    if every:
        return (f"forward hooks for every module are registered ({', '.join(sorted({_name(h) for h in every}))}, "
                "with torch.nn.modules.module.register_module_forward_hook), which absorbed decode would skip")
    backward = sorted({_name(h) for h in _backward_hooks(proj) if not _where(h).startswith("torch.distributed")})
    if backward:
        return (f"it has backward hooks ({', '.join(backward)}, on it or on every module) that absorbed decode would "
                "skip while gradients are enabled")
    if any(t.is_meta for t in proj.parameters()):
        return ("its weights are offloaded (on the meta device until its forward loads them); keep it on the GPU, "
                "in a device_map without CPU or disk offload, for absorbed decode")
    replaced = sorted({type(m).__name__ for m in proj.modules() if "forward" in m.__dict__ and not _aligned(m)})
    if replaced:
        return (f"the forward of its {', '.join(replaced)} is replaced on the instance (an accelerate hook, say), "
                "which absorbed decode would skip")
    if _is_plain_linear(proj) or adapters.is_lora(proj):
        return None  # (views of a live weight; a LoRA layer's base is looked at on its own, its adapters live)
    hidden = next((m for m in proj.modules() if not _state_is_visible(m)), None)
    if hidden is not None:
        reason = (f"it holds a {_qualified(hidden)}, whose output may depend on state this package cannot watch "
                  "for changes, such as plain attributes, so a derived copy could go stale")
        if type(hidden).__module__.split(".")[0] == "peft":
            return reason
        return (f"{reason}; if it depends on its tensors alone, add \"{_qualified(hidden)}\" to "
                "hf_flashinfer_mla.absorption.KNOWN_LINEARS")
    if any(t.is_inference() for t in _sources(proj)):
        return ("its tensors are inference tensors (made under torch.inference_mode()), whose in-place changes leave "
                "no trace, so a derived copy could go stale; load the model under torch.no_grad() for absorbed decode")
    return None


def _backward_hooks(proj: nn.Module) -> list:
    """The backward hooks a call of `proj` would run while gradients are enabled (none under no_grad, where they
    never fire)."""
    if not torch.is_grad_enabled():
        return []
    return [*(h for m in proj.modules() for h in (*m._backward_pre_hooks.values(), *m._backward_hooks.values())),
            *_nn_module._global_backward_pre_hooks.values(), *_nn_module._global_backward_hooks.values()]


def _aligned(module: nn.Module) -> bool:
    """Whether a forward replaced on `module` is accelerate's device alignment alone (``device_map`` without
    offload): it moves inputs and outputs between devices, which the attention does itself."""
    from accelerate.hooks import AlignDevicesHook, SequentialHook

    hook = getattr(module, "_hf_hook", None)
    hooks = hook.hooks if isinstance(hook, SequentialHook) else [hook]
    return all(isinstance(h, AlignDevicesHook) and not h.offload for h in hooks)


def _hooks_key(proj: nn.Module, linear: nn.Module) -> tuple:
    """The forward hooks that may run on `proj` and its base `linear` (their handles' ids) and whether their forward
    is replaced: tensor parallelism's hooks and accelerate's alignment, set once, keep the views of `_views`; any
    change since makes `unabsorbable` look again. (A LoRA's adapter modules are looked at every step,
    ``adapters.lora_terms``.)"""
    key = (tuple(proj._forward_pre_hooks), tuple(proj._forward_hooks), tuple(_nn_module._global_forward_pre_hooks),
           tuple(_nn_module._global_forward_hooks), proj.__dict__.get("forward"))
    if linear is proj:
        return key
    return key, tuple(linear._forward_pre_hooks), tuple(linear._forward_hooks), linear.__dict__.get("forward")


def _where(hook) -> str:
    hook = getattr(hook, "func", hook)  # (a functools.partial)
    return getattr(hook, "__module__", None) or type(hook).__module__


def _name(hook) -> str:
    hook = getattr(hook, "func", hook)
    return f"{_where(hook)}.{getattr(hook, '__qualname__', type(hook).__qualname__)}"


def _storage(weight: torch.Tensor, bias: torch.Tensor | None, sharded: bool) -> tuple:
    """Where a plain linear's weight and bias live (`sharded`: DTensors, whose own data_ptr() is 0: their local
    shards are what move); with the objects themselves, what the views of `_views` depend on (``.to()`` and
    ``.half()`` give a parameter new storage, ``load_state_dict`` writes into it)."""
    if sharded:
        weight, bias = _local(weight), _local(bias)
    return weight.data_ptr(), None if bias is None else bias.data_ptr()


def _split(module: nn.Module, weight: torch.Tensor, bias: torch.Tensor | None) -> AbsorbedWeights:
    nope, v_dim = module.qk_nope_head_dim, module.v_head_dim
    rows, rank = weight.shape
    if rows % (nope + v_dim):
        raise ValueError(
            f"kv_b_proj maps to {rows} values, not a multiple of qk_nope_head_dim + v_head_dim = {nope + v_dim}; "
            "cannot split it into per-head key and value projections."
        )
    num_heads = rows // (nope + v_dim)
    per_head = weight.unflatten(0, (num_heads, nope + v_dim))
    v_bias = None if bias is None else bias.unflatten(0, (num_heads, nope + v_dim))[:, nope:]
    return AbsorbedWeights(per_head[:, :nope], per_head[:, nope:].transpose(1, 2), v_bias, num_heads,
                           bias is not None)


# ------------------------------------------------------------------------------------------------- derived copies
def _dequantize_fp8(proj: nn.Module, dtype: torch.dtype):
    # Transformers' own dequantization of its FP8Linear (block or per-tensor scales), as its backward uses.
    from transformers.integrations.finegrained_fp8 import _dequantize_fp8_weight

    return _dequantize_fp8_weight(proj.weight, proj.weight_scale_inv, proj.block_size, dtype), proj.bias


def _dequantize_bnb_4bit(proj: nn.Module, dtype: torch.dtype):
    import copy

    import bitsandbytes.functional as bnbf

    weight, state = proj.weight.data, proj.weight.quant_state
    if getattr(state, "packing_format_for_cpu", False):
        # On CPUs with AVX512-BF16, bitsandbytes repacks a 4-bit weight for its CPU kernel at the first forward, a
        # layout its dequantization does not read (it returns other values, silently): unpacked first, through its
        # own inverse, on copies (the inverse rewrites the state it is given). A release without it: None.
        unpack = getattr(bnbf, "_convert_weight_packed_for_cpu_inverse", None)
        if unpack is None:
            return None
        weight, state = unpack(weight.clone(), copy.deepcopy(state))
    return bnbf.dequantize_4bit(weight, state).to(dtype), proj.bias


# Quantized linear class name -> its library's dequantization (None where it cannot read the weight as it is). Everything
# else goes through the identity basis.
DEQUANTIZERS: dict[str, Callable[[nn.Module, torch.dtype], tuple[torch.Tensor, torch.Tensor | None]]] = {
    "FP8Linear": _dequantize_fp8,
    "Linear4bit": _dequantize_bnb_4bit,
}


# Linear classes (by name) whose output depends only on their parameters, buffers and training flag (all in the key
# below), besides torch.nn's own modules: the quantized linears of the libraries Transformers
# loads. A user's own class joins them by adding its qualified name (``"my_package.layers.MyLinear"``) here.
KNOWN_LINEARS = {
    "FP8Linear", "Linear4bit", "Linear8bitLt", "QuantLinear", "WQLinear_GEMM", "WQLinear_GEMV", "WQLinear_Exllama",
    "WQLinear_ExllamaV2", "CompressedLinear", "HQQLinear", "QLinear", "FbgemmFp8Linear",
}


def _state_is_visible(m: nn.Module) -> bool:
    """Whether the key below sees everything module `m` computes with: its tensors and training flag. Any other
    module, an ``nn.Linear`` subclass of the user's included, might keep state in plain attributes that no key can
    see; so do PEFT's tuners (they switch adapters by plain attributes, and hot-swap writes through ``.data``: a
    LoRA layer is never derived, its adapters apply live)."""
    if type(m).__module__.split(".")[0] == "peft":
        return False
    return (type(m).__name__ in KNOWN_LINEARS or _qualified(m) in KNOWN_LINEARS
            or type(m).__module__.startswith("torch.nn"))


def _qualified(m: nn.Module) -> str:
    return f"{type(m).__module__}.{type(m).__qualname__}"


def _sources(proj: nn.Module) -> list[torch.Tensor]:
    """Every tensor `proj` computes with (a DTensor's local shard: its own data_ptr() is 0, the shard is what
    changes when the weight does)."""
    return ([_local(t) for t in proj.parameters()]
            + [_local(t) for n, t in proj.named_buffers() if not n.endswith(_DENSE)])


def _source_key(proj: nn.Module, dtype: torch.dtype, tensors: list[torch.Tensor]) -> tuple:
    """Storage and version of everything the module computes with, and each submodule's class, training flag and
    hooks: any change (``load_state_dict``, ``.to()``, an optimizer step, ``weight.data = ...``, a copy of the
    module, a hook (a backward one while gradients are enabled)) looks at the module again. (A write through
    ``weight.data`` bumps no version: it is the one change no key sees.)"""
    return (
        dtype,
        tuple((t.untyped_storage()._cdata, None if t.is_inference() else t._version) for t in tensors),
        tuple((type(m), m.training, tuple(m._forward_pre_hooks), tuple(m._forward_hooks), m.__dict__.get("forward"))
              for m in proj.modules()),
        (tuple(_nn_module._global_forward_pre_hooks), tuple(_nn_module._global_forward_hooks)),
        tuple(id(h) for h in _backward_hooks(proj)),
    )


@torch.no_grad()
def _dense_copy(proj: nn.Module, rank: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor | None] | None:
    tensors = _sources(proj)
    key = _source_key(proj, dtype, tensors)
    held = _derived.get(proj)
    if held is not None and held[0] == key and not any(ref.expired() for ref in held[2]):
        # (the same state: its copy, or its verdict that none can be made, not looked at again until it changes)
        return None if held[1] is None else _unpack(getattr(proj, _DENSE), held[1])
    # Weak references to the storages keep their addresses from being reused while the key names them (a new weight
    # could otherwise take an old one's address), without keeping their memory.
    refs = [StorageWeakRef(t.untyped_storage()) for t in tensors]
    derived = _derive(proj, rank, dtype) if _absorbable(proj) else None
    if derived is None:
        _derived[proj] = (key, None, refs)
        return None
    weight, bias = derived
    weight = _local(weight).to(dtype)
    bias = None if bias is None else _local(bias).to(dtype)
    packed = weight if bias is None else torch.cat([weight, bias[:, None]], dim=1)
    proj.register_buffer(_DENSE, packed.contiguous(), persistent=False)
    _derived[proj] = (key, bias is not None, refs)  # (the buffer is not in the key)
    logger.info_once(  # Transformers' logging adds info_once to every logger; one line per format and size
        f"flashinfer_mla: absorbed decode keeps a dense {dtype} copy of each {type(proj).__name__} kv_b_proj "
        f"({packed.numel() * packed.element_size() / 2**20:.1f} MiB per layer that decodes)."
    )
    return _unpack(getattr(proj, _DENSE), bias is not None)


def _derive(proj: nn.Module, rank: int, dtype: torch.dtype):
    """``(weight, bias)`` of what `proj` computes, or None where it is not linear."""
    if _is_plain_linear(proj):
        return proj.weight, proj.bias
    dequantize = DEQUANTIZERS.get(type(proj).__name__)
    derived = None if dequantize is None else dequantize(proj, dtype)
    return derived if derived is not None else _from_identity_basis(proj, rank, dtype)


def _unpack(packed: torch.Tensor, has_bias: bool):
    return (packed[:, :-1], packed[:, -1]) if has_bias else (packed, None)


def _from_identity_basis(proj: nn.Module, rank: int, dtype: torch.dtype):
    """``W^T = proj(I) - proj(0)`` for a module whose forward is linear in its input, checked on random inputs."""
    device = next((t.device for t in proj.parameters()), torch.device("cpu"))
    # A private generator: the probe must not advance the user's random state (sampling would then differ).
    random = torch.randn(2, rank, generator=torch.Generator().manual_seed(0))
    probe = torch.cat([torch.eye(rank), torch.zeros(1, rank), random]).to(device, dtype)
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):  # (dropout draws from it)
        out = proj(probe)
        again = proj(probe)
    weight_t, bias = out[:rank] - out[rank], out[rank]
    x = probe[rank + 1:]
    expected = x @ weight_t + bias
    # Loose enough for modules that quantize their activations (W8A8), tight enough for anything non-linear.
    tol = {torch.float64: 1e-9, torch.float32: 1e-3}.get(dtype, 1e-1)
    err = ((out[rank + 1:] - expected).float().norm() / expected.float().norm().clamp_min(1e-30)).item()
    if not torch.equal(out, again) or not err < tol:
        logger.warning_once(
            f"flashinfer_mla: kv_b_proj ({type(proj).__name__}) is not a linear function of its input here (or is "
            "non-deterministic: dropout in train mode?), so its weights cannot be absorbed; decode expands the latent "
            "through the module itself, as sdpa does. Call model.eval() for absorbed decode."
        )
        return None
    has_bias = bool(bias.abs().max() > 0)
    return weight_t.t(), bias if has_bias else None


# ------------------------------------------------------------------------------------------------- the two GEMMs
def absorb_query(query: torch.Tensor, nope: int, weights: AbsorbedWeights) -> tuple[torch.Tensor, torch.Tensor]:
    """``[B, H, Sq, qk_nope + rope]`` query -> (latent query ``[H, B * Sq, kv_lora_rank]``, one batched GEMM over
    heads; rotary query ``[B * Sq, H, rope]``).

    The latent operands stay head-major (row ``b * Sq + s``) from here to the projection: FlashInfer's kernels take
    the strides of their query and output, so no layer copies them into another layout. With one query token (decode)
    both halves are one strided view each of the query, not a chain of five views: this runs on every layer of every
    step, where each view costs host time."""
    b, h, s, d = query.shape
    if s == 1 and not (query.requires_grad or torch.compiler.is_compiling()):
        # (autograd and compilers get plain views: as_strided's backward is costly, and a compiler may lay out the
        # query otherwise than eager did)
        sb, sh, _, sd = query.stride()
        at = query.storage_offset()
        q_nope = query.as_strided((h, b, nope), (sh, sb, sd), at)
        q_pe = query.as_strided((b, h, d - nope), (sb, sh, sd), at + nope * sd)
    else:
        q_nope = query.narrow(-1, 0, nope).permute(1, 0, 2, 3).reshape(h, b * s, nope)
        q_pe = query.narrow(-1, nope, d - nope).transpose(1, 2).reshape(b * s, h, d - nope)
    q_lat = torch.bmm(q_nope, weights.w_uk)
    if weights.lora:
        q_lat = adapters.adapt_query(q_lat, q_nope, weights.lora)
    return q_lat, q_pe


def project_output(o_lat: torch.Tensor, weights: AbsorbedWeights, batch: int) -> torch.Tensor:
    """Latent attention output ``[H, B * Sq, kv_lora_rank]`` -> ``[B, Sq, H, v_head_dim]`` (the interface's layout;
    one strided view of the GEMM's output)."""
    h, n, _ = o_lat.shape
    out = torch.bmm(o_lat, weights.w_uv_t)  # [H, B*Sq, dv]
    if weights.lora:
        out = adapters.adapt_output(out, o_lat, weights.lora)
    if weights.v_bias is not None:
        out = out + weights.v_bias[:, None, :]
    if out.requires_grad or torch.compiler.is_compiling():
        return out.view(h, batch, n // batch, -1).permute(1, 2, 0, 3)
    dv = out.shape[-1]
    return out.as_strided((batch, n // batch, h, dv), (n // batch * dv, dv, n * dv, 1))
