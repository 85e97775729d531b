"""Continuous batching's paged latent cache, inside Transformers' `PagedAttentionCache`.

Transformers' continuous batching (``generate_batch``, ``init_continuous_batching``, ``transformers serve``) keeps
every request's cache in one paged tensor. Up to 5.24 its full-attention allocator sizes a token as ``(2,
num_key_value_heads, head_dim)``, per-head keys and values, while an MLA layer writes one latent row per token
(``kv_lora_rank + rope`` values, 576 for DeepSeek): the first cache write fails and every request ends FAILED. 5.25
adds an MLA allocator with the same rows (`MLACacheAllocator`), which gathers each step's rows and hands them to the
model's own expansion. Here, on either version, `LatentAllocator` is Transformers' own full-attention allocator
(block tables, read/write indices, prefix sharing, forks, offloading: all unchanged) over rows of ``kv_lora_rank +
rope`` values, one row per token and layer. The cache is sized by Transformers' own memory handler, shown a
`LatentSizing` view of the config in which a token is one "key-value head" of ``(rank + rope) / 2`` values, so
that it counts exactly the latent's bytes (DeepSeek-V3: 576 values per token and layer instead of 2 x 128 x 64,
28x more tokens in the same memory).

A sparse (DSA) model's row also holds the layer's indexer key (``index_head_dim`` values, DeepSeek-V3.2: 512 + 64 +
128), so the indexer's keys are paged beside the latent by the same block tables: prefix sharing, forks and
offloading carry them along, and a shared prompt block holds the keys of its own tokens, which depend on its prefix
only. Its ``indexed_attention`` layers are full-attention layers to the paged cache (`LatentSizing.layer_types`);
``paged_indexer.py`` selects each request's rows over them.

The attention over these rows is ``paged_attention.py``; this module also holds what continuous batching refuses
(`refuse_unservable`, `refuse_kept_cache`) and whether it runs CUDA graphs (`resolve_graphs`).
"""

from __future__ import annotations

import functools
import itertools
import weakref
from dataclasses import dataclass

import torch
from transformers.generation.continuous_batching import cache as cb_cache
from transformers.generation.continuous_batching.cache_allocators import (
    FULL_ATTENTION,
    SLIDING_ATTENTION,
    FullAttentionCacheAllocator,
    SlidingAttentionCacheAllocator,
)
from transformers.integrations.heterogeneity.configuration_utils import AmbiguousGlobalPerLayerAttributeError
from transformers.utils import logging

from .errors import UnsupportedModelError
from .kernels import ragged
from .models import (
    ATTN_NAME,
    DENSE_MLA_MODEL_TYPES,
    SPARSE_MLA_MODEL_TYPES,
    checkpoint_model_type,
    global_value,
    layer_config,
)

INDEXED_ATTENTION = "indexed_attention"  # the layer type of a sparse (DSA) model's attention layers

# Where a continuous-batching step finds its requests' rows: expanded on the device from the allocator's block tables
# (`BlockRows`), a few host values per request; False keeps Transformers' read indices, which it lists token by
# token in Python every step (``get_read_indices``), for the A/B of ``scripts/bench_step_prep.py`` and
# ``scripts/bench_serving.py --modes ...-token-indices``.
ROWS_FROM_BLOCK_TABLES = True

logger = logging.get_logger("hf_flashinfer_mla")

_ALLOCATOR_ATTR = "_flashinfer_mla_paged"  # on the paged cache's root tensor: the `LatentAllocator` that owns it
_WEIGHTS_ATTR = "_flashinfer_mla_weights"  # on a latent manager: `weights_seen` when it was last handed out


def uses_latent(config) -> bool:
    """Whether Transformers' paged cache for `config` must hold the MLA latent (an MLA model on this package)."""
    return getattr(config, "_attn_implementation", None) == ATTN_NAME and global_value(config, "kv_lora_rank")


def index_width(config) -> int:
    """Values of the indexer key a sparse (DSA) model's paged row holds after the latent (0: a dense model)."""
    types = getattr(config, "layer_types", None) or ()
    return int(getattr(config, "index_head_dim", 0) or 0) if INDEXED_ATTENTION in types else 0


