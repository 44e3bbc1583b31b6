"""Remote prefill in one process: a prefill engine ships each layer's KV as it is computed to a
decode engine's reserved blocks (local connector); the decode engine continues token for token
as transformers `generate` would."""
from __future__ import annotations

import copy

import pytest

from engine import CacheConfig, EngineConfig, LLMEngine, SamplingParams
from engine.errors import CapacityError
from kv_transfer import TransferConfig, TransferState, make_connector
from tests.conftest import greedy_reference, random_prompt


@pytest.fixture(params=[256, 16, 9], ids=["chunk256", "chunk16", "chunk9"])
def pair(tiny_pair, request):
    ref, model = tiny_pair
    cfg = EngineConfig(dtype="float32", cache=CacheConfig(memory_gib=0.02), prefill_chunk_tokens=request.param)
    prefill, decode = LLMEngine(cfg, model=model), LLMEngine(cfg, model=copy.deepcopy(ref))
    tx = make_connector(TransferConfig(backend="local"), "prefill-0")
    rx = make_connector(TransferConfig(backend="local"), "decode-0")
    tx.register(prefill.runner.kv)
    rx.register(decode.runner.kv)
    layers_seen: list[tuple[str, int, int]] = []  # (request, layer, blocks shipped)
    skip: dict[str, int] = {}  # request id -> leading blocks the decode engine holds (as a prefill worker keeps)

    def ship(layer: int, seqs: list) -> None:  # runs after each layer of a step with prompt chunks
        for seq in seqs:  # the prompts this step completes
            if not seq.prefill_only:  # a request this engine runs whole: nothing to ship
                continue
            blocks = seq.block_table[skip.get(seq.request_id, 0):]
            layers_seen.append((seq.request_id, layer, len(blocks)))
            tx.send(seq.request_id, layer, blocks, rx.local_info())

    prefill.set_prefill_layer_hook(ship)
    yield ref, prefill, decode, tx, rx, layers_seen, skip
    tx.close()
    rx.close()


def run_remote(prefill, decode, tx, rx, prompts, sampling, skip: dict[str, int],
               ids: list[str] | None = None) -> dict[str, list[int]]:
    layers = prefill.layout.num_layers
    for rid, prompt in zip(ids or [f"r{i}" for i in range(len(prompts))], prompts, strict=True):
        reservation = decode.reserve(prompt, sampling, rid)
        skip[rid] = reservation.cached_blocks
        rx.recv(rid, reservation.blocks, layers, tx.local_info())
        prefill.add_request(prompt, sampling, request_id=rid, prefill_only=True)
    outputs: dict[str, list[int]] = {}
    while prefill.has_unfinished():  # batched prefill steps of every prompt, in chunks
        for out in prefill.step():
            assert rx.poll(out.request_id) == TransferState.DONE == tx.poll(out.request_id)
            prefill.release(out.request_id)
            outputs[out.request_id] = list(decode.activate(out.request_id, out.new_token_ids[0]).new_token_ids)
    while decode.has_unfinished():
        for out in decode.step():
            outputs[out.request_id] += out.new_token_ids
    return outputs


def test_remote_prefill_matches_generate(pair):
    ref, prefill, decode, tx, rx, layers_seen, skip = pair
    prompts = [random_prompt(n, seed=100 + n) for n in (3, 40, 77)]
    expected = [greedy_reference(ref, p, 20) for p in prompts]
    got = run_remote(prefill, decode, tx, rx, prompts, SamplingParams(max_tokens=20), skip)
    assert [got[f"r{i}"] for i in range(len(prompts))] == expected
    for i in range(len(prompts)):  # each prompt shipped layer by layer, in order, once
        assert [layer for rid, layer, _ in layers_seen if rid == f"r{i}"] == list(range(prefill.layout.num_layers))
    for engine in (prefill, decode):
        bm = engine.block_manager
        assert bm.num_free_blocks == bm.num_blocks


def test_seeded_sampling_remote_equals_local(pair, tiny_pair):
    """The first token sampled on the prefill engine, the rest on the decode engine: the same tokens as
    one engine sampling them all, for the same seed."""
    _, prefill, decode, tx, rx, _, skip = pair
    prompt = random_prompt(40, seed=88)
    sp = SamplingParams(max_tokens=20, temperature=1.0, top_k=40, seed=4242)
    local = LLMEngine(EngineConfig(dtype="float32", cache=CacheConfig(memory_gib=0.02)), model=copy.deepcopy(tiny_pair[1]))
    expected = local.generate([prompt], sp)[0].output_token_ids
    assert run_remote(prefill, decode, tx, rx, [prompt], sp, skip, ids=["seeded"])["seeded"] == expected


