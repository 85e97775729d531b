"""Where continuous batching's time goes, step by step: wall time against GPU-busy time, per kind of step.

`bench_serving.py --step-split` hands each step of the package's to `StepSplit.boundary()` as the step starts (on
Transformers' generation thread, before the step is prepared) and `StepSplit.classify()` once its plan exists. A
step's wall time runs from its start to the next step's start, the device synchronized at both ends (continuous
batching without asynchronous batching synchronizes every step anyway, to read its tokens). Steps that run
uncompiled are profiled on the GPU alone (CUPTI, through torch's profiler; never across a CUDA graph's capture): their
GPU-busy time is the union of their kernels' and copies' intervals. With `graphed`, steps replayed from CUDA graphs are
profiled too (their kernels recorded one by one): only for a run whose graphs were all captured by an identical run
before it (``bench_serving.py --warm-run``). Each kind of step keeps its top kernels by GPU time.

A CUDA graph can at best remove the host's share of a step, wall minus GPU-busy, and adds padding to the GPU's. So
for the steps that run uncompiled today, `graph_bound` = wall / (wall - sum over them of (wall - GPU-busy)) is an upper
bound on the whole run's speed-up from putting them in graphs. It errs high: the profiler's own start is taken out of
each step's wall time, its stop and parse out of the run's, and CUPTI's cost per launch stays in (host time that looks
saveable).
"""

from __future__ import annotations

import time
from collections import Counter

import torch


def busy_ns(intervals: list[tuple[int, int]]) -> int:
    """The length of the union of [start, end) intervals."""
    total, reach = 0, None
    for start, end in sorted(intervals):
        if reach is None or start > reach:
            total, reach = total + end - start, end
        elif end > reach:
            total, reach = total + end - reach, end
    return total


class StepSplit:
    def __init__(self, device: torch.device, graphed: bool = False):
        self.device, self.open, self.kinds, self.graphed = device, None, {}, graphed
        self.kernels: dict[str, Counter] = {}  # per kind of step: GPU seconds by kernel name
        self.overhead_s = 0.0  # the profiler's start, stop and parse: taken out of the run's wall time

    def _sync(self):
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def boundary(self):
        """A step starts: the one before it ends here."""
        self._sync()
        now = time.perf_counter()
        self.close(now)
        self.open = {"t0": now, "kind": "other", "prof": None, "start_s": 0.0}

    def classify(self, mixed: bool, graphed: bool, tokens: int):
        """The step begun at the last `boundary()` has its plan: its kind, and a profiler if it runs uncompiled (or
        replays a graph, with `graphed`)."""
        self.open["kind"] = ("mixed" if mixed else "decode") + ("-graphed" if graphed else "")
        self.open["tokens"] = tokens
        if (self.graphed or not graphed) and self.device.type == "cuda":
            t = time.perf_counter()
            prof = torch.autograd.profiler.profile(use_cpu=False, use_device="cuda", use_kineto=True)
            prof.__enter__()
            self.open["prof"], self.open["start_s"] = prof, time.perf_counter() - t

    def close(self, now: float):
        """The open step ends at `now` (the device synchronized): counted under its kind, its GPU-busy time read."""
        step, self.open = self.open, None
        if step is None:
            return
        wall = now - step["t0"] - step["start_s"]
        row = self.kinds.setdefault(step["kind"], {"steps": 0, "wall_s": 0.0, "tokens": 0})
        row["steps"] += 1
        row["wall_s"] += wall
        row["tokens"] += step.get("tokens", 0)
        self.overhead_s += step["start_s"]
        if step["prof"] is not None:
            t = time.perf_counter()
            step["prof"].__exit__(None, None, None)
            spans, kernels = [], self.kernels.setdefault(step["kind"], Counter())
            for e in step["prof"].kineto_results.events():
                if e.device_type() == torch.autograd.DeviceType.CUDA and e.duration_ns() > 0:
                    spans.append((e.start_ns(), e.start_ns() + e.duration_ns()))
                    kernels[e.name()] += e.duration_ns()
            gpu = busy_ns(spans) / 1e9
            row["gpu_busy_s"] = row.get("gpu_busy_s", 0.0) + gpu
            if not step["kind"].endswith("-graphed"):  # (what a graph could save: uncompiled steps' host share)
                row["saveable_s"] = row.get("saveable_s", 0.0) + max(0.0, wall - gpu)
            self.overhead_s += time.perf_counter() - t

    def discard(self):
        """The run is over: the step still open (the manager's last, cut by its stop) is not counted."""
        step, self.open = self.open, None
        if step is not None and step["prof"] is not None:
            try:
                step["prof"].__exit__(None, None, None)
            except RuntimeError:  # (its profiler runs on the generation thread, which has stopped: nothing to read)
                pass

    def report(self, wall_s: float) -> dict:
        """Per kind of step: count, tokens, wall and (uncompiled steps) GPU-busy seconds; the bound described above."""
        clean = wall_s - self.overhead_s
        saveable = sum(r.get("saveable_s", 0.0) for r in self.kinds.values())
        top = {kind: [(name, ns / 1e9) for name, ns in kernels.most_common(12)] for kind, kernels in self.kernels.items()}
        profiled = any("gpu_busy_s" in r for r in self.kinds.values())  # (none without CUDA)
        return {"wall_s_without_profiler": clean, "kinds": self.kinds, "saveable_s": saveable,
                "graph_bound": clean / (clean - saveable) if profiled and clean > saveable else None,
                "top_kernels_s": top}
