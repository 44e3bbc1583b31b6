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
    layers_seen: list[tuple[str, int]] = []

    def ship(layer: int, seqs: list) -> None:  # runs after each layer of a step with prompt chunks
        for seq in seqs:  # the prompts this step completes
            if not seq.prefill_only:  # a request this engine runs whole: nothing to ship
                continue
            layers_seen.append((seq.request_id, layer))
            tx.send(seq.request_id, layer, seq.block_table, rx.local_info())

    prefill.set_prefill_layer_hook(ship)
    yield ref, prefill, decode, tx, rx, layers_seen
    tx.close()
    rx.close()


def run_remote(prefill, decode, tx, rx, prompts, sampling) -> dict[str, list[int]]:
    layers = prefill.layout.num_layers
    for i, prompt in enumerate(prompts):
        blocks = decode.reserve(prompt, sampling, f"r{i}")
        rx.recv(f"r{i}", blocks, layers, tx.local_info())
        prefill.add_request(prompt, sampling, request_id=f"r{i}", prefill_only=True)
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
    ref, prefill, decode, tx, rx, layers_seen = pair
    prompts = [random_prompt(n, seed=100 + n) for n in (3, 40, 77)]
    expected = [greedy_reference(ref, p, 20) for p in prompts]
    got = run_remote(prefill, decode, tx, rx, prompts, SamplingParams(max_tokens=20))
    assert [got[f"r{i}"] for i in range(len(prompts))] == expected
    for i in range(len(prompts)):  # each prompt shipped layer by layer, in order, once
        assert [layer for rid, layer in layers_seen if rid == f"r{i}"] == list(range(prefill.layout.num_layers))
    for engine in (prefill, decode):
        bm = engine.block_manager
        assert bm.num_free_blocks == bm.num_blocks


def test_reserve_refuses_when_full_and_abort_frees(pair):
    ref, prefill, _, _, _, _ = pair
    small = EngineConfig(dtype="float32", cache=CacheConfig(memory_gib=100 * 16 * 768 / (1 << 30)))
    decode = LLMEngine(small, model=copy.deepcopy(ref))
    assert decode.block_manager.num_blocks == 100
    total = decode.block_manager.num_blocks * decode.layout.block_size
    blocks = decode.reserve(random_prompt(total // 2, 1), SamplingParams(max_tokens=1), "big")
    assert len(blocks) == decode.block_manager.num_blocks // 2
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
    prefill.step()  # part-way through its prompt
    assert prefill.abort("q") and not prefill.has_unfinished()
    assert prefill.block_manager.num_free_blocks == prefill.block_manager.num_blocks


def test_a_prefill_engine_decodes_its_own_requests_while_it_ships_prompts(pair):
    """A prefill worker flipped to decode: requests it runs whole decode in the same steps as the
    prompt chunks it ships (the layer hook fires on prefill steps only, and never alters a layer's
    output). Both kinds equal `generate`; every block returns."""
    ref, prefill, decode, tx, rx, layers_seen = pair
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
        rx.recv(f"r{i}", decode.reserve(prompt, sampling, f"r{i}"), layers, tx.local_info())
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
    assert {rid for rid, _ in layers_seen} == {"r0", "r1"}  # only the shipped prompts' layers went out
    for engine in (prefill, decode):
        assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks
