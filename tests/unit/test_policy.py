"""Placement policy and cost model: pure, on made-up but realistic costs (2-core CPU, 135M model)."""
from __future__ import annotations

import json
from dataclasses import replace

import pytest

from router.book import DecodeSlot, PoolBook, PrefillSlot
from router.config import RouterConfig
from router.cost_model import Correction, CostModel, LinearFit, OutputLengthEstimator
from router.policy import (
    POLICIES,
    AlwaysLocalPolicy,
    AlwaysRemotePolicy,
    DecodeLoad,
    Loan,
    NoCapacity,
    Placement,
    PoolState,
    PrefillLoad,
    RatioPolicy,
    RequestFeatures,
    RoundRobinPolicy,
    _local,
    _remote,
    make_policy,
)

KV_BYTES = 23040  # per token, all layers


def measured_cost(bandwidth: float = 200e6, step_scale: float = 1.0, chunk: int | None = 256,
                  ride: float = 0.5) -> CostModel:
    """Fit a cost model from 'measurements' the way start-up calibration would (256-token chunks; a
    decode batch adds half its own step to a chunk's step, as on a 2-core CPU)."""
    tokens = [16, 128, 512, 2048]
    prefill = LinearFit.fit(tokens, [0.005 + 0.0025 * t for t in tokens])
    nbytes = [1e5, 1e6, 1e7, 5e7]
    transfer = LinearFit.fit(nbytes, [0.002 + b / bandwidth for b in nbytes])
    steps = ((1, 0.050 * step_scale), (8, 0.060 * step_scale), (32, 0.090 * step_scale))
    return CostModel(prefill=prefill, local_prefill=prefill, decode_step=steps, transfer=transfer,
                     kv_bytes_per_token=KV_BYTES, num_layers=30, hop_s=0.01, prefill_chunk_tokens=chunk,
                     decode_ride=ride)


COST = measured_cost()
TARGETS = (RouterConfig().ttft_target_s, RouterConfig().tpot_target_s)  # the router's defaults


def req(prompt: int, out: int, max_tokens: int | None = None) -> RequestFeatures:
    return RequestFeatures(prompt, out, max_tokens if max_tokens is not None else out)


def dec(running: int = 0, free: int = 10_000, wid: str = "d", **kw) -> DecodeLoad:
    return DecodeLoad(wid, running=running, free_blocks=free, block_size=16, **kw)


def pools(prefill: list[PrefillLoad] | None = None, decode: list[DecodeLoad] | None = None) -> PoolState:
    return PoolState(tuple(prefill if prefill is not None else [PrefillLoad("p", 0)]),
                     tuple(decode if decode is not None else [dec()]))


def switch_point(policy: RatioPolicy, out: int, running: int = 0, limit: int = 4000) -> int | None:
    """Smallest prompt length that goes remote for this output length (linear scan)."""
    state = pools(decode=[dec(running)])
    return next((n for n in range(1, limit) if policy.place(req(n, out), state).path == "remote"), None)


# --- ratio policy: the decision ---

@pytest.mark.parametrize("running", [0, 3, 12])
def test_long_prompt_short_output_goes_remote(running: int) -> None:
    pl = RatioPolicy(COST, *TARGETS).place(req(2000, 20), pools(decode=[dec(running)]))
    assert (pl.path, pl.prefill, pl.decode, pl.reason) == ("remote", 0, 0, "cheapest_remote")
    assert "local" in pl.detail  # the losing path is reported too
    assert pl.est_tpot_s == pytest.approx(COST.step_s(running + 1))


@pytest.mark.parametrize("running,ride", [(0, 0.5), (1, 0.1), (1, 0.5)])
def test_short_prompt_long_output_goes_local(running: int, ride: float) -> None:
    """Unless the decode step its one chunk rides with costs more than the hop to a prefill worker."""
    policy = RatioPolicy(measured_cost(ride=ride), *TARGETS)
    pl = policy.place(req(20, 500), pools(decode=[dec(running)]))
    hop = COST.hop_s + COST.exposed_transfer_s(20)
    expected = "local" if running * ride * COST.step_s(running) < hop else "remote"
    assert (pl.path, pl.decode, pl.reason) == (expected, 0, f"cheapest_{expected}")
    assert pl.est_ttft_s < policy.place(req(2000, 500), pools(decode=[dec(running)])).est_ttft_s


def test_busy_decode_batch_pushes_short_prompt_remote() -> None:
    # the local stall is charged to every running sequence, so a bigger batch makes local dearer
    policy = RatioPolicy(COST, *TARGETS)
    assert policy.place(req(20, 500), pools(decode=[dec(0)])).path == "local"
    assert policy.place(req(20, 500), pools(decode=[dec(16)])).path == "remote"
    assert switch_point(policy, 500, running=4) < switch_point(policy, 500, running=0)


def test_switch_point_follows_transfer_bandwidth() -> None:
    fast = switch_point(RatioPolicy(measured_cost(bandwidth=200e6), *TARGETS), 500)
    slow = switch_point(RatioPolicy(measured_cost(bandwidth=10e6), *TARGETS), 500)
    assert fast is not None and slow is not None
    assert 1 < fast < slow < 4000


