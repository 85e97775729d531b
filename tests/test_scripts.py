"""The benchmark scripts run end to end on the CPU (tiny model, a step or two): each prints its table and writes
its JSON under --out, so the GPU round does not discover a broken script on the device."""

from __future__ import annotations

import json
import pathlib
import sys
import types

import pytest
import torch

SCRIPTS = pathlib.Path(__file__).parents[1] / "scripts"
sys.path.insert(0, str(SCRIPTS))
sys.path.insert(0, str(SCRIPTS / "dev"))

CPU = ["--device", "cpu", "--dtype", "float32"]


@pytest.mark.parametrize("script, args, output", [
    ("bench_decode", ["--model", "tiny", "--batch", "2", "--context", "32", "--steps", "1", "--warmup", "1"],
     "decode_eager.json"),
    ("bench_decode", ["--model", "tiny-dsa", "--batch", "2", "--context", "32", "--steps", "1", "--warmup", "1"],
     "decode_eager.json"),
    ("bench_decode", ["--model", "tiny", "--batch", "2", "--context", "32", "--steps", "1", "--warmup", "1",
                      "--attn", "flashinfer_mla", "--layout", "transformers"], "decode_eager.json"),
    ("bench_decode", ["--model", "tiny", "--batch", "2", "--context", "32", "--steps", "1", "--warmup", "1",
                      "--attn", "flashinfer_mla", "--stop-check", "sync", "deferred"], "decode_eager.json"),
    ("bench_kernel", ["--heads", "2", "--batch", "2", "--context", "64", "--iters", "1", "--warmup", "0",
                      "--backends", "reference", "fa3"], "kernel.json"),
    ("bench_generate", ["--model", "tiny", "--prompt", "8", "--new", "3", "--repeats", "1"], "generate_tiny.json"),
    ("bench_generate", ["--model", "tiny", "--prompt", "8", "--new", "3", "--repeats", "1", "--static", "--cache",
                        "new", "kept"], "generate_tiny_static.json"),
    ("bench_host", ["--model", "tiny", "--batch", "2", "--context", "32", "--steps", "1", "--warmup", "0"],
     "host.json"),
    ("bench_serving", ["--model", "tiny", "--requests", "5", "--prompt-min", "3", "--prompt-max", "9", "--new", "2",
                       "--static-batch", "4", "--cb-num-blocks", "64", "--cb-page-size", "16",
                       "--cb-max-batch-tokens", "16", "--no-progress"], "serving_tiny.json"),
    ("bench_prefill", ["--heads", "2", "--lengths", "64", "--batch", "3", "--pad", "16", "--iters", "1",
                       "--warmup", "0"], "prefill.json"),
    ("bench_adapters", ["--model", "tiny", "--batch", "2", "--context", "16", "--steps", "1", "--warmup", "0",
                        "--repeats", "1", "--rank", "4"], "bench_adapters.json"),
    ("profile_replay", ["--model", "tiny", "--cells", "2x32", "--steps", "2", "--no-compile", "--segments",
                        "hf_flashinfer_mla.masks:host_rows"], "profile_replay.json"),
])
def test_script_runs_on_cpu(script, args, output, tmp_path, capsys):
    module = __import__(script)
    assert module.main(args + CPU + ["--out", str(tmp_path)]) == 0
    payload = json.loads((tmp_path / output).read_text())
    results = payload["results"]
    assert results and payload["metadata"]["torch"]
    ran = [r for r in results if r.get("status") == "ok"]
    assert ran, results  # at least one implementation measured (fa3 is skipped on the CPU, and says why)
    assert "fa3" not in {r.get("backend") for r in ran}
    printed = capsys.readouterr().out
    assert "wrote" in printed
    if script == "bench_serving":  # every default mode, Transformers' own continuous batching on sdpa included
        by_mode = {r["mode"]: r for r in results}
        assert list(by_mode) == list(module.MODES)
        # (Transformers up to 5.24 cannot page the MLA latent for sdpa: that mode is skipped there, saying why)
        assert by_mode["cb-sdpa"]["status"] == ("skipped" if module.unpageable("sdpa") else "ok"), by_mode["cb-sdpa"]
        for r in ran:
            assert r["tokens_per_s"] > 0 and r["itl_p50_ms"] > 0 and r["ttft_p50_s"] > 0, r
        assert by_mode["cb-sdpa"].get("attn_implementation", "sdpa") == "sdpa"


