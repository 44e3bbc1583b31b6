"""Disaggregated serving on a real local Ray cluster: prefill actors ship KV over per-pair gloo
groups to decode actors; greedy output equals transformers `generate` token for token."""
from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import pytest
import ray

from engine import CacheConfig, EngineConfig, SamplingParams
from kv_transfer import TransferConfig
from router.pools import add_worker, create_pools
from tests.conftest import greedy_reference, random_prompt, tiny_model
from tests.integration.conftest import saved_tiny_model
from tests.integration.direct_driver import Orchestrator
from tests.integration.test_logprobs import assert_match, reference_logprobs
from worker_core.protocol import ErrorKind


@pytest.fixture(scope="module")
def cluster(ray_cluster, tmp_path_factory):
    ref, path = saved_tiny_model(tmp_path_factory, "llama", seed=3)
    cfg = EngineConfig(model=path, dtype="float32", num_threads=1, cache=CacheConfig(memory_gib=0.02))
    transfer = TransferConfig(backend="torch_dist", timeout_s=20, host="127.0.0.1")
    pools = create_pools(2, 1, cfg, transfer, num_cpus=0)
    yield ref, pools, cfg, transfer
    pools.shutdown()


def assert_all_free(pools) -> None:
    for w in pools.prefill + pools.decode:
        load = ray.get(w.load.remote())
        assert load.free_blocks == load.num_blocks, load


def test_remote_and_local_paths_match_generate(cluster):
    ref, pools, _, _ = cluster
    orch = Orchestrator(pools)
    prompt = random_prompt(45, 1)
    expected = greedy_reference(ref, prompt, 24)
    remote = orch.generate(prompt, SamplingParams(max_tokens=24), remote=True)
    assert remote.token_ids == expected and remote.finish_reason == "length"
    assert remote.prefill_s > 0 and remote.transfer_s >= 0
    assert orch.generate(prompt, SamplingParams(max_tokens=24), remote=False).token_ids == expected
    assert_all_free(pools)


def test_logprobs_on_both_paths_equal_the_models_and_each_other(cluster):
    """The remote path's first token's logprobs cross from the prefill worker to the decode worker's
    stream; on both paths every token's equal the model's own log-softmax, and each other's."""
    ref, pools, _, _ = cluster
    orch = Orchestrator(pools)
    prompt = random_prompt(33, 21)
    sp = SamplingParams(max_tokens=8, logprobs=3)
    remote = orch.generate(prompt, sp, remote=True)
    local = orch.generate(prompt, sp, remote=False)
    assert remote.token_ids == local.token_ids == greedy_reference(ref, prompt, 8)
    assert_match(reference_logprobs(ref, prompt, remote.token_ids), remote.token_ids, remote.logprobs, 3)
    assert_match(reference_logprobs(ref, prompt, local.token_ids), local.token_ids, local.logprobs, 3)
    for r, lo in zip(remote.logprobs, local.logprobs):
        assert r.top_ids == lo.top_ids and abs(r.logprob - lo.logprob) < 1e-4
    assert orch.generate(random_prompt(20, 22), SamplingParams(max_tokens=3), remote=True).logprobs == []  # not asked
    assert_all_free(pools)


def test_concurrent_mixed_requests_across_workers_and_a_late_decode_worker(cluster):
    ref, pools, cfg, transfer = cluster
    add_worker(pools, "decode", cfg, transfer, num_cpus=0)  # joins after start, pairs on first use
    orch = Orchestrator(pools)
    cases = [(random_prompt(5 + 37 * i % 150, 10 + i), 4 + 9 * i % 30) for i in range(16)]
    expected = [greedy_reference(ref, p, n) for p, n in cases]

    def run(i: int) -> list[int]:
        prompt, n = cases[i]
        return orch.generate(prompt, SamplingParams(max_tokens=n), remote=i % 4 != 3, prefill=i % 2,
                             decode=i % 2).token_ids
    with ThreadPoolExecutor(max_workers=16) as pool:
        got = list(pool.map(run, range(len(cases))))
    assert got == expected
    assert_all_free(pools)


