"""Fault injection on a real local Ray cluster: worker processes are killed (by pid) under load.
Every request either completes with transformers' greedy output or fails with a clear error; none
hangs; dead workers are replaced; afterwards every block of every live worker is free."""
from __future__ import annotations

import asyncio
import copy
import os
import signal
from dataclasses import replace

import pytest
import ray

from engine import CacheConfig, EngineConfig, LLMEngine, SamplingParams
from kv_transfer import TransferConfig
from router.calibrate import calibrate
from router.config import RouterConfig
from router.cost_model import CostModel
from router.pools import create_pools, replace_worker
from router.service import Router
from router.types import GenerateRequest, RequestFailed
from tests.conftest import greedy_reference, random_prompt
from tests.integration.conftest import saved_tiny_model
from worker_core.protocol import ErrorKind

pytestmark = pytest.mark.slow
TRANSFER_TIMEOUT_S = 5.0


@pytest.fixture(scope="module")
def cluster(ray_cluster, tmp_path_factory):
    ref, path = saved_tiny_model(tmp_path_factory, "qwen2", seed=9)
    cfg = EngineConfig(model=path, dtype="float32", num_threads=1, max_num_seqs=16,
                       cache=CacheConfig(memory_gib=0.004))
    transfer = TransferConfig(backend="torch_dist", timeout_s=TRANSFER_TIMEOUT_S, host="127.0.0.1")
    pools = create_pools(2, 2, cfg, transfer, num_cpus=0)
    infos = ray.get([w.info.remote() for w in pools.prefill + pools.decode])
    cost = asyncio.run(calibrate(pools, infos[2]))

    def respawn(pool: str, index: int) -> dict:
        return replace_worker(pools, pool, index, cfg, transfer, num_cpus=0)

    yield ref, pools, infos, cost, path, respawn
    pools.shutdown()


def make_router(cluster, cost: CostModel | None = None, **kw) -> Router:
    """A router over the module's pools, pricing with `cost` (default: the calibrated cost model)."""
    _, pools, infos, calibrated, path, respawn = cluster
    return Router(pools, infos[:2], infos[2:], None, path, RouterConfig(load_poll_s=0.2, **kw),
                  cost or calibrated, respawn=respawn)


async def run_one(router: Router, prompt: list[int], max_tokens: int, progress: dict, key: int,
                  sampling: SamplingParams | None = None, logprobs: list | None = None):
    """Stream one request (greedy unless `sampling` is given) to its end; `progress[key]` follows it;
    its tokens' logprobs (when `sampling` asks) go to `logprobs`."""
    try:
        stream = await router.submit(GenerateRequest(prompt=prompt, sampling=sampling or SamplingParams(
            max_tokens=max_tokens)))
        tokens = []
        async for chunk in stream:
            tokens += chunk.token_ids
            if logprobs is not None:
                logprobs += chunk.logprobs
            progress[key] = (len(tokens), stream._booking)
        return tokens
    except RequestFailed as e:
        return e


def kill(actor) -> None:
    os.kill(ray.get(actor.pid.remote()), signal.SIGKILL)


async def settle(router: Router, timeout_s: float = 60) -> None:
    """Wait until both pools are back to full strength and healthy."""
    loop = asyncio.get_running_loop()
    end = loop.time() + timeout_s
    while loop.time() < end:
        await router.poll_once()
        if not router.health.respawning and all(s.healthy for s in router.book.prefill + router.book.decode):
            return
        await asyncio.sleep(0.3)
    raise AssertionError("pools did not recover")


def assert_all_free(pools) -> None:
    for w in pools.prefill + pools.decode:
        load = ray.get(w.load.remote())
        assert load.free_blocks == load.num_blocks, load


def assert_all_match(ref, prompts: list[list[int]], results: list, n: int) -> None:
    """Every request completed (none failed) with transformers' greedy output: no token lost or repeated."""
    for prompt, out in zip(prompts, results):
        assert not isinstance(out, Exception), out
        assert out == greedy_reference(ref, prompt, n)


