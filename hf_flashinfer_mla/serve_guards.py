"""What the server (``serve.py``) checks and caps, installed into Transformers' serving code: one bad request never
takes the server down (and a continuous-batching worker that an error killed is replaced: ``serve_recovery.py``).

* requests (`_check_request`): sampling settings out of range or of the wrong type are refused with a 400 naming the
  field, a chat completion without a list of ``messages`` with a 422, each in OpenAI's error shape
  (``{"error": {"message", "type", "param", "code"}}``); any other error of a request is its own error response;
* what a request asks for is honoured or refused, never silently dropped (`honoured`): ``stop`` ends the answer
  before the stop string with ``finish_reason`` "stop" (Transformers ignores it under continuous batching and fails
  without it), streamed or not; ``n`` > 1 gives n choices (n requests through the same queue, which share the
  prompt's cached blocks); the fields Transformers accepts and ignores (``logprobs``, ``presence_penalty``,
  ``response_format``, ...) are refused with a 400 naming them where they would change the answer (`_IGNORED`);
* sampling as OpenAI defines it (`sampling_settings`, `engine_sampling`): ``temperature`` 0 is greedy and above 0
  samples, whatever the checkpoint's generation config says, with or without continuous batching (whose engine starts
  sampling and takes every request's temperature, top-k and top-p); a seeded request samples what generate() samples
  under that seed; what continuous batching cannot apply (a penalty, ``logit_bias``, most ``generation_config``
  settings, a seed for a sample) is refused there, naming the field;
* answers (`cap_new_tokens`): ``max_tokens`` (or ``max_completion_tokens``, ``max_output_tokens``), given or not, is
  capped at the context (``--max-model-len``, else the model's ``max_position_embeddings``) minus the prompt, and an
  answer stopped there has ``finish_reason`` ``"length"`` (Transformers' default is 1,024 new tokens whatever the
  context); streams of chat completions and completions end with ``data: [DONE]``;
* models a request names: one that cannot be read gets a 404 (``model_not_found``), one this server cannot serve a
  400, each naming the model and the fix;
* with a key in ``HF_FLASHINFER_MLA_API_KEY`` (``--api-key`` sets it), a request without ``Authorization: Bearer
  <key>`` gets a 401; ``/health`` stays open.

`install` puts them in place, idempotently (`INSTALLED` marks what it installed).
"""

from __future__ import annotations

import functools
import json
import math
import os
import secrets

from transformers.cli.serving import model_manager as _transformers_model_manager
from transformers.cli.serving import utils as _serving_utils
from transformers.utils import logging

logger = logging.get_logger("hf_flashinfer_mla")
# Marks what this module and ``serve_recovery`` installed, so that importing them twice changes nothing
INSTALLED = "_flashinfer_mla"


# --------------------------------------------------------------------------------------------------------------
# Requests: what is refused, and how errors are answered
# --------------------------------------------------------------------------------------------------------------
class RequestError(ValueError):
    """A request the server refuses: answered with `status` and OpenAI's error body, naming the field `param` (and
    OpenAI's error `code`, where it has one)."""

    def __init__(self, message: str, param: str | None = None, status: int = 400, code: str | None = None):
        super().__init__(message)
        self.param, self.status, self.code = param, status, code


def _error_response(message: str, status: int, kind: str, param: str | None = None, code: str | None = None):
    from fastapi.responses import JSONResponse

    return JSONResponse({"error": {"message": message, "type": kind, "param": param, "code": code}},
                        status_code=status)


def _at_least_one(value) -> bool:
    return value >= 1


# The sampling settings a request may carry, where it carries them: (name, integer?, accepted?, what it must be).
# Transformers passes them on unchecked: a negative `max_tokens` answered empty, a negative temperature or a top_p
# of 5 sampled anyway.
_TOKENS = (True, _at_least_one, "at least 1")
_SETTINGS = (
    ("max_tokens", *_TOKENS),
    ("max_completion_tokens", *_TOKENS),
    ("max_output_tokens", *_TOKENS),
    ("temperature", False, lambda v: v >= 0, "0 or more (0 is greedy)"),
    ("top_p", False, lambda v: 0 < v <= 1, "greater than 0 and at most 1"),
    ("n", True, _at_least_one, "at least 1"),
    ("seed", True, lambda v: True, "an integer"),
    # (Transformers turns it into repetition_penalty = 1 + frequency_penalty, which must be positive)
    ("frequency_penalty", False, lambda v: -1 < v <= 2, "greater than -1 and at most 2"),
)
# Those of `generation_config`, a JSON object of GenerationConfig fields, that a request may set too.
_GENERATION_CONFIG_SETTINGS = (
    ("max_new_tokens", *_TOKENS),
    ("max_length", *_TOKENS),
    ("temperature", False, lambda v: v >= 0, "0 or more (0 is greedy)"),
    ("top_p", False, lambda v: 0 < v <= 1, "greater than 0 and at most 1"),
    ("top_k", True, lambda v: v >= 0, "0 or more (0: no top-k)"),
)


def _check_settings(settings: dict, rules, prefix: str = "") -> None:
    for name, integer, accepted, must_be in rules:
        value = settings.get(name)
        if value is None:
            continue
        param = f"{prefix}{name}"
        number = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
        if not number or (integer and not isinstance(value, int)):
            raise RequestError(f"`{param}` must be {'an integer' if integer else 'a number'}, "
                               f"not {json.dumps(value)}", param)
        if not accepted(value):
            raise RequestError(f"`{param}` must be {must_be}, not {json.dumps(value)}", param)


def _check_request(handler, body: dict) -> None:
    """Raises `RequestError` naming the first field of `body` the server cannot take as it is."""
    from transformers.cli.serving.chat_completion import ChatCompletionHandler
    from transformers.cli.serving.response import ResponseHandler

    if isinstance(handler, ResponseHandler) and not isinstance(body.get("input"), (str, list)):
        # (Transformers reads body["input"] unchecked: a KeyError, a 500)
        raise RequestError("`input` must be a string or a list of input items", "input", 422)
    if isinstance(handler, ChatCompletionHandler):
        # (Transformers 5.24's handler reads body["messages"] unchecked: a KeyError, a 500)
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages:
            raise RequestError("`messages` must be a non-empty list of chat messages", "messages", 422)
        for index, message in enumerate(messages):
            if not isinstance(message, dict) or not isinstance(message.get("role"), str):
                raise RequestError(f"`messages[{index}]` must be an object with a `role`", f"messages[{index}]", 422)
    _check_settings(body, _SETTINGS)
    generation_config = body.get("generation_config")
    if generation_config is not None:
        try:
            settings = json.loads(generation_config) if isinstance(generation_config, str) else None
        except ValueError:
            settings = None
        if not isinstance(settings, dict):
            raise RequestError("`generation_config` must be a string holding a JSON object of generation settings",
                               "generation_config")
        _check_settings(settings, _GENERATION_CONFIG_SETTINGS, prefix="generation_config.")


# Fields Transformers' server takes and ignores (with a warning in its log): refused where the request asks for
# something by them, as (field, asks for something?, what to do instead). The others it ignores change nothing in an
# answer (user, metadata, store, service_tier, prediction: a hint for speed, parallel_tool_calls).
_IGNORED = (
    ("logprobs", lambda v: v not in (None, False), "token log-probabilities are not returned; leave it out"),
    ("top_logprobs", lambda v: v not in (None, 0), "token log-probabilities are not returned; leave it out"),
    ("presence_penalty", lambda v: v not in (None, 0), "not applied; use frequency_penalty"),
    ("response_format", lambda v: v is not None and (not isinstance(v, dict) or v.get("type") != "text"),
     "structured output is not enforced; leave it out or give {\"type\": \"text\"}"),
    ("tool_choice", lambda v: v not in (None, "auto"),
     "a tool cannot be forced or forbidden; leave it out (tools are offered through the chat template)"),
    ("functions", lambda v: v is not None, "use tools"),
    ("function_call", lambda v: v is not None, "use tools"),
    ("audio", lambda v: v is not None, "the server answers in text only"),
    ("modalities", lambda v: v not in (None, ["text"]), "the server answers in text only"),
    ("reasoning_effort", lambda v: v is not None, "not applied; leave it out"),
    ("web_search_options", lambda v: v is not None, "the server has no web search"),
    ("best_of", lambda v: v not in (None, 1), "use n"),
    ("echo", lambda v: v not in (None, False), "the prompt is not echoed; leave it out"),
)


def _continuous_batching(handler) -> bool:
    state = getattr(handler, "generation_state", None)  # (5.25+; 5.24's handlers have a manager per path)
    if state is not None:
        return bool(getattr(state, "_continuous_batching", False))
    return type(getattr(handler, "generate_manager", None)).__name__ == "CBGenerateManager"


def honoured(handler, body: dict) -> tuple[list[str], int]:
    """``(stop strings, n)`` of a request, once every field it asks for is known to be honoured; raises
    `RequestError` naming the first one that is not."""
    for field, asks, instead in _IGNORED:
        if field in body and asks(body[field]):
            raise RequestError(f"`{field}` is not supported by this server: {instead}", field)
    stop = body.get("stop")
    stops = [stop] if isinstance(stop, str) else stop
    if stops is not None and (not isinstance(stops, list) or not all(isinstance(x, str) and x for x in stops)):
        raise RequestError("`stop` must be a non-empty string or a list of them", "stop")
    n = body.get("n") or 1
    if n > 1 and body.get("stream"):
        raise RequestError("`n` > 1 is answered without streaming: send stream false, or n requests", "n")
    if _continuous_batching(handler):
        _check_continuous_batching_applies(body)
    return stops or [], n


# What continuous batching applies of a request: its max_new_tokens, end of sequence, and sampling (temperature, top_k,
# top_p: `engine_sampling`). Transformers drops the rest there, where generate() would apply it.
_CONTINUOUS_BATCHING_SETTINGS = {"max_new_tokens", "eos_token_id", "do_sample", "temperature", "top_k", "top_p"}
_NOT_UNDER_CONTINUOUS_BATCHING = (
    ("frequency_penalty", lambda v: v not in (None, 0)),
    ("logit_bias", lambda v: bool(v)),
)


def _check_continuous_batching_applies(body: dict) -> None:
    instead = "leave it out, or serve without --continuous-batching"
    if body.get("seed") is not None and body.get("temperature") != 0:
        raise RequestError("`seed` cannot be honoured under continuous batching, whose requests share one random "
                           f"stream: send temperature 0 (greedy), or {instead}", "seed")
    for field, asks in _NOT_UNDER_CONTINUOUS_BATCHING:
        if asks(body.get(field)):
            raise RequestError(f"`{field}` is not applied under continuous batching: {instead}", field)
    if body.get("generation_config") is not None:  # (a JSON object: `_check_request`)
        for name in json.loads(body["generation_config"]):
            if name not in _CONTINUOUS_BATCHING_SETTINGS:
                raise RequestError(f"`generation_config.{name}` is not applied under continuous batching, which "
                                   f"takes {', '.join(sorted(_CONTINUOUS_BATCHING_SETTINGS))}: {instead}",
                                   f"generation_config.{name}")


def _cut(text: str, stops: list[str]) -> int | None:
    """Where `text` first holds one of `stops` (None: nowhere)."""
    found = [i for i in (text.find(stop) for stop in stops) if i >= 0]
    return min(found) if found else None


def _held_back(text: str, stops: list[str]) -> int:
    """How many characters at the end of `text` may begin a stop string, and must wait for the next ones."""
    return max((k for stop in stops for k in range(1, len(stop)) if text.endswith(stop[:k])), default=0)


def _answer_field(choice: dict) -> tuple[dict, str] | None:
    """The dict and key of a choice's text: a chat completion's message or delta ``content``, a completion's ``text``."""
    for holder, key in ((choice.get("message"), "content"), (choice.get("delta"), "content"), (choice, "text")):
        if isinstance(holder, dict) and isinstance(holder.get(key), str):
            return holder, key
    return None


def _stopped_json(response, stops: list[str]):
    """A JSON answer cut before its first stop string, with ``finish_reason`` "stop" there."""
    from fastapi.responses import JSONResponse

    if response.status_code != 200:
        return response
    data = json.loads(response.body)
    for choice in data.get("choices", []):
        field = _answer_field(choice)
        cut = None if field is None else _cut(field[0][field[1]], stops)
        if cut is not None:
            field[0][field[1]] = field[0][field[1]][:cut]
            choice["finish_reason"] = "stop"
    return JSONResponse(data, status_code=response.status_code)


def _stopped_stream(response, stops: list[str]):
    """A streamed answer whose text ends before its first stop string: what may begin one is held back until the
    next text decides; at a stop string the stream ends with a chunk whose ``finish_reason`` is "stop", and the
    generation is cancelled (the source stream is closed, which cancels it)."""
    source = response.body_iterator

    async def events():
        held, last = "", None
        try:
            async for chunk in source:
                for event in (chunk if isinstance(chunk, str) else chunk.decode()).split("\n\n"):
                    if not event.strip():
                        continue
                    payload = event[len("data: "):] if event.startswith("data: ") else None
                    data = None
                    try:
                        data = json.loads(payload) if payload is not None else None
                    except ValueError:
                        pass
                    choice = (data.get("choices") or [None])[0] if isinstance(data, dict) else None
                    field = None if choice is None else _answer_field(choice)
                    if field is None:
                        if choice is not None and choice.get("finish_reason") and held:
                            yield _event(last, held)
                            held = ""
                        yield event + "\n\n"
                        continue
                    last = data
                    held += field[0][field[1]]
                    cut = _cut(held, stops)
                    if cut is not None:
                        if cut:
                            yield _event(data, held[:cut])
                        yield _event(data, "", finish_reason="stop")
                        return
                    keep = _held_back(held, stops)
                    if len(held) > keep:
                        yield _event(data, held[: len(held) - keep])
                        held = held[len(held) - keep :]
            if held and last is not None:
                yield _event(last, held)
        finally:
            await source.aclose()  # (the server's own stream cancels its generation when closed)

    response.body_iterator = events()
    return response


def _event(data: dict, text: str, finish_reason: str | None = None) -> str:
    """`data` (a streamed chunk) with its text set to `text` (and its finish_reason), as one SSE event."""
    data = json.loads(json.dumps(data))
    choice = data["choices"][0]
    holder, key = _answer_field(choice)
    holder[key] = text
    if finish_reason is not None:
        choice["finish_reason"] = finish_reason
    return f"data: {json.dumps(data, ensure_ascii=False)}\n\n"


def _ended_with_done(handler, response):
    """A chat completion's or a completion's stream, ending with ``data: [DONE]`` as OpenAI's do (clients read up to
    it); Transformers ends them without. (A Responses stream ends with its ``response.completed`` event.)"""
    from transformers.cli.serving.chat_completion import ChatCompletionHandler
    from transformers.cli.serving.completion import CompletionHandler

    streams = isinstance(handler, (ChatCompletionHandler, CompletionHandler)) and hasattr(response, "body_iterator")
    if not streams or response.status_code != 200:
        return response
    source = response.body_iterator

    async def events():
        last = ""
        try:
            async for chunk in source:
                text = chunk if isinstance(chunk, str) else chunk.decode()
                last = text if text.strip() else last
                yield chunk
            if not last.rstrip().endswith("data: [DONE]"):  # (a release that sends it already)
                yield "data: [DONE]\n\n"
        finally:
            await source.aclose()  # (the server's own stream cancels its generation when closed)

    response.body_iterator = events()
    return response


async def _n_choices(handle_request, handler, body: dict, args: tuple, kwargs: dict, n: int):
    """n answers to one request, as n requests at once (their own ids; a `seed` gives each its own, seed + i), merged
    into one answer of n choices: usage counts the prompt once and every choice's tokens."""
    import asyncio

    from fastapi.responses import JSONResponse

    def one(i):
        single = {**body, "n": 1}
        if body.get("seed") is not None:
            single["seed"] = body["seed"] + i
        # (each its own request id: continuous batching keys its requests by them)
        if args and isinstance(args[0], str):
            return handle_request(handler, single, f"{args[0]}-{i}", *args[1:], **kwargs)
        if isinstance(kwargs.get("request_id"), str):
            return handle_request(handler, single, *args, **{**kwargs, "request_id": f"{kwargs['request_id']}-{i}"})
        return handle_request(handler, single, *args, **kwargs)

    responses = await asyncio.gather(*(one(i) for i in range(n)))
    failed = next((r for r in responses if r.status_code != 200), None)
    if failed is not None:
        return failed
    answers = [json.loads(r.body) for r in responses]
    merged = answers[0]
    merged["choices"] = [{**a["choices"][0], "index": i} for i, a in enumerate(answers)]
    usage = merged.get("usage")
    if isinstance(usage, dict):
        usage["completion_tokens"] = sum(a["usage"]["completion_tokens"] for a in answers)
        usage["total_tokens"] = usage["prompt_tokens"] + usage["completion_tokens"]
    return JSONResponse(merged)


def _engine_dead_errors() -> tuple[type, ...]:
    """Transformers' error for a dead engine (5.25+), which its own handler answers with a 503. (5.24's
    `CBWorkerDeadError` is not one here: the worker restarts, so it is the error of its request, a 500.)"""
    dead = getattr(_serving_utils, "EngineDeadError", None)
    return () if dead is None else (dead,)


def _answering_errors(handle_request):
    """`handle_request` of an endpoint, which answers every error of its request itself: a refused request with a
    4xx naming the field, an error of its generation with a 500 saying what it was, each in OpenAI's error shape
    (a request that streams gets its error as an event of the stream: Transformers' own)."""

    @functools.wraps(handle_request)
    async def handle(self, body, *args, **kwargs):
        from starlette.exceptions import HTTPException

        try:
            stops, n = [], 1
            if isinstance(body, dict):
                _check_request(self, body)
                stops, n = honoured(self, body)
                # (Transformers' own stop handling fails without continuous batching, and is ignored with it)
                body = {key: value for key, value in body.items() if key != "stop"}
            if n > 1:
                response = await _n_choices(handle_request, self, body, args, kwargs, n)
            else:
                response = await handle_request(self, body, *args, **kwargs)
            if stops and response.status_code == 200:
                streamed = hasattr(response, "body_iterator")
                response = _stopped_stream(response, stops) if streamed else _stopped_json(response, stops)
            return _ended_with_done(self, response)
        except RequestError as error:
            return _error_response(str(error), error.status, "invalid_request_error", error.param, error.code)
        except HTTPException as error:  # Transformers' own refusals (unknown fields, ...): same shape
            return _error_response(str(error.detail), error.status_code, "invalid_request_error")
        except _engine_dead_errors():
            raise  # Transformers answers 503 for them
        except ValueError as error:  # the request's fault: a model the server does not serve, a bad value
            return _error_response(str(error), 400, "invalid_request_error")
        except Exception as error:
            logger.error("A request failed", exc_info=True)
            return _error_response(f"{type(error).__name__}: {error}", 500, "server_error")

    setattr(handle, INSTALLED, True)
    return handle


def _install_request_checks() -> None:
    from transformers.cli.serving.chat_completion import ChatCompletionHandler
    from transformers.cli.serving.completion import CompletionHandler
    from transformers.cli.serving.response import ResponseHandler

    for handler in (ChatCompletionHandler, CompletionHandler, ResponseHandler):
        if not getattr(handler.handle_request, INSTALLED, False):
            handler.handle_request = _answering_errors(handler.handle_request)


# --------------------------------------------------------------------------------------------------------------
# Answers: capped at the context
# --------------------------------------------------------------------------------------------------------------
MAX_MODEL_LEN: int | None = None  # --max-model-len on Transformers 5.24, whose server has no such option (serve.py)


def cap_new_tokens(requested: int | None, prompt: int, context: int | None) -> int | None:
    """The new tokens a request gets: what it asked for (``None``: no limit of its own), at most what fits in the
    `context` after its `prompt`. Raises `RequestError` for a prompt that leaves no room."""
    if context is None:
        return requested
    room = context - prompt
    if room < 1:
        raise RequestError(f"The prompt has {prompt} tokens, but the model takes at most {context}, prompt and "
                           "answer (--max-model-len): shorten the prompt")
    return room if requested is None or requested > room else requested


def _prompt_length(inputs) -> int:
    ids = inputs["input_ids"]
    return len(ids) if isinstance(ids, list) else ids.shape[-1]  # lists for continuous batching, else a tensor


def _context_524(config) -> int | None:
    model_length = getattr(config.get_text_config(), "max_position_embeddings", None)
    if MAX_MODEL_LEN is None:
        return model_length
    return MAX_MODEL_LEN if model_length is None else min(MAX_MODEL_LEN, model_length)


def _capped_engine_call(method):
    """`EngineClient.generate_(non_)streaming(inputs, generation_kwargs, ...)` (5.25+), with ``max_new_tokens``
    capped in `generation_kwargs` itself, which the handler reads afterwards for the answer's finish_reason."""

    @functools.wraps(method)
    def call(self, inputs, generation_kwargs, *args, **kwargs):
        context = self.generation_state.context_length(self.model_config)
        generation_kwargs["max_new_tokens"] = cap_new_tokens(
            generation_kwargs.get("max_new_tokens"), _prompt_length(inputs), context)
        return method(self, inputs, generation_kwargs, *args, **kwargs)

    setattr(call, INSTALLED, True)
    return call


def _capped_manager_call(method):
    """`GenerateManager`/`CBGenerateManager.generate_(non_)streaming(model, processor, inputs, gen_config, ...)`
    (5.24), with ``max_new_tokens`` capped in `gen_config` (the request's own copy), which the handler reads
    afterwards for the answer's finish_reason."""

    @functools.wraps(method)
    def call(self, model, processor, inputs, gen_config, *args, **kwargs):
        gen_config.max_new_tokens = cap_new_tokens(gen_config.max_new_tokens, _prompt_length(inputs),
                                                   _context_524(model.config))
        return method(self, model, processor, inputs, gen_config, *args, **kwargs)

    setattr(call, INSTALLED, True)
    return call


def _install_answer_caps() -> None:
    engine = getattr(_transformers_model_manager, "EngineClient", None)
    if engine is not None:
        classes, wrap = (engine,), _capped_engine_call
    else:
        classes, wrap = (_serving_utils.GenerateManager, _serving_utils.CBGenerateManager), _capped_manager_call
    for cls in classes:
        for name in ("generate_streaming", "generate_non_streaming"):
            method = getattr(cls, name)
            if not getattr(method, INSTALLED, False):
                setattr(cls, name, wrap(method))


# --------------------------------------------------------------------------------------------------------------
# Sampling as OpenAI defines it, with or without continuous batching
# --------------------------------------------------------------------------------------------------------------
# Transformers sets a request's temperature but leaves `do_sample` as the checkpoint's generation config has it: on a
# checkpoint that does not sample, temperature 1 is greedy. Its continuous batching samples, or not, as the checkpoint
# says, for every request, and of a request's temperature, top_k and top_p applies only those the checkpoint's config
# made processors for: on a checkpoint that samples, temperature 0 (sent as top_k 1, which no processor takes) samples.
NO_TOP_K = 2**31 - 1  # a per-request top-k that keeps every token (the engine clamps it to the vocabulary)
_SAMPLING = ("do_sample", "temperature", "top_k", "top_p")


def sampling_settings(body: dict, settings: dict) -> dict:
    """`settings` (``do_sample``, ``temperature``, ``top_k``, ``top_p``: the checkpoint's generation config with the
    request's ``generation_config`` on top) as the request asks, OpenAI's way: ``temperature`` 0 is greedy and above 0
    samples at that temperature, whatever the checkpoint's config says; ``top_p`` without a temperature samples at the
    checkpoint's (1 if it has none); a request that asks neither generates as the checkpoint does. Sampling keeps
    every token unless a top_k is set (the checkpoint's or the request's: OpenAI has none, and generate()'s default of
    50 would apply otherwise)."""
    temperature = body.get("temperature")
    if temperature is not None:
        settings["do_sample"] = temperature > 0
        if temperature > 0:
            settings["temperature"] = float(temperature)
    elif body.get("top_p") is not None:
        settings["do_sample"] = True
    if settings.get("temperature") == 0:  # (a generation_config's temperature 0 too)
        settings["do_sample"] = False
    if settings.get("do_sample") and not settings.get("top_k"):
        settings["top_k"] = 0
    return settings


def engine_sampling(settings: dict) -> dict:
    """What continuous batching's per-request processors take for `settings` (`sampling_settings`): every request sets
    all three, greedy as the one most likely token left to draw."""
    temperature = settings.get("temperature")
    if not settings.get("do_sample") or temperature == 0:
        return {"temperature": 1.0, "top_k": 1, "top_p": 1.0}
    top_k, top_p = settings.get("top_k"), settings.get("top_p")
    return {"temperature": 1.0 if temperature is None else float(temperature), "top_k": int(top_k or NO_TOP_K),
            "top_p": 1.0 if top_p is None else float(top_p)}


