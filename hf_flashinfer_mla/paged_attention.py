"""The attention over continuous batching's paged latent cache (``paged_cache.py``).

Under continuous batching the attention function receives every request's query tokens packed (``[1, H, T, d]``),
``cu_seq_lens_q/k``, the layer's rows of the paged cache and the step's read indices; no mask, no cache object.

* `PagedStep`: one forward's host-side lengths, built when Transformers prepares the batch (so planning never waits
  for the GPU), and the step's `plan.Routing`: its decode requests (one query token each) run through the same
  per-layer routine as generate()'s (``decode.decode_layer``: absorb -> the step's route -> project), their rows
  given to the kernel builders as a ``rows.PageTable`` over the step's rows. Those are laid out on the device
  from the cache's block tables before the forward (`PagedStep.launch`), in the order Transformers' read indices
  would list them, which the latent allocator leaves empty (listing them is Python work growing with the context). Each family reads it as it reads any
  cache: fa3/fa2 with pages of one row, trtllm-gen/cute-dsl with block tables of 64 (or 32) rows gathered from it
  where Transformers' pages of a multiple of 32 rows hold packed latent rows, the reference by gathering the rows.
* Prefill chunks, which continuous batching mixes with decodes in one batch, are expanded through the model's own
  ``expand_kv`` and attended causally: on FlashInfer's ragged prefill, one launch per group of requests, where the
  decode runs on fa3 (``kernels/ragged.py``), else with Transformers' SDPA one request at a time.
* A sparse (DSA) layer's `indices` are its selection in the step's read indices (``paged_indexer.py``): every query
  token, a prefill chunk's too, attends absorbed over those rows of the layer (fa3/fa2 take them as pages of one row,
  the reference gathers them; `PagedStep.absorbed`). Where a step cannot run so (more tokens than FlashInfer's
  scheduler takes, a layer that cannot absorb) its chunks get them folded into their causal mask, as generate()'s
  prefill does (``masks.selection_mask``).
"""

from __future__ import annotations

import functools
import inspect

import torch
from transformers.generation.continuous_batching.utils import pad_to_pow2, stream_context
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.utils import logging

from . import adapters, capabilities, paged_indexer
from .absorption import absorbed_weights, unabsorbable
from .decode import decode_layer
from .kernels import Layer, Refused, fa, graphs, ragged
from .masks import selection_mask
from .models import PER_LAYER, attention_with_sinks, global_value, layer_config, original_expand_kv
from .paged_cache import (
    SLIDING_ATTENTION,
    BlockRows,
    LatentAllocator,
    SlidingLatentAllocator,
    index_width,
    refuse_unservable,
    resolve_graphs,
    uses_latent,
)
from .plan import FAMILIES, Route, Routing
from .rows import PageTable, Rows, to_device

logger = logging.get_logger("hf_flashinfer_mla")

# The backends whose continuous-batching decode runs in CUDA graphs: a step's metadata is reloaded into a slot's
# fixed buffers before each replay (fa2/fa3 through FlashInfer's generated module, ``kernels/fa.py``; trtllm-gen and
# cute-dsl where Transformers' pages hold 32-row pages, ``kernels/trtllm.py``).
GRAPHED_BACKENDS = ("fa3", "fa2", "trtllm-gen", "cute-dsl")

# Whether a sparse (DSA) model's uncompiled steps run every query token absorbed over the rows its indexer picked
# (the sparse decode kernel, each token a request of its own, as vLLM's sparse MLA backends run prefill and decode
# alike), rather than expanding each prefill chunk's rows and attending them all under the selection as a mask;
# False keeps the latter for the A/B of ``scripts/bench_serving.py --modes ...-sparse-expanded``.
SPARSE_CHUNKS_ABSORBED = True


