"""The Transformers releases the package runs on: the declared floor, the shape checks of its seams, and what a
release outside the tested ones gets (``supported.py``, ``registration.py``).

A release whose code does not fit a seam is faked in a fresh process, by putting an object of another shape where the
seam looks before the package is imported: the pre-5.24 signature of ``masking_utils._preprocess_mask_arguments``
(``past_key_values`` where the tested releases say ``cache``) for continuous batching, a renamed parameter for a
generate() seam, a module the package imports made missing. Each child process prints what it saw as JSON.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
import types
from pathlib import Path

import pytest
import transformers

import hf_flashinfer_mla
from hf_flashinfer_mla import TransformersVersionError, registration, supported

ROOT = Path(__file__).resolve().parents[1]
FIX = f"pip install 'transformers{supported.REQUIREMENT}'"


def test_the_floor_is_the_oldest_tested_release_everywhere_it_is_written():
    """pyproject's dependency and extras, the README's Requirements line and CI's runs name the same releases."""
    pins = re.findall(r'"(transformers[^"]*)"', (ROOT / "pyproject.toml").read_text())  # (the dependency, extras)
    assert len(pins) >= 3 and all(p.endswith(f">={supported.TESTED[0]},<6") for p in pins), pins
    requirements = next(line for line in (ROOT / "README.md").read_text().splitlines()
                        if line.startswith("Requirements:"))
    assert f"Transformers >= {supported.TESTED[0]}, < 6" in requirements, requirements
    ci = (ROOT / ".ci" / "run").read_text()
    assert re.findall(r'"transformers\[serving\]==(\d+\.\d+)\.\d+"', ci) == list(reversed(supported.TESTED))
    assert ci.count("python -m pytest -q tests\n") == len(supported.TESTED)  # the whole suite on each
    assert supported.REQUIREMENT == ">=5.24,<5.26"
    # Every install command the README and the package's messages give names the same floor.
    for path in [ROOT / "README.md", *sorted((ROOT / "hf_flashinfer_mla").glob("*.py"))]:
        for spec in re.findall(r"transformers(?:\[serving\])?>=[\d.]+", path.read_text()):
            assert spec.endswith(f">={supported.TESTED[0]}"), (path.name, spec)


def _original(seam):
    """Transformers' own object under the seam's wrapper, as the seam finds it (a class in a table: its base; a
    classmethod: bound to the class)."""
    current = registration._current(seam)
    if isinstance(current, type):
        return current.__bases__[0]
    if isinstance(current, types.MethodType):
        return types.MethodType(current.__func__.__wrapped__, current.__self__)
    return current.__wrapped__


def test_every_seam_fits_this_release():
    """On this release (CI: each tested one) nothing is unavailable, and each seam's shape is what Transformers' own
    object (under the wrapper) has: a shape written wrong would refuse a feature on the releases that have it.
    Control: the same check names a parameter renamed in a copy of the object."""
    assert registration.UNAVAILABLE == {}
    checked = 0
    for seam in registration.SEAMS:
        if registration._current(seam) is None or seam.adds:
            assert seam.optional or seam.adds, seam
            continue
        original = _original(seam)
        assert not getattr(getattr(original, "__func__", original), registration.PATCHED, False), seam
        assert registration.shape_problem(seam._replace(owner={seam.name: original})) is None, seam
        checked += 1
    assert checked >= len(registration.SEAMS) - 2

    def _preprocess_mask_arguments(config, inputs_embeds, attention_mask, past_key_values, position_ids, layer_idx):
        """(5.23's signature)"""

    seam = next(s for s in registration.SEAMS if s.name == "_preprocess_mask_arguments")
    why = registration.shape_problem(seam._replace(owner={seam.name: _preprocess_mask_arguments}))
    assert why is not None and "past_key_values), not (" in why and why.endswith("cache)"), why


