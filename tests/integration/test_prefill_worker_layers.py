"""When a prefill worker ships a prompt's layers: as each is computed on its own threads, after the last one
while it computes with borrowed threads (`PrefillWorker._after_layer`). Real prefill and decode workers in
one process (the actor classes, without Ray) over the local connector, a tiny model; the decode worker
continues token for token as transformers `generate` would, either way."""
from __future__ import annotations

import time

import pytest

from decode_worker import DecodeWorker
from engine import CacheConfig, EngineConfig, SamplingParams
from kv_transfer import TransferConfig
from prefill_worker import PrefillWorker
from tests.conftest import greedy_reference, random_prompt
from tests.integration.conftest import saved_tiny_model


@pytest.fixture(scope="module")
def workers(tmp_path_factory):
    ref, path = saved_tiny_model(tmp_path_factory, "llama", seed=11)
    cfg = EngineConfig(model=path, dtype="float32", num_threads=1, compile=False, cache=CacheConfig(memory_gib=0.004))
    prefill = PrefillWorker(cfg, TransferConfig(backend="local"), "layers-prefill")
    try:
        decode = DecodeWorker(cfg, TransferConfig(backend="local"), "layers-decode")
    except BaseException:
        prefill.shutdown()
        raise
    events: list[tuple[str, int]] = []  # ("sent", layer) and ("computed", layer), in the order they happened
    send = prefill.connector.send

    def recording_send(transfer_id, layer, blocks, peer):
        events.append(("sent", layer))
        return send(transfer_id, layer, blocks, peer)
    prefill.connector.send = recording_send
    for i, layer in enumerate(prefill.engine.runner.decoder.layers):  # after the worker's own hook (registered first)
        layer.register_forward_hook(lambda *_, i=i: events.append(("computed", i)))
    yield ref, prefill, decode, events
    prefill.shutdown()
    decode.shutdown()


def remote(prefill: PrefillWorker, decode: DecodeWorker, rid: str, prompt: list[int], max_tokens: int) -> list[int]:
    sampling = SamplingParams(max_tokens=max_tokens)
    skip = decode.reserve(rid, prompt, sampling, prefill.peer_info())
    first = prefill.prefill(rid, prompt, sampling, decode.peer_info(), skip)
    decode.start_remote(rid, first.first_token, first.handoff)
    return [t for item in decode.stream(rid) for t in item.token_ids]  # the first token leads the stream


@pytest.mark.parametrize("borrowed", [False, True], ids=["own-threads", "borrowed-threads"])
def test_layers_stream_on_own_threads_and_follow_the_last_layer_on_borrowed_ones(workers, borrowed):
    ref, prefill, decode, events = workers
    layers = prefill.engine.layout.num_layers
    prefill.set_threads(2 if borrowed else 1)  # a decode worker's thread lent to it, or its own
    try:
        events.clear()
        prompt = random_prompt(70, seed=40 + borrowed)
        assert remote(prefill, decode, f"layers-{borrowed}", prompt, 12) == greedy_reference(ref, prompt, 12)
    finally:
        prefill.set_threads(1)
    computed = [("computed", i) for i in range(layers)]
    sent = [("sent", i) for i in range(layers)]
    if borrowed:  # every layer held until the last was computed
        assert events == [*computed[:-1], *sent, computed[-1]]
    else:  # each shipped as soon as it was computed
        assert events == [e for pair in zip(sent, computed) for e in pair]
    for worker in (prefill, decode):  # every block back (the load is published after the round that freed it)
        deadline = time.monotonic() + 5
        while (load := worker.load()).free_blocks < load.num_blocks and time.monotonic() < deadline:
            time.sleep(0.01)
        assert load.free_blocks == load.num_blocks
