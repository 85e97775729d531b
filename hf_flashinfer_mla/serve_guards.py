"""What the server (``serve.py``) checks and caps, installed into Transformers' serving code: one bad request never
takes the server down.

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
  context);
* continuous batching survives an error: when its worker dies (an error in a step, or a request that outgrows the
  whole cache), the runner starts a new worker on the same model and cache settings; Transformers marks the engine
  dead instead, and from 5.25 stops the server. A failing request also fails alone: one forward runs every request
  of a step, so they all fail with it, and each runs again alone, through ``generate()`` one request at a time (as
  without continuous batching: 5.25's runner's own queue, 5.24's inference thread), from where its stream stopped:
  the one at fault fails there with its own error, the others get their answers (`_install_worker_restart_525`,
  `_install_worker_restart_524`).

`install` puts them in place, idempotently (`_INSTALLED` marks what it installed).
"""

from __future__ import annotations

import asyncio
import functools
import gc
import inspect
import json
import math
import threading
import traceback

from transformers.cli.serving import model_manager as _transformers_model_manager
from transformers.cli.serving import utils as _serving_utils
from transformers.utils import logging

logger = logging.get_logger("hf_flashinfer_mla")
_INSTALLED = "_flashinfer_mla"  # marks what this module installed, so that importing it twice changes nothing


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

    setattr(handle, _INSTALLED, True)
    return handle


def _install_request_checks() -> None:
    from transformers.cli.serving.chat_completion import ChatCompletionHandler
    from transformers.cli.serving.completion import CompletionHandler
    from transformers.cli.serving.response import ResponseHandler

    for handler in (ChatCompletionHandler, CompletionHandler, ResponseHandler):
        if not getattr(handler.handle_request, _INSTALLED, False):
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

    setattr(call, _INSTALLED, True)
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

    setattr(call, _INSTALLED, True)
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
            if not getattr(method, _INSTALLED, False):
                setattr(cls, name, wrap(method))


# --------------------------------------------------------------------------------------------------------------
# Continuous batching: a worker that dies is replaced
# --------------------------------------------------------------------------------------------------------------
RESTART_WAIT = 120.0  # seconds a new request waits for a worker being replaced, before it fails


def _free_device_memory(model, dead_manager) -> None:
    """Frees the dead worker's cache before the new worker allocates one as large (its config holds the size now).
    The worker's error keeps its traceback, whose frames hold the batch processor, its cache and the activations
    of the step that failed: they are cleared first (the thread has ended: none of them runs)."""
    error = dead_manager.background_thread_status.fatal_error
    if error is not None:
        try:
            traceback.clear_frames(error.__traceback__)
        except RuntimeError:  # (a frame still running: nothing to free there)
            pass
    gc.collect()
    device = getattr(model, "device", None)
    if getattr(device, "type", None) == "cuda":
        import torch

        torch.cuda.empty_cache()


def _install_worker_restart_525(runner_class) -> None:
    """Transformers 5.25+: `CBGenerateRunner` runs in the model's process. When its batching worker dies, the thread
    that sends its outputs fails its requests with an `EngineDeadError`, which marks the engine dead in the API
    server and stops the server. Here the requests fail with a `RuntimeError` instead (the error of their own
    request), and that thread starts a new worker before it exits. A request arriving meanwhile waits for it.

    A request that fails under continuous batching is not answered with that error: it runs again, once, through
    the runner's base class (`GenerateRunner.generate`: ``generate()`` on its own thread, one request at a time),
    whose answer or error is the request's. The step's other requests failed only because they shared its forward;
    alone, the request at fault fails by itself. A stream that already sent tokens goes on from them: they are
    appended to its prompt, and its budget of new tokens shrinks by as many (the client has them; a sampled
    continuation stays consistent with what it saw)."""
    from transformers.cli.serving.utils import EngineDeadError, GenerateRunner

    original_init, original_generate = runner_class.__init__, runner_class.generate
    original_cancel = runner_class.cancel
    signature, generate_signature = inspect.signature(original_init), inspect.signature(original_generate)

    def request_failure(result):
        if isinstance(result, EngineDeadError):
            return RuntimeError(f"Continuous batching failed while running this request, and restarts: {result}")
        return result

    def __init__(self, *args, **kwargs):
        bound = signature.bind(self, *args, **kwargs)
        bound.apply_defaults()
        arguments = bound.arguments
        self._flashinfer_mla_worker = (arguments["model"], arguments["cb_config"], arguments.get("context_length"))
        self._flashinfer_mla_replacing = threading.Condition()
        self._flashinfer_mla_gone = False  # a new worker could not start either: the engine is dead for good
        # request id -> (inputs, generation kwargs, stream) while it runs under continuous batching: what running it
        # again alone takes; the tokens each has streamed, and the ids run again (once each)
        self._flashinfer_mla_requests, self._flashinfer_mla_streamed, self._flashinfer_mla_rerun = {}, {}, set()
        send_results = arguments["send_results"]

        def send(ids, tokens, finished):
            death = next((r for i, r in finished if i is None and isinstance(r, EngineDeadError)), None)
            if self._flashinfer_mla_gone:
                send_results(ids, tokens, finished)
                return
            with self.lock:
                for i, token in zip(ids, tokens):
                    self._flashinfer_mla_streamed.setdefault(i, []).append(token)
            rerun = [(i, r) for i, r in finished if i is not None and isinstance(r, Exception) and runs_again(self, i)]
            rerun_ids = {i for i, _ in rerun}
            # (an EngineDeadError for one request, from a worker found dead, would mark the whole engine dead)
            answered = [(i, request_failure(r)) for i, r in finished if i is not None and i not in rerun_ids]
            for i, _ in answered:
                forget(self, i)
            send_results(ids, tokens, answered)
            if death is not None:  # this is the outputs thread of the worker that died: it replaces it
                replace_worker(self, death, send_results)
            for i, error in rerun:
                with self.lock:
                    kept, sent = self._flashinfer_mla_requests.get(i), list(self._flashinfer_mla_streamed.get(i, ()))
                if kept is None:  # (cancelled while the worker was replaced: it ends with no answer)
                    continue
                inputs, generation_kwargs, stream = kept
                logger.warning(f"Request {i} failed under continuous batching ({str(error)[:200]}); it runs again "
                               f"alone, through generate(), after the {len(sent)} tokens it streamed")
                left = generation_kwargs.get("max_new_tokens")
                if left is not None and len(sent) >= left:  # (it had streamed all it asked for)
                    send_results([], [], [(i, None)])
                    forget(self, i)
                    continue
                kwargs = {**generation_kwargs, **({} if left is None else {"max_new_tokens": left - len(sent)})}
                GenerateRunner.generate(self, i, _batched(inputs, sent), kwargs, stream)

        arguments["send_results"] = send
        original_init(*bound.args, **bound.kwargs)

    def runs_again(self, request_id) -> bool:
        """Whether a request that failed runs again alone: it ran under continuous batching and has not run again
        yet (a second failure is its own)."""
        with self.lock:
            if request_id not in self._flashinfer_mla_requests or request_id in self._flashinfer_mla_rerun:
                return False
            self._flashinfer_mla_rerun.add(request_id)
            return True

    def forget(self, request_id) -> None:
        with self.lock:
            self._flashinfer_mla_requests.pop(request_id, None)
            self._flashinfer_mla_streamed.pop(request_id, None)
            self._flashinfer_mla_rerun.discard(request_id)

    def replace_worker(self, death, send_results) -> None:
        model, cb_config, context_length = self._flashinfer_mla_worker
        with self._flashinfer_mla_replacing:
            logger.warning(f"Continuous batching failed ({death}): its requests failed; starting a new worker")
            old = self.manager
            try:
                old.stop(block=True, timeout=30)
            except Exception:  # noqa: BLE001  (it is dead already: whatever stopping it raises changes nothing)
                logger.debug("Stopping the dead continuous batching worker raised", exc_info=True)
            _free_device_memory(model, old)
            try:
                self.manager = self._start_continuous_batching(model, cb_config, context_length)
            except Exception:
                logger.error("A new continuous batching worker could not start: the engine stops", exc_info=True)
                self._flashinfer_mla_gone = True
                send_results([], [], [(None, death)])
            self._flashinfer_mla_replacing.notify_all()

    def generate(self, request_id, *args, **kwargs):
        def alive() -> bool:
            return self._flashinfer_mla_gone or self.manager.background_thread_status.fatal_error is None

        with self._flashinfer_mla_replacing:
            self._flashinfer_mla_replacing.wait_for(alive, timeout=RESTART_WAIT)
        bound = generate_signature.bind(self, request_id, *args, **kwargs).arguments
        with self.lock:  # (its kwargs copied: continuous batching's generate pops the seed from them)
            self._flashinfer_mla_requests[request_id] = (bound["inputs"], dict(bound["generation_kwargs"]),
                                                         bound["stream"])
        return original_generate(self, request_id, *args, **kwargs)

    def cancel(self, request_id) -> None:
        # A cancelled request ends without a result through `send` (Transformers drops its outputs): what was kept to
        # run it again goes here.
        original_cancel(self, request_id)
        forget(self, request_id)

    runner_class.__init__ = functools.wraps(original_init)(__init__)
    runner_class.generate = functools.wraps(original_generate)(generate)
    runner_class.cancel = functools.wraps(original_cancel)(cancel)
    setattr(runner_class.__init__, _INSTALLED, True)


