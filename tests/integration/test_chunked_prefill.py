"""Chunked prefill and mixed steps: greedy output equals transformers `generate` (fp32) whatever the
chunk size (a block, half a block, uneven), with the decode kernel and without, with prefix hits
and under preemption; a long prompt never stops the running batch; a prompt alone goes whole."""
from __future__ import annotations

import pytest

from engine import SamplingParams
from tests.conftest import greedy_reference, random_prompt
from tests.integration.test_engine_correctness import assert_all_free, make_engine


@pytest.mark.parametrize("kernel", [True, False], ids=["kernel", "sdpa"])
@pytest.mark.parametrize("chunk", [16, 8, 7])
def test_chunked_prefill_matches_generate(tiny_pair, chunk, kernel):
    ref, model = tiny_pair
    prompts = [random_prompt(n, seed=n) for n in (1, 7, 33, 150)]
    expected = [greedy_reference(ref, p, 12) for p in prompts]
    engine = make_engine(model, prefill_chunk_tokens=chunk, max_num_batched_tokens=40)
    engine.runner.use_kernel &= kernel
    outs = engine.generate(prompts, SamplingParams(max_tokens=12))
    assert [o.output_token_ids for o in outs] == expected
    assert engine.stats.mixed_steps > 0  # the short prompts decoded while the long one was chunked
    assert_all_free(engine)


def test_a_long_prompt_never_stops_the_running_batch(tiny_pair):
    ref, model = tiny_pair
    first, long_ = random_prompt(20, 1), random_prompt(300, 2)
    engine = make_engine(model, prefill_chunk_tokens=32)
    engine.add_request(first, SamplingParams(max_tokens=40), request_id="first")
    got: dict[str, list[int]] = {"first": [], "long": []}
    first_token_step = None
    for step in range(100):
        if step == 3:
            engine.add_request(long_, SamplingParams(max_tokens=5), request_id="long")
        outs = {o.request_id: o for o in engine.step()}
        if len(got["first"]) < 40:
            assert "first" in outs, f"step {step}: the running sequence got no token"
        for rid, out in outs.items():
            got[rid] += out.new_token_ids
        if first_token_step is None and got["long"]:
            first_token_step = step
        if not engine.has_unfinished():
            break
    assert first_token_step == 3 + 300 // 32  # ten chunks of at most 32 tokens, the last one sampled
    assert engine.stats.mixed_steps >= 300 // 32
    assert got == {"first": greedy_reference(ref, first, 40), "long": greedy_reference(ref, long_, 5)}
    assert_all_free(engine)


def test_a_prompt_waits_for_the_prefix_blocks_another_is_computing_and_reuses_them(tiny_pair):
    """b arrives while a is part-way through the prefix they share: b waits for a's blocks instead of
    computing them again, then reuses every full block of the prefix."""
    ref, model = tiny_pair
    prefix = random_prompt(100, 3)
    a, b, c = prefix + random_prompt(20, 4), prefix + random_prompt(30, 5), random_prompt(90, 6)
    engine = make_engine(model, prefill_chunk_tokens=32)
    engine.add_request(a, SamplingParams(max_tokens=6), request_id="a")
    engine.add_request(c, SamplingParams(max_tokens=6), request_id="c")  # a is not alone: it goes in chunks
    engine.step()
    engine.step()  # a: 64 tokens computed, four 16-token blocks keyed, the next two being computed
    engine.add_request(b, SamplingParams(max_tokens=6), request_id="b")
    got: dict[str, list[int]] = {"a": [], "b": [], "c": []}
    cached = {}
    while engine.has_unfinished():
        for out in engine.step():
            got[out.request_id] += out.new_token_ids
            cached[out.request_id] = out.num_cached_tokens
    assert cached["b"] == 96  # the prefix's six full blocks, all computed by a
    assert got == {"a": greedy_reference(ref, a, 6), "b": greedy_reference(ref, b, 6), "c": greedy_reference(ref, c, 6)}
    assert engine.stats.prefill_tokens == len(a) + len(b) + len(c) - 96
    assert_all_free(engine)


def test_concurrent_prompts_sharing_a_prefix_compute_it_once(tiny_pair):
    """Five first turns over one system prompt, sent at once (and one unrelated prompt): the system
    prompt's KV is computed once, and every output equals `generate`."""
    ref, model = tiny_pair
    system = random_prompt(70, 7)  # four full 16-token blocks and a partial one
    prompts = [system + random_prompt(5 + 3 * i, 30 + i) for i in range(5)] + [random_prompt(40, 40)]
    engine = make_engine(model, prefill_chunk_tokens=32)
    outs = engine.generate(prompts, SamplingParams(max_tokens=8))
    assert [o.output_token_ids for o in outs] == [greedy_reference(ref, p, 8) for p in prompts]
    assert [o.num_cached_tokens for o in outs] == [0, 64, 64, 64, 64, 0]
    assert engine.stats.prefill_tokens == sum(len(p) for p in prompts) - 4 * 64
    assert_all_free(engine)


def test_a_prompt_alone_is_prefilled_whole(tiny_pair):
    """Nothing decodes and no other prompt waits: one step computes the whole prompt (a chunk would
    hold nobody up less), and the output equals `generate`."""
    ref, model = tiny_pair
    prompt = random_prompt(150, 8)
    engine = make_engine(model, prefill_chunk_tokens=16)
    engine.add_request(prompt, SamplingParams(max_tokens=5), request_id="alone")
    first = engine.step()
    assert [o.request_id for o in first] == ["alone"] and engine.stats.prefill_tokens == 150
    tokens = first[0].new_token_ids
    while engine.has_unfinished():
        tokens += [t for o in engine.step() for t in o.new_token_ids]
    assert tokens == greedy_reference(ref, prompt, 5)
    assert_all_free(engine)


def test_chunked_prefill_under_preemption(tiny_pair):
    ref, model = tiny_pair
    prompts = [random_prompt(30 + 7 * i, 20 + i) for i in range(6)]
    expected = [greedy_reference(ref, p, 40) for p in prompts]
    # 768 B per token (3 layers x 2 kv heads x 16 dims x 4 bytes x k, v); 80 blocks of 4 tokens
    engine = make_engine(model, memory_gib=80 * 4 * 768 / (1 << 30), block_size=4, prefill_chunk_tokens=5)
    outs = engine.generate(prompts, SamplingParams(max_tokens=40))
    assert engine.scheduler.num_preemptions > 0 and engine.stats.mixed_steps > 0
    assert [o.output_token_ids for o in outs] == expected
    assert_all_free(engine)
