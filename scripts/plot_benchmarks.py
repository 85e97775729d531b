"""Draw BENCHMARKS.md's pictures from the raw JSON kept in benchmarks/.

    python scripts/plot_benchmarks.py                  # benchmarks/*.json -> docs/*.png
    python scripts/plot_benchmarks.py --out /tmp/plots --batch 1 32 128

Writes three PNGs into --out:

* ``decode_step_time.png``: decode step time against context length for eager, sdpa and flashinfer_mla, one panel
  per batch size, from a ``bench_decode.py`` grid (log axes; cells that ran out of memory are marked "OOM"; the
  dashed line is the step's bandwidth floor, (weights + latent) / copy bandwidth);
* ``decode_memory.png``: the same cells' transient memory (peak above weights and cache);
* ``serving_throughput.png``: output tokens/s of each mode of one or more ``bench_serving.py`` runs;
* ``serving_step_split.png`` (with ``--split``): where each continuous-batching step's wall time goes, per mode and
  kind of step, from ``bench_serving.py --loop-split`` runs (stacked bars, the package's phase hatched, the step's
  GPU span marked).

Titles (model shape, GPU, date, versions) are read from the JSON files' metadata. matplotlib is an optional
dependency: ``pip install "hf-flashinfer-mla[bench]"``.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
BENCH = ROOT / "benchmarks"

# One colour and marker per implementation, in every picture.
STYLE = {
    "eager": {"color": "#7f7f7f", "marker": "s"},
    "sdpa": {"color": "#ff7f0e", "marker": "^"},
    "flashinfer_mla": {"color": "#1f77b4", "marker": "o"},
}
MODEL_NAMES = {
    "deepseek-v3-attn": "DeepSeek-V3 attention shape",
    "deepseek-v32-attn": "DeepSeek-V3.2 attention shape",
    "deepseek-v2-lite": "DeepSeek-V2-Lite",
}


def load(path: Path) -> dict:
    with open(path) as f:
        return json.load(f)


def versions(meta: dict) -> str:
    parts = [meta.get("gpu", "GPU ?"), meta.get("date", "")[:10]]
    for name in ("torch", "transformers", "flashinfer"):
        if meta.get(name):
            parts.append(f"{name} {meta[name]}")
    return ", ".join(p for p in parts if p)


def context_label(n: int) -> str:
    return f"{n // 1024}k" if n % 1024 == 0 else str(n)


def grid_cells(grid: dict, batches: list[int] | None):
    """{batch: {attn: [(context, record), ...]}} of the grid's eager-mode cells, and the floor per cell."""
    cells, floor = {}, {}
    for r in grid["results"]:
        if r.get("mode", "eager") != "eager" or (batches and r["batch"] not in batches):
            continue
        cells.setdefault(r["batch"], {}).setdefault(r["attn"], []).append((r["context"], r))
        if r.get("floor_ms"):
            floor[(r["batch"], r["context"])] = r["floor_ms"]
    for by_attn in cells.values():
        for points in by_attn.values():
            points.sort(key=lambda p: p[0])
    return cells, floor