# A fresh process whose Transformers has 5.23's `_preprocess_mask_arguments` (the keyword 5.24 renamed to `cache`),
# delegating to this release's: continuous batching must be refused at each of its entry points, one line each, and
# generate() must still match eager; a model on another attention is left to Transformers.
_OLD_MASK_ARGUMENTS = """
import json, sys
sys.path.insert(0, {tests!r})
import torch
from transformers import masking_utils

original = masking_utils._preprocess_mask_arguments

def _preprocess_mask_arguments(config, inputs_embeds, attention_mask, past_key_values, position_ids, layer_idx,
                               encoder_hidden_states=None):
    return original(config, inputs_embeds, attention_mask, past_key_values, position_ids, layer_idx,
                    encoder_hidden_states)

masking_utils._preprocess_mask_arguments = _preprocess_mask_arguments

from transformers import ContinuousBatchingConfig, GenerationConfig, LlamaConfig, LlamaForCausalLM
from transformers.generation.continuous_batching.continuous_api import ContinuousBatchingManager

from hf_flashinfer_mla import TransformersVersionError, registration
from helpers import left_padded_batch, make_model, set_attention

seen = dict(unavailable=registration.UNAVAILABLE, untouched=masking_utils._preprocess_mask_arguments is
            _preprocess_mask_arguments, refusals={{}}, generate={{}})
gen = GenerationConfig(max_new_tokens=4, do_sample=False, eos_token_id=-1, pad_token_id=0)
cb = ContinuousBatchingConfig(page_size=4, num_blocks=32, max_batch_tokens=16, max_requests_per_batch=4)
ids, mask, prompts = left_padded_batch(lengths=(7, 4, 9))
for model_type in ("deepseek_v3", "deepseek_v32"):
    model = make_model(model_type)
    for entry, call in (
        ("generate_batch", lambda: model.generate_batch([p.tolist() for p in prompts], generation_config=gen,
                                                        continuous_batching_config=cb)),
        ("init_continuous_batching", lambda: model.init_continuous_batching(generation_config=gen,
                                                                            continuous_batching_config=cb)),
        ("ContinuousBatchingManager", lambda: ContinuousBatchingManager(model, gen, cb)),
    ):
        try:
            call()
            seen["refusals"][f"{{model_type}} {{entry}}"] = None
        except TransformersVersionError as error:
            seen["refusals"][f"{{model_type}} {{entry}}"] = str(error)
    ours = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=6, do_sample=False, pad_token_id=0)
    set_attention(model, "eager")
    alone = [model.generate(input_ids=p[None], max_new_tokens=6, do_sample=False, pad_token_id=0)[0, -6:].tolist()
             for p in prompts]
    seen["generate"][model_type] = [ours[:, -6:].tolist(), alone]
torch.manual_seed(0)
llama = LlamaForCausalLM(LlamaConfig(vocab_size=97, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                     num_attention_heads=2, num_key_value_heads=2, pad_token_id=0)).eval()
out = llama.generate_batch([p.tolist() for p in prompts], generation_config=gen, continuous_batching_config=cb)
seen["llama"] = [o.generated_tokens for o in out.values()]
print("SEEN" + json.dumps(seen))
"""


def _child(code: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600, cwd=ROOT)


def _seen(proc: subprocess.CompletedProcess) -> dict:
    line = next((line for line in proc.stdout.splitlines() if line.startswith("SEEN")), None)
    assert line is not None, proc.stdout[-3000:] + proc.stderr[-5000:]
    return json.loads(line[len("SEEN"):])


def test_a_release_whose_code_does_not_fit_refuses_continuous_batching_and_keeps_generate():
    seen = _seen(_child(_OLD_MASK_ARGUMENTS.format(tests=str(ROOT / "tests"))))
    # The fault was in place and seen: the seam is left alone, and its feature is the one recorded.
    assert seen["untouched"], "the seam was installed over the older signature"
    assert list(seen["unavailable"]) == [registration.CONTINUOUS_BATCHING]
    assert "masking_utils._preprocess_mask_arguments takes (" in seen["unavailable"][registration.CONTINUOUS_BATCHING]
    assert len(seen["refusals"]) == 6
    for entry, message in seen["refusals"].items():
        assert message is not None, f"{entry} ran"
        assert "\n" not in message, message
        assert message.startswith("continuous batching with flashinfer_mla needs Transformers "), message
        assert f"(installed: {transformers.__version__}; masking_utils._preprocess_mask_arguments" in message
        assert FIX in message and message.endswith("or use generate()"), message
    for model_type, (ours, alone) in seen["generate"].items():
        assert ours == alone, model_type
    # Another attention's continuous batching is Transformers' own, and runs.
    assert len(seen["llama"]) == 3 and all(len(tokens) == 4 for tokens in seen["llama"]), seen["llama"]


# A fresh process whose generate() seam has another shape: the import fails with one line, Transformers untouched.
_RENAMED_GENERATE_SEAM = """
import json
from transformers import AttentionInterface, PreTrainedModel
from transformers.generation.utils import GenerationMixin

original = GenerationMixin._update_model_kwargs_for_generation

def _update_model_kwargs_for_generation(self, model_output, model_kwargs, *args, **kwargs):
    return original(self, model_output, model_kwargs, *args, **kwargs)

GenerationMixin._update_model_kwargs_for_generation = _update_model_kwargs_for_generation
try:
    import hf_flashinfer_mla
    raised = None
except ImportError as error:
    raised = [type(error).__name__, str(error)]
check = PreTrainedModel._check_and_adjust_attn_implementation
print("SEEN" + json.dumps(dict(raised=raised, registered="flashinfer_mla" in AttentionInterface._global_mapping,
                               patched=getattr(check, "_flashinfer_mla_patch", False))))
"""

# A fresh process in which a Transformers module the package imports is missing, as on releases before 5.19.
_MISSING_MODULE = """
import json, sys
MODULE = "transformers.generation.continuous_batching.cache_allocators"
sys.modules[MODULE] = None  # (an import of it raises ModuleNotFoundError)
try:
    __import__(MODULE)
    fault = False
except ModuleNotFoundError:
    fault = True
try:
    import hf_flashinfer_mla
    raised = None
except ImportError as error:
    raised = [type(error).__name__, str(error)]
print("SEEN" + json.dumps(dict(fault=fault, raised=raised)))
"""


def test_a_generate_seam_that_does_not_fit_fails_the_import_with_one_line():
    seen = _seen(_child(_RENAMED_GENERATE_SEAM))
    assert seen["raised"] is not None, "the import went through"
    kind, message = seen["raised"]
    assert kind == "TransformersVersionError" and "\n" not in message, message
    assert message.startswith(f"hf_flashinfer_mla needs Transformers {supported.REQUIREMENT} (installed: "
                              f"{transformers.__version__}; GenerationMixin._update_model_kwargs_for_generation "
                              "takes (self, model_output, model_kwargs), not (self, outputs, model_kwargs)"), message
    assert message.endswith(FIX), message
    assert not seen["registered"] and not seen["patched"]  # nothing of Transformers changed


def test_a_missing_transformers_module_fails_the_import_with_one_line():
    seen = _seen(_child(_MISSING_MODULE))
    assert seen["fault"], "the module could still be imported"
    kind, message = seen["raised"]
    assert kind == "TransformersVersionError" and "\n" not in message, message
    assert re.fullmatch(
        rf"hf_flashinfer_mla needs Transformers {re.escape(supported.REQUIREMENT)} \(installed: "
        rf"{re.escape(transformers.__version__)}; it has no module "
        r"transformers\.generation\.continuous_batching\.cache_allocators\): " + re.escape(FIX), message), message


def test_the_refusal_is_an_import_error_and_the_package_s_own():
    assert issubclass(TransformersVersionError, ImportError)
    assert issubclass(TransformersVersionError, hf_flashinfer_mla.FlashInferMLAError)


def test_an_unavailable_feature_is_refused_where_it_is_asked_for_only_for_flashinfer_mla(monkeypatch):
    """The entry-point wrapper an unavailable feature gets: one line for a flashinfer_mla model (the model as `self`,
    or as the first argument of a manager), Transformers' own call for any other."""
    from helpers import make_model

    monkeypatch.setitem(registration.UNAVAILABLE, registration.CONTINUOUS_BATCHING, "a seam does not fit")
    calls = []
    refused = registration.refused_where_unavailable(registration.CONTINUOUS_BATCHING,
                                                     lambda self, *args, **kwargs: calls.append(args) or "ran")
    model = make_model("deepseek_v3")
    for call in (lambda: refused(model, [[1, 2]]), lambda: refused(object(), model), lambda: refused(object(),
                                                                                                   model=model)):
        with pytest.raises(TransformersVersionError, match=re.escape(
                f"continuous batching with flashinfer_mla needs Transformers {supported.REQUIREMENT} (installed: "
                f"{transformers.__version__}; a seam does not fit): {FIX}, or use generate()")):
            call()
    assert calls == []
    model.set_attn_implementation("eager")
    assert refused(model, [[1, 2]]) == "ran" and calls == [([[1, 2]],)]


def test_the_server_refuses_at_start_what_this_release_cannot_serve(monkeypatch, capsys):
    """One line and exit status 2 before anything loads: a loader of another shape (older releases' `ModelManager`
    takes no ``continuous_batching``), or continuous batching unavailable when the command asks for it."""
    pytest.importorskip("fastapi", reason="transformers serve needs its [serving] extra")
    from hf_flashinfer_mla import serve

    assert serve.loader_problem() is None
    loader = serve._ModelLoader or serve._transformers_model_manager.ModelManager

    class Older(loader):
        def __init__(self, force_model=None):
            pass

    monkeypatch.setattr(serve, "_ModelLoader", Older if serve._ModelLoader else None)
    monkeypatch.setattr(serve._transformers_model_manager, "ModelManager", Older)
    why = serve.loader_problem()
    assert why == f"cli.serving.model_manager.Older takes no continuous_batching=", why
    monkeypatch.undo()

    for unavailable, args, says in (
        (registration.SERVE, [], "the server with flashinfer_mla needs"),
        (registration.CONTINUOUS_BATCHING, ["--continuous-batching"], "continuous batching with flashinfer_mla needs"),
    ):
        with monkeypatch.context() as m:
            m.setitem(registration.UNAVAILABLE, unavailable, "a seam does not fit")
            with pytest.raises(SystemExit) as exc:
                serve.main(["/nonexistent/checkpoint", *args, "--host", "127.0.0.1", "--port", "1"])
        out, err = capsys.readouterr()
        assert exc.value.code == 2 and err.count("\n") == 1, err
        assert err.startswith(f"{serve.PROG}: error: {says} Transformers {supported.REQUIREMENT} (installed: "), err
        assert FIX in err, err
    # Without the fault the same command line gets to its own checks (the checkpoint does not exist).
    with pytest.raises(SystemExit):
        serve.main(["/nonexistent/checkpoint", "--continuous-batching", "--host", "127.0.0.1", "--port", "1"])
    assert "no such directory" in capsys.readouterr().err
