"""Continuous batching for MLA models: a paged latent cache inside Transformers' `PagedAttentionCache`, and the
attention over it.

Transformers' continuous batching (``generate_batch``, ``init_continuous_batching``, ``transformers serve``) keeps
every request's cache in one paged tensor. Up to 5.24 its full-attention allocator sizes a token as ``(2,
num_key_value_heads, head_dim)``, per-head keys and values, while an MLA layer writes one latent row per token
(``kv_lora_rank + rope`` values, 576 for DeepSeek): the first cache write fails and every request ends FAILED. 5.25
adds an MLA allocator with the same rows (`MLACacheAllocator`), which gathers each step's rows and hands them to the
model's own expansion. Here, on either version:

* `LatentAllocator`: Transformers' own full-attention allocator (block tables, read/write indices, prefix sharing,
  forks, offloading: all unchanged) over rows of ``kv_lora_rank + rope`` values, one row per token and layer. The
  cache is sized by Transformers' own memory handler, shown a `LatentSizing` view of the config in which a token is
  one "key-value head" of ``(rank + rope) / 2`` values, so that it counts exactly the latent's bytes (DeepSeek-V3:
  576 values per token and layer instead of 2 x 128 x 64, 28x more tokens in the same memory).
* `PagedStep`: the host-side lengths of one step, built when Transformers prepares the batch (so planning never
  waits for the GPU), and what the step's layers share: the page table, and each kernel's metadata (built by the
  first layer that needs it, run by every layer).
* `attend`: one layer's attention over the pages. Decode tokens (one query token per request) run absorbed straight
  over the latent rows: FlashInfer's fa3/fa2 with the read indices as the page table (pages of one row),
  trtllm-gen/cute-dsl on Blackwell with block tables of 64 (or 32) rows gathered from them (the latent rows are
  packed, and Transformers' pages of a multiple of 32 rows hold whole pages), or the reference backend. Prefill
  chunks, which continuous batching mixes with decodes in one batch, are expanded through the model's own
  ``expand_kv`` and attended causally: on FlashInfer's ragged prefill, one launch per group of requests, where the
  decode runs on fa3 (``kernels/ragged.py``), else with Transformers' SDPA one request at a time.

CUDA graphs are switched off for these models (`disable_graphs`): a replayed graph runs no Python, and the kernels
here are planned on the host from each step's lengths.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass, field

import torch
from transformers.generation.continuous_batching import cache as cb_cache
from transformers.generation.continuous_batching.cache_allocators import FULL_ATTENTION, FullAttentionCacheAllocator
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.utils import logging

from . import capabilities
from .absorption import absorb_query, absorbed_weights, project_output
from .errors import UnsupportedModelError
from .kernels import Layer, Refused, fa, ragged, reference, trtllm
from .models import ATTN_NAME, DENSE_MLA_MODEL_TYPES, SPARSE_MLA_MODEL_TYPES, checkpoint_model_type, original_expand_kv
from .plan import Route, first_accepting
from .rows import Rows, to_device

logger = logging.get_logger("hf_flashinfer_mla")

_ALLOCATOR_ATTR = "_flashinfer_mla_paged"  # on the paged cache's root tensor: the `LatentAllocator` that owns it


# --------------------------------------------------------------------------------------------------------------
# The cache
# --------------------------------------------------------------------------------------------------------------
def uses_latent(config) -> bool:
    """Whether Transformers' paged cache for `config` must hold the MLA latent (a dense MLA model on this package)."""
    return getattr(config, "_attn_implementation", None) == ATTN_NAME and getattr(config, "kv_lora_rank", None)


class LatentSizing:
    """`config` as Transformers' paged cache should size it: one "key-value head" of ``ceil((rank + rope) / 2)``
    values, so that its ``2 x heads x head_dim`` per token is the latent row (``rank + rope``, rounded up to even).
    Every other attribute is the config's own."""

    def __init__(self, config):
        self._config = config
        self.head_dim = -(-(config.kv_lora_rank + config.qk_rope_head_dim) // 2)
        self.num_key_value_heads = 1

    def __getattr__(self, name):
        return getattr(self._config, name)


class LatentAllocator(FullAttentionCacheAllocator):
    """Transformers' full-attention allocator with one row of ``kv_lora_rank + rope`` values per token and layer
    (its pages hold ``page_size`` latent rows instead of ``page_size`` keys and ``page_size`` values). Only the row
    layout and the update differ; indices, blocks and sharing are the parent's."""

    rows_per_token = 1
    # The decode fast path hands per-head K/V pages to flash_attn_with_kvcache; the latent has none.
    supports_block_table = False

    def __init__(self, index, config, num_key_value_heads, cache_dtype, page_size, layer_indices,
                 allow_block_sharing):
        super().__init__(index=index, config=config, num_key_value_heads=num_key_value_heads, cache_dtype=cache_dtype,
                         page_size=page_size, layer_indices=layer_indices, allow_block_sharing=allow_block_sharing)
        self.rank, self.rope = config.kv_lora_rank, config.qk_rope_head_dim
        self.row_width = 2 * self.head_dim  # the sizing view's head_dim: rank + rope, rounded up to even
        self.step: PagedStep | None = None  # the step being prepared or run (`prepare_step`)
        self.prefill_wrappers = ragged.Wrappers()  # FlashInfer's ragged prefill, planned per step

    def register_cache_tensor(self, bytes_per_sector, non_trash_bytes, cache_tensor, pool) -> None:
        """Rows ``[total_rows, rank + rope]``; layer ``i``'s page of block ``b`` is rows ``b * tokens_per_block +
        i * page_size + [0, page_size)``, so each layer gets a view shifted by ``i * page_size`` rows, in which
        Transformers' indices (``block * tokens_per_block + offset``) address it directly."""
        self.bytes_per_sector = bytes_per_sector
        self._copy_view = cache_tensor.view(-1, self.bytes_per_block)
        total_rows = ((non_trash_bytes + 2 * bytes_per_sector) // self.bytes_per_page) * self.tokens_per_page
        typed = cache_tensor.view(self.cache_dtype)  # (a dtype view starts a new base: the root of every view below)
        rows = typed[: total_rows * self.row_width].view(total_rows, self.row_width)
        self._after_cache_tensor_init(non_trash_bytes, bytes_per_sector, rows, pool)
        self._layer_rows = {layer: rows[i * self.tokens_per_page:] for i, layer in enumerate(self.layer_indices)}
        # The views handed to the attention all have `typed` as their base: `allocator_of` finds the allocator there,
        # through a weak reference (a strong one would be a cycle through the tensor's __dict__, which Python's
        # collector does not break: every generate_batch() would keep its whole cache alive).
        self._typed = typed
        setattr(typed, _ALLOCATOR_ATTR, weakref.ref(self))

    def update(self, key_states, value_states, layer_idx, read_index, write_index):
        """Write the new latent rows (``[T, 1, rank]``, ``[T, 1, rope]``) and hand back the layer's whole row views:
        the attention reads them in place through the step's page table (no gather here)."""
        rows = self._layer_rows[layer_idx]
        lat, rot = rows[:, None, : self.rank], rows[:, None, self.rank : self.rank + self.rope]
        lat.index_copy_(0, write_index, key_states)
        rot.index_copy_(0, write_index, value_states)
        return lat, rot

    def get_cache_for_block_table(self, layer_idx):
        raise NotImplementedError("the paged latent cache has no per-head K/V pages for flash_attn_with_kvcache")


# Transformers 5.25+ builds MLA layers' pages with its own allocator, named in its cache module (None before).
TRANSFORMERS_MLA_ALLOCATOR = getattr(cb_cache, "MLACacheAllocator", None)


def latent_or(base: type) -> type:
    """The allocator class Transformers' paged cache should build where it would build `base` (``registration.py``
    puts it in place of `base`, once: in the module-level table for the full-attention allocator, and in place of
    5.25's `MLACacheAllocator`): a `LatentAllocator` for a cache sized by `LatentSizing` (a dense MLA model on this
    package), `base` itself for any other. One class, never swapped in and out, so caches built at the same time in
    two threads each get theirs; its class attributes are `base`'s, as Transformers reads them."""

    def __new__(cls, **kwargs):
        latent = isinstance(kwargs.get("config"), LatentSizing)
        return (LatentAllocator if latent else base)(**kwargs)

    return type(f"LatentOr{base.__name__}", (base,), {"__new__": __new__, "__doc__": latent_or.__doc__})


FullOrLatentAllocator = latent_or(FullAttentionCacheAllocator)
MLAOrLatentAllocator = None if TRANSFORMERS_MLA_ALLOCATOR is None else latent_or(TRANSFORMERS_MLA_ALLOCATOR)


def allocator_of(latent: torch.Tensor) -> LatentAllocator | None:
    """The `LatentAllocator` whose rows `latent` views (continuous batching), None for any other cache's tensor."""
    ref = None if latent._base is None else getattr(latent._base, _ALLOCATOR_ATTR, None)
    return None if ref is None else ref()


def build_paged_cache(original, cache, config, *args, **kwargs) -> None:
    """``PagedAttentionCache.__init__`` for a dense MLA model on this package: Transformers' own construction and
    memory sizing, shown the `LatentSizing` view, for which its full-attention allocator is a `LatentAllocator`."""
    sizing = LatentSizing(config)
    original(cache, sizing, *args, **kwargs)
    per_head = 2 * cb_cache.find_num_key_value_heads(config) * cb_cache.find_head_dim(config)
    logger.info(
        f"flashinfer_mla: paged latent cache of {cache.num_blocks} blocks of {cache.cache_allocators[FULL_ATTENTION]}"
        f".tokens_per_page tokens: {2 * sizing.head_dim} values per token and layer, where Transformers' per-head "
        f"K/V would take {per_head} ({per_head / (2 * sizing.head_dim):.1f}x more tokens in the same memory)."
    )


def refuse_unservable(model) -> None:
    """Raise, naming why and what to use, for a model continuous batching cannot serve with MLA attention (called
    when the manager is created, in the caller's thread: never empty outputs from the background loop)."""
    config = model.config.get_text_config(decoder=True)
    model_type, impl = getattr(config, "model_type", None), config._attn_implementation
    name = checkpoint_model_type(model_type)  # (as the user's config.json names it)
    if model_type in SPARSE_MLA_MODEL_TYPES:
        raise UnsupportedModelError(
            f"continuous batching (generate_batch, init_continuous_batching, transformers serve) cannot serve "
            f'model_type "{name}": its DeepSeek Sparse Attention reads an indexer-selected subset of the cache, which '
            "Transformers' paged cache does not keep. Use generate()."
        )
    if model_type not in DENSE_MLA_MODEL_TYPES:
        return  # not an MLA model: Transformers' own business
    if impl != ATTN_NAME and TRANSFORMERS_MLA_ALLOCATOR is None:
        raise UnsupportedModelError(
            f'continuous batching cannot serve model_type "{name}" with attn_implementation={impl!r}: its layers '
            "cache the MLA latent, which Transformers' paged cache (sized for per-head keys and values) cannot "
            f'hold. Load it with attn_implementation="{ATTN_NAME}" (import hf_flashinfer_mla), or use generate().'
        )
    if impl != ATTN_NAME:
        return  # Transformers 5.25+ pages the latent itself and expands it for eager/sdpa/flash
    unknown = sorted(set(getattr(config, "layer_types", None) or ()) - {FULL_ATTENTION})
    if unknown:
        raise UnsupportedModelError(
            f'continuous batching cannot serve model_type "{name}": its layers of type {", ".join(unknown)} '
            "have no paged cache for the MLA latent (Transformers' continuous batching keeps full- and sliding-window "
            "attention caches only, and this package gives latent rows to the full-attention ones). Use generate(), "
            "which runs every layer type."
        )
    if getattr(model, "_device_mesh", None) is not None:
        raise UnsupportedModelError(
            f"continuous batching with {ATTN_NAME} under tensor parallelism is not supported: every rank would need "
            "the whole latent, which Transformers' paged cache shards by key-value heads. Use generate()."
        )


def refuse_kept_cache(model, manager) -> None:
    """Raise where a manager kept with ``persistent_manager=True`` holds a paged cache built for another attention
    than the model's now: this package's latent rows read by eager/sdpa (Transformers' own attention would take the
    layer's whole rows for the request's), or, from Transformers 5.25, Transformers' own MLA rows read by this
    package's paged attention. Its next run would otherwise return wrong tokens or fail every request."""
    cache = getattr(getattr(manager, "batch_processor", None), "cache", None)
    if cache is None:
        return
    kept_latent = any(isinstance(a, LatentAllocator) for a in cache.cache_allocators.values())
    if kept_latent == bool(uses_latent(model.config.get_text_config())):
        return
    built_for = ATTN_NAME if kept_latent else "another attention implementation"
    raise UnsupportedModelError(
        f"this model's kept continuous-batching manager (persistent_manager=True) holds a paged cache built for "
        f"{built_for}, and the model now runs attn_implementation={model.config._attn_implementation!r}. Switch "
        f'back (attn_implementation="{ATTN_NAME}" for the latent cache), or call model.destroy_cached_continuous_'
        "batching_manager() (or generate_batch without persistent_manager) so that a new manager builds a cache "
        "for the attention of the moment."
    )


def disable_graphs(cb_config) -> None:
    """Continuous batching without CUDA graphs and without asynchronous batching, saying why once: a replayed graph
    runs no Python, and the paged kernels are planned on the host from each step's lengths. Transformers turns
    asynchronous batching on with the graphs (its default: on where graphs are); it would have the host plan a step
    while the GPU may still be copying the previous step's schedule from FlashInfer's pinned host buffer, which each
    ragged-prefill plan rewrites (`kernels/ragged.py`)."""
    if any(cb_config.cuda_graph_booleans) or cb_config.use_async_batching:
        logger.warning_once(
            f"flashinfer_mla: continuous batching runs without CUDA graphs and without asynchronous batching for "
            f"{ATTN_NAME} models: a replayed graph runs no Python, and FlashInfer's paged MLA kernels are planned on "
            "the host from each step's lengths, after the previous step's."
        )
        cb_config.use_cuda_graph = (False, False)
        cb_config.use_async_batching = False


# --------------------------------------------------------------------------------------------------------------
# The step
# --------------------------------------------------------------------------------------------------------------
@dataclass(eq=False)
class PagedStep:
    """One continuous-batching forward, on the host: request ``r`` has ``q_lens[r]`` query tokens (packed in order)
    and sees ``k_lens[r]`` cached rows (its past and its new tokens), listed in order in the step's read indices.
    Its layers share the page table and each kernel's metadata (`routes`)."""

    q_lens: torch.Tensor  # [B] int64, host
    k_lens: torch.Tensor  # [B] int64, host
    tokens: int  # query tokens of the forward, padding included
    routes: dict = field(default_factory=dict)
    _tables: dict = field(default_factory=dict)
    started: bool = False  # a forward has run on it
    page_rows: int = 0  # rows per page of a cache storing the latent packed (trtllm-gen reads those); 0: not packed

    def __post_init__(self):
        self.cu_q = torch.zeros(self.batch + 1, dtype=torch.long)
        self.cu_q[1:] = self.q_lens.cumsum(0)
        self.kv_offsets = torch.zeros(self.batch + 1, dtype=torch.long)
        self.kv_offsets[1:] = self.k_lens.cumsum(0)
        self.decode = (self.q_lens == 1).nonzero().flatten()  # requests that run absorbed
        # the others with query tokens: prefill chunks (a request may have none: Transformers prefills a prompt to be
        # forked, sampled several times, without its last token, which for a 1-token prompt leaves nothing)
        self.chunks = (self.q_lens > 1).nonzero().flatten().tolist()

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

    def page_table(self, source: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """The step's read indices in `dtype` (int32 for FlashInfer), converted once per step."""
        key = (source.data_ptr(), dtype)
        if key not in self._tables:
            self._tables[key] = source[: int(self.kv_offsets[-1])].to(dtype)
        return self._tables[key]


def prepare_step(cache, requests, tokens: int) -> None:
    """Hand the batch Transformers just prepared to the cache's latent allocator (``registration.py`` calls this
    after ``ContinuousBatchingIOs.prepare_batch_tensors``)."""
    for allocator in cache.cache_allocators.values():
        if isinstance(allocator, LatentAllocator):
            allocator.step = PagedStep.of_batch(requests, tokens)


# --------------------------------------------------------------------------------------------------------------
# The attention
# --------------------------------------------------------------------------------------------------------------
def attend(allocator: LatentAllocator, module, query, kv_latent, k_rot, scaling, mla_backend=None, **kwargs):
    """One layer's attention over the paged latent: ``query [1, H, T, qk_head_dim]`` (every request's tokens packed)
    -> ``(attn_output [1, T, H, v_head_dim], None)``; padding tokens get zeros."""
    cu_q = kwargs["cu_seq_lens_q"]
    step = allocator.step
    # A prepared step serves exactly one forward: the one whose first layer finds it unstarted.
    first = module.layer_idx == allocator.layer_indices[0]
    if step is None or (first and step.started) or not step.matches(query.shape[2], cu_q):
        step = allocator.step = PagedStep.from_kwargs(cu_q, kwargs["cu_seq_lens_k"], query.shape[2])
    if not step.started and allocator.row_width == allocator.rank + allocator.rope:
        step.page_rows = allocator.tokens_per_page
    step.started = True
    read_index = kwargs["read_index"][allocator.index]
    # A step with no cached past reads nothing back: its rows are the ones it writes, in the same order.
    source = read_index if read_index.numel() else kwargs["write_index"][allocator.index]
    scale = scaling if scaling is not None else module.qk_head_dim**-0.5
    requested = capabilities.requested_backend(mla_backend, module.config)
    h, t = query.shape[1], query.shape[2]
    out = query.new_zeros(1, t, h, module.v_head_dim)
    weights = absorbed_weights(module, query.dtype) if len(step.decode) else None
    decode = step.decode if weights is not None else step.decode[:0]
    if len(decode):
        tokens = step.cu_q[decode]
        all_decode = len(decode) == step.batch == t
        q = query if all_decode else query[:, :, to_device(tokens, query.device)]
        q_lat, q_pe = absorb_query(q, module.qk_nope_head_dim, weights)
        key = (q_lat.device, q_lat.dtype, h, kv_latent.shape[-1], k_rot.shape[-1], scale, requested)
        route = step.routes.get(key)
        if route is None:
            route = step.routes[key] = _route(step, key, source)
        o = project_output(route.run(q_lat, q_pe, kv_latent, k_rot), weights, 1)  # [1, N, H, dv]
        if all_decode:
            return o, None
        out.index_copy_(1, to_device(tokens, out.device), o)
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
    key = ("prefill", query.device, query.dtype, query.shape[1], query.shape[-1], module.v_head_dim, scale, requested,
           len(pending))
    if key not in step.routes:
        step.routes[key] = _prefill_groups(allocator, step, pending, module, query, scale, requested)
    for group in step.routes[key]:
        rows = source[group.kv_index]
        keys, values = expand(lat_rows.index_select(0, rows)[None, None], rot_rows.index_select(0, rows)[None, None])
        q = query[0].index_select(1, group.q_index).transpose(0, 1)  # [N, H, qk]
        o = ragged.run(group.wrapper, q, keys[0].transpose(0, 1), values[0].transpose(0, 1))
        out[0].index_copy_(0, group.q_index, o)
    if step.routes[key]:
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


@dataclass(eq=False)
class PagedRoute:
    """How one layer shape's decode tokens run this step: the `plan.Route` its chain chose (for the reference
    backend, its metadata is each decode request's rows, gathered here, and their mask)."""

    route: Route

    @property
    def backend(self) -> str:
        return self.route.backend

    def run(self, q_lat, q_pe, kv_latent, k_rot) -> torch.Tensor:
        route = self.route
        if route.backend == "reference":
            index, mask = route.meta
            n, width = index.shape
            lat = kv_latent[0, 0].index_select(0, index.flatten()).view(n, 1, width, -1)
            rot = k_rot[0, 0].index_select(0, index.flatten()).view(n, 1, width, -1)
            return reference.attend(mask, route.layer.scale, q_lat, q_pe, lat, rot)
        return route.run(q_lat, q_pe, kv_latent, k_rot)


def _route(step: PagedStep, key: tuple, source: torch.Tensor) -> PagedRoute:
    """The step's decode route for one layer shape: the backend asked for (or chosen), else the next of its chain
    that accepts the step (`plan.first_accepting`, which reports each kind of refusal once). On Blackwell the chain
    tries fa2 after trtllm-gen or cute-dsl (which need pages of 32 or 64 rows), before the reference."""
    device, dtype, heads, rank, rope, scale, requested = key
    layer = Layer(device, dtype, dtype, heads, rank, rope, 0, step.page_rows > 0, scale)
    backend = capabilities.choose_backend(device, dtype, rank, rope, heads, requested)
    chain = list(capabilities.fallbacks(backend, device, dtype, rank, rope, heads, False))
    if backend in ("trtllm-gen", "cute-dsl") and not capabilities.unavailable_reason("fa2", device, dtype, rank,
                                                                                    rope, heads):
        chain.insert(1, "fa2")
    return PagedRoute(first_accepting(chain, layer, lambda candidate, spec: _build(candidate, step, spec, source), 1))


def _build(backend: str, step: PagedStep, layer: Layer, source: torch.Tensor):
    """The decode tokens' metadata for `backend`: pages of one row addressed through the step's read indices (fa3,
    fa2), pages of 32 or 64 rows (trtllm-gen, cute-dsl), or the rows gathered (reference)."""
    decode = step.decode
    lens, offsets = step.k_lens[decode], step.kv_offsets[decode]
    if backend == "reference":  # each decode request's rows gathered into a padded batch, and its mask
        width = int(lens.max())
        positions = torch.arange(width)
        mask = positions < lens[:, None]
        index = torch.where(mask, offsets[:, None] + positions, offsets[:, None])
        table = step.page_table(source, torch.long)
        return table[to_device(index, layer.device)], to_device(mask[:, None, None], layer.device)
    if backend in ("trtllm-gen", "cute-dsl"):
        return trtllm.paged(backend, layer, lens, offsets, step.page_table(source, torch.long), step.page_rows)
    table = step.page_table(source, torch.int32)
    rows = Rows(lens.to(torch.int32), 1, torch.zeros_like(lens))
    if fa.uses_generated_module():
        engine = fa.generated_fa(layer, backend)
        kv_indptr = torch.cat([offsets, step.kv_offsets[-1:]]).to(torch.int32)  # need not be compact
        workspace = engine.new_workspace()
        plan_info = engine.plan(rows, kv_indptr, False, workspace)
        return fa.FaMetadata(backend, False, engine, workspace, plan_info, table)
    from flashinfer.mla import BatchMLAPagedAttentionWrapper

    from .buffers import workspace_buffer

    compact = table
    if len(decode) != step.batch:  # FlashInfer's wrapper takes compact offsets: the decode requests' rows only
        index = torch.cat([torch.arange(int(o), int(o + n)) for o, n in zip(offsets, lens)])
        compact = table[to_device(index, layer.device)]
    wrapper = BatchMLAPagedAttentionWrapper(workspace_buffer(layer.device), backend=backend)
    fa.wrapper_plan(wrapper, rows, compact, False, layer)
    return fa.FaMetadata(backend, False, None, wrapper=wrapper)
