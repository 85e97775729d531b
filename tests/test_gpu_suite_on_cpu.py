"""What of ``tests/gpu`` and its runner can be checked without a GPU, so that a rename breaks CI, not the next GPU
round: every attribute a GPU test patches or observes exists where the test reaches for it, and every mode of
``scripts/dev/gpu_round.sh`` its usage text documents is registered and defined."""

from __future__ import annotations

import ast
import importlib
import pathlib
import re
import sys

import pytest
import torch

from fake_flashinfer import fake_hopper  # noqa: F401  (fixture)

GPU_TESTS = pathlib.Path(__file__).parent / "gpu"
ROUND = pathlib.Path(__file__).parents[1] / "scripts" / "dev" / "gpu_round.sh"


def _patched_targets(path: pathlib.Path):
    """``(function, expression, attribute)`` of every ``<x>.setattr(<expression>, "<attribute>", ...)`` in a file,
    with the imports of the function it sits in."""
    tree = ast.parse(path.read_text())
    for func in ast.walk(tree):
        if not isinstance(func, (ast.FunctionDef, ast.AsyncFunctionDef)):
            continue
        imports = [ast.unparse(n) for n in ast.walk(func) if isinstance(n, (ast.Import, ast.ImportFrom))]
        for call in ast.walk(func):
            if (isinstance(call, ast.Call) and isinstance(call.func, ast.Attribute) and call.func.attr == "setattr"
                    and len(call.args) >= 2 and isinstance(call.args[1], ast.Constant)
                    and isinstance(call.args[1].value, str)):
                yield func.name, imports, ast.unparse(call.args[0]), call.args[1].value


def _cases():
    return [(path, *target) for path in sorted(GPU_TESTS.glob("test_*.py")) for target in _patched_targets(path)]


@pytest.mark.parametrize("path, function, imports, owner, attribute", _cases(),
                         ids=[f"{c[0].name}::{c[1]}:{c[3]}.{c[4]}" for c in _cases()])
def test_every_attribute_a_gpu_test_patches_exists(path, function, imports, owner, attribute, monkeypatch):
    monkeypatch.syspath_prepend(str(GPU_TESTS))
    module = importlib.import_module(path.stem)  # (collecting a GPU test needs no GPU: it skips when it runs)
    namespace = dict(vars(module))
    for statement in imports:
        exec(statement, namespace)  # noqa: S102  (the test's own imports, as its function runs them)
    try:
        obj = eval(owner, namespace)  # noqa: S307
    except NameError:
        pytest.skip(f"{owner} is a local of the test (an object it builds), not a module's or class's attribute")
    assert hasattr(obj, attribute), f"{path.name}::{function} patches {owner}.{attribute}, which does not exist"


def test_the_control_of_a_renamed_patch_target_is_caught(tmp_path, monkeypatch):
    """Control: a GPU test patching a name its module no longer has (as one did after a move) is reported."""
    (tmp_path / "test_gpu_renamed.py").write_text(
        "def test_x(monkeypatch):\n"
        "    from hf_flashinfer_mla import decode\n"
        "    monkeypatch.setattr(decode, 'mask_planned_outside_graph', lambda: True)\n")
    [(function, imports, owner, attribute)] = list(_patched_targets(tmp_path / "test_gpu_renamed.py"))
    namespace = {}
    for statement in imports:
        exec(statement, namespace)  # noqa: S102
    assert not hasattr(eval(owner, namespace), attribute)  # noqa: S307


def test_every_gpu_round_mode_documented_is_registered_and_defined():
    script = ROUND.read_text()
    usage = script.split("set -uo pipefail")[0]
    documented = set(re.findall(r"gpu_round\.sh ((?:[a-z0-9-]+ ?)+)", usage))
    documented = {mode for group in documented for mode in group.split()}
    registered = set(" ".join(re.findall(r'^MODES="(?:\$MODES )?([^"]*)"', script, re.M)).split())
    defined = {name.replace("_", "-") for name in re.findall(r"^mode_([a-z0-9_]+)\(\)", script, re.M)}
    assert documented <= registered, f"documented but not registered: {sorted(documented - registered)}"
    assert registered - {"bench"} <= defined, f"registered without a function: {sorted(registered - defined)}"
    assert "prefill" in registered and "serving-sparse" in registered


