"""CPU stand-ins for FlashInfer's MLA kernels, for tests that cannot run a GPU.

`FakeMLAModule` has the call signatures of FlashInfer 0.7.4's generated fa2/fa3 module
(``csrc/batch_mla_binding.cu``, as ``_fa_common._plan_generated_fa`` / ``_run_generated_fa`` call it), asserts what
it receives, stages the planned rows into the integer workspace it was given (as the native scheduler does) and
reads them back from the workspace it is run with, then computes exactly what the kernel computes, causal rule
included. `FakeRaggedPrefill` stands in for the ragged prefill wrapper of continuous batching's prefill chunks
(``kernels/ragged.py``) the same way. `fake_hopper` makes the package believe it runs on an SM90 GPU with those, in
float64 on the CPU, so whole models can be checked against ``eager`` to rounding.

`FakeTrtllm` stands in for ``flashinfer.mla.trtllm_batch_decode_with_kv_cache_mla`` (trtllm-gen, and cute-dsl for
head counts trtllm-gen cannot tile): it applies FlashInfer's documented contract and its own argument checks, then
computes the attention exactly (float64) through the packed pages and block tables it is given. `blackwell` /
`fake_blackwell` make the package believe it runs on an SM100 GPU with that kernel.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, field
from types import SimpleNamespace

import pytest

pytest.importorskip("flashinfer",
                    reason="these tests check the package against FlashInfer's own host code (full install)")

import flashinfer.mla
import flashinfer.utils
import torch
from flashinfer.mla._batch_mla._backends import _capabilities, _fa_common
from flashinfer.mla._batch_mla._backends.trtllm_gen_backend import _trtllm_gen_mla_incompatibility_reason
from flashinfer.utils import _resolve_trtllm_gen_multi_ctas_kv_counter_buffer

from hf_flashinfer_mla import buffers, capabilities
from hf_flashinfer_mla.kernels import fa, graphs, ragged

PLAN_INFO_LEN = 18  # MLAPlanInfo::ToVector


class FakeMLAModule:
    def __init__(self, backend: str):
        self.backend = backend
        self.plans: list[dict] = []
        self.runs = 0

    def plan_with_staged_workspace_bytes(self, float_ws, int_ws, scratch, *args):
        """FlashInfer's proxy: the native plan, then its staged bytes to the device workspace."""
        plan_info, staged = self.plan(float_ws, int_ws, scratch, *args)
        int_ws[:staged].copy_(scratch[:staged])
        return plan_info, staged

    def plan(self, float_ws, int_ws, scratch, qo_indptr, kv_indptr, kv_len, num_heads, head_dim_o, causal):
        """The native plan: validates its arguments and writes the "schedule" to the host `scratch` only."""
        for t in (qo_indptr, kv_indptr, kv_len):
            assert t.device.type == "cpu" and t.dtype == torch.int32 and t.is_contiguous()  # read on the host
        assert float_ws.dtype == torch.uint8 and int_ws.dtype == torch.uint8 and scratch.device.type == "cpu"
        assert isinstance(num_heads, int) and isinstance(head_dim_o, int) and isinstance(causal, bool)
        b = kv_len.numel()
        assert qo_indptr.numel() == kv_indptr.numel() == b + 1
        # Page size 1: sequence r's pages are kv_indices[kv_indptr[r] : kv_indptr[r] + kv_len[r]] (the kernel's
        # addressing: MLAPlan copies kv_indptr[r] into each work item and takes lengths from kv_len only), so the
        # offsets need not be compact and sequences may share pages (a graphed continuous-batching step's prefill
        # tokens read prefixes of their request's pages).
        assert all(s >= 0 for s in kv_indptr[:-1].tolist())
        plan_id = len(self.plans)
        self.plans.append(dict(qo_indptr=qo_indptr.clone(), kv_indptr=kv_indptr.clone(), kv_len=kv_len.clone(),
                               num_heads=num_heads, head_dim_o=head_dim_o, causal=causal,
                               scratch=scratch,  # kept alive: a scratch allocated per plan gets a new address
                               ahead=_called_from("plan_next")))  # planned ahead of its step (StepPlan.plan_next)
        staged = torch.cat([torch.tensor([b, plan_id], dtype=torch.int32), qo_indptr, kv_indptr, kv_len])
        assert scratch.numel() >= 4 * staged.numel() and int_ws.numel() >= 4 * staged.numel()
        scratch.view(torch.int32)[: staged.numel()] = staged
        q_tokens = int(qo_indptr[-1]) // max(b, 1)
        plan_info = [2 if q_tokens * num_heads > 64 else 1, 132] + [64 * i for i in range(PLAN_INFO_LEN - 2)]
        return plan_info, 4 * staged.numel()

    def run(self, float_ws, int_ws, plan_info, q_nope, q_pe, ckv, kpe, kv_indices, out, lse, mask_mode, num_heads,
            page_size, sm_scale, return_lse_base_on_e, ckv_scale, kpe_scale, ckv_scale_arr):
        self.runs += 1
        ws = int_ws.view(torch.int32)
        b, plan_id = int(ws[0]), int(ws[1])
        plan = self.plans[plan_id]  # the plan staged into *this* workspace
        qo_indptr, kv_indptr, kv_len = ws[2 : 3 + b], ws[3 + b : 4 + 2 * b], ws[4 + 2 * b : 4 + 3 * b]
        assert len(plan_info) == PLAN_INFO_LEN and float_ws.dtype == torch.uint8
        assert mask_mode == int(plan["causal"]) and num_heads == plan["num_heads"] == q_nope.shape[1]
        assert (page_size, lse, return_lse_base_on_e, ckv_scale, kpe_scale, ckv_scale_arr) == (1, None, False, 1.0,
                                                                                              1.0, None)
        assert q_nope.shape[0] == int(qo_indptr[-1]) and q_pe.shape[:2] == q_nope.shape[:2]
        assert ckv.dim() == kpe.dim() == 3 and ckv.shape[1] == kpe.shape[1] == 1
        assert out.shape == q_nope.shape and out.dtype == q_nope.dtype
        assert kv_indices.dtype == torch.int32
        assert kv_indices.numel() >= max((kv_indptr[:-1] + kv_len).tolist(), default=0)
        for r in range(b):
            q0, q1, k0, n = int(qo_indptr[r]), int(qo_indptr[r + 1]), int(kv_indptr[r]), int(kv_len[r])
            pages = kv_indices[k0 : k0 + n].long()
            lat, pe = ckv[pages, 0], kpe[pages, 0]
            scores = (torch.einsum("qhl,kl->qhk", q_nope[q0:q1], lat)
                      + torch.einsum("qhr,kr->qhk", q_pe[q0:q1], pe)) * sm_scale
            if plan["causal"]:  # query i of q sees the first n - q + i + 1 keys of its request
                i = torch.arange(q1 - q0)[:, None, None]
                scores = scores.masked_fill(torch.arange(n)[None, None, :] > n - (q1 - q0) + i, float("-inf"))
            out[q0:q1] = torch.einsum("qhk,kl->qhl", torch.softmax(scores, -1).nan_to_num(0.0), lat)


class FakeRaggedPrefill:
    """FlashInfer 0.7.4's ``BatchPrefillWithRaggedKVCacheWrapper`` as ``kernels/ragged.py`` calls it: plan on host
    indptrs (int32, the query tokens' and the key rows' offsets of each request), run on packed ``q [N, H, qk]``,
    ``k [M, H, qk]``, ``v [M, H, vo]`` with any row and head strides, causal bottom-right aligned (query ``i`` of a
    request with ``q`` tokens over ``k`` rows sees rows ``0 .. k - q + i``), as the fa3 kernel computes it."""

    instances: list = []

    def __init__(self, float_workspace, kv_layout="NHD", backend="auto"):
        assert float_workspace.dtype == torch.uint8 and kv_layout == "NHD" and backend == "fa3"
        self.plans: list[dict] = []
        self.runs = 0
        FakeRaggedPrefill.instances.append(self)

    def plan(self, qo_indptr, kv_indptr, num_qo_heads, num_kv_heads, head_dim_qk, head_dim_vo, causal=False,
             sm_scale=None, q_data_type=None, kv_data_type=None, o_data_type=None):
        for t in (qo_indptr, kv_indptr):
            assert t.device.type == "cpu" and t.dtype == torch.int32  # host lengths: no sync
        assert num_qo_heads == num_kv_heads and causal is True and isinstance(sm_scale, float)
        assert bool((qo_indptr.diff() <= kv_indptr.diff()).all())  # a chunk sees at least itself
        self.plans.append(dict(qo_indptr=qo_indptr.clone(), kv_indptr=kv_indptr.clone(), heads=num_qo_heads,
                               dims=(head_dim_qk, head_dim_vo), scale=sm_scale, dtype=q_data_type))

    def run(self, q, k, v):
        self.runs += 1
        plan = self.plans[-1]
        qo, kv = plan["qo_indptr"].tolist(), plan["kv_indptr"].tolist()
        assert q.shape == (qo[-1], plan["heads"], plan["dims"][0]) and k.shape[:2] == v.shape[:2] == (kv[-1],
                                                                                                 plan["heads"])
        assert k.shape[-1] == plan["dims"][0] and v.shape[-1] == plan["dims"][1]
        assert q.stride(-1) == k.stride(-1) == v.stride(-1) == 1 and q.dtype == k.dtype == v.dtype == plan["dtype"]
        out = q.new_empty(q.shape[0], q.shape[1], v.shape[-1])
        for q0, q1, k0, k1 in zip(qo, qo[1:], kv, kv[1:]):
            scores = torch.einsum("qhd,khd->hqk", q[q0:q1], k[k0:k1]) * plan["scale"]
            n, m = q1 - q0, k1 - k0
            hidden = torch.arange(m)[None, :] > (m - n) + torch.arange(n)[:, None]
            scores = scores.masked_fill(hidden, float("-inf"))
            out[q0:q1] = torch.einsum("hqk,khd->qhd", torch.softmax(scores, -1), v[k0:k1])
        return out


class FakeMLAWrapper:
    """FlashInfer 0.7.4's public ``BatchMLAPagedAttentionWrapper`` as ``kernels/fa.py`` plans and runs it (releases
    whose generated module it does not call, ``HF_FLASHINFER_MLA_FA_PLANNER=wrapper``): ``plan`` takes compact CSR
    metadata (explicit page indices, page size 1, split layouts) and FlashInfer's own workload validator, which may
    decline the plan as the real wrapper does; ``run`` computes it with a `FakeMLAModule` of its own. Every plan is
    recorded (``plans``) and every instance (``instances``)."""

    instances: list = []

    def __init__(self, float_workspace_buffer, use_cuda_graph=False, *, backend, **graph_buffers):
        assert backend in ("fa3", "fa2") and float_workspace_buffer.dtype == torch.uint8
        self.backend, self.module = backend, FakeMLAModule(backend)
        self.plans: list = []
        self.runs = 0
        FakeMLAWrapper.instances.append(self)

    def plan(self, *, metadata, num_heads, head_dim_ckv, head_dim_kpe, page_size, causal, sm_scale, q_data_type,
             kv_data_type, query_layout, kv_cache_layout, scale_mode="default"):
        assert (page_size, query_layout, kv_cache_layout, scale_mode) == (1, "split", "split", "default")
        assert q_data_type == kv_data_type and (head_dim_ckv, head_dim_kpe) == tuple(capabilities.KERNEL_DIMS)
        assert int(metadata.kv_indptr[-1]) == metadata.kv_indices.numel()  # compact CSR, explicit indices
        _fa_common._validate_fa_plan_workload(metadata.qo_indptr, metadata.kv_len_arr, num_heads, causal,
                                              metadata.kv_indices.device, self.backend, kv_data_type)
        nbytes = 4 * (3 * metadata.kv_len_arr.numel() + 8)
        self.workspace = torch.zeros(nbytes, dtype=torch.uint8)
        self.info, _ = self.module.plan_with_staged_workspace_bytes(
            self.workspace, self.workspace, torch.zeros(nbytes, dtype=torch.uint8), metadata.qo_indptr,
            metadata.kv_indptr, metadata.kv_len_arr, num_heads, head_dim_ckv, causal)
        self.kv_indices, self.scale, self.causal = metadata.kv_indices, sm_scale, causal
        self.plans.append(metadata)

    def run(self, *, query, kv_cache):
        self.runs += 1
        out = torch.empty_like(query[0])
        self.module.run(self.workspace, self.workspace, self.info, *query, *kv_cache, self.kv_indices, out, None,
                        int(self.causal), query[0].shape[1], 1, self.scale, False, 1.0, 1.0, None)
        return out


def _called_from(function: str) -> bool:
    frame = sys._getframe(1)
    while frame is not None and frame.f_code.co_name != function:
        frame = frame.f_back
    return frame is not None


class FakeSurface(SimpleNamespace):
    """What `kernels.fa.generated_surface` returns, with FlashInfer's real workload validator on a pretend
    132-SM Hopper (its causal tile bound and work-item capacity are plain Python)."""


def make_surface(validate_workload=None) -> FakeSurface:
    modules: dict[str, FakeMLAModule] = {}
    static_calls = []

    def get_module(backend, dtype_q, dtype_kv, dtype_o, dtype_idx, head_dim_ckv, head_dim_kpe, use_profiler):
        assert dtype_q == dtype_kv == dtype_o and dtype_idx == torch.int32 and use_profiler is False
        return modules.setdefault(backend, FakeMLAModule(backend))

    def validate_static(**kwargs):
        static_calls.append(kwargs)

    return FakeSurface(
        get_module=get_module,
        native=lambda module: module,
        validate_static=validate_static,
        validate_workload=validate_workload or _fa_common._validate_fa_plan_workload,
        refused=_capabilities._BackendPlanUnsupportedError,
        modules=modules,
        static_calls=static_calls,
    )


def fresh_caches() -> None:
    """The package's process caches as a fresh process has them (CUDA-graph slots and routes, FlashInfer's
    generated modules, device buffers); torch's compiled code is kept, which no CUDA graph ties to them on the CPU."""
    graphs.reset()
    fa.reset()
    buffers.reset()


@pytest.fixture
def fake_hopper(monkeypatch):
    """The package sees an SM90 GPU whose fa3/fa2 kernels are `FakeMLAModule`, for the test models' float64
    latent; FlashInfer's host-side validators see 132 SMs and an H100's shared memory."""
    import transformers

    surface = make_surface()
    monkeypatch.setattr(capabilities, "device_capability", lambda device: (9, 0))
    monkeypatch.setattr(capabilities, "KERNEL_DTYPES", (torch.float64,))
    monkeypatch.setattr(capabilities, "KERNEL_DIMS", (32, 8))  # the helpers' deepseek_v3 latent
    monkeypatch.setattr(fa, "generated_surface", lambda: surface)
    monkeypatch.setattr(fa, "INT_WORKSPACE_BYTES", 1 << 16)
    monkeypatch.setattr(buffers, "WORKSPACE_BYTES", 1 << 16)
    fresh_caches()
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda d: SimpleNamespace(multi_processor_count=132))
    monkeypatch.setattr(_fa_common, "get_device_sm_count", lambda device: 132)
    monkeypatch.setattr(_fa_common, "_get_fa_shared_memory_limits", lambda device: (233472, 232448))
    monkeypatch.delenv(fa.PLANNER_ENV, raising=False)
    monkeypatch.setattr(ragged, "wrapper_class", lambda: FakeRaggedPrefill)
    monkeypatch.setattr(ragged, "supported_dims", lambda qk, vo: True)  # the test models' small head dims
    monkeypatch.setattr(FakeRaggedPrefill, "instances", [])
    surface.ragged = FakeRaggedPrefill.instances
    transformers.utils.logging.warning_once.cache_clear()
    yield surface
    fresh_caches()  # (CUDA-graph slots of the stand-in's kernels would be reloaded by a later test's steps)


# ---------------------------------------------------------------------------------- trtllm-gen and cute-dsl (SM100)
SM_COUNT = 148  # a B200