def _sampling_engine_config(generation_config):
    """A copy of the checkpoint's generation config with which continuous batching samples and takes a temperature, a
    top-k and a top-p from each request: Transformers makes each of these processors only where the config's value
    changes something, and every request sets all three (`engine_sampling`), so these values are never used."""
    import copy

    config = copy.deepcopy(generation_config)
    config.do_sample, config.temperature, config.top_k, config.top_p = True, 0.5, NO_TOP_K, 0.5
    return config


def _generation_kwargs_sampled(build):
    """`BaseHandler._build_generation_kwargs(body, model_generation_config)` (5.25+), sampling as the request asks."""

    @functools.wraps(build)
    def wrapper(self, body, *args, **kwargs):
        return sampling_settings(body, build(self, body, *args, **kwargs))

    setattr(wrapper, INSTALLED, True)
    return wrapper


_SEED = "_flashinfer_mla_seed"  # a request's seed, on its generation config (5.24)


def _generation_config_sampled(build):
    """`BaseHandler._build_generation_config(body, model_generation_config, use_cb)` (5.24), sampling as the request
    asks. It seeded torch's generator itself, on the event loop, while generate() runs on the inference thread after
    the requests queued before it (n choices seeded seed, seed + 1, ... all drew from the last seed): the seed rides on
    the config instead, set on the inference thread just before its generate() (`_seeded_where_generated`)."""

    @functools.wraps(build)
    def wrapper(self, body, *args, **kwargs):
        config = build(self, {name: value for name, value in body.items() if name != "seed"}, *args, **kwargs)
        for name, value in sampling_settings(body, {name: getattr(config, name) for name in _SAMPLING}).items():
            setattr(config, name, value)
        if body.get("seed") is not None:
            setattr(config, _SEED, int(body["seed"]))
        return config

    setattr(wrapper, INSTALLED, True)
    return wrapper


def _seeded_where_generated(method):
    """`GenerateManager.generate_(non_)streaming(model, processor, inputs, gen_config, ...)` (5.24): the request's seed
    is set on the inference thread, queued right before its generate() (both queued in the same step of the event
    loop, so no other request's generate() comes between)."""

    @functools.wraps(method)
    def call(self, model, processor, inputs, gen_config, *args, **kwargs):
        seed = getattr(gen_config, _SEED, None)
        if seed is not None:
            self.submit(_serving_utils.set_torch_seed, seed)
        return method(self, model, processor, inputs, gen_config, *args, **kwargs)

    setattr(call, INSTALLED + "_seed", True)
    return call


def _engine_started_sampling(start):
    """`CBGenerateRunner._start_continuous_batching(model, cb_config, context_length)` (5.25+): the manager it starts
    (`model.init_continuous_batching`, with the model's generation config) gets `_sampling_engine_config` instead."""

    @functools.wraps(start)
    def wrapper(self, model, *args, **kwargs):
        config = _sampling_engine_config(model.generation_config)
        model.init_continuous_batching = functools.partial(type(model).init_continuous_batching, model,
                                                           generation_config=config)
        try:
            return start(self, model, *args, **kwargs)
        finally:
            del model.init_continuous_batching  # (the instance's: the class's own is back)

    setattr(wrapper, INSTALLED, True)
    return wrapper


def _per_request(supported: dict, settings: dict) -> dict:
    sampling = engine_sampling(settings)
    missing = [name for name in sampling if name not in supported]
    if missing:  # (a manager not started by `_engine_started_sampling`)
        raise ValueError(f"Continuous batching cannot set {', '.join(missing)} per request here: serve without "
                         "--continuous-batching")
    return {name: supported[name](value) for name, value in sampling.items()}


def _batching_kwargs_sampled(build):
    """`CBGenerateRunner._build_continuous_batching_kwargs(generation_kwargs)` (5.25+): the request's temperature, top-k
    and top-p, all three, greedy or sampling (`engine_sampling`)."""

    @functools.wraps(build)
    def wrapper(self, generation_kwargs):
        batching_kwargs = build(self, generation_kwargs)
        batching_kwargs.update(_per_request(self.manager.logit_processor.supported_keys, generation_kwargs))
        logger.debug(f"Continuous batching sampling of the request: {batching_kwargs}")
        return batching_kwargs

    setattr(wrapper, INSTALLED, True)
    return wrapper


