"""Penalties, min_tokens, logit_bias and min_p in the engine (fp32): greedy output with a repetition
penalty, min_tokens or a logit bias equals transformers `generate` with its own processors for them; OpenAI's presence and
frequency penalties equal a step-by-step reference on the model's own logits; min_p keeps only the
likely tokens; a request moved to another worker (its earlier output in the prompt) is penalised
for that output too."""
from __future__ import annotations

import copy

import pytest
import torch

from engine import InvalidRequestError, SamplingParams
from tests.conftest import random_prompt
from tests.integration.test_engine_correctness import assert_all_free, make_engine


def hf_generate(model, prompt: list[int], n: int, **kw) -> list[int]:
    """transformers' greedy `generate` with extra processors, no EOS (the engine ignores it too)."""
    ref = copy.deepcopy(model)
    ref.generation_config.eos_token_id = None
    with torch.no_grad():
        out = ref.generate(torch.tensor([prompt]), max_new_tokens=n, do_sample=False, pad_token_id=0, **kw)
    return out[0, len(prompt):].tolist()


def openai_penalized(model, prompt: list[int], n: int, presence: float, frequency: float,
                     earlier: list[int] = ()) -> list[int]:
    """Greedy with OpenAI's penalties, one full forward per token: logit -= frequency * count + presence *
    (count > 0) over the output so far (`earlier` output included)."""
    ids, out = list(prompt) + list(earlier), list(earlier)
    with torch.no_grad():
        for _ in range(n):
            logits = model(torch.tensor([ids])).logits[0, -1].float()
            counts = torch.bincount(torch.tensor(out, dtype=torch.long), minlength=logits.shape[-1]).float()
            token = int((logits - frequency * counts - presence * (counts > 0).float()).argmax())
            out.append(token)
            ids.append(token)
    return out[len(earlier):]


def test_repetition_penalty_equals_generate(tiny_pair):
    ref, model = tiny_pair
    engine = make_engine(model)
    prompts = [random_prompt(n, seed=200 + n) for n in (4, 30, 70)]
    for penalty in (1.5, 0.7):
        outs = engine.generate(prompts, SamplingParams(max_tokens=14, repetition_penalty=penalty, ignore_eos=True))
        assert [o.output_token_ids for o in outs] == [hf_generate(ref, p, 14, repetition_penalty=penalty)
                                                      for p in prompts]
    assert_all_free(engine)


def test_min_tokens_masks_the_stop_tokens_until_then(tiny_pair):
    """The stop token the plain greedy output reaches second comes no earlier than min_tokens."""
    ref, model = tiny_pair
    engine = make_engine(model)
    prompt = random_prompt(25, seed=301)
    plain = engine.generate([prompt], SamplingParams(max_tokens=12, ignore_eos=True))[0].output_token_ids
    stop = plain[1]
    early = engine.generate([prompt], SamplingParams(max_tokens=12, stop_token_ids=(stop,), ignore_eos=True))[0]
    assert early.output_token_ids == plain[:2]
    got = engine.generate([prompt], SamplingParams(max_tokens=12, min_tokens=5, stop_token_ids=(stop,),
                                                   ignore_eos=True))[0].output_token_ids
    want = hf_generate(ref, prompt, 12, min_new_tokens=5, eos_token_id=stop)
    want = want[:want.index(stop) + 1] if stop in want else want
    assert got == want and len(got) >= 5 and stop not in got[:5]
    assert_all_free(engine)


@pytest.mark.parametrize("presence,frequency", [(0.8, 0.0), (0.0, 1.2), (-0.5, 0.6)])
def test_presence_and_frequency_penalties_equal_the_reference(tiny_pair, presence, frequency):
    ref, model = tiny_pair
    engine = make_engine(model)
    prompt = random_prompt(20, seed=400)
    sp = SamplingParams(max_tokens=16, presence_penalty=presence, frequency_penalty=frequency, ignore_eos=True)
    assert engine.generate([prompt], sp)[0].output_token_ids == openai_penalized(ref, prompt, 16, presence, frequency)


def test_a_moved_request_is_penalised_for_its_earlier_output_too(tiny_pair):
    """The rest of a stream whose first tokens came from another worker (`prior_output_tokens`)."""
    ref, model = tiny_pair
    engine = make_engine(model)
    prompt = random_prompt(20, seed=401)
    whole = openai_penalized(ref, prompt, 14, 0.4, 0.9)
    moved = SamplingParams(max_tokens=8, presence_penalty=0.4, frequency_penalty=0.9, ignore_eos=True,
                           prior_output_tokens=6)
    assert engine.generate([prompt + whole[:6]], moved)[0].output_token_ids == whole[6:]