class PagedStep(Routing):
    """One continuous-batching forward, on the host: request ``r`` has ``q_lens[r]`` query tokens (packed in order)
    and sees ``k_lens[r]`` cached rows (its past and its new tokens), listed in order in the step's read indices.
    Its decode rows' routes are shared by its layers (`plan.Routing`).

    An uncompiled step's decode rows are its requests of one query token; its other requests with query tokens are
    prefill chunks (`_prefill`). An `absorbed` step has every query token as a decode row: a `graphed` one, which
    runs in a CUDA graph (`graph_pays`), so that one capture serves every mix of decodes and chunks of its token
    count (the padded forward's tokens), and a sparse model's uncompiled one (`SPARSE_CHUNKS_ABSORBED`). There token
    ``i`` of a request with ``q`` query tokens and ``k`` rows reads its first ``k - q + i + 1`` rows (causal: a
    decode reads all ``k``); a padding token reads one entry of the read indices' padded tail, which Transformers
    fills with its read-trash row (its outputs are never read). A graphed step's routes run the CUDA-graph slots of
    that many rows (``kernels/graphs.py``), which `prepare_step` reloads before each replay."""

    paged = True
    q_len = 1  # the routes serve the decode rows: one query token each

    def __init__(self, q_lens: torch.Tensor, k_lens: torch.Tensor, tokens: int, page_rows: int = 0,
                 graphed: bool = False, tables: BlockRows | None = None, read_end: int = 0, width: int = 0,
                 absorbed: bool = False):
        super().__init__()
        # a sparse model's graphed step: the rows its indexer scores per query token, fixed for the graph's shape
        # (Transformers' padded longest key length, part of its graph's key)
        self.width = width
        # where the requests' rows lie, as block tables (None: the forward's read indices list them), and how many
        # entries of the rows a forward reads (Transformers' padded read length)
        self.tables, self.read_end = tables, read_end
        self.launched = False  # its rows and graph slots are on the device (`launch`)
        self.serial = 0  # the step's number in its cache (`prepare_step`): two in a row are in flight at once
        self.requests = q_lens.numel()
        self.graphed = graphed
        self.q_lens, self.k_lens = q_lens, k_lens  # [R] int64, host
        self.kv_offsets = torch.zeros(self.requests + 1, dtype=torch.long)
        self.kv_offsets[1:] = k_lens.cumsum(0)
        self.cu_q = torch.zeros(self.requests + 1, dtype=torch.long)
        self.cu_q[1:] = q_lens.cumsum(0)
        self.tokens = tokens  # query tokens of the forward, padding included
        self.started = False  # a forward has run on it
        self.index_calls = None  # a sparse model's indexer calls, planned by its first layer (``paged_indexer``)
        self.prefill_groups: dict[tuple, list] = {}  # the prefill chunks' ragged-prefill groups, planned per shape
        self.page_rows = page_rows  # rows per page of a cache storing the latent packed (trtllm-gen reads those)
        end = int(self.kv_offsets[-1])
        self.absorbed = graphed or absorbed
        if self.absorbed:
            owner = torch.repeat_interleave(torch.arange(self.requests), q_lens)  # each real token's request
            seen = k_lens[owner] - q_lens[owner] + torch.arange(owner.numel()) - self.cu_q[owner] + 1
            pad = tokens - owner.numel() if graphed else 0
            lens = torch.cat([seen, seen.new_ones(pad)])
            offsets = torch.cat([self.kv_offsets[owner], end + torch.arange(pad)])
            end += pad
            self.decode = torch.arange(owner.numel() + pad)  # query tokens, every one absorbed
            self.decode_tokens = self.decode
            self.chunks = []
        else:
            self.decode = (q_lens == 1).nonzero().flatten()  # requests that run absorbed
            self.decode_tokens = self.cu_q[self.decode]  # their query tokens' positions in the packed forward
            # the others with query tokens: prefill chunks (a request may have none: Transformers prefills a prompt
            # to be forked, sampled several times, without its last token, which for a 1-token prompt leaves nothing)
            self.chunks = (q_lens > 1).nonzero().flatten().tolist()
            lens, offsets = k_lens[self.decode], self.kv_offsets[self.decode]
        self._rows = Rows(lens.to(torch.int32), 1, None)
        # (the read indices, on the device, are the forward's: `start`)
        self.pages = PageTable(offsets, None, end, page_rows)

    @property
    def batch(self) -> int:
        """Decode rows (a graphed step's: its padded query tokens)."""
        return self._rows.batch

    batch_size = batch  # (as `kernels/graphs.py` reads a step)

    @classmethod
    def of_batch(cls, requests, allocator: LatentAllocator, tokens: int, capture: bool = False,
                 read_end: int = 0, max_rows: int = 0, absorb: bool = False) -> PagedStep:
        """From Transformers' scheduled requests, once `prepare_batch_tensors` has advanced their offsets, over
        `allocator`'s rows (a sliding-window layer sees its window only); graphed where it may be (`capture`) and a
        graph pays for it (`graph_pays`; a sparse model's: its decode steps only). `read_end`: Transformers' padded
        read length; `max_rows`: the most rows a request may read (its padding of the longest key length)."""
        q = torch.tensor([fs.query_length for fs in requests], dtype=torch.long)
        k = torch.tensor([allocator.get_seqlen_k(fs.state.position_offset - fs.query_length, fs.query_length)
                          for fs in requests], dtype=torch.long)
        tables = allocator.block_rows([fs.state.request_id for fs in requests], k)
        graphed = capture and graph_pays(q, k) and not (allocator.index_dim and bool((q > 1).any()))
        width = pad_to_pow2(int(k.max()), max_rows, 1024) if graphed and allocator.index_dim else 0
        absorbed = absorb and SPARSE_CHUNKS_ABSORBED and bool(allocator.index_dim) and not graphed
        return cls(q, k, tokens, page_rows(allocator), graphed, tables, read_end, width, absorbed)

    def launch(self, allocator: LatentAllocator) -> None:
        """The step's device work before its forward, on the stream the forward runs on: its rows laid out from the
        block tables into the cache's rows buffer, and a graphed step's slots reloaded with its schedule (a replay
        runs no Python). Once per step; stream-ordered after the previous step's forward, which may still run (the
        buffers are the cache's, at fixed addresses)."""
        if self.launched:
            return
        self.launched = True
        if self.tables is not None:
            self.tables.write(allocator.rows, max(self.pages.end, self.read_end), to_device)
        if self.graphed and self.width:  # each query token's rows, where the indexer reads them in the graph
            host = torch.stack([self.pages.offsets, self._rows.lens.long()])
            allocator.token_rows[:, : self.batch].copy_(to_device(host, allocator.token_rows.device))
        if self.graphed:
            for _, slot in graphs.slots_for(self.batch, 1, None):
                slot.load(self)

    def matches(self, tokens: int, cu_q: torch.Tensor) -> bool:
        return self.tokens == tokens and cu_q.numel() >= self.requests + 1

    def start(self, source: torch.Tensor) -> None:
        """A forward's first layer: the step's read indices (`source`, on the device) become its page table's. A
        graphed step's forward is run twice (warmed up, then captured): each converts them again, so that the
        captured graph converts the indices of the step it replays, and routes again on them."""
        self.started = True
        self.pages.indices, self.pages._typed = source, {}
        if self.graphed:
            # (all of them: the captured conversion must cover the longest step its graph replays, not this one)
            self.pages._typed = {torch.int32: source.to(torch.int32), torch.long: source.long()}
            self.routes.clear()

    def route(self, key: tuple, layer: Layer, requested: str, grad: bool) -> Route:
        if not self.graphed:
            return super().route(key, layer, requested, grad)
        backend = self.backend_for(layer, requested, grad)
        slot = backend in GRAPHED_BACKENDS and graphs.slot((backend, layer, self.batch, 1, None), FAMILIES[backend],
                                                           backend, layer, self)
        if not isinstance(slot, graphs.GraphSlot):
            raise RuntimeError(f"flashinfer_mla: a continuous-batching step in a CUDA graph routed to {backend}, "
                               f"which it cannot replay; pass continuous_batching_config=ContinuousBatchingConfig("
                               "use_cuda_graph=False) to generate_batch or init_continuous_batching.")
        # The slot's metadata (reloaded before each replay, `prepare_step`) with this forward's page addressing.
        self.routes[key] = Route(backend, layer, FAMILIES[backend].replayed(slot.meta, self.pages))
        return self.routes[key]

    # ------------------------------------------------------------------------------------------- what builders read
    def rows(self) -> Rows:
        """The decode requests' rows: their lengths (where they lie is `pages`)."""
        return self._rows

    def layer_of(self, q_lat, kv_latent, k_rot, scale: float, topk: int = 0, sinks: bool = False) -> Layer:
        # (no pitch: the layer's rows are one sequence of the whole paged cache, addressed through `pages`)
        return Layer(q_lat.device, q_lat.dtype, kv_latent.dtype, q_lat.shape[0], kv_latent.shape[-1],
                     k_rot.shape[-1], 0, self.page_rows > 0, scale, topk, sinks)