@pytest.mark.parametrize("how", ["killed", "hung"])
def test_a_prefill_worker_lost_under_load_its_requests_retry_and_match(cluster, how):
    """Killed, or hung (SIGSTOP: it answers nothing until the router kills it after `hang_timeout_s`)
    while prompts are queued or prefilling on it: each is placed again and completes exactly; the
    worker is replaced."""
    ref, pools = cluster[0], cluster[1]
    prompts = [random_prompt(60 + 7 * i, seed=100 + i) for i in range(8)]

    async def main():
        router = make_router(cluster, policy="always_remote", hang_timeout_s=2.0)
        router.start_polling()
        progress: dict = {}
        tasks = [asyncio.create_task(run_one(router, p, 24, progress, i)) for i, p in enumerate(prompts)]
        await asyncio.sleep(0.05)
        if how == "killed":  # while prompts are queued or prefilling on it
            kill(pools.prefill[0])
        else:
            os.kill(ray.get(pools.prefill[0].pid.remote()), signal.SIGSTOP)
        results = await asyncio.wait_for(asyncio.gather(*tasks), 120)
        await settle(router)
        await router.stop_polling()
        return router, results

    router, results = asyncio.run(main())
    assert_all_match(ref, prompts, results, 24)
    text = router.metrics_text()[0].decode()
    assert "pdserve_worker_replacements_total" in text
    assert ('pdserve_worker_hangs_total{pool="prefill"} 1.0' in text) == (how == "hung")
    assert len(pools.prefill) == 2 and len(pools.decode) == 2
    assert_all_free(pools)


@pytest.mark.parametrize("how", ["killed", "stopped", "hung"])
def test_a_decode_worker_lost_mid_stream_hands_its_streams_on_without_losing_a_token(cluster, how):
    """Killed: the router sees the actor die. Stopped (a graceful shutdown): the worker ends its streams
    with WORKER_STOPPING. Hung (SIGSTOP): it answers nothing, and after `hang_timeout_s` the router
    kills it. Each way the router moves its streams to the other decode worker, which continues each
    where it stopped (the seeded ones' logprobs too), and the lost worker is replaced."""
    ref, pools = cluster[0], cluster[1]
    prompts = [random_prompt(20 + 3 * i, seed=200 + i) for i in range(6)]
    n = 300
    # and two seeded samples, one on each decode worker (round robin): the moved one samples on as if unbroken
    sampled = [random_prompt(30, seed=260 + i) for i in range(2)]
    sampling = SamplingParams(max_tokens=n, temperature=1.0, top_k=20, seed=31, logprobs=2)
    oracle = LLMEngine(EngineConfig(dtype="float32", cache=CacheConfig(memory_gib=0.02)), model=copy.deepcopy(ref))
    oracle_outs = oracle.generate(sampled, sampling)
    expected = [o.output_token_ids for o in oracle_outs]
    logprobs: list[list] = [[], []]

    async def main():
        router = make_router(cluster, policy="round_robin", hang_timeout_s=2.0)
        router.start_polling()
        progress: dict = {}
        tasks = [asyncio.create_task(run_one(router, p, n, progress, i)) for i, p in enumerate(prompts)]
        tasks += [asyncio.create_task(run_one(router, p, n, progress, 6 + i, sampling, logprobs[i]))
                  for i, p in enumerate(sampled)]
        while not all(v[0] >= 20 for k, v in progress.items() if k >= 6) or len(progress) < 8:  # under way
            await asyncio.sleep(0.01)
        victim = progress[6][1].decode.worker_id
        index = [s.worker_id for s in router.book.decode].index(victim)
        if how == "killed":
            kill(pools.decode[index])
        elif how == "stopped":
            await asyncio.wait_for(pools.decode[index].shutdown.remote(), 30)
        else:
            os.kill(ray.get(pools.decode[index].pid.remote()), signal.SIGSTOP)
        results = await asyncio.wait_for(asyncio.gather(*tasks), 180)
        if how == "stopped":
            ray.kill(pools.decode[index])  # a stopped worker is then replaced like a dead one
        await settle(router)
        await router.poll_once()
        await router.stop_polling()
        return router, results, index

    router, results, index = asyncio.run(main())
    assert_all_match(ref, prompts, results[:6], n)
    assert results[6:] == expected
    for got, want in zip(logprobs, oracle_outs):  # one per token, those after the move from the new worker
        for g, w in zip(got, want.logprobs, strict=True):
            assert g.token_id == w.token_id and abs(g.logprob - w.logprob) < 1e-4
            assert max(abs(a - b) for a, b in zip(g.top_logprobs, w.top_logprobs, strict=True)) < 1e-4
    # the router's copy of the replaced slot's prefix cache is the new worker's, nothing of the lost one's
    assert router.placer.prefix.keys("decode", index) == set(ray.get(pools.decode[index].cache_events.remote(0)).stored)
    text = router.metrics_text()[0].decode()
    assert 'pdserve_request_recoveries_total{action="migrate",model_name=' in text
    assert ('pdserve_worker_hangs_total{pool="decode"} 1.0' in text) == (how == "hung")
    assert_all_free(pools)


