"""Greedy output of the paged engine equals transformers `generate`, token for token (fp32)."""
from __future__ import annotations

import copy
from dataclasses import replace

import pytest
import torch

from engine import CacheConfig, EngineConfig, LLMEngine, SamplingParams
from tests.conftest import greedy_reference, random_prompt


def make_engine(model, memory_gib: float = 0.02, block_size: int = 16, **kw) -> LLMEngine:
    cfg = EngineConfig(dtype="float32", cache=CacheConfig(block_size=block_size, memory_gib=memory_gib), **kw)
    return LLMEngine(cfg, model=model)


def assert_all_free(engine: LLMEngine) -> None:
    bm = engine.block_manager
    assert bm.num_free_blocks == bm.num_blocks
    assert all(b.ref_count == 0 for b in bm.blocks)
    assert not bm.pending  # nothing is left waiting to be keyed


def test_single_and_batched_match_generate(tiny_pair):
    ref, model = tiny_pair
    prompts = [random_prompt(n, seed=n) for n in (1, 7, 33, 64, 150)]
    expected = [greedy_reference(ref, p, 24) for p in prompts]
    engine = make_engine(model)
    single = engine.generate([prompts[2]], SamplingParams(max_tokens=24))[0]
    assert single.output_token_ids == expected[2]
    outs = engine.generate(prompts, SamplingParams(max_tokens=24))
    for out, exp in zip(outs, expected):
        assert out.output_token_ids == exp
        assert out.finish_reason == "length"
    assert_all_free(engine)


def test_torch_fallback_decode_matches_generate(tiny_pair):
    """The gather + SDPA decode path (used where the CPU kernel is not: CUDA, no compiler)."""
    ref, model = tiny_pair
    prompts = [random_prompt(n, seed=n) for n in (9, 70)]
    expected = [greedy_reference(ref, p, 20) for p in prompts]
    engine = make_engine(model)
    engine.runner.use_kernel = False
    assert [o.output_token_ids for o in engine.generate(prompts, SamplingParams(max_tokens=20))] == expected


def test_very_different_lengths_and_outputs(tiny_pair):
    ref, model = tiny_pair
    cases = [(random_prompt(3, 1), 60), (random_prompt(700, 2), 5), (random_prompt(40, 3), 30)]
    expected = [greedy_reference(ref, p, n) for p, n in cases]
    engine = make_engine(model, block_size=8)
    outs = engine.generate([p for p, _ in cases], [SamplingParams(max_tokens=n) for _, n in cases])
    assert [o.output_token_ids for o in outs] == expected
    assert_all_free(engine)


def test_sequences_join_mid_run(tiny_pair):
    ref, model = tiny_pair
    first, late = random_prompt(20, 10), random_prompt(90, 11)
    exp_first, exp_late = greedy_reference(ref, first, 40), greedy_reference(ref, late, 25)
    engine = make_engine(model)
    engine.add_request(first, SamplingParams(max_tokens=40), request_id="first")
    got: dict[str, list[int]] = {"first": [], "late": []}
    for step in range(200):
        if step == 10:
            engine.add_request(late, SamplingParams(max_tokens=25), request_id="late")
        for out in engine.step():
            got[out.request_id] += out.new_token_ids
        if step > 10 and not engine.has_unfinished():
            break
    assert got == {"first": exp_first, "late": exp_late}
    assert_all_free(engine)


def test_preemption_under_tiny_block_budget(tiny_pair):
    ref, model = tiny_pair
    prompts = [random_prompt(30 + 7 * i, 20 + i) for i in range(6)]
    expected = [greedy_reference(ref, p, 40) for p in prompts]
    # 3 layers x 2 kv heads x 16 dims x 4 bytes x 2 (k, v) = 768 B per token; 4-token blocks
    engine = make_engine(model, memory_gib=80 * 4 * 768 / (1 << 30), block_size=4)
    assert engine.layout.num_blocks == 80
    outs = engine.generate(prompts, SamplingParams(max_tokens=40))
    assert engine.scheduler.num_preemptions > 0
    assert [o.output_token_ids for o in outs] == expected
    assert_all_free(engine)