def prepare_step(io) -> None:
    """Hand the batch Transformers just prepared (``ContinuousBatchingIOs`` `io`, the host's under asynchronous
    batching) to the cache's latent allocator: its seam, `paged_steps`, calls this after ``prepare_batch_tensors``.
    Host work only: the step's lengths and block tables, whether it runs in a CUDA graph where Transformers captures
    them (`graph_pays`, `PagedStep.graphed`); its device work waits for its forward (`launch_steps`)."""
    requests, tokens = io.requests_in_batch, io.num_q_tokens
    fits = _fits_one_schedule(io, tokens)
    capturable = getattr(io, "use_cuda_graph_varlen", False) and not io.use_block_table and fits
    for allocator in io.cache.cache_allocators.values():
        if isinstance(allocator, LatentAllocator):
            capture = capturable and _graphs_still_hold(allocator)
            allocator.step = step = PagedStep.of_batch(requests, allocator, tokens, capture, io.max_kv_read + tokens,
                                                       io.cache.max_tokens_read, absorb=fits)
            step.serial, allocator.steps_prepared = allocator.steps_prepared, allocator.steps_prepared + 1


def launch_steps(cache, stream) -> None:
    """Every latent allocator's prepared step launched (`PagedStep.launch`) on `stream`, the one the forward (or its
    graph's replay) runs on."""
    with stream_context(stream):
        for allocator in cache.cache_allocators.values():
            if isinstance(allocator, LatentAllocator) and allocator.step is not None:
                allocator.step.launch(allocator)