class LatentSizing:
    """`config` as Transformers' paged cache should size it: one "key-value head" of ``ceil((rank + rope + index) /
    2)`` values, so that its ``2 x heads x head_dim`` per token is the latent row (``rank + rope``, and a sparse
    model's indexer key, rounded up to even), and its indexed (DSA) layers typed as full attention.

    `layers`: one allocator's layers, whose rows these are (a DSA model's sliding-window layers, dots3's, have a
    latent width of their own and no indexer). Without, the model's, as Transformers' memory sizing reads it: the
    widest layer's. Every other attribute is the config's own; one its layers do not share reads as their largest
    (an upper bound is what sizing needs, and Transformers refuses to give one value for all)."""

    def __init__(self, config, layers=None):
        self._config = config
        types = getattr(config, "layer_types", None)
        layers = range(config.num_hidden_layers) if layers is None else layers
        rank, rope = max(((c.kv_lora_rank, c.qk_rope_head_dim) for c in (layer_config(config, i) for i in layers)),
                         key=sum)
        sliding = types is not None and all(types[i] == SLIDING_ATTENTION for i in layers)
        self.kv_lora_rank, self.qk_rope_head_dim = rank, rope
        self.index_dim = 0 if sliding else index_width(config)
        self.head_dim = -(-(rank + rope + self.index_dim) // 2)
        self.num_key_value_heads = 1
        if types is not None:
            self.layer_types = [FULL_ATTENTION if t == INDEXED_ATTENTION else t for t in types]

    def __getattr__(self, name):
        try:
            return getattr(self._config, name)
        except AmbiguousGlobalPerLayerAttributeError:
            return max(getattr(layer_config(self._config, i), name) for i in range(self._config.num_hidden_layers))


class LatentAllocator(FullAttentionCacheAllocator):
    """Transformers' full-attention allocator with one row of ``kv_lora_rank + rope`` values per token and layer
    (its pages hold ``page_size`` latent rows instead of ``page_size`` keys and ``page_size`` values). Only the row
    layout and the update differ; indices, blocks and sharing are the parent's."""

    rows_per_token = 1
    # The decode fast path hands per-head K/V pages to flash_attn_with_kvcache; the latent has none.
    supports_block_table = False

    def __init__(self, index, config, num_key_value_heads, cache_dtype, page_size, layer_indices,
                 allow_block_sharing):
        config = LatentSizing(config._config, layer_indices)  # (this allocator's layers' rows)
        super().__init__(index=index, config=config, num_key_value_heads=num_key_value_heads, cache_dtype=cache_dtype,
                         page_size=page_size, layer_indices=layer_indices, allow_block_sharing=allow_block_sharing)
        self.rank, self.rope = config.kv_lora_rank, config.qk_rope_head_dim
        self.index_dim = config.index_dim  # a sparse model's indexer key, after the latent
        self.row_width = 2 * self.head_dim  # the sizing view's head_dim: rank + rope (+ index), rounded up to even
        self.step = None  # the step being prepared or run (``paged_attention.PagedStep``)
        self.steps_prepared = 0
        # The forward's read and write indices, as its layers' cache updates receive them (the indexer, which reads
        # and writes its keys in the same rows, is handed no keyword arguments)
        self.read_index: torch.Tensor | None = None
        self.write_index: torch.Tensor | None = None
        # Each step's rows in the layers' view, in the order Transformers' read indices would list them: written on the
        # device before the step's forward (`BlockRows.write`), at one address for the cache's life (a CUDA graph
        # reads it); sized as Transformers' read indices (`attach_rows_buffer`)
        self.rows: torch.Tensor | None = None
        # A sparse (DSA) model's graphed decode step: each query token's first row in `rows` and its rows, written
        # before the replay, read by the indexer inside the graph (``paged_indexer``); fixed like `rows`
        self.token_rows: torch.Tensor | None = None
        self.graphed_layers = weakref.WeakSet()  # attention modules captured in CUDA graphs over this cache
        self.graphs_refused: str | None = None  # why its steps no longer run in graphs (``paged_attention``)
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

    def get_read_indices(self, request_id: str, past_length: int, query_length: int) -> list[int]:
        # Transformers lists every visible row of every request in Python on every step, which grows with the total
        # context; the step expands them on the device from the block tables instead (`block_rows`).
        if ROWS_FROM_BLOCK_TABLES:
            return []
        return super().get_read_indices(request_id, past_length, query_length)

    def attach_rows_buffer(self, size: int, tokens: int) -> None:
        """The device buffers of each step's rows: `size` rows, as Transformers sizes its read indices (the scheduler
        keeps a step's reads within them), and for a sparse model where each of a step's `tokens` query tokens
        finds its rows."""
        device = self.cache_tensor.device
        self.rows = torch.empty(size, dtype=torch.long, device=device)
        if self.index_dim:
            self.token_rows = torch.zeros(2, tokens, dtype=torch.long, device=device)

    def block_rows(self, request_ids: list[str], k_lens: torch.Tensor) -> BlockRows | None:
        """Where the requests' first `k_lens` rows lie: their blocks, on the host (None: Transformers lists them)."""
        if not ROWS_FROM_BLOCK_TABLES or self.rows is None:
            return None
        per_page = self.tokens_per_page
        counts = (k_lens + per_page - 1) // per_page
        tables = self.block_table
        blocks = list(itertools.chain.from_iterable(
            tables[rid][:n] for rid, n in zip(request_ids, counts.tolist())))
        return BlockRows(torch.tensor(blocks, dtype=torch.long), counts, k_lens, per_page,
                         self.block_physical_stride, self.read_trash_index)

    def update(self, key_states, value_states, layer_idx, read_index, write_index):
        """Write the new latent rows (``[T, 1, rank]``, ``[T, 1, rope]``) and hand back the layer's whole row views:
        the attention reads them in place through the step's page table (no gather here)."""
        rows = self._layer_rows[layer_idx]
        # (a layer without rotary dims writes none: Mistral Large 4's no-rope layers)
        rope = value_states.shape[-1]
        lat, rot = rows[:, None, : self.rank], rows[:, None, self.rank : self.rank + rope]
        lat.index_copy_(0, write_index, key_states)
        rot.index_copy_(0, write_index, value_states)
        self.read_index, self.write_index = read_index, write_index
        return lat, rot

    def source(self, read_index: torch.Tensor, write_index: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        """Where the step's visible rows lie in the view `update` handed the layer (`rows`, ``[..., rows, width]``):
        the rows the step expanded from the block tables (`PagedStep.launch`; as many as Transformers' padded read
        indices, whose padded tail a CUDA graph's padding tokens read); else Transformers' read indices, in order, and
        where a step has no cached past and reads nothing back, the rows it writes, in the same order."""
        step = self.step
        if step is not None and step.tables is not None:
            return self.rows[: max(read_index.numel(), step.pages.end)]
        return read_index if read_index.numel() else write_index

    def index_keys(self, layer_idx: int) -> torch.Tensor:
        """Layer `layer_idx`'s indexer keys ``[rows, index_dim]``, addressed as its latent rows are."""
        start = self.rank + self.rope
        return self._layer_rows[layer_idx][:, start : start + self.index_dim]

    def get_cache_for_block_table(self, layer_idx):
        raise NotImplementedError("the paged latent cache has no per-head K/V pages for flash_attn_with_kvcache")


@dataclass(eq=False)
class BlockRows:
    """A step's requests' rows as their blocks (host): request ``r``'s row ``j`` lies at ``blocks[b] *
    block_stride + j % page`` of the layers' view, ``b`` its ``j // page``-th block. `write` lays them out on the
    device in the order Transformers' read indices would (`FullAttentionCacheAllocator.get_read_indices`), from a
    few host values per request: the host never lists a row."""

    blocks: torch.Tensor  # [sum(counts)] int64: each request's first counts[r] blocks, in order
    counts: torch.Tensor  # [R] int64
    k_lens: torch.Tensor  # [R] int64: rows of each request
    page: int  # rows per page
    block_stride: int  # rows between two blocks in a layer's view
    trash: int  # the row Transformers' padded read indices point to

    def write(self, out: torch.Tensor, end: int, to_device) -> None:
        """Each request's rows into ``out[:sum(k_lens)]``, the rest of ``out[:end]`` pointing at the trash row (a
        CUDA graph's padding tokens read there). `to_device`: the host-to-device copy."""
        total = int(self.k_lens.sum())
        starts = torch.zeros_like(self.counts)
        starts[1:] = self.counts.cumsum(0)[:-1]
        offsets = torch.zeros_like(self.k_lens)
        offsets[1:] = self.k_lens.cumsum(0)[:-1]
        host = torch.cat([self.blocks, starts * self.page - offsets, self.k_lens])
        device = to_device(host, out.device)
        n = self.blocks.numel()
        blocks, shift, lens = device[:n], device[n : n + self.k_lens.numel()], device[n + self.k_lens.numel():]
        # row p of request r is its row j = p - offsets[r], at position f = starts[r] * page + j of its blocks' rows
        flat = torch.arange(total, device=out.device) + torch.repeat_interleave(shift, lens, output_size=total)
        torch.add(blocks[flat // self.page] * self.block_stride, flat % self.page, out=out[:total])
        if end > total:
            out[total:end].fill_(self.trash)


class SlidingLatentAllocator(LatentAllocator, SlidingAttentionCacheAllocator):
    """Transformers' sliding-window allocator (a ring of pages holding each request's last ``sliding_window``
    tokens) with latent rows: a DSA model's sliding-window MLA layers (dots3's), which have a latent width of their
    own (`LatentSizing`) and no indexer. Its ring indices and block counts are the parent's; no prefix sharing (the
    parent's rule: a ring overwrites its oldest rows)."""

    # (its ring's read indices: a window's few rows per request, which `update` gathers)
    get_read_indices = SlidingAttentionCacheAllocator.get_read_indices

    def block_rows(self, request_ids, k_lens) -> None:
        return None

    def update(self, key_states, value_states, layer_idx, read_index, write_index):
        """The rows each request sees, gathered into a new tensor ``[K, width]`` in the order of the read indices
        (its last ``sliding_window - 1`` cached tokens, then its new ones, where the read indices hold Transformers'
        sentinel), before the new rows are written: a chunk's new rows take the ring slots of rows that its earlier
        tokens still see. The views handed back index that tensor (`source`), which carries this allocator as the
        paged rows' root tensor does (`allocator_of`)."""
        rows = self._layer_rows[layer_idx]
        rope = value_states.shape[-1]
        new = rows.new_zeros(key_states.shape[0], self.row_width)
        new[:, : self.rank], new[:, self.rank : self.rank + rope] = key_states[:, 0], value_states[:, 0]
        if read_index.numel():
            window = rows.index_select(0, read_index)
            # (the sentinels stand for the requests' new tokens in order; padding tokens come last and have none)
            window.masked_scatter_((read_index == self.sentinel_index)[:, None], new)
        else:
            window = new
        rows.index_copy_(0, write_index, new)
        setattr(window, _ALLOCATOR_ATTR, weakref.ref(self))
        return window[:, None, : self.rank], window[:, None, self.rank : self.rank + rope]

    def source(self, read_index: torch.Tensor, write_index: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        """The gathered rows are the step's visible rows, in order."""
        return torch.arange(rows.shape[-2], device=rows.device)


# Transformers 5.25+ builds MLA layers' pages with its own allocator, named in its cache module (None before).
TRANSFORMERS_MLA_ALLOCATOR = getattr(cb_cache, "MLACacheAllocator", None)


@functools.cache  # (one class per base: the table's entry is the module's `FullOrLatentAllocator` itself)
def latent_or(base: type) -> type:
    """The allocator class Transformers' paged cache should build where it would build `base` (``registration.py``
    puts it in place of `base`, once: in the module-level table for the full-attention allocator, and in place of
    5.25's `MLACacheAllocator`): a `LatentAllocator` for a cache sized by `LatentSizing` (a dense MLA model on this
    package), `base` itself for any other. One class, never swapped in and out, so caches built at the same time in
    two threads each get theirs; its class attributes are `base`'s, as Transformers reads them."""

    latent_class = SlidingLatentAllocator if issubclass(base, SlidingAttentionCacheAllocator) else LatentAllocator

    def __new__(cls, **kwargs):
        latent = isinstance(kwargs.get("config"), LatentSizing)
        return (latent_class if latent else base)(**kwargs)

    return type(f"LatentOr{base.__name__}", (base,), {"__new__": __new__, "__doc__": latent_or.__doc__})


FullOrLatentAllocator = latent_or(FullAttentionCacheAllocator)
SlidingOrLatentAllocator = latent_or(SlidingAttentionCacheAllocator)
MLAOrLatentAllocator = None if TRANSFORMERS_MLA_ALLOCATOR is None else latent_or(TRANSFORMERS_MLA_ALLOCATOR)


def indexed_as_full(_absent) -> type:
    """The allocator Transformers' continuous-batching checks should see for a sparse model's indexed (DSA) layers:
    the full-attention one's. (The paged cache itself never builds one: `LatentSizing` types those layers as full
    attention, and only this package's attention runs sparse models under continuous batching.)"""
    return FullOrLatentAllocator


def allocator_of(latent: torch.Tensor) -> LatentAllocator | None:
    """The `LatentAllocator` whose rows `latent` views (continuous batching), None for any other cache's tensor."""
    ref = None if latent._base is None else getattr(latent._base, _ALLOCATOR_ATTR, None)
    return None if ref is None else ref()


def build_paged_cache(original, cache, config, *args, **kwargs) -> None:
    """``PagedAttentionCache.__init__`` for a dense MLA model on this package: Transformers' own construction and
    memory sizing, shown the `LatentSizing` view, for which its full-attention allocator is a `LatentAllocator`."""
    sizing = LatentSizing(config)
    original(cache, sizing, *args, **kwargs)
    for allocator in cache.cache_allocators.values():
        if isinstance(allocator, LatentAllocator):
            allocator.attach_rows_buffer(cache.max_tokens_read + cache.max_batch_tokens, cache.max_batch_tokens)
    first = layer_config(config, 0)
    per_head = 2 * cb_cache.find_num_key_value_heads(first) * cb_cache.find_head_dim(first)
    latent = next(a for a in cache.cache_allocators.values() if isinstance(a, LatentAllocator))
    logger.info(
        f"flashinfer_mla: paged latent cache of {cache.num_blocks} blocks of {latent.tokens_per_page} tokens: "
        f"{2 * sizing.head_dim} values per token and layer, where Transformers' per-head "
        f"K/V would take {per_head} ({per_head / (2 * sizing.head_dim):.1f}x more tokens in the same memory)."
    )


def refuse_unservable(model) -> None:
    """Raise, naming why and what to use, for a model continuous batching cannot serve with MLA attention (called
    when the manager is created, in the caller's thread: never empty outputs from the background loop)."""
    config = model.config.get_text_config(decoder=True)
    model_type, impl = getattr(config, "model_type", None), config._attn_implementation
    name = checkpoint_model_type(model_type)  # (as the user's config.json names it)
    sparse = model_type in SPARSE_MLA_MODEL_TYPES
    if sparse and impl != ATTN_NAME:
        raise UnsupportedModelError(
            f'continuous batching (generate_batch, init_continuous_batching, transformers serve) serves model_type '
            f'"{name}" with attn_implementation="{ATTN_NAME}" only: its DeepSeek Sparse Attention indexer keeps keys '
            f"of its own, which Transformers' paged cache does not hold for {impl!r}. Load it with "
            f'attn_implementation="{ATTN_NAME}" (import hf_flashinfer_mla), or use generate().'
        )
    if model_type not in DENSE_MLA_MODEL_TYPES and not sparse:
        return  # not an MLA model: Transformers' own business
    if impl != ATTN_NAME and TRANSFORMERS_MLA_ALLOCATOR is None:
        raise UnsupportedModelError(
            f'continuous batching cannot serve model_type "{name}" with attn_implementation={impl!r}: its layers '
            "cache the MLA latent, which Transformers' paged cache (sized for per-head keys and values) cannot "
            f'hold. Load it with attn_implementation="{ATTN_NAME}" (import hf_flashinfer_mla), or use generate().'
        )
    if impl != ATTN_NAME:
        return  # Transformers 5.25+ pages the latent itself and expands it for eager/sdpa/flash
    unknown = sorted(set(getattr(config, "layer_types", None) or ()) - {FULL_ATTENTION, INDEXED_ATTENTION,
                                                                        SLIDING_ATTENTION})
    if unknown:
        raise UnsupportedModelError(
            f'continuous batching cannot serve model_type "{name}": its layers of type {", ".join(unknown)} '
            "have no paged cache for the MLA latent (Transformers' continuous batching keeps full- and sliding-window "
            "attention caches only, and this package gives latent rows to those). Use generate(), which runs every "
            "layer type."
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
    package's paged attention; or latent rows of another dtype or device than the model's (moved or cast since).
    Its next run would otherwise return wrong tokens or fail every request."""
    cache = getattr(getattr(manager, "batch_processor", None), "cache", None)
    if cache is None:
        return
    kept_latent = any(isinstance(a, LatentAllocator) for a in cache.cache_allocators.values())
    if kept_latent and (cache.dtype != model.dtype or torch.device(cache.device) != model.device):
        raise UnsupportedModelError(  # (its rows would fail every request's first cache write)
            f"this model's kept continuous-batching manager (persistent_manager=True) holds a paged cache of "
            f"{cache.dtype} on {cache.device}, and the model now runs in {model.dtype} on {model.device}. Call "
            "model.destroy_cached_continuous_batching_manager() (or generate_batch without persistent_manager) so "
            "that a new manager builds a cache for the model as it is."
        )
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


def weights_seen(model) -> tuple:
    """What the rows of a cached prompt block depend on: every parameter and buffer (the tensor, its storage, its
    version, which in-place writes and ``load_state_dict`` move), each PEFT layer's switches and scaling, and its
    adapters' values (PEFT's hot-swap copies new factors in through ``.data``, which moves no version)."""
    tensors = [(id(t), t.data_ptr(), t._version) for t in (getattr(t, "_local_tensor", t) for t in
                                                           itertools.chain(model.parameters(), model.buffers()))]
    switches, sums = [], {}
    for module in model.modules():
        if "base_layer" in module._modules and hasattr(module, "merged_adapters"):
            switches.append((tuple(module.active_adapters), module.disable_adapters, tuple(module.merged_adapters),
                             repr(getattr(module, "scaling", None))))
            for name, p in module.named_parameters():
                if not name.startswith("base_layer."):
                    sums.setdefault(p.device, []).append(p.detach().float().square().sum() + p.detach().sum())
    return tensors, switches, [torch.stack(s).tolist() for s in sums.values()]  # (one copy per device)


def forget_stale_prefixes(model, manager) -> None:
    """Drop the prompt blocks a kept manager cached for reuse (prefix sharing) if the model's weights changed since
    they were written: a block's latent rows at layer ``i > 0`` come out of layers ``0..i-1``, so a reused block
    would give a request another model's past, and other tokens, silently."""
    seen, kept = weights_seen(model), getattr(manager, _WEIGHTS_ATTR, None)
    setattr(manager, _WEIGHTS_ATTR, seen)
    cache = getattr(getattr(manager, "batch_processor", None), "cache", None)
    if kept is None or kept == seen or cache is None:
        return
    if cache.evict_cached_blocks():
        logger.info("flashinfer_mla: the model's weights or adapters changed since its kept continuous-batching "
                    "manager cached prompt blocks; those blocks are dropped and their prompts prefilled again.")


def resolve_graphs(cb_config, why: str | None, async_asked: bool | None = None) -> None:
    """Continuous batching without CUDA graphs where `why` says why not (said once). Asynchronous batching (the host
    prepares and plans step N+1 while the GPU runs step N) stays as Transformers resolved it, which is on with the
    graphs; where the graphs go, it goes too unless the caller asked for it (`async_asked`), as Transformers' own
    rule has it. A step's plan needs only the lengths scheduled for it, and its device work is ordered on the
    compute stream after the previous step's forward (``paged_attention.PagedStep.launch``)."""
    if why is not None and any(cb_config.cuda_graph_booleans):
        logger.warning_once(f"flashinfer_mla: continuous batching runs without CUDA graphs for this {ATTN_NAME} "
                            f"model: {why}.")
        cb_config.use_cuda_graph = (False, False)
        if async_asked is None:
            cb_config.use_async_batching = False


# ------------------------------------------------------------------------------------------------------------------
# Seams (``registration.py``): the kept manager and the paged cache, where Transformers offers no hook
# ------------------------------------------------------------------------------------------------------------------
def cached_manager_checked(original):
    # A manager kept with persistent_manager=True is handed out again without being built, so its check never runs
    # again: a model switched to another attention since (eager, sdpa) would read the cached latent rows as per-head
    # keys and values and return wrong tokens. The check runs here too.
    # The manager also keeps its paged cache, built for the attention of its first run: from 5.25, where eager and
    # sdpa page the latent too, that is checked as well (refuse_kept_cache). Its cached prompt blocks hold the latent
    # rows of the weights of the moment: they are dropped once the weights change (forget_stale_prefixes).
    @functools.wraps(original)
    def init_continuous_batching(self, *args, **kwargs):
        manager = getattr(self, "_cached_continuous_batching_manager", None)
        if manager is not None:
            refuse_unservable(self)
            refuse_kept_cache(self, manager)
        manager = original(self, *args, **kwargs)
        if uses_latent(self.config.get_text_config()):
            forget_stale_prefixes(self, manager)
        return manager

    return init_continuous_batching


def latent_paged_cache(original):
    # PagedAttentionCache picks its allocator from a module-level table and sizes tokens from the config's head_dim
    # and key-value heads: per-head K/V rows, which the MLA latent does not fit. For flashinfer_mla models it is built
    # by Transformers' own code with a config view that sizes latent rows, for which the table's full-attention
    # allocator (`latent_or`, put there once) builds latent rows.
    @functools.wraps(original)
    def __init__(self, config, *args, **kwargs):
        if not uses_latent(config):
            return original(self, config, *args, **kwargs)
        return build_paged_cache(original, self, config, *args, **kwargs)

    return __init__