def test_a_flipped_prefill_worker_killed_mid_stream_hands_its_streams_on(cluster):
    """A prefill worker flipped to decode dies while it runs requests whole: they move to a decode
    worker and continue where they stopped (exact), and its replacement starts as a prefill worker."""
    ref, pools = cluster[0], cluster[1]
    prompts = [random_prompt(15 + 4 * i, seed=700 + i) for i in range(6)]
    n = 300

    async def main():
        # the ratio policy with remote prefill priced out (a slow hop), so that requests run whole on
        # decode workers and flex slots alike, and decode steps that grow with the batch whatever the
        # calibration on a busy machine measured, so that crowding spreads them over all four slots
        cost = replace(cluster[3], hop_s=60.0, decode_step=((1, 0.01), (4, 0.03), (16, 0.12)))
        router = make_router(cluster, cost, flip_roles=True)
        flipper = router.placer.elastic
        for _ in range(2):
            await router.poll_once()
        assert flipper.flipped(0) and flipper.flipped(1)
        progress: dict = {}
        tasks = [asyncio.create_task(run_one(router, p, n, progress, i)) for i, p in enumerate(prompts)]
        flex_ids = {s.worker_id for s in router.book.flex}

        def on_flex() -> list:
            return [v[1] for v in progress.values() if v[0] >= 20 and v[1].decode.worker_id in flex_ids]
        while not on_flex() and not all(t.done() for t in tasks):
            await asyncio.sleep(0.01)
        placed = [(v[1].placement.path, v[1].placement.reason, v[1].decode.worker_id) for v in progress.values()]
        assert on_flex(), f"no request ran on a flipped prefill worker (flex slots {flex_ids}; placed {placed})"
        victim = on_flex()[0]
        index = [s.worker_id for s in router.book.prefill].index(victim.decode.worker_id)
        kill(pools.prefill[index])
        router.start_polling()
        results = await asyncio.wait_for(asyncio.gather(*tasks), 180)
        await settle(router)
        assert router.book.flex[index].worker_id != victim.decode.worker_id  # a fresh flex slot
        await router.stop_polling()
        return router, results

    router, results = asyncio.run(main())
    assert_all_match(ref, prompts, results, n)
    assert 'pdserve_request_recoveries_total{action="migrate",model_name=' in router.metrics_text()[0].decode()
    assert_all_free(pools)


def test_a_worker_busy_in_a_long_step_answers_its_health_checks(cluster):
    """The prefill worker's engine thread is held for longer than a health check may take (as by a
    very long prefill): its load is still answered, so it is never marked unhealthy, and the request
    completes exactly."""
    ref, pools = cluster[0], cluster[1]
    prompt = random_prompt(40, seed=400)

    async def main():
        router = make_router(cluster, policy="always_remote")
        await settle(router)
        for w in pools.prefill:
            await asyncio.wait_for(w.inject_fault.remote("stall"), 30)
        router.start_polling()
        try:
            return await asyncio.wait_for(run_one(router, prompt, 10, {}, 0), 60), router
        finally:
            await router.stop_polling()
            for w in pools.prefill:
                await asyncio.wait_for(w.inject_fault.remote(None), 30)

    out, router = asyncio.run(main())
    assert out == greedy_reference(ref, prompt, 10)
    text = router.metrics_text()[0].decode()
    assert "pdserve_worker_failures_total{" not in text, text  # busy, never unhealthy
    assert "pdserve_worker_hangs_total{" not in text
    assert_all_free_eventually(pools)


TRANSFER_FAULTS, ON_FAILURE = ["drop", "bad_header", "die"], ["retry", "local", "fail"]


@pytest.mark.parametrize("fault", TRANSFER_FAULTS)
@pytest.mark.parametrize("on_failure", ON_FAILURE)
def test_transfer_faults_abort_free_and_recover_as_configured(cluster, fault, on_failure):
    ref, pools = cluster[0], cluster[1]
    # 3 blocks: a short header is visible. A prompt of its own, every run: one the decode worker cached in
    # an earlier case would need less of the transfer, or none.
    prompt = random_prompt(40, seed=500 + 10 * TRANSFER_FAULTS.index(fault) + ON_FAILURE.index(on_failure))

    async def main():
        router = make_router(cluster, policy="always_remote", on_prefill_failure=on_failure)
        await settle(router)
        for w in pools.prefill:
            await asyncio.wait_for(w.inject_fault.remote(None), 30)
        await asyncio.wait_for(pools.prefill[0].inject_fault.remote(fault), 30)
        await asyncio.wait_for(pools.prefill[1].inject_fault.remote(fault), 30)  # whichever one it lands on
        out = await asyncio.wait_for(run_one(router, prompt, 10, {}, 0), 60)
        for w in pools.prefill:
            try:
                await asyncio.wait_for(w.inject_fault.remote(None), 30)
            except ray.exceptions.RayActorError:
                pass  # the one that died
        router.start_polling()
        await settle(router)
        await router.stop_polling()
        return out, router

    out, router = asyncio.run(asyncio.wait_for(main(), 240))  # a hang fails here, not at the suite timeout
    text, model = router.metrics_text()[0].decode(), router.model_name
    if on_failure == "fail":
        assert isinstance(out, RequestFailed) and "could not start" in str(out)
        assert f'pdserve_request_errors_total{{kind="{out.kind.value}",model_name="{model}"}} 1.0' in text
    else:
        assert out == greedy_reference(ref, prompt, 10)
        action = on_failure if on_failure == "local" else "retry"
        assert f'pdserve_request_recoveries_total{{action="{action}",model_name="{model}"}}' in text
    # a lost transfer is counted apart from a prefill worker that died, by the error's kind
    kind = "prefill_failed" if fault == "die" else "transfer_failed"
    assert f'pdserve_request_attempt_failures_total{{kind="{kind}",model_name="{model}",pool="prefill"}}' in text, text
    assert_all_free_eventually(pools)


@pytest.mark.parametrize("side", ["prefill", "decode"])
def test_a_token_that_cannot_be_picked_fails_its_request_alone(cluster, side):
    """A worker's sampler cannot pick a request's token (as for a row with no finite logit): on the
    prefill worker (its first token) or the decode worker (a later one). That request ends with a clear
    error of its kind, at once (no retry, no hang); the worker serves the next request exactly; every
    block returns to its pool."""
    ref, pools = cluster[0], cluster[1]
    prompt, after = random_prompt(40, seed=620), random_prompt(30, seed=621)
    armed = pools.prefill if side == "prefill" else pools.decode

    async def main():
        router = make_router(cluster, policy="always_remote", on_prefill_failure="fail")
        await settle(router)
        for w in armed:
            await asyncio.wait_for(w.inject_fault.remote("sample"), 30)
        try:
            failed = await asyncio.wait_for(run_one(router, prompt, 10, {}, 0), 60)
        finally:
            for w in armed:
                await asyncio.wait_for(w.inject_fault.remote(None), 30)
        out = await asyncio.wait_for(run_one(router, after, 12, {}, 0), 60)
        await router.stop_polling()
        return failed, out, router

    failed, out, router = asyncio.run(main())
    text = router.metrics_text()[0].decode()
    placed = [line for line in text.splitlines() if line.startswith("pdserve_placement_decisions_total{")]
    assert isinstance(failed, RequestFailed), (failed, placed)
    assert "no token could be picked" in str(failed), failed
    kind = ErrorKind.PREFILL_FAILED if side == "prefill" else ErrorKind.INTERNAL
    assert failed.kind == kind, failed
    assert out == greedy_reference(ref, after, 12)
    assert "pdserve_worker_failures_total{" not in text, text  # a request failed, not its worker
    assert_all_free_eventually(pools)


def test_a_token_that_cannot_be_picked_fails_the_request_that_arrives_not_one_already_decoding(cluster):
    """The sampling fault is armed on the decode workers while a request decodes there: the next request to
    arrive takes it and fails alone; the one already decoding runs on to the end exactly."""
    ref, pools = cluster[0], cluster[1]
    running, victim = random_prompt(35, seed=630), random_prompt(30, seed=631)

    async def main():
        router = make_router(cluster, policy="always_remote", on_prefill_failure="fail")
        await settle(router)
        progress: dict = {}
        first = asyncio.create_task(run_one(router, running, 300, progress, 0))
        while progress.get(0, (0,))[0] < 5 and not first.done():  # it decodes on its decode worker
            await asyncio.sleep(0.01)
        for w in pools.decode:
            await asyncio.wait_for(w.inject_fault.remote("sample"), 30)
        armed_while_decoding = not first.done()
        try:
            failed = await asyncio.wait_for(run_one(router, victim, 10, {}, 1), 60)
        finally:
            for w in pools.decode:
                await asyncio.wait_for(w.inject_fault.remote(None), 30)
        out = await asyncio.wait_for(first, 120)
        await router.stop_polling()
        return armed_while_decoding, failed, out

    armed_while_decoding, failed, out = asyncio.run(main())
    assert armed_while_decoding, "the first request ended before the fault was armed: the test proves nothing"
    assert isinstance(failed, RequestFailed) and "no token could be picked" in str(failed), failed
    assert out == greedy_reference(ref, running, 300)
    assert_all_free_eventually(pools)


def assert_all_free_eventually(pools, timeout_s: float = 30) -> None:
    """Blocks a failed transfer held on the sending side return once that side sees it fail."""
    import time

    end = time.monotonic() + timeout_s
    while True:
        loads = ray.get([w.load.remote() for w in pools.prefill + pools.decode])
        if all(x.free_blocks == x.num_blocks for x in loads) or time.monotonic() > end:
            break
        time.sleep(0.2)
    for load in loads:
        assert load.free_blocks == load.num_blocks, load


def test_a_cancel_between_prefill_and_decode_frees_both_sides(cluster):
    """The client goes away at the moment its prompt's prefill is done and before the decode worker
    starts it (the placer's `prefilled` hook, where the router hands the first token over): both
    workers drop the request and every block returns; the next request is exact."""
    ref, pools = cluster[0], cluster[1]
    prompt, after = random_prompt(50, seed=610), random_prompt(30, seed=611)

    async def main():
        router = make_router(cluster, policy="always_remote")
        await settle(router)
        stream = await router.submit(GenerateRequest(prompt=prompt, sampling=SamplingParams(max_tokens=50)))
        placer, prefilled = router.placer, router.placer.prefilled
        closing: list[asyncio.Task] = []

        def hooked(booking) -> None:
            prefilled(booking)
            if not closing:  # the first token is known; the decode worker has not started
                closing.append(asyncio.get_running_loop().create_task(stream.aclose()))
        placer.prefilled = hooked
        got = [c async for c in stream]
        await asyncio.gather(*closing)
        placer.prefilled = prefilled
        assert closing and sum(len(c.token_ids) for c in got) < 50
        out = await asyncio.wait_for(run_one(router, after, 12, {}, 0), 60)
        await router.stop_polling()
        return router, out

    router, out = asyncio.run(main())
    assert out == greedy_reference(ref, after, 12)
    text = router.metrics_text()[0].decode().splitlines()
    assert any(line.startswith("pdserve_requests_total{") and 'outcome="cancelled"' in line for line in text)
    assert_all_free_eventually(pools)


def test_an_idle_transfer_plane_serves_at_once_after_the_transfer_timeout(cluster):
    """The pairs built, then nothing for longer than the transfer timeout: the next remote request
    goes through on its first attempt (no retry, no recovery), exact."""
    ref, pools = cluster[0], cluster[1]
    first, later = random_prompt(40, seed=620), random_prompt(45, seed=621)

    async def main():
        router = make_router(cluster, policy="always_remote")
        await settle(router)
        a = await asyncio.wait_for(run_one(router, first, 8, {}, 0), 60)
        await asyncio.sleep(TRANSFER_TIMEOUT_S + 2)  # longer than any transfer may take
        b = await asyncio.wait_for(run_one(router, later, 8, {}, 1), 60)
        await router.stop_polling()
        return router, a, b

    router, a, b = asyncio.run(main())
    assert a == greedy_reference(ref, first, 8) and b == greedy_reference(ref, later, 8)
    text = router.metrics_text()[0].decode()
    assert "pdserve_request_recoveries_total{" not in text, text
    assert_all_free_eventually(pools)
