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
* answers (`cap_new_tokens`): ``max_tokens`` (or ``max_completion_tokens``, ``max_output_tokens``), given or not, is
  capped at the context (``--max-model-len``, else the model's ``max_position_embeddings``) minus the prompt, and an
  answer stopped there has ``finish_reason`` ``"length"`` (Transformers' default is 1,024 new tokens whatever the
  context).

`install` puts them in place, idempotently (`INSTALLED` marks what it installed).
"""

from __future__ import annotations

import functools
import json
import math

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
    """A request the server refuses: answered with `status` and OpenAI's error body, naming the field `param`."""

    def __init__(self, message: str, param: str | None = None, status: int = 400):
        super().__init__(message)
        self.param, self.status = param, status


def _error_response(message: str, status: int, kind: str, param: str | None = None):
    from fastapi.responses import JSONResponse

    return JSONResponse({"error": {"message": message, "type": kind, "param": param, "code": None}},
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
    sampling = body.get("temperature") != 0 and (body.get("temperature") is not None or body.get("top_p") is not None)
    if body.get("seed") is not None and sampling and _continuous_batching(handler):
        raise RequestError("`seed` cannot be honoured under continuous batching, whose requests share one random "
                           "stream: leave it out, or serve without --continuous-batching", "seed")
    return stops or [], n


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
            return response
        except RequestError as error:
            return _error_response(str(error), error.status, "invalid_request_error", error.param)
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


def install() -> None:
    _install_request_checks()
    _install_answer_caps()
