"""Host time of the attention function per decode layer on the CPU, with FlashInfer's fa3 stand-in
(``tests/fake_flashinfer.py``) and a kernel that does nothing: the package's own Python and view work, what it
costs on every layer of every step, without a GPU. To compare two revisions, run it on each.

    python scripts/dev/host_cpu_standin.py          # or: python -m pytest -q -s scripts/dev/host_cpu_standin.py

Prints, per repetition of 60 generate()-driven steps of an 8-layer conftest DeepSeek-V3 (batch 4), the median time
of a step's first layer (which builds the step's route) and of the others, in microseconds.
"""

import argparse
import os
import statistics
import sys
import time

import pytest
import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "tests"))
from helpers import decode_logits, make_model  # noqa: E402
from fake_flashinfer import FakeMLAModule, fake_hopper  # noqa: E402,F401  (fixture)
from transformers import AttentionInterface  # noqa: E402

LAYERS = 8


def test_attention_function_host_time(fake_hopper, monkeypatch):
    monkeypatch.setattr(FakeMLAModule, "run", lambda self, *args, **kwargs: None)  # the launch only
    model = make_model("deepseek_v3", num_hidden_layers=LAYERS)
    registered = AttentionInterface._global_mapping["flashinfer_mla"]
    times = []

    def timed(*args, **kwargs):
        start = time.perf_counter()
        out = registered(*args, **kwargs)
        times.append(time.perf_counter() - start)
        return out

    monkeypatch.setitem(AttentionInterface._global_mapping, "flashinfer_mla", timed)
    ids, mask = torch.randint(1, 90, (4, 12)), torch.ones(4, 12, dtype=torch.long)
    rounds = []
    with torch.no_grad():
        decode_logits(model, ids, mask, steps=10, as_generate=True)  # warm-up
        for _ in range(5):
            times.clear()
            decode_logits(model, ids, mask, steps=60, as_generate=True)
            steps = times[LAYERS:]  # (the prefill's layers first)
            first = [t for i, t in enumerate(steps) if i % LAYERS == 0]
            others = [t for i, t in enumerate(steps) if i % LAYERS]
            rounds.append((statistics.median(first) * 1e6, statistics.median(others) * 1e6))
    print("\nattention function per layer, us (first layer / others), per repetition:",
          ", ".join(f"{a:.0f} / {b:.1f}" for a, b in rounds), f"| best of the others: {min(b for _, b in rounds):.1f}")
    assert all(a > 0 and b > 0 for a, b in rounds)


def main(argv=None) -> int:
    """The measurement under pytest (it uses the stand-in's fixtures)."""
    argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter).parse_args(argv)
    return int(pytest.main([__file__, "-q", "-s", "-p", "no:cacheprovider"]))


if __name__ == "__main__":
    sys.exit(main())