def test_serving_with_requests_arriving_over_time_on_cpu(tmp_path):
    """``bench_serving.py --request-rate``: requests join a running manager as a Poisson process (first at t0, times
    increasing, fixed seed), all finish, and a static-batch mode refuses the rate."""
    import types

    import bench_serving

    times = bench_serving.arrival_times(types.SimpleNamespace(requests=200, request_rate=40.0, seed=0))
    assert times[0] == 0.0 and all(b >= a for a, b in zip(times, times[1:]))
    assert 0.5 * 200 / 40 < times[-1] < 2 * 200 / 40  # (about requests / rate seconds)
    args = ["--model", "tiny", "--requests", "5", "--prompt-min", "3", "--prompt-max", "9", "--new", "2",
            "--cb-num-blocks", "64", "--cb-page-size", "16", "--cb-max-batch-tokens", "16", "--no-progress",
            "--request-rate", "20", "--modes", "cb-flashinfer_mla", "cb-flashinfer_mla-decode-graphs"]
    assert bench_serving.main(args + CPU + ["--out", str(tmp_path)]) == 0
    results = json.loads((tmp_path / "serving_tiny.json").read_text())["results"]
    assert [r["status"] for r in results] == ["ok", "ok"] and all(r["finished_requests"] == 5 for r in results)
    assert all(r["steps"] > 0 and r["ttft_p50_s"] > 0 for r in results)
    with pytest.raises(SystemExit):
        bench_serving.parse_args(["--request-rate", "5", "--modes", "generate-sdpa"])


def test_step_split_counts_every_step_by_kind_and_merges_overlapping_gpu_intervals_on_cpu(tmp_path):
    """``bench_serving.py --step-split``: the GPU-busy time is the union of the kernels' intervals (overlaps counted
    once, gaps not at all); every step but the manager's last lands in a kind with its tokens, and the run's steps'
    tokens add up to the prompts' plus the generated ones. Without CUDA nothing is profiled, so no bound is claimed."""
    import bench_serving
    from step_split import busy_ns

    assert busy_ns([(0, 10), (5, 12), (20, 25), (21, 22)]) == 17
    assert busy_ns([(3, 4)]) == 1 and busy_ns([]) == 0
    args = ["--model", "tiny", "--requests", "5", "--prompt-min", "3", "--prompt-max", "9", "--new", "3",
            "--cb-num-blocks", "64", "--cb-page-size", "16", "--cb-max-batch-tokens", "16", "--no-progress",
            "--modes", "cb-flashinfer_mla", "--step-split", "--warm-run"]
    assert bench_serving.main(args + CPU + ["--out", str(tmp_path)]) == 0
    (r,) = json.loads((tmp_path / "serving_tiny.json").read_text())["results"]
    split = r["step_split"]
    kinds = split["kinds"]  # (the timed pass's steps alone: the warm pass's, as many tokens again, are dropped)
    assert set(kinds) <= {"mixed", "decode", "mixed-graphed", "decode-graphed", "other"} and "mixed" in kinds, kinds
    assert sum(k["steps"] for k in kinds.values()) == r["steps"] - 1  # (the last step is cut by the stop)
    prompts = sum(len(p) for p in bench_serving.make_prompts(bench_serving.parse_args(args), 64))
    assert prompts < sum(k["tokens"] for k in kinds.values()) <= prompts + 5 * 3
    assert all(k["wall_s"] > 0 for k in kinds.values()) and split["graph_bound"] is None

    # A profiled (uncompiled) step, its kernels given as CUPTI would: 0.3 s busy in 1 s of wall time, the rest saveable.
    from step_split import StepSplit

    def kernel(start_s, end_s):
        return types.SimpleNamespace(device_type=lambda: torch.autograd.DeviceType.CUDA, name=lambda: "k",
                                     start_ns=lambda: int(start_s * 1e9),
                                     duration_ns=lambda: int((end_s - start_s) * 1e9))

    prof = types.SimpleNamespace(__exit__=lambda *a: None, kineto_results=types.SimpleNamespace(
        events=lambda: [kernel(0.0, 0.2), kernel(0.1, 0.25), kernel(0.5, 0.55)]))
    split = StepSplit(torch.device("cpu"))
    split.open = {"t0": 10.0, "kind": "mixed", "prof": prof, "start_s": 0.0, "tokens": 8}
    split.close(now=11.0)
    got = split.report(wall_s=4.0)
    assert got["kinds"]["mixed"]["gpu_busy_s"] == pytest.approx(0.3)
    assert got["saveable_s"] == pytest.approx(0.7) and got["graph_bound"] == pytest.approx(4.0 / 3.3, rel=1e-3)


