"""A sparse (DSA) model's indexer over continuous batching's paged cache.

Under continuous batching a DSA layer gets every request's tokens packed into one sequence (``[1, T]``), the paged
cache and no mask. Transformers' indexers score every query token against every key their cache hands back
(``[B, H, S, keys]``) and keep their keys in the cache (``cache.update_indexer``): over a packed step that would
score each request against every other request's rows (quadratic in the step's rows), and the paged cache has no
``update_indexer``.

Here the model's own indexer (its projections, rotary, scoring and top-k, unchanged: each family's differ) runs
once per group of requests (`select`): the step's decode requests as one batch ``[G, 1]``, each over its own rows
padded to the longest, and each prefill chunk alone, both in slices whose scores fit `SCORE_BYTES`. Each call sees
`RequestRows` as its cache: its ``update_indexer`` writes the call's new keys into the paged rows beside the latent
(``paged_cache.LatentAllocator.index_keys``) and returns each request's keys; its mask is each request's causal
mask over its own rows. The selection comes back as positions in the step's read indices (``[1, T, topk]`` int32,
-1 past a token's visible rows and on padding tokens), so it means the same to every layer of the step: a layer of
"shared" indexer type reuses the previous layer's, as it does in ``generate()``; ``paged_attention.attend`` turns
it into the layer's rows.

A decode step in a CUDA graph (``paged_attention.PagedStep.graphed``) runs the same indexer in fixed shapes
(`_select_in_graph`): every padded query token over the graph's width of rows, where its rows lie read from a
buffer the step's launch writes before each replay, so the selection is made on the GPU and feeds the sparse kernel
without a host round trip.

An indexer whose forward is DeepSeek-V3.2's (`OWN_ROWS_INDEXERS`: its family's classes differ in their rotary only)
is not called: its queries, keys and head weights come from its own modules (`scoring_inputs`), and its scores are
computed over each query token's own rows only (``kernels/index_scores.py``: a Triton kernel on CUDA), where its own
call scores every token of a group over the group's longest rows, and a graph's padding tokens over all of them.
Each step's geometry is the same `Call`s (or the graph's ``token_rows``); `SCORES_OVER_OWN_ROWS` False calls the
model's forward instead, for A/Bs.

Transformers builds no mask for a paged cache, and a DSA layer slices its mask (``attention_mask[:, 0]``) before it
calls its indexer: `step_mask` gives those layers an empty one (``[1, 1, T, 0]``), which the indexer here never
reads.
"""

from __future__ import annotations

import functools
import inspect
import sys
from dataclasses import dataclass

import torch

from .errors import UnsupportedModelError
from .kernels import index_scores
from .paged_cache import LatentAllocator, index_width, uses_latent
from .rows import to_device

# The most fp32 scores one indexer call may hold (``[G, H, q, keys]``): a prefill chunk of 8k tokens over 32k rows
# at 64 index heads would otherwise take 64 GiB.
SCORE_BYTES = 1 << 30

# Indexers whose forward is DeepSeek-V3.2's, by class name: the rotary function (of their modeling module) it applies
# to the queries' and keys' first ``qk_rope_head_dim`` channels. `scoring_inputs` follows that forward.
OWN_ROWS_INDEXERS = {"DeepseekV32Indexer": "apply_rotary_pos_emb", "GlmMoeDsaIndexer": "apply_rotary_pos_emb_interleave"}
# Whether those indexers' scores are computed over each token's own rows (False: their forward runs per group).
SCORES_OVER_OWN_ROWS = True

# The indexer arguments a group's call is sliced from (the rest are passed on as they are): how their token
# dimension is laid out. A family whose indexer takes another tensor is refused (`refusal`).
_TOKEN_DIM = {"hidden_states": "batch", "q_resid": "batch", "position_embeddings": "batch",
              "position_ids": "positions", "attention_mask": "mask", "cache": "cache"}


