"""generate() reading its stop condition a step late, on CUDA, for flashinfer_mla models (``generation.py``).

Transformers' `DeferredStopCheck` (5.24 and 5.25 have it) reads "have all rows stopped?" one step late, so the host
queues the next step instead of waiting for the GPU; when every row has stopped it has run one forward too many, and
undoes it (tokens, logits, scores, the returned cache). Transformers enables it on MPS only; the package enables it
on CUDA for the caches generate() prepares for a flashinfer_mla model. These tests run that path on the CPU: the
package admits the CPU there (`DEFERRED_STOP_DEVICES`) and `torch.Event`, which the CPU lacks, gets a stand-in (the
CPU has finished every op before the next, so every event has happened). The oracle is eager, which checks every
step.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from helpers import (
    GENERATION_MODES, HYBRIDS, assert_same_outputs, generation_mode, left_padded_batch, make_model, rel_err,
)
from fake_flashinfer import fake_hopper  # noqa: F401  (fixture)
from transformers import DynamicCache, LogitsProcessor, LogitsProcessorList, StaticCache
from transformers.generation.streamers import BaseStreamer

from hf_flashinfer_mla import generation

DeferredStopCheck = generation.DeferredStopCheck
pytestmark = pytest.mark.skipif(DeferredStopCheck is None, reason="this Transformers checks every step")

MAX_NEW = 10
CUDA = torch.device("cuda")


class HostEvent:
    """`torch.Event` on the CPU: every op has run before the next is issued, so an event has always happened."""

    def __init__(self, device=None, blocking=False, **kwargs):
        pass

    def record(self, stream=None):
        pass

    def synchronize(self):
        pass

    def query(self):
        return True


@pytest.fixture
def late_stop_on_cpu(monkeypatch):
    """The CUDA path, on the CPU. Returns the number of steps each deferred generate() undid, one entry per call
    (a call that checked every step adds none)."""
    monkeypatch.setattr(generation, "DEFERRED_STOP_DEVICES", ("cuda", "cpu"))
    monkeypatch.setattr(torch, "Event", HostEvent)
    monkeypatch.delenv(generation.DEFER_STOP_ENV, raising=False)
    undone, finish = [], DeferredStopCheck.finish

    def counted(self):
        undone.append(finish(self))
        return undone[-1]

    monkeypatch.setattr(DeferredStopCheck, "finish", counted)
    return undone


def test_a_step_late_on_cuda_for_caches_generate_prepared_for_flashinfer_mla(monkeypatch):
    monkeypatch.delenv(generation.DEFER_STOP_ENV, raising=False)
    model = make_model("deepseek_v3")
    ids, mask, _ = left_padded_batch()
    ours = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=2, return_dict_in_generate=True).cache
    users = DynamicCache(config=model.config)
    model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=2, cache=users)
    for cache in (ours, users):
        assert DeferredStopCheck.is_supported(CUDA, cache, cache_is_returned=True, is_assistant=False)
        assert not DeferredStopCheck.is_supported(CUDA, cache, cache_is_returned=True, is_assistant=True)
        assert not DeferredStopCheck.is_supported(torch.device("cpu"), cache, True, False)
    monkeypatch.setenv(generation.DEFER_STOP_ENV, "0")
    assert not DeferredStopCheck.is_supported(CUDA, ours, True, False)
    monkeypatch.delenv(generation.DEFER_STOP_ENV)
    # A returned cache must be able to undo the extra step (Transformers' rule); one that is dropped need not.
    uncroppable = SimpleNamespace(is_croppable=False, **{generation.DEFERS_STOP: True})
    assert not DeferredStopCheck.is_supported(CUDA, uncroppable, cache_is_returned=True, is_assistant=False)
    assert DeferredStopCheck.is_supported(CUDA, uncroppable, cache_is_returned=False, is_assistant=False)
    # Another attention's caches keep Transformers' rule: MPS only. The mark follows the latest generate() call.
    model.set_attn_implementation("eager")
    eager = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=2, return_dict_in_generate=True).cache
    model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=2, cache=users)  # (its content: a test's)
    for cache in (eager, users):
        assert not DeferredStopCheck.is_supported(CUDA, cache, True, False)
        assert DeferredStopCheck.is_supported(torch.device("mps"), cache, True, False)


class Recorder(BaseStreamer, LogitsProcessor):
    """A streamer (the tokens it is handed) and a logits processor (how often it is called), in one."""

    def __init__(self):
        self.streamed, self.calls = [], 0

    def put(self, value):
        self.streamed.append(value.reshape(-1).clone())

    def end(self):
        pass

    def __call__(self, input_ids, scores):
        self.calls += 1
        return scores


def stop_at_eos(model, ids, mask, eos, cache_implementation="dynamic", cache=None):
    recorder = Recorder()
    out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=MAX_NEW, do_sample=False,
                         eos_token_id=eos, pad_token_id=0, output_logits=True, output_scores=True,
                         return_dict_in_generate=True, disable_compile=True, streamer=recorder,
                         logits_processor=LogitsProcessorList([recorder]), cache=cache,
                         cache_implementation=None if cache is not None else cache_implementation)
    return out, recorder


def every_row_stops_early(model, ids, mask) -> list[int]:
    """Eos tokens at which every row stops before MAX_NEW, each at another step: row i's greedy token 2 + 2i."""
    greedy = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=MAX_NEW, do_sample=False)
    return sorted({int(greedy[i, ids.shape[1] + 2 + 2 * i]) for i in range(ids.shape[0])})