def test_warm_run_times_generate_after_an_untimed_batch_of_the_first_batchs_lengths_on_cpu(tmp_path, monkeypatch):
    """``bench_serving.py --warm-run`` on a generate mode: one untimed batch first, of other prompts with the first
    timed batch's lengths; the timed figures count the timed prompts' tokens only."""
    import bench_serving

    calls = []
    generate = bench_serving._generate

    def recorded(model, batch, *args):
        calls.append([list(p) for p in batch])
        return generate(model, batch, *args)

    monkeypatch.setattr(bench_serving, "_generate", recorded)
    args = ["--model", "tiny", "--requests", "5", "--prompt-min", "3", "--prompt-max", "9", "--new", "2",
            "--static-batch", "4", "--no-progress", "--modes", "generate-flashinfer_mla", "--warm-run"]
    assert bench_serving.main(args + CPU + ["--out", str(tmp_path)]) == 0
    (r,) = json.loads((tmp_path / "serving_tiny.json").read_text())["results"]
    vocab = bench_serving.bc.build_config("tiny", None).vocab_size
    prompts = bench_serving.make_prompts(bench_serving.parse_args(args), vocab)
    assert len(calls) == 3 and calls[1:] == [prompts[:4], prompts[4:]]  # (the warm batch, then the timed ones)
    assert [len(p) for p in calls[0]] == [len(p) for p in prompts[:4]] and calls[0] != prompts[:4]
    assert r["status"] == "ok" and r["output_tokens"] == 5 * 2 and r["finished_requests"] == 5


def test_serving_within_a_time_limit_counts_what_finished_and_every_token_produced_on_cpu(tmp_path):
    """``bench_serving.py --time-limit``: a load that cannot finish in time ends each mode at the limit with status
    time-limit, the requests finished by then, and the tokens produced by then, with their latencies: under
    continuous batching those of the requests still running too (more than the finished ones hold), in generate()
    whole batches' and the one stopped at its first step past the limit."""
    import bench_serving

    # (more than either mode generates in 10 s on a CPU, up to the tiny model's context of 4096. The cache is sized
    # for the load, 512 blocks of 256 tokens and room to spare: sized from the machine's memory, Transformers 5.24
    # zeroes 9 GiB on a 24 GiB CPU machine before the first step, which takes the whole limit.)
    new, batch = 4000, 4
    args = ["--model", "tiny", "--requests", "32", "--prompt-min", "3", "--prompt-max", "9", "--new", str(new),
            "--static-batch", str(batch), "--time-limit", "10", "--no-progress", "--modes", "cb-flashinfer_mla",
            "generate-flashinfer_mla", "--cb-num-blocks", "1024"]
    assert bench_serving.main(args + CPU + ["--out", str(tmp_path)]) == 0
    cb, static = json.loads((tmp_path / "serving_tiny.json").read_text())["results"]
    for r in (cb, static):
        assert r["status"] == "time-limit" and r["finished_requests"] < 32, r
        assert r["requests_with_tokens"] >= r["finished_requests"], r
        assert r["tokens_per_s"] == pytest.approx(r["output_tokens"] / r["wall_s"]), r
        assert r["ttft_p50_s"] > 0 and r["itl_p50_ms"] > 0, r  # (over every request that had tokens by the limit)
    assert cb["output_tokens"] > cb["finished_requests"] * new, cb
    assert cb["requests_with_tokens"] > cb["finished_requests"], cb
    assert static["finished_requests"] % batch == 0 and static["output_tokens"] % batch == 0, static
    assert static["output_tokens"] >= static["finished_requests"] * new, static


def test_parallel_gpu_suite_reports_every_collected_test_and_counts_a_cut_run_as_missing(tmp_path):
    """``scripts/dev/gpu_suite_parallel.py`` on the CPU, over a few tests of ``tests/gpu`` (``-k``): those that run
    on the stand-ins and one that skips without two GPUs, each worker's share last to first (``--reverse``). Every
    collected test is reported (exit 0), and the workers' log names the order each ran; with workers stopped before
    they start, every test is missing and the run fails (exit 1)."""
    import gpu_suite_parallel as gsp

    chosen = "test_gpu_sparse or test_multi_gpu"
    collected = gsp.collect(chosen)
    assert len(collected) >= 4 and any("test_multi_gpu" in n for n in collected)
    assert gsp.main(["--workers", "2", "-k", chosen, "--reverse", "--out", str(tmp_path / "full")]) == 0
    summary = (tmp_path / "full" / "gpu_suite_summary.txt").read_text()
    reported = json.loads((tmp_path / "full" / "gpu_suite_durations.json").read_text())
    assert sorted(reported) == sorted(collected)
    counts = f"{len(collected)} collected, {len(collected) - 1} passed, 1 skipped, 0 missing"
    assert f"(reversed): {counts}" in summary, summary
    workers = (tmp_path / "full" / "gpu_suite_workers.txt").read_text()
    for share in gsp.deal(collected, 2, {}, reverse=True):
        assert "".join(f"   {n}\n" for n in share) in workers
    assert not list((tmp_path / "full").glob("worker*"))  # merged: a device call brings back at most 8 files

    assert gsp.main(["--workers", "2", "-k", chosen, "--timeout", "0", "--out", str(tmp_path / "cut")]) == 1
    cut = (tmp_path / "cut" / "gpu_suite_summary.txt").read_text()
    assert f"{len(collected)} missing" in cut and cut.count("MISSING ") == len(collected), cut


