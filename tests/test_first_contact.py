"""A new user's first contact, on a CPU machine: the README's install, quick start and first snippet, the example
(``python examples/generate.py``) and the CLI (``python -m hf_flashinfer_mla``): their help, their errors (a device
this machine does not have, bad dimensions, an unknown backend, a model path that does not exist: one line each, exit
status 2), the model-type names they use, the example's table and verdict, and torchrun's logs kept out of the temp
dir."""

from __future__ import annotations

import importlib.util
import os
import pathlib
import re
import shutil
import subprocess
import sys
import tempfile

import pytest
import torch
import transformers

from hf_flashinfer_mla import __main__ as cli

REPO = pathlib.Path(__file__).resolve().parents[1]
EXAMPLE = REPO / "examples" / "generate.py"
README = (REPO / "README.md").read_text()


def _env(**extra) -> dict[str, str]:
    """This process's environment as it is now (session fixtures have run), the checkout first on the path."""
    return {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]), **extra}


def _example():
    spec = importlib.util.spec_from_file_location("examples_generate", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _exit(main, argv, capsys) -> tuple[int, str, str]:
    """Run `main(argv)` in this process; ``(exit status, stdout, stderr)``."""
    with pytest.raises(SystemExit) as exc:
        main(argv)
    out, err = capsys.readouterr()
    return exc.value.code, out, err


def _section(title: str) -> str:
    return README.split(f"\n## {title}\n", 1)[1].split("\n## ", 1)[0]


def _code_blocks(text: str, lang: str) -> list[str]:
    return re.findall(rf"```{lang}\n(.*?)```", text, re.S)


def _commands(block: str) -> list[str]:
    return [line.split("#", 1)[0].strip() for line in block.splitlines() if line.split("#", 1)[0].strip()]


# --- command lines: prog, help texts, devices ------------------------------------------------------------------------


def _options_help(text: str) -> dict[str, str]:
    """The ``options:`` section of argparse's help, parsed: ``{invocation: help text}``."""
    section = re.split(r"\n(?:options|optional arguments):\n", text, maxsplit=1)[1].split("\n\n", 1)[0]
    entries: dict[str, str] = {}
    current = None
    for line in section.splitlines():
        entry = re.match(r"^  (-\S.*?)(?:\s{2,}(\S.*))?$", line)
        if entry:
            current = entry.group(1)
            entries[current] = entry.group(2) or ""
        else:
            assert current is not None and re.match(r"^\s{3,}\S", line), line
            entries[current] = f"{entries[current]} {line.strip()}".strip()
    return entries


@pytest.mark.parametrize("which", ["example", "cli"])
def test_help_shows_the_command_as_typed_and_explains_every_option(which, capsys):
    main, prog, expected = {
        "example": (_example().main, "python examples/generate.py",
                    {"--model", "--prompt", "--max-new-tokens", "--dtype", "--device", "--attn", "--repeats",
                     "--warmup", "--fp8-cache"}),
        "cli": (cli.main, "python -m hf_flashinfer_mla", {"--device", "--kv-lora-rank", "--rope-dim"}),
    }[which]
    status, out, _ = _exit(main, ["--help"], capsys)
    assert status == 0
    assert out.startswith(f"usage: {prog} "), out.splitlines()[0]
    assert "``" not in out and "__main__" not in out
    options = _options_help(out)
    named = {name.split()[0].rstrip(",") for invocation in options for name in invocation.split(", ")}
    assert expected <= named, named
    missing = [invocation for invocation, text in options.items() if not text]
    assert not missing, f"options without a help text: {missing}"


def _bad_devices():
    bad = ["nonsense", "cuda:99"]
    if not torch.cuda.is_available():
        bad.append("cuda")
    return bad


@pytest.mark.parametrize("which", ["example", "cli"])
@pytest.mark.parametrize("device", _bad_devices())
def test_a_device_this_machine_lacks_is_one_line_and_exit_2(which, device, capsys):
    main, prog = {"example": (_example().main, "python examples/generate.py"),
                  "cli": (cli.main, "python -m hf_flashinfer_mla")}[which]
    status, out, err = _exit(main, ["--device", device], capsys)
    assert status == 2
    assert out == ""
    assert err.count("\n") == 1 and err.startswith(f"{prog}: error: --device "), err
    assert "Traceback" not in err


@pytest.mark.parametrize("args, says", [
    (["--attn", "bogus"], "--attn bogus: not an attention implementation; choose among eager, "),
    (["--attn", "sdpa", "--fp8-cache"], "--fp8-cache gives flashinfer_mla the FP8 latent cache: add flashinfer_mla"),
], ids=["unknown-attn", "fp8-cache-without-flashinfer_mla"])
def test_the_examples_bad_options_are_one_line_and_exit_2(args, says, capsys):
    """An implementation name nobody registered (it ended in Transformers' traceback, whose list of names lacks
    flashinfer_mla), and --fp8-cache with no flashinfer_mla to give it to (it was ignored): one line, exit 2."""
    status, out, err = _exit(_example().main, args, capsys)
    assert status == 2 and out == "" and err.count("\n") == 1, err
    assert err.startswith(f"python examples/generate.py: error: {says}"), err
    if "bogus" in args:
        assert "flashinfer_mla" in err


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
@pytest.mark.parametrize("command", [[str(EXAMPLE)], ["-m", "hf_flashinfer_mla"]], ids=["example", "cli"])
def test_device_cuda_without_cuda_as_the_user_sees_it(command):
    """The whole stderr of the real process, as typed: one line, exit status 2, no traceback."""
    proc = subprocess.run([sys.executable, *command, "--device", "cuda"], cwd=REPO, env=_env(), capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.splitlines()
    assert len(lines) == 1 and "error: --device cuda: " in lines[0] and "--device cpu" in lines[0], proc.stderr
    assert proc.stdout == ""


@pytest.mark.parametrize("args, says", [
    (["--kv-lora-rank", "-5", "--rope-dim", "-1"], "--kv-lora-rank -5: the latent width must be at least 1"),
    (["--kv-lora-rank", "0"], "--kv-lora-rank 0: the latent width must be at least 1"),
    (["--rope-dim", "-1"], "--rope-dim -1: the rotary key width must be 0 or more"),
], ids=["negative-both", "zero-rank", "negative-rope"])
def test_the_clis_negative_dimensions_are_one_line_and_exit_2(args, says, capsys):
    """They printed a table of backends for a latent that cannot exist, and exited 0."""
    status, out, err = _exit(cli.main, ["--device", "cpu", *args], capsys)
    assert status == 2 and out == "" and err.count("\n") == 1, err
    assert err.startswith(f"python -m hf_flashinfer_mla: error: {says}"), err


def test_an_unknown_backend_in_the_environment_as_the_user_sees_it():
    """It ended in a raw traceback, where every other bad input of the command is one line."""
    proc = subprocess.run([sys.executable, "-m", "hf_flashinfer_mla", "--device", "cpu"], cwd=REPO,
                          env=_env(HF_FLASHINFER_MLA_BACKEND="nonsense"), capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("python -m hf_flashinfer_mla: error: "), proc.stderr
    assert "'nonsense'" in lines[0] and "$HF_FLASHINFER_MLA_BACKEND" in lines[0] and "reference" in lines[0]
    assert proc.stdout == ""


def test_an_unknown_backend_for_the_example_as_the_user_sees_it():
    """About 30 lines of traceback ended in the clear message: now the message alone, exit status 2."""
    proc = subprocess.run([sys.executable, str(EXAMPLE), "--device", "cpu"], cwd=REPO,
                          env=_env(HF_FLASHINFER_MLA_BACKEND="fa4"), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.splitlines()
    assert len(lines) == 1 and "'fa4'" in lines[0] and "$HF_FLASHINFER_MLA_BACKEND" in lines[0], proc.stderr
    assert proc.stdout == ""


def test_the_cli_and_the_errors_name_models_as_checkpoints_do(capsys):
    """One set of model-type names: those of a checkpoint's config.json ("glm5_next", not its text model's
    "glm5_next_text"), in `python -m hf_flashinfer_mla` and in the refusal of an unsupported model."""
    from hf_flashinfer_mla import UnsupportedModelError
    from hf_flashinfer_mla.models import CHECKPOINT_MODEL_TYPES, SPARSE_MLA_MODEL_TYPES, check_model_supported

    for name in ("glm5_next", "hy_v4_vl", "mistral_large4", "dots3_note", "deepseek_v3", "kimi_k25"):
        assert name in CHECKPOINT_MODEL_TYPES
    assert not [name for name in CHECKPOINT_MODEL_TYPES if name.endswith("_text")]
    assert {name for name in SPARSE_MLA_MODEL_TYPES if name.endswith("_text")}  # what the attention's configs say
    cli.main(["--device", "cpu"])
    listed = next(line for line in capsys.readouterr().out.splitlines() if line.startswith("model types"))
    assert listed.split(": ", 1)[1].split(", ") == list(CHECKPOINT_MODEL_TYPES)
    llama = transformers.LlamaConfig(vocab_size=32, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                     num_attention_heads=4, num_key_value_heads=4)
    with pytest.raises(UnsupportedModelError) as refused:
        check_model_supported(llama)
    assert f"Supported model types: {', '.join(CHECKPOINT_MODEL_TYPES)}." in str(refused.value)
    assert "_text" not in str(refused.value)
    for model_type in CONFIG_TYPES_WITH_MLA_TEXT:  # every one of them exists in this Transformers
        assert model_type in transformers.models.auto.configuration_auto.CONFIG_MAPPING_NAMES


CONFIG_TYPES_WITH_MLA_TEXT = ("glm5_next", "hy_v4_vl", "mistral_large4", "dots3_note", "kimi_k25")


@pytest.mark.parametrize("args, says", [
    (["--model", "/nonexistent/path"], "--model /nonexistent/path: no such directory; give a local checkpoint"),
    (["--model", "./nope"], "--model ./nope: no such directory"),
    (["--prompt", "The capital of France is"], "--prompt needs --model"),
], ids=["absolute", "relative", "prompt-without-model"])
def test_the_examples_model_and_prompt_errors_are_one_line_and_exit_2(args, says, capsys):
    """A path that does not exist ended in a 33-line traceback about repo ids that never said so; --prompt without
    --model was ignored without a word."""
    status, out, err = _exit(_example().main, [*args, "--device", "cpu"], capsys)
    assert status == 2 and out == "" and err.count("\n") == 1, err
    assert err.startswith(f"python examples/generate.py: error: {says}"), err


def test_the_examples_model_must_be_a_checkpoint_directory(tmp_path, capsys):
    (tmp_path / "weights.bin").write_text("")
    for path, says in ((tmp_path, "the directory has no config.json"), (tmp_path / "weights.bin", "not a directory")):
        status, out, err = _exit(_example().main, ["--model", str(path), "--device", "cpu"], capsys)
        assert status == 2 and err.count("\n") == 1 and f"--model {path}: {says}" in err, err


def test_a_model_path_that_does_not_exist_as_the_user_sees_it():
    proc = subprocess.run([sys.executable, str(EXAMPLE), "--model", "/nonexistent/path", "--device", "cpu"], cwd=REPO,
                          env=_env(), capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.splitlines()
    assert len(lines) == 1 and "error: --model /nonexistent/path: no such directory" in lines[0], proc.stderr
    assert proc.stdout == ""


# --- the example's output --------------------------------------------------------------------------------------------

VERDICT = re.compile(
    r"^verdict: flashinfer_mla vs eager: max \|logit diff\| (?P<ours>\S+)(?: \(over the \d+ positions with the same "
    r"context\))?, tokens differ in (?P<k>\d+) of (?P<n>\d+) positions; sdpa vs eager \(Transformers' own spread\): "
    r"(?P<theirs>\S+)(?: \(over the \d+ positions with the same context\))?, (?P<k2>\d+) of (?P<n2>\d+)$", re.M)


def test_example_prints_a_side_by_side_table_and_a_verdict_with_the_yardstick(capsys):
    argv = ["--device", "cpu", "--dtype", "float32", "--max-new-tokens", "3", "--repeats", "2", "--warmup", "1"]
    assert _example().main(argv) == 0
    out = capsys.readouterr().out
    assert "ms per decode step (median of 2)" in out
    for attn in ("flashinfer_mla", "eager", "sdpa"):
        assert re.search(rf"^{attn}\s+\d+\.\d+\s+\d+\.\d+x$", out, re.M), (attn, out)
    # Each row's tokens: the three implementations on consecutive lines.
    tokens = r"\s+\d+\*?(?: \d+\*?){2}"  # 3 new tokens, * where one differs from eager's
    for row in range(3):
        assert re.search(rf"^row {row}\s+flashinfer_mla{tokens}\n\s+eager{tokens}\n\s+sdpa{tokens}$", out, re.M), out
    verdict = VERDICT.search(out)
    assert verdict, out
    assert verdict["n"] == verdict["n2"] == "9"  # 3 rows x 3 new tokens
    assert verdict["k"] == verdict["k2"] == "0"  # float32: tokens equal
    assert float(verdict["ours"]) < 1e-4 and float(verdict["theirs"]) < 1e-4
    assert "DIFFER" not in out


def test_example_in_float64_names_eagers_nan_and_compares_per_row(capsys):
    argv = ["--device", "cpu", "--dtype", "float64", "--max-new-tokens", "3", "--repeats", "1", "--warmup", "0"]
    assert _example().main(argv) == 0
    out = capsys.readouterr().out
    assert "NaN logits on the left-padded row(s) 1, 2" in out and "known Transformers issue" in out, out
    assert "each prompt generated alone, unpadded" in out
    verdict = VERDICT.search(out)
    assert verdict and verdict["k"] == "0" and verdict["k2"] == "0", out
    assert float(verdict["ours"]) < 1e-5, out  # eager's softmax runs in float32, even in float64
    assert "DIFFER" not in out and "nan" not in verdict[0]


# --- the README ------------------------------------------------------------------------------------------------------


def test_readme_install_works_from_a_checkout_and_says_it_is_not_on_pypi():
    install = _section("Install")
    first = _commands(_code_blocks(install, "bash")[0])[0]
    assert first.startswith("pip install -e "), first
    assert "not on PyPI" in install


def test_readme_lighter_route_installs_what_the_package_needs_but_flashinfer():
    """Its commands (which .ci/run runs as written, in a venv of their own) install the package without its
    dependencies, then every dependency pyproject.toml names but torch (installed before) and FlashInfer, as pyproject
    names it; then the server's packages."""
    import shlex

    route = _code_blocks(_section("Install").split("**Lighter CPU route**", 1)[1], "bash")[0]
    commands = [shlex.split(command) for command in _commands(route)]
    pyproject = (REPO / "pyproject.toml").read_text()
    dependencies = re.findall(r'"([^"]+)"', pyproject.split("\ndependencies = [", 1)[1].split("\n]", 1)[0])
    assert commands[0] == ["pip", "install", "--no-deps", "-e", "."], commands
    assert commands[1][:2] == ["pip", "install"] and sorted(commands[1][2:]) == sorted(
        d for d in dependencies if not d.startswith(("torch", "flashinfer"))), (commands, dependencies)
    assert commands[2] == ["pip", "install", "transformers[serving]"] and len(commands) == 3, commands


def test_readme_quick_start_is_the_example_and_the_tests():
    blocks = _code_blocks(_section("Quick start"), "bash")
    assert _commands(blocks[0]) == ["python examples/generate.py", "python -m pytest -q tests"]


def _tiny_checkpoint(path: pathlib.Path) -> None:
    """A small random DeepSeek-V3 model and a word-level tokenizer, both built offline."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    words = ["<unk>", "<pad>", "<eos>", *"the capital of france is paris".split()]
    words += [f"w{i}" for i in range(64 - len(words))]
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    transformers.PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", pad_token="<pad>",
                                         eos_token="<eos>").save_pretrained(path)
    config = transformers.DeepseekV3Config(
        vocab_size=64, hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=4, n_routed_experts=4, num_experts_per_tok=2, n_shared_experts=1,
        n_group=1, topk_group=1, first_k_dense_replace=1, kv_lora_rank=32, q_lora_rank=24, qk_rope_head_dim=8,
        qk_nope_head_dim=16, v_head_dim=16, max_position_embeddings=512, pad_token_id=1, eos_token_id=2,
        bos_token_id=None)
    torch.manual_seed(0)
    transformers.AutoModelForCausalLM.from_config(config).save_pretrained(path)


def test_readme_first_snippet_runs_as_pasted(tmp_path, capsys):
    """The README's first snippet, with its placeholder path replaced by a tiny local checkpoint (and fewer tokens)."""
    code = _code_blocks(README, "python")[0]
    placeholder = re.search(r'^path = "([^"]+)"', code, re.M)
    assert placeholder and "/path/to/" in placeholder[1], code
    _tiny_checkpoint(tmp_path)
    code = code.replace(placeholder[1], str(tmp_path)).replace("max_new_tokens=256", "max_new_tokens=4")
    namespace = {"__name__": "__main__"}
    exec(compile(code, "README.md snippet", "exec"), namespace)  # noqa: S102
    assert namespace["model"].config._attn_implementation == "eager"  # its last line switches back
    assert namespace["out"].shape[1] == namespace["inputs"]["input_ids"].shape[1] + 4
    assert capsys.readouterr().out.strip()


# --- the suite's own leftovers ---------------------------------------------------------------------------------------


def test_torchrun_logs_land_in_the_pytest_temp_dir(tmp_path, tmp_path_factory):
    """torchrun's default log dir is a new ``torchelastic_*`` in the system temp dir, never removed; the suite's
    session fixture (conftest.py) sends it into pytest's temp dir, which pytest prunes."""
    chosen = os.environ.get("PET_LOG_DIR")
    if chosen and not pathlib.Path(chosen).is_relative_to(tmp_path_factory.getbasetemp()):
        pytest.skip("PET_LOG_DIR was set before the session: torchrun logs where the user asked")
    script = tmp_path / "noop.py"
    script.write_text("print('ok')\n")
    proc = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "1", str(script)],
        env=_env(LOGLEVEL="INFO"), capture_output=True, text=True, timeout=120,
    )
    found = re.search(r"log_dir\s*:\s*(\S+)", proc.stderr)
    assert proc.returncode == 0 and found, proc.stderr[-3000:]
    log_dir = pathlib.Path(found[1])
    leaked = log_dir.parent == pathlib.Path(tempfile.gettempdir()) and log_dir.name.startswith("torchelastic_")
    if leaked:
        shutil.rmtree(log_dir, ignore_errors=True)  # this test's own leftover, not another run's
    assert not leaked, log_dir
    assert log_dir.is_relative_to(tmp_path_factory.getbasetemp()), log_dir
