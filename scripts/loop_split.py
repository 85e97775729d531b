"""Where each continuous-batching step's wall time goes, measured on Transformers' generation thread.

`LoopSplit` wraps the functions the generation loop calls in turn with timers, each time counted once, in the
innermost phase that runs it (a phase's own time excludes the phases it calls), and closes a step at each
``_generation_loop_body``:

* ``schedule`` (Transformers): choosing the step's requests, offloading, restoring (``prepare_next_batch``);
* ``batch tensors`` (Transformers): laying out the step's inputs on the host (``prepare_batch_tensors``);
* ``step plan`` (this package): the step's lengths and block tables (``paged_attention.prepare_step``), its device
  work before the forward (``launch_steps``), its kernels' plans and routes (``Routing.route``);
* ``inputs to device`` (Transformers): the step's keyword arguments, the host-to-device copy under asynchronous
  batching (``get_model_kwargs``);
* ``forward`` (the model and this package's attention, launching kernels; a graph's replay);
* ``wait for GPU`` (Transformers): blocked until the step's tokens exist (``retrieve_device_outputs`` without
  asynchronous batching, ``prepare_batch_update`` with it);
* ``updates`` (Transformers): the requests' new tokens and states (``update_batch``);
* ``other``: the rest of the loop's wall time.

With a CUDA device it also records each step's GPU span: events on the compute stream around the forward (with
CUDA graphs, the replay's kernels; uncompiled, their launches' gaps included). Steps are kinds by the package's
step (``decode`` / ``mixed``, ``-graphed``). Used by ``bench_serving.py --loop-split``.
"""

from __future__ import annotations

import functools
import statistics
import time

import torch

PHASES = ("schedule", "batch tensors", "step plan", "inputs to device", "forward", "wait for GPU", "updates", "other")
PACKAGE_PHASES = ("step plan",)


