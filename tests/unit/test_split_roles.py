"""The role split an operator pins (`router.split`, `RoleFlipper.pin`, `Placer.pin_split`): parsing and
refusals, which prefill workers flip, that a pin holds against idle polls, flips back and replaced
workers, and that flips are automatic again once released. Pure: the book and a real `Placer`, no Ray."""
from __future__ import annotations

import asyncio

import pytest

from engine.errors import InvalidRequestError
from router.admission import ModelLimits
from router.book import DecodeSlot, PoolBook, PrefillSlot
from router.config import RouterConfig
from router.elastic import IDLE_POLLS, RoleFlipper
from router.metrics import Metrics
from router.placer import Placer
from router.policy import OutputLengthEstimator, RequestFeatures
from router.split import Mechanism, RoleSplit, SplitUnavailable, parse_split_body
from tests.unit.test_placer import info
from tests.unit.test_policy import COST


def flex_book(prefill: int) -> PoolBook:
    return PoolBook([PrefillSlot(f"p{i}") for i in range(prefill)], [DecodeSlot("d", 100, 16, 8)],
                    [DecodeSlot(f"p{i}", 50, 16, 8, flex=True, accepting=False) for i in range(prefill)])


def flipped(book: PoolBook) -> list[bool]:
    return [f.accepting for f in book.flex]


# --- the body and the refusals ---------------------------------------------------------------------

@pytest.mark.parametrize("body,want", [({"prefill": 2}, 2), ({"prefill": 0}, 0), ({"prefill": None}, None)])
def test_a_split_body_gives_the_prefill_role_count(body, want) -> None:
    assert parse_split_body(body) == want


@pytest.mark.parametrize("body,field", [([1], "body"), ("2", "body"), ({}, "prefill"), ({"prefill": True}, "prefill"),
                                        ({"prefill": "1"}, "prefill"), ({"prefill": 1.0}, "prefill"),
                                        ({"prefill": 1, "decode": 3}, "decode")])
def test_a_bad_split_body_names_its_field(body, field) -> None:
    with pytest.raises(InvalidRequestError) as e:
        parse_split_body(body)
    assert e.value.field == field and str(e.value).startswith(f"{field}: ")


def test_a_split_the_server_cannot_hold_is_refused_saying_why() -> None:
    split = RoleSplit(2, 2, 2, None, Mechanism.FLIP_ROLES)
    split.check(0)
    split.check(2)
    with pytest.raises(InvalidRequestError) as e:
        split.check(3)
    assert e.value.field == "prefill" and "has 2 prefill workers" in str(e.value) and "--prefill 3" in str(e.value)
    with pytest.raises(InvalidRequestError) as e:
        split.check(-1)
    assert e.value.field == "prefill"
    for mechanism in (Mechanism.LEND_THREADS, Mechanism.NONE):
        with pytest.raises(SplitUnavailable, match="start it with --flip-roles"):
            RoleSplit(2, 2, 2, None, mechanism).check(1)


def test_a_split_travels_as_json_and_a_broken_one_is_named() -> None:
    split = RoleSplit(3, 1, 1, 1, Mechanism.FLIP_ROLES)
    assert split.flipped == 2
    assert RoleSplit.from_json(split.to_json()) == split
    assert split.to_json()["mechanism"] == "flip_roles"
    assert "1 of 3 prefill workers prefill, 2 flipped to decode" in split.describe() and "(pinned)" in split.describe()
    with pytest.raises(ValueError, match="'pinned'"):
        RoleSplit.from_json({k: v for k, v in split.to_json().items() if k != "pinned"})
    with pytest.raises(ValueError, match="prefill_role"):
        RoleSplit.from_json({**split.to_json(), "prefill_role": "1"})


# --- the flipper ------------------------------------------------------------------------------------

def test_a_pin_flips_the_flipped_then_the_least_queued_and_holds_against_idle_polls_and_prompts() -> None:
    book = flex_book(3)
    flip = RoleFlipper(book)
    for _ in range(IDLE_POLLS):
        flip.rebalance([0, 300, 200], [1])
    assert flipped(book) == [True, False, False] and flip.pinned is None
    book.prefill[1].queued_tokens, book.prefill[2].queued_tokens = 300, 200
    flip.pin(1)  # two flipped: worker 0 (flipped already), then worker 2 (fewer tokens queued than 1)
    assert flipped(book) == [True, False, True] and flip.pinned == 1 and flip.moved == 2
    state = book.state()
    assert [p.healthy for p in state.prefill] == [False, True, False]  # a flipped worker is no prefill candidate
    assert [d.healthy for d in state.decode] == [True, True, False, True]
    for _ in range(IDLE_POLLS + 1):  # idle polls flip no more while pinned
        flip.rebalance([0, 0, 0], [0])
    assert flipped(book) == [True, False, True]
    flip.reclaim(1)  # a prompt on the worker that holds the prefill role
    assert flipped(book) == [True, False, True]
    flip.pin(3)  # every prefill worker back to prefill; nothing they run moves
    assert flipped(book) == [False, False, False] and flip.moved == 0 and flip.pinned == 3
    flip.pin(0)
    assert flipped(book) == [True, True, True] and flip.pinned == 0
    book.prefill[1].healthy = False
    flip.pin(2)  # the unhealthy worker is the one flipped: the healthy ones prefill
    assert flipped(book) == [False, True, False]
    with pytest.raises(ValueError, match="between 0 and 3"):
        flip.pin(4)


def test_a_replaced_worker_takes_its_pinned_role_and_a_released_pin_flips_automatically() -> None:
    book = flex_book(2)
    flip = RoleFlipper(book)
    flip.pin(1)
    assert flipped(book) == [False, True]
    book.flex[1] = DecodeSlot("p1b", 50, 16, 8, flex=True, accepting=False)  # the placer's fresh slot
    flip.reset("prefill", 1)
    assert flipped(book) == [False, True] and book.flex[1].worker_id == "p1b"
    flip.pin(None)  # automatic: the roles stand until polls or prompts change them
    assert flip.pinned is None and flipped(book) == [False, True]
    flip.reclaim(1)  # a prompt flips it back, as it would before any pin
    assert flipped(book) == [False, False]
    for _ in range(IDLE_POLLS):
        flip.rebalance([0, 0], [0])
    assert flipped(book) == [True, True]


# --- the placer -------------------------------------------------------------------------------------

def flip_placer(metrics: Metrics | None = None) -> Placer:
    p, d = [info("p0")], [info("d0")]
    return Placer(p, d, ModelLimits.from_infos(p, d), RouterConfig(flip_roles=True), COST,
                  metrics or Metrics(model_name="m"), OutputLengthEstimator())


LONG = RequestFeatures(3000, 4, 4)  # a prompt worth its prefill worker back, were it free to take it


def test_a_pinned_split_holds_where_an_automatic_one_flips_back() -> None:
    async def main():
        metrics = Metrics(model_name="m")
        auto, pinned = flip_placer(), flip_placer(metrics)
        for placer in (auto, pinned):
            for _ in range(IDLE_POLLS):
                placer.elastic.rebalance(*placer.computing())
            assert placer.elastic.flipped(0)
        busy = [await auto.place(RequestFeatures(20, 200, 200), None, [7] * 20) for _ in range(6)]
        assert all(b.placement.path == "local" for b in busy)
        got = await auto.place(LONG, None, [1] * 3000)
        assert (got.placement.path, got.placement.prefill, got.placement.reason) == ("remote", 0, "flip_back")
        assert not auto.elastic.flipped(0)

        split = pinned.pin_split(0)
        assert (split.prefill_role, split.pinned, split.flipped) == (0, 0, 1)
        text = metrics.exposition()[0].decode()
        assert "pdserve_role_split_pinned 1.0" in text and "pdserve_role_split_prefill_workers 0.0" in text
        for _ in range(6):
            await pinned.place(RequestFeatures(20, 200, 200), None, [7] * 20)
        got = await pinned.place(LONG, None, [1] * 3000)
        assert got.placement.path == "local" and got.placement.prefill is None  # the pin holds: prefilled locally
        assert pinned.elastic.flipped(0) and pinned.split().pinned == 0
        split = pinned.pin_split(None)
        assert split.pinned is None and split.prefill_role == 0  # automatic again, from the roles as they stand
        assert "pdserve_role_split_pinned 0.0" in metrics.exposition()[0].decode()
        await asyncio.sleep(0)
    asyncio.run(main())


def test_a_placer_without_role_flips_refuses_a_split_and_keeps_its_roles() -> None:
    async def main():
        p, d = [info("p0")], [info("d0")]
        placer = Placer(p, d, ModelLimits.from_infos(p, d), RouterConfig(), COST, Metrics(model_name="m"),
                        OutputLengthEstimator())
        assert placer.split() == RoleSplit(1, 1, 1, None, Mechanism.NONE)
        for prefill in (0, None):
            with pytest.raises(SplitUnavailable, match="--flip-roles"):
                placer.pin_split(prefill)
        with pytest.raises(InvalidRequestError, match="--prefill 2"):
            flip_placer().pin_split(2)
    asyncio.run(main())
