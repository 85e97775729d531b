"""The attention over continuous batching's paged latent cache (``paged_cache.py``).

Under continuous batching the attention function receives every request's query tokens packed (``[1, H, T, d]``),
``cu_seq_lens_q/k``, the layer's rows of the paged cache and the step's read indices; no mask, no cache object.

* `PagedStep`: one forward's host-side lengths, built when Transformers prepares the batch (so planning never waits
  for the GPU), and the step's `plan.Routing`: its decode requests (one query token each) run through the same
  per-layer routine as generate()'s (``decode.decode_layer``: absorb -> the step's route -> project), their rows
  given to the kernel builders as a ``rows.PageTable`` over the read indices. Each family reads it as it reads any
  cache: fa3/fa2 with pages of one row, trtllm-gen/cute-dsl with block tables of 64 (or 32) rows gathered from it
  where Transformers' pages of a multiple of 32 rows hold packed latent rows, the reference by gathering the rows.
* Prefill chunks, which continuous batching mixes with decodes in one batch, are expanded through the model's own
  ``expand_kv`` and attended causally: on FlashInfer's ragged prefill, one launch per group of requests, where the
  decode runs on fa3 (``kernels/ragged.py``), else with Transformers' SDPA one request at a time.
"""

from __future__ import annotations

import functools

import torch
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.utils import logging

from . import capabilities
from .absorption import absorbed_weights
from .decode import decode_layer
from .kernels import Layer, Refused, ragged
from .models import original_expand_kv
from .paged_cache import LatentAllocator
from .plan import Routing
from .rows import PageTable, Rows, to_device

logger = logging.get_logger("hf_flashinfer_mla")


class PagedStep(Routing):
    """One continuous-batching forward, on the host: request ``r`` has ``q_lens[r]`` query tokens (packed in order)
    and sees ``k_lens[r]`` cached rows (its past and its new tokens), listed in order in the step's read indices.
    Its decode requests' routes are shared by its layers (`plan.Routing`)."""

    paged = True
    q_len = 1  # the routes serve the decode requests: one query token each

    def __init__(self, q_lens: torch.Tensor, k_lens: torch.Tensor, tokens: int):
        super().__init__()
        self.q_lens, self.k_lens = q_lens, k_lens  # [B] int64, host
        self.tokens = tokens  # query tokens of the forward, padding included
        self.started = False  # a forward has run on it
        self.prefill_groups: dict[tuple, list] = {}  # the prefill chunks' ragged-prefill groups, planned per shape
        self.page_rows = 0  # rows per page of a cache storing the latent packed (trtllm-gen reads those); 0: not
        self.cu_q = torch.zeros(self.batch + 1, dtype=torch.long)
        self.cu_q[1:] = q_lens.cumsum(0)
        self.kv_offsets = torch.zeros(self.batch + 1, dtype=torch.long)
        self.kv_offsets[1:] = k_lens.cumsum(0)
        self.decode = (q_lens == 1).nonzero().flatten()  # requests that run absorbed
        # the others with query tokens: prefill chunks (a request may have none: Transformers prefills a prompt to be
        # forked, sampled several times, without its last token, which for a 1-token prompt leaves nothing)
        self.chunks = (q_lens > 1).nonzero().flatten().tolist()
        self._rows = Rows(k_lens[self.decode].to(torch.int32), 1, None)

    @property
    def batch(self) -> int:
        return self.q_lens.numel()

    @classmethod
    def of_batch(cls, requests, tokens: int) -> PagedStep:
        """From Transformers' scheduled requests, once `prepare_batch_tensors` has advanced their offsets."""
        q = torch.tensor([fs.query_length for fs in requests], dtype=torch.long)
        end = torch.tensor([fs.state.position_offset for fs in requests], dtype=torch.long)
        return cls(q, end, tokens)

    @classmethod
    def from_kwargs(cls, cu_q: torch.Tensor, cu_k: torch.Tensor, tokens: int) -> PagedStep:
        """From the forward's own cumulative lengths (one device-to-host copy): a forward not prepared by
        continuous batching's loop."""
        host = torch.stack([cu_q.long(), cu_k.long()]).cpu()
        q, k = host.diff(dim=1)
        keep = q > 0  # padding sequences have no tokens
        return cls(q[keep], k[keep], tokens)

    def matches(self, tokens: int, cu_q: torch.Tensor) -> bool:
        return self.tokens == tokens and cu_q.numel() >= self.batch + 1

    def start(self, source: torch.Tensor, page_rows: int) -> None:
        """The first layer's forward: the step's read indices (`source`, on the device) become its page table."""
        self.started, self.page_rows = True, page_rows
        self.pages = PageTable(self.kv_offsets[self.decode], source, int(self.kv_offsets[-1]), page_rows)

    # ------------------------------------------------------------------------------------------- what builders read
    def rows(self) -> Rows:
        """The decode requests' rows: their lengths (where they lie is `pages`)."""
        return self._rows

    def layer_of(self, q_lat, kv_latent, k_rot, scale: float, topk: int = 0, sinks: bool = False) -> Layer:
        # (no pitch: the layer's rows are one sequence of the whole paged cache, addressed through `pages`)
        return Layer(q_lat.device, q_lat.dtype, kv_latent.dtype, q_lat.shape[0], kv_latent.shape[-1],
                     k_rot.shape[-1], 0, self.page_rows > 0, scale, topk, sinks)