def test_the_feed_carries_every_fed_request_and_keeps_what_was_not_acknowledged(cluster):
    """`drain`: fed requests' items (local and remote) in one message per call, numbered; a call's
    answer that never reached its reader is given again until acknowledged."""
    ref, pools, _, _ = cluster
    decode, prefill = pools.decode[0], pools.prefill[0]
    prompts = [random_prompt(30, 7), random_prompt(70, 8)]
    sp = SamplingParams(max_tokens=6)
    ray.get(decode.submit_local.remote("fed-local", prompts[0], sp, feed=True))
    ray.get(decode.reserve.remote("fed-remote", prompts[1], sp, pools.prefill_peers[0], feed=True))
    first = ray.get(prefill.prefill.remote("fed-remote", prompts[1], sp, pools.decode_peers[0]))
    ray.get(decode.start_remote.remote("fed-remote", first.first_token, first.handoff))
    got: dict[str, list[int]] = {"fed-local": [], "fed-remote": []}
    acked, done = 0, set()
    while len(done) < 2:
        batch = ray.get(decode.drain.remote(acked, 5.0))
        assert batch, "no item within 5 s"
        assert [e.seq for e in batch] == list(range(acked + 1, acked + 1 + len(batch)))
        replay = ray.get(decode.drain.remote(acked, 0.0))  # this answer is 'lost': nothing was acknowledged
        assert [e.seq for e in replay[:len(batch)]] == [e.seq for e in batch]
        for e in batch:
            got[e.request_id] += e.item.token_ids
            if e.item.finished:
                done.add(e.request_id)
        acked = batch[-1].seq
    assert got == {"fed-local": greedy_reference(ref, prompts[0], 6),
                   "fed-remote": greedy_reference(ref, prompts[1], 6)}
    assert ray.get(decode.drain.remote(acked, 0.0)) == []
    assert_all_free(pools)


def test_object_store_backend_matches_generate(cluster):
    ref, _, cfg, _ = cluster
    pools = create_pools(1, 1, cfg, TransferConfig(backend="object_store"), num_cpus=0)
    try:
        prompt = random_prompt(60, 5)
        got = Orchestrator(pools).generate(prompt, SamplingParams(max_tokens=12), remote=True)
        assert got.token_ids == greedy_reference(ref, prompt, 12)
        assert_all_free(pools)
    finally:
        pools.shutdown()


def test_a_transfer_that_never_comes_times_out_and_frees_the_blocks(cluster):
    ref, _, cfg, _ = cluster
    pools = create_pools(1, 1, cfg, TransferConfig(backend="torch_dist", timeout_s=3, host="127.0.0.1"), num_cpus=0)
    try:
        decode = pools.decode[0]
        prompt = random_prompt(50, 6)
        ray.get(decode.reserve.remote("lost", prompt, SamplingParams(max_tokens=5), pools.prefill_peers[0]))
        assert ray.get(decode.load.remote()).receiving == 1
        items = [ray.get(r) for r in decode.stream.options(num_returns="streaming").remote("lost")]  # no prefill
        assert items[-1].finished and items[-1].error.kind is ErrorKind.TRANSFER_FAILED
        assert_all_free(pools)
        # the pair works again for the next request
        got = Orchestrator(pools).generate(prompt, SamplingParams(max_tokens=5), remote=True)
        assert got.token_ids == greedy_reference(ref, prompt, 5)
        assert_all_free(pools)
    finally:
        pools.shutdown()


