"""Backend selection (`hf_flashinfer_mla.capabilities`) with the compute-capability query substituted: no CUDA call.
Also the fallback chain a declined step walks (`capabilities.fallbacks`), and the choice the compiled decode step
makes for each shape at run time (`compiled.route_in_graph`, which the graph op calls)."""

from __future__ import annotations

import logging

import pytest
pytest.importorskip("flashinfer",
                    reason="these tests check the package against FlashInfer's own host code (full install)")

import torch

import hf_flashinfer_mla
from fake_flashinfer import fake_hopper  # noqa: F401  (fixture)
from hf_flashinfer_mla import BackendUnavailableError, capabilities
from hf_flashinfer_mla.compiled import route_in_graph
from hf_flashinfer_mla.capabilities import (ENV_VAR, LOAD_ATTR, backend_and_reason, choose_backend, fallbacks,
                                            requested_backend)

GPU = torch.device("cuda", 0)
CPU = torch.device("cpu")
BF16 = torch.bfloat16
RANK, ROPE = 512, 64

# Import flashinfer once, before any test patches CUDA queries, so that the cached import check reflects this
# environment (flashinfer imports on a CPU-only machine).
assert capabilities._flashinfer_import_error() is None


@pytest.fixture(autouse=True)
def _no_env(monkeypatch):
    monkeypatch.delenv(ENV_VAR, raising=False)


@pytest.fixture
def capability(monkeypatch):
    """`capability((9, 0))` makes every device report that compute capability (None: not a GPU)."""
    calls = []

    def set_cc(cc):
        def fake(device):
            calls.append(device)
            return cc

        monkeypatch.setattr(capabilities, "device_capability", fake)
        return calls

    return set_cc


@pytest.fixture
def no_cuda(monkeypatch):
    """Any real CUDA query fails the test: the substituted capability function must be the only source."""

    def boom(*args, **kwargs):
        raise AssertionError("a CUDA query was made although device_capability is substituted")

    monkeypatch.setattr(torch.cuda, "get_device_capability", boom)
    monkeypatch.setattr(torch.cuda, "current_device", boom)
    monkeypatch.setattr(torch.cuda, "get_device_properties", boom)


def warnings_of(caplog):
    return [r for r in caplog.records if r.name == "hf_flashinfer_mla" and r.levelno >= logging.WARNING]


# ---------------------------------------------------------------------------------------------------- auto


@pytest.mark.parametrize(
    "cc, heads, expected",
    [
        ((9, 0), 128, "fa3"),
        ((9, 0), 16, "fa3"),
        ((8, 0), 128, "fa2"),
        ((8, 9), 128, "fa2"),
        ((8, 6), 16, "fa2"),
        ((12, 0), 128, "fa2"),
        ((10, 0), 128, "trtllm-gen"),
        ((10, 0), 16, "trtllm-gen"),
        ((10, 3), 128, "trtllm-gen"),
        ((10, 3), 16, "trtllm-gen"),
        ((10, 0), 96, "cute-dsl"),
        ((10, 0), 24, "cute-dsl"),
        ((10, 3), 96, "cute-dsl"),
    ],
)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_auto_picks_kernel_for_gpu(capability, no_cuda, caplog, cc, heads, expected, dtype):
    calls = capability(cc)
    caplog.set_level(logging.DEBUG, logger="hf_flashinfer_mla")
    if dtype == torch.float16 and expected in ("trtllm-gen", "cute-dsl"):
        # FlashInfer's trtllm-gen and cute-dsl MLA decode write bfloat16 only: float16 goes to fa2, with one warning.
        assert choose_backend(GPU, dtype, RANK, ROPE, heads) == "fa2"
        msgs = [r.getMessage() for r in warnings_of(caplog)]
        assert len(msgs) == 1 and "bfloat16 only" in msgs[0] and "fa2" in msgs[0]
        return
    assert choose_backend(GPU, dtype, RANK, ROPE, heads) == expected
    assert calls and all(d == GPU for d in calls)
    # A kernel was found: no fallback warning (only the cute-dsl routing note on untileable head counts).
    msgs = [r.getMessage() for r in warnings_of(caplog)]
    assert not any("reference" in m for m in msgs)
    if expected == "cute-dsl":
        assert len(msgs) == 1 and f"{heads} query heads" in msgs[0]
    else:
        assert msgs == []


