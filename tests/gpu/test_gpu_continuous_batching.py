"""Continuous batching's paged decode on FlashInfer's fa3/fa2 (an H200), against the reference backend (bf16).

Run with ``python -m pytest -q tests/gpu/test_gpu_continuous_batching.py -s``. Without CUDA the same tests run on the
CPU stand-ins (``gpu_suite.py``), but for Transformers' CUDA graphs (``tests/test_continuous_batching_graphs.py``
emulates them on the CPU).

* kernel level: one step of decodes mixed with prefill chunks, its rows scattered over a paged cache, at 16 and 128
  heads, through FlashInfer's generated module and through its public wrapper (``HF_FLASHINFER_MLA_FA_PLANNER``);
  a control with the wrong softmax scale must fail the bound;
* prefill chunks on FlashInfer's fa3 ragged prefill (query/key 192, value 128) against SDPA per request, chunks after
  a cached past included, at 16 and 128 heads, in one launch and in several groups; a control with the wrong softmax
  scale must fail the bound;
* model level: ``generate_batch`` of a DeepSeek-V3-shaped model (512 + 64 latent) on the kernels (decode and
  ragged prefill) against the same loop on the reference backend and SDPA, with both kernels observed to run.
"""

from __future__ import annotations

import logging

import pytest
import torch
import transformers
from gpu_suite import CUDA, DEV, DTYPE, RANK, ROPE, ROUNDING, kernel_backend, needs_cuda, sized
from transformers import ContinuousBatchingConfig, GenerationConfig

import hf_flashinfer_mla  # noqa: F401
from hf_flashinfer_mla import capabilities, paged_attention
from hf_flashinfer_mla.kernels import fa, ragged

KERNEL_TOL = 2e-2 if CUDA else ROUNDING  # bf16 operands, as tests/gpu/test_gpu_backends.py


def _available(backend, heads):
    reason = capabilities.unavailable_reason(backend, DEV, DTYPE, RANK, ROPE, heads)
    if reason:
        pytest.skip(f"{backend}: {reason}")


def rel(a, b):
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def _mixed_step(heads, seed=0):
    g = torch.Generator(device=DEV).manual_seed(seed)
    rows = 8192
    cache = torch.randn(rows, 1, RANK + ROPE, generator=g, device=DEV, dtype=DTYPE)
    kv, rot = cache[:, :, :RANK].transpose(0, 1)[None], cache[:, :, RANK:].transpose(0, 1)[None]
    q_lens = torch.tensor([1, 37, 1, 1, 200, 1, 1])
    k_lens = torch.tensor([900, 37, 1, 2048, 700, 17, 333])
    table = torch.randperm(rows, generator=g, device=DEV)[: int(k_lens.sum())]
    n = int((q_lens == 1).sum())
    q_lat = torch.randn(heads, n, RANK, generator=g, device=DEV, dtype=DTYPE)
    q_pe = torch.randn(n, heads, ROPE, generator=g, device=DEV, dtype=DTYPE)
    return q_lens, k_lens, table, q_lat, q_pe, kv, rot


def _run(backend, heads, case, scale):
    q_lens, k_lens, table, q_lat, q_pe, kv, rot = case
    step = paged_attention.PagedStep(q_lens, k_lens, int(q_lens.sum()))
    step.start(table)
    route = step.route(backend, step.layer_of(q_lat, kv, rot, scale), backend, False)
    assert route.backend == backend
    return route.run(q_lat, q_pe, kv, rot)


@pytest.mark.parametrize("planner", ["generated", "wrapper"])
@pytest.mark.parametrize("heads", [16, 128])
@pytest.mark.parametrize("backend", ["fa3", "fa2"])
def test_paged_decode_kernel_against_reference(backend, heads, planner, monkeypatch):
    _available(backend, heads)
    if planner == "wrapper":
        monkeypatch.setenv(fa.PLANNER_ENV, "wrapper")
    else:
        monkeypatch.delenv(fa.PLANNER_ENV, raising=False)
    case = _mixed_step(heads)
    scale = 192**-0.5
    ref = _run("reference", heads, case, scale)
    out = _run(backend, heads, case, scale)
    err = rel(out, ref)
    print(f"{backend} {planner} heads={heads}: rel err {err:.2e}")
    assert err < KERNEL_TOL
    assert rel(_run(backend, heads, case, scale * 1.5), ref) > KERNEL_TOL  # the bound catches a wrong scale


def _prefill(module, case, requested, scale):
    """`paged_attention._prefill` of one step (its decode requests left out) on `requested`'s prefill path."""
    from types import SimpleNamespace

    q_lens, k_lens, table, query, kv, rot = case
    step = paged_attention.PagedStep(q_lens, k_lens, int(q_lens.sum()))
    out = query.new_zeros(1, query.shape[2], query.shape[1], module.v_head_dim)
    cache = SimpleNamespace(prefill_wrappers=ragged.Wrappers())
    paged_attention._prefill(cache, step, step.decode, module, query, kv, rot, table, scale, requested, out)
    return out, step


@pytest.mark.parametrize("grouped", [False, True])
@pytest.mark.parametrize("heads", [16, 128])
def test_ragged_prefill_against_sdpa(heads, grouped, monkeypatch):
    if capabilities.device_capability(DEV) != (9, 0):
        pytest.skip("fa3 ragged prefill needs SM90")
    _available("fa3", heads)
    model = _v3_shaped("flashinfer_mla", heads=heads)
    module = next(m for m in model.modules() if hasattr(m, "kv_b_proj"))
    g = torch.Generator(device=DEV).manual_seed(2)
    q_lens = torch.tensor([37, 1, 200, 64, 1, 512])
    k_lens = torch.tensor([37, 900, 700, 1000, 17, 512])  # chunks after a past (200 of 700, 64 of 1000) and alone
    rows = 8192
    cache = torch.randn(rows, 1, RANK + ROPE, generator=g, device=DEV, dtype=DTYPE)
    kv, rot = cache[:, :, :RANK].transpose(0, 1)[None], cache[:, :, RANK:].transpose(0, 1)[None]
    table = torch.randperm(rows, generator=g, device=DEV)[: int(k_lens.sum())]
    query = torch.randn(1, heads, int(q_lens.sum()), module.qk_head_dim, generator=g, device=DEV, dtype=DTYPE)
    case = (q_lens, k_lens, table, query, kv, rot)
    if grouped:
        monkeypatch.setattr(ragged, "EXPANDED_BYTES", 1)  # every request a launch of its own
    scale = 192**-0.5
    ref, _ = _prefill(module, case, "reference", scale)
    out, step = _prefill(module, case, "fa3", scale)
    (groups,) = step.prefill_groups.values()
    assert len(groups) == (4 if grouped else 1), "the ragged prefill did not plan"
    prefill_tokens = torch.cat([torch.arange(int(a), int(a + n)) for a, n in zip(step.cu_q, q_lens) if n > 1])
    err = rel(out[:, prefill_tokens], ref[:, prefill_tokens])
    print(f"fa3 ragged prefill heads={heads} grouped={grouped}: rel err {err:.2e}")
    assert err < KERNEL_TOL
    wrong, _ = _prefill(module, case, "fa3", scale * 1.5)
    assert rel(wrong[:, prefill_tokens], ref[:, prefill_tokens]) > KERNEL_TOL  # the bound catches a wrong scale


def _v3_shaped(attn, heads=16):
    config = transformers.DeepseekV3Config(**sized(
        vocab_size=512, hidden_size=1024, intermediate_size=1024, moe_intermediate_size=256, num_hidden_layers=2,
        num_attention_heads=heads, num_key_value_heads=heads, n_routed_experts=4, num_experts_per_tok=2, n_group=1,
        topk_group=1, first_k_dense_replace=2, kv_lora_rank=512, q_lora_rank=256, qk_rope_head_dim=64,
        qk_nope_head_dim=128, v_head_dim=128, max_position_embeddings=4096, eos_token_id=None, pad_token_id=0,
    ))
    torch.manual_seed(0)
    return transformers.DeepseekV3ForCausalLM._from_config(config, attn_implementation=attn, dtype=DTYPE).to(DEV).eval()


def test_generate_batch_on_kernel_against_reference(monkeypatch):
    backend = kernel_backend()
    _available(backend, 16)
    model = _v3_shaped("flashinfer_mla")
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(1, 512, (n,), generator=g).tolist() for n in (5, 300, 17, 1200, 64, 9, 700, 33)]
    gen = GenerationConfig(max_new_tokens=24, do_sample=False, eos_token_id=-1, pad_token_id=0)
    cb = ContinuousBatchingConfig(page_size=64, num_blocks=256, max_batch_tokens=512, max_requests_per_batch=8)
    runs, prefills = [], []
    original, original_prefill = fa.run, ragged.run
    monkeypatch.setattr(fa, "run", lambda *a, **k: runs.append(1) or original(*a, **k))
    monkeypatch.setattr(ragged, "run", lambda *a, **k: prefills.append(1) or original_prefill(*a, **k))
    results = {}
    for requested in (backend, "reference"):
        monkeypatch.setenv("HF_FLASHINFER_MLA_BACKEND", requested)
        out = model.generate_batch(prompts, generation_config=gen, continuous_batching_config=cb)
        assert all(o.error is None for o in out.values())
        results[requested] = [o.generated_tokens for o in out.values()]
    assert runs, "the kernel never ran"
    assert prefills or backend != "fa3", "the ragged prefill never ran"
    same = sum(a == b for a, b in zip(results[backend], results["reference"]))
    first = sum(a[:4] == b[:4] for a, b in zip(results[backend], results["reference"]))
    print(f"{backend}: {same}/{len(prompts)} requests identical to the reference backend, {first} on 4 tokens")
    assert first >= len(prompts) - 1 and same >= len(prompts) // 2  # bf16 near-ties may split a few late tokens


@needs_cuda("Transformers' continuous-batching CUDA graphs captured and replayed "
            "(tests/test_continuous_batching_graphs.py emulates them on the CPU stand-ins)")
def test_generate_batch_in_cuda_graphs_against_reference(monkeypatch):
    """Continuous batching with Transformers' CUDA graphs on the kernel: each padded shape is captured once and
    replayed, its schedule reloaded before every replay, and the tokens agree with the reference backend (which
    runs without graphs) as the uncompiled kernel's do; again with every step admitted to the graphs
    (``paged_attention.graph_pays``), so that steps mixing prefill chunks with decodes replay, absorbed token by
    token. Control: with the reload skipped, replays run a stale schedule and the tokens change."""
    from transformers.generation.continuous_batching import input_outputs

    backend = kernel_backend()
    _available(backend, 16)
    model = _v3_shaped("flashinfer_mla")
    g = torch.Generator().manual_seed(2)
    prompts = [torch.randint(1, 512, (n,), generator=g).tolist() for n in (5, 300, 17, 1200, 64, 9, 700, 33)]
    new = [24, 9, 30, 16, 5, 27, 12, 20]  # requests finish at different steps: graphs replay other compositions
    graphed, keys, replays = [], [], []  # (requests, padded rows, mixed) per graphed step; captured keys; replays
    prepare, set_graph = paged_attention.prepare_step, input_outputs.ContinuousBatchingIOs.set_graph
    replay = torch.cuda.CUDAGraph.replay

    def prepare_step(io):
        prepare(io)
        step = next(iter(io.cache.cache_allocators.values())).step
        if step.graphed:
            graphed.append((step.requests, step.batch, bool((step.q_lens > 1).any())))

    monkeypatch.setattr(paged_attention, "prepare_step", prepare_step)
    # (keyed by the IO that captured it: asynchronous batching's two IO pairs capture a graph of each shape each)
    monkeypatch.setattr(input_outputs.ContinuousBatchingIOs, "set_graph",
                        lambda self, graph: keys.append((id(self), self._get_graph_key())) or set_graph(self, graph))
    monkeypatch.setattr(torch.cuda.CUDAGraph, "replay", lambda self: replays.append(1) or replay(self))

    def run(requested, graphs=True):
        monkeypatch.setenv("HF_FLASHINFER_MLA_BACKEND", requested)
        cb = ContinuousBatchingConfig(page_size=64, num_blocks=256, max_batch_tokens=512, max_requests_per_batch=8,
                                      q_padding_interval_size=8, use_cuda_graph=True if graphs else False)
        manager = model.init_continuous_batching(generation_config=GenerationConfig(
            do_sample=False, eos_token_id=-1, pad_token_id=0), continuous_batching_config=cb)
        manager.start()
        try:
            ids = [manager.add_request(p, max_new_tokens=n) for p, n in zip(prompts, new)]
            outs = {o.request_id: o for o in (manager.get_result(timeout=120) for _ in ids)}
        finally:
            manager.stop(block=True, timeout=60)
            model.destroy_cached_continuous_batching_manager()
        assert all(o.error is None for o in outs.values())
        return [outs[i].generated_tokens for i in ids]

    in_graphs = run(backend)
    assert keys and replays and len(set(keys)) == len(keys), "each shape is captured once by each IO"
    assert len(replays) > len(keys) and any(n < t for n, t, _ in graphed) and len({n for n, *_ in graphed}) >= 2
    uncompiled, reference = run(backend, graphs=False), run("reference")
    graphed.clear()
    with monkeypatch.context() as every_step:
        every_step.setattr(paged_attention, "graph_pays", lambda q_lens, k_lens: True)
        all_graphed = run(backend)
    assert any(mixed for *_, mixed in graphed)
    agree = [sum(a[:4] == b[:4] for a, b in zip(x, reference)) for x in (in_graphs, all_graphed, uncompiled)]
    print(f"{backend}: first 4 tokens as the reference's: in graphs {agree[0]}/8, every step in graphs {agree[1]}/8, "
          f"without {agree[2]}/8; {len(keys)} graphs, {len(replays)} replays")
    assert agree[0] >= len(prompts) - 1 and agree[1] >= len(prompts) - 1

    skipped = []
    from hf_flashinfer_mla.kernels import graphs as slots
    monkeypatch.setattr(slots.GraphSlot, "load", lambda self, step, staged=None: skipped.append(1))
    stale = run(backend)
    assert skipped and sum(a != b for a, b in zip(stale, in_graphs)) >= 2


def _served_sparse(model, monkeypatch):
    """For the sparse tests below: `run(backend)` serves 8 prompts of 5 to 1,200 tokens (24 new each) through
    ``generate_batch`` with every decode requested on `backend` and returns each request's tokens; `topks` collects
    the ``topk`` of every FlashInfer kernel call. On the CPU the long prompts are cut to 300 tokens (still several
    windows and selections long, and prefilled in chunks), which the stand-ins' prefill attends in seconds."""
    g = torch.Generator().manual_seed(1)
    lengths = [n if CUDA else min(n, 300) for n in (5, 300, 17, 1200, 64, 9, 700, 33)]
    prompts = [torch.randint(1, 4096, (n,), generator=g).tolist() for n in lengths]
    gen = GenerationConfig(max_new_tokens=24, do_sample=False, eos_token_id=-1, pad_token_id=0)
    cb = ContinuousBatchingConfig(page_size=64, num_blocks=256, max_batch_tokens=512, max_requests_per_batch=8)
    topks = []
    original = fa.run
    monkeypatch.setattr(fa, "run", lambda meta, layer, *a, **k: topks.append(layer.topk) or original(meta, layer, *a,
                                                                                                      **k))

    def run(requested):
        monkeypatch.setenv("HF_FLASHINFER_MLA_BACKEND", requested)
        out = model.generate_batch(prompts, generation_config=gen, continuous_batching_config=cb)
        assert all(o.error is None for o in out.values())
        return [o.generated_tokens for o in out.values()]

    return run, topks, prompts


def test_sparse_model_under_continuous_batching_on_kernel_against_reference(monkeypatch):
    """A DeepSeek-V3.2-shaped model (its attention and indexer dims, ``index_topk`` 48 so that these prompts drop
    rows) served by ``generate_batch``: decode on the kernel over each request's selected rows (pages of one row),
    against the same loop on the reference backend, compared on each request's first 4 tokens. At this shape (128
    heads, hidden 7168, random weights) bf16 kernels agree with the reference on ~0.92 of next tokens
    (tests/gpu/test_gpu_sparse.py), so greedy sequences part at near-ties, and how many agree on 4 tokens depends on the
    card (8 of 8 on an H100, 6 on an H200). The bound is a yardstick of the same run: the kernel against the reference
    with every row kept in both (no selection: the kernel's own numerics at this shape), less 2 requests (about 1.5
    standard deviations of a count of 8 at that rate). Control: the kernel keeping every row against the selecting
    reference agrees on fewer requests than the selecting kernel does, so the comparison sees the selection. (A
    selection inconsistent with the step's planned lengths is not a control here: the kernel would read past it.
    tests/test_continuous_batching_sparse.py has that one.)"""
    from test_gpu_sparse import _v32_model

    backend = kernel_backend()
    _available(backend, 128)
    model = _v32_model()
    model.set_attn_implementation("flashinfer_mla")
    run, topks, prompts = _served_sparse(model, monkeypatch)

    ours, reference = run(backend), run("reference")
    assert topks and set(topks) == {48}, "the sparse kernel never ran"
    same = sum(a == b for a, b in zip(ours, reference))
    first = sum(a[:4] == b[:4] for a, b in zip(ours, reference))
    for indexer in (layer.self_attn.indexer for layer in model.model.layers):
        indexer.index_topk = 10**6
    dense, dense_reference = run(backend), run("reference")
    dense_first = sum(a[:4] == b[:4] for a, b in zip(dense, reference))
    yardstick = sum(a[:4] == b[:4] for a, b in zip(dense, dense_reference))
    print(f"sparse {backend}: {same}/{len(prompts)} requests identical to the reference backend, {first} on 4 tokens; "
          f"yardstick (every row kept in both): {yardstick} on 4 tokens; control (every row kept in the kernel only): "
          f"{dense_first} on 4 tokens")
    assert first >= yardstick - 2
    assert dense_first < first


def _dots3_model():
    """dots3's layers at their attention dims: DSA layers as DeepSeek-V3.2's (128 heads, 512 + 64 latent, 64 indexer
    heads of 128, ``index_topk`` 48) and sliding-window layers of its own (64 heads, a 1024 + 64 latent, which no
    FlashInfer MLA kernel takes: the reference), a window of 64 tokens, a sliding layer first; dense MLPs."""
    cfg = transformers.Dots3NoteTextConfig(**sized(
        vocab_size=4096, hidden_size=2048, intermediate_size=1024, num_hidden_layers=4, num_attention_heads=128,
        num_key_value_heads=128, q_lora_rank=1536, kv_lora_rank=512, qk_rope_head_dim=64, qk_nope_head_dim=128,
        v_head_dim=128, head_dim=192, index_n_heads=64, index_head_dim=128, index_topk=48, sliding_window=64,
        swa_num_attention_heads=64, swa_num_key_value_heads=64, swa_q_lora_rank=1024, swa_kv_lora_rank=1024,
        swa_head_dim=256, swa_qk_nope_head_dim=192, swa_v_head_dim=128,
        layer_types=["sliding_attention", "indexed_attention", "sliding_attention", "indexed_attention"],
        mlp_layer_types=["dense"] * 4, max_position_embeddings=8192, initializer_range=0.05, eos_token_id=None,
        bos_token_id=None, pad_token_id=0,
    ))
    torch.manual_seed(0)
    return transformers.AutoModelForCausalLM.from_config(cfg, attn_implementation="flashinfer_mla",
                                                         dtype=DTYPE).to(DEV).eval()


def test_sliding_window_and_sparse_layers_under_continuous_batching_on_kernel_against_reference(monkeypatch,
                                                                                                 caplog):
    """A dots3-shaped model served by ``generate_batch`` with the kernel forced for the whole model
    (``$HF_FLASHINFER_MLA_BACKEND``, as a user forcing it for speed): its DSA layers decode on the kernel over each
    request's selected rows, its sliding-window layers, whose latent the kernel does not take, on the reference over
    each request's gathered window (prompts of 5 to 1,200 tokens against a window of 64) after one warning naming
    their dims, against the same loop with every layer on the reference, compared on each request's first 4 tokens.
    The bound is a yardstick of the same run, as for DeepSeek-V3.2 above: the kernel against the reference with
    every row kept in both, less 2 requests."""
    backend = kernel_backend()
    _available(backend, 128)
    model = _dots3_model()
    run, topks, prompts = _served_sparse(model, monkeypatch)
    caplog.set_level(logging.WARNING, logger="hf_flashinfer_mla")

    ours, reference = run(backend), run("reference")
    assert topks and set(topks) == {48}, "the sparse kernel never ran (and only the DSA layers may run it)"
    sliding = next(layer.self_attn for layer in model.model.layers if layer.self_attn.indexer is None)
    fell_back = [r.getMessage() for r in caplog.records if "cannot run layers" in r.getMessage()]
    assert fell_back == [f"flashinfer_mla: decode runs on the PyTorch reference backend because "
                         f"mla_backend={backend!r} cannot run layers of kv_lora_rank {sliding.kv_lora_rank} + rope "
                         f"{sliding.qk_rope_head_dim} (its kernels are built for {RANK} + {ROPE}); layers it can run "
                         "stay on it."]
    first = sum(a[:4] == b[:4] for a, b in zip(ours, reference))
    for layer in model.model.layers:
        if layer.self_attn.indexer is not None:
            layer.self_attn.indexer.index_topk = 10**6
    yardstick = sum(a[:4] == b[:4] for a, b in zip(run(backend), run("reference")))
    print(f"dots3 {backend}: {first}/{len(prompts)} requests agree with the reference backend on 4 tokens; "
          f"yardstick (every row kept in both): {yardstick}")
    assert first >= yardstick - 2
