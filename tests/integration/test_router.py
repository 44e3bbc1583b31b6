"""The router core on a real local Ray cluster with a tiny model: calibration, every policy against
transformers greedy `generate`, cancellation and admission, with no HTTP or gRPC in between."""
from __future__ import annotations

import asyncio

import pytest
import ray

from engine import CacheConfig, EngineConfig, SamplingParams
from engine.block_manager import prefix_keys
from kv_transfer import TransferConfig
from router.calibrate import calibrate
from router.config import RouterConfig
from router.pools import create_pools
from router.service import Router
from router.types import GenerateRequest, OverloadedError
from tests.conftest import greedy_reference, random_prompt
from tests.integration.conftest import saved_tiny_model


@pytest.fixture(scope="module")
def cluster(ray_cluster, tmp_path_factory):
    ref, path = saved_tiny_model(tmp_path_factory, "llama", seed=5)
    cfg = EngineConfig(model=path, dtype="float32", num_threads=1, max_num_seqs=8,
                       cache=CacheConfig(memory_gib=0.004))
    pools = create_pools(1, 1, cfg, TransferConfig(backend="torch_dist", timeout_s=20, host="127.0.0.1"),
                         num_cpus=0)
    infos = ray.get([w.info.remote() for w in pools.prefill + pools.decode])
    cost = asyncio.run(calibrate(pools, infos[1]))
    yield ref, pools, infos, cost, path
    pools.shutdown()


def make_router(cluster, **kw) -> Router:
    _, pools, infos, cost, path = cluster
    return Router(pools, infos[:1], infos[1:], None, path, RouterConfig(**kw), cost)


async def collect(router: Router, prompt: list[int], max_tokens: int) -> tuple[list[int], object]:
    stream = await router.submit(GenerateRequest(prompt=prompt, sampling=SamplingParams(max_tokens=max_tokens)))
    tokens, last = [], None
    async for chunk in stream:
        tokens += chunk.token_ids
        last = chunk
    return tokens, last


def assert_all_free(pools) -> None:
    for w in pools.prefill + pools.decode:
        load = ray.get(w.load.remote())
        assert load.free_blocks == load.num_blocks, load


def test_calibrated_cost_model_is_plausible(cluster):
    cost = cluster[3]
    assert cost.prefill_s(512) > cost.prefill_s(16) > 0
    assert cost.step_s(1) > 0 and cost.transfer_s(512) > 0 and cost.hop_s > 0
    assert cost.num_layers == 3 and cost.prefill_chunk_tokens == 256
    assert 0 <= cost.decode_ride <= 1
    assert cost.decode_context == 64  # the context its decode steps were timed at (and again at a longer one)


@pytest.mark.parametrize("policy", ["always_remote", "always_local", "round_robin", "ratio"])
def test_every_policy_matches_generate(cluster, policy):
    ref, pools = cluster[0], cluster[1]
    prompts = [random_prompt(n, seed=n) for n in (5, 40, 130)]

    async def main():
        router = make_router(cluster, policy=policy)
        results = await asyncio.gather(*(collect(router, p, 12) for p in prompts))
        return router, results

    router, results = asyncio.run(main())
    paths = set()
    for prompt, (tokens, last) in zip(prompts, results):
        assert tokens == greedy_reference(ref, prompt, 12)
        assert last.finish_reason == "length" and last.usage.completion_tokens == 12
        assert last.usage.prompt_tokens == len(prompt)
        assert last.timings.ttft_s > 0 and last.timings.e2e_s >= last.timings.ttft_s
        paths.add(last.timings.path)
    expected = {"always_remote": {"remote"}, "always_local": {"local"}, "round_robin": {"remote", "local"}}
    if policy in expected:
        assert paths == expected[policy]
    text = router.metrics_text()[0].decode()
    assert f'pdserve_placement_decisions_total{{model_name="{router.model_name}",path="' in text
    assert f'policy="{policy}"' in text
    for path in paths:  # every served request taught the online correction what the cost model missed
        assert f'pdserve_cost_model_error_ratio_count{{model_name="{router.model_name}",path="{path}",quantity="ttft"}} ' \
            in text
        assert router.placer.correction.factor("ttft", path) != 1.0
    assert all(d.running == 0 and d.reserved_blocks == 0 for d in router.book.decode)
    assert all(p.queued_tokens == 0 for p in router.book.prefill)
    assert_all_free(pools)


