#!/usr/bin/env python3
"""The WHOLE ``tests/gpu`` on one GPU in several pytest processes at once, so that it fits one bounded device call.

Most of the suite's time is torch.compile's inductor and Python on the host, not the GPU, and every test builds its
own small model (2 layers), so several processes fit on one GPU, and the wall time is bounded by the slowest worker
instead of the sum.

It collects every test of ``tests/gpu`` (``pytest --collect-only``; ``-k`` narrows it as pytest's does) and deals
them to ``--workers`` processes, largest first. The weights come from an earlier run's ``gpu_suite_durations.json``
if one is given, else from a rule of thumb: the compiling tests are the heavy ones. Each worker keeps its tests in
the suite's order. Its log (with ``-s``: the tests' measured errors), headed by the tests it was given in order, is
merged into ``gpu_suite_workers.txt`` at the end, and its JUnit file is read for the report. The report checks that
every collected test was reported, so a worker that died or was cut by ``--timeout`` shows as missing tests, never
as a shorter green run. It exits 0 only when nothing failed and nothing is missing. ``scripts/dev/gpu_round.sh
suite`` runs it with six workers.

    python3 scripts/dev/gpu_suite_parallel.py --workers 6 --timeout 480 --out "$OUT"
    python3 scripts/dev/gpu_suite_parallel.py --durations benchmarks/.../gpu_suite_durations.json --out "$OUT"
    python3 scripts/dev/gpu_suite_parallel.py --workers 6 --seed 7 --reverse --out "$OUT"   # the second run

Tests are written to be order-independent (each resets the process caches it counts on), and a green suite is run
twice, the second time in another order: ``--reverse`` runs each worker's tests last to first, ``--seed N`` deals
them into another split of about the same balance (each weight scaled by a factor in [0.8, 1.25] drawn from N) and
runs each worker's share in an order drawn from N; the workers' log names the order, to replay a failure. The
multi-GPU tests skip on one GPU, as in the one-process run. Without CUDA the suite runs on the CPU stand-ins
(``tests/gpu/gpu_suite.py``), which checks this script there.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import random
import subprocess
import sys
import time
import xml.etree.ElementTree as ET

ROOT = pathlib.Path(__file__).resolve().parents[2]
HEAVY = ("graphs", "compiled", "static_generate", "reset_frees")  # names of tests that compile with inductor


def collect(keyword: str | None = None) -> list[str]:
    """The node ids of ``tests/gpu`` in the suite's order (those whose names match `keyword`, pytest's ``-k``)."""
    out = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider",
                          "-p", "no:randomly", "tests/gpu", *(["-k", keyword] if keyword else [])],
                         cwd=ROOT, capture_output=True, text=True, check=True).stdout
    return [line.strip() for line in out.splitlines() if "::" in line]


def weight(node: str, known: dict[str, float]) -> float:
    if node in known:
        return known[node]
    name = node.split("::", 1)[1]
    return 60.0 if any(h in name for h in HEAVY) else 8.0 if "64_steps" in name else 3.0


def deal(nodes: list[str], workers: int, known: dict[str, float], seed: int | None = None,
         reverse: bool = False) -> list[list[str]]:
    """Largest first to the least loaded worker; each worker's tests then in the suite's order. `seed`: each weight
    scaled by a factor in [0.8, 1.25] drawn from it (another split), and each share in an order drawn from it;
    `reverse`: each share last to first."""
    rng = random.Random(seed) if seed is not None else None
    weights = {n: weight(n, known) * (rng.uniform(0.8, 1.25) if rng else 1.0) for n in nodes}
    loads, shares = [0.0] * workers, [[] for _ in range(workers)]
    for node in sorted(nodes, key=lambda n: -weights[n]):
        i = loads.index(min(loads))
        shares[i].append(node)
        loads[i] += weights[node]
    order = {n: k for k, n in enumerate(nodes)}
    shares = [sorted(s, key=order.__getitem__) for s in shares if s]
    for share in shares:
        if rng:
            rng.shuffle(share)
        if reverse:
            share.reverse()
    return shares


def node_id(classname: str, name: str) -> str:
    """A JUnit test case's pytest node id: ``tests.gpu.test_x`` (+ ``.TestClass``) and ``name`` ->
    ``tests/gpu/test_x.py[::TestClass]::name``."""
    parts = classname.split(".")
    for cut in range(len(parts), 0, -1):
        if (ROOT / pathlib.Path(*parts[:cut])).with_suffix(".py").is_file():
            return "::".join(["/".join(parts[:cut]) + ".py", *parts[cut:], name])
    return f"{classname}::{name}"


def results(xml: pathlib.Path) -> dict[str, tuple[str, float]]:
    """``node id -> (outcome, seconds)`` from a worker's JUnit file."""
    found = {}
    if not xml.exists():
        return found
    for case in ET.parse(xml).getroot().iter("testcase"):
        outcome = next((o for tag, o in (("failure", "failed"), ("error", "error"), ("skipped", "skipped"))
                        if case.find(tag) is not None), "passed")
        found[node_id(case.get("classname", ""), case.get("name", ""))] = (outcome, float(case.get("time", 0)))
    return found


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--workers", type=int, default=4, help="pytest processes")
    p.add_argument("--timeout", type=float, default=420, help="seconds before the workers still running are stopped")
    p.add_argument("--durations", default=None, help="gpu_suite_durations.json of another run, for the balance")
    p.add_argument("--reverse", action="store_true", help="each worker runs its tests in the reverse order")
    p.add_argument("--seed", type=int, default=None,
                   help="another split of the tests (weights scaled by factors drawn from it) and each worker's "
                        "tests in an order drawn from it")
    p.add_argument("-k", dest="keyword", default=None, help="only the tests whose names match (pytest's -k)")
    p.add_argument("--out", default=os.environ.get("OUT", "gpu_suite_out"),
                   help="directory for gpu_suite_summary.txt, gpu_suite_durations.json, gpu_suite_workers.txt "
                        "(default: $OUT, else gpu_suite_out)")
    args = p.parse_args(argv)
    out = pathlib.Path(args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    known = json.loads(pathlib.Path(args.durations).read_text()) if args.durations else {}
    t0 = time.monotonic()
    nodes = collect(args.keyword)
    shares = deal(nodes, args.workers, known, args.seed, args.reverse)
    procs = []
    for i, share in enumerate(shares):
        log = open(out / f"worker{i}.txt", "w")
        cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "no:randomly", "-s",
               f"--junitxml={out}/worker{i}.xml", *share]
        procs.append((subprocess.Popen(cmd, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT), log))
    deadline = t0 + args.timeout
    for proc, log in procs:
        try:
            proc.wait(timeout=max(deadline - time.monotonic(), 0.01))
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        log.close()
    wall = time.monotonic() - t0
    reported: dict[str, tuple[str, float]] = {}
    for i in range(len(shares)):
        reported.update(results(out / f"worker{i}.xml"))
    counts: dict[str, int] = {}
    for outcome, _ in reported.values():
        counts[outcome] = counts.get(outcome, 0) + 1
    missing = [n for n in nodes if n not in reported]
    bad = [n for n, (o, _) in reported.items() if o in ("failed", "error")]
    # One log for all workers, and no JUnit files: a device call brings back at most 8 files.
    with open(out / "gpu_suite_workers.txt", "w") as merged:
        for i, share in enumerate(shares):
            log, xml = out / f"worker{i}.txt", out / f"worker{i}.xml"
            merged.write(f"== worker {i}: {len(share)} tests, in this order:\n" + "".join(f"   {n}\n" for n in share)
                         + (log.read_text() if log.exists() else "(no log)\n"))
            log.unlink(missing_ok=True)
            xml.unlink(missing_ok=True)
    (out / "gpu_suite_durations.json").write_text(json.dumps({n: s for n, (_, s) in reported.items()}, indent=1))
    busy = [sum(reported.get(n, ("", 0.0))[1] for n in share) for share in shares]
    tally = [f"{v} {k}" for k, v in sorted(counts.items())] + [f"{len(missing)} missing"]
    order = ", ".join([f"seed {args.seed}"] * (args.seed is not None) + ["reversed"] * args.reverse) or "suite order"
    summary = (f"tests/gpu in {len(shares)} workers ({order}): {len(nodes)} collected, {', '.join(tally)}; "
               f"{wall:.0f} s wall (workers' test time {', '.join(f'{b:.0f}' for b in busy)} s)")
    print(summary)
    for n in bad:
        print(f"FAILED {n}")
    for n in missing:
        print(f"MISSING {n}")
    (out / "gpu_suite_summary.txt").write_text(summary + "\n" + "".join(f"FAILED {n}\n" for n in bad)
                                                + "".join(f"MISSING {n}\n" for n in missing))
    return 0 if not bad and not missing else 1


if __name__ == "__main__":
    sys.exit(main())