def test_switch_point_follows_decode_step_cost() -> None:
    base = switch_point(RatioPolicy(COST, *TARGETS), 500)
    slow_steps = switch_point(RatioPolicy(measured_cost(step_scale=2.0), *TARGETS), 500)
    fast_steps = switch_point(RatioPolicy(measured_cost(step_scale=0.5), *TARGETS), 500)
    assert None not in (base, slow_steps, fast_steps)
    assert fast_steps < base < slow_steps  # slower steps hide a local prefill's stall better


def test_switch_point_follows_output_length() -> None:
    policy = RatioPolicy(COST, *TARGETS)
    assert switch_point(policy, 100) < switch_point(policy, 500) < switch_point(policy, 2000)


def test_ratio_estimates_follow_the_documented_formula() -> None:
    state = pools([PrefillLoad("p", 3000)], [dec(5, queued_prefill_tokens=64)])
    n, out = 1000, 50
    step = COST.step_s(6)
    pl = make_policy("always_remote", COST).place(req(n, out), state)
    assert pl.est_ttft_s == pytest.approx(3000 * COST.prefill.per_unit_s + COST.prefill_s(n)
                                          + COST.exposed_transfer_s(n) + COST.hop_s + step / 2)
    assert pl.est_tpot_s == pytest.approx(step)
    pl = make_policy("always_local", COST).place(req(n, out), state)
    sizes = [256, 256, 256, 232]  # each chunk's step also decodes the 5 running sequences
    assert COST.chunks(n) == sizes
    assert pl.est_ttft_s == pytest.approx(COST.local_prefill_s(64) + COST.local_prefill_s(n)
                                          + 4 * COST.step_s(5) * 0.5 + step / 2)
    stall = COST.local_prefill_s(n) - 4 * COST.step_s(5) * 0.5
    assert pl.est_tpot_s == pytest.approx(step * (1 + 6 * stall / (out * step)))


def test_chunks_cost_a_local_prefill_what_they_add_beyond_the_running_batch_s_own_steps() -> None:
    whole, chunked = measured_cost(chunk=None, ride=1.0), measured_cost(chunk=8, ride=0.2)
    n, step = 1000, COST.step_s(4)
    assert whole.chunks(n) == [1000] and chunked.chunks(n) == [8] * 125 and chunked.chunks(3) == [3]
    assert chunked.chunks(17) == [8, 8, 1]
    # nothing shared: the whole prefill stalls the batch, and the batch's step adds to the first token's wait
    assert whole.local_stall_s(n, 4) == whole.local_prefill_s(n)
    assert whole.local_prefill_wall_s(n, 4) == pytest.approx(whole.local_prefill_s(n) + step)
    assert chunked.local_stall_s(n, 4) == pytest.approx(max(0.0, chunked.local_prefill_s(n) - 125 * step * 0.8))
    assert chunked.local_stall_s(n, 4) < whole.local_stall_s(n, 4)
    assert chunked.local_stall_s(8, 4) == 0.0  # a small chunk hides in the decode step it stands in for
    assert chunked.local_prefill_wall_s(n, 4) == pytest.approx(chunked.local_prefill_s(n) + 125 * step * 0.2)
    assert chunked.local_prefill_wall_s(n, 0) == chunked.local_prefill_s(n)
    # layer-by-layer shipping hides the transfer behind the last chunk only
    t = chunked.transfer_s(n)
    assert chunked.exposed_transfer_s(n) == pytest.approx(max(t / 30, t - chunked.prefill_s(8) * 29 / 30))
    assert chunked.exposed_transfer_s(n) > whole.exposed_transfer_s(n)
    # a prompt alone on its prefill worker goes whole: its transfer hides behind all of its prefill
    assert chunked.exposed_transfer_s(n, whole=True) == pytest.approx(whole.exposed_transfer_s(n))


def test_a_remote_prompt_alone_on_its_prefill_worker_hides_its_transfer_behind_the_whole_prefill() -> None:
    slow = measured_cost(bandwidth=10e6)  # a transfer longer than one chunk's prefill
    n = 1000
    idle, queued = (make_policy("always_remote", slow).place(req(n, 16), pools([p], [dec()]))
                    for p in (PrefillLoad("p", 0), PrefillLoad("p", 100)))
    rest = slow.prefill_s(n) + slow.hop_s + slow.step_s(1) / 2
    assert idle.est_ttft_s == pytest.approx(rest + slow.exposed_transfer_s(n, whole=True))
    assert queued.est_ttft_s == pytest.approx(rest + 100 * slow.prefill.per_unit_s + slow.exposed_transfer_s(n))
    assert slow.exposed_transfer_s(n, whole=True) < slow.exposed_transfer_s(n)


def test_a_prompt_prefilled_on_borrowed_threads_pays_its_whole_transfer_after_the_prefill() -> None:
    """The prefill worker holds a step's layers while it computes with a decode worker's threads
    (`PrefillWorker._after_layer`): nothing of the transfer hides behind the prefill then."""
    slow = measured_cost(bandwidth=10e6)
    n = 1000
    assert slow.exposed_transfer_s(n, whole=True, held=True) == slow.exposed_transfer_s(n, held=True) == \
        pytest.approx(slow.transfer_s(n))
    assert slow.exposed_transfer_s(n, whole=True) < slow.transfer_s(n)
    own, borrowing = (make_policy("always_remote", slow).place(req(n, 16), pools([p], [dec()]))
                      for p in (PrefillLoad("p", 0), PrefillLoad("p", 0, loan=Loan(0, 1.6, 1.6, 2.0, to_decode=False))))
    rest = slow.hop_s + slow.step_s(1) / 2
    assert own.est_ttft_s == pytest.approx(rest + slow.prefill_s(n) + slow.exposed_transfer_s(n, whole=True))
    assert borrowing.est_ttft_s == pytest.approx(rest + slow.prefill_s(n) / 1.6 + slow.transfer_s(n))