def _install_sampling_524(manager_class) -> None:
    """Transformers 5.24's `CBGenerateManager` starts its worker with the first request's generation config (every
    later request samples as that one did) and adds each request with its max_new_tokens and end of sequence only.
    The worker starts with `_sampling_engine_config` and per-request processors; each request's sampling
    (`engine_sampling` of its generation config) is kept by request id from its `generate_(non_)streaming` call to its
    `add_request`, which the worker's own method takes it in."""
    from transformers import ContinuousBatchingConfig

    original_init_cb = manager_class.init_cb
    original_streaming, original_non_streaming = manager_class.generate_streaming, manager_class.generate_non_streaming

    def kept(self) -> dict:
        return vars(self).setdefault("_flashinfer_mla_sampling", {})

    @functools.wraps(original_init_cb)
    def init_cb(self, model, gen_config):
        if self._cb is not None:
            return original_init_cb(self, model, gen_config)
        self._cb_config = self._cb_config if self._cb_config is not None else ContinuousBatchingConfig()
        self._cb_config.per_request_processors = True
        original_init_cb(self, model, _sampling_engine_config(model.generation_config))
        worker = self._cb
        add_request = worker.add_request

        @functools.wraps(add_request)
        def add_request_sampled(input_ids, *args, request_id=None, **kwargs):
            sampling = kept(self).pop(request_id, None)
            if sampling is not None:
                kwargs.update(_per_request(worker.logit_processor.supported_keys, sampling))
            return add_request(input_ids, *args, request_id=request_id, **kwargs)

        worker.add_request = add_request_sampled

    @functools.wraps(original_streaming)
    def generate_streaming(self, model, processor, inputs, gen_config, request_id, *args, **kwargs):
        kept(self)[request_id] = {name: getattr(gen_config, name) for name in _SAMPLING}
        try:
            return original_streaming(self, model, processor, inputs, gen_config, request_id, *args, **kwargs)
        finally:
            kept(self).pop(request_id, None)

    @functools.wraps(original_non_streaming)
    async def generate_non_streaming(self, model, processor, inputs, gen_config, request_id, *args, **kwargs):
        kept(self)[request_id] = {name: getattr(gen_config, name) for name in _SAMPLING}
        try:
            return await original_non_streaming(self, model, processor, inputs, gen_config, request_id, *args,
                                                **kwargs)
        finally:
            kept(self).pop(request_id, None)

    manager_class.init_cb = init_cb
    manager_class.generate_streaming, manager_class.generate_non_streaming = generate_streaming, generate_non_streaming
    setattr(manager_class.generate_streaming, INSTALLED + "_sampling", True)


def _install_sampling() -> None:
    handler = _serving_utils.BaseHandler
    name, wrap = (("_build_generation_kwargs", _generation_kwargs_sampled)
                  if hasattr(handler, "_build_generation_kwargs") else
                  ("_build_generation_config", _generation_config_sampled))
    if not getattr(getattr(handler, name), INSTALLED, False):
        setattr(handler, name, wrap(getattr(handler, name)))
    runner = getattr(_serving_utils, "CBGenerateRunner", None)
    if runner is not None:
        for name, wrap in (("_start_continuous_batching", _engine_started_sampling),
                           ("_build_continuous_batching_kwargs", _batching_kwargs_sampled)):
            if not getattr(getattr(runner, name), INSTALLED, False):
                setattr(runner, name, wrap(getattr(runner, name)))
        return
    manager = _serving_utils.CBGenerateManager
    if not getattr(manager.generate_streaming, INSTALLED + "_sampling", False):
        _install_sampling_524(manager)
    manager = _serving_utils.GenerateManager
    for name in ("generate_streaming", "generate_non_streaming"):
        if not getattr(getattr(manager, name), INSTALLED + "_seed", False):
            setattr(manager, name, _seeded_where_generated(getattr(manager, name)))


# --------------------------------------------------------------------------------------------------------------
# Models a request names: a 404 for one that does not exist, a 400 for one this server cannot serve
# --------------------------------------------------------------------------------------------------------------
_NAME_A_MODEL = "name a checkpoint directory (config.json, weights and tokenizer files) or a Hub model id (org/name)"


def looks_local(name: str) -> bool:
    """Whether a model name can only be a path (a Hub id is ``org/name``, with no more than one slash)."""
    return os.path.isabs(name) or name.startswith((".", "~")) or name.count("/") > 1 or "\\" in name


def unservable(config, attn_implementation: str | None) -> str | None:
    """Why a server whose models load with `attn_implementation` cannot serve the model of `config` (None: it can)."""
    from .errors import UnsupportedModelError
    from .models import ATTN_NAME, SUPPORTED_MODEL_TYPES, check_model_supported

    if attn_implementation != ATTN_NAME:
        return None
    try:
        check_model_supported(config)
    except UnsupportedModelError as error:
        text = config.get_text_config(decoder=True)
        if getattr(text, "model_type", None) in SUPPORTED_MODEL_TYPES:
            return str(error)
        return (f'model_type "{config.model_type}" is not a Multi-head Latent Attention model, which '
                f"--attn-implementation {ATTN_NAME} serves")
    return None


def _unservable_error(model: str, why: str | None, error: Exception | None = None) -> RequestError:
    """`why` (`unservable`'s), or else the loading's own `error`, which names its fix."""
    fix = "; serve it from a server started with --attn-implementation sdpa (or eager)" if why is not None else ""
    return RequestError(f"The model `{model}` cannot be served by this server: {why or error}{fix}", "model", 400,
                        "model_not_supported")


def _not_found_error(model, error: Exception) -> RequestError:
    if isinstance(model, str) and looks_local(model) and not os.path.exists(os.path.expanduser(model)):
        message = f"The model `{model}` does not exist: no such directory; {_NAME_A_MODEL}"
    else:
        why = " ".join(str(error).split())[:300]
        message = f"The model `{model}` could not be loaded ({type(error).__name__}: {why}); {_NAME_A_MODEL}"
    return RequestError(message, "model", 404, "model_not_found")


def _engine_checked(get_engine):
    """`ModelManager.get_engine(model)` (5.25+), which reads the model's config and processor in the API server (its
    process loads the weights at its first request): a model it cannot read is the request's 404, one this server
    cannot serve its 400, named, before its process starts (where the error was a 500 naming a keyword argument)."""
    from transformers.cli.serving.utils import ModelNotServedError

    @functools.wraps(get_engine)
    def wrapper(self, model, *args, **kwargs):
        try:
            engine = get_engine(self, model, *args, **kwargs)
        except ModelNotServedError:
            raise
        except (OSError, ValueError) as error:  # (a Hub id's HFValidationError is a ValueError)
            raise _not_found_error(model, error) from None
        why = unservable(engine.model_config, self.loader.attn_implementation)
        if why is not None:
            raise _unservable_error(model, why)
        return engine

    setattr(wrapper, INSTALLED, True)
    return wrapper


def _model_resolved_checked(resolve):
    """`BaseHandler._resolve_model(body)` (5.24), which loads the model in the server's process: the same 404 and
    400."""
    from starlette.exceptions import HTTPException

    from .errors import UnsupportedModelError

    @functools.wraps(resolve)
    def wrapper(self, body, *args, **kwargs):
        model = body.get("model")
        try:
            return resolve(self, body, *args, **kwargs)
        except HTTPException:
            raise
        except UnsupportedModelError as error:
            why = None
            try:
                from transformers import AutoConfig

                why = unservable(AutoConfig.from_pretrained(os.path.expanduser(model)),
                                 self.model_manager.attn_implementation)
            except Exception:  # noqa: BLE001  (its config cannot be read again: the load's own message says why)
                pass
            raise _unservable_error(model, why, error) from None
        except (OSError, ValueError) as error:
            raise _not_found_error(model, error) from None

    setattr(wrapper, INSTALLED, True)
    return wrapper


def _install_model_checks() -> None:
    manager = _transformers_model_manager.ModelManager
    if hasattr(manager, "get_engine"):
        if not getattr(manager.get_engine, INSTALLED, False):
            manager.get_engine = _engine_checked(manager.get_engine)
        return
    handler = _serving_utils.BaseHandler
    if not getattr(handler._resolve_model, INSTALLED, False):
        handler._resolve_model = _model_resolved_checked(handler._resolve_model)


# --------------------------------------------------------------------------------------------------------------
# An API key for a server other machines reach
# --------------------------------------------------------------------------------------------------------------
API_KEY_ENV = "HF_FLASHINFER_MLA_API_KEY"  # the key (serve.py's --api-key sets it, for every process of the server)
OPEN_PATHS = ("/health",)


class _KeyRequired:
    """ASGI middleware: a request needs ``Authorization: Bearer <key>`` (a 401 in OpenAI's error shape otherwise),
    but for `OPEN_PATHS` and CORS preflights (which carry no credentials)."""

    def __init__(self, app, key: str):
        self.app, self.key = app, key.encode()

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http" and scope["path"] not in OPEN_PATHS and scope["method"] != "OPTIONS":
            header = next((value for name, value in scope["headers"] if name == b"authorization"), b"")
            scheme, _, token = header.partition(b" ")
            if scheme.lower() != b"bearer" or not secrets.compare_digest(token.strip(), self.key):
                message = ("Incorrect API key provided" if header else "No API key provided") + (
                    ": send the header `Authorization: Bearer <key>` with the key this server was started with "
                    f"(--api-key or {API_KEY_ENV})")
                response = _error_response(message, 401, "invalid_request_error", code="invalid_api_key")
                response.headers["WWW-Authenticate"] = "Bearer"
                await response(scope, receive, send)
                return
        await self.app(scope, receive, send)


def _key_checked(build_server):
    """`build_server(...)`: the app, behind `_KeyRequired` when ``HF_FLASHINFER_MLA_API_KEY`` holds a key."""

    @functools.wraps(build_server)
    def wrapper(*args, **kwargs):
        app = build_server(*args, **kwargs)
        key = os.environ.get(API_KEY_ENV)
        if key:
            app.add_middleware(_KeyRequired, key=key)
        return app

    setattr(wrapper, INSTALLED, True)
    return wrapper


def _install_api_key() -> None:
    from transformers.cli.serving import server

    if not getattr(server.build_server, INSTALLED, False):
        server.build_server = _key_checked(server.build_server)


def install() -> None:
    _install_request_checks()
    _install_answer_caps()
    _install_sampling()
    _install_model_checks()
    _install_api_key()
