"""Log-probabilities in the engine (fp32): each output token's is the log-softmax of the model's own
logits for that prefix (transformers, one full forward), raw (before penalties and temperature); the
top k are the k likeliest, the greedy token first; a request that did not ask gets none. The paths
through real workers (the remote path's first token from the prefill worker) are checked against
the same reference in test_disaggregated.py, a moved stream in test_faults.py."""
from __future__ import annotations

import copy

import pytest
import torch

from engine import SamplingParams
from engine.logprobs import TokenLogprob
from tests.conftest import random_prompt, tiny_model
from tests.integration.test_engine_correctness import assert_all_free, make_engine

TOL = 1e-4


def reference_logprobs(model, prompt: list[int], output: list[int]) -> torch.Tensor:
    """[len(output), V]: the log-softmax of the model's logits before each output token."""
    with torch.no_grad():
        logits = model(torch.tensor([prompt + output[:-1]])).logits[0, len(prompt) - 1:].float()
    return torch.log_softmax(logits, dim=-1)


def assert_match(ref_lp: torch.Tensor, output: list[int], got: list[TokenLogprob], k: int) -> None:
    """Each token's logprob and its top k against the reference rows."""
    assert [g.token_id for g in got] == output
    for row, g in zip(ref_lp, got):
        assert abs(g.logprob - float(row[g.token_id])) < TOL
        assert len(g.top_ids) == len(g.top_logprobs) == k
        values, _ = row.topk(k) if k else (row[:0], None)
        assert all(abs(a - float(b)) < TOL for a, b in zip(g.top_logprobs, values))
        assert all(abs(lp - float(row[t])) < TOL for t, lp in zip(g.top_ids, g.top_logprobs))
        assert list(g.top_logprobs) == sorted(g.top_logprobs, reverse=True)


def test_logprobs_equal_the_models_log_softmax(tiny_pair):
    """Greedy, first token and later ones; a request beside it that did not ask gets none; k = 0
    gives the chosen token's alone."""
    ref, model = tiny_pair
    engine = make_engine(model)
    prompts = [random_prompt(n, seed=700 + n) for n in (5, 37, 12)]
    params = [SamplingParams(max_tokens=9, ignore_eos=True, logprobs=5), SamplingParams(max_tokens=9, ignore_eos=True),
              SamplingParams(max_tokens=6, ignore_eos=True, logprobs=0)]
    outs = engine.generate(prompts, params)
    assert outs[1].logprobs == []
    for prompt, out, k in ((prompts[0], outs[0], 5), (prompts[2], outs[2], 0)):
        assert_match(reference_logprobs(ref, prompt, out.output_token_ids), out.output_token_ids, out.logprobs, k)
    for lp in outs[0].logprobs:  # greedy: the chosen token is the likeliest
        assert lp.top_ids[0] == lp.token_id and lp.top_logprobs[0] == pytest.approx(lp.logprob, abs=TOL)
    assert_all_free(engine)


def test_logprobs_are_the_raw_models_before_penalties_and_temperature():
    """A penalised greedy request and a sampled one: their tokens' logprobs are still the model's own."""
    ref = tiny_model("qwen2", seed=1)
    engine = make_engine(copy.deepcopy(ref))
    prompt = random_prompt(20, seed=710)
    for sp in (SamplingParams(max_tokens=8, ignore_eos=True, logprobs=3, repetition_penalty=1.5, presence_penalty=1.0),
               SamplingParams(max_tokens=8, ignore_eos=True, logprobs=3, temperature=1.7, top_k=30, seed=5)):
        out = engine.generate([prompt], sp)[0]
        assert_match(reference_logprobs(ref, prompt, out.output_token_ids), out.output_token_ids, out.logprobs, 3)