@dataclass
class FakeTrtllm:
    """``flashinfer.mla.trtllm_batch_decode_with_kv_cache_mla`` on the CPU.

    It takes exactly the keywords the package passes (any other is a TypeError) and asserts FlashInfer's contract:
    ``query [B, Sq, H, L + R]``; ``kv_cache`` the *packed* paged cache ``[pages, page_size, L + R]`` (one row per
    token, latent then rope); ``block_tables [B, pages]`` and ``seq_lens [B]`` int32; ``max_seq_len`` a Python int
    bounding the lengths; ``bmm1_scale`` a Python float (a captured graph holds it as a constant); ``backend="auto"``
    with a caller-owned uint8 ``multi_ctas_kv_counter_buffer`` that FlashInfer's own check accepts (trtllm-gen
    counts in it), or ``backend="cute-dsl"`` with none (FlashInfer raises if one is given). Then it computes the
    attention of each sequence over the first ``seq_lens[b]`` rows of its pages, causal over the step's query
    tokens, in float64. Each call is recorded (`calls`), with copies of its tables and lengths and the counter
    tensor itself (held, so that a buffer allocated anew per call could not reuse a freed address)."""

    sm_count: int = SM_COUNT
    calls: list = field(default_factory=list)

    def __call__(self, *, query, kv_cache, workspace_buffer, qk_nope_head_dim, kv_lora_rank, qk_rope_head_dim,
                 block_tables, seq_lens, max_seq_len, bmm1_scale, bmm2_scale, backend,
                 multi_ctas_kv_counter_buffer=None, sparse_mla_top_k=0):
        assert query.dim() == 4, query.shape
        b, sq, h, width = query.shape
        for value in (qk_nope_head_dim, kv_lora_rank, qk_rope_head_dim, max_seq_len):
            assert type(value) is int, value
        assert width == kv_lora_rank + qk_rope_head_dim
        # The packed paged cache: [pages, page_size, L + R], rows adjacent, one page after the other.
        assert kv_cache.dim() == 3 and kv_cache.shape[1] in (32, 64) and kv_cache.shape[2] == width, kv_cache.shape
        page = kv_cache.shape[1]
        assert kv_cache.stride() == (page * width, width, 1), kv_cache.stride()
        assert kv_cache.dtype == query.dtype and kv_cache.device == query.device
        assert query.dtype != torch.float16, "FlashInfer's trtllm-gen MLA writes a bfloat16 output"
        assert workspace_buffer.dtype == torch.uint8 and workspace_buffer.is_contiguous()
        assert workspace_buffer.device == query.device
        if sparse_mla_top_k:
            return self._sparse(query, kv_cache, block_tables, seq_lens, max_seq_len, bmm1_scale, bmm2_scale, backend,
                                multi_ctas_kv_counter_buffer, sparse_mla_top_k, kv_lora_rank)
        assert block_tables.dtype == torch.int32 and block_tables.dim() == 2 and block_tables.shape[0] == b
        assert seq_lens.dtype == torch.int32 and seq_lens.shape == (b,)
        assert block_tables.device == seq_lens.device == query.device
        lens = seq_lens.tolist()
        assert all(n >= sq for n in lens) and max_seq_len >= max(lens), (lens, max_seq_len)
        assert all(-(-n // page) <= block_tables.shape[1] for n in lens), (lens, block_tables.shape)
        # FlashInfer 0.7.4 (flashinfer/mla/_utils.py, for backend "auto" and "cute-dsl"): 128 rows' worth of pages.
        assert block_tables.shape[1] % (128 // page) == 0, f"block_num {block_tables.shape[1]}, block_size {page}"
        assert type(bmm1_scale) is float and type(bmm2_scale) is float and bmm2_scale == 1.0
        counter = multi_ctas_kv_counter_buffer
        eligible = _trtllm_gen_mla_incompatibility_reason(num_heads_q=h, block_size=page) is None
        if backend == "cute-dsl" or (backend == "auto" and not eligible):
            if counter is not None:  # what FlashInfer 0.7.4 raises
                raise ValueError("multi_ctas_kv_counter_buffer is only supported when a trtllm-gen runner is selected")
        elif backend == "auto":
            # The package's side of the contract: its own zero-once buffer, never FlashInfer's per-call allocation.
            assert counter is not None, "trtllm-gen must be given the package's counter buffer"
            assert counter.dtype == torch.uint8 and counter.dim() == 1
            _resolve_trtllm_gen_multi_ctas_kv_counter_buffer(counter, b * sq, h, self.sm_count, query.device)
        else:
            raise AssertionError(f"unexpected backend {backend!r}")
        # The pages each sequence reads: inside the cache, none twice in a sequence (sequences may share pages:
        # continuous batching's shared prefixes, the padding rows of its CUDA graphs).
        read = [block_tables[i, : -(-n // page)].long() for i, n in enumerate(lens)]
        everything = torch.cat(read)
        assert bool(((everything >= 0) & (everything < kv_cache.shape[0])).all()), block_tables
        assert all(r.unique().numel() == r.numel() for r in read), block_tables
        self.calls.append(dict(
            backend=backend, counter=counter, heads=h, batch=b, q_len=sq, tables=block_tables.clone(),
            seq_lens=seq_lens.clone(), max_seq_len=max_seq_len, tables_ptr=block_tables.data_ptr(),
            seq_lens_ptr=seq_lens.data_ptr(), kv_storage=kv_cache.untyped_storage().data_ptr(),
            pages=kv_cache.shape[0], scale=bmm1_scale))
        out = torch.empty(b, sq, h, kv_lora_rank, dtype=torch.float64)
        for i, n in enumerate(lens):
            kv = kv_cache[read[i]].reshape(-1, width)[:n].double()  # [n, L + R]
            scores = torch.einsum("qhd,kd->hqk", query[i].double(), kv) * bmm1_scale
            visible = torch.arange(n)[None, :] <= torch.arange(n - sq, n)[:, None]  # [Sq, n]
            probs = scores.masked_fill(~visible, float("-inf")).softmax(-1)
            out[i] = torch.einsum("hqk,kd->qhd", probs, kv[:, :kv_lora_rank])
        return out.to(query.dtype)


    def _sparse(self, query, kv_cache, block_tables, seq_lens, max_seq_len, bmm1_scale, bmm2_scale, backend, counter,
                topk, kv_lora_rank):
        """Sparse MLA (``sparse_mla_top_k``, DeepSeek-V3.2 / GLM-5), as vLLM's FlashInfer sparse backend calls it:
        ``block_tables [B, Sq, topk]`` int32 flat cache slots (``page * page_size + offset``), each query token's
        selection, `topk` a multiple of 4 wide; a token attends to the first ``min(seq_lens[b], topk)`` of them,
        which must all be slots (-1 only after them); no causal rule (the selection is the token's own)."""
        b, sq, h, width = query.shape
        assert type(topk) is int and block_tables.shape == (b, sq, topk) and block_tables.dtype == torch.int32
        assert topk % 4 == 0, f"SparseMlaTopK must be a multiple of 4 (FlashInfer's C++ launcher; got {topk})"
        assert seq_lens.dtype == torch.int32 and seq_lens.shape == (b,) and max_seq_len >= int(seq_lens.max())
        assert type(bmm1_scale) is float and bmm2_scale == 1.0 and backend == "auto" and counter is not None
        _resolve_trtllm_gen_multi_ctas_kv_counter_buffer(counter, b * sq, h, self.sm_count, query.device)
        slots = kv_cache.shape[0] * kv_cache.shape[1]
        read = torch.arange(topk) < seq_lens.clamp(max=topk).long()[:, None, None]  # [B, 1, topk]
        assert bool((block_tables[read.expand_as(block_tables)] >= 0).all()), "a -1 among the slots seq_lens reads"
        assert bool((block_tables < slots).all()) and bool((seq_lens > 0).all())
        flat = kv_cache.reshape(slots, width)
        self.calls.append(dict(backend=backend, counter=counter, heads=h, batch=b, q_len=sq, sparse=topk,
                               tables=block_tables.clone(), seq_lens=seq_lens.clone(), scale=bmm1_scale))
        out = torch.empty(b, sq, h, kv_lora_rank, dtype=torch.float64)
        for i in range(b):
            for t in range(sq):
                kv = flat[block_tables[i, t][read[i, 0]].long()].double()
                probs = (torch.einsum("hd,kd->hk", query[i, t].double(), kv) * bmm1_scale).softmax(-1)
                out[i, t] = probs @ kv[:, :kv_lora_rank]
        return out.to(query.dtype)


def blackwell(monkeypatch, dtype=torch.float64, dims=(32, 8), sm_count=SM_COUNT) -> FakeTrtllm:
    """Make the package see an SM100 GPU (any device) whose trtllm-gen/cute-dsl kernel is a `FakeTrtllm`, for
    `dtype` and latent `dims`; with fresh device buffers, graph slots and captured routes."""
    kernel = FakeTrtllm(sm_count)
    monkeypatch.setattr(capabilities, "device_capability", lambda device: (10, 0))
    monkeypatch.setattr(capabilities, "KERNEL_DTYPES", (dtype,))
    monkeypatch.setattr(capabilities, "KERNEL_DIMS", tuple(dims))
    monkeypatch.setattr(capabilities, "_flashinfer_import_error", lambda: None)
    monkeypatch.setattr(flashinfer.mla, "trtllm_batch_decode_with_kv_cache_mla", kernel)
    monkeypatch.setattr(flashinfer.utils, "get_device_sm_count", lambda device: sm_count)
    monkeypatch.setattr(buffers, "WORKSPACE_BYTES", 1 << 16)
    fresh_caches()
    return kernel


@pytest.fixture
def fake_blackwell(monkeypatch):
    """`blackwell` for the helpers' float64 models (latent 32 + rope 8)."""
    yield blackwell(monkeypatch)
    fresh_caches()  # (CUDA-graph slots of the stand-in's kernel would be reloaded by a later test's steps)