def test_auto_cute_dsl_warns_once_per_head_count(capability, no_cuda, caplog):
    capability((10, 0))
    caplog.set_level(logging.WARNING, logger="hf_flashinfer_mla")
    for heads in (96, 96, 24, 24, 96, 16, 48, 64, 128):
        choose_backend(GPU, BF16, RANK, ROPE, heads)
    msgs = [r.getMessage() for r in warnings_of(caplog)]
    assert len(msgs) == 2 and "96 query heads" in msgs[0] and "24 query heads" in msgs[1]
    assert all("cute-dsl" in m for m in msgs)


def test_auto_explicit_requested_auto_equals_default(capability, no_cuda):
    capability((9, 0))
    assert choose_backend(GPU, BF16, RANK, ROPE, 128, requested="auto") == "fa3"


def _assert_reference_warns_once(caplog, call, *reason_parts):
    caplog.set_level(logging.WARNING, logger="hf_flashinfer_mla")
    assert call() == "reference"
    warns = warnings_of(caplog)
    assert len(warns) == 1, [r.getMessage() for r in warns]
    msg = warns[0].getMessage()
    assert "reference" in msg
    for part in reason_parts:
        assert part in msg, msg
    caplog.clear()
    assert call() == "reference"
    assert warnings_of(caplog) == [], "the fallback warning must be emitted once only"


def test_auto_cpu_falls_back_to_reference(capability, no_cuda, caplog):
    capability(None)
    _assert_reference_warns_once(caplog, lambda: choose_backend(CPU, BF16, RANK, ROPE, 128), "cpu")


def test_auto_cpu_with_real_capability_function(caplog, no_cuda):
    # The real device_capability must answer None for a CPU device without touching CUDA.
    assert capabilities.device_capability(CPU) is None
    _assert_reference_warns_once(caplog, lambda: choose_backend(CPU, torch.float32, 64, 16, 4), "cpu")


@pytest.mark.parametrize("cc", [(9, 0), (8, 0), (8, 9), (10, 0), (12, 0)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_auto_float_dtype_falls_back(capability, no_cuda, caplog, cc, dtype):
    capability(cc)
    _assert_reference_warns_once(
        caplog, lambda: choose_backend(GPU, dtype, RANK, ROPE, 128), str(dtype), "bfloat16 or float16"
    )


@pytest.mark.parametrize("cc, heads, dtype", [((10, 0), 96, torch.float32), ((10, 3), 24, torch.float64)])
def test_auto_blackwell_untileable_heads_float_dtype_warns_only_the_fallback(
    capability, no_cuda, caplog, cc, heads, dtype
):
    """On Blackwell with a head count trtllm-gen cannot tile, a float32 model still decodes on the reference backend:
    the one warning must say so, not claim that decoding goes to cute-dsl."""
    capability(cc)
    _assert_reference_warns_once(
        caplog, lambda: choose_backend(GPU, dtype, RANK, ROPE, heads), str(dtype), "bfloat16 or float16"
    )


@pytest.mark.parametrize("cc", [(9, 0), (8, 0), (10, 0)])
def test_auto_minicpm3_dims_fall_back(capability, no_cuda, caplog, cc):
    capability(cc)
    _assert_reference_warns_once(
        caplog, lambda: choose_backend(GPU, BF16, 256, 32, 40), "256 + 32", "kv_lora_rank 512"
    )


def test_auto_old_gpu_falls_back(capability, no_cuda, caplog):
    capability((7, 5))
    _assert_reference_warns_once(caplog, lambda: choose_backend(GPU, BF16, RANK, ROPE, 128), "7.5")


def test_fallback_warning_per_distinct_reason(capability, no_cuda, caplog):
    caplog.set_level(logging.WARNING, logger="hf_flashinfer_mla")
    capability((9, 0))
    assert choose_backend(GPU, torch.float32, RANK, ROPE, 128) == "reference"
    assert choose_backend(GPU, BF16, 256, 32, 128) == "reference"
    assert choose_backend(GPU, torch.float32, RANK, ROPE, 128) == "reference"
    msgs = [r.getMessage() for r in warnings_of(caplog)]
    assert len(msgs) == 2
    assert "float32" in msgs[0] and "256 + 32" in msgs[1]


@pytest.mark.parametrize(
    "device, cc, dtype, rank, rope, heads, expected",
    [
        (GPU, (9, 0), BF16, RANK, ROPE, 128, ("fa3", None)),
        (GPU, (10, 0), BF16, RANK, ROPE, 16, ("trtllm-gen", None)),
        (GPU, (10, 0), BF16, RANK, ROPE, 96, ("cute-dsl", "trtllm-gen cannot tile 96 query heads per device")),
        (CPU, None, BF16, RANK, ROPE, 16, ("reference", "it needs an NVIDIA GPU and the tensors are on cpu")),
        (GPU, (7, 5), BF16, RANK, ROPE, 16, ("reference", "no FlashInfer MLA kernel supports compute capability 7.5")),
        # fa3 refuses a float32 model, and so would fa2: Hopper has no second kernel to try.
        (GPU, (9, 0), torch.float32, RANK, ROPE, 16,
         ("reference", "its kernels take bfloat16 or float16 and the model runs in torch.float32")),
        (GPU, (8, 0), BF16, 256, 32, 40,
         ("reference", "its kernels are built for kv_lora_rank 512 + rope 64, this model has 256 + 32")),
    ],
)
def test_backend_and_reason(capability, no_cuda, caplog, device, cc, dtype, rank, rope, heads, expected):
    capability(cc)
    caplog.set_level(logging.WARNING, logger="hf_flashinfer_mla")
    assert backend_and_reason(device, dtype, rank, rope, heads) == expected
    assert warnings_of(caplog) == []  # it only answers; choose_backend is the one that warns
    assert backend_and_reason(device, dtype, rank, rope, heads, requested="reference") == ("reference", None)


def test_hopper_fallback_is_the_reference_not_fa2(capability, no_cuda, monkeypatch):
    """fa3 and fa2 fail for the same reasons; when fa3 cannot run, auto does not try fa2 (it would fail alike)."""
    capability((9, 0))
    asked = []
    real = capabilities.unavailable_reason

    def recording(backend, *args):
        asked.append(backend)
        return real(backend, *args)

    monkeypatch.setattr(capabilities, "unavailable_reason", recording)
    monkeypatch.setattr(capabilities, "_flashinfer_import_error", lambda: "flashinfer cannot be imported (test)")
    assert backend_and_reason(GPU, BF16, RANK, ROPE, 128) == ("reference", "flashinfer cannot be imported (test)")
    assert asked == ["fa3"]


# ---------------------------------------------------------------------------------------------------- forced


@pytest.mark.parametrize(
    "backend, cc, dtype, rank, rope, heads, fragments",
    [
        ("fa3", (8, 0), BF16, RANK, ROPE, 128, ["fa3", "Hopper", "8.0"]),
        ("fa3", (10, 0), BF16, RANK, ROPE, 128, ["fa3", "10.0"]),
        ("fa3", (12, 0), BF16, RANK, ROPE, 128, ["fa3", "12.0"]),
        ("fa2", (7, 5), BF16, RANK, ROPE, 128, ["fa2", "8.0 or newer", "7.5"]),
        ("fa2", (9, 0), torch.float32, RANK, ROPE, 128, ["float32", "bfloat16 or float16"]),
        ("fa3", (9, 0), torch.float64, RANK, ROPE, 128, ["float64"]),
        # Latent dims the kernels do not take beside a reason of the machine or dtype: the request fails, naming
        # what no layer could run it with.
        ("fa3", (8, 0), BF16, 1024, 64, 64, ["fa3", "Hopper", "8.0"]),
        ("fa2", (9, 0), torch.float32, 256, 32, 40, ["float32"]),
        ("trtllm-gen", (9, 0), BF16, RANK, ROPE, 128, ["trtllm-gen", "SM100/SM103", "9.0"]),
        ("trtllm-gen", (12, 0), BF16, RANK, ROPE, 128, ["trtllm-gen", "12.0"]),
        ("cute-dsl", (9, 0), BF16, RANK, ROPE, 128, ["cute-dsl", "SM100/SM103", "9.0"]),
        ("cute-dsl", (8, 0), BF16, RANK, ROPE, 96, ["cute-dsl", "8.0"]),
        ("trtllm-gen", (10, 0), BF16, RANK, ROPE, 96, ["cannot tile 96 heads", "cute-dsl"]),
        ("trtllm-gen", (10, 3), BF16, RANK, ROPE, 24, ["cannot tile 24 heads"]),
        ("trtllm-gen", (10, 0), torch.float32, RANK, ROPE, 128, ["float32"]),
    ],
)
def test_forced_backend_that_cannot_run_raises(capability, no_cuda, backend, cc, dtype, rank, rope, heads, fragments):
    capability(cc)
    with pytest.raises(BackendUnavailableError) as info:
        choose_backend(GPU, dtype, rank, rope, heads, requested=backend)
    msg = str(info.value)
    assert repr(backend) in msg
    for fragment in fragments:
        assert fragment in msg, msg


@pytest.mark.parametrize(
    "backend, cc, rank, rope, heads",
    [
        ("fa3", (9, 0), 1024, 64, 64),  # dots3's sliding-window layers, beside its 512 + 64 DSA layers
        ("fa2", (8, 0), 256, 32, 40),  # MiniCPM3: every layer
        ("trtllm-gen", (10, 0), 1024, 64, 64),
        ("cute-dsl", (10, 3), 256, 32, 96),
    ],
)
def test_forced_backend_runs_layers_of_other_latent_dims_on_the_reference_after_one_warning(
        capability, no_cuda, caplog, backend, cc, rank, rope, heads):
    """A backend forced for speed on a model some of whose layers its kernels are not built for: those layers
    decode on the reference (the fallback every kernel has), with one warning naming their dims however often they
    are asked for, and the layers it takes keep the forced kernel."""
    capability(cc)
    caplog.set_level(logging.WARNING, logger="hf_flashinfer_mla")
    for _ in range(3):
        assert choose_backend(GPU, BF16, rank, rope, heads, requested=backend) == "reference"
        assert choose_backend(GPU, BF16, RANK, ROPE, 128, requested=backend) == backend
    [warning] = [r.getMessage() for r in warnings_of(caplog)]
    assert "PyTorch reference backend" in warning and repr(backend) in warning, warning
    assert f"kv_lora_rank {rank} + rope {rope}" in warning and f"{RANK} + {ROPE}" in warning, warning
    assert backend_and_reason(GPU, BF16, rank, rope, heads, backend) == ("reference", warning.split("because ")[1][:-1])


@pytest.mark.parametrize("backend", ["fa3", "fa2", "trtllm-gen", "cute-dsl"])
def test_forced_kernel_on_cpu_raises(capability, no_cuda, backend):
    capability(None)
    with pytest.raises(BackendUnavailableError, match="NVIDIA GPU.*cpu"):
        choose_backend(CPU, BF16, RANK, ROPE, 128, requested=backend)


@pytest.mark.parametrize("backend", ["fa3", "fa2", "trtllm-gen", "cute-dsl"])
def test_forced_kernel_on_cpu_with_real_capability_function_raises(no_cuda, backend):
    with pytest.raises(BackendUnavailableError, match="cpu"):
        choose_backend(CPU, BF16, RANK, ROPE, 128, requested=backend)


def test_backend_unavailable_error_is_value_error():
    assert issubclass(BackendUnavailableError, hf_flashinfer_mla.FlashInferMLAError)
    assert issubclass(BackendUnavailableError, ValueError)


@pytest.mark.parametrize(
    "backend, cc, heads",
    [
        ("fa3", (9, 0), 128),
        ("fa2", (9, 0), 128),
        ("fa2", (8, 0), 16),
        ("fa2", (8, 9), 128),
        ("fa2", (12, 0), 128),
        ("fa2", (10, 0), 128),
        ("trtllm-gen", (10, 0), 128),
        ("trtllm-gen", (10, 3), 16),
        ("cute-dsl", (10, 0), 96),
        ("cute-dsl", (10, 3), 128),
    ],
)
def test_forced_backend_that_can_run(capability, no_cuda, caplog, backend, cc, heads):
    capability(cc)
    caplog.set_level(logging.WARNING, logger="hf_flashinfer_mla")
    assert choose_backend(GPU, BF16, RANK, ROPE, heads, requested=backend) == backend
    assert warnings_of(caplog) == []


@pytest.mark.parametrize(
    "device, cc, dtype, rank, rope, heads",
    [
        (CPU, None, torch.float32, 64, 16, 4),
        (CPU, None, BF16, RANK, ROPE, 128),
        (GPU, (7, 5), torch.float64, RANK, ROPE, 128),
        (GPU, (9, 0), BF16, 256, 32, 40),
        (GPU, (10, 0), BF16, RANK, ROPE, 96),
        (GPU, (8, 0), torch.float32, RANK, ROPE, 128),
    ],
)
def test_forced_reference_always_works(capability, no_cuda, caplog, device, cc, dtype, rank, rope, heads):
    capability(cc)
    caplog.set_level(logging.WARNING, logger="hf_flashinfer_mla")
    assert choose_backend(device, dtype, rank, rope, heads, requested="reference") == "reference"
    assert warnings_of(caplog) == [], "forcing reference is not a fallback and must not warn"


@pytest.mark.parametrize("name", ["fa4", "FA3", "trtllm", "flashinfer", "ref", ""])
def test_unknown_backend_name_raises(capability, no_cuda, name):
    capability((9, 0))
    with pytest.raises(BackendUnavailableError, match="unknown flashinfer_mla backend"):
        choose_backend(GPU, BF16, RANK, ROPE, 128, requested=name)


def test_backend_list():
    assert set(hf_flashinfer_mla.BACKENDS) == {"auto", "reference", "fa3", "fa2", "trtllm-gen", "cute-dsl"}
    assert hf_flashinfer_mla.ENV_VAR == "HF_FLASHINFER_MLA_BACKEND"


# ---------------------------------------------------------------------------------------------------- precedence


class _Config:
    """A config carrying a load option, as from_pretrained/from_config leave it."""

    def __init__(self, mla_backend=None):
        if mla_backend is not None:
            setattr(self, LOAD_ATTR, mla_backend)


def test_requested_default_is_auto():
    assert requested_backend() == "auto"
    assert requested_backend(None, None) == "auto"
    assert requested_backend(None, _Config()) == "auto"


def test_requested_env_var(monkeypatch):
    monkeypatch.setenv(ENV_VAR, "fa2")
    assert requested_backend() == "fa2"
    assert requested_backend(None, _Config()) == "fa2"


def test_requested_config_beats_env(monkeypatch):
    monkeypatch.setenv(ENV_VAR, "fa2")
    assert requested_backend(None, _Config("reference")) == "reference"


def test_requested_call_beats_config_and_env(monkeypatch):
    monkeypatch.setenv(ENV_VAR, "fa2")
    assert requested_backend("trtllm-gen", _Config("reference")) == "trtllm-gen"
    assert requested_backend("cute-dsl", None) == "cute-dsl"


def test_requested_call_beats_config_without_env():
    assert requested_backend("fa3", _Config("fa2")) == "fa3"
    assert requested_backend(None, _Config("fa2")) == "fa2"


def test_requested_config_none_attribute_falls_through(monkeypatch):
    cfg = _Config()
    setattr(cfg, LOAD_ATTR, None)
    monkeypatch.setenv(ENV_VAR, "reference")
    assert requested_backend(None, cfg) == "reference"


def test_requested_ignores_a_public_config_attribute(monkeypatch):
    """A checkpoint's config.json may say "mla_backend" (older versions of this package wrote it): not a setting."""
    cfg = _Config()
    cfg.mla_backend = "fa3"
    assert requested_backend(None, cfg) == "auto"


def test_requested_explicit_auto_from_call(monkeypatch):
    monkeypatch.setenv(ENV_VAR, "fa2")
    assert requested_backend("auto", _Config("fa3")) == "auto"


@pytest.mark.parametrize(
    "source, named", [("call", "of this call"), ("config", "when the model was loaded"), ("env", ENV_VAR)]
)
def test_requested_unknown_raises_naming_its_source(monkeypatch, source, named):
    if source == "env":
        monkeypatch.setenv(ENV_VAR, "fa4")
        args = (None, None)
    elif source == "config":
        args = (None, _Config("fa4"))
    else:
        args = ("fa4", None)
    with pytest.raises(BackendUnavailableError, match="'fa4'") as info:
        requested_backend(*args)
    assert named in str(info.value)


def test_requested_then_choose_env_forced_unavailable(capability, no_cuda, monkeypatch):
    """The forced env value reaches choose_backend and raises there when it cannot run."""
    capability((8, 0))
    monkeypatch.setenv(ENV_VAR, "fa3")
    with pytest.raises(BackendUnavailableError, match="fa3"):
        choose_backend(GPU, BF16, RANK, ROPE, 128, requested=requested_backend())
    # ... and the call-time value overrides it.
    assert choose_backend(GPU, BF16, RANK, ROPE, 128, requested=requested_backend("fa2")) == "fa2"


def test_environment_report_prints_the_backend_table(capsys):
    from hf_flashinfer_mla.__main__ import HEADS, main

    main(["--device", "cpu", "--kv-lora-rank", "256", "--rope-dim", "32"])
    out = capsys.readouterr().out
    assert "transformers" in out and "flashinfer-python" in out
    assert "kv_lora_rank 256 + rope 32" in out
    lines = out.splitlines()
    header = next(i for i, line in enumerate(lines) if line.startswith("dtype"))
    assert lines[header].split()[1:] == [w for h in HEADS for w in (str(h), "heads")]  # columns are head counts
    rows = [line.split() for line in lines[header + 1 : header + 4]]
    assert [r[0] for r in rows] == ["bfloat16", "float16", "float32"]
    assert all(r[1:] == ["reference"] * len(HEADS) for r in rows)
    # The reason is printed once, after the table, not inside it.
    notes = lines[header + 4 :]
    assert sum("reference because it needs an NVIDIA GPU" in line for line in notes) == 1


def test_environment_report_on_blackwell_explains_cute_dsl_below_the_table(capability, no_cuda, capsys, caplog,
                                                                           monkeypatch):
    from hf_flashinfer_mla.__main__ import HEADS, main

    capability((10, 0))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)  # the report checks that the device exists
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device: "B200 (substituted)")
    caplog.set_level(logging.WARNING, logger="hf_flashinfer_mla")
    main(["--device", "cuda"])
    lines = capsys.readouterr().out.splitlines()
    header = next(i for i, line in enumerate(lines) if line.startswith("dtype"))
    table = {line.split()[0]: line.split()[1:] for line in lines[header + 1 : header + 4]}
    expected = ["cute-dsl" if h in (20, 24, 96) else "trtllm-gen" for h in HEADS]
    assert table == {"bfloat16": expected, "float16": ["fa2"] * len(HEADS), "float32": ["reference"] * len(HEADS)}
    notes = lines[header + 4 :]
    assert "cute-dsl because trtllm-gen cannot tile 96 query heads per device (bfloat16: 96 heads)" in notes
    assert any(n.startswith("fa2 because trtllm-gen's MLA decode takes bfloat16 only") for n in notes)
    assert any(n.startswith("reference because its kernels take bfloat16 or float16") for n in notes)
    assert warnings_of(caplog) == []  # nothing logged in the middle of the table


def test_a_forced_backend_serves_every_request_of_a_model_whose_sliding_layers_it_cannot_take(
        fake_hopper, monkeypatch, caplog):
    """dots3 on the fa3 stand-in (kernels built for 32 + 8; its sliding-window layers 48 + 8) served by
    ``generate_batch`` with ``$HF_FLASHINFER_MLA_BACKEND=fa3``, as a user forcing the kernel for speed would: every
    request answers with the reference backend's tokens, its DSA layers routed to fa3 and its sliding layers to the
    reference, after one warning naming their dims. Control: under the rule as it was (a forced backend raising for
    any layer it cannot take) the same batch fails, every request with ``BackendUnavailableError``'s message."""
    from helpers import make_model
    from test_continuous_batching import greedy, prompts, small_cb
    from test_continuous_batching_sparse import WINDOW_FIRST

    from hf_flashinfer_mla import plan

    model = make_model("dots3_note_text", swa_kv_lora_rank=48, **WINDOW_FIRST)
    routed, first_accepting = [], plan.first_accepting

    def recorded(chain, layer, *args):
        route = first_accepting(chain, layer, *args)
        routed.append((layer.rank, route.backend))
        return route

    monkeypatch.setattr(plan, "first_accepting", recorded)
    caplog.set_level(logging.WARNING, logger="hf_flashinfer_mla")

    def serve(backend):
        monkeypatch.setenv(ENV_VAR, backend)
        out = model.generate_batch(prompts(), generation_config=greedy(), continuous_batching_config=small_cb())
        return [(o.error, o.generated_tokens) for o in out.values()]

    reference = serve("reference")
    routed.clear()
    caplog.clear()
    forced = serve("fa3")
    assert all(error is None for error, _ in reference) and forced == reference
    assert set(routed) == {(32, "fa3"), (48, "reference")}
    [warning] = [r.getMessage() for r in warnings_of(caplog)]
    assert "mla_backend='fa3' cannot run layers of kv_lora_rank 48 + rope 8" in warning, warning

    real = capabilities.backend_and_reason

    def as_it_was(device, dtype, rank, rope, heads, requested="auto"):
        why = requested != "auto" and capabilities.unavailable_reason(requested, device, dtype, rank, rope, heads)
        if why:
            raise BackendUnavailableError(f"mla_backend={requested!r} was requested but cannot run: {why}")
        return real(device, dtype, rank, rope, heads, requested)

    monkeypatch.setattr(capabilities, "backend_and_reason", as_it_was)
    failed = serve("fa3")
    assert failed and all(error and "mla_backend='fa3' was requested but cannot run" in error for error, _ in failed)


# ---------------------------------------------------------------------------------------------------- fallbacks


@pytest.mark.parametrize(
    "backend, cc, fp8, chain",
    [
        ("fa3", (9, 0), False, ("fa3", "fa2", "reference")),  # fa2 serves what fa3's scheduler declines
        ("fa3", (9, 0), True, ("fa3", "reference")),  # no fa2 module for the FP8 latent
        ("fa2", (8, 0), False, ("fa2", "reference")),
        ("fa2", (9, 0), False, ("fa2", "reference")),
        ("trtllm-gen", (10, 0), False, ("trtllm-gen", "reference")),  # never cute-dsl: it reads the same layout
        ("cute-dsl", (10, 0), False, ("cute-dsl", "reference")),
        ("reference", (9, 0), False, ("reference",)),
        ("reference", None, False, ("reference",)),
    ],
)
def test_fallbacks_end_on_the_reference(capability, no_cuda, backend, cc, fp8, chain):
    capability(cc)
    assert fallbacks(backend, GPU, BF16, RANK, ROPE, 128, fp8) == chain


def test_fallbacks_skip_fa2_where_it_cannot_run(capability, no_cuda, monkeypatch):
    """fa2 joins fa3's chain only where fa2 itself can run (asked of `unavailable_reason`, as choose_backend asks)."""
    capability((9, 0))
    real = capabilities.unavailable_reason
    monkeypatch.setattr(capabilities, "unavailable_reason",
                        lambda backend, *args: "no fa2 here" if backend == "fa2" else real(backend, *args))
    assert fallbacks("fa3", GPU, BF16, RANK, ROPE, 128, False) == ("fa3", "reference")


# ------------------------------------------------------------------------------------ the compiled step's choice


@pytest.fixture
def graph_state(monkeypatch):
    """Fresh CUDA-graph slots and device buffers, and FlashInfer's SM-count query answered without a GPU; returns
    `captured_shapes`."""
    import flashinfer.utils

    from fake_flashinfer import fresh_caches

    fresh_caches()
    monkeypatch.setattr(flashinfer.utils, "get_device_sm_count", lambda device: 148)
    return hf_flashinfer_mla.captured_shapes


def _slot(backend: str, batch: int):
    """The one CUDA-graph slot of `backend` for decode steps of `batch` rows over 64 cached tokens."""
    from hf_flashinfer_mla.kernels import graphs

    [slot] = [slot for _, slot in graphs.slots_for(batch, 1, 64) if slot.backend == backend]
    return slot


def _graph_route(dtype, heads, requested, packed=True, kv_dtype=None, rank=RANK, rope=ROPE, batch=2):
    """What the graph op (`compiled.decode_in_graph`) decides while a compiled step of this shape warms up: the
    route of a step of `batch` sequences of 64 rows (page-aligned), on a CPU `Layer` (the capability is faked)."""
    from hf_flashinfer_mla.kernels import Layer
    from hf_flashinfer_mla.plan import StepPlan

    layer = Layer(CPU, dtype, kv_dtype or dtype, heads, rank, rope, 256, packed, 0.1)
    step = StepPlan(torch.ones(batch, 1, 1, 64, dtype=torch.bool))
    return route_in_graph(step, (layer, batch, 1), layer, requested), (layer, batch)


