"""``python -m hf_flashinfer_mla.serve``: Transformers' OpenAI-style server with continuous batching over the paged
latent cache, on the CPU.

One server process (127.0.0.1, a free port) serves a small random DeepSeek-V3-style model saved to a temporary
folder, with a WordLevel tokenizer built offline. Every wait is bounded (server start, each request), so a hung
server fails the test instead of hanging the suite.
"""

from __future__ import annotations

import json
import os
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

from conftest import VOCAB, make_model  # noqa: E402
from hf_flashinfer_mla import UnsupportedModelError  # noqa: E402

pytestmark = pytest.mark.server

START_TIMEOUT = 120  # seconds for the server process to import, load and answer /health
REQUEST_TIMEOUT = 60
NEW_TOKENS = 6
ROOT = Path(__file__).resolve().parents[1]


def save_model(path: Path, model_type: str = "deepseek_v3") -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    model = make_model(model_type, dtype=torch.float32)
    model.generation_config.eos_token_id = None
    model.save_pretrained(path)
    vocab = {"<pad>": 0, **{f"w{i}": i for i in range(1, VOCAB - 3)}, "<user>": VOCAB - 3, "<bot>": VOCAB - 2,
             "<unk>": VOCAB - 1}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer.decoder = decoders.WordPiece(prefix="##")  # joins words with spaces
    fast = PreTrainedTokenizerFast(tokenizer_object=tokenizer, pad_token="<pad>", unk_token="<unk>")
    fast.chat_template = ("{% for m in messages %}<user> {{ m['content'] }} {% endfor %}"
                          "{% if add_generation_prompt %}<bot>{% endif %}")
    fast.save_pretrained(path)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    path = tmp_path_factory.mktemp("mla_model")
    save_model(path)
    port = free_port()
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    log = open(path / "server.log", "w")
    process = subprocess.Popen(
        [sys.executable, "-m", "hf_flashinfer_mla.serve", str(path), "--continuous-batching", "--host", "127.0.0.1",
         "--port", str(port), "--device", "cpu", "--dtype", "float32", "--cb-block-size", "16", "--cb-num-blocks",
         "64", "--cb-max-batch-tokens", "64"],
        env=env, stdout=log, stderr=subprocess.STDOUT,
    )
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + START_TIMEOUT
    try:
        while True:
            if process.poll() is not None:
                pytest.fail(f"the server exited with {process.returncode}:\n{(path / 'server.log').read_text()}")
            try:
                if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                pytest.fail(f"the server did not start in {START_TIMEOUT} s:\n{(path / 'server.log').read_text()}")
            time.sleep(0.5)
        yield url, path
    finally:
        process.terminate()
        try:
            process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait(timeout=10)
        log.close()


@pytest.fixture(scope="module")
def expected(server):
    """Each test prompt's words from eager generate() on the same checkpoint and chat template."""
    from transformers import AutoTokenizer, DeepseekV3ForCausalLM

    _, path = server
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
    url, path = server
    contents = ["w3 w4 w5", "w10 w11 w12 w13 w14 w15 w16 w17 w18", "w7", "w20 w21 w22 w23 w24 w25"]
    target = (url, str(path))
    with ThreadPoolExecutor(len(contents)) as pool:
        futures = [pool.submit(chat, target, c, stream=i % 2 == 0) for i, c in enumerate(contents)]
        got = [f.result(timeout=REQUEST_TIMEOUT) for f in futures]
    assert got == [expected(c) for c in contents]


def test_malformed_request_gets_4xx_and_server_keeps_serving(server, expected):
    url, path = server
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
    url, path = server
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