def latent_allocator(cache, layer: int | None = None) -> LatentAllocator | None:
    """The `LatentAllocator` of a continuous-batching cache holding this package's latent rows (`layer`'s, where
    given: a model with sliding-window layers has a second one), None for any other cache."""
    allocators = getattr(cache, "cache_allocators", None)
    if not isinstance(allocators, dict):
        return None
    found = (cache.layer_to_allocator.get(layer),) if layer is not None else allocators.values()
    return next((a for a in found if isinstance(a, LatentAllocator)), None)


def step_mask(config, inputs_embeds: torch.Tensor, cache) -> torch.Tensor | None:
    """The mask a sparse model's layers get under continuous batching (None: not such a forward)."""
    if not (uses_latent(config) and index_width(config)) or latent_allocator(cache) is None:
        return None
    return torch.ones(1, 1, inputs_embeds.shape[1], 0, dtype=torch.bool, device=inputs_embeds.device)


def install(model) -> None:
    """Make `model`'s indexers (a sparse model's; none in a dense one) run per request group on a paged latent cache
    (`select`); their classes' `forward` is wrapped once, and runs unchanged on any other cache. Raises
    `UnsupportedModelError` for an indexer taking an argument this module does not know how to slice per request."""
    for module in model.modules():
        cls = type(module)
        if "Indexer" not in cls.__name__ or "cache" not in inspect.signature(cls.forward).parameters:
            continue
        unknown = sorted(set(inspect.signature(cls.forward).parameters) - set(_TOKEN_DIM) - {"self", "kwargs"})
        if unknown:
            raise UnsupportedModelError(
                f"continuous batching cannot run {cls.__name__} per request: it takes {', '.join(unknown)}, which "
                "this package does not slice per request. Use generate().")
        if not getattr(cls.forward, "_flashinfer_mla_hook", False):
            cls.forward = _per_request_groups(cls.forward)


def _per_request_groups(forward):
    signature = inspect.signature(forward)

    @functools.wraps(forward)
    def indexer_forward(self, *args, **kwargs):
        # On a paged latent cache the packed forward's selection is made per request group; elsewhere, unchanged.
        bound = signature.bind(self, *args, **kwargs)
        allocator = latent_allocator(bound.arguments.get("cache"), self.layer_idx)
        if allocator is None:
            return forward(self, *args, **kwargs)
        return select(self, forward, bound, allocator)

    indexer_forward._flashinfer_mla_hook = True
    return indexer_forward


class RequestRows:
    """The cache one indexer call sees: `update_indexer` writes the new keys of the call's tokens into the paged rows
    and returns each request's keys ``[G, width, D]`` (a request's rows past its own are its first row's: masked)."""

    def __init__(self, keys: torch.Tensor, write: torch.Tensor, read: torch.Tensor):
        self.keys, self.write, self.read = keys, write, read

    def update_indexer(self, key_states: torch.Tensor, layer_idx: int) -> torch.Tensor:
        self.keys.index_copy_(0, self.write, key_states.reshape(-1, key_states.shape[-1]).to(self.keys.dtype))
        return self.keys[self.read]


@dataclass(eq=False)
class Call:
    """One indexer call of a step: `requests` (rows of the step) with `q` query tokens each, starting at query
    token `first` of their chunk; `tokens` [G * q] their positions in the packed forward, `read` [G, width] the
    positions in the step's read indices of each request's rows (its own `lens` of them first), `last` [G, q] the
    last of its own rows each query token sees."""

    requests: list[int]
    q: int
    tokens: torch.Tensor  # host, long
    read: torch.Tensor  # host, long
    lens: torch.Tensor  # host, long
    last: torch.Tensor  # host, long
    offsets: torch.Tensor  # host, long: each request's first position in the read indices
    on_device: tuple | None = None  # what every layer's call reads of it on the device (`device_view`)

    def device_view(self, device, source: torch.Tensor, write_index: torch.Tensor) -> tuple:
        """``(tokens, last, offsets, rows written, rows read [G, width])`` on the device, built by the step's first
        layer and read by the others (a step's read and write indices are its layers')."""
        if self.on_device is None:
            tokens = to_device(self.tokens, device)
            read = source.index_select(0, to_device(self.read.flatten(), device)).view(self.read.shape)
            self.on_device = (tokens, to_device(self.last, device), to_device(self.offsets, device),
                              write_index.index_select(0, tokens), read)
        return self.on_device


def calls(step, heads: int) -> list[Call]:
    """The step's indexer calls: its decode requests together, each prefill chunk alone, in slices whose scores
    (``[G, heads, q, width]`` fp32) fit `SCORE_BYTES`. Planned once per step, on the host."""
    out = []
    # (by request, whether or not the step's attention runs every query token absorbed, ``PagedStep.absorbed``)
    decode = (step.q_lens == 1).nonzero().flatten().tolist()
    if decode:
        width = int(step.k_lens[decode].max())
        per = max(1, SCORE_BYTES // (heads * width * 4))
        for i in range(0, len(decode), per):
            out.append(_call(step, decode[i : i + per], 0, 1))
    for r in (step.q_lens > 1).nonzero().flatten().tolist():
        q, k = int(step.q_lens[r]), int(step.k_lens[r])
        per = max(1, SCORE_BYTES // (heads * k * 4))
        for first in range(0, q, per):
            out.append(_call(step, [r], first, min(per, q - first)))
    return out


def _call(step, requests: list[int], first: int, q: int) -> Call:
    rows = torch.tensor(requests, dtype=torch.long)
    lens, q_lens = step.k_lens[rows], step.q_lens[rows]
    offsets = step.kv_offsets[rows]
    width = int(lens.max())
    j = torch.arange(width)
    read = offsets[:, None] + torch.where(j < lens[:, None], j, 0)
    tokens = (step.cu_q[rows][:, None] + first + torch.arange(q)).flatten()
    last = (lens - q_lens)[:, None] + first + torch.arange(q)  # query i sees its rows up to k_len - q_len + i
    return Call(requests, q, tokens, read, lens, last, offsets)


@torch.no_grad()
def select(indexer, forward, bound: inspect.BoundArguments, allocator: LatentAllocator) -> torch.Tensor:
    """The indexer's selection for a packed continuous-batching forward: ``[1, T, topk]`` int32 positions in the
    step's read indices, -1 where none (see the module's docstring)."""
    step = allocator.step
    hidden = bound.arguments["hidden_states"]
    total = hidden.shape[1]
    first_layer = indexer.layer_idx == allocator.layer_indices[0]
    # (a graphed step serves the two forwards of its capture: warm-up, then capture)
    if step is None or step.tokens != total or (first_layer and step.started and not step.graphed):
        raise RuntimeError("flashinfer_mla: a sparse model's paged forward was not prepared by continuous batching's "
                           "loop (generate_batch, init_continuous_batching); run it there, or use generate()")
    device = hidden.device
    read_index, write_index = allocator.read_index, allocator.write_index
    step.launch(allocator)  # (the indexer runs before its layer's attention: the step's rows must be laid out)
    source = allocator.source(read_index, write_index, None)
    if step.graphed:
        return _select_in_graph(indexer, forward, bound, allocator, step, source, write_index)
    if step.index_calls is None:
        step.index_calls = calls(step, getattr(indexer, "n_heads", 64))
    keys = allocator.index_keys(indexer.layer_idx)
    by = _picks_over_own_rows if scores_own_rows(indexer) else _picks_by_forward
    picks = by(indexer, forward, bound, step.index_calls, keys, source, write_index)
    topk = max(p.shape[-1] for _, p in picks)
    selection = torch.full((total, topk), -1, dtype=torch.int32, device=device)
    for tokens, p in picks:
        selection[tokens, : p.shape[-1]] = p.to(torch.int32)
    return selection[None]


def _picks_over_own_rows(indexer, forward, bound, index_calls, keys, source, write_index) -> list[tuple]:
    """Per call: its tokens and their selections, scored here over each token's own rows."""
    q, w = _write_keys(indexer, bound, keys, write_index)
    picks = []
    for call in index_calls:
        tokens, last, offsets, _, read = call.device_view(q.device, source, write_index)
        first = offsets[:, None].expand(-1, call.q).flatten()
        picks.append((tokens, _pick(indexer, q[tokens], w[tokens], keys, source, first, (last + 1).flatten(),
                                    read.shape[1])))
    return picks


def _picks_by_forward(indexer, forward, bound, index_calls, keys, source, write_index) -> list[tuple]:
    """Per call: its tokens and their selections, by the indexer's own forward over the call's requests."""
    picks = []
    for call in index_calls:
        g, q = len(call.requests), call.q
        tokens, last, offsets, written, read = call.device_view(keys.device, source, write_index)
        args = bound.arguments.copy()
        for name, kind in _TOKEN_DIM.items():
            if name not in args or args[name] is None:
                continue
            if kind == "batch":
                args[name] = _per_request(args[name], tokens, g, q)
            elif kind == "positions":
                value = args[name]
                args[name] = value.index_select(-1, tokens).view(*value.shape[:-2], g, q)
        args["attention_mask"] = torch.arange(read.shape[1], device=keys.device) <= last[..., None]  # [G, q, width]
        args["cache"] = RequestRows(keys, written, read)
        call_args = inspect.BoundArguments(bound.signature, args)
        local = forward(*call_args.args, **call_args.kwargs).long()  # [G, q, k]
        seen = local <= last[..., None]  # (the indexer ranks what its mask hides last)
        picks.append((tokens, torch.where(seen, offsets[:, None, None] + local, -1).view(g * q, -1)))
    return picks


def _select_in_graph(indexer, forward, bound: inspect.BoundArguments, allocator: LatentAllocator, step, source,
                     write_index) -> torch.Tensor:
    """`select` for a decode step in a CUDA graph: every padded query token one request of one token, each over
    ``step.width`` rows (its own first, the rest masked), in slices of fixed shapes whose scores fit `SCORE_BYTES`;
    where each token's rows lie comes from the fixed buffer the step's launch wrote (``token_rows``), so a replay
    reads the replayed step's. A padding token reads the trash row its rows point to; its selection is never read."""
    hidden = bound.arguments["hidden_states"]
    device, tokens, width = hidden.device, step.tokens, step.width
    offsets, lens = allocator.token_rows[0, :tokens], allocator.token_rows[1, :tokens]
    keys = allocator.index_keys(indexer.layer_idx)
    if scores_own_rows(indexer):  # (the scores of each token's own rows: a padding token's one row)
        q, w = _write_keys(indexer, bound, keys, write_index)
        per = max(1, SCORE_BYTES // (getattr(indexer, "n_heads", 64) * width * 4))
        return torch.cat([_pick(indexer, q[a : a + per], w[a : a + per], keys, source, offsets[a : a + per],
                                lens[a : a + per], width) for a in range(0, tokens, per)]).to(torch.int32)[None]
    j = torch.arange(width, device=device)
    read = source.index_select(0, (offsets[:, None] + torch.where(j < lens[:, None], j, 0)).flatten())
    read, last = read.view(tokens, width), (lens - 1)[:, None]
    per = max(1, SCORE_BYTES // (getattr(indexer, "n_heads", 64) * width * 4))
    picks = []
    for first in range(0, tokens, per):
        g = min(per, tokens - first)
        span = torch.arange(first, first + g, device=device)
        args = bound.arguments.copy()
        for name, kind in _TOKEN_DIM.items():
            if name not in args or args[name] is None:
                continue
            if kind == "batch":
                args[name] = _per_request(args[name], span, g, 1)
            elif kind == "positions":
                value = args[name]
                args[name] = value.index_select(-1, span).view(*value.shape[:-2], g, 1)
        args["attention_mask"] = (j <= last[first : first + g, :, None])  # [G, 1, width]
        args["cache"] = RequestRows(keys, write_index[first : first + g], read[first : first + g])
        call_args = inspect.BoundArguments(bound.signature, args)
        local = forward(*call_args.args, **call_args.kwargs).long()  # [G, 1, k]
        seen = local <= last[first : first + g, :, None]
        picks.append(torch.where(seen, offsets[first : first + g, None, None] + local, -1).view(g, -1))
    return torch.cat(picks).to(torch.int32)[None]


def scores_own_rows(indexer) -> bool:
    """Whether `indexer`'s scores are computed here over each token's own rows (the module's docstring)."""
    name = type(indexer).__name__
    return (SCORES_OVER_OWN_ROWS and name in OWN_ROWS_INDEXERS
            and hasattr(sys.modules[type(indexer).__module__], OWN_ROWS_INDEXERS[name]))


def scoring_inputs(indexer, arguments: dict) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """What an `OWN_ROWS_INDEXERS` indexer scores with, for the packed forward's ``T`` tokens, computed as its own
    forward computes them: queries ``[T, H, D]`` after rotary, keys ``[T, D]``, head weights ``[T, H]`` float32
    (its ``n_heads ** -0.5`` included)."""
    hidden, q_resid = arguments["hidden_states"], arguments["q_resid"]
    cos, sin = arguments["position_embeddings"]
    rotary = getattr(sys.modules[type(indexer).__module__], OWN_ROWS_INDEXERS[type(indexer).__name__])
    b, s, _ = hidden.shape
    rope, h = indexer.qk_rope_head_dim, indexer.n_heads
    q = indexer.wq_b(q_resid).view(b, s, h, indexer.head_dim)
    k = indexer.k_norm(indexer.wk(hidden)).unsqueeze(2)
    q_rot, k_rot = rotary(q[..., :rope], k[..., :rope], cos, sin, unsqueeze_dim=2)
    q = torch.cat([q_rot, q[..., rope:]], dim=-1)
    k = torch.cat([k_rot, k[..., rope:]], dim=-1).squeeze(2)
    w = indexer.weights_proj(hidden.to(indexer.weights_proj.weight.dtype)).float() * h**-0.5
    return q[0], k[0], w[0]


def _write_keys(indexer, bound: inspect.BoundArguments, keys: torch.Tensor, write_index: torch.Tensor):
    """The forward's new indexer keys written into the paged rows (every token's before any is scored: a token reads
    no row past its own); returns its queries and head weights."""
    q, k, w = scoring_inputs(indexer, bound.arguments)
    keys.index_copy_(0, write_index[: k.shape[0]], k.to(keys.dtype))
    return q, w


def _pick(indexer, q, w, keys, source, first, lens, width: int) -> torch.Tensor:
    """Each token's top-k of its own rows (``source[first + j]``, ``j < lens``) as positions in the step's read
    indices, -1 past its rows (what the model's top-k of its masked scores gives)."""
    scores = index_scores.scores(q, w, keys, source, first, lens, width, indexer.softmax_scale)
    local = scores.topk(min(indexer.index_topk, width), dim=-1).indices
    return torch.where(local < lens[:, None], first[:, None] + local, -1)


def _per_request(value, tokens: torch.Tensor, g: int, q: int):
    """A packed ``[..., 1, T, d]`` argument (or a tuple of them: rotary cos and sin) as ``[..., G, q, d]``."""
    if isinstance(value, tuple):
        return tuple(_per_request(v, tokens, g, q) for v in value)
    picked = value.index_select(-2, tokens)
    return picked.view(*value.shape[:-3], g, q, value.shape[-1])