def test_parallel_gpu_suite_deals_another_split_and_order_by_seed_or_reversed():
    """The second run of the GPU suite runs it in another order: ``--reverse`` runs each worker's share last to
    first; ``--seed`` deals another split of the same tests (reproducibly) and orders each share by the seed."""
    import gpu_suite_parallel as gsp

    nodes = [f"tests/gpu/test_x.py::test_{i}" for i in range(12)] + ["tests/gpu/test_x.py::test_graphs"]
    suite = gsp.deal(nodes, 3, {})
    assert sorted(n for share in suite for n in share) == sorted(nodes)
    assert all(share == sorted(share, key=nodes.index) for share in suite)  # the suite's order
    assert gsp.deal(nodes, 3, {}, reverse=True) == [share[::-1] for share in suite]
    seeded = {seed: gsp.deal(nodes, 3, {}, seed=seed) for seed in range(4)}
    assert all(sorted(n for share in s for n in share) == sorted(nodes) for s in seeded.values())
    assert seeded[1] == gsp.deal(nodes, 3, {}, seed=1)

    def split(shares):
        return sorted(sorted(share) for share in shares)

    assert any(split(s) != split(suite) for s in seeded.values())
    assert any(share != sorted(share, key=nodes.index) for s in seeded.values() for share in s)

def test_step_prep_lays_out_the_same_rows_both_ways_and_reports_both(tmp_path, monkeypatch, capsys):
    """bench_step_prep.py times a decode step's preparation with Transformers' read indices and with the block
    tables on one cache, and stops if the two name different rows."""
    import bench_step_prep

    monkeypatch.setattr(sys, "argv", ["bench_step_prep.py", "--requests", "3", "--contexts", "300", "600",
                                      "--steps", "1", "--out", str(tmp_path)])
    bench_step_prep.main()
    rows = json.loads((tmp_path / "step_prep_cpu.json").read_text())["rows"]
    assert [(r["requests"], r["context"], r["rows"]) for r in rows] == [(3, 300, 900), (3, 600, 1800)]
    assert all(r["token-indices_prepare_ms"] > 0 and r["block-tables_prepare_ms"] > 0 for r in rows)
    assert "| 3 | 600 | 1,800 |" in capsys.readouterr().out


def test_loop_split_accounts_every_step_of_the_cb_modes(tmp_path):
    """bench_serving.py --loop-split: each step's wall time split into phases on the generation thread, each phase
    timed once (a phase's own time excludes the phases it calls), the package's step plan among them; the A/B modes
    (without asynchronous batching; with Transformers' read indices) run beside the default one."""
    import bench_serving

    args = ["--model", "tiny", "--requests", "4", "--prompt-min", "3", "--prompt-max", "9", "--new", "3",
            "--cb-num-blocks", "64", "--cb-page-size", "16", "--cb-max-batch-tokens", "16", "--no-progress",
            "--loop-split", "--modes", "cb-flashinfer_mla", "cb-flashinfer_mla-sync", "cb-flashinfer_mla-token-indices"]
    assert bench_serving.main(args + CPU + ["--out", str(tmp_path)]) == 0
    results = json.loads((tmp_path / "serving_tiny.json").read_text())["results"]
    assert [r["status"] for r in results] == ["ok"] * 3
    for r in results:
        kinds = r["loop_split"]["kinds"]
        assert sum(k["steps"] for k in kinds.values()) == r["steps"]
        for k in kinds.values():
            phases = k["phases_ms"]
            assert set(phases) == set(r["loop_split"]["phases"]) and min(phases.values()) >= 0
            assert abs(sum(phases.values()) - k["wall_ms"]) < 1e-6 * max(1.0, k["wall_ms"]) + 1e-3
            assert phases["forward"] > 0 and phases["step plan"] > 0 and phases["batch tensors"] > 0
    assert results[0]["async_batching"] is False  # (a CPU: Transformers runs it on an accelerator only)