def plot_grid(plt, ticker, grid: dict, batches: list[int] | None, value: str, out: Path) -> Path:
    """One panel per batch size: `value` ("ms" or "memory") against context, OOM cells marked at the top."""
    cells, floor = grid_cells(grid, batches)
    if not cells:
        raise SystemExit("no eager-mode cells in the grid JSON" + (f" for batch {batches}" if batches else ""))
    meta = grid["metadata"]
    model = grid["results"][0]["model"]
    shape = grid.get("models", {}).get(model, {})
    n = len(cells)
    fig, axes = plt.subplots(1, n, figsize=(3.4 * n + 0.6, 4.8), sharey=True, squeeze=False)
    axes = axes[0]
    tops, lows, ooms = [], [], []
    for ax, batch in zip(axes, sorted(cells)):
        contexts = sorted({c for points in cells[batch].values() for c, _ in points})
        ok = []
        for attn in ("eager", "sdpa", "flashinfer_mla"):
            points = cells[batch].get(attn, [])
            xs, ys = [], []
            for c, r in points:
                if r["status"] != "ok":
                    continue
                y = r["ms_median"] if value == "ms" else r.get("transient_peak_bytes", 0) / 2**20
                xs.append(c)
                ys.append(max(y, 0.05))  # a log axis cannot show 0 MiB
            ok += ys
            if xs:
                ax.plot(xs, ys, label=attn, linewidth=2, markersize=6, **STYLE.get(attn, {}))
        if value == "ms" and any((batch, c) in floor for c in contexts):
            fx = [c for c in contexts if (batch, c) in floor]
            ax.plot(fx, [floor[(batch, c)] for c in fx], "k--", linewidth=1, label="bandwidth floor")
            ok += [floor[(batch, c)] for c in fx]
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.yaxis.set_major_locator(ticker.LogLocator(base=10, subs=(1.0, 3.0)))
        ax.yaxis.set_major_formatter(ticker.FuncFormatter(lambda v, _: f"{v:g}"))
        ax.set_xticks(contexts)
        ax.set_xticklabels([context_label(c) for c in contexts])
        ax.minorticks_off()
        ax.set_title(f"batch {batch}")
        ax.set_xlabel("context (tokens)")
        ax.grid(True, which="major", alpha=0.3)
        ax.set_xlim(contexts[0] / 1.5, contexts[-1] * 1.5)
        tops.append(max(ok) if ok else 1.0)
        lows.append(min(ok) if ok else 1.0)
        for c in contexts:
            oom = [a for a in ("eager", "sdpa")
                   for cc, r in cells[batch].get(a, []) if cc == c and r["status"] == "oom"]
            if oom:
                ooms.append((ax, c, "OOM" if len(oom) == 2 else f"{oom[0]}\nOOM"))
    top = max(tops) * 1.8  # one height for every panel's OOM marks: the panels share their y axis
    for ax, c, text in ooms:
        ax.plot([c], [top], linestyle="none", marker="x", markersize=9, markeredgewidth=2, color="#d62728",
                label="out of memory (OOM)")
        ax.annotate(text, (c, top), textcoords="offset points", xytext=(0, -16), ha="center", va="top", fontsize=8,
                    color="#d62728")
    axes[0].set_ylim(10 ** math.floor(math.log10(min(lows))), top * 2.5)  # from a power of ten: a labelled tick
    axes[0].set_ylabel("ms per decode step" if value == "ms" else "transient memory per step (MiB)")
    handles, labels = axes[0].get_legend_handles_labels()
    for ax in axes[1:]:  # a panel may have a curve the first lacks
        for h, lab in zip(*ax.get_legend_handles_labels()):
            if lab not in labels:
                handles.append(h)
                labels.append(lab)
    fig.legend(handles, labels, loc="lower center", ncol=len(labels), frameon=False, fontsize=10)
    what = "Decode step time" if value == "ms" else "Transient memory of a decode step"
    dims = ", ".join(f"{shape[k]} {k}" for k in ("layers", "heads") if k in shape)
    fig.suptitle(f"{what}, {MODEL_NAMES.get(model, model)} ({dims}), {meta.get('args', {}).get('dtype', '')}, "
                 f"eager mode (no CUDA graphs)\n{versions(meta)}", fontsize=11)
    fig.tight_layout(rect=(0, 0.07, 1, 1))
    path = out / ("decode_step_time.png" if value == "ms" else "decode_memory.png")
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def mode_label(mode: str, static_batch) -> str:
    kind, attn = mode.split("-", 1)
    if kind == "cb":
        if attn.endswith("-sdpa-prefill"):
            return f"continuous batching, {attn.removesuffix('-sdpa-prefill')}, SDPA prefill"
        return f"continuous batching, {attn}"
    return f"generate(), batches of {static_batch}, {attn}"


def plot_serving(plt, runs: list[dict], out: Path) -> Path:
    """One panel per serving run: output tokens/s of each mode, horizontal bars."""
    n = len(runs)
    fig, axes = plt.subplots(n, 1, figsize=(11, 1.0 + 2.4 * n), squeeze=False)
    for ax, run in zip(axes[:, 0], runs):
        args = run["metadata"].get("args", {})
        rows = [r for r in run["results"] if r.get("status") == "ok"][::-1]
        labels = [mode_label(r["mode"], args.get("static_batch", "?")) for r in rows]
        values = [r["tokens_per_s"] for r in rows]
        colors = [STYLE.get(r["mode"].split("-", 1)[1].removesuffix("-sdpa-prefill"), {}).get("color", "#999999")
                  for r in rows]
        bars = ax.barh(range(len(rows)), values, color=colors)
        for bar, r in zip(bars, rows):
            if r["mode"].startswith("generate"):
                bar.set_hatch("//")
                bar.set_edgecolor("white")
        ax.set_yticks(range(len(rows)))
        ax.set_yticklabels(labels, fontsize=9)
        for i, v in enumerate(values):
            ax.annotate(f"{v:,.0f}", (v, i), textcoords="offset points", xytext=(4, 0), va="center", fontsize=9)
        ax.set_xlim(0, max(values) * 1.18)
        model = args.get("model", "?")
        ax.set_title(f"{MODEL_NAMES.get(model, model)}: {args.get('requests', '?')} requests, prompts "
                     f"{args.get('prompt_min', '?')}-{args.get('prompt_max', '?')}, {args.get('new', '?')} new "
                     f"tokens each, all arriving at once", fontsize=10)
        ax.grid(True, axis="x", alpha=0.3)
    axes[-1, 0].set_xlabel("output tokens/s (all new tokens / wall time)")
    meta = runs[0]["metadata"]
    fig.suptitle(f"Serving throughput: continuous batching against generate() on fixed batches, bf16\n"
                 f"{versions(meta)}", fontsize=11)
    fig.tight_layout()
    path = out / "serving_throughput.png"
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