def test_a_dead_prefill_worker_is_a_clear_error_and_frees_the_decode_blocks(cluster):
    _, _, cfg, transfer = cluster
    pools = create_pools(1, 1, cfg, transfer, num_cpus=0)
    try:
        ray.kill(pools.prefill[0])
        with pytest.raises(ray.exceptions.RayActorError):
            Orchestrator(pools).generate(random_prompt(30, 7), SamplingParams(max_tokens=5), remote=True)
        load = ray.get(pools.decode[0].load.remote())
        assert load.free_blocks == load.num_blocks and load.receiving == 0
    finally:
        pools.prefill = []  # already dead
        pools.shutdown()


@pytest.mark.model
def test_embedded_model_chat_prompt_disaggregated(cluster):
    """SmolLM2 through the disaggregated path equals transformers greedy generate on a chat prompt."""
    import copy

    import torch

    from engine.model_loader import encode_prompt, load_model

    model, tok = load_model(None, "float32", "cpu")
    prompt = encode_prompt(tok, "What is the capital of France?", chat=True)
    with torch.no_grad():
        ids = copy.deepcopy(model).generate(torch.tensor([prompt]), max_new_tokens=16, do_sample=False)[0].tolist()
    expected = ids[len(prompt):]
    expected = expected[:expected.index(tok.eos_token_id) + 1] if tok.eos_token_id in expected else expected
    cfg = EngineConfig(model=None, dtype="float32", num_threads=1, cache=CacheConfig(memory_gib=0.1))
    pools = create_pools(1, 1, cfg, TransferConfig(backend="torch_dist", timeout_s=30, host="127.0.0.1"), num_cpus=0)
    try:
        got = Orchestrator(pools).generate(prompt, SamplingParams(max_tokens=16), remote=True)
        assert got.token_ids == expected and "Paris" in tok.decode(got.token_ids)
        assert_all_free(pools)
    finally:
        pools.shutdown()


@pytest.mark.parametrize("arch", ["qwen2", "mistral"])
def test_other_architectures_disaggregated(cluster, arch, tmp_path):
    ref = tiny_model(arch, seed=9)
    ref.save_pretrained(tmp_path)
    cfg = EngineConfig(model=str(tmp_path), dtype="float32", num_threads=1, cache=CacheConfig(memory_gib=0.02))
    pools = create_pools(1, 1, cfg, TransferConfig(backend="torch_dist", timeout_s=20, host="127.0.0.1"), num_cpus=0)
    try:
        prompts = [random_prompt(n, 20 + n) for n in (9, 64)]
        orch = Orchestrator(pools)
        assert [orch.generate(p, SamplingParams(max_tokens=10)).token_ids for p in prompts] == \
            [greedy_reference(ref, p, 10) for p in prompts]
        assert_all_free(pools)
    finally:
        pools.shutdown()


def test_auto_dtype_is_settled_by_the_first_worker_and_shared_by_the_pool(cluster):
    """`dtype="auto"`: the first worker chooses; every other worker, and replacements started from
    `pools.engine_config`, run the same dtype, so KV moves between them and the remote path gives
    `generate`'s tokens in that dtype."""
    import dataclasses

    from engine.model_loader import load_model
    from router.pools import replace_worker

    _, _, cfg, transfer = cluster
    pools = create_pools(1, 1, dataclasses.replace(cfg, dtype="auto"), transfer, num_cpus=0)
    try:
        chosen = pools.engine_config.dtype
        assert chosen in ("float32", "bfloat16")
        replace_worker(pools, "decode", 0, pools.engine_config, transfer, num_cpus=0)
        infos = ray.get([w.info.remote() for w in pools.prefill + pools.decode])
        assert {i.dtype for i in infos} == {chosen}
        ref, _ = load_model(cfg.model, chosen, "cpu")
        ref.generation_config.eos_token_id = None
        prompt = random_prompt(40, 7)
        expected = greedy_reference(ref, prompt, 10)
        got = Orchestrator(pools).generate(prompt, SamplingParams(max_tokens=10), remote=True).token_ids
        assert got == expected if chosen == "float32" else got[:4] == expected[:4]
        assert_all_free(pools)
    finally:
        pools.shutdown()