def test_penalties_min_tokens_and_min_p_remote_equal_local(pair, tiny_pair):
    """The first token sampled on the prefill engine with the same processors as the rest on the decode
    engine: the same tokens as one engine, greedy with penalties, a logit bias and min_tokens, seeded with min_p."""
    _, prefill, decode, tx, rx, _, skip = pair
    prompt = random_prompt(40, seed=89)
    local = LLMEngine(EngineConfig(dtype="float32", cache=CacheConfig(memory_gib=0.02)),
                      model=copy.deepcopy(tiny_pair[1]))
    first = local.generate([prompt], SamplingParams(max_tokens=1, ignore_eos=True))[0].output_token_ids[0]
    got: dict[str, list[int]] = {}
    for rid, sp in (("penalised", SamplingParams(max_tokens=12, repetition_penalty=1.3, presence_penalty=0.5,
                                                  frequency_penalty=0.7, min_tokens=3, stop_token_ids=(first,),
                                                  logit_bias=((first + 1, 2.0),))),
                    ("min_p", SamplingParams(max_tokens=12, temperature=1.2, min_p=0.05, seed=11, ignore_eos=True))):
        expected = local.generate([prompt], sp)[0].output_token_ids
        got[rid] = run_remote(prefill, decode, tx, rx, [prompt], sp, skip, ids=[rid])[rid]
        assert got[rid] == expected
    assert got["penalised"][0] != first  # min_tokens masked the plain first token on the prefill engine


