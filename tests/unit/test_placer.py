"""The placer's bookkeeping with the elastic mechanism, on a real `Placer` and book (no Ray, no
workers): what it tells the mechanism as requests are booked, prefilled and leave."""
from __future__ import annotations

import asyncio

from engine.block_manager import prefix_keys
from router.admission import ModelLimits
from router.config import RouterConfig
from router.metrics import Metrics
from router.placer import Placer
from router.policy import OutputLengthEstimator, RequestFeatures
from tests.unit.test_policy import COST
from worker_core.protocol import WorkerInfo


def info(worker_id: str) -> WorkerInfo:
    return WorkerInfo(worker_id, num_blocks=256, block_size=16, kv_bytes_per_token=1024, num_layers=30,
                      max_num_seqs=16, max_model_len=4096, prefill_chunk_tokens=256, vocab_size=1000,
                      dtype="float32", dtype_reason="test", attention="torch", compiled=False, linear="plain")


class Recorder:
    """An `Elastic` that records what the placer tells it."""

    def __init__(self) -> None:
        self.calls: list[tuple] = []

    def rebalance(self, queued_tokens: list[int], decoding: list[int]) -> None:
        self.calls.append(("rebalance", queued_tokens, decoding))

    def reclaim(self, prefill: int) -> None:
        self.calls.append(("reclaim", prefill))

    def occupy(self, decode: int) -> None:
        self.calls.append(("occupy", decode))

    def nudge(self, queued_tokens: list[int], decoding: list[int]) -> None:
        self.calls.append(("nudge", queued_tokens, decoding))

    def reset(self, pool: str, index: int) -> None:
        self.calls.append(("reset", pool, index))

    def loans(self) -> dict:
        return {}

    def offers(self, queued_tokens: list[int]) -> dict:
        return {}

    def lend_for(self, decode: int, queued_tokens: list[int]) -> None:
        self.calls.append(("lend_for", decode, queued_tokens))

    moved = moved_to_prefill = 0


def test_the_mechanism_hears_of_every_prompt_booked_and_every_request_gone() -> None:
    """Three prompts booked on the prefill worker, two of them prefilled and decoding, one leaving:
    after each booking and each departure the mechanism sees the book's prompt tokens queued per
    prefill worker and the requests each decode worker computes (not those awaiting their KV)."""
    async def main():
        prefill, decode = [info("p0")], [info("d0")]
        elastic = Recorder()
        placer = Placer(prefill, decode, ModelLimits.from_infos(prefill, decode), RouterConfig(policy="always_remote"),
                        COST, Metrics(model_name="m"), OutputLengthEstimator(), lender=elastic)
        bookings = [await placer.place(RequestFeatures(100 + i, 8, 8), None, [i] * (100 + i)) for i in range(3)]
        assert elastic.calls == [("reclaim", 0), ("nudge", [100], [0]), ("reclaim", 0), ("nudge", [201], [0]),
                                 ("reclaim", 0), ("nudge", [303], [0])]
        elastic.calls.clear()
        for b in bookings[:2]:
            placer.prefilled(b)  # their KV arrived: they decode on d0
        placer.release(bookings[0], 8, "length")
        assert elastic.calls == [("occupy", 0), ("occupy", 0), ("nudge", [102], [1])]
        placer.release(bookings[1], 8, "length")
        assert elastic.calls[-1] == ("nudge", [102], [0])  # d0 computes nothing; the third's prompt waits
    asyncio.run(main())


def test_a_remote_prompt_is_promised_to_its_decode_worker_and_a_local_one_waiting_for_it_takes_no_threads() -> None:
    """The n choices of one prompt: the first goes remote and its prefix is promised to the prefill worker
    computing it and to the decode worker receiving it; the second, placed local on that decode worker,
    waits there for the KV in flight, so it takes no threads back from the prefill worker computing it
    (they come back when the first is prefilled) and borrows none; an unrelated local prompt takes them
    back at once, and asks for the prefill worker's. The promises end with the requests."""
    async def main():
        prefill, decode = [info("p0")], [info("d0")]
        elastic = Recorder()
        placer = Placer(prefill, decode, ModelLimits.from_infos(prefill, decode), RouterConfig(policy="round_robin"),
                        COST, Metrics(model_name="m"), OutputLengthEstimator(), lender=elastic)
        prompt = list(range(200))
        keys = prefix_keys(prompt, 16)
        first = await placer.place(RequestFeatures(200, 8, 8), None, prompt)
        assert first.placement.path == "remote"
        assert placer.prefix.matched("prefill", 0, keys) == placer.prefix.matched("decode", 0, keys) == len(keys)
        elastic.calls.clear()
        second = await placer.place(RequestFeatures(200, 8, 8), None, prompt)
        assert second.placement.path == "local" and ("occupy", 0) not in elastic.calls
        assert second.awaits_kv and placer.computing() == ([200], [0])  # d0 computes nothing before the KV lands
        third = await placer.place(RequestFeatures(50, 8, 8), None, list(range(500, 550)))
        assert third.placement.path == "remote"
        elastic.calls.clear()
        fourth = await placer.place(RequestFeatures(40, 8, 8), None, list(range(900, 940)))
        # it takes D's threads back, and is offered the prefill worker's (not lent: 250 prompt tokens queued there)
        assert fourth.placement.path == "local" and elastic.calls == [("occupy", 0), ("lend_for", 0, [250])]
        assert not fourth.awaits_kv
        placer.prefilled(first)
        assert elastic.calls[-1] == ("occupy", 0)
        placer.prefilled(second)
        assert placer.book.decode[0].awaiting_kv == 1  # the third's KV alone is on its way
        for _ in range(50):  # its TTFT was the first's prefill: the correction learns nothing of it
            placer.observed(second, 10 * second.placement.est_ttft_s, None)
        assert placer.correction.factor("ttft", "local") == 1.0
        for _ in range(50):
            placer.observed(fourth, 10 * fourth.placement.est_ttft_s, None)
        assert placer.correction.factor("ttft", "local") > 1.0
        for b in (first, second, third, fourth):
            placer.release(b, 8, "length")
        assert placer.prefix.matched("decode", 0, keys) == placer.prefix.matched("prefill", 0, keys) == 0
    asyncio.run(main())