@pytest.mark.parametrize("cache_implementation", ["dynamic", "static"])
def test_rows_all_stopping_at_eos_a_step_late_match_eager(late_stop_on_cpu, cache_implementation):
    """A left-padded batch whose rows all stop at eos, at different steps, before max_new_tokens: the step after
    the last row stopped runs and is undone. Tokens, logits, scores, the streamed tokens and the returned cache's
    length are eager's (float32, where batched eager is exact), and the cache continues as eager's does."""
    model = make_model("deepseek_v3", dtype=torch.float32)
    ids, mask, _ = left_padded_batch(lengths=(7, 4, 9))
    model.set_attn_implementation("eager")
    eos = every_row_stops_early(model, ids, mask)
    ref, ref_recorder = stop_at_eos(model, ids, mask, eos, cache_implementation)
    model.set_attn_implementation("flashinfer_mla")
    assert late_stop_on_cpu == []  # eager checked every step
    ours, recorder = stop_at_eos(model, ids, mask, eos, cache_implementation)
    assert late_stop_on_cpu == [1]  # one step too many ran, and was undone
    assert recorder.calls == ref_recorder.calls + 1  # (the extra step's logits processors ran: documented)
    new = ref.sequences.shape[1] - ids.shape[1]
    assert new < MAX_NEW and all(bool((row == 0).any() or row[-1] in eos) for row in ref.sequences[:, ids.shape[1]:])
    assert torch.equal(ours.sequences, ref.sequences)
    assert len(ours.logits) == len(ref.logits) == len(ours.scores) == new
    assert rel_err(torch.stack(ours.logits), torch.stack(ref.logits)) < 1e-5
    assert len(recorder.streamed) == len(ref_recorder.streamed) == 1 + new  # the prompt, then one entry per step
    assert all(torch.equal(a, b) for a, b in zip(recorder.streamed, ref_recorder.streamed))
    assert int(ours.cache.get_seq_length()) == int(ref.cache.get_seq_length()) == ours.sequences.shape[1] - 1
    if cache_implementation == "dynamic":  # continued: a cache that kept the extra step's row would differ
        more = torch.ones(ids.shape[0], new, dtype=mask.dtype)
        again = [model.generate(input_ids=out.sequences, attention_mask=torch.cat([mask, more], -1), cache=out.cache,
                                max_new_tokens=4, do_sample=False, output_logits=True, return_dict_in_generate=True)
                 for out in (ours,)]
        model.set_attn_implementation("eager")
        again.append(model.generate(input_ids=ref.sequences, attention_mask=torch.cat([mask, more], -1),
                                    cache=ref.cache, max_new_tokens=4, do_sample=False, output_logits=True,
                                    return_dict_in_generate=True))
        assert torch.equal(again[0].sequences, again[1].sequences)
        assert rel_err(torch.stack(again[0].logits), torch.stack(again[1].logits)) < 1e-5


def test_a_static_cache_of_the_users_own_kept_across_calls_matches_eager(late_stop_on_cpu):
    """The README's way to keep CUDA graphs replaying across static-cache generate() calls: one `StaticCache`, reset
    and passed to every call (with cache_implementation="static" Transformers builds a new cache per call, whose
    tensors may land at other addresses, and CUDA graphs then record again). Over calls with other prompts and
    paddings whose rows all stop at eos, a step late (a cache of the user's own is returned, so the extra step is
    cropped off it before the next call resets it): tokens and logits are eager's with a new static cache per call,
    and the kept cache holds eager's latent rows."""
    model = make_model("deepseek_v3", dtype=torch.float32)
    cache = StaticCache(config=model.config, max_cache_len=32)
    for seed, lengths in ((1, (7, 4, 9)), (2, (3, 11, 6)), (1, (7, 4, 9))):
        ids, mask, _ = left_padded_batch(seed, lengths)
        model.set_attn_implementation("eager")
        eos = every_row_stops_early(model, ids, mask)
        ref, _ = stop_at_eos(model, ids, mask, eos, "static")
        model.set_attn_implementation("flashinfer_mla")
        calls = len(late_stop_on_cpu)
        cache.reset()
        ours, _ = stop_at_eos(model, ids, mask, eos, cache=cache)
        assert late_stop_on_cpu[calls:] == [1]  # one step too many ran, and was undone
        assert torch.equal(ours.sequences, ref.sequences)
        assert rel_err(torch.stack(ours.logits), torch.stack(ref.logits)) < 1e-5
        n = int(ref.cache.get_seq_length())
        assert ours.cache is cache and int(cache.get_seq_length()) == n == ours.sequences.shape[1] - 1
        shown = torch.cat([mask, torch.ones(len(lengths), n - ids.shape[1], dtype=mask.dtype)], -1).bool()
        for kept, fresh in zip(cache.layers, ref.cache.layers):  # (rows of the padding are never read)
            for a, b in ((kept.keys, fresh.keys), (kept.values, fresh.values)):
                assert rel_err(a[:, 0, :n][shown], b[:, 0, :n][shown]) < 1e-5


def test_a_step_late_is_off_with_the_environment_variable(late_stop_on_cpu, monkeypatch):
    model = make_model("deepseek_v3", dtype=torch.float32)
    ids, mask, _ = left_padded_batch(lengths=(7, 4, 9))
    monkeypatch.setenv(generation.DEFER_STOP_ENV, "0")
    eos = every_row_stops_early(model, ids, mask)
    off, off_recorder = stop_at_eos(model, ids, mask, eos)
    assert late_stop_on_cpu == []
    monkeypatch.delenv(generation.DEFER_STOP_ENV)
    on, on_recorder = stop_at_eos(model, ids, mask, eos)
    assert late_stop_on_cpu == [1] and on_recorder.calls == off_recorder.calls + 1
    assert torch.equal(on.sequences, off.sequences)


@pytest.mark.parametrize("mode", [m for m in GENERATION_MODES if not m.startswith("assisted") and m != "beams"])
def test_generation_modes_a_step_late_on_the_kernel_match_checking_every_step(fake_hopper, late_stop_on_cpu,
                                                                              monkeypatch, mode):
    """Every generation mode that runs Transformers' sampling loop (assisted generation and beam search have loops
    of their own, which check every step), on the fa3 stand-in (which attends over the rows it was planned with, so
    a plan made for the wrong step shows): a step late, and checking every step, give the same outputs."""
    late = generation_mode(mode)
    assert late_stop_on_cpu, "the stop check ran a step late"
    monkeypatch.setenv(generation.DEFER_STOP_ENV, "0")
    calls = len(late_stop_on_cpu)
    every = generation_mode(mode)
    assert len(late_stop_on_cpu) == calls
    assert_same_outputs(late, every, 1e-12)


def test_every_family_stopping_at_eos_a_step_late_continues_as_checking_every_step(late_stop_on_cpu, monkeypatch,
                                                                                    model_type):
    """Every dense family, the hybrids' linear-attention layers included (whose recurrent states Transformers records
    to undo the extra step): all rows stopping at eos a step late give the tokens and logits of every step checked,
    and the returned caches continue alike."""
    model = make_model(model_type)
    ids, mask, _ = left_padded_batch(lengths=(7, 4, 9))
    monkeypatch.setenv(generation.DEFER_STOP_ENV, "0")
    eos = every_row_stops_early(model, ids, mask)
    runs = []
    for defer in ("0", "1"):
        monkeypatch.setenv(generation.DEFER_STOP_ENV, defer)
        out, _ = stop_at_eos(model, ids, mask, eos)
        more = torch.ones(ids.shape[0], out.sequences.shape[1] - ids.shape[1], dtype=mask.dtype)
        again = model.generate(input_ids=out.sequences, attention_mask=torch.cat([mask, more], -1), cache=out.cache,
                               max_new_tokens=4, do_sample=False, output_logits=True, return_dict_in_generate=True)
        runs.append((out, again))
    (every, every_again), (late, late_again) = runs
    if late.cache.is_croppable:
        assert late_stop_on_cpu == [1, 0]  # the first call stopped at eos a step late; its continuation ran to the end
    else:  # (Transformers 5.24's linear-attention layers cannot undo a step: it checks every step for a returned cache)
        assert model_type in HYBRIDS and late_stop_on_cpu == []
    assert late.sequences.shape[1] - ids.shape[1] < MAX_NEW
    for a, b in ((late, every), (late_again, every_again)):
        assert torch.equal(a.sequences, b.sequences)
        assert rel_err(torch.stack(a.logits), torch.stack(b.logits)) < 1e-12