def prepare_step(cache, requests, tokens: int) -> None:
    """Hand the batch Transformers just prepared to the cache's latent allocator (its seam, `paged_steps`, calls this
    after ``ContinuousBatchingIOs.prepare_batch_tensors``)."""
    for allocator in cache.cache_allocators.values():
        if isinstance(allocator, LatentAllocator):
            allocator.step = PagedStep.of_batch(requests, tokens)


def attend(allocator: LatentAllocator, module, query, kv_latent, k_rot, scaling, mla_backend=None, **kwargs):
    """One layer's attention over the paged latent: ``query [1, H, T, qk_head_dim]`` (every request's tokens packed)
    -> ``(attn_output [1, T, H, v_head_dim], None)``; padding tokens get zeros."""
    cu_q = kwargs["cu_seq_lens_q"]
    step = allocator.step
    # A prepared step serves exactly one forward: the one whose first layer finds it unstarted.
    first = module.layer_idx == allocator.layer_indices[0]
    if step is None or (first and step.started) or not step.matches(query.shape[2], cu_q):
        step = allocator.step = PagedStep.from_kwargs(cu_q, kwargs["cu_seq_lens_k"], query.shape[2])
    read_index = kwargs["read_index"][allocator.index]
    # A step with no cached past reads nothing back: its rows are the ones it writes, in the same order.
    source = read_index if read_index.numel() else kwargs["write_index"][allocator.index]
    if not step.started:
        packed = allocator.row_width == allocator.rank + allocator.rope
        step.start(source, allocator.tokens_per_page if packed else 0)
    scale = scaling if scaling is not None else module.qk_head_dim**-0.5
    h, t = query.shape[1], query.shape[2]
    out = query.new_zeros(1, t, h, module.v_head_dim)
    weights = absorbed_weights(module, query.dtype) if len(step.decode) else None
    decode = step.decode if weights is not None else step.decode[:0]
    if len(decode):
        tokens = step.cu_q[decode]
        all_decode = len(decode) == step.batch == t
        q = query if all_decode else query[:, :, to_device(tokens, query.device)]
        o = decode_layer(module, step, q, kv_latent, k_rot, weights, scale, mla_backend)  # [1, N, H, dv]
        if all_decode:
            return o, None
        out.index_copy_(1, to_device(tokens, out.device), o)
    requested = capabilities.requested_backend(mla_backend, module.config)
    _prefill(allocator, step, decode, module, query, kv_latent, k_rot, source, scale, requested, out)
    return out, None