def test_shared_prefix_prefills_only_the_remainder(tiny_pair):
    ref, model = tiny_pair
    prefix = random_prompt(512, 30)
    a, b = prefix + random_prompt(20, 31), prefix + random_prompt(37, 32)
    exp_a, exp_b = greedy_reference(ref, a, 12), greedy_reference(ref, b, 12)
    engine = make_engine(model, memory_gib=0.05)
    assert engine.generate([a], SamplingParams(max_tokens=12))[0].output_token_ids == exp_a
    before = engine.stats.prefill_tokens
    out = engine.generate([b], SamplingParams(max_tokens=12))[0]
    assert out.num_cached_tokens == 512
    assert engine.stats.prefill_tokens - before == len(b) - 512
    assert out.output_token_ids == exp_b
    assert_all_free(engine)  # cached blocks sit in the free list, evictable


def test_prefix_cache_evicts_when_blocks_run_out(tiny_pair):
    _, model = tiny_pair
    engine = make_engine(model, memory_gib=64 * 16 * 768 / (1 << 30))
    assert engine.layout.num_blocks == 64
    prompts = [random_prompt(320, 40 + i) for i in range(6)]
    for prompt in prompts:  # 6 x 20 blocks of distinct prompts through a 64-block pool
        engine.generate([prompt], SamplingParams(max_tokens=4))
    bm = engine.block_manager
    assert bm.cached_prefix_len(prompts[0]) == 0  # the oldest prefix was evicted
    assert bm.cached_prefix_len(prompts[-1]) == 304  # the newest is still cached (all but its last block)
    assert_all_free(engine)


def test_seeded_sampling_reproduces_and_top_k_1_is_greedy(tiny_pair):
    ref, model = tiny_pair
    prompt = random_prompt(25, 50)
    engine = make_engine(model)
    sp = SamplingParams(max_tokens=30, temperature=1.0, top_p=0.9, top_k=50, seed=1234)
    a = engine.generate([prompt], sp)[0].output_token_ids
    b = engine.generate([prompt, random_prompt(9, 51)], [sp, SamplingParams(max_tokens=5, temperature=1.0)])[0]
    assert a == b.output_token_ids
    other = engine.generate([prompt], SamplingParams(max_tokens=30, temperature=1.0, seed=99))[0]
    assert other.output_token_ids != a
    top1 = engine.generate([prompt], SamplingParams(max_tokens=30, temperature=0.8, top_k=1, seed=5))[0]
    assert top1.output_token_ids == greedy_reference(ref, prompt, 30)


def test_a_seeded_request_continued_elsewhere_samples_what_the_unbroken_run_would(tiny_pair):
    """A stream moved to another engine mid-way: the prompt plus the tokens already out, marked as
    the request's own earlier output, continues with exactly the tokens the unbroken run samples
    next (each draw depends on the seed and the token's position only)."""
    _, model = tiny_pair
    prompt = random_prompt(25, 52)
    sp = SamplingParams(max_tokens=30, temperature=1.0, top_p=0.95, seed=77)
    whole = make_engine(model).generate([prompt], sp)[0].output_token_ids
    for cut in (1, 12, 29):
        rest = make_engine(model).generate([prompt + whole[:cut]], replace(
            sp, max_tokens=30 - cut, prior_output_tokens=cut))[0].output_token_ids
        assert whole[:cut] + rest == whole, cut
    shifted = make_engine(model).generate([prompt + whole[:12]], replace(sp, max_tokens=18))[0].output_token_ids
    assert shifted != whole[12:]  # without the marking, the draws start over


def test_stop_token_ids_end_generation(tiny_pair):
    ref, model = tiny_pair
    prompt = random_prompt(12, 60)
    expected = greedy_reference(ref, prompt, 20)
    stop = expected[5]
    engine = make_engine(model)
    out = engine.generate([prompt], SamplingParams(max_tokens=20, stop_token_ids=[stop]))[0]
    assert out.output_token_ids == expected[:expected.index(stop) + 1]
    assert out.finish_reason == "stop"


def test_abort_frees_blocks(tiny_pair):
    _, model = tiny_pair
    engine = make_engine(model)
    engine.add_request(random_prompt(100, 70), SamplingParams(max_tokens=50), request_id="x")
    engine.add_request(random_prompt(10, 71), SamplingParams(max_tokens=50), request_id="y")
    engine.step()
    engine.step()
    assert engine.block_manager.num_free_blocks < engine.block_manager.num_blocks
    with pytest.raises(ValueError, match="^request_id: 'x' is already running"):
        engine.add_request(random_prompt(5, 72), request_id="x")
    assert engine.abort("x") and engine.abort("y")
    assert not engine.abort("nope")
    assert not engine.has_unfinished()
    assert_all_free(engine)