def graph_pays(q_lens: torch.Tensor, k_lens: torch.Tensor) -> bool:
    """Whether a step of requests with `q_lens` query tokens over `k_lens` rows runs in a CUDA graph, where every
    query token attends absorbed (`PagedStep`): when its prefill chunks' tokens read no more rows that way than its
    decodes read. A graph saves a step's host time (Python and launches, per layer), which bounds a step of decodes
    with a few prefill tokens beside them; a step whose prefill dominates is bound by the GPU instead, and there
    the ragged prefill over expanded rows (`_prefill`), which reads each row once per request, costs less than the
    absorbed kernel reading the latent once per query token."""
    decode, chunk = q_lens == 1, q_lens > 1
    q, k = q_lens[chunk], k_lens[chunk]
    chunk_rows = int((q * (k - q) + q * (q + 1) // 2).sum())  # token i of a chunk reads k - q + i + 1 rows
    return chunk_rows <= int(k_lens[decode].sum())


def _graphs_still_hold(allocator: LatentAllocator) -> bool:
    """Whether the layers that ran in this cache's graphs still run as captured. A PEFT adapter put on a kv_b_proj
    since (a persistent manager outlives the check at its creation, `graph_refusal`) would never reach a replay,
    which runs the captured kernels only: the cache's steps then run without graphs, after one warning."""
    if allocator.graphs_refused is None and any(adapters.is_lora(m.kv_b_proj) for m in allocator.graphed_layers):
        allocator.graphs_refused = "a PEFT adapter was put on kv_b_proj after its graphs were captured"
        logger.warning_once(f"flashinfer_mla: continuous batching's steps run without CUDA graphs from now on: "
                            f"{allocator.graphs_refused}.")
    return allocator.graphs_refused is None


def page_rows(allocator: LatentAllocator) -> int:
    """Rows per page of a cache storing the latent packed (trtllm-gen reads those; 0: not packed, or a sliding-window
    layer's rows, which its allocator gathers, `SlidingLatentAllocator`)."""
    packed = allocator.row_width == allocator.rank + allocator.rope
    return allocator.tokens_per_page if packed and not isinstance(allocator, SlidingLatentAllocator) else 0


def _fits_one_schedule(io, tokens: int) -> bool:
    """Whether FlashInfer's scheduler accepts every decode step of `tokens` rows (its work-item capacity), so that a
    graph captured on fa3/fa2 never meets a step it declines (``kernels/fa.py`` `refusal_for_every_step`), and a
    sparse step absorbing every query token runs on one plan. trtllm-gen has no such bound; its steps are held to
    fa's, which only leaves larger ones uncompiled, or their prefill chunks expanded."""
    text = io.config.get_text_config()
    heads = global_value(text, "num_attention_heads")
    if heads == PER_LAYER:  # (the most heads of any layer: its query tiles are the most work items)
        heads = max(layer_config(text, i).num_attention_heads for i in range(text.num_hidden_layers))
    device = torch.device(io.cache.device)  # (under asynchronous batching `io` is the host's)
    sms = torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 132
    return fa.work_items_bound(tokens, 1, heads, sms) <= fa.MAX_WORK_ITEMS


NOT_PREPARED = ("flashinfer_mla: a forward over continuous batching's paged latent cache was not prepared by its loop "
                "(the batch's lengths and block tables are laid out in ContinuousBatchingIOs.prepare_batch_tensors); run "
                "it through generate_batch or init_continuous_batching, or use generate()")


def attend(allocator: LatentAllocator, module, query, kv_latent, k_rot, scaling, mla_backend=None, indices=None,
           s_aux=None, **kwargs):
    """One layer's attention over the paged latent: ``query [1, H, T, qk_head_dim]`` (every request's tokens packed)
    -> ``(attn_output [1, T, H, v_head_dim], None)``; padding tokens get zeros. `indices`: a sparse layer's selection
    ``[1, T, topk]`` in the step's read indices (-1: none); `s_aux`: attention sinks (one logit per head)."""
    cu_q = kwargs["cu_seq_lens_q"]
    step = allocator.step
    # A prepared step serves exactly one forward: the one whose first layer finds it unstarted.
    first = module.layer_idx == allocator.layer_indices[0]
    # (a graphed step serves the two forwards of its capture: warm-up, then capture)
    if step is None or (first and step.started and not step.graphed) or not step.matches(query.shape[2], cu_q):
        raise RuntimeError(NOT_PREPARED)
    step.launch(allocator)  # (done before the forward where Transformers' model runner runs it: `launch_steps`)
    source = allocator.source(kwargs["read_index"][allocator.index], kwargs["write_index"][allocator.index], kv_latent)
    if not step.started or (first and step.graphed):
        step.start(source)
    scale = scaling if scaling is not None else module.qk_head_dim**-0.5
    h, t = query.shape[1], query.shape[2]
    weights = absorbed_weights(module, query.dtype, sinks=s_aux is not None) if len(step.decode) else None
    if step.graphed:
        allocator.graphed_layers.add(module)  # (warm-up and capture only: a replay runs no Python)
    if step.graphed and weights is None:
        raise RuntimeError(f"flashinfer_mla: layer {module.layer_idx} can no longer absorb kv_b_proj, which a "
                           "continuous-batching step in a CUDA graph needs; run generate_batch with "
                           "continuous_batching_config=ContinuousBatchingConfig(use_cuda_graph=False).")
    out = query.new_zeros(1, t, h, module.v_head_dim)
    decode = step.decode if weights is not None else step.decode[:0]
    if len(decode):
        all_decode = len(decode) == t  # every query token decodes (a graphed step's always do)
        tokens = None if all_decode else step.decode_tokens
        q = query if all_decode else query[:, :, to_device(tokens, query.device)]
        rows = None
        if indices is not None:  # the selected rows of each decode request, in the layer's view: [N, 1, topk]
            picked = indices[0] if all_decode else indices[0].index_select(0, to_device(tokens, query.device))
            rows = torch.where(picked >= 0, source[picked.clamp_min(0).long()], -1).to(torch.int32)[:, None]
        o = decode_layer(module, step, q, kv_latent, k_rot, weights, scale, mla_backend, rows, s_aux)  # [1,N,H,dv]
        if all_decode:
            return o, None
        out.index_copy_(1, to_device(tokens, out.device), o)
    requested = capabilities.requested_backend(mla_backend, module.config)
    _prefill(allocator, step, decode, module, query, kv_latent, k_rot, source, scale, requested, out, indices, s_aux)
    return out, None


def _prefill(allocator: LatentAllocator, step: PagedStep, decoded, module, query, kv_latent, k_rot, source, scale,
             requested, out, indices=None, sinks=None) -> None:
    """Every request not decoded absorbed: its rows expanded through the model's own ``expand_kv`` and attended
    causally, on FlashInfer's ragged prefill (``kernels/ragged.py``: one launch per group of requests) where the
    step's decode backend is fa3 and it serves the head dims, else with Transformers' SDPA one request at a time
    (so the transient keys and values are one request's). A sparse layer's chunks attend their selected rows only,
    a sliding-window layer's their window (its decodes see nothing else: `SlidingLatentAllocator`), and a layer
    with sinks runs the model's own eager attention: all three one request at a time."""
    window = getattr(allocator, "sliding_window", None)
    # (no decode: a layer that cannot absorb runs every request with query tokens here)
    pending = step.chunks if len(decoded) else (step.q_lens > 0).nonzero().flatten().tolist()
    if not pending:
        return
    lat_rows, rot_rows = kv_latent[0, 0], k_rot[0, 0]
    expand = original_expand_kv(module)
    key = (query.device, query.dtype, query.shape[1], query.shape[-1], module.v_head_dim, scale, requested,
           len(pending))
    if indices is not None or sinks is not None or window is not None:
        step.prefill_groups[key] = []
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
        if (q > 1 and k > q) or indices is not None or sinks is not None or (window is not None and q > window):
            last = torch.arange(k - q, k, device=query.device)[:, None]  # query i sees rows up to k - q + i
            mask = torch.arange(k, device=query.device) <= last
            if window is not None:  # ... and the window's last rows only
                mask &= torch.arange(k, device=query.device) > last - window
            mask = mask[None, None]
        if indices is not None:  # (its selection, as positions among its own rows)
            picked = indices[:, q0 : q0 + q].long()
            mask = selection_mask(mask, torch.where(picked >= 0, picked - k0, -1), k)
        if sinks is not None:
            o, _ = attention_with_sinks(module, query[:, :, q0 : q0 + q], keys, values, mask, 0.0, scale)
        else:
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
            group.wrapper = allocator.prefill_wrappers.get(device, i, step.serial % 2)
            ragged.plan(group.wrapper, step.q_lens[group.requests], step.k_lens[group.requests], heads, qk, vo,
                        scale, dtype)
    except Refused as exc:
        logger.warning_once(f"flashinfer_mla: continuous batching's prefill chunks run on SDPA, one request at a "
                            f"time ({str(exc)[:200]})")
        return []
    return groups


def graph_refusal(model, page_size: int) -> str | None:
    """Why `model`'s continuous-batching decode steps, in pages of `page_size` tokens, cannot run in CUDA graphs
    (None: they can). A replayed graph
    runs the kernels it captured on the buffers it captured: the decode must run on a backend whose schedule is
    reloaded into fixed buffers before each replay, and nothing that a Python check decides per step may change
    between replays (a PEFT adapter switched, a kv_b_proj that stopped absorbing)."""
    config = model.config.get_text_config(decoder=True)
    layers = [m for m in model.modules() if "kv_b_proj" in m._modules and hasattr(m, "qk_nope_head_dim")]
    if not layers:
        return "it has no MLA attention layer"
    if SLIDING_ATTENTION in (getattr(config, "layer_types", None) or ()):
        return "its sliding-window layers gather each step's window into a new tensor, which a graph cannot replay"
    weight = next(layers[0].kv_b_proj.parameters())
    requested = capabilities.requested_backend(None, config)
    backend = capabilities.choose_backend(weight.device, model.dtype, config.kv_lora_rank, config.qk_rope_head_dim,
                                         config.num_attention_heads, requested)
    if backend not in GRAPHED_BACKENDS:
        return f"its decode runs on {backend}, whose paged steps are planned on the host every step"
    if index_width(config) and backend not in ("fa3", "fa2"):
        return f"its sparse (DSA) decode runs on {backend}, whose sparse kernel takes no fixed-address metadata"
    if backend in ("fa3", "fa2") and not fa.uses_generated_module():
        return "FlashInfer's public MLA wrapper binds its buffers when it plans (its generated module is not in use)"
    if backend not in ("fa3", "fa2") and (page_size % 32 or (config.kv_lora_rank + config.qk_rope_head_dim) % 2):
        return (f"{backend} reads pages of 32 or 64 packed latent rows, which pages of {page_size} tokens do not "
                "hold (ContinuousBatchingConfig(page_size=64))")
    for module in layers:
        proj = module.kv_b_proj
        if adapters.is_lora(proj):
            return "a PEFT adapter on kv_b_proj can be switched between steps, which a replayed graph would not see"
        if getattr(module, "sinks", None) is not None:
            return "its layers have attention sinks, which FlashInfer's MLA kernels do not take"
        why = unabsorbable(proj)
        if why is not None:
            return f"kv_b_proj cannot be absorbed ({why})"
    return None


# ------------------------------------------------------------------------------------------------------------------
# Seams (``registration.py``)
# ------------------------------------------------------------------------------------------------------------------
def manager_checked(original):
    # The manager is built in the caller's thread, before the background loop: the one place where a model continuous
    # batching cannot serve can raise (the loop turns any error into FAILED requests with empty outputs), and where
    # the model is at hand to decide its CUDA graphs. It keeps "flashinfer_mla" as a flash implementation (the name
    # contains "flash"), for which Transformers turns CUDA graphs and asynchronous batching on: graphs stay on for
    # the decode steps of a model that `graph_refusal` admits, and asynchronous batching with them (`paged_cache`).
    @functools.wraps(original)
    def __init__(self, model, *args, **kwargs):
        refuse_unservable(model)
        if uses_latent(model.config.get_text_config()):
            paged_indexer.install(model)  # (a sparse model's indexers select per request)
        asked = _arguments(original, self, model, *args, **kwargs).get("continuous_batching_config")
        original(self, model, *args, **kwargs)
        if uses_latent(self.model.config.get_text_config()):
            cb_config = self.continuous_batching_config
            why = graph_refusal(self.model, cb_config.page_size) if any(cb_config.cuda_graph_booleans) else None
            resolve_graphs(cb_config, why, getattr(asked, "use_async_batching", None))

    return __init__


def _arguments(function, *args, **kwargs) -> dict:
    return inspect.signature(function).bind_partial(*args, **kwargs).arguments


EMPTY_PROMPT = ("continuous batching was given an empty prompt: every request needs at least one input token (the "
                "tokenizer's BOS token, or the chat template's)")


def prompt_checked(original):
    # Transformers schedules a request with no input token as one with nothing to attend from: among others it answers
    # with a neighbouring request's first token, alone it fails inside the loop (its own attentions do the same).
    # Refused here, in the caller's thread, before it is queued.
    @functools.wraps(original)
    def add_request(self, input_ids, *args, **kwargs):
        if len(input_ids) == 0 and uses_latent(self.model.config.get_text_config()):
            raise ValueError(EMPTY_PROMPT)
        return original(self, input_ids, *args, **kwargs)

    return add_request


def prompts_checked(original):
    # generate_batch turns an error while it queues its requests into a log line and an empty result: an empty prompt
    # is refused before the manager starts, naming which.
    @functools.wraps(original)
    def generate_batch(self, inputs, *args, **kwargs):
        empty = [i for i, ids in enumerate(inputs or ()) if len(ids) == 0]
        if empty and uses_latent(self.config.get_text_config()):
            raise ValueError(f"{EMPTY_PROMPT}; inputs {empty} are empty")
        return original(self, inputs, *args, **kwargs)

    return generate_batch


def latent_attention_kept(original):
    # Transformers switches a model whose config says eager to "paged|eager", through set_attn_implementation on the
    # whole model: a multimodal model whose wrapper and vision tower run eager (HY-V4-VL) would lose flashinfer_mla on
    # its MLA text model too, which eager cannot serve from the paged latent. A model whose text model runs
    # flashinfer_mla keeps it (its other sub-models never run under continuous batching's text-only requests).
    @functools.wraps(original)
    def switch_to_cb_friendly_attn(self, model, *args, **kwargs):
        if uses_latent(model.config.get_text_config()):
            return None
        return original(self, model, *args, **kwargs)

    return switch_to_cb_friendly_attn


# Where Transformers has laid out a batch on the host
def paged_steps(original):
    # The attention receives only device tensors (cu_seq_lens, read indices); reading their lengths would wait for
    # the GPU. Here, where Transformers has just laid out the batch on the host, its lengths go to the latent
    # allocator, so every layer of the step plans its kernels without a sync.
    @functools.wraps(original)
    def prepare_batch_tensors(self, *args, **kwargs):
        original(self, *args, **kwargs)
        prepare_step(self)

    return prepare_batch_tensors


def graphs_for_graphed_steps(original):
    # Transformers captures every padded varlen forward in a CUDA graph once it turned graphs on; a step of the
    # package's is captured only where its metadata can be reloaded before each replay (`PagedStep.graphed`: every
    # request decodes); any other step (prefill chunks, mixed) runs as it is, with the same padded inputs.
    # It is also the last point before the forward or its graph's replay: the prepared steps' device work is
    # launched there, on the stream the forward runs on.
    @functools.wraps(original)
    def _get_forward_fn(self, use_block_table: bool):
        forward_fn, use_graph = original(self, use_block_table)
        steps = [a.step for a in self.cache.cache_allocators.values() if isinstance(a, LatentAllocator)]
        if use_graph and steps:
            use_graph = all(step is not None and step.graphed for step in steps)
        if steps:
            launch_steps(self.cache, self.inputs_and_outputs.compute_stream)
        return forward_fn, use_graph

    return _get_forward_fn