def test_min_p_keeps_only_likely_tokens(tiny_pair):
    """min_p = 1 leaves only the likeliest token: sampling at any temperature is then greedy."""
    _, model = tiny_pair
    engine = make_engine(model)
    prompt = random_prompt(15, seed=500)
    greedy = engine.generate([prompt], SamplingParams(max_tokens=10, ignore_eos=True))[0].output_token_ids
    sampled = engine.generate([prompt], SamplingParams(max_tokens=10, temperature=1.5, min_p=1.0, seed=7,
                                                       ignore_eos=True))[0].output_token_ids
    assert sampled == greedy


def test_logit_bias_equals_generate_with_its_sequence_bias(tiny_pair):
    """A bias on single tokens is transformers' `sequence_bias` on one-token sequences: a ban of the plain
    greedy token (-100), a push of another (+3), greedy; an id beyond the vocabulary is refused."""
    ref, model = tiny_pair
    engine = make_engine(model)
    prompt = random_prompt(30, seed=321)
    plain = engine.generate([prompt], SamplingParams(max_tokens=10, ignore_eos=True))[0].output_token_ids
    bias = ((plain[0], -100.0), (plain[1], 3.0))
    out = engine.generate([prompt], SamplingParams(max_tokens=10, ignore_eos=True, logit_bias=bias))[0]
    assert out.output_token_ids == hf_generate(ref, prompt, 10, sequence_bias={(t,): b for t, b in bias})
    assert plain[0] not in out.output_token_ids
    with pytest.raises(InvalidRequestError, match="logit_bias: token id 512 is outside"):
        engine.add_request(prompt, SamplingParams(logit_bias=((512, 1.0),)))
    assert_all_free(engine)


@pytest.mark.parametrize("penalty", [1.0694772137381023e-193, 100.0])
def test_extreme_repetition_penalties_still_pick_tokens(tiny_pair, penalty):
    """The ends of the allowed range (a penalty near 0 divides the seen tokens' logits by it: +inf): greedy
    equals `generate` with the same penalty, and sampling still draws a token each step."""
    ref, model = tiny_pair
    engine = make_engine(model)
    prompt = random_prompt(12, seed=600)
    greedy = engine.generate([prompt], SamplingParams(max_tokens=6, repetition_penalty=penalty, ignore_eos=True))[0]
    assert greedy.output_token_ids == hf_generate(ref, prompt, 6, repetition_penalty=penalty)
    sampled = engine.generate([prompt], SamplingParams(max_tokens=6, repetition_penalty=penalty, temperature=0.5,
                                                       seed=3, ignore_eos=True))[0]
    assert len(sampled.output_token_ids) == 6 and all(0 <= t < 512 for t in sampled.output_token_ids)
    assert_all_free(engine)


def test_a_row_that_cannot_pick_a_token_fails_its_request_alone(tiny_pair, monkeypatch):
    """A request whose adjusted logits hold no finite value (injected: NaN everywhere) ends with an error
    and its blocks return; the other requests of its steps go on, equal to `generate`."""
    ref, model = tiny_pair
    engine = make_engine(model)
    adjust = engine.sampler._adjust

    def broken(logits, seq):
        return torch.full_like(logits, float("nan")) if seq.request_id == "bad" else adjust(logits, seq)

    monkeypatch.setattr(engine.sampler, "_adjust", broken)
    prompts = [random_prompt(n, seed=700 + n) for n in (9, 21)]
    sp = SamplingParams(max_tokens=8, ignore_eos=True, presence_penalty=0.5)
    engine.add_request(prompts[0], sp, request_id="bad")
    engine.add_request(prompts[1], sp, request_id="good")
    outs = []
    while engine.has_unfinished():
        outs += engine.step()
    bad = [o for o in outs if o.request_id == "bad"]
    assert len(bad) == 1 and bad[0].finished and bad[0].new_token_ids == [] and "no token can be picked" in bad[0].error
    good = [t for o in outs if o.request_id == "good" for t in o.new_token_ids]
    assert good == openai_penalized(ref, prompts[1], 8, 0.5, 0.0)
    assert all(o.error is None for o in outs if o.request_id == "good")
    assert_all_free(engine)