@pytest.mark.parametrize("kwargs,field", [
    (dict(prompt=[]), "prompt"),
    (dict(prompt=list(range(3, 2100))), "prompt"),
    (dict(prompt=[1, 2, 99999]), "prompt"),
    (dict(prompt=[5] * 1000, max_tokens=900), "max_tokens"),
])
def test_bad_requests_name_the_field(tiny_pair, kwargs, field):
    _, model = tiny_pair
    engine = make_engine(model, memory_gib=100 * 16 * 768 / (1 << 30))
    with pytest.raises(ValueError, match=rf"^{field}: "):
        engine.add_request(kwargs["prompt"], SamplingParams(max_tokens=kwargs.get("max_tokens", 4)))
    assert not engine.has_unfinished()
    assert_all_free(engine)


@pytest.mark.slow
@pytest.mark.parametrize("arch", ["llama", "qwen2", "mistral"])
def test_compiled_decode_matches_generate(arch):
    """`compile=True`: the decode step as one torch.compile graph for every batch size, batch 1 included:
    start-up compiles one graph, and serving batches of 1 and 3 compiles nothing more."""
    from torch._dynamo.utils import counters

    from engine import kernels
    from tests.conftest import tiny_model

    if kernels.active().kernel is None:
        pytest.skip("compile mode needs the CPU kernel, which needs a C compiler")
    ref, model = tiny_model(arch), tiny_model(arch)
    prompts = [random_prompt(n, seed=n) for n in (5, 37, 80)]
    expected = [greedy_reference(ref, p, 16) for p in prompts]
    graphs = counters["stats"]["unique_graphs"]
    engine = make_engine(model, compile=True)
    assert engine.runner.compiled
    assert counters["stats"]["unique_graphs"] == graphs + 1  # checked at batches 2 and 1
    for i in (0, 1):  # batch 1: a one-block context and a longer one
        assert engine.generate([prompts[i]], SamplingParams(max_tokens=16))[0].output_token_ids == expected[i]
    assert [o.output_token_ids for o in engine.generate(prompts, SamplingParams(max_tokens=16))] == expected
    assert counters["stats"]["unique_graphs"] == graphs + 1, "a batch size compiled a graph of its own"
    assert_all_free(engine)


@pytest.mark.slow
def test_compiling_for_another_thread_count_mid_serving_leaves_live_kv_alone():
    """`prepare_threads` compiles and checks the decode step again while sequences hold KV blocks (a
    decode worker that joins a thread loan later); its check writes only the runner's own blocks."""
    from engine import kernels
    from tests.conftest import tiny_model

    if kernels.active().kernel is None:
        pytest.skip("compile mode needs the CPU kernel, which needs a C compiler")
    ref = tiny_model("llama", seed=6)
    prompts = [random_prompt(n, seed=n) for n in (40, 45)]
    expected = [greedy_reference(ref, p, 12) for p in prompts]
    engine = make_engine(copy.deepcopy(ref), compile=True)
    ids = [engine.add_request(p, SamplingParams(max_tokens=12)) for p in prompts]
    outs = {}
    for _ in range(3):
        outs.update((o.request_id, o) for o in engine.step())
    assert 0 in {b for seq in engine.scheduler.running for b in seq.block_table}
    engine.runner.prepare_threads(torch.get_num_threads())
    while engine.has_unfinished():
        outs.update((o.request_id, o) for o in engine.step())
    assert [outs[i].output_token_ids for i in ids] == expected
    assert_all_free(engine)


@pytest.mark.slow
def test_compiled_decode_falls_back_to_eager_where_the_decoder_is_not_standard():
    """A decoder whose forward does more than embed → layers → norm (here: it scales the embeddings)
    is not what the compiled step replays: the start-up check against the eager model catches it
    and decode stays eager, and right."""
    import types

    from engine import kernels
    from tests.conftest import tiny_model

    if kernels.active().kernel is None:
        pytest.skip("compile mode needs the CPU kernel, which needs a C compiler")
    ref = tiny_model("llama", seed=5)
    standard = type(ref.model).forward

    def forward(self, input_ids=None, inputs_embeds=None, **kw):
        embeds = self.embed_tokens(input_ids) if inputs_embeds is None else inputs_embeds
        return standard(self, inputs_embeds=embeds * 3.0, **kw)
    ref.model.forward = types.MethodType(forward, ref.model)
    engine = make_engine(copy.deepcopy(ref), compile=True)
    assert not engine.runner.compiled
    prompt = random_prompt(40, seed=3)
    assert engine.generate([prompt], SamplingParams(max_tokens=12))[0].output_token_ids == \
        greedy_reference(ref, prompt, 12)
    assert_all_free(engine)
