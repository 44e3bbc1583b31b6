"""The role split on a real router with role flips (a local Ray cluster, a tiny model, one prefill and one
decode worker) behind its real HTTP server with an API key: pinned over HTTP, a request is served on the
flipped worker, a long prompt stays local while the pin holds, outputs equal transformers greedy
`generate`, flips are automatic again after DELETE; bad input is a 400 naming the field, no key a 401."""
from __future__ import annotations

import asyncio

import aiohttp
import pytest
import ray

from engine import CacheConfig, EngineConfig
from kv_transfer import TransferConfig
from router.calibrate import calibrate
from router.config import RouterConfig
from router.http_server import start_http_server
from router.pools import create_pools
from router.service import Router
from tests.conftest import greedy_reference, random_prompt
from tests.integration.conftest import saved_tiny_model

KEY = "split-test-key"
AUTH = {"Authorization": f"Bearer {KEY}"}


@pytest.fixture(scope="module")
def cluster(ray_cluster, tmp_path_factory):
    ref, path = saved_tiny_model(tmp_path_factory, "llama", seed=11)
    cfg = EngineConfig(model=path, dtype="float32", num_threads=1, max_num_seqs=8,
                       cache=CacheConfig(memory_gib=0.004))
    pools = create_pools(1, 1, cfg, TransferConfig(backend="torch_dist", timeout_s=20, host="127.0.0.1"),
                         num_cpus=0)
    infos = ray.get([w.info.remote() for w in pools.prefill + pools.decode])
    cost = asyncio.run(calibrate(pools, infos[1]))
    yield ref, pools, infos, cost, path
    pools.shutdown()


async def complete(http: aiohttp.ClientSession, base: str, prompt: list[int], max_tokens: int) -> tuple[list[int], dict]:
    """A greedy completion of token ids: (the output's token ids, from its logprobs; its pdserve_timings)."""
    body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "logprobs": 0}
    async with http.post(base + "/v1/completions", json=body, headers=AUTH) as r:
        assert r.status == 200, await r.text()
        answer = await r.json()
    tokens = [int(t.removeprefix("token_id:")) for t in answer["choices"][0]["logprobs"]["tokens"]]
    return tokens, answer["usage"]["pdserve_timings"]


@pytest.mark.slow  # a Ray cluster, two workers and a calibration: about 25 s on 2 cores
def test_a_split_pinned_over_http_holds_serves_on_the_flipped_worker_and_is_released(cluster):
    ref, pools, infos, cost, path = cluster
    p_id, d_id = infos[0].worker_id, infos[1].worker_id

    async def main():
        router = Router(pools, infos[:1], infos[1:], None, path, RouterConfig(flip_roles=True), cost)
        runner, port = await start_http_server(router, "127.0.0.1", 0, api_keys=frozenset({KEY}))
        base = f"http://127.0.0.1:{port}"
        try:
            async with aiohttp.ClientSession() as http:
                async with http.post(base + "/pdserve/split", json={"prefill": 0}) as r:
                    assert r.status == 401
                for bad, field in (({"prefill": 2}, "prefill"), ({"prefill": 0, "decode": 1}, "decode")):
                    async with http.post(base + "/pdserve/split", json=bad, headers=AUTH) as r:
                        assert r.status == 400 and (await r.json())["error"]["param"] == field
                async with http.get(base + "/pdserve/split", headers=AUTH) as r:
                    assert (await r.json())["prefill_role"] == 1  # no poll yet: nothing flipped

                async with http.post(base + "/pdserve/split", json={"prefill": 0}, headers=AUTH) as r:
                    split = await r.json()
                assert (split["pinned"], split["prefill_role"]) == (0, 0)
                router.placer.set_healthy("decode", 0, False)  # the flipped prefill worker is the only decode slot
                short = random_prompt(20, seed=61)
                tokens, timings = await complete(http, base, short, 6)
                assert (timings["path"], timings["decode_worker"]) == ("local", p_id)  # served on the flipped worker
                assert tokens == greedy_reference(ref, short, 6)
                router.placer.set_healthy("decode", 0, True)

                long = random_prompt(300, seed=62)  # a prompt worth a prefill worker: the pin holds, it stays local
                tokens, timings = await complete(http, base, long, 3)
                assert timings["path"] == "local" and timings["prefill_worker"] is None, timings
                assert tokens == greedy_reference(ref, long, 3)

                async with http.post(base + "/pdserve/split", json={"prefill": 1}, headers=AUTH) as r:
                    assert (await r.json())["prefill_role"] == 1
                tokens, timings = await complete(http, base, long, 3)
                assert timings["decode_worker"] == d_id  # the prefill worker's flex slot takes no new request
                assert tokens == greedy_reference(ref, long, 3)

                async with http.delete(base + "/pdserve/split", headers=AUTH) as r:
                    assert r.status == 200 and (await r.json())["pinned"] is None
                async with http.get(base + "/metrics") as r:
                    text = await r.text()
                assert "pdserve_role_split_pinned 0.0" in text and "pdserve_role_split_prefill_workers 1.0" in text
        finally:
            await runner.cleanup()
            await router.stop_polling()
        assert all(d.running == 0 and d.reserved_blocks == 0 for d in [*router.book.decode, *router.book.flex])

    asyncio.run(main())