@pytest.mark.parametrize(
    "cc, dtype, heads, requested, expected",
    [
        ((10, 0), BF16, 16, "auto", "trtllm-gen"),
        ((10, 3), BF16, 128, "auto", "trtllm-gen"),
        ((10, 0), BF16, 24, "auto", "cute-dsl"),
        ((10, 0), BF16, 96, "auto", "cute-dsl"),
        # A forced Blackwell kernel runs inside compiled graphs too (it no longer falls back or raises there).
        ((10, 0), BF16, 16, "cute-dsl", "cute-dsl"),
        ((10, 0), BF16, 16, "trtllm-gen", "trtllm-gen"),
        ((10, 0), torch.float32, 16, "auto", "reference"),
        ((10, 0), BF16, 16, "reference", "reference"),
        (None, BF16, 16, "auto", "reference"),
        ((7, 5), BF16, 16, "auto", "reference"),
    ],
)
def test_graph_route_is_the_backend_of_each_shape_at_run_time(capability, no_cuda, graph_state, cc, dtype, heads,
                                                              requested, expected):
    """The compiled decode step chooses exactly as an eager step does (`choose_backend`), when the shape first runs:
    kernels get a CUDA-graph slot of that backend and shape; the reference backend needs none."""
    capability(cc)
    route, (layer, batch) = _graph_route(dtype, heads, requested)
    assert route.backend == expected == choose_backend(CPU, dtype, RANK, ROPE, heads, requested)
    if expected == "reference":
        assert graph_state() == []
    else:
        slot = _slot(expected, batch)
        assert route.slot is slot and slot.backend == expected and slot.meta.backend == expected
        assert (slot.meta.counter is not None) == (expected == "trtllm-gen")


def test_graph_route_decides_per_shape_in_one_process(capability, no_cuda, graph_state):
    """One process, several shapes and devices: each gets its own decision (not one constant per traced
    graph)."""
    capability((10, 0))
    assert _graph_route(BF16, 16, "auto")[0].backend == "trtllm-gen"
    assert _graph_route(BF16, 24, "auto")[0].backend == "cute-dsl"
    assert _graph_route(BF16, 16, "auto", batch=3)[0].backend == "trtllm-gen"
    assert _graph_route(BF16, 16, "auto", packed=False)[0].backend == "reference"  # split cache: no kernel slot
    capability(None)
    assert _graph_route(BF16, 16, "auto")[0].backend == "reference"
    # (the split cache's shape is the one that runs the reference)
    assert sorted((s.backend, s.runs, s.heads, s.batch) for s in graph_state()) == [
        ("cute-dsl", "cute-dsl", 24, 2), ("trtllm-gen", "reference", 16, 2), ("trtllm-gen", "trtllm-gen", 16, 2),
        ("trtllm-gen", "trtllm-gen", 16, 3)]


def test_graph_route_fp8_latent_runs_the_reference(capability, no_cuda, graph_state):
    capability((9, 0))
    route, _ = _graph_route(BF16, 16, "auto", packed=False, kv_dtype=torch.float8_e4m3fn)
    assert route.backend == "reference" and graph_state() == []


@pytest.mark.parametrize("cc, heads, backend, fragment", [((10, 0), 24, "trtllm-gen", "cannot tile 24 heads"),
                                                          ((9, 0), 16, "trtllm-gen", "SM100/SM103"),
                                                          ((10, 0), 16, "fa3", "Hopper")])
def test_graph_route_forced_backend_that_cannot_run_raises(capability, no_cuda, graph_state, cc, heads, backend,
                                                           fragment):
    capability(cc)
    with pytest.raises(BackendUnavailableError, match=fragment):
        _graph_route(BF16, heads, backend)
    assert graph_state() == []


def test_graph_route_on_hopper_takes_fa3_or_the_forced_fa2(fake_hopper, graph_state):
    """On (a fake of) Hopper, the compiled step of the float64 test latent gets fa3's graph slot, or fa2's when
    forced: the same decision as an eager step."""
    route, (layer, batch) = _graph_route(torch.float64, 4, "auto", packed=False, rank=32, rope=8)
    assert route.backend == "fa3" and _slot("fa3", batch) is route.slot
    route, (layer, batch) = _graph_route(torch.float64, 4, "fa2", packed=False, rank=32, rope=8)
    assert route.backend == "fa2" and _slot("fa2", batch) is route.slot