def test_a_cost_model_written_before_chunking_reads_as_whole_prompts() -> None:
    d = measured_cost().to_dict()
    assert CostModel.from_dict(d) == measured_cost()
    for name in ("prefill_chunk_tokens", "decode_ride", "decode_context", "decode_context_s", "decode_beside_prefill",
                 "prefill_beside_decode", "prefill_context_s"):
        del d[name]
    old = CostModel.from_dict(d)
    assert old.prefill_chunk_tokens is None and old.decode_ride == 1.0
    assert old.prefill_context_s == 0.0 and old.prefill_s(100, cached=5000) == old.prefill_s(100)
    assert old.decode_context_s == 0.0 and old.decode_s(4, 4 * 2000) == old.step_s(4)  # context costs nothing
    assert old.decode_beside_prefill == old.prefill_beside_decode == 1.0  # and workers never slow each other


def test_a_saved_cost_model_serves_workers_of_its_model_and_dtype_at_their_chunk_size() -> None:
    """`pdserve serve --cost-model`: the measured figures carry over; the chunk size is the workers' setting."""
    assert COST.for_workers(KV_BYTES, 30, 512, True) == replace(COST, prefill_chunk_tokens=512)
    assert COST.for_workers(KV_BYTES, 30, None, True).prefill_chunk_tokens is None
    with pytest.raises(ValueError, match=r"cost_model: .*kv_bytes_per_token 23040; these workers' 11520"):
        COST.for_workers(KV_BYTES // 2, 30, 256, True)  # bf16 workers, an fp32 measurement
    with pytest.raises(ValueError, match="num_layers 30; these workers' 24"):
        COST.for_workers(KV_BYTES, 24, 256, True)
    alone = replace(COST, transfer=LinearFit(0.0, 0.0))  # as calibrated without prefill workers
    assert alone.for_workers(KV_BYTES, 30, 256, False) == alone
    with pytest.raises(ValueError, match="cost_model: measured without prefill workers"):
        alone.for_workers(KV_BYTES, 30, 256, True)


def test_a_decode_step_pays_for_the_context_its_sequences_hold_beyond_the_calibrated_one() -> None:
    cost = replace(measured_cost(), decode_context=64, decode_context_s=2e-6)
    assert CostModel.from_dict(cost.to_dict()) == cost
    assert cost.decode_s(4, 4 * 64) == cost.step_s(4)
    assert cost.decode_s(4, 4 * 1064) == pytest.approx(cost.step_s(4) + 4 * 1000 * 2e-6)
    assert cost.decode_s(4, 10) == cost.step_s(4)  # shorter contexts than calibrated: never cheaper
    for bad in ({"decode_context": 0}, {"decode_context_s": -1.0}, {"decode_context_s": float("nan")},
                {"decode_beside_prefill": 0.9}, {"prefill_beside_decode": float("inf")}):
        with pytest.raises(ValueError, match=next(iter(bad))):
            replace(cost, **bad)


# --- load, room, health ---

def test_loaded_prefill_worker_is_avoided() -> None:
    state = pools([PrefillLoad("busy", 20_000), PrefillLoad("idle", 100)])
    for name in ("ratio", "always_remote"):
        pl = make_policy(name, COST, *TARGETS).place(req(2000, 20), state)
        assert (pl.path, pl.prefill) == ("remote", 1), name


def test_loaded_decode_worker_is_avoided() -> None:
    state = pools(decode=[dec(30, wid="busy"), dec(1, wid="light")])
    for name in ("ratio", "always_remote", "always_local"):
        for r in (req(2000, 20), req(20, 500)):
            assert make_policy(name, COST, *TARGETS).place(r, state).decode == 1, (name, r)
    # same batch: the one with more free blocks
    state = pools(decode=[dec(2, free=200), dec(2, free=5000)])
    assert RatioPolicy(COST, *TARGETS).place(req(2000, 20), state).decode == 1


def test_decode_worker_without_room_is_never_chosen() -> None:
    # prompt 1000 + max_tokens 600 = 1600 tokens = 100 blocks of 16; worker 0 is idle but has 99
    state = pools(decode=[dec(0, free=99), dec(25, free=100)])
    for name in POLICIES:
        policy = make_policy(name, COST, *TARGETS)
        for _ in range(3):
            assert policy.place(req(1000, 20, max_tokens=600), state).decode == 1, name


@pytest.mark.parametrize("name", POLICIES)
def test_all_full_raises_no_capacity(name: str) -> None:
    state = pools(decode=[dec(0, free=10), dec(0, free=99)])
    with pytest.raises(NoCapacity, match="max_tokens 600"):
        make_policy(name, COST, *TARGETS).place(req(1000, 20, max_tokens=600), state)
    with pytest.raises(NoCapacity):
        make_policy(name, COST, *TARGETS).place(req(20, 20), pools(decode=[]))


@pytest.mark.parametrize("name", POLICIES)
def test_unhealthy_workers_are_skipped(name: str) -> None:
    state = pools([PrefillLoad("down", 0, healthy=False), PrefillLoad("up", 50_000)],
                  [dec(0, wid="down", healthy=False), dec(20, wid="up")])
    policy = make_policy(name, COST, *TARGETS)
    for r in (req(2000, 20), req(20, 500), req(300, 100)):
        pl = policy.place(r, state)
        assert pl.decode == 1 and pl.prefill in (None, 1), (name, pl)
    with pytest.raises(NoCapacity):
        policy.place(req(20, 20), pools(decode=[dec(0, healthy=False)]))


@pytest.mark.parametrize("prefill", [[], [PrefillLoad("p", 0, healthy=False)]])
def test_no_prefill_worker_falls_back_to_local(prefill: list[PrefillLoad]) -> None:
    state = pools(prefill, [dec()])
    for name in ("always_remote", "ratio"):
        pl = make_policy(name, COST, *TARGETS).place(req(2000, 20), state)
        assert (pl.path, pl.prefill, pl.reason) == ("local", None, "no_prefill_worker"), name


def test_round_robin_alternates_paths_and_rotates_workers() -> None:
    state = pools([PrefillLoad("p0", 0), PrefillLoad("p1", 0)], [dec(wid="d0"), dec(wid="d1"), dec(wid="d2")])
    policy = RoundRobinPolicy(COST)
    got = [policy.place(req(100, 100), state) for _ in range(6)]
    assert [p.path for p in got] == ["remote", "local"] * 3
    assert [p.decode for p in got] == [0, 1, 2, 0, 1, 2]
    assert [p.prefill for p in got if p.path == "remote"] == [0, 1, 0]
    assert {p.reason for p in got} == {"round_robin"}
    assert all(p.est_ttft_s > 0 and p.est_tpot_s > 0 for p in got)


def test_make_policy() -> None:
    assert POLICIES == ("ratio", "always_remote", "always_local", "round_robin")
    kinds = (RatioPolicy, AlwaysRemotePolicy, AlwaysLocalPolicy, RoundRobinPolicy)
    for name, kind in zip(POLICIES, kinds, strict=True):
        policy = make_policy(name, COST, *TARGETS)
        assert isinstance(policy, kind) and policy.name == name
    ratio = make_policy("ratio", COST, ttft_target_s=0.5, tpot_target_s=0.1)
    assert (ratio.ttft_target_s, ratio.tpot_target_s) == (0.5, 0.1)
    with pytest.raises(ValueError) as err:
        make_policy("fastest", COST)
    assert "fastest" in str(err.value) and all(n in str(err.value) for n in POLICIES)
    with pytest.raises(ValueError, match="ttft_target_s"):
        RatioPolicy(COST, ttft_target_s=0, tpot_target_s=TARGETS[1])
    with pytest.raises(ValueError, match="needs its TTFT and TPOT targets"):
        make_policy("ratio", COST)


def test_invalid_inputs_name_the_field() -> None:
    for args, field in (((0, 1, 1), "prompt_tokens"), ((1, 5, 4), "expected_output_tokens"), ((1, 1, 0), "max_tokens")):
        with pytest.raises(ValueError, match=field):
            RequestFeatures(*args)
    with pytest.raises(ValueError, match="block_size"):
        DecodeLoad("d", 0, 10, 0)
    with pytest.raises(ValueError, match="queued_tokens"):
        PrefillLoad("p", -1)
    with pytest.raises(ValueError, match="path"):
        Placement("both", None, 0, "x", 0.0, 0.0)
    with pytest.raises(ValueError, match="prefill"):
        Placement("remote", None, 0, "x", 0.0, 0.0)
    with pytest.raises(ValueError, match="decode_step"):
        CostModel(COST.prefill, COST.prefill, ((8, 0.06), (1, 0.05)), COST.transfer, KV_BYTES, 30, 0.01)
    with pytest.raises(ValueError, match="num_layers"):
        CostModel(COST.prefill, COST.prefill, ((1, 0.05),), COST.transfer, KV_BYTES, 0, 0.01)
    with pytest.raises(ValueError, match="per_unit_s"):
        LinearFit(0.0, -1.0)


# --- cost model ---

def test_linear_fit_recovers_a_known_line() -> None:
    fit = LinearFit.fit([10, 100, 1000, 5000], [0.005 + 0.0025 * x for x in (10, 100, 1000, 5000)])
    assert fit.fixed_s == pytest.approx(0.005) and fit.per_unit_s == pytest.approx(0.0025)
    assert fit(400) == pytest.approx(1.005)
    assert COST.transfer.per_unit_s == pytest.approx(1 / 200e6) and COST.transfer.fixed_s == pytest.approx(0.002)


def test_linear_fit_clamps_and_handles_one_point() -> None:
    assert LinearFit.fit([100], [0.5]) == LinearFit(0.0, 0.005)
    through_origin = LinearFit.fit([1, 2, 3], [0.0, 0.5, 1.0])  # unconstrained intercept would be -0.5
    assert through_origin.fixed_s == 0 and through_origin.per_unit_s > 0
    flat = LinearFit.fit([1, 2, 3], [0.3, 0.2, 0.1])  # unconstrained slope would be negative
    assert flat.fixed_s == pytest.approx(0.2) and flat.per_unit_s == 0
    with pytest.raises(ValueError, match="same length"):
        LinearFit.fit([1, 2], [1.0])
    with pytest.raises(ValueError, match="at least one"):
        LinearFit.fit([], [])


def test_step_s_interpolates_and_extrapolates() -> None:
    assert COST.step_s(1) == pytest.approx(0.05)
    assert COST.step_s(8) == pytest.approx(0.06)
    assert COST.step_s(20) == pytest.approx(0.075)  # halfway between 8 and 32
    assert COST.step_s(56) == pytest.approx(0.12)  # last slope 0.03 / 24 per sequence
    below = CostModel(COST.prefill, COST.prefill, ((4, 0.05), (8, 0.06)), COST.transfer, KV_BYTES, 30, 0.0)
    assert below.step_s(1) == pytest.approx(0.05)
    one = CostModel(COST.prefill, COST.prefill, ((1, 0.05),), COST.transfer, KV_BYTES, 30, 0.0)
    assert one.step_s(1) == one.step_s(64) == pytest.approx(0.05)


@pytest.mark.parametrize("bandwidth", [200e6, 10e6, 1e6])
def test_exposed_transfer_is_between_one_layer_and_all(bandwidth: float) -> None:
    cost = measured_cost(bandwidth=bandwidth)
    for n in (1, 20, 500, 4000):
        full = cost.transfer_s(n)
        assert full == pytest.approx(0.002 + n * KV_BYTES / bandwidth)
        assert full / 30 - 1e-12 <= cost.exposed_transfer_s(n) <= full
    # fast link: hidden behind the prefill but for the last layer; very slow link: mostly exposed
    assert measured_cost(bandwidth=200e6).exposed_transfer_s(2000) == pytest.approx(COST.transfer_s(2000) / 30)
    slow = measured_cost(bandwidth=1e6)
    assert slow.exposed_transfer_s(2000) > 0.5 * slow.transfer_s(2000)


def test_cost_model_json_round_trip() -> None:
    back = CostModel.from_dict(json.loads(json.dumps(COST.to_dict())))
    assert back == COST and isinstance(back.decode_step, tuple)
    d = COST.to_dict()
    del d["hop_s"]
    with pytest.raises(ValueError, match="hop_s"):
        CostModel.from_dict(d)


# --- output length ---

def test_output_length_estimator() -> None:
    est = OutputLengthEstimator(min_samples=8, alpha=0.1)
    assert est.expected(512, ignore_eos=False) == 512  # nothing observed yet
    for _ in range(7):
        est.observe(40, 512, "stop")
    assert est.expected(512, ignore_eos=False) == 512  # fewer than min_samples
    est.observe(40, 512, "stop")
    assert est.expected(512, ignore_eos=False) == 60  # 1.5 x the stop EMA
    assert est.expected(30, ignore_eos=False) == 30  # never above max_tokens
    assert est.expected(512, ignore_eos=True) == 512
    est.observe(3, 512, "abort")  # says nothing about lengths
    assert est.samples == 8
    for _ in range(3):
        est.observe(512, 512, "length")
    assert est.expected(512, ignore_eos=False) == 60  # a minority hit max_tokens
    for _ in range(10):
        est.observe(512, 512, "length")
    assert est.expected(512, ignore_eos=False) == 512  # most recent ones hit max_tokens


def test_output_length_estimator_tracks_recent_lengths() -> None:
    est = OutputLengthEstimator(min_samples=1, alpha=0.5)
    est.observe(100, 1000, "stop")
    assert est.expected(1000, ignore_eos=False) == 150
    est.observe(20, 1000, "stop")
    assert est.expected(1000, ignore_eos=False) == 90  # EMA 60
    est.observe(0, 1000, "stop")
    est.observe(0, 1000, "stop")
    assert est.expected(1000, ignore_eos=False) >= 1
    with pytest.raises(ValueError, match="alpha"):
        OutputLengthEstimator(alpha=0)
    with pytest.raises(ValueError, match="min_samples"):
        OutputLengthEstimator(min_samples=0)


# --- online correction ---

def test_correction_learns_a_steady_bias_and_stays_bounded() -> None:
    c = Correction(rate=0.2, limit=4.0)
    for _ in range(60):  # the true TTFT of the remote path is 3x the calibrated estimate
        predicted = 1.0 * c.factor("ttft", "remote")
        assert c.observe("ttft", "remote", 3.0, predicted) == pytest.approx(3.0 / predicted)
    assert c.factor("ttft", "remote") == pytest.approx(3.0, rel=0.02)
    assert c.factor("ttft", "local") == c.factor("tpot", "remote") == 1.0  # the others are untouched
    for _ in range(200):
        c.observe("tpot", "local", 100.0, c.factor("tpot", "local"))
    assert c.factor("tpot", "local") == 4.0  # bounded
    assert c.observe("ttft", "local", 0.0, 1.0) is None and c.observe("ttft", "local", 1.0, 0.0) is None


def test_a_corrected_estimate_moves_the_decision() -> None:
    """Serving shows the local path's first tokens to come 3x later than calibrated: a request on the
    switch point goes remote once the policy has learnt it."""
    policy = make_policy("ratio", COST, *TARGETS, correction=Correction())
    n = switch_point(policy, 200)
    assert n is not None and n > 1
    before = policy.place(req(n - 1, 200), pools())
    assert before.path == "local"
    for _ in range(100):
        policy.correction.observe("ttft", "local", 3 * before.est_ttft_s, before.est_ttft_s * policy.correction.factor(
            "ttft", "local"))
    after = policy.place(req(n - 1, 200), pools())
    assert after.path == "remote"
    fixed = make_policy("always_local", COST, correction=policy.correction).place(req(n - 1, 200), pools())
    # every policy reports corrected estimates
    assert fixed.est_ttft_s == pytest.approx(3 * before.est_ttft_s, rel=0.05)


# --- a prefill worker flipped to decode (a flex slot: local path only) ---

@pytest.mark.parametrize("name", POLICIES)
def test_a_flipped_prefill_worker_is_never_sent_kv(name: str) -> None:
    """Its flex slot is the least loaded decode worker, yet nothing is placed on it remotely."""
    state = pools([PrefillLoad("p", 0)], [dec(30, wid="d"), dec(0, wid="p", local_only=True)])
    policy = make_policy(name, COST, *TARGETS)
    for r in (req(2000, 20), req(20, 500), req(300, 100), req(1500, 16)):
        pl = policy.place(r, state)
        assert pl.path == "local" or pl.decode == 0, (name, pl)


def test_a_flipped_prefill_worker_takes_decode_heavy_requests() -> None:
    """Short prompts with long outputs go local on the idle flex slot rather than into a busy batch."""
    state = pools([PrefillLoad("p", 0)], [dec(30, wid="d"), dec(0, wid="p", local_only=True)])
    pl = RatioPolicy(COST, *TARGETS).place(req(20, 500), state)
    assert (pl.path, pl.decode) == ("local", 1)


def test_a_prefill_worker_that_decodes_prices_its_prompts_in_chunks_beside_its_batch() -> None:
    remote = make_policy("always_remote", COST)
    idle = remote.place(req(2000, 20), pools([PrefillLoad("p", 0)], [dec(0)]))
    riding = remote.place(req(2000, 20), pools([PrefillLoad("p", 0, decoding=16)], [dec(0)]))
    assert riding.est_ttft_s - idle.est_ttft_s == pytest.approx(  # its 16 decode rows ride in each chunk's step
        COST.local_prefill_wall_s(2000, 16) - COST.prefill_s(2000), rel=1e-6)
    ratio = RatioPolicy(COST, *TARGETS)
    assert ratio.place(req(2000, 20), pools([PrefillLoad("p", 0)], [dec(0)])).path == "remote"
    # the same prompt would stall P's 16 streams for its whole prefill: the idle decode worker takes it
    assert ratio.place(req(2000, 20), pools([PrefillLoad("p", 0, decoding=16)], [dec(0)])).path == "local"


def test_crowding_steers_decode_heavy_requests_to_the_emptier_batch() -> None:
    """Local prefill only: worker a decodes 12 streams, b none but has 200 prompt tokens queued. b's
    first token comes later, yet a 13th stream on a would slow all 12 for its whole output: b wins."""
    policy = RatioPolicy(COST, *TARGETS)
    state = pools([], [dec(12, wid="a"), dec(0, wid="b", queued_prefill_tokens=200)])
    pl = policy.place(req(30, 200), state)
    assert pl.decode == 1 and pl.est_ttft_s > policy.place(req(30, 200), pools([], [dec(12)])).est_ttft_s
    # a longer backlog on b outweighs it: then a's batch takes it
    assert policy.place(req(30, 200), pools([], [dec(12, wid="a"), dec(0, wid="b", queued_prefill_tokens=300)])
                        ).decode == 0


def test_requests_waiting_for_their_kv_are_not_stalled_by_a_local_prefill() -> None:
    """A burst of long prompts: P holds a queue of them and D's batch is only those requests, waiting for
    their KV. A local prefill holds none of them up, so D prefills the next prompt itself; once they
    decode, the same prompt would stall them all and goes to P."""
    policy = RatioPolicy(COST, *TARGETS)
    queued = [PrefillLoad("p", 4 * 2000)]
    assert policy.place(req(2000, 20), pools(queued, [dec(4, awaiting_kv=4)])).path == "local"
    assert policy.place(req(2000, 20), pools(queued, [dec(4)])).path == "remote"
    with pytest.raises(ValueError, match="awaiting_kv"):
        dec(2, awaiting_kv=3)


def test_a_burst_of_long_prompts_shares_the_prefill_between_the_pools() -> None:
    """16 long prompts with short answers at once on 1 prefill + 1 decode worker, booked as the router
    books them: the decode worker prefills a share of them (each local one then stalls the ones
    before it as they decode, so fewer than half), instead of leaving all 16 queued on P."""
    policy = RatioPolicy(COST, *TARGETS)
    book = PoolBook([PrefillSlot("p")], [DecodeSlot("d", 10_000, 16, 64)])
    bookings = []
    for _ in range(16):
        pl = policy.place(req(1024, 16), book.state())
        bookings.append(book.admit(pl, 1024, 16))
    paths = [b.placement.path for b in bookings]
    assert 3 <= paths.count("local") <= 8, paths
    assert book.state().decode[0].awaiting_kv == paths.count("remote")
    for b in bookings:  # a first token, twice (idempotent), then the end: every count back to zero
        book.prefilled(b)
        book.prefilled(b)
    assert book.decode[0].awaiting_kv == 0 and book.decode[0].running == 16
    for b in bookings:
        book.finished(b)
    assert (book.decode[0].running, book.decode[0].queued_prefill_tokens, book.prefill[0].queued_tokens) == (0, 0, 0)


# --- lent threads: the borrower computes faster; a prompt sent to the lender costs the borrower's batch ---

def lent(queued: int = 0, speedup: float = 1.75, relend_s: float = 2.0, prefill_speedup: float | None = None
         ) -> PrefillLoad:
    return PrefillLoad("p", queued, loan=Loan(0, speedup, speedup if prefill_speedup is None else prefill_speedup,
                                              relend_s))


def test_a_loan_speeds_the_borrower_s_local_estimates_by_its_measured_speedup() -> None:
    n, out, running = 600, 100, 6
    own = make_policy("always_local", COST).place(req(n, out), pools(decode=[dec(running)]))
    loaned = make_policy("always_local", COST).place(req(n, out), pools([lent()], [dec(running)]))
    assert loaned.est_ttft_s == pytest.approx(own.est_ttft_s / 1.75)
    assert loaned.est_tpot_s == pytest.approx(own.est_tpot_s / 1.75)  # the stall shrinks with the steps


def test_a_loan_speeds_the_borrower_s_prefill_and_its_decode_steps_each_by_its_own_factor() -> None:
    """A prefill gains more from a lent core than a decode step: the local path's prompt (and the stall
    its chunks put on the batch) is priced at the prefill speedup, its steps at the decode speedup."""
    n, out, running, dsp, psp = 600, 100, 6, 1.2, 1.9
    loaned = _local(COST, req(n, out), pools([lent(speedup=dsp, prefill_speedup=psp)], [dec(running)]), 0)
    step = COST.step_s(running + 1) / dsp
    assert loaned.ttft_s == pytest.approx(COST.local_prefill_wall_s(n, running) / psp + step / 2)
    assert loaned.tpot_s == pytest.approx(step + (running + 1) * COST.local_stall_s(n, running) / psp / out)
    # a prompt sent to the lender costs the borrower's batch what its decode steps lose, not its prefills
    remote = _remote_option(req(n, out), pools([lent(speedup=dsp, prefill_speedup=psp)], [dec(running)]))
    lost = (COST.prefill_s(n) + 2.0) * (1 - 1 / dsp)
    assert remote.slowdown == pytest.approx(1 + running * lost / (out * COST.step_s(running + 1)))


def test_a_prompt_sent_to_a_lender_prices_the_loan_its_borrower_s_batch_loses() -> None:
    """Decode-heavy: short prompts, a batch of 10 decoding on the borrower. With the prefill worker's
    threads lent, a prompt that went remote (a busy batch makes local dearer, see above) stays local:
    sending it away would cost the batch the loan for the prefill and until it is lent again. A long
    prompt still goes remote, and the longer the loan takes to come back the dearer remote gets."""
    policy = RatioPolicy(COST, *TARGETS)
    assert policy.place(req(128, 128), pools(decode=[dec(10)])).path == "remote"
    assert policy.place(req(128, 128), pools([lent()], [dec(10)])).path == "local"
    assert policy.place(req(3000, 16), pools([lent()], [dec(10)])).path == "remote"
    remote = make_policy("always_remote", COST)
    quick, slow = (remote.place(req(128, 128), pools([lent(relend_s=r)], [dec(10)])) for r in (0.5, 5.0))
    assert quick.path == slow.path == "remote" and quick.est_ttft_s == pytest.approx(slow.est_ttft_s)
    priced = [policy._priced(_remote_option(req(128, 128), pools([lent(relend_s=r)], [dec(10)]))).cost
              for r in (0.5, 5.0)]
    assert priced[0] < priced[1]
    # nothing is lost where the borrower's batch only waits for its KV
    waiting = pools([lent()], [dec(10, awaiting_kv=10)])
    assert _remote_option(req(128, 128), waiting).slowdown == pytest.approx(1.0)


def _remote_option(request: RequestFeatures, state: PoolState):
    return _remote(COST, request, state, 0, 0)


def test_loans_are_checked() -> None:
    with pytest.raises(ValueError, match="decode_speedup"):
        Loan(0, 0.9, 1.5, 1.0)
    with pytest.raises(ValueError, match="prefill_speedup"):
        Loan(0, 1.5, float("nan"), 1.0)
    with pytest.raises(ValueError, match="relend_s"):
        Loan(0, 1.5, 1.5, -1.0)
    with pytest.raises(ValueError, match="decode index 3"):
        PoolState((PrefillLoad("p", 0, loan=Loan(3, 1.5, 1.5, 1.0)),), (dec(),))
    assert pools([lent()], [dec(), dec(wid="e")]).lent_to(0).decode_speedup == 1.75
    assert pools([lent()], [dec(), dec(wid="e")]).lent_to(1) is None


def test_a_prefill_worker_with_the_decode_worker_s_threads_prefills_faster_and_local_prefill_takes_them_back(
        ) -> None:
    """Prompt-heavy, the decode worker idle and its threads lent to the prefill worker: remote prefill
    (and P's queue) is that much faster; a local prefill on D would take the threads back and delay
    every prompt queued on P, which is priced."""
    borrowing = PrefillLoad("p", 2000, loan=Loan(0, 1.2, 1.6, 2.0, to_decode=False))  # prefills 1.6x as fast
    own, fast = (make_policy("always_remote", COST).place(req(1024, 16), pools([p], [dec()]))
                 for p in (PrefillLoad("p", 2000), borrowing))
    rest = COST.hop_s + COST.step_s(1) / 2  # and the transfer: all of it after a prefill on borrowed threads
    assert fast.est_ttft_s - rest - COST.transfer_s(1024) == pytest.approx(
        (own.est_ttft_s - rest - COST.exposed_transfer_s(1024)) / 1.6)
    state = pools([borrowing], [dec()])
    assert state.lending(0) == 0 and state.lent_to(0) is None  # D computes with its own threads
    assert _local(COST, req(1024, 16), state, 0).delay_s == pytest.approx(
        2000 * COST.prefill.per_unit_s * (1 - 1 / 1.6))
    assert _local(COST, req(1024, 16), pools([PrefillLoad("p", 2000)], [dec()]), 0).delay_s == 0.0
    assert RatioPolicy(COST, *TARGETS).place(req(1024, 16), state).path == "remote"


def test_a_local_prompt_waiting_for_kv_on_its_way_to_d_takes_no_lent_threads_back() -> None:
    """The n choices of one prompt: the first's KV is on its way to D (arriving) while P prefills it with
    D's threads. A local choice there waits for that KV and computes only the rest, and it takes no
    threads back: no delay is charged to P's queue, and the ratio policy keeps it on D (remote, it would
    wait for P's whole queue; local, for the prefix only)."""
    borrowing = PrefillLoad("p", 2000, loan=Loan(0, 1.6, 1.6, 2.0, to_decode=False), cached_tokens=1008)
    arriving, held = dec(cached_tokens=1008, arriving_tokens=1008), dec(cached_tokens=1008)
    assert _local(COST, req(1024, 16), pools([borrowing], [arriving]), 0).delay_s == 0.0
    assert _local(COST, req(1024, 16), pools([borrowing], [held]), 0).delay_s > 0
    assert RatioPolicy(COST, *TARGETS).place(req(1024, 16), pools([borrowing], [arriving])).path == "local"


def test_a_local_prompt_waiting_for_kv_on_its_way_to_d_waits_for_it_to_be_computed_first() -> None:
    """Its prefix (1008 tokens) is on its way to D from a prefill worker: the local estimate waits while that
    worker computes those tokens (at the borrowed threads' speed), at most its whole queue (it computes its
    prompts side by side), before its own prefill. With the prefix held, or P's queue empty (the KV is on the
    wire), there is no such wait."""
    speedup = 1.6
    loan = Loan(0, 1.2, speedup, 2.0, to_decode=False)
    arriving, held = dec(cached_tokens=1008, arriving_tokens=1008), dec(cached_tokens=1008)
    assert arriving.arriving and not held.arriving

    def ttft(prefill: list[PrefillLoad], d: DecodeLoad) -> float:
        return _local(COST, req(1024, 16), pools(prefill, [d]), 0).ttft_s
    at_once = ttft([PrefillLoad("p", 2000, loan=loan)], held)
    assert ttft([PrefillLoad("p", 2000, loan=loan)], arriving) - at_once == pytest.approx(
        1008 * COST.prefill.per_unit_s / speedup)  # a queue longer than the prefix: the prefix
    assert ttft([PrefillLoad("p", 600, loan=loan)], arriving) - at_once == pytest.approx(
        600 * COST.prefill.per_unit_s / speedup)  # a shorter one: what is left of it
    assert ttft([PrefillLoad("p", 0)], arriving) == pytest.approx(ttft([PrefillLoad("p", 0)], held))
    # two prefill workers: the longer queue stands for the one bringing it; an unhealthy one counts not
    two = [PrefillLoad("p", 500), PrefillLoad("q", 3000, healthy=False)]
    assert ttft(two, arriving) - ttft(two, held) == pytest.approx(500 * COST.prefill.per_unit_s)


def test_prompt_tokens_computed_over_a_cached_prefix_pay_for_attending_over_it() -> None:
    """A later turn computes its new tokens over the history its worker's cache holds: each computed token
    pays `prefill_context_s` per cached token, on either path, in the estimate and in the stall it puts
    on D's running batch; a prompt with nothing cached costs what it did."""
    per = 1e-6
    cost = replace(measured_cost(), prefill_context_s=per)
    assert CostModel.from_dict(cost.to_dict()) == cost
    assert cost.prefill_s(136, cached=1200) == pytest.approx(cost.prefill_s(136) + 136 * 1200 * per)
    assert cost.local_prefill_s(136, cached=1200) == pytest.approx(cost.local_prefill_s(136) + 136 * 1200 * per)
    with pytest.raises(ValueError, match="prefill_context_s"):
        replace(cost, prefill_context_s=-1e-9)
    request = req(1336, 64)

    def option(c: CostModel, pool: str) -> object:
        state = pools([PrefillLoad("p", 0, cached_tokens=1200 if pool == "remote" else 0)],
                      [dec(running=4, cached_tokens=1200 if pool == "local" else 0)])
        return _local(c, request, state, 0) if pool == "local" else _remote(c, request, state, 0, 0)
    for pool in ("local", "remote"):
        with_context, without = option(cost, pool), option(measured_cost(), pool)
        assert with_context.computed == without.computed == 136
        assert with_context.ttft_s - without.ttft_s == pytest.approx(136 * 1200 * per)
        if pool == "local":
            assert with_context.slowdown > without.slowdown  # its chunks hold D's batch up longer
    nothing = pools([PrefillLoad("p", 0)], [dec(running=4)])
    assert _local(cost, request, nothing, 0).ttft_s == _local(measured_cost(), request, nothing, 0).ttft_s