# The loop's phases in the order they run, Transformers' in greys and blues, the package's in red.
PHASE_COLORS = {"schedule": "#c7c7c7", "batch tensors": "#9ecae1", "step plan": "#d62728",
                "inputs to device": "#6baed6", "forward": "#1f77b4", "wait for GPU": "#ffbb78",
                "updates": "#7f7f7f", "other": "#e5e5e5"}


def plot_split(plt, runs: list[dict], out: Path) -> Path:
    """One panel per run: per mode and kind of step, the mean wall time of a step split into the loop's phases."""
    fig, axes = plt.subplots(len(runs), 1, figsize=(11, 1.4 + 2.8 * len(runs)), squeeze=False)
    for ax, run in zip(axes[:, 0], runs):
        args = run["metadata"].get("args", {})
        bars = []  # (label, phases_ms, gpu span)
        for r in run["results"]:
            split = r.get("loop_split")
            if not split or r.get("status") not in ("ok", "time-limit"):
                continue
            for kind, k in sorted(split["kinds"].items(), key=lambda kv: -kv[1]["steps"]):
                if k["steps"] < 3:
                    continue
                rows = "token indices" if r["mode"].endswith("-token-indices") else "block tables"
                label = f"{rows}, {'async' if r.get('async_batching') else 'sync'}: {kind} ({k['steps']} steps)"
                bars.append((label, k["phases_ms"], k.get("gpu_span_ms")))
        bars = bars[::-1]
        for i, (_, phases, span) in enumerate(bars):
            left = 0.0
            for phase, ms in phases.items():
                ax.barh(i, ms, left=left, color=PHASE_COLORS.get(phase, "#999999"),
                        hatch="//" if phase == "step plan" else None, edgecolor="white", linewidth=0.5,
                        label=phase if i == 0 else None)
                left += ms
            ax.annotate(f"{left:.1f} ms", (left, i), textcoords="offset points", xytext=(4, 0), va="center",
                        fontsize=8)
            if span:
                ax.plot([span, span], [i - 0.4, i + 0.4], color="black", linewidth=1.5,
                        label="GPU span" if i == 0 else None)
        ax.set_yticks(range(len(bars)))
        ax.set_yticklabels([b[0] for b in bars], fontsize=8)
        model = args.get("model", "?")
        ax.set_title(f"{MODEL_NAMES.get(model, model)}: {args.get('requests', '?')} requests at once, prompts "
                     f"{args.get('prompt_min', '?')}-{args.get('prompt_max', '?')}, {args.get('new', '?')} new",
                     fontsize=10)
        ax.grid(True, axis="x", alpha=0.3)
        ax.set_xlim(0, ax.get_xlim()[1] * 1.1)
    axes[-1, 0].set_xlabel("mean wall time of a step (ms), by phase of Transformers' generation loop; "
                           "hatched: this package's step plan")
    handles, labels = axes[0, 0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="lower center", ncol=len(labels), fontsize=8, frameon=False)
    fig.suptitle(f"Where a continuous-batching step's time goes (generation thread)\n{versions(runs[0]['metadata'])}",
                 fontsize=11)
    fig.tight_layout(rect=(0, 0.04, 1, 1))
    path = out / "serving_step_split.png"
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    p.add_argument("--grid", type=Path, default=BENCH / "decode_grid_v3.json",
                   help="bench_decode.py JSON of the eager-mode grid (default: benchmarks/decode_grid_v3.json)")
    p.add_argument("--serving", type=Path, nargs="*",
                   default=[BENCH / "serving_v2lite.json", BENCH / "serving_v3.json"],
                   help="bench_serving.py JSON files, one panel each (default: benchmarks/serving_v2lite.json "
                        "benchmarks/serving_v3.json; the flag alone: no serving picture)")
    p.add_argument("--split", type=Path, nargs="*", default=[],
                   help="bench_serving.py --loop-split JSON files, one panel each (serving_step_split.png)")
    p.add_argument("--batch", type=int, nargs="+", default=None, help="batch sizes to draw (default: all)")
    p.add_argument("--out", type=Path, default=ROOT / "docs", help="directory for the PNGs (default: docs/)")
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    try:
        import matplotlib
    except ImportError:
        raise SystemExit('plot_benchmarks.py needs matplotlib: pip install "hf-flashinfer-mla[bench]"') from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib import ticker

    args.out.mkdir(parents=True, exist_ok=True)
    grid = load(args.grid)
    written = [plot_grid(plt, ticker, grid, args.batch, value, args.out) for value in ("ms", "memory")]
    if args.serving:
        written.append(plot_serving(plt, [load(p) for p in args.serving], args.out))
    if args.split:
        written.append(plot_split(plt, [load(p) for p in args.split], args.out))
    for path in written:
        print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
