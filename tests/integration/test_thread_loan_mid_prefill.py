"""A thread loan made or ended while a prompt computes takes effect from the next layer: the engine
thread takes up `ThreadCount` in the prefill layer hook the workers install (a whole long prompt is one
step of seconds; at the step's end the loan would come too late). A real engine over a tiny model of
eight layers."""
from __future__ import annotations

import math

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from engine import SamplingParams
from engine.profiling import time_prefill, time_threads_speedup
from tests.conftest import TINY
from tests.integration.test_engine_correctness import assert_all_free, make_engine
from worker_core.base import ThreadCount


def test_a_loan_reaches_a_prefill_step_under_way():
    engine = make_engine(LlamaForCausalLM(LlamaConfig(**{**TINY, "num_hidden_layers": 8})).eval())
    threads = ThreadCount(1)
    seen: list[tuple[int, bool]] = []

    def after_layer(layer: int, seqs: list) -> None:
        threads.apply()  # what the workers' hook does
        seen.append((torch.get_num_threads(), threads.borrowed))
        if layer == 1:
            threads.want(2)  # the router lends (an actor thread, here mid-step)
        if layer == 5:
            threads.want(1)  # and takes the loan back
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    engine.set_prefill_layer_hook(after_layer)
    try:
        engine.generate([list(range(100, 400))], SamplingParams(max_tokens=1))
        # one step (the prompt went whole), the loan between layers
        assert seen == [(1, False), (1, False), *[(2, True)] * 4, (1, False), (1, False)]
    finally:
        torch.set_num_threads(before)


def test_applying_changes_only_what_was_asked_since():
    threads = ThreadCount(1)
    before = torch.get_num_threads()
    try:
        threads.apply()  # nothing asked: the count stays
        assert torch.get_num_threads() == before
        threads.want(1)
        threads.apply()
        assert torch.get_num_threads() == 1
        torch.set_num_threads(2)  # a measurement sets its own count: not undone by the next layer's apply
        threads.apply()
        assert torch.get_num_threads() == 2
        assert not threads.borrowed  # the count applied is its own
        with pytest.raises(ValueError, match="threads must be >= 1"):
            threads.want(0)
        with pytest.raises(ValueError, match="own must be >= 1"):
            ThreadCount(0)
    finally:
        torch.set_num_threads(before)


def test_the_loan_s_speedup_is_measured_for_decode_steps_and_prefills_apart():
    """What a lent thread buys a worker, as `WorkerBase.profile_threads` measures it: a decode step and
    a prefill each timed on the engine's own count and on the lent one; the own count is restored and no
    request is left behind."""
    engine = make_engine(LlamaForCausalLM(LlamaConfig(**TINY)).eval())
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        speedup = time_threads_speedup(engine, 2, rounds=1, batch=2, prompt_tokens=64)
        assert torch.get_num_threads() == 1
    finally:
        torch.set_num_threads(before)
    assert isinstance(speedup, tuple) and len(speedup) == 2
    assert all(math.isfinite(s) and s > 0 for s in speedup)
    assert not engine.has_unfinished()
    assert_all_free(engine)


def test_a_repeated_prefill_probe_computes_its_whole_prompt_every_time():
    """The engine's prefix cache keeps a finished prompt's blocks: a probe that drew the same prompt again
    (the speedup's rounds, a second calibration) would time a prefill of its last few tokens."""
    engine = make_engine(LlamaForCausalLM(LlamaConfig(**TINY)).eval())
    for seed in (0, 0, 0, 1):
        before = engine.stats.prefill_tokens
        time_prefill(engine, 64, seed=seed)
        assert engine.stats.prefill_tokens - before == 64
    assert_all_free(engine)
