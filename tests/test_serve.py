"""``python -m hf_flashinfer_mla.serve``: Transformers' OpenAI-style server with continuous batching over the paged
latent cache, on the CPU, and what it does with bad requests: refused ones, capped answers, failures it survives.

Two server processes (127.0.0.1, free ports) serve a small random DeepSeek-V3-style model saved to a temporary
folder, with a WordLevel tokenizer built offline: one with continuous batching, one with generate() and a shorter
--max-model-len. Both import a test-only fault hook (a sitecustomize on their path) that makes the model's forward
raise for a marker prompt. Every wait is bounded (server start, each request), so a hung server fails the test
instead of hanging the suite, and each server is stopped by its PID.
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import os
import re
import socket
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch

pytest.importorskip("fastapi", reason="transformers serve needs its [serving] extra (pip install -e '.[test]')")
pytest.importorskip("uvicorn")
httpx = pytest.importorskip("httpx")

from helpers import VOCAB, make_model  # noqa: E402
from hf_flashinfer_mla import UnsupportedModelError  # noqa: E402

pytestmark = pytest.mark.server

API_KEY_ENV = "HF_FLASHINFER_MLA_API_KEY"
START_TIMEOUT = 120  # seconds for the server process to import, load and answer /health
REQUEST_TIMEOUT = 60
NEW_TOKENS = 6
ROOT = Path(__file__).resolve().parents[1]


def _tiny_checkpoint():
    """``examples/tiny_checkpoint.py`` (the README's serving quick start makes its checkpoint with it)."""
    spec = importlib.util.spec_from_file_location("tiny_checkpoint", ROOT / "examples" / "tiny_checkpoint.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def save_model(path: Path, model_type: str = "deepseek_v3", model=None) -> None:
    """A tiny random model of `model_type` (or `model`), saved with the quick start's word-level tokenizer and chat
    template over the words w1 ... w93: word wi is token i, as `MARKER` counts on."""
    model = make_model(model_type, dtype=torch.float32) if model is None else model
    _tiny_checkpoint().save_checkpoint(path, model, words=[f"w{i}" for i in range(1, VOCAB - 3)])


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# A test-only fault: every process of a server started with `FAULT_HOOK` on its path imports this sitecustomize, which
# makes the model's forward raise for any input holding the marker's tokens (four in a row: a generated token never
# brings more than one per request and step). The failing request's error names it, which proves it was injected.
MARKER = "w91 w92 w93 w91"
FAULT = "injected fault: the prompt holds the marker"
FAULT_HOOK = f"""
import os

MARKER = [91, 92, 93, 91]  # {MARKER!r} in the tokenizer of save_model


def _install():
    from transformers.models.deepseek_v3 import modeling_deepseek_v3 as modeling

    forward = modeling.DeepseekV3ForCausalLM.forward

    def failing_forward(self, *args, **kwargs):
        ids = kwargs.get("input_ids", args[0] if args else None)
        tokens = [] if ids is None else ids.flatten().tolist()
        if any(tokens[i : i + len(MARKER)] == MARKER for i in range(len(tokens))):
            raise RuntimeError({FAULT!r})
        return forward(self, *args, **kwargs)

    modeling.DeepseekV3ForCausalLM.forward = failing_forward


_install()
"""


def stop_server(process: subprocess.Popen) -> None:
    """End a server process: asked first, killed if it does not end within 10 s."""
    process.terminate()
    try:
        process.wait(timeout=10)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait(timeout=10)


@contextlib.contextmanager
def serving(path: Path, *options: str, log_name: str = "server.log", fault_hook: Path | None = None,
            pinned: bool = True, env: dict | None = None):
    """``(url, process)`` of ``python -m hf_flashinfer_mla.serve path`` on 127.0.0.1 (CPU, float32), once it answers
    /health; stopped by its PID when the block ends. Not `pinned`: without the model argument (each request names
    its model; `path` holds the log), with `env` added to the environment."""
    port = free_port()
    paths = [str(ROOT), *([str(fault_hook)] if fault_hook else []), os.environ.get("PYTHONPATH", "")]
    inherited = {name: value for name, value in os.environ.items() if name != API_KEY_ENV}
    env = {**inherited, **(env or {}), "PYTHONPATH": os.pathsep.join(paths)}
    log = open(path / log_name, "w")
    process = subprocess.Popen(
        [sys.executable, "-m", "hf_flashinfer_mla.serve", *([str(path)] if pinned else []), "--host", "127.0.0.1",
         "--port", str(port), "--device", "cpu", "--dtype", "float32", *options],
        env=env, stdout=log, stderr=subprocess.STDOUT,
    )
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + START_TIMEOUT
    try:
        while True:
            if process.poll() is not None:
                pytest.fail(f"the server exited with {process.returncode}:\n{(path / log_name).read_text()}")
            try:
                if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                pytest.fail(f"the server did not start in {START_TIMEOUT} s:\n{(path / log_name).read_text()}")
            time.sleep(0.5)
        yield url, process
    finally:
        stop_server(process)
        log.close()


@pytest.fixture(scope="module")
def fault_hook(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("fault_hook")
    (folder / "sitecustomize.py").write_text(FAULT_HOOK)
    return folder


@pytest.fixture(scope="module")
def model_path(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("mla_model")
    save_model(path)
    return path


@pytest.fixture(scope="module")
def server(model_path, fault_hook):
    """Continuous batching, on the model's own context (max_position_embeddings 256)."""
    with serving(model_path, "--continuous-batching", "--cb-block-size", "16", "--cb-num-blocks", "64",
                 "--cb-max-batch-tokens", "64", fault_hook=fault_hook) as (url, process):
        yield url, model_path, process


GENERATE_CONTEXT = 64  # --max-model-len of the server without continuous batching


@pytest.fixture(scope="module")
def generate_server(model_path, fault_hook):
    """Transformers' other path, one generate() at a time, with a context shorter than the model's."""
    with serving(model_path, "--max-model-len", str(GENERATE_CONTEXT), log_name="generate_server.log",
                 fault_hook=fault_hook) as (url, process):
        yield url, model_path, process


@pytest.fixture(scope="module")
def expected(model_path):
    """Each test prompt's words from eager generate() on the same checkpoint and chat template."""
    from transformers import AutoTokenizer, DeepseekV3ForCausalLM

    path = model_path
    tokenizer = AutoTokenizer.from_pretrained(path)
    model = DeepseekV3ForCausalLM.from_pretrained(path, attn_implementation="eager", dtype=torch.float32).eval()

    def words(content: str, new_tokens: int = NEW_TOKENS) -> list[str]:
        ids = tokenizer.apply_chat_template([{"role": "user", "content": content}], add_generation_prompt=True,
                                            return_tensors="pt", return_dict=True)["input_ids"]
        out = model.generate(ids, max_new_tokens=new_tokens, do_sample=False, eos_token_id=None, pad_token_id=0)
        return tokenizer.decode(out[0, ids.shape[1]:], skip_special_tokens=True).split()  # as the server decodes

    return words


def chat(url, content, stream, max_tokens=NEW_TOKENS) -> list[str]:
    body = {"model": "x", "messages": [{"role": "user", "content": content}], "max_tokens": max_tokens,
            "temperature": 0, "stream": stream}
    body["model"] = url[1]
    if not stream:
        response = httpx.post(f"{url[0]}/v1/chat/completions", json=body, timeout=REQUEST_TIMEOUT)
        assert response.status_code == 200, response.text
        return response.json()["choices"][0]["message"]["content"].split()
    text = []
    with httpx.stream("POST", f"{url[0]}/v1/chat/completions", json=body, timeout=REQUEST_TIMEOUT) as response:
        assert response.status_code == 200
        for line in response.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                delta = json.loads(line[6:])["choices"][0]["delta"]
                text.append(delta.get("content") or "")
    return "".join(text).split()


def test_concurrent_chat_completions_match_generate(server, expected):
    url, path, _ = server
    contents = ["w3 w4 w5", "w10 w11 w12 w13 w14 w15 w16 w17 w18", "w7", "w20 w21 w22 w23 w24 w25"]
    target = (url, str(path))
    with ThreadPoolExecutor(len(contents)) as pool:
        futures = [pool.submit(chat, target, c, stream=i % 2 == 0) for i, c in enumerate(contents)]
        got = [f.result(timeout=REQUEST_TIMEOUT) for f in futures]
    assert got == [expected(c) for c in contents]


def test_malformed_request_gets_4xx_and_server_keeps_serving(server, expected):
    url, path, _ = server
    bad = httpx.post(f"{url}/v1/chat/completions", content=b"{not json", timeout=REQUEST_TIMEOUT,
                     headers={"content-type": "application/json"})
    assert 400 <= bad.status_code < 500
    unknown = httpx.post(f"{url}/v1/chat/completions", timeout=REQUEST_TIMEOUT,
                         json={"model": str(path), "messages": [{"role": "user", "content": "w3"}], "bogus": 1})
    assert unknown.status_code == 422
    # (Transformers 5.24's own handler answers a body without "messages" with a 500, a KeyError: serve.py checks it.)
    for body in ({"model": str(path)}, {"model": str(path), "messages": []}, {"model": str(path), "messages": "w3"}):
        missing = httpx.post(f"{url}/v1/chat/completions", json=body, timeout=REQUEST_TIMEOUT)
        assert missing.status_code == 422 and "messages" in missing.text, (body, missing.status_code)
    assert chat((url, str(path)), "w3 w4 w5", stream=False) == expected("w3 w4 w5")


def test_client_disconnecting_mid_stream_leaves_server_healthy(server, expected):
    url, path, _ = server
    body = {"model": str(path), "messages": [{"role": "user", "content": "w40 w41"}], "max_tokens": 200,
            "temperature": 0, "stream": True}
    with httpx.stream("POST", f"{url}/v1/chat/completions", json=body, timeout=REQUEST_TIMEOUT) as response:
        for line in response.iter_lines():
            if line.startswith("data: "):
                break  # one chunk, then the connection is closed
    assert httpx.get(f"{url}/health", timeout=REQUEST_TIMEOUT).status_code == 200
    assert chat((url, str(path)), "w9 w8", stream=True) == expected("w9 w8")


def test_unservable_model_fails_at_server_start(tmp_path):
    """A hybrid (linear-attention layers) cannot be served by continuous batching: the server refuses it while
    loading it, before any request, and exits naming why (Transformers 5.24 loads it in the server's process, 5.25
    in a spawned model process whose fatal error stops the server). Without continuous batching the same
    checkpoint serves (generate() runs every layer type)."""
    save_model(tmp_path, "kimi_linear")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    cmd = [sys.executable, "-m", "hf_flashinfer_mla.serve", str(tmp_path), "--host", "127.0.0.1", "--device", "cpu",
           "--dtype", "float32"]
    refused = subprocess.run([*cmd, "--continuous-batching", "--port", str(free_port())], env=env,
                             capture_output=True, text=True, timeout=START_TIMEOUT)
    assert refused.returncode != 0
    assert UnsupportedModelError.__name__ in refused.stdout + refused.stderr
    assert "linear_attention" in refused.stdout + refused.stderr
    port = free_port()
    served = subprocess.Popen([*cmd, "--port", str(port)], env=env, stdout=subprocess.DEVNULL,
                              stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + START_TIMEOUT
        while served.poll() is None and time.monotonic() < deadline:
            try:
                if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                time.sleep(0.5)
        assert served.poll() is None, "the server without continuous batching exited"
        assert chat((f"http://127.0.0.1:{port}", str(tmp_path)), "w1 w2", stream=False)
    finally:
        served.kill()
        served.wait()


# --- requests the server refuses, answers it caps, errors it survives ------------------------------------------------

def answer(url: str, body: dict, stream: bool) -> dict:
    """A chat completion's outcome: ``status``, and ``words``, ``finish_reason``, ``prompt`` and ``tokens`` (its
    usage) for an answer, ``error`` for an error (the body's, or a stream's error event)."""
    if not stream:
        response = httpx.post(f"{url}/v1/chat/completions", json=body, timeout=REQUEST_TIMEOUT)
        data = response.json()
        if response.status_code != 200:
            return {"status": response.status_code, "error": data.get("error")}
        choice = data["choices"][0]
        return {"status": 200, "words": choice["message"]["content"].split(), "finish_reason": choice["finish_reason"],
                "prompt": data["usage"]["prompt_tokens"], "tokens": data["usage"]["completion_tokens"], "error": None}
    body = {**body, "stream": True, "stream_options": {"include_usage": True}}
    text, outcome = [], {"status": 200, "finish_reason": None, "prompt": None, "tokens": None, "error": None}
    with httpx.stream("POST", f"{url}/v1/chat/completions", json=body, timeout=REQUEST_TIMEOUT) as response:
        if response.status_code != 200:
            response.read()
            return {"status": response.status_code, "error": response.json().get("error")}
        for line in response.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[6:])
            if "error" in event:
                outcome["error"] = event["error"]
            usage = event.get("usage")
            if usage:
                outcome["prompt"], outcome["tokens"] = usage["prompt_tokens"], usage["completion_tokens"]
            for choice in event.get("choices") or []:
                text.append(choice["delta"].get("content") or "")
                outcome["finish_reason"] = choice.get("finish_reason") or outcome["finish_reason"]
    return {**outcome, "words": "".join(text).split()}


def healthy(url: str, process) -> bool:
    return process.poll() is None and httpx.get(f"{url}/health", timeout=REQUEST_TIMEOUT).status_code == 200


BAD_SETTINGS = [
    ({"max_tokens": -1}, "max_tokens"),
    ({"max_tokens": 0}, "max_tokens"),  # (Transformers answered it with an empty answer)
    ({"max_tokens": "12"}, "max_tokens"),
    ({"max_tokens": 2.5}, "max_tokens"),
    ({"max_tokens": True}, "max_tokens"),
    ({"max_completion_tokens": -3}, "max_completion_tokens"),
    ({"temperature": -1}, "temperature"),
    ({"temperature": "hot"}, "temperature"),
    ({"top_p": 5}, "top_p"),
    ({"top_p": 0}, "top_p"),
    ({"n": 0}, "n"),
    ({"frequency_penalty": -1.5}, "frequency_penalty"),
    ({"generation_config": json.dumps({"top_k": -1})}, "generation_config.top_k"),
    ({"generation_config": json.dumps({"max_new_tokens": 0})}, "generation_config.max_new_tokens"),
    ({"generation_config": json.dumps({"temperature": -0.5})}, "generation_config.temperature"),
    ({"generation_config": "{not json"}, "generation_config"),
    ({"max_tokens": -1, "stream": True}, "max_tokens"),
]


@pytest.mark.parametrize("settings, field", BAD_SETTINGS, ids=[json.dumps(s) for s, _ in BAD_SETTINGS])
def test_bad_sampling_settings_get_400_naming_the_field(server, settings, field):
    """Transformers answered these 200 (an empty answer for max_tokens -1, sampling anyway for a negative temperature
    or a top_p of 5), or 500 (a generation_config that is not JSON)."""
    url, path, _ = server
    body = {"model": str(path), "messages": [{"role": "user", "content": "w3"}], **settings}
    response = httpx.post(f"{url}/v1/chat/completions", json=body, timeout=REQUEST_TIMEOUT)
    assert response.status_code == 400, response.text
    error = response.json()["error"]  # OpenAI's error shape
    assert error["type"] == "invalid_request_error" and error["param"] == field, error
    assert f"`{field}`" in error["message"], error


def test_the_other_endpoints_refuse_bad_settings_too_and_the_server_keeps_serving(server, expected):
    url, path, process = server
    for endpoint, body, field in [
        ("completions", {"prompt": "w3 w4", "max_tokens": -1}, "max_tokens"),
        ("completions", {"prompt": "w3 w4", "top_p": 5}, "top_p"),
        ("responses", {"input": "w3 w4", "max_output_tokens": 0}, "max_output_tokens"),
        ("responses", {"input": "w3 w4", "temperature": -2}, "temperature"),
    ]:
        response = httpx.post(f"{url}/v1/{endpoint}", json={"model": str(path), **body}, timeout=REQUEST_TIMEOUT)
        assert response.status_code == 400 and response.json()["error"]["param"] == field, (endpoint, response.text)
    # (Transformers read the body's "input" unchecked: a KeyError, a 500)
    response = httpx.post(f"{url}/v1/responses", json={"model": str(path)}, timeout=REQUEST_TIMEOUT)
    assert response.status_code == 422 and response.json()["error"]["param"] == "input", response.text
    assert healthy(url, process)
    assert chat((url, str(path)), "w3 w4 w5", stream=True) == expected("w3 w4 w5")


@pytest.mark.parametrize("which, context", [("server", 256), ("generate_server", GENERATE_CONTEXT)],
                         ids=["continuous-batching", "generate"])
def test_answers_stop_at_the_context_and_the_server_keeps_serving(which, context, request, expected):
    """max_tokens 10**9 made continuous batching's worker fail (its cache cannot hold that much) and the server exit;
    without max_tokens Transformers' default of 1,024 new tokens ran past a 256-token model's context. Both are capped
    at the context (the model's max_position_embeddings, or --max-model-len), minus the prompt, and say "length"."""
    url, path, process = request.getfixturevalue(which)
    base = {"model": str(path), "messages": [{"role": "user", "content": "w3 w4 w5"}], "temperature": 0}
    for settings, stream in (({"max_tokens": 10**9}, False), ({}, True)):
        got = answer(url, {**base, **settings}, stream)
        assert got["status"] == 200 and got["error"] is None, (settings, stream, got)
        assert got["finish_reason"] == "length", (settings, stream, got)
        assert got["prompt"] + got["tokens"] == context, (settings, stream, got)
    assert healthy(url, process)
    assert chat((url, str(path)), "w3 w4 w5", stream=False) == expected("w3 w4 w5")
    assert chat((url, str(path)), "w9 w8", stream=True) == expected("w9 w8")


def test_a_prompt_longer_than_the_context_gets_400(generate_server, expected):
    url, path, process = generate_server
    words = " ".join(f"w{i % 90 + 1}" for i in range(GENERATE_CONTEXT + 5))
    for stream in (False, True):
        got = answer(url, {"model": str(path), "messages": [{"role": "user", "content": words}], "max_tokens": 4},
                     stream)
        assert got["status"] == 400 and "prompt" in got["error"]["message"], got
    assert healthy(url, process)
    assert chat((url, str(path)), "w3 w4 w5", stream=False) == expected("w3 w4 w5")


def test_a_request_failing_in_generate_fails_alone(generate_server, expected):
    """generate() runs one request at a time: the request whose forward raises (the fault hook) gets its error, a 500
    or an error event on its stream, naming the fault; the requests around it get eager's tokens."""
    url, path, process = generate_server
    failing = {"model": str(path), "messages": [{"role": "user", "content": MARKER}], "max_tokens": 4}
    contents = ["w3 w4 w5", "w7", "w20 w21 w22 w23", "w9 w8"]
    with ThreadPoolExecutor(len(contents) + 2) as pool:
        faults = [pool.submit(answer, url, failing, stream) for stream in (False, True)]
        others = [pool.submit(chat, (url, str(path)), c, stream=i % 2 == 0) for i, c in enumerate(contents)]
        plain, streamed = (f.result(timeout=REQUEST_TIMEOUT) for f in faults)
        got = [f.result(timeout=REQUEST_TIMEOUT) for f in others]
    assert plain["status"] == 500 and FAULT in plain["error"]["message"], plain
    assert streamed["status"] == 200 and FAULT in json.dumps(streamed["error"]), streamed
    assert got == [expected(c) for c in contents]
    assert healthy(url, process)


def test_continuous_batching_replaces_a_worker_that_failed(server, expected):
    """An error in a step of continuous batching killed its worker, and Transformers then stopped the server. The
    fault hook's request fails, a 500 or an error event naming the fault, the runner starts a new worker, and the
    server goes on: later requests, concurrent, get eager's tokens."""
    url, path, process = server
    failing = {"model": str(path), "messages": [{"role": "user", "content": MARKER}], "max_tokens": 4}
    for stream in (False, True):
        got = answer(url, failing, stream)
        assert FAULT in json.dumps(got["error"]), got
        assert got["status"] == (200 if stream else 500), got
        assert healthy(url, process)
    contents = ["w3 w4 w5", "w10 w11 w12 w13 w14 w15 w16 w17 w18", "w7", "w20 w21 w22 w23 w24 w25"]
    with ThreadPoolExecutor(len(contents)) as pool:
        futures = [pool.submit(chat, (url, str(path)), c, stream=i % 2 == 0) for i, c in enumerate(contents)]
        got = [f.result(timeout=REQUEST_TIMEOUT) for f in futures]
    assert got == [expected(c) for c in contents]
    assert healthy(url, process)


LONG = 40  # new tokens of the requests around a failing one


def test_under_continuous_batching_a_failing_request_fails_alone(server, expected):
    """One forward runs every request of a step, so the fault hook's request failed the requests that shared its
    steps. Those run again alone, through generate(): they get eager's tokens, streamed or not, and the request at
    fault gets its own error. The server log shows that the fault reached more requests than its own (each failed
    one is named as it runs again), so the requests around it were in its step. (Transformers 5.25's runner and
    5.24's manager each take their own path there.)"""
    url, path, process = server
    log = path / "server.log"
    before = log.read_text().count("it runs again alone")
    failing = {"model": str(path), "messages": [{"role": "user", "content": MARKER}], "max_tokens": 4}
    contents = ["w3 w4 w5", "w10 w11 w12 w13 w14 w15 w16 w17 w18", "w7", "w20 w21 w22 w23 w24 w25"]
    with ThreadPoolExecutor(len(contents) + 2) as pool:
        # (long answers: the others are still decoding when the failing requests join their steps)
        others = [pool.submit(chat, (url, str(path)), c, stream=i % 2 == 0, max_tokens=LONG)
                  for i, c in enumerate(contents)]
        time.sleep(0.05)
        faults = [pool.submit(answer, url, failing, stream) for stream in (False, True)]
        got = [f.result(timeout=REQUEST_TIMEOUT) for f in others]
        plain, streamed = (f.result(timeout=REQUEST_TIMEOUT) for f in faults)
    assert got == [expected(c, LONG) for c in contents]
    assert plain["status"] == 500 and FAULT in plain["error"]["message"], plain
    assert streamed["status"] == 200 and FAULT in json.dumps(streamed["error"]), streamed
    ran_again = log.read_text().count("it runs again alone") - before
    assert ran_again > 2, f"only {ran_again} requests ran again: the fault reached no other request"
    assert healthy(url, process)


def test_what_a_request_keeps_to_run_again_goes_when_it_ends_or_is_cancelled():
    """The runner keeps each continuous-batching request's inputs while it runs, to run it again alone if its step
    fails. A request that ends gives them back through its result; a cancelled one ends with no result (Transformers
    drops its outputs), so the cancel itself must: otherwise a long-running server keeps every cancelled prompt."""
    if not hasattr(_serving_utils(), "CBGenerateRunner"):
        pytest.skip("Transformers 5.24's continuous batching server runs no request again")
    import threading
    from types import SimpleNamespace

    from hf_flashinfer_mla import serve_recovery

    class Runner:  # (CBGenerateRunner's surface that the wrapper reads)
        def __init__(self, model, processor, send_results, cb_config, context_length=None):
            self.lock, self.send_results, self.cancelled = threading.Lock(), send_results, []
            self.manager = SimpleNamespace(background_thread_status=SimpleNamespace(fatal_error=None))

        def generate(self, request_id, inputs, generation_kwargs, stream):
            pass

        def cancel(self, request_id):
            self.cancelled.append(request_id)

    serve_recovery._install_worker_restart_525(Runner)
    sent = []
    runner = Runner(None, None, lambda *args: sent.append(args), None)
    for request_id in (7, 8):
        runner.generate(request_id, {"input_ids": [1, 2, 3]}, {"max_new_tokens": 4}, False)
    assert set(runner._flashinfer_mla_requests) == {7, 8}
    runner.send_results([], [], [(8, [5, 6, 7, 8])])  # 8 ends with its tokens
    runner.cancel(7)
    assert runner.cancelled == [7] and sent == [([], [], [(8, [5, 6, 7, 8])])]
    assert runner._flashinfer_mla_requests == {}


def test_a_request_cancelled_while_the_worker_is_replaced_leaves_the_others_to_run_again(monkeypatch):
    """Transformers 5.25+: the requests of a failed step run again after their worker is replaced; one cancelled
    meanwhile (a client gone) has nothing kept to run again. It is skipped, and the others still run again: reading
    it raised in the outputs thread, and the requests after it were never answered."""
    if not hasattr(_serving_utils(), "CBGenerateRunner"):
        pytest.skip("Transformers 5.24's manager runs requests again on its own path (the test below)")
    import threading
    from types import SimpleNamespace

    from hf_flashinfer_mla import serve_recovery

    def worker():
        return SimpleNamespace(background_thread_status=SimpleNamespace(fatal_error=None), stop=lambda **_: None)

    class Runner:  # (CBGenerateRunner's surface that the wrapper reads)
        def __init__(self, model, processor, send_results, cb_config, context_length=None):
            self.lock, self.send_results, self.manager = threading.Lock(), send_results, worker()

        def generate(self, request_id, inputs, generation_kwargs, stream):
            pass

        def cancel(self, request_id):
            pass

        def _start_continuous_batching(self, model, cb_config, context_length):
            self.cancel(7)  # (the client of request 7 goes while the new worker starts)
            return worker()

    serve_recovery._install_worker_restart_525(Runner)
    ran_again = []
    monkeypatch.setattr(_serving_utils().GenerateRunner, "generate",
                        lambda self, request_id, inputs, kwargs, stream: ran_again.append(request_id))
    answered = []
    runner = Runner(None, None, lambda *args: answered.append(args), None)
    for request_id in (7, 8):
        runner.generate(request_id, {"input_ids": [1, 2, 3]}, {"max_new_tokens": 4}, True)
    failed = RuntimeError("the step failed")
    runner.send_results([], [], [(7, failed), (8, failed), (None, _serving_utils().EngineDeadError("dead"))])
    assert ran_again == [8] and 7 not in runner._flashinfer_mla_requests


def test_a_request_that_continuous_batching_failed_runs_alone_after_the_tokens_it_sent_524():
    """Transformers 5.24's manager: a request whose continuous-batching output comes back failed runs again alone
    through generate(), from its prompt and the tokens its handler already had, and its handler gets the tokens as
    continuous batching would have sent them; a non-streamed one runs again from its prompt; a cancelled one stops.
    What was kept to run it again goes with its registration, or with its error when it never registered."""
    if not hasattr(_serving_utils(), "GenerateManager"):
        pytest.skip("Transformers 5.25+ runs requests again through its runner (the test above)")
    import asyncio
    import threading
    from types import SimpleNamespace

    import torch
    from transformers import GenerationConfig

    from hf_flashinfer_mla import serve_recovery

    class Worker:  # (the continuous batching manager's surface that the wrapper reads)
        def __init__(self):
            self.handlers, self.background_thread_status, self.cancelled = {}, SimpleNamespace(fatal_error=None), []

        def register_result_handler(self, request_id, callback):
            self.handlers[request_id] = callback

        def cancel_request(self, request_id):
            self.cancelled.append(request_id)

    class Manager:  # (CBGenerateManager's)
        def __init__(self):
            self._cb = None

        def init_cb(self, model, gen_config):
            self._cb = self._cb or Worker()

        def is_alive(self):
            return True

        def generate_streaming(self, model, processor, inputs, gen_config, request_id, response_parser=None):
            if inputs.get("refused"):
                raise RuntimeError("refused before it registered")
            outputs = []
            self._cb.register_result_handler(request_id, outputs.append)
            return outputs, None

        async def generate_non_streaming(self, model, processor, inputs, gen_config, request_id):
            done = asyncio.get_running_loop().create_future()
            self._cb.register_result_handler(request_id, done.set_result)
            return await done

    class Model:
        device, prompts, resume = torch.device("cpu"), [], threading.Event()

        def generate(self, input_ids, generation_config, streamer=None):
            self.prompts.append(input_ids.tolist())
            new = torch.tensor([[7, 8, 9, 10][: generation_config.max_new_tokens]])
            if streamer is not None:
                streamer.put(input_ids)
                for i, token in enumerate(new[0]):
                    if input_ids[0, 0] == 6 and i == 1:  # (the request cancelled after its first token)
                        self.resume.wait(30)
                    streamer.put(token.reshape(1))
                streamer.end()
            return torch.cat([input_ids, new], dim=1)

    def output(tokens, error=None, finished=False):
        return SimpleNamespace(generated_tokens=tokens, error=error, is_finished=lambda: finished)

    serve_recovery._install_worker_restart_524(Manager)
    manager, model, config = Manager(), Model(), GenerationConfig(max_new_tokens=4)

    async def run():
        manager.init_cb(model, config)
        with pytest.raises(RuntimeError, match="refused"):
            manager.generate_streaming(model, None, {"input_ids": [1], "refused": True}, config, "r0")
        outputs, _ = manager.generate_streaming(model, None, {"input_ids": [1, 2, 3]}, config, "r1")
        assert manager._flashinfer_mla_kept == {}  # (taken by the registration)
        handler = manager._cb.handlers["r1"]
        handler(output([5]))
        handler(output([5], error="the step failed", finished=True))
        answer = asyncio.ensure_future(manager.generate_non_streaming(model, None, {"input_ids": [4]}, config, "r2"))
        while "r2" not in manager._cb.handlers:
            await asyncio.sleep(0.01)
        manager._cb.handlers["r2"](output([], error="the step failed", finished=True))
        result = await asyncio.wait_for(answer, timeout=30)
        while not outputs[-1].is_finished():
            await asyncio.sleep(0.01)
        gone, _ = manager.generate_streaming(model, None, {"input_ids": [6]}, config, "r3")
        manager._cb.handlers["r3"](output([], error="the step failed", finished=True))
        while len(gone) < 1:  # (its first token, run alone)
            await asyncio.sleep(0.01)
        manager._cb.cancel_request("r3")
        model.resume.set()
        while not gone[-1].is_finished():
            await asyncio.sleep(0.01)
        return outputs, result, gone

    outputs, result, gone = asyncio.run(run())
    assert [o.generated_tokens for o in outputs] == [[5], [5, 7], [5, 7, 8], [5, 7, 8, 9], [5, 7, 8, 9]]
    assert outputs[-1].error is None and outputs[-1].is_finished()
    assert result.error is None and result.generated_tokens == [7, 8, 9, 10]
    assert [o.generated_tokens for o in gone[:-1]] == [[7]] and "cancelled" in gone[-1].error
    assert manager._cb.cancelled == ["r3"]
    assert sorted(model.prompts) == [[[1, 2, 3, 5]], [[4]], [[6]]]
    assert manager._flashinfer_mla_kept == {}


def _serving_utils():
    from transformers.cli.serving import utils

    return utils


# --- the command line ------------------------------------------------------------------------------------------------

PROG = "python -m hf_flashinfer_mla.serve"


def run_serve(*args: str) -> subprocess.CompletedProcess:
    """The serve command as typed, bounded in time (a server that starts by mistake listens on a free local port)."""
    env = {**os.environ, "COLUMNS": "200",
           "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    return subprocess.run([sys.executable, "-m", "hf_flashinfer_mla.serve", *args, "--host", "127.0.0.1", "--port",
                           str(free_port())], env=env, capture_output=True, text=True, timeout=START_TIMEOUT)


def test_serve_help_is_the_command_as_typed_with_this_packages_defaults():
    """Its usage line was ``... serve serve [OPTIONS] [FORCE_MODEL]`` (Transformers' subcommand), which fails when
    typed, and --attn-implementation showed no default."""
    proc = run_serve("--help")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.splitlines()[0] == f"Usage: {PROG} [OPTIONS] [FORCE_MODEL]", proc.stdout
    flat = " ".join(proc.stdout.split())
    attn = re.search(r"--attn-implementation \S+ (.*?) --compile", flat)
    assert attn and "[default: flashinfer_mla]" in attn[1], flat
    assert "--max-model-len" in flat and "serve serve" not in flat


def _usage_errors():
    errors = [
        (["--device", "cuda:99"], "--device cuda:99: "),
        (["--max-model-len", "0"], "--max-model-len 0: "),
        (["--dtype", "float33"], "--dtype float33: not a torch dtype"),
        (["--attn-implementation", "bogus"], "--attn-implementation bogus: use flashinfer_mla, eager, sdpa"),
        (["--bogus"], "No such option: --bogus"),
        (["a", "b"], "unexpected extra argument"),
    ]
    if not torch.cuda.is_available():
        errors.append((["--device", "cuda"], "--device cuda: "))
    return errors


@pytest.mark.parametrize("args, says", _usage_errors(), ids=[" ".join(a) for a, _ in _usage_errors()])
def test_serve_usage_errors_are_one_line_and_exit_2(args, says, capsys):
    """Each ended in a traceback of 74-77 lines once the server started loading (or, for click's own errors, in a
    usage line that fails when typed); now it is one line before anything loads."""
    from hf_flashinfer_mla import serve

    with pytest.raises(SystemExit) as exc:
        serve.main([*args, "--host", "127.0.0.1", "--port", str(free_port())])
    out, err = capsys.readouterr()
    assert exc.value.code == 2, err
    assert err.count("\n") == 1 and err.startswith(f"{PROG}: error: ") and says in err, err
    assert out == ""


def test_a_model_path_that_does_not_exist_as_the_user_sees_it():
    """The whole stderr of the real process, typed as the usage line says: one line, exit status 2."""
    proc = run_serve("/nonexistent/path", "--continuous-batching")
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"{PROG}: error: FORCE_MODEL /nonexistent/path: no such "), lines
    assert proc.stdout == ""


def test_a_checkpoint_that_is_not_mla_as_the_user_sees_it(tmp_path):
    """75 lines with two tracebacks, the message twice, naming a keyword argument where the command has a flag; now
    one line naming the flag, exit status 2, before anything loads."""
    from transformers import LlamaConfig, LlamaForCausalLM

    save_model(tmp_path, model=LlamaForCausalLM(LlamaConfig(
        hidden_size=32, num_attention_heads=4, num_key_value_heads=2, num_hidden_layers=2, intermediate_size=64,
        vocab_size=VOCAB)))
    proc = run_serve(str(tmp_path))
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.splitlines()
    assert len(lines) == 1 and "not a Multi-head Latent Attention model" in lines[0], lines
    assert "--attn-implementation sdpa" in lines[0] and proc.stdout == ""


def test_serve_without_a_model_says_what_it_will_do():
    """It started a server that could serve nothing, saying nothing: now its first line says how it finds models."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    process = subprocess.Popen([sys.executable, "-m", "hf_flashinfer_mla.serve", "--host", "127.0.0.1", "--port",
                                str(free_port()), "--device", "cpu"], env=env, stderr=subprocess.PIPE, text=True)
    try:
        first = process.stderr.readline()
    finally:
        process.kill()
        process.wait(timeout=30)
    assert first.startswith(f"{PROG}: no model given: each request names its model"), first


def test_serve_help_says_what_it_serves_and_how_to_install_it():
    proc = run_serve("--help")
    flat = " ".join(proc.stdout.split())
    assert proc.returncode == 0 and "/v1/chat/completions" in flat and 'pip install -e ".[serve]"' in flat, flat
    assert "systemone" not in flat and "transformers[serving]" not in flat, flat


# --- what a request asks for: honoured, or refused naming the field ---------------------------------------------------

def _cut_words(words: list[str], stop: str) -> list[str]:
    text = " ".join(words)  # (the answer's text, as the tokenizer's decoder joins its words)
    return text[: text.index(stop)].split()


SERVERS = pytest.mark.parametrize("which", ["server", "generate_server"], ids=["continuous-batching", "generate"])


@SERVERS
@pytest.mark.parametrize("stream", [False, True], ids=["json", "stream"])
@pytest.mark.parametrize("as_list", [False, True], ids=["string", "list"])
def test_stop_ends_the_answer_before_the_stop_string(which, stream, as_list, request, expected):
    """Transformers ignored `stop` under continuous batching (the answer ran on, finish_reason "length") and failed
    the request without it (a 400, "substring not found"). The answer is eager's words up to the stop string, and
    says "stop"."""
    url, path, process = request.getfixturevalue(which)
    content = "w3 w4 w5"
    words = expected(content)
    stop = f"{words[3]}"  # (a later word's text: the answer must end before its first occurrence)
    body = {"model": str(path), "messages": [{"role": "user", "content": content}], "max_tokens": NEW_TOKENS,
            "temperature": 0, "stop": ["<never>", stop] if as_list else stop}
    got = answer(url, body, stream)
    assert got["status"] == 200 and got["error"] is None, got
    assert got["words"] == _cut_words(words, stop) and got["finish_reason"] == "stop", (words, stop, got)
    assert healthy(url, process)


@SERVERS
def test_n_gives_n_choices_of_eager_tokens(which, request, expected):
    """Transformers answered `n: 2` with one choice. Greedy: each of the n choices is eager's answer."""
    url, path, process = request.getfixturevalue(which)
    content = "w10 w11 w12"
    body = {"model": str(path), "messages": [{"role": "user", "content": content}], "max_tokens": NEW_TOKENS,
            "temperature": 0, "n": 2}
    response = httpx.post(f"{url}/v1/chat/completions", json=body, timeout=REQUEST_TIMEOUT)
    assert response.status_code == 200, response.text
    data = response.json()
    assert [c["index"] for c in data["choices"]] == [0, 1]
    assert [c["message"]["content"].split() for c in data["choices"]] == [expected(content)] * 2
    assert data["usage"]["completion_tokens"] == 2 * NEW_TOKENS
    response = httpx.post(f"{url}/v1/completions", json={"model": str(path), "prompt": "w3 w4", "max_tokens": 3,
                                                         "temperature": 0, "n": 3}, timeout=REQUEST_TIMEOUT)
    assert response.status_code == 200 and len(response.json()["choices"]) == 3, response.text
    got = answer(url, body, stream=True)  # n streamed choices are not served: refused, naming n
    assert got["status"] == 400 and got["error"]["param"] == "n", got
    assert healthy(url, process)


IGNORED_BY_TRANSFORMERS = [
    ({"logprobs": True}, "logprobs"),
    ({"top_logprobs": 2}, "top_logprobs"),
    ({"presence_penalty": 0.5}, "presence_penalty"),
    ({"response_format": {"type": "json_object"}}, "response_format"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"functions": [{"name": "f", "parameters": {}}]}, "functions"),
    ({"modalities": ["text", "audio"]}, "modalities"),
]


@pytest.mark.parametrize("settings, field", IGNORED_BY_TRANSFORMERS, ids=[f for _, f in IGNORED_BY_TRANSFORMERS])
def test_fields_the_server_cannot_honour_get_400_naming_them(server, settings, field):
    """Transformers accepted these and answered without them (a warning in its log only)."""
    url, path, _ = server
    body = {"model": str(path), "messages": [{"role": "user", "content": "w3"}], "max_tokens": 2, **settings}
    response = httpx.post(f"{url}/v1/chat/completions", json=body, timeout=REQUEST_TIMEOUT)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == field and f"`{field}`" in error["message"], error


@SERVERS
def test_the_same_fields_asking_nothing_are_answered_and_seed_is_refused_only_where_it_cannot_hold(which, request,
                                                                                                  expected):
    url, path, process = request.getfixturevalue(which)
    content = "w3 w4 w5"
    harmless = {"logprobs": False, "presence_penalty": 0, "response_format": {"type": "text"}, "user": "u",
                "seed": 3, "temperature": 0}
    got = answer(url, {"model": str(path), "messages": [{"role": "user", "content": content}],
                       "max_tokens": NEW_TOKENS, **harmless}, stream=False)
    assert got["status"] == 200 and got["words"] == expected(content), got
    sampled = {"model": str(path), "messages": [{"role": "user", "content": content}], "max_tokens": 3,
               "temperature": 0.8, "seed": 7}
    got = [answer(url, sampled, stream=False) for _ in range(2)]
    if which == "server":  # continuous batching: one random stream for every request, no per-request seed
        assert all(g["status"] == 400 and g["error"]["param"] == "seed" for g in got), got
    else:  # generate(): seeded before each request, so the same seed gives the same sample
        assert got[0]["status"] == 200 and got[0]["words"] == got[1]["words"], got
    assert healthy(url, process)


# --- a sparse-attention (DSA) model under continuous batching ----------------------------------------------------------

@pytest.mark.parametrize("model_type", ["deepseek_v32", "dots3_note_text"])
def test_a_sparse_model_served_with_continuous_batching_answers_as_eager(tmp_path, model_type):
    """A DeepSeek-V3.2-style checkpoint (DSA: each token attends to its indexer's top-4 rows), and a dots3-style one
    (DSA layers beside sliding-window layers of 4 tokens), served with continuous batching: concurrent requests,
    streamed or not, with prompts longer than top-k and the window, get eager generate()'s words."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from test_continuous_batching_sparse import WINDOW_FIRST, sparse_model

    overrides = WINDOW_FIRST if model_type == "dots3_note_text" else {}
    save_model(tmp_path, model=sparse_model(model_type, dtype=torch.float32, **overrides))
    tokenizer = AutoTokenizer.from_pretrained(tmp_path)
    model = AutoModelForCausalLM.from_pretrained(tmp_path, attn_implementation="eager", dtype=torch.float32).eval()

    def words(content: str) -> list[str]:
        ids = tokenizer.apply_chat_template([{"role": "user", "content": content}], add_generation_prompt=True,
                                            return_tensors="pt", return_dict=True)["input_ids"]
        out = model.generate(ids, max_new_tokens=NEW_TOKENS, do_sample=False, eos_token_id=None, pad_token_id=0)
        return tokenizer.decode(out[0, ids.shape[1]:], skip_special_tokens=True).split()

    contents = ["w3 w4 w5 w6 w7 w8", "w10 w11 w12 w13 w14 w15 w16 w17 w18", "w7", "w20 w21 w22 w23 w24 w25 w26"]
    with serving(tmp_path, "--continuous-batching", "--cb-block-size", "16", "--cb-num-blocks", "64",
                 "--cb-max-batch-tokens", "16", log_name="sparse_server.log") as (url, process):
        with ThreadPoolExecutor(len(contents)) as pool:
            futures = [pool.submit(chat, (url, str(tmp_path)), c, stream=i % 2 == 0) for i, c in enumerate(contents)]
            got = [f.result(timeout=REQUEST_TIMEOUT) for f in futures]
        assert healthy(url, process)
    assert got == [words(c) for c in contents]


# --- sampling as OpenAI defines it; models a request names; streams' end; the API key ---------------------------------
#
# Each check below is a function of a running server, asserting what the server must do; its test runs it against the
# servers above and the ones here, and `test_without_the_new_seams_each_check_fails` runs it against a server whose
# seams for it are removed (`CONTROL_HOOK`), where it must fail: the old server's outcome.

API_KEY = "sk-test-key"
CONTENT = "w3 w4 w5"
CB_OPTIONS = ("--continuous-batching", "--cb-block-size", "16", "--cb-num-blocks", "64", "--cb-max-batch-tokens", "64")
ENGINES = pytest.mark.parametrize("engine", ["continuous-batching", "generate"])
CHECKPOINT_SAMPLING = {"do_sample": True, "temperature": 0.7, "top_p": 0.9}  # (as DeepSeek's chat checkpoints)

# Every process of a server started with it on its path imports this sitecustomize first: it removes the seams the
# checks below test, and says so in the server's log (the control injected its fault). A seam renamed away fails the
# server's start, so a control never runs against a server that still has the seam.
CONTROL_HOOK = """
from hf_flashinfer_mla import serve_guards

REMOVED = {
    "_install_sampling": lambda: None,
    "_install_model_checks": lambda: None,
    "_install_api_key": lambda: None,
    "_ended_with_done": lambda handler, response: response,
    "_check_continuous_batching_applies": lambda body: None,
}
for name, replacement in REMOVED.items():
    getattr(serve_guards, name)
    setattr(serve_guards, name, replacement)
print("control: removed " + ", ".join(REMOVED), flush=True)
"""


@pytest.fixture(scope="module")
def sampling_model_path(model_path, tmp_path_factory) -> Path:
    """`model_path`'s weights and tokenizer, with a generation config that samples."""
    import shutil

    path = tmp_path_factory.mktemp("mla_model_sampling")
    for name in os.listdir(model_path):
        if not name.endswith(".log"):
            shutil.copy(model_path / name, path / name)
    config = json.loads((path / "generation_config.json").read_text())
    (path / "generation_config.json").write_text(json.dumps({**config, **CHECKPOINT_SAMPLING}))
    return path


def _llama():
    from transformers import LlamaConfig, LlamaForCausalLM

    return LlamaForCausalLM(LlamaConfig(hidden_size=32, num_attention_heads=4, num_key_value_heads=2,
                                        num_hidden_layers=2, intermediate_size=64, vocab_size=VOCAB))


@pytest.fixture(scope="module")
def llama_path(tmp_path_factory) -> Path:
    """A checkpoint that is not MLA."""
    path = tmp_path_factory.mktemp("llama")
    save_model(path, model=_llama())
    return path


@pytest.fixture(scope="module")
def open_servers(tmp_path_factory):
    """``{engine: url}``: servers started without a model (each request names its own), with an API key: from the
    environment under continuous batching, from --api-key without. Started at first use, stopped with the module."""
    with contextlib.ExitStack() as stack:
        started = {}

        def url(engine: str) -> str:
            if engine not in started:
                folder = tmp_path_factory.mktemp(f"open_{engine}")
                if engine == "continuous-batching":
                    options, env = CB_OPTIONS, {API_KEY_ENV: API_KEY}
                else:
                    options, env = ("--api-key", API_KEY), None
                started[engine], _ = stack.enter_context(serving(folder, *options, pinned=False, env=env))
            return started[engine]

        yield url


@pytest.fixture(scope="module")
def sampled(model_path):
    """The words eager generate(do_sample=True) samples after torch.manual_seed(seed), every token kept unless a
    top_k is given (OpenAI's sampling: no top-k of its own)."""
    from transformers import AutoTokenizer, DeepseekV3ForCausalLM

    tokenizer = AutoTokenizer.from_pretrained(model_path)
    model = DeepseekV3ForCausalLM.from_pretrained(model_path, attn_implementation="eager", dtype=torch.float32).eval()

    def words(content: str, seed: int, temperature: float, top_p: float = 1.0, top_k: int = 0,
              new_tokens: int = NEW_TOKENS, **settings) -> list[str]:
        ids = tokenizer.apply_chat_template([{"role": "user", "content": content}], add_generation_prompt=True,
                                            return_tensors="pt", return_dict=True)["input_ids"]
        torch.manual_seed(seed)
        out = model.generate(ids, max_new_tokens=new_tokens, do_sample=True, temperature=temperature, top_p=top_p,
                             top_k=top_k, eos_token_id=None, pad_token_id=0, **settings)
        return tokenizer.decode(out[0, ids.shape[1]:], skip_special_tokens=True).split()

    return words


@pytest.fixture(scope="module")
def penalized(model_path):
    """Eager generate()'s greedy words under a repetition penalty."""
    from transformers import AutoTokenizer, DeepseekV3ForCausalLM

    tokenizer = AutoTokenizer.from_pretrained(model_path)
    model = DeepseekV3ForCausalLM.from_pretrained(model_path, attn_implementation="eager", dtype=torch.float32).eval()

    def words(content: str, repetition_penalty: float) -> list[str]:
        ids = tokenizer.apply_chat_template([{"role": "user", "content": content}], add_generation_prompt=True,
                                            return_tensors="pt", return_dict=True)["input_ids"]
        out = model.generate(ids, max_new_tokens=NEW_TOKENS, do_sample=False, repetition_penalty=repetition_penalty,
                             eos_token_id=None, pad_token_id=0)
        return tokenizer.decode(out[0, ids.shape[1]:], skip_special_tokens=True).split()

    return words


def _headers(key: str | None = API_KEY) -> dict:
    return {"Authorization": f"Bearer {key}"} if key else {}


def post(url: str, body: dict, endpoint: str = "chat/completions", key: str | None = API_KEY):
    return httpx.post(f"{url}/v1/{endpoint}", json=body, headers=_headers(key), timeout=REQUEST_TIMEOUT)


def sse_lines(url: str, body: dict, endpoint: str = "chat/completions", key: str | None = API_KEY) -> list[str]:
    """The non-empty lines of a streamed answer (a 200: asserted)."""
    with httpx.stream("POST", f"{url}/v1/{endpoint}", json={**body, "stream": True}, headers=_headers(key),
                      timeout=REQUEST_TIMEOUT) as response:
        assert response.status_code == 200, response.read()
        return [line for line in response.iter_lines() if line.strip()]


def answers(url: str, body: dict, stream: bool = False) -> list[list[str]]:
    """The words of each choice of a chat completion (a 200: asserted)."""
    if stream:
        text = []
        for line in sse_lines(url, body):
            if line.startswith("data: ") and line != "data: [DONE]":
                for choice in json.loads(line[6:]).get("choices") or []:
                    text.append(choice["delta"].get("content") or "")
        return ["".join(text).split()]
    response = post(url, body)
    assert response.status_code == 200, response.text
    return [choice["message"]["content"].split() for choice in response.json()["choices"]]


def chat_body(model, **settings) -> dict:
    return {"model": str(model), "messages": [{"role": "user", "content": CONTENT}], "max_tokens": NEW_TOKENS,
            **settings}


def check_temperature_samples(url, model):
    """temperature 1 samples: four requests (two streamed) and the three choices of n=3 are not all one answer."""
    body = chat_body(model, temperature=1.0)
    got = [answers(url, body, stream)[0] for stream in (False, True, False, True)]
    assert len({tuple(words) for words in got}) > 1, got
    choices = answers(url, {**body, "n": 3})
    assert len(choices) == 3 and len({tuple(words) for words in choices}) > 1, choices


def check_temperature_zero_is_greedy(url, model, expected):
    """temperature 0 is eager's greedy answer, streamed or not, and n=2 gives it twice."""
    body = chat_body(model, temperature=0)
    for stream in (False, True):
        assert answers(url, body, stream) == [expected(CONTENT)], stream
    assert answers(url, {**body, "n": 2}) == [expected(CONTENT)] * 2


def check_seeded_sample_is_generates(url, model, sampled, settings: dict, oracle: dict):
    """A seeded request samples what eager generate(do_sample=True) samples under that seed and settings (`oracle`);
    the choices of n=2 under seed and seed + 1, which differ; the same request again, the same answer."""
    body = chat_body(model, seed=11, **settings)
    choices = answers(url, {**body, "n": 2})
    assert choices == [sampled(CONTENT, seed=11, **oracle), sampled(CONTENT, seed=12, **oracle)], choices
    assert choices[0] != choices[1]
    assert answers(url, body) == choices[:1]


def check_top_p_and_top_k_are_applied(url, model, expected):
    """At temperature 1, a top_p of 1e-6 or a top_k of 1 leaves the most likely token alone: eager's greedy words."""
    for extra in ({"top_p": 1e-6}, {"generation_config": json.dumps({"top_k": 1})}):
        assert answers(url, chat_body(model, temperature=1.0, **extra)) == [expected(CONTENT)], extra


def check_penalties(url, model, engine, penalized, expected):
    """Without continuous batching, frequency_penalty f is generate()'s repetition_penalty 1 + f (and changes this
    answer); under it, where Transformers drops them, it, logit_bias and a generation_config setting the engine does
    not take get a 400 naming them."""
    body = chat_body(model, temperature=0)
    if engine == "generate":
        got = answers(url, {**body, "frequency_penalty": 1.5})
        assert got == [penalized(CONTENT, 2.5)] and got != [expected(CONTENT)], got
        return
    for extra, field in (({"frequency_penalty": 1.5}, "frequency_penalty"), ({"logit_bias": {"5": 10}}, "logit_bias"),
                         ({"generation_config": json.dumps({"repetition_penalty": 2.5})},
                          "generation_config.repetition_penalty")):
        response = post(url, {**body, **extra})
        assert response.status_code == 400, (extra, response.text)
        assert response.json()["error"]["param"] == field, response.text


def check_streams_end_with_done(url, model, expected):
    """Chat completions and completions streams end with ``data: [DONE]``, once (a stream cut at a stop string too)."""
    stop = expected(CONTENT)[2]
    for endpoint, body in (("chat/completions", chat_body(model, temperature=0)),
                           ("chat/completions", chat_body(model, temperature=0, stop=stop)),
                           ("completions",
                            {"model": str(model), "prompt": "w3 w4", "max_tokens": 3, "temperature": 0})):
        lines = sse_lines(url, body, endpoint)
        assert lines[-1] == "data: [DONE]" and lines.count("data: [DONE]") == 1, (endpoint, body, lines[-2:])


def check_models_named_get_4xx(url, good_model, llama, expected):
    """A model that is not MLA gets a 400 naming it and the server flag that serves it, one that does not exist a 404
    (OpenAI's model_not_found) naming it, streamed or not; a request for a good model is answered afterwards."""
    missing = "/nonexistent/mla-checkpoint"
    for stream in (False, True):
        response = post(url, chat_body(llama, stream=stream))
        error = response.json().get("error") or {}
        assert response.status_code == 400 and error.get("param") == "model", response.text
        assert str(llama) in error["message"] and "--attn-implementation sdpa" in error["message"], error
        response = post(url, chat_body(missing, stream=stream))
        error = response.json().get("error") or {}
        assert response.status_code == 404 and error.get("code") == "model_not_found", response.text
        assert missing in error["message"] and "no such directory" in error["message"], error
    assert answers(url, chat_body(good_model, temperature=0)) == [expected(CONTENT)]


def check_api_key(url, model, expected):
    """With a key set, a request without it, or with another, gets a 401 in OpenAI's error shape; /health is open."""
    assert httpx.get(f"{url}/health", timeout=REQUEST_TIMEOUT).status_code == 200
    for key in (None, "sk-wrong"):
        for response in (post(url, chat_body(model, temperature=0), key=key),
                         httpx.get(f"{url}/v1/models", headers=_headers(key), timeout=REQUEST_TIMEOUT)):
            assert response.status_code == 401, (key, response.status_code, response.text)
            assert response.json()["error"]["code"] == "invalid_api_key", response.text
            assert response.headers.get("www-authenticate") == "Bearer"
    assert answers(url, chat_body(model, temperature=0)) == [expected(CONTENT)]


def _greedy_server(request, engine: str) -> str:
    return request.getfixturevalue("server" if engine == "continuous-batching" else "generate_server")[0]


@ENGINES
def test_temperature_above_zero_samples_on_a_checkpoint_that_does_not(engine, request, model_path):
    """Transformers kept the checkpoint's do_sample: temperature 1 gave one answer to every request."""
    check_temperature_samples(_greedy_server(request, engine), model_path)


@ENGINES
def test_temperature_zero_is_greedy_on_a_checkpoint_that_samples(engine, open_servers, sampling_model_path, expected):
    """Under continuous batching temperature 0 sampled (the engine dropped its top_k=1); generate() was greedy."""
    check_temperature_zero_is_greedy(open_servers(engine), sampling_model_path, expected)


@pytest.mark.parametrize("checkpoint", ["greedy", "sampling"])
def test_a_seeded_request_samples_what_generate_samples_under_its_seed(checkpoint, request, open_servers, model_path,
                                                                       sampling_model_path, sampled):
    """Without continuous batching (under it `seed` is refused: its requests share one random stream). The greedy
    checkpoint asked for temperature 0.8 and top_p 0.9 answered greedily; the sampling one, asked for nothing, sampled
    with generate()'s default top_k of 50, which OpenAI's sampling does not have."""
    if checkpoint == "greedy":
        url, model = request.getfixturevalue("generate_server")[0], model_path
        settings = oracle = {"temperature": 0.8, "top_p": 0.9}
    else:
        url, model, settings = open_servers("generate"), sampling_model_path, {}
        oracle = {"temperature": CHECKPOINT_SAMPLING["temperature"], "top_p": CHECKPOINT_SAMPLING["top_p"]}
    check_seeded_sample_is_generates(url, model, sampled, settings, oracle)


@ENGINES
def test_top_p_and_top_k_are_applied(engine, open_servers, sampling_model_path, expected):
    """Under continuous batching a request's top_k was dropped unless the checkpoint's config set one."""
    check_top_p_and_top_k_are_applied(open_servers(engine), sampling_model_path, expected)


@ENGINES
def test_penalties_are_applied_or_refused_naming_the_field(engine, request, model_path, penalized, expected):
    """Under continuous batching frequency_penalty, logit_bias and most generation_config settings were dropped."""
    check_penalties(_greedy_server(request, engine), model_path, engine, penalized, expected)


@ENGINES
def test_streams_end_with_done(engine, request, model_path, expected):
    """Streams ended after their last chunk, without OpenAI's ``data: [DONE]``."""
    check_streams_end_with_done(_greedy_server(request, engine), model_path, expected)


@ENGINES
def test_a_model_a_request_names_that_cannot_be_served_gets_4xx(engine, open_servers, sampling_model_path, llama_path,
                                                                expected):
    """Both were 500s (server_error): a RuntimeError naming the Python argument attn_implementation="sdpa", and an
    OSError about Hub repository ids."""
    check_models_named_get_4xx(open_servers(engine), sampling_model_path, llama_path, expected)


@ENGINES
def test_an_api_key_is_required_once_set(engine, open_servers, sampling_model_path, expected):
    """From $HF_FLASHINFER_MLA_API_KEY (continuous batching's server) and from --api-key (the other)."""
    check_api_key(open_servers(engine), sampling_model_path, expected)


def sample_first(url, other_model, model) -> None:
    """A request for `other_model`, then a sampled one for `model`: Transformers 5.24 starts its continuous batching
    engine again for each new model, with the first request's settings for all the requests after it (where 5.25 drops
    the settings its engine was not started for), so a control there samples first, as a client may."""
    post(url, chat_body(other_model, temperature=0))
    post(url, chat_body(model, temperature=1.0))


@ENGINES
def test_without_the_new_seams_each_check_fails(engine, tmp_path, model_path, sampling_model_path, llama_path,
                                                expected, sampled, penalized):
    """The controls: a server like the ones above with the seams the checks test removed (`CONTROL_HOOK`) answers as
    the server did before them, and each check fails there. (Without continuous batching, temperature 0 on a
    checkpoint that samples was greedy already, and top_p, top_k and the penalties were applied: those checks have no
    control there.)"""
    (tmp_path / "hook").mkdir()
    (tmp_path / "hook" / "sitecustomize.py").write_text(CONTROL_HOOK)
    cb = engine == "continuous-batching"
    with serving(tmp_path, *(CB_OPTIONS if cb else ()), pinned=False, env={API_KEY_ENV: API_KEY},
                 fault_hook=tmp_path / "hook", log_name="control.log") as (url, process):
        assert "control: removed _install_sampling" in (tmp_path / "control.log").read_text()
        checks = {
            "temperature samples": lambda: check_temperature_samples(url, model_path),
            "top_p and top_k": lambda: check_top_p_and_top_k_are_applied(url, sampling_model_path, expected),
            "penalties": lambda: check_penalties(url, model_path, engine, penalized, expected),
            "[DONE]": lambda: check_streams_end_with_done(url, model_path, expected),
            "4xx": lambda: check_models_named_get_4xx(url, sampling_model_path, llama_path, expected),
            "API key": lambda: check_api_key(url, sampling_model_path, expected),
        }
        if cb:
            def after_a_sample(check):
                def run():
                    sample_first(url, model_path, sampling_model_path)
                    check()
                return run

            checks["top_p and top_k"] = after_a_sample(checks["top_p and top_k"])
            checks["temperature 0"] = after_a_sample(
                lambda: check_temperature_zero_is_greedy(url, sampling_model_path, expected))
        else:  # (generate() applied top_p, top_k and the penalties already)
            del checks["top_p and top_k"], checks["penalties"]
            checks["seed"] = lambda: check_seeded_sample_is_generates(
                url, model_path, sampled, {"temperature": 0.8, "top_p": 0.9}, {"temperature": 0.8, "top_p": 0.9})
            checks["seed, the checkpoint's sampling"] = lambda: check_seeded_sample_is_generates(
                url, sampling_model_path, sampled, {}, {"temperature": 0.7, "top_p": 0.9})
        passed = []
        for name, check in checks.items():
            try:
                check()
            except AssertionError:
                continue
            passed.append(name)
        assert not passed, f"these checks pass without their seams, so they cannot fail: {passed}"
        assert healthy(url, process)


# --- the README's serving quick start; the server without its packages ------------------------------------------------

README = (ROOT / "README.md").read_text()


def _readme_commands(section: str) -> list[str]:
    """The commands of the first bash block of the README's `section` (### title), continuation lines joined, comments
    dropped."""
    text = README.split(f"\n### {section}\n", 1)[1].split("\n## ", 1)[0].split("\n### ", 1)[0]
    block = re.findall(r"```bash\n(.*?)```", text, re.S)[0].replace("\\\n", " ")
    return [line.split(" #", 1)[0].strip() for line in block.splitlines() if line.split(" #", 1)[0].strip()]


def test_the_readme_serving_quick_start_runs_as_written(tmp_path):
    """Its three commands, in a folder of their own (with the checkout's examples/): the checkpoint made, the server
    started (on a free port instead of 8000), and the request sent with curl; its answer has the 16 tokens it asked
    for. Every wait is bounded; the server is stopped by its PID."""
    import shlex
    import shutil

    commands = _readme_commands("Serving and continuous batching")
    assert [c.split()[:2] for c in commands] == [["python", "examples/tiny_checkpoint.py"], ["python", "-m"],
                                                 ["curl", "http://localhost:8000/v1/chat/completions"]], commands
    if shutil.which("curl") is None:
        pytest.skip("the quick start's request is a curl command, and this machine has no curl")
    port = free_port()
    make, serve, request = ([sys.executable if word == "python" else word.replace("8000", str(port))
                             for word in shlex.split(command)] for command in commands)
    (tmp_path / "examples").symlink_to(ROOT / "examples")
    env = {name: value for name, value in os.environ.items() if name != API_KEY_ENV}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])
    made = subprocess.run(make, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=START_TIMEOUT)
    assert made.returncode == 0, made.stderr
    with open(tmp_path / "server.log", "w") as log:
        process = subprocess.Popen(serve, cwd=tmp_path, env=env, stdout=log, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + START_TIMEOUT
        while True:
            assert process.poll() is None, (tmp_path / "server.log").read_text()
            try:
                if httpx.get(f"http://localhost:{port}/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert time.monotonic() < deadline, (tmp_path / "server.log").read_text()
            time.sleep(0.5)
        sent = subprocess.run(request, capture_output=True, text=True, timeout=REQUEST_TIMEOUT)
    finally:
        stop_server(process)
    assert sent.returncode == 0, sent.stderr
    data = json.loads(sent.stdout)
    assert data["usage"]["completion_tokens"] == 16 and data["choices"][0]["finish_reason"] == "length", data
    assert data["choices"][0]["message"]["content"].split(), data


# Every process started with it on its path imports this sitecustomize first: the server's packages cannot be found,
# as where they are not installed.
WITHOUT_SERVING_PACKAGES = """
import importlib.machinery

_find_spec = importlib.machinery.PathFinder.find_spec.__func__
MISSING = {"fastapi", "uvicorn", "openai"}


def find_spec(cls, name, path=None, target=None):
    return None if name.split(".")[0] in MISSING else _find_spec(cls, name, path, target)


importlib.machinery.PathFinder.find_spec = classmethod(find_spec)
"""


def test_the_server_without_its_packages_says_which_to_install_in_one_line(tmp_path):
    """The lighter install route has no FastAPI: the command ended in a 16-line traceback about a Transformers name
    (5.25: EventStream), which named neither the packages nor the install. The control: Transformers' serving module
    fails there as it did, a traceback naming neither (the packages really are missing)."""
    (tmp_path / "sitecustomize.py").write_text(WITHOUT_SERVING_PACKAGES)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), str(ROOT), os.environ.get("PYTHONPATH", "")])}

    def run(*args):
        return subprocess.run([sys.executable, *args], env=env, capture_output=True, text=True, timeout=START_TIMEOUT)

    control = run("-c", "import transformers.cli.serving.chat_completion")
    last = control.stderr.strip().splitlines()[-1]
    assert control.returncode == 1 and "Traceback" in control.stderr, control.stderr
    assert "fastapi" not in last and "[serve]" not in last, last
    proc = run("-m", "hf_flashinfer_mla.serve", "--help")
    assert proc.returncode == 2 and proc.stdout == "", proc.stderr
    lines = proc.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"{PROG}: error: the server needs fastapi, uvicorn, openai"), lines
    assert 'pip install -e ".[serve]"' in lines[0], lines
    imported = run("-c", "import hf_flashinfer_mla.serve")
    assert imported.returncode == 1 and 'ImportError: the server needs fastapi' in imported.stderr, imported.stderr
