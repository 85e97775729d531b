"""Where a continuous-batching step finds its requests' rows (``paged_cache.BlockRows``, ``PagedStep.launch``), on the
CPU.

Transformers lists every cached row of every request of a step in Python (``get_read_indices``), which grows with
the total context. For the latent cache it lists none; the step takes each request's blocks on the host and lays
its rows out on the device. Those rows must be exactly the ones Transformers would have listed, request by request,
however the cache got them: queued requests and chunked prefills, prefix sharing, forked sequences, and requests
offloaded to the CPU (or dropped and prefilled again) and restored into other blocks.
"""

from __future__ import annotations

import pytest
import torch
from transformers import GenerationConfig
from transformers.generation.continuous_batching.cache_allocators import FullAttentionCacheAllocator

from helpers import make_model
from hf_flashinfer_mla import paged_attention, paged_cache
from hf_flashinfer_mla.paged_cache import LatentAllocator, SlidingLatentAllocator
from test_continuous_batching import eager_tokens, greedy, prompts, small_cb

SHARED = prompts((12,), seed=5)[0]


def _transformers_rows(allocator, requests) -> torch.Tensor:
    """The step's rows as Transformers lists them: each request's read indices, in order."""
    rows = []
    for fs in requests:
        past = fs.state.position_offset - fs.query_length
        rows += FullAttentionCacheAllocator.get_read_indices(allocator, fs.state.request_id, past, fs.query_length)
    return torch.tensor(rows, dtype=torch.long)


@pytest.fixture
def compared(monkeypatch):
    """Every prepared step's rows, laid out from the block tables, against Transformers' read indices for the same
    requests; the steps compared, and those that differed."""
    seen = {"steps": 0, "differed": 0, "true_read_sizes": []}
    prepare = paged_attention.prepare_step

    def prepare_step(io):
        prepare(io)
        seen["true_read_sizes"].append(list(io.true_read_sizes))
        paged_attention.launch_steps(io.cache, None)  # (its forward would launch it: idempotent)
        for allocator in io.cache.cache_allocators.values():
            if type(allocator) is LatentAllocator and allocator.step.tables is not None:
                step = allocator.step
                seen["steps"] += 1
                want = _transformers_rows(allocator, io.requests_in_batch)
                if not torch.equal(allocator.rows[: want.numel()], want) or step.pages.end != want.numel():
                    seen["differed"] += 1

    monkeypatch.setattr(paged_attention, "prepare_step", prepare_step)
    return seen


def _served(model, batch, cb, **generation):
    out = model.generate_batch(batch, generation_config=greedy(**generation), continuous_batching_config=cb)
    assert [o.error for o in out.values()] == [None] * len(out)
    return [o.generated_tokens for o in out.values()]


SCENARIOS = {
    # requests queue, a 14-token prompt is prefilled in chunks after its cached past, decodes run beside chunks
    "queued-and-chunked": (prompts(), small_cb()),
    # later requests reuse a common prompt's cached blocks
    "shared-prefix": ([SHARED + tail for tail in prompts((3, 5, 2, 7), seed=6)],
                      small_cb(max_requests_per_batch=1, max_batch_tokens=32)),
    # a cache too small for every request at once: some are offloaded to the CPU and restored into other blocks
    "offloaded": (prompts((14, 13, 12, 11, 10, 9), seed=8), small_cb(num_blocks=12, cpu_offload_space=0.01)),
    # the same, dropped and prefilled again
    "soft-reset": (prompts((14, 13, 12, 11, 10, 9), seed=8), small_cb(num_blocks=12)),
}


class _HostTorch:
    """torch for Transformers' offloading manager on a host without pinned memory (its swap pool is pinned)."""

    def __getattr__(self, name):
        return getattr(torch, name)

    @staticmethod
    def empty(*args, pin_memory=False, **kwargs):
        return torch.empty(*args, **kwargs)


@pytest.fixture
def offloads(monkeypatch):
    """Requests offloaded (or dropped for a new prefill) when the cache is full: how many times."""
    from transformers.generation.continuous_batching import offloading_manager

    monkeypatch.setattr(offloading_manager, "torch", _HostTorch())
    counted = []
    offload = offloading_manager.OffloadingManager.offload_requests

    def offload_requests(self, *args, **kwargs):
        done = offload(self, *args, **kwargs)
        counted.append(done)
        return done

    monkeypatch.setattr(offloading_manager.OffloadingManager, "offload_requests", offload_requests)
    return counted


@pytest.mark.parametrize("scenario", list(SCENARIOS))
def test_rows_from_block_tables_are_transformers_read_indices(scenario, compared, offloads):
    model = make_model("deepseek_v3", dtype=torch.float32)
    batch, cb = SCENARIOS[scenario]
    got = _served(model, batch, cb)
    assert compared["steps"] > len(batch) and compared["differed"] == 0
    if scenario in ("offloaded", "soft-reset"):
        assert any(offloads)  # (the cache did run full)
    # Transformers listed no row of the latent layers: its read indices stayed empty on every step
    assert all(sizes == [0] for sizes in compared["true_read_sizes"])
    assert got == eager_tokens(model, batch)


def test_forked_sequences_read_their_parents_blocks(compared):
    """Several sequences per prompt: Transformers forks a prefilled prompt into children that share its full
    blocks and copy its last one (``top_k=1``: each child decodes the greedy tokens)."""
    model = make_model("deepseek_v3", dtype=torch.float32)
    batch = prompts((6, 9), seed=4)
    config = GenerationConfig(max_new_tokens=4, do_sample=True, top_k=1, eos_token_id=-1, pad_token_id=0,
                              num_return_sequences=3)
    out = model.generate_batch(batch, generation_config=config, continuous_batching_config=small_cb())
    assert len(out) == 6 and all(o.error is None for o in out.values())
    assert compared["steps"] > 0 and compared["differed"] == 0
    want = eager_tokens(model, batch, new_tokens=4)
    assert all(o.generated_tokens == want[batch.index(o.prompt_ids)] for o in out.values())


def test_transformers_read_indices_switch_gives_the_same_tokens(compared, monkeypatch):
    """The A/B switch (`paged_cache.ROWS_FROM_BLOCK_TABLES`): with it off, Transformers lists every row again, and
    the tokens are the same."""
    model = make_model("deepseek_v3", dtype=torch.float32)
    batch = prompts()
    with_tables = _served(model, batch, small_cb())
    monkeypatch.setattr(paged_cache, "ROWS_FROM_BLOCK_TABLES", False)
    compared["true_read_sizes"].clear()
    assert _served(model, batch, small_cb()) == with_tables == eager_tokens(model, batch)
    assert any(sizes[0] > 0 for sizes in compared["true_read_sizes"])  # (its indices were listed)


def test_a_wrong_block_in_the_rows_changes_the_tokens(compared, monkeypatch):
    """Control: rows laid out one block off (each request's blocks shifted by one where it has several) are caught
    by the comparison, and give other tokens than eager."""
    write = paged_cache.BlockRows.write

    def shifted(self, out, end, to_device):
        blocks = self.blocks.clone()
        starts = torch.cat([torch.zeros(1, dtype=torch.long), self.counts.cumsum(0)[:-1]])
        for start, count in zip(starts.tolist(), self.counts.tolist()):
            if count > 1:
                blocks[start : start + count] = blocks[start : start + count].roll(1)
        return write(paged_cache.BlockRows(blocks, *(getattr(self, f) for f in
                                                     ("counts", "k_lens", "page", "block_stride", "trash"))),
                     out, end, to_device)

    monkeypatch.setattr(paged_cache.BlockRows, "write", shifted)
    model = make_model("deepseek_v3", dtype=torch.float32)
    batch = prompts()
    got = _served(model, batch, small_cb())
    assert compared["differed"] > 0  # (the fault was injected)
    assert got != eager_tokens(model, batch)


def test_sliding_window_layers_keep_their_ring_indices():
    """A sliding-window layer's rows are its ring's few per request, which its allocator gathers: Transformers
    still lists those (bounded by the window), and its steps take no block tables."""
    assert SlidingLatentAllocator.get_read_indices is not LatentAllocator.get_read_indices
    assert SlidingLatentAllocator.block_rows(None, ["r"], torch.tensor([3])) is None
