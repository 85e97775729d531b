"""Tensor parallelism on the CPU: Transformers' ``tp_plan="auto"`` over two gloo ranks, float64, against one process.

Transformers' DTensor tensor parallelism runs on a CPU device mesh (gloo), so the sharding this package meets on
GPUs (``kv_b_proj`` a colwise DTensor whose ``.shape`` is global; the query holding the rank's heads only; ``o_proj``
rowwise with an all-reduce) can be checked here exactly. `scripts/tp_parity.py` is launched twice: in this process
(one rank) and under ``torchrun --nproc-per-node 2`` (two ranks); both load the same saved checkpoints.

For each of the ten dense MLA families (the small random models of `helpers.FAMILIES`), and for
DeepSeek-V3 and Mistral 4 with attention sharded through a plan override (`tp_parity.mla_attention_tp_plan`):
flashinfer_mla on two ranks equals flashinfer_mla and sdpa on one rank (teacher-forced logits over a left-padded
batch; greedy tokens), every rank ends with the same logits, and the attention saw the rank's share of the heads:
half of them where the plan shards attention (deepseek_v2, glm4_moe_lite, minicpm3, longcat_flash as shipped in
Transformers 5.24; deepseek_v3 and axk1 too from 5.25, read off each config's plan), all of them where it replicates
attention. Eager is not the oracle here: its softmax runs in float32,
where float64's masking value becomes -inf, so fully masked left-padding rows turn into NaN, which reaches the
padded sequences' cached latents. The control rolls the query heads on the two ranks (heads misaligned with their
``kv_b_proj`` shard) and must fail the bound.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch
import torch.distributed

from helpers import FAMILIES, make_config, make_model

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(REPO, "scripts"))
import tp_parity  # noqa: E402

pytestmark = pytest.mark.skipif(
    not (torch.distributed.is_available() and torch.distributed.is_gloo_available()),
    reason="needs torch.distributed with gloo",
)

TOL = 1e-6  # float64, as in test_dense_models.py
# Checkpoint names run on two ranks; "@attn-plan" adds head-sharded attention to the plan (prototype).
TP_RUNS = (*FAMILIES, "deepseek_v3@attn-plan", "mistral4@attn-plan")


def _shipped_plan_shards_attention(family: str) -> bool:
    """Whether the family's shipped tp plan shards attention (``kv_b_proj`` colwise): deepseek_v2, glm4_moe_lite,
    minicpm3 and longcat_flash in Transformers 5.24; deepseek_v3 and the families built on its config from 5.25."""
    plan = getattr(make_config(family), "base_model_tp_plan", None) or {}
    return any(key.startswith("layers.*.self_attn.") and key.endswith(".kv_b_proj") for key in plan)


SHARDED_ATTENTION = {f for f in FAMILIES if _shipped_plan_shards_attention(f)} | {"deepseek_v3@attn-plan",
                                                                                  "mistral4@attn-plan"}
ARGS = ["--device", "cpu", "--dtype", "float64", "--experts-impl", "eager", "--lengths", "7", "4", "9",
        "--steps", "6", "--gen-prompt", "5", "--gen-tokens", "6"]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("tp")
    for family in FAMILIES:
        make_model(family, attn="eager").save_pretrained(root / family)
    # Two ranks, started first so that their start-up overlaps the one-rank run in this process.
    two_dir, one_dir = root / "tp2", root / "tp1"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([REPO, os.environ.get("PYTHONPATH", "")])}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
           os.path.join(REPO, "scripts", "tp_parity.py"), "run", "--ckpt", *(str(root / r) for r in TP_RUNS),
           "--out", str(two_dir), *ARGS, "--attn", "flashinfer_mla", "flashinfer_mla:roll-heads"]
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        tp_parity.main(["run", "--ckpt", *(str(root / f) for f in FAMILIES), "--out", str(one_dir), *ARGS,
                        "--attn", "flashinfer_mla", "sdpa"])
        stdout, stderr = proc.communicate(timeout=300)
    finally:
        if proc.poll() is None:
            proc.kill()
    if proc.returncode:
        pytest.fail(f"torchrun exited {proc.returncode}:\n{stdout[-3000:]}\n{stderr[-6000:]}")

    def load(path):
        return torch.load(path, weights_only=True)

    return {name: (load(one_dir / f"{name.partition('@')[0]}.pt"), load(two_dir / f"{name}.pt")) for name in TP_RUNS}


@pytest.mark.parametrize("name", TP_RUNS)
def test_two_ranks_match_one(runs, name):
    one, two = runs[name]
    meta = two["meta"]
    assert meta["world_size"] == 2 and meta["ranks_agree"]
    heads = meta["num_attention_heads"]
    probe = meta["runs"]["flashinfer_mla"]["probe"]
    assert probe["decode_calls"] > 0 and probe["latent_inputs"] > 0  # absorbed decode over the latent ran
    for held in meta["held_by_rank"]:
        kv_b = held["kv_b_proj"]
        if name in SHARDED_ATTENTION:
            assert kv_b["dtensor"] and kv_b["local"][0] * 2 == kv_b["global"][0]
            assert held["o_proj"]["dtensor"] and held["o_proj"]["local"][1] * 2 == held["o_proj"]["global"][1]
        else:
            assert not kv_b["dtensor"]  # the shipped plan replicates attention
    assert probe["query_heads"] == [heads // 2 if name in SHARDED_ATTENTION else heads]
    for oracle in ("flashinfer_mla", "sdpa"):
        result = tp_parity.compare(one, two, "flashinfer_mla", oracle)
        assert result["rel_err"] < TOL, (oracle, result)
        assert result["tokens_equal"], (oracle, result)


@pytest.mark.parametrize("name", sorted(SHARDED_ATTENTION))
def test_control_misaligned_heads_fail_the_bound(runs, name):
    one, two = runs[name]
    assert two["meta"]["runs"]["flashinfer_mla:roll-heads"]["probe"]["faulted"] > 0
    result = tp_parity.compare(one, two, "flashinfer_mla:roll-heads", "flashinfer_mla")
    assert result["rel_err"] > 100 * TOL, result