def test_cancelled_stream_frees_blocks(cluster):
    pools = cluster[1]

    async def main():
        router = make_router(cluster, policy="always_remote")
        stream = await router.submit(GenerateRequest(prompt=random_prompt(30, 1),
                                                     sampling=SamplingParams(max_tokens=400)))
        got = 0
        async for chunk in stream:
            got += len(chunk.token_ids)
            if got >= 3:
                break
        await stream.aclose()
        return router

    router = asyncio.run(main())
    assert router.book.decode[0].running == 0
    assert 'outcome="cancelled"' in router.metrics_text()[0].decode()
    assert_all_free(pools)


def test_full_decode_worker_queues_then_overloads(cluster):
    async def main():
        router = make_router(cluster, policy="always_local", max_queued=1, queue_timeout_s=30)
        d = router.book.decode[0]
        big = SamplingParams(max_tokens=router.max_model_len - 10)
        fill = min(d.max_num_seqs, d.num_blocks // d.blocks_for(router.max_model_len))
        held = [await router.submit(GenerateRequest(prompt=random_prompt(10, 10 + i), sampling=big))
                for i in range(fill)]  # these fill the worker: its KV budget or its sequence slots
        waiter = asyncio.create_task(router.submit(GenerateRequest(prompt=random_prompt(10, 4), sampling=big)))
        await asyncio.sleep(0.3)
        assert not waiter.done() and router.placer.queue.waiting == 1  # queued at the router, not stalling the worker
        with pytest.raises(OverloadedError):
            await router.submit(GenerateRequest(prompt=random_prompt(10, 5), sampling=big))
        await held[0].aclose()
        c = await asyncio.wait_for(waiter, 10)  # room came back
        tokens = []
        async for ch in c:
            tokens += ch.token_ids
            if len(tokens) >= 4:
                break
        for h in held[1:] + [c]:
            await h.aclose()
        return tokens

    assert len(asyncio.run(main())) >= 4
    assert_all_free(cluster[1])


def test_twenty_streams_dropped_halfway_free_their_blocks_within_a_second(cluster):
    pools = cluster[1]

    async def main():
        router = make_router(cluster, policy="round_robin", max_queued=64)
        streams = [await router.submit(GenerateRequest(prompt=random_prompt(20 + i, 300 + i),
                                                       sampling=SamplingParams(max_tokens=200)))
                   for i in range(20)]

        async def half(stream):
            got = 0
            async for chunk in stream:
                got += len(chunk.token_ids)
                if got >= 5:
                    break
        await asyncio.wait_for(asyncio.gather(*(half(s) for s in streams)), 60)
        await asyncio.gather(*(s.aclose() for s in streams))  # the clients went away
        loop = asyncio.get_running_loop()
        t0 = loop.time()
        while True:
            loads = await asyncio.gather(*(w.load.remote() for w in pools.prefill + pools.decode))
            if all(x.free_blocks == x.num_blocks for x in loads):
                return loop.time() - t0, router
            assert loop.time() - t0 < 1.0, loads
            await asyncio.sleep(0.02)

    elapsed, router = asyncio.run(main())
    assert elapsed < 1.0
    assert all(d.running == 0 for d in router.book.decode)


def test_ten_times_capacity_gets_fast_overload_errors_and_the_rest_completes(cluster):
    ref = cluster[0]
    prompts = [random_prompt(8, 400 + i) for i in range(80)]  # capacity: 8 running + 8 waiting

    async def one(router, prompt):
        loop = asyncio.get_running_loop()
        t0 = loop.time()
        try:
            stream = await router.submit(GenerateRequest(prompt=prompt, sampling=SamplingParams(max_tokens=16)))
        except OverloadedError:
            return "overloaded", loop.time() - t0
        return [t async for ch in stream for t in ch.token_ids], loop.time() - t0

    async def main():
        router = make_router(cluster, policy="always_local", max_queued=8)
        return await asyncio.gather(*(one(router, p) for p in prompts)), router

    results, router = asyncio.run(main())
    refused = [dt for out, dt in results if out == "overloaded"]
    served = [(p, out) for p, (out, _) in zip(prompts, results) if out != "overloaded"]
    assert len(refused) >= 60 and max(refused) < 1.0  # refused at once, not after a wait
    assert len(served) >= 8
    for prompt, out in served:
        assert out == greedy_reference(ref, prompt, 16)
    assert router.placer.queue.waiting == 0 and all(d.running == 0 for d in router.book.decode)
    assert_all_free(cluster[1])


def test_request_timeout_aborts_it_everywhere(cluster):
    from router.types import DeadlineExceeded

    async def main():
        router = make_router(cluster, policy="always_remote")
        stream = await router.submit(GenerateRequest(prompt=random_prompt(12, 7), timeout_s=0.3,
                                                     sampling=SamplingParams(max_tokens=2000)))
        got = []
        with pytest.raises(DeadlineExceeded, match="timeout"):
            async for chunk in stream:
                got += chunk.token_ids
        return got, router

    got, router = asyncio.run(main())
    assert 0 < len(got) < 2000
    assert 'outcome="deadline"' in router.metrics_text()[0].decode()
    assert_all_free(cluster[1])


def test_idle_workers_lend_their_threads_both_ways_and_get_them_back_with_work(cluster):
    """Workers on one node: with nothing to compute on the decode worker, the prefill worker prefills
    with both workers' threads until a request decodes there; with nothing to prefill and a request
    decoding, the decode worker computes with both until a prompt is booked on the prefill worker.
    Output stays exact on every path."""
    from router.elastic import IDLE_POLLS, ThreadLender

    ref, pools, infos, cost, path = cluster
    prefill, decode = pools.prefill[0], pools.decode[0]

    async def threads_become(worker, n: int) -> None:
        for _ in range(100):
            if (await worker.load.remote()).threads == n:
                return
            await asyncio.sleep(0.05)
        raise AssertionError(f"the worker never computed with {n} threads")

    async def main():
        lender = ThreadLender.on_same_nodes(pools, threads=1, poll_s=1.0)
        assert lender.pairs == [(0, 0)] and "decode worker 0" in lender.describe()
        router = Router(pools, infos[:1], infos[1:], None, path, RouterConfig(policy="always_remote"), cost,
                        lender=lender)
        for _ in range(IDLE_POLLS):
            await router.poll_once()
        await threads_become(prefill, 2)  # nothing anywhere: prompts come to the prefill worker first
        assert lender.loans()[0].to_decode is False and (await decode.load.remote()).threads == 1
        assert "pdserve_elastic_decode_workers 1.0" in router.metrics_text()[0].decode()
        prompt = random_prompt(60, 77)
        tokens, _ = await collect(router, prompt, 10)  # prefilled with both; decoding takes them back
        await threads_become(prefill, 1)
        assert tokens == greedy_reference(ref, prompt, 10)
        stream = await router.submit(GenerateRequest(prompt=prompt, sampling=SamplingParams(max_tokens=400)))
        tokens = []
        async for chunk in stream:
            if not tokens:  # its first token: it decodes now, with nothing to prefill: the other way
                for _ in range(IDLE_POLLS):
                    await router.poll_once()
                await threads_become(decode, 2)
                assert lender.loans()[0].to_decode is True
            tokens += chunk.token_ids
        assert tokens == greedy_reference(ref, prompt, 400)  # exact across the thread change
        await collect(router, random_prompt(30, 78), 2)  # a prompt booked on the prefill worker
        await threads_become(decode, 1)
        for worker in (prefill, decode):
            await worker.set_threads.remote(1)
        await router.stop_polling()
    asyncio.run(main())
    assert_all_free(pools)


def test_an_idle_prefill_worker_flips_to_decode_and_back_while_its_requests_run(cluster):
    """Decode-heavy: with nothing to prefill, the prefill worker takes requests of its own (local
    prefill, decode). The mix shifts to long prompts: a prompt the policy finds worth the prefill
    worker back flips it, and it prefills beside the batch it still decodes; the flipper's state
    follows. Every request equals `generate`; no block leaks."""
    from router.elastic import IDLE_POLLS

    ref, pools, infos, _, _ = cluster
    p_id = infos[0].worker_id

    async def main():
        router = make_router(cluster, flip_roles=True)  # the ratio policy
        flipper = router.placer.elastic
        for _ in range(IDLE_POLLS):
            await router.poll_once()
        assert flipper.flipped(0)
        assert "pdserve_elastic_prefill_workers 1.0" in router.metrics_text()[0].decode()
        short = [random_prompt(12 + i, 300 + i) for i in range(6)]
        decode_heavy = [asyncio.ensure_future(collect(router, p, 120)) for p in short]
        await asyncio.sleep(0.2)  # they are placed and decoding
        long = [random_prompt(300 + 20 * i, 400 + i) for i in range(2)]
        prompt_heavy = await asyncio.gather(*(collect(router, p, 2) for p in long))
        heavy = await asyncio.gather(*decode_heavy)
        assert p_id in {last.timings.decode_worker for _, last in heavy}  # some ran on the flipped worker
        for prompt, (tokens, last) in zip(short, heavy):
            assert last.timings.path == "local" and tokens == greedy_reference(ref, prompt, 120), last.timings
        flipped_back = any(last.timings.prefill_worker == p_id for _, last in prompt_heavy)
        assert flipper.flipped(0) != flipped_back  # a prompt sent to it took it back from decode
        for prompt, (tokens, last) in zip(long, prompt_heavy):
            assert tokens == greedy_reference(ref, prompt, 2), last.timings
        for _ in range(IDLE_POLLS):
            await router.poll_once()
        assert flipper.flipped(0)  # idle again
        await router.stop_polling()
    asyncio.run(main())
    assert_all_free(pools)


def test_choices_of_one_prompt_share_the_kv_that_one_of_them_receives(cluster):
    """Four requests of one prompt (the `n` choices of a request) submitted one after the other; round_robin
    sends the 1st and 3rd remote, the 2nd and 4th local. The local ones reach the decode worker while the
    1st's KV is in flight: they wait for it and compute only the prompt's last partial block on the
    received blocks (usage says the rest came from the cache); every output equals `generate`, every
    block returns."""
    ref, pools, infos = cluster[0], cluster[1], cluster[2]
    bs = infos[1].block_size
    prompt = random_prompt(7 * bs + 5, seed=990)

    async def main():
        router = make_router(cluster, policy="round_robin")
        streams = [await router.submit(GenerateRequest(prompt=prompt, sampling=SamplingParams(max_tokens=8)))
                   for _ in range(4)]

        async def drain(stream):
            tokens, last = [], None
            async for chunk in stream:
                tokens, last = tokens + chunk.token_ids, chunk
            return tokens, last
        return await asyncio.gather(*(drain(s) for s in streams))

    results = asyncio.run(main())
    expected = greedy_reference(ref, prompt, 8)
    assert [tokens for tokens, _ in results] == [expected] * 4
    assert [last.timings.path for _, last in results] == ["remote", "local", "remote", "local"]
    for _, last in results[1::2]:
        assert last.usage.cached_tokens == 7 * bs, last.usage
    assert_all_free(pools)


@pytest.mark.parametrize("policy", ["always_remote", "always_local"])
def test_the_next_turn_of_a_conversation_reuses_what_the_workers_hold(cluster, policy):
    """Turn 2's prompt is turn 1's and more. After one poll the router knows the decode worker holds turn
    1's full blocks; remote: the decode worker reserves with them and only the rest is shipped (and the
    prefill worker computes only what its own cache lacks); local: only the rest is computed. Output
    equals `generate`, usage says what came from the cache, every block returns."""
    ref, pools, infos = cluster[0], cluster[1], cluster[2]
    bs, kv_bytes = infos[1].block_size, infos[1].kv_bytes_per_token
    seed = 900 if policy == "always_remote" else 950  # prompts no earlier test left in a cache
    first = random_prompt(70, seed=seed)
    second = first + random_prompt(30, seed=seed + 1)

    async def main():
        router = make_router(cluster, policy=policy)
        one = await collect(router, first, 6)
        await router.poll_once()  # the workers' cache events reach the router's index
        held = router.placer.prefix.matched("decode", 0, prefix_keys(second, bs))
        two = await collect(router, second, 6)
        return router, one, two, held

    router, (t1, l1), (t2, l2), held = asyncio.run(main())
    assert t1 == greedy_reference(ref, first, 6) and t2 == greedy_reference(ref, second, 6)
    assert held == 70 // bs and l2.usage.cached_tokens == held * bs and l1.usage.cached_tokens == 0
    assert {l1.timings.path, l2.timings.path} == {policy.removeprefix("always_")}
    text = router.metrics_text()[0].decode()
    path = policy.removeprefix("always_")
    worker = router.book.decode[0].worker_id
    labels = f'model_name="{router.model_name}",path="{path}",worker="{worker}"'
    assert f'pdserve_prefix_cache_hit_tokens_total{{{labels}}} {float(held * bs)}' in text
    if path == "remote":  # turn 1's 5 blocks, then turn 2's 7 but the 4 the decode worker held
        sent = float((5 + 7 - held) * bs * kv_bytes)
        assert f'pdserve_kv_transfer_bytes_sum{{model_name="{router.model_name}"}} {sent}' in text
    assert_all_free(pools)


def test_a_prompt_in_flight_promises_its_prefix_to_the_worker_computing_it(cluster):
    """Two turns over one system prompt arrive together: the second is placed before the first's blocks
    are reported (no poll between), yet the router sees the prefix on the worker computing the first;
    both equal `generate`; the promise ends with the requests and every block returns."""
    ref, pools, infos = cluster[0], cluster[1], cluster[2]
    bs = infos[1].block_size
    system = random_prompt(64, seed=970)
    first, second = system + random_prompt(8, seed=971), system + random_prompt(8, seed=972)

    async def main():
        router = make_router(cluster, policy="always_local")
        stream = await router.submit(GenerateRequest(prompt=first, sampling=SamplingParams(max_tokens=20)))
        promised = router.placer.prefix.matched("decode", 0, prefix_keys(second, bs))
        two = asyncio.ensure_future(collect(router, second, 20))
        one = [t async for chunk in stream for t in chunk.token_ids]
        tokens, _ = await two
        return router, promised, one, tokens

    router, promised, one, two = asyncio.run(main())
    assert promised == 64 // bs  # the shared blocks, before the worker reported any
    assert one == greedy_reference(ref, first, 20) and two == greedy_reference(ref, second, 20)
    assert router.placer.prefix.matched("decode", 0, prefix_keys(second, bs)) == 0  # withdrawn; no poll yet
    assert router.book.decode[0].queued_prefill_tokens == 0
    assert_all_free(pools)