# --- the GPU controls' faults, reached on the stand-in's decode path ---------------------------------------------------
def _teacher_forced(model, steps=6, **kwargs):
    """The GPU suite's teacher-forced run (``tests/gpu/test_gpu_backends.py`` `_teacher_forced`), small: a left-padded
    batch prefilled, then `steps` forced tokens, one logits row per sequence and step."""
    from transformers import DynamicCache

    g = torch.Generator().manual_seed(1)
    lengths, width = (9, 4, 7), 9
    ids, mask = torch.zeros(len(lengths), width, dtype=torch.long), torch.zeros(len(lengths), width, dtype=torch.long)
    for i, n in enumerate(lengths):
        ids[i, width - n:], mask[i, width - n:] = torch.randint(1, 90, (n,), generator=g), 1
    forced = torch.randint(1, 90, (len(lengths), steps), generator=g)
    pos = (mask.cumsum(-1) - 1).clamp(min=0)
    with torch.no_grad():
        out = model(input_ids=ids, attention_mask=mask, position_ids=pos, cache=DynamicCache(config=model.config),
                    use_cache=True)
        logits = []
        for t in range(steps):
            mask = torch.cat([mask, torch.ones_like(mask[:, :1])], -1)
            pos = pos[:, -1:] + 1
            out = model(input_ids=forced[:, t : t + 1], attention_mask=mask, position_ids=pos, cache=out.cache,
                        use_cache=True, **kwargs)
            logits.append(out.logits[:, -1])
    return torch.stack(logits, 1)


def test_the_gpu_controls_faults_reach_the_decode_path(fake_hopper, monkeypatch):
    """``test_bounds_catch_wrong_scale_and_mask`` injects a 10% wrong scale at ``kernels.fa.run`` and leaky rows at
    ``plan.StepPlan.rows``, and asserts every decode layer of every step met them. On the fa3 stand-in the same
    injections are reached as often, and each moves the logits far from the reference backend's (the oracle here:
    eager's float64 over left padding is NaN) while the clean run matches them: a decode path that moved away from
    either point fails here, on the CPU, before a GPU round."""
    import dataclasses

    from helpers import make_model
    from hf_flashinfer_mla.kernels import fa
    from hf_flashinfer_mla.plan import StepPlan
    from hf_flashinfer_mla.rows import Rows

    model = make_model("deepseek_v3")
    layers, steps = model.config.num_hidden_layers, 6
    oracle = _teacher_forced(model, steps, mla_backend="reference")

    def rel(a):
        return float((a - oracle).norm() / oracle.norm())

    clean = rel(_teacher_forced(model, steps, mla_backend="fa3"))
    launches, leaks, run = [], [], fa.run

    def wrong_scale(meta, layer, *args, **kwargs):
        launches.append(layer.scale)
        return run(meta, dataclasses.replace(layer, scale=layer.scale * 1.1), *args, **kwargs)

    def leaky_rows(step):
        leaks.append(step)
        return Rows.from_mask(torch.ones_like(step.mask[:, 0, -1, :]), step.q_len)

    with monkeypatch.context() as m:
        m.setattr(fa, "run", wrong_scale)
        wrong = rel(_teacher_forced(model, steps, mla_backend="fa3"))
    with monkeypatch.context() as m:
        m.setattr(StepPlan, "rows", leaky_rows)
        leaky = rel(_teacher_forced(model, steps, mla_backend="fa3"))
    assert len(launches) == steps * layers and len({id(s) for s in leaks}) == steps
    assert clean < 1e-10, clean  # (float64: the stand-in computes what the reference does)
    assert wrong > 1e-4 and leaky > 1e-4, (wrong, leaky)