def _batched(inputs: dict, sent: list[int]) -> dict:
    """A continuous-batching request's inputs (token lists: its handler tokenizes without tensors) as generate()
    takes them, ``[1, N]`` tensors, followed by the tokens it already streamed (`sent`)."""
    import torch

    def batched(name, value):
        if not isinstance(value, list):
            return value
        tensor = torch.tensor(value).reshape(1, -1)
        more = sent if name == "input_ids" else [1] * len(sent) if name == "attention_mask" else []
        return torch.cat([tensor, torch.tensor([more], dtype=tensor.dtype)], dim=1) if more else tensor

    return {name: batched(name, value) for name, value in inputs.items()}


class _Relayed:
    """A request's answer from its run alone, in the shape of continuous batching's `GenerationOutput` (the part that
    5.24's result handlers read): all the tokens so far, an error, finished or not."""

    def __init__(self, request_id, tokens: list[int], finished: bool, error: str | None = None):
        self.request_id, self.generated_tokens, self.error, self._finished = request_id, tokens, error, finished

    def is_finished(self) -> bool:
        return self._finished


class _RelayStreamer:
    """generate()'s streamer for a request run again alone: each new token goes to the request's own result handler
    (on its event loop) as continuous batching's outputs did, after the tokens it already had (`sent`). A cancelled
    request (`cancelled` set) stops generate() at its next token, as Transformers' own streamer does."""

    def __init__(self, request_id, sent: list[int], deliver, cancelled: threading.Event):
        self.request_id, self.tokens, self.deliver, self.prompt_seen = request_id, list(sent), deliver, False
        self.cancelled = cancelled

    def put(self, value) -> None:
        if self.cancelled.is_set():
            raise RuntimeError(f"request {self.request_id} was cancelled")
        if not self.prompt_seen:  # (generate() puts the prompt first)
            self.prompt_seen = True
            return
        self.tokens += value.reshape(-1).tolist()
        self.deliver(_Relayed(self.request_id, list(self.tokens), finished=False))

    def end(self) -> None:
        pass  # (the run's end is delivered with its whole answer, or its error)


def _run_alone_524(model, inputs: dict, sent: list[int], gen_config, request_id, deliver, stream: bool,
                   cancelled: threading.Event) -> None:
    """Runs a request again, alone, through generate() (on the caller's inference thread), and delivers its answer:
    each token as it comes when streamed, then the end (its whole answer, or its own error)."""
    import copy

    try:
        config = copy.deepcopy(gen_config)
        if config.max_new_tokens is not None:
            config.max_new_tokens -= len(sent)
        tokens = list(sent)
        if config.max_new_tokens is None or config.max_new_tokens > 0:
            batched = {name: value.to(model.device) if hasattr(value, "to") else value
                       for name, value in _batched(inputs, sent).items()}
            relay = _RelayStreamer(request_id, sent, deliver, cancelled) if stream else None
            out = model.generate(**batched, generation_config=config, streamer=relay)
            tokens += out[0, batched["input_ids"].shape[-1]:].tolist()
        deliver(_Relayed(request_id, tokens, finished=True))
    except Exception as error:  # noqa: BLE001  (the request's own error is its answer)
        deliver(_Relayed(request_id, [], finished=True, error=f"{type(error).__name__}: {error}"))


def _install_worker_restart_524(manager_class) -> None:
    """Transformers 5.24: `CBGenerateManager` runs in the server's process; once its worker died, every request gets
    a 503 and /health says unhealthy. Here the next request starts a new worker first (`init_cb`, which every
    continuous batching request calls before it generates).

    A request that fails under continuous batching runs again, once, alone, through generate() on this manager's own
    inference thread (`GenerateManager`'s, as without continuous batching), and its result handler gets that answer
    in the shape continuous batching delivers: the tokens (a stream after the ones it already sent) or its own
    error. `generate_streaming` and `generate_non_streaming` both register that handler with the worker
    (`register_result_handler`), which is wrapped on each worker: the handler of a request they keep
    (`_flashinfer_mla_kept`: request id -> what running it alone takes, from the call until the registration) holds
    what it keeps from then on, and it goes with the handler. The worker's `cancel_request` (a client gone) also
    stops a request running again alone."""
    original_init_cb, original_is_alive = manager_class.init_cb, manager_class.is_alive

    def kept_by(self) -> dict:
        return vars(self).setdefault("_flashinfer_mla_kept", {})

    def run_alone_on_failure(self, cb) -> None:
        register, cancel = type(cb).register_result_handler, type(cb).cancel_request
        alone: dict = {}  # request id -> its cancellation, while it runs again alone

        def cancel_request(request_id):  # (a client gone: CBStreamer.cancel)
            cancelled = alone.get(request_id)
            if cancelled is not None:
                cancelled.set()
            return cancel(cb, request_id)

        def run_alone(model, inputs, sent, gen_config, request_id, deliver, stream, cancelled):
            try:
                _run_alone_524(model, inputs, sent, gen_config, request_id, deliver, stream, cancelled)
            finally:
                alone.pop(request_id, None)

        def register_result_handler(request_id, callback):
            kept = kept_by(self).pop(request_id, None)
            if kept is None:
                return register(cb, request_id, callback)
            model, inputs, gen_config, stream = kept
            loop, sent = asyncio.get_running_loop(), []

            def deliver(output):  # (from the inference thread onto the handler's event loop)
                loop.call_soon_threadsafe(callback, output)

            def on_output(output):
                if output.error is None:
                    sent[:] = output.generated_tokens
                    callback(output)
                    return
                logger.warning(f"Request {request_id} failed under continuous batching ({str(output.error)[:200]}); "
                               f"it runs again alone, through generate(), after the {len(sent)} tokens it streamed")
                if getattr(self, "_flashinfer_mla_alone", None) is None:
                    self._flashinfer_mla_alone = _serving_utils.GenerateManager()
                cancelled = alone[request_id] = threading.Event()
                self._flashinfer_mla_alone.submit(run_alone, model, inputs, list(sent), gen_config, request_id,
                                                  deliver, stream, cancelled)

            return register(cb, request_id, on_output)

        cb.register_result_handler, cb.cancel_request = register_result_handler, cancel_request

    # Kept from the call to the registration, which takes it (a request that fails before registering leaves
    # nothing behind): generate_streaming registers before it returns, generate_non_streaming once awaited.
    original_streaming, original_non_streaming = manager_class.generate_streaming, manager_class.generate_non_streaming

    @functools.wraps(original_streaming)
    def generate_streaming(self, model, processor, inputs, gen_config, request_id, *args, **kwargs):
        kept_by(self)[request_id] = (model, inputs, gen_config, True)
        try:
            return original_streaming(self, model, processor, inputs, gen_config, request_id, *args, **kwargs)
        finally:
            kept_by(self).pop(request_id, None)

    @functools.wraps(original_non_streaming)
    async def generate_non_streaming(self, model, processor, inputs, gen_config, request_id, *args, **kwargs):
        kept_by(self)[request_id] = (model, inputs, gen_config, False)
        try:
            return await original_non_streaming(self, model, processor, inputs, gen_config, request_id, *args,
                                                **kwargs)
        finally:
            kept_by(self).pop(request_id, None)

    def init_cb(self, model, gen_config):
        dead = self._cb
        if dead is not None and dead.background_thread_status.fatal_error is not None:
            error = dead.background_thread_status.fatal_error
            logger.warning(f"Continuous batching failed ({error}): its requests failed; starting a new worker")
            try:
                dead.stop(block=True, timeout=30)
            except Exception:  # noqa: BLE001  (it is dead already)
                logger.debug("Stopping the dead continuous batching worker raised", exc_info=True)
            self._cb = None
            _free_device_memory(model, dead)
        started = self._cb is None
        original_init_cb(self, model, gen_config)
        if started and self._cb is not None:
            run_alone_on_failure(self, self._cb)

    def is_alive(self):
        # A dead worker is replaced by the next request: the server stays healthy.
        return True

    manager_class.init_cb = functools.wraps(original_init_cb)(init_cb)
    manager_class.is_alive = functools.wraps(original_is_alive)(is_alive)
    manager_class.generate_streaming, manager_class.generate_non_streaming = generate_streaming, generate_non_streaming
    setattr(manager_class.init_cb, _INSTALLED, True)


def _install_worker_restart() -> None:
    runner = getattr(_serving_utils, "CBGenerateRunner", None)
    if runner is not None:
        if not getattr(runner.__init__, _INSTALLED, False):
            _install_worker_restart_525(runner)
        return
    manager = getattr(_serving_utils, "CBGenerateManager", None)
    if manager is not None and not getattr(manager.init_cb, _INSTALLED, False):
        _install_worker_restart_524(manager)


def install() -> None:
    _install_request_checks()
    _install_answer_caps()
    _install_worker_restart()
