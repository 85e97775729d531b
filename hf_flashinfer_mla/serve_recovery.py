"""Continuous batching in the server survives an error (``serve.py`` installs this into Transformers' serving code).

When the batching worker dies (an error in a step, or a request that outgrows the whole cache), the runner starts a
new worker on the same model and cache settings; Transformers marks the engine dead instead, and from 5.25 stops
the server. A failing request also fails alone: one forward runs every request of a step, so they all fail with
it, and each runs again alone, through ``generate()`` one request at a time (as without continuous batching: 5.25's
runner's own queue, 5.24's inference thread), from where its stream stopped: the one at fault fails there with its
own error, the others get their answers (`_install_worker_restart_525`, `_install_worker_restart_524`).

`install` puts them in place, idempotently (``serve_guards.INSTALLED`` marks what it installed).
"""

from __future__ import annotations

import asyncio
import functools
import gc
import inspect
import threading
import traceback

from transformers.cli.serving import utils as _serving_utils
from transformers.utils import logging

from .serve_guards import INSTALLED as _INSTALLED

logger = logging.get_logger("hf_flashinfer_mla")


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


def install() -> None:
    """Put the worker's replacement in place for the release's serving code (idempotent)."""
    runner = getattr(_serving_utils, "CBGenerateRunner", None)
    if runner is not None:
        if not getattr(runner.__init__, _INSTALLED, False):
            _install_worker_restart_525(runner)
        return
    manager = getattr(_serving_utils, "CBGenerateManager", None)
    if manager is not None and not getattr(manager.init_cb, _INSTALLED, False):
        _install_worker_restart_524(manager)