def _prefill(allocator: LatentAllocator, step: PagedStep, decoded, module, query, kv_latent, k_rot, source, scale,
             requested, out) -> None:
    """Every request not decoded absorbed: its rows expanded through the model's own ``expand_kv`` and attended
    causally, on FlashInfer's ragged prefill (``kernels/ragged.py``: one launch per group of requests) where the
    step's decode backend is fa3 and it serves the head dims, else with Transformers' SDPA one request at a time
    (so the transient keys and values are one request's)."""
    # (no decode: a layer that cannot absorb runs every request with query tokens here)
    pending = step.chunks if len(decoded) else (step.q_lens > 0).nonzero().flatten().tolist()
    if not pending:
        return
    lat_rows, rot_rows = kv_latent[0, 0], k_rot[0, 0]
    expand = original_expand_kv(module)
    key = (query.device, query.dtype, query.shape[1], query.shape[-1], module.v_head_dim, scale, requested,
           len(pending))
    if key not in step.prefill_groups:
        step.prefill_groups[key] = _prefill_groups(allocator, step, pending, module, query, scale, requested)
    for group in step.prefill_groups[key]:
        rows = source[group.kv_index]
        keys, values = expand(lat_rows.index_select(0, rows)[None, None], rot_rows.index_select(0, rows)[None, None])
        q = query[0].index_select(1, group.q_index).transpose(0, 1)  # [N, H, qk]
        o = ragged.run(group.wrapper, q, keys[0].transpose(0, 1), values[0].transpose(0, 1))
        out[0].index_copy_(0, group.q_index, o)
    if step.prefill_groups[key]:
        return
    for r in pending:
        q0, q, k0, k = (int(x) for x in (step.cu_q[r], step.q_lens[r], step.kv_offsets[r], step.k_lens[r]))
        rows = source[k0 : k0 + k]
        keys, values = expand(lat_rows.index_select(0, rows)[None, None], rot_rows.index_select(0, rows)[None, None])
        mask = None
        if q > 1 and k > q:  # a chunk after a cached past: query i sees rows up to k - q + i
            mask = torch.arange(k, device=query.device) <= torch.arange(k - q, k, device=query.device)[:, None]
            mask = mask[None, None]
        o, _ = sdpa_attention_forward(module, query[:, :, q0 : q0 + q], keys, values, mask, dropout=0.0,
                                      scaling=scale, is_causal=True)
        out[:, q0 : q0 + q] = o


def _prefill_groups(allocator, step: PagedStep, pending: list[int], module, query, scale, requested) -> list:
    """The step's ragged-prefill groups, planned (empty: the step's prefill runs on SDPA). fa3 prefills where the
    step's decode backend is fa3, so a request for the reference backend keeps the whole step in PyTorch."""
    device, dtype, heads, qk = query.device, query.dtype, query.shape[1], query.shape[-1]
    vo = module.v_head_dim
    decode_backend = capabilities.choose_backend(device, dtype, module.kv_lora_rank, module.qk_rope_head_dim, heads,
                                                 requested)
    if decode_backend != "fa3" or not ragged.supported_dims(qk, vo):
        return []
    row_bytes = heads * (qk + vo + module.qk_nope_head_dim + vo) * query.element_size()
    groups = ragged.groups(step.q_lens, step.k_lens, step.cu_q, step.kv_offsets, pending, row_bytes, device)
    try:
        for i, group in enumerate(groups):
            group.wrapper = allocator.prefill_wrappers.get(device, i)
            ragged.plan(group.wrapper, step.q_lens[group.requests], step.k_lens[group.requests], heads, qk, vo,
                        scale, dtype)
    except Refused as exc:
        logger.warning_once(f"flashinfer_mla: continuous batching's prefill chunks run on SDPA, one request at a "
                            f"time ({str(exc)[:200]})")
        return []
    return groups


# Seam (``registration.py``): where Transformers has laid out a batch on the host
def paged_steps(original):
    # The attention receives only device tensors (cu_seq_lens, read indices); reading their lengths would wait for
    # the GPU. Here, where Transformers has just laid out the batch on the host, its lengths go to the latent
    # allocator, so every layer of the step plans its kernels without a sync.
    @functools.wraps(original)
    def prepare_batch_tensors(self, *args, **kwargs):
        original(self, *args, **kwargs)
        prepare_step(self.cache, self.requests_in_batch, self.num_q_tokens)

    return prepare_batch_tensors