def test_a_local_prompt_waiting_for_kv_starts_once_its_decode_worker_reserved_that_kv() -> None:
    """The n choices of one prompt, round robin: the 2nd and 4th go local on d0 and wait there for the KV the
    1st and 3rd ship. Each starts only after d0 reserved the blocks of every remote choice placed before it (else
    d0 might not yet know them pending, and would compute the prefix again): `shipping` for one, or its release
    when it never reserves. An unrelated local prompt waits for nothing."""
    async def main():
        prefill, decode = [info("p0")], [info("d0")]
        placer = Placer(prefill, decode, ModelLimits.from_infos(prefill, decode), RouterConfig(policy="round_robin"),
                        COST, Metrics(model_name="m"), OutputLengthEstimator())
        prompt = list(range(200))
        choices = [await placer.place(RequestFeatures(200, 8, 8), None, prompt) for _ in range(4)]
        assert [b.placement.path for b in choices] == ["remote", "local", "remote", "local"]
        second, fourth = (asyncio.ensure_future(placer.reservations_made(b)) for b in choices[1::2])
        await asyncio.sleep(0.01)
        assert not second.done() and not fourth.done()
        placer.shipping(choices[0], 0)  # d0 reserved the 1st's blocks
        await asyncio.wait_for(second, 1)
        await asyncio.sleep(0.01)
        assert not fourth.done()  # the 3rd's reservation is still to come
        placer.release(choices[2], 0, "cancelled")  # it never reserved: nothing to wait for any more
        await asyncio.wait_for(fourth, 1)
        other = await placer.place(RequestFeatures(40, 8, 8), None, list(range(900, 940)))
        assert other.placement.path == "remote"
        alone = await placer.place(RequestFeatures(40, 8, 8), None, list(range(700, 740)))
        assert alone.placement.path == "local" and not alone.awaits_kv
        await asyncio.wait_for(placer.reservations_made(alone), 1)
        for b in (*choices, other, alone):
            placer.release(b, 8, "length")
        assert not placer._unreserved and not placer._waits
    asyncio.run(main())


def test_a_local_prompt_is_priced_with_an_idle_prefill_worker_s_threads_and_gets_them() -> None:
    """With the prefill worker idle and no loan standing yet (it lends after two idle polls), the ratio policy
    prices a short prompt on the decode worker with the prefill worker's threads, which a booking there takes
    at once: it goes local and the decode worker computes with both workers' threads. Told of no such offer,
    the same placer sends it remote. A prompt booked on the prefill worker takes them back."""
    from router.elastic import ThreadLender
    from tests.unit.test_elastic import fake_pools
    from worker_core.protocol import ThreadSpeedup

    async def main():
        prefill, decode = [info("p0")], [info("d0")]

        def placer(elastic) -> Placer:
            return Placer(prefill, decode, ModelLimits.from_infos(prefill, decode), RouterConfig(policy="ratio"),
                          COST, Metrics(model_name="m"), OutputLengthEstimator(), lender=elastic)
        blind = await placer(Recorder()).place(RequestFeatures(64, 64, 64), None, list(range(64)))
        assert blind.placement.path == "remote"
        pools, calls = fake_pools(1, 1)
        lender = ThreadLender(pools, [(0, 0, ThreadSpeedup(1.3, 1.8))], threads=1, poll_s=1.0)
        offered = placer(lender)
        first = await offered.place(RequestFeatures(64, 64, 64), None, list(range(64)))
        await asyncio.sleep(0)
        assert first.placement.path == "local" and first.placement.est_ttft_s < blind.placement.est_ttft_s
        assert lender.lent_to(0) and calls == [("decode", 0, 2)]
        long = await offered.place(RequestFeatures(1500, 8, 8), None, list(range(1000, 2500)))
        await asyncio.sleep(0)
        assert long.placement.path == "remote" and not lender.lent_to(0) and calls[-1] == ("decode", 0, 1)
    asyncio.run(main())