class LoopSplit:
    def __init__(self, device: torch.device):
        self.device = device
        self.stack: list[list] = []  # [phase, start, time spent in inner phases]
        self.current = dict.fromkeys(PHASES[:-1], 0.0)
        self.kind = None
        self.t0 = None
        self.steps: list[dict] = []
        self.events: list = []
        self._undo: list = []

    # -------------------------------------------------------------------------------------------------- timers
    def _timed(self, phase: str, fn):
        split = self

        @functools.wraps(fn)
        def timed(*args, **kwargs):
            start = time.perf_counter()
            split.stack.append([phase, start, 0.0])
            try:
                return fn(*args, **kwargs)
            finally:
                _, start, inner = split.stack.pop()
                spent = time.perf_counter() - start
                split.current[phase] += spent - inner
                if split.stack:
                    split.stack[-1][2] += spent

        return timed

    def _wrap(self, owner, name: str, phase: str) -> None:
        original = owner.__dict__.get(name)
        if original is None:
            return
        fn = original.__func__ if isinstance(original, staticmethod) else original
        timed = self._timed(phase, fn)
        setattr(owner, name, staticmethod(timed) if isinstance(original, staticmethod) else timed)
        self._undo.append((owner, name, original))

    def install(self) -> LoopSplit:
        from transformers.generation.continuous_batching import continuous_api, input_outputs, model_runner

        from hf_flashinfer_mla import paged_attention, plan

        api = continuous_api
        self._wrap(api.ContinuousBatchProcessor, "prepare_next_batch", "schedule")
        self._wrap(input_outputs.ContinuousBatchingIOs, "prepare_batch_tensors", "batch tensors")
        self._wrap(input_outputs.ContinuousBatchingAsyncIOs, "prepare_batch_tensors", "batch tensors")
        self._wrap(paged_attention, "prepare_step", "step plan")
        self._wrap(paged_attention, "launch_steps", "step plan")
        self._wrap(plan.Routing, "route", "step plan")
        self._wrap(paged_attention.PagedStep, "route", "step plan")
        self._wrap(input_outputs.ContinuousBatchingIOs, "get_model_kwargs", "inputs to device")
        self._wrap(input_outputs.ContinuousBatchingAsyncIOs, "get_model_kwargs", "inputs to device")
        self._wrap(model_runner.ModelRunner, "compute_batch", "forward")
        self._wrap(input_outputs.ContinuousBatchingIOs, "retrieve_device_outputs", "wait for GPU")
        self._wrap(input_outputs.ContinuousBatchingAsyncIOs, "prepare_batch_update", "wait for GPU")
        self._wrap(api.ContinuousBatchProcessor, "update_batch", "updates")
        self._wrap_loop(api.ContinuousBatchingManager)
        self._wrap_forward_events(model_runner.ModelRunner)
        self._wrap_kind(paged_attention)
        return self

    def _wrap_loop(self, manager_cls) -> None:
        original = manager_cls._generation_loop_body
        split = self

        @functools.wraps(original)
        def body(manager, *args, **kwargs):
            start = time.perf_counter()
            try:
                return original(manager, *args, **kwargs)
            finally:
                split._close(time.perf_counter() - start)

        manager_cls._generation_loop_body = body
        self._undo.append((manager_cls, "_generation_loop_body", original))

    def _wrap_forward_events(self, runner_cls) -> None:
        original = runner_cls.compute_batch
        split = self

        @functools.wraps(original)
        def compute_batch(runner, *args, **kwargs):
            if split.device.type != "cuda":
                return original(runner, *args, **kwargs)
            stream = runner.inputs_and_outputs.compute_stream or torch.cuda.current_stream(split.device)
            begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            begin.record(stream)
            try:
                return original(runner, *args, **kwargs)
            finally:
                end.record(stream)
                split.pending_events = (begin, end)

        runner_cls.compute_batch = compute_batch
        self._undo.append((runner_cls, "compute_batch", original))

    def _wrap_kind(self, paged_attention) -> None:
        original = paged_attention.prepare_step
        split = self

        @functools.wraps(original)
        def prepare_step(io):
            original(io)
            step = next((a.step for a in io.cache.cache_allocators.values() if hasattr(a, "step")), None)
            if step is not None:
                split.kind = ("mixed" if bool((step.q_lens > 1).any()) else "decode") + (
                    "-graphed" if step.graphed else "")

        paged_attention.prepare_step = prepare_step
        self._undo.append((paged_attention, "prepare_step", original))

    def uninstall(self) -> None:
        for owner, name, original in reversed(self._undo):
            setattr(owner, name, original)
        self._undo.clear()

    # ------------------------------------------------------------------------------------------------------ steps
    pending_events = None

    def _close(self, wall: float) -> None:
        if self.kind is not None:  # (a loop body that ran no step: waiting for requests)
            phases = dict(self.current)
            phases["other"] = max(0.0, wall - sum(phases.values()))
            self.steps.append({"kind": self.kind, "wall": wall, "phases": phases})
            self.events.append(self.pending_events)
        self.current = dict.fromkeys(PHASES[:-1], 0.0)
        self.kind, self.pending_events = None, None

    def report(self) -> dict:
        """Per kind of step: steps, mean wall ms, mean ms per phase, the package's share, the GPU span."""
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        spans = [None if e is None else e[0].elapsed_time(e[1]) for e in self.events]
        kinds = {}
        for step, span in zip(self.steps, spans):
            k = kinds.setdefault(step["kind"], {"steps": 0, "wall": [], "gpu": [], "phases": {p: [] for p in PHASES}})
            k["steps"] += 1
            k["wall"].append(step["wall"])
            if span is not None:
                k["gpu"].append(span / 1e3)
            for p in PHASES:
                k["phases"][p].append(step["phases"][p])
        out = {}
        for kind, k in kinds.items():
            row = {"steps": k["steps"], "wall_ms": 1e3 * statistics.fmean(k["wall"]),
                   "phases_ms": {p: 1e3 * statistics.fmean(v) for p, v in k["phases"].items()}}
            row["package_ms"] = sum(row["phases_ms"][p] for p in PACKAGE_PHASES)
            if k["gpu"]:
                row["gpu_span_ms"] = 1e3 * statistics.fmean(k["gpu"])
                row["wall_over_gpu"] = row["wall_ms"] / row["gpu_span_ms"] if row["gpu_span_ms"] else None
            out[kind] = row
        return {"phases": list(PHASES), "package_phases": list(PACKAGE_PHASES), "kinds": out}