def test_reserve_refuses_when_full_and_abort_frees(pair):
    ref, prefill, *_ = pair
    small = EngineConfig(dtype="float32", cache=CacheConfig(memory_gib=100 * 16 * 768 / (1 << 30)))
    decode = LLMEngine(small, model=copy.deepcopy(ref))
    assert decode.block_manager.num_blocks == 100
    total = decode.block_manager.num_blocks * decode.layout.block_size
    reservation = decode.reserve(random_prompt(total // 2, 1), SamplingParams(max_tokens=1), "big")
    assert len(reservation.blocks) == decode.block_manager.num_blocks // 2 and reservation.cached_blocks == 0
    with pytest.raises(CapacityError, match="try another worker"):
        decode.reserve(random_prompt(total // 2 + 50, 2), SamplingParams(max_tokens=1), "too-big")
    assert decode.abort("big")
    assert decode.block_manager.num_free_blocks == decode.block_manager.num_blocks
    prefill.add_request(random_prompt(30, 3), SamplingParams(max_tokens=4), request_id="p", prefill_only=True)
    while prefill.has_unfinished():
        prefill.step()
    assert prefill.held_blocks("p") and prefill.abort("p")  # an abort frees held blocks too
    assert prefill.block_manager.num_free_blocks == prefill.block_manager.num_blocks
    prefill.add_request(random_prompt(300, 4), SamplingParams(max_tokens=4), request_id="q", prefill_only=True)
    prefill.add_request(random_prompt(200, 5), SamplingParams(max_tokens=4), request_id="q2", prefill_only=True)
    prefill.step()  # both part-way through their prompts (side by side, in chunks)
    assert prefill.abort("q") and prefill.abort("q2") and not prefill.has_unfinished()
    assert prefill.block_manager.num_free_blocks == prefill.block_manager.num_blocks


def test_a_prefill_engine_decodes_its_own_requests_while_it_ships_prompts(pair):
    """A prefill worker flipped to decode: requests it runs whole decode in the same steps as the
    prompt chunks it ships (the layer hook fires on prefill steps only, and never alters a layer's
    output). Both kinds equal `generate`; every block returns."""
    ref, prefill, decode, tx, rx, layers_seen, _ = pair
    own = [random_prompt(n, seed=500 + n) for n in (7, 33)]
    shipped = [random_prompt(n, seed=600 + n) for n in (21, 90)]
    for i, p in enumerate(own):
        prefill.add_request(p, SamplingParams(max_tokens=24), request_id=f"own{i}")
    got = {f"own{i}": [] for i in range(len(own))}
    for _ in range(3):  # they are decoding before the prompts come
        for out in prefill.step():
            got[out.request_id] += out.new_token_ids
    sampling, layers = SamplingParams(max_tokens=12), prefill.layout.num_layers
    for i, prompt in enumerate(shipped):
        rx.recv(f"r{i}", decode.reserve(prompt, sampling, f"r{i}").blocks, layers, tx.local_info())
        prefill.add_request(prompt, sampling, request_id=f"r{i}", prefill_only=True)
    remote: dict[str, list[int]] = {}
    while prefill.has_unfinished():  # mixed steps: own decode rows beside the prompts' chunks
        for out in prefill.step():
            if out.request_id in got:
                got[out.request_id] += out.new_token_ids
                continue
            assert rx.poll(out.request_id) == TransferState.DONE
            prefill.release(out.request_id)
            remote[out.request_id] = list(decode.activate(out.request_id, out.new_token_ids[0]).new_token_ids)
    while decode.has_unfinished():
        for out in decode.step():
            remote[out.request_id] += out.new_token_ids
    assert [got[f"own{i}"] for i in range(len(own))] == [greedy_reference(ref, p, 24) for p in own]
    assert [remote[f"r{i}"] for i in range(len(shipped))] == [greedy_reference(ref, p, 12) for p in shipped]
    assert {rid for rid, *_ in layers_seen} == {"r0", "r1"}  # only the shipped prompts' layers went out
    for engine in (prefill, decode):
        assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks


def run_whole(engine, prompt: list[int], rid: str, max_tokens: int = 4) -> list[int]:
    engine.add_request(prompt, SamplingParams(max_tokens=max_tokens), request_id=rid)
    out: list[int] = []
    while engine.has_unfinished():
        out += [t for o in engine.step() for t in o.new_token_ids]
    return out


@pytest.mark.parametrize("shared", [0, 16, 40, 80], ids=["none", "one-block", "mid-block", "all"])
def test_delta_transfer_ships_only_the_blocks_the_decode_engine_lacks(pair, shared):
    """The decode engine ran a request whose prompt begins as these do (its full blocks are cached):
    it reserves with those blocks and receives only the rest; two prompts sharing the prefix at once read
    the same blocks; both equal `generate`, and every block returns."""
    ref, prefill, decode, tx, rx, layers_seen, skip = pair
    bs, layers = decode.block_manager.block_size, prefill.layout.num_layers
    head = random_prompt(80, seed=7)
    run_whole(decode, head, "earlier")
    prompts = [head[:shared] + random_prompt(n, seed=8 + n) for n in (50, 9)] if shared < 80 else [head, head]
    got = run_remote(prefill, decode, tx, rx, prompts, SamplingParams(max_tokens=16), skip, ids=["a", "b"])
    assert [got["a"], got["b"]] == [greedy_reference(ref, p, 16) for p in prompts]
    for rid, prompt in zip("ab", prompts):
        cached = min(shared, len(prompt) - 1) // bs  # full blocks only, never the one with the last token
        assert skip[rid] == cached
        shipped = [n for r, _, n in layers_seen if r == rid]  # every layer, each the blocks the decode side lacks
        assert len(shipped) == layers and set(shipped) == {-(-len(prompt) // bs) - cached}
    for engine in (prefill, decode):
        bm = engine.block_manager
        assert bm.num_free_blocks == bm.num_blocks and all(b.ref_count == 0 for b in bm.blocks)


def test_a_reserved_prefix_is_never_evicted_before_its_kv_is_used(pair):
    """The cached blocks a reservation counts on are held by it: filling the pool around them takes other
    blocks or fails, and never hands them to another request; an abort gives every block back."""
    ref, *_ = pair
    small = EngineConfig(dtype="float32", cache=CacheConfig(memory_gib=100 * 16 * 768 / (1 << 30)))
    decode = LLMEngine(small, model=copy.deepcopy(ref))  # 100 blocks: a prompt can fill the pool
    bm, bs = decode.block_manager, decode.block_manager.block_size
    head = random_prompt(64, seed=11)
    run_whole(decode, head, "earlier")
    reservation = decode.reserve(head + random_prompt(20, seed=12), SamplingParams(max_tokens=4), "promised")
    assert reservation.cached_blocks == 64 // bs
    held = decode.scheduler.receiving["promised"].block_table[:reservation.cached_blocks]
    assert all(b not in bm.free and bm.blocks[b].ref_count == 1 for b in held)
    room = bm.num_free_blocks * bs
    with pytest.raises(CapacityError):  # more than what is free: refused, the promised blocks untouched
        decode.reserve(random_prompt(room + 1, seed=13), SamplingParams(max_tokens=1), "flood")
    filler = decode.reserve(random_prompt(room - 1, seed=14), SamplingParams(max_tokens=1), "fill")
    assert not set(filler.blocks) & set(held) and bm.num_free_blocks == 0
    assert decode.abort("fill") and decode.abort("promised")
    assert bm.num_free_blocks == bm.num_blocks and all(b.ref_count == 0 for b in bm.blocks)


def test_blocks_still_receiving_are_never_handed_to_another_request(pair):
    """While a prompt's KV is on its way, its blocks are not in the prefix cache: a second request with the
    same prompt gets blocks of its own. Once the KV landed, a third one reuses them."""
    ref, prefill, decode, tx, rx, _, skip = pair
    prompt, sampling = random_prompt(70, seed=21), SamplingParams(max_tokens=3)
    a = decode.reserve(prompt, sampling, "a")
    b = decode.reserve(prompt, sampling, "b")
    assert a.cached_blocks == b.cached_blocks == 0 and not set(a.blocks) & set(b.blocks)
    assert decode.abort("b")
    got = run_remote(prefill, decode, tx, rx, [prompt], sampling, skip, ids=["c"])  # lands, then decodes
    assert got["c"] == greedy_reference(ref, prompt, 3)
    d = decode.reserve(prompt, sampling, "d")
    assert d.cached_blocks == 70 // decode.block_manager.block_size
    assert decode.abort("a") and decode.abort("d")
    for engine in (prefill, decode):
        assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks
