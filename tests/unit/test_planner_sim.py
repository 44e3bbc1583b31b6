"""The planner's simulator against schedules computed by hand, on a tiny made-up cost model: one request
(each path), two overlapping, KV exhaustion (waiting at the router), a chunked prefill, preemption; and
that it runs the router's own Policy on the router's own PoolBook state. Pure: no Ray, no torch."""
from __future__ import annotations

import subprocess
import sys
from dataclasses import replace

import pytest

from planner.profiles import AS_CALIBRATED, ServingFactors
from planner.sim import Layout, Simulator, WorkerSpec, prompt_ids, simulate
from planner.traces import Trace, TraceRequest
from router.book import PoolBook
from router.config import RouterConfig
from router.cost_model import CostModel, LinearFit
from router.policy import AlwaysRemotePolicy, Placement, Policy, PoolState, RequestFeatures

# prefill on P: 10 ms + 1 ms/token; on D: 20 ms + 2 ms/token; decode step 10 ms at batch 1, 12 ms at 2,
# 16 ms at 4; the KV of a token moves in 0.1 ms (100 bytes at 1 MB/s), over 2 layers; hops 5 ms; a
# decode batch adds half its step to a prompt chunk's step.
COST = CostModel(prefill=LinearFit(0.01, 0.001), local_prefill=LinearFit(0.02, 0.002),
                 decode_step=((1, 0.01), (2, 0.012), (4, 0.016)), transfer=LinearFit(0.0, 1e-6),
                 kv_bytes_per_token=100, num_layers=2, hop_s=0.005, prefill_chunk_tokens=256, decode_ride=0.5)
WORKER = WorkerSpec(num_blocks=1000, block_size=16, prefill_chunk_tokens=256)


def trace(*requests: tuple[float, int, int]) -> Trace:
    return Trace(tuple(TraceRequest(at, p, o) for at, p, o in requests), "test")


def run(tr: Trace, layout: Layout, policy: str, worker: WorkerSpec = WORKER, **kw):
    return simulate(tr, COST, layout, worker, RouterConfig(policy=policy), **kw)


def test_one_remote_request_matches_the_hand_schedule():
    out = run(trace((0.0, 100, 3)), Layout(1, 1), "always_remote").outcomes[0]
    # P prefills 100 tokens alone: 0.01 + 0.1 = 0.11 s. The transfer (100 tokens: 0.01 s) hides behind
    # the later of the 2 layers of that one chunk but for max(0.01 / 2, 0.01 - 0.11 / 2) = 0.005 s; then
    # the hops (0.005 s): D starts it at 0.12 s; two decode steps at batch 1 follow.
    assert out.path == "remote" and out.error is None and out.queue_s == 0.0
    assert out.ttft_s == pytest.approx(0.12)
    assert out.e2e_s == pytest.approx(0.14)
    assert out.tpot_s == pytest.approx(0.01)
    assert out.output_tokens == 3


def test_a_remote_prompt_is_reserved_between_its_decode_workers_steps():
    """D reserves a remote prompt's blocks on its engine thread, between steps: the prompt placed while
    D decodes reaches P when D's step under way ends."""
    a, b = run(trace((0.0, 100, 20), (0.2001, 50, 3)), Layout(1, 1), "always_remote").outcomes
    # a decodes from 0.12 s in 10 ms steps: b, placed at 0.2001, is reserved at 0.21; P prefills it
    # alone in 0.06 s; its KV lands 0.0025 + 0.005 s later (0.2775), during D's step [0.27, 0.28]:
    # D starts it at 0.28. (Reserved at once, it would land at 0.2676 and start at 0.27.)
    assert a.ttft_s == pytest.approx(0.12)
    assert b.ttft_s == pytest.approx(0.28 - 0.2001)


def test_one_local_request_matches_the_hand_schedule():
    out = run(trace((0.0, 100, 3)), Layout(1, 1), "always_local").outcomes[0]
    assert out.path == "local"
    assert out.ttft_s == pytest.approx(0.22)  # 0.02 + 100 * 0.002, alone on D: the prompt goes whole
    assert out.e2e_s == pytest.approx(0.24)


def test_decode_steps_pay_for_their_sequences_context():
    """With 1 us per token of context beyond 64 a sequence, a decode step of one 100-token prompt's sequence
    (101 tokens at its first decode step, 102 at the second) takes 10 ms + 37 / 38 us."""
    cost = replace(COST, decode_context=64, decode_context_s=1e-6)
    out = simulate(trace((0.0, 100, 3)), cost, Layout(1, 1), WORKER, RouterConfig(policy="always_local")).outcomes[0]
    assert out.ttft_s == pytest.approx(0.22)  # the prompt's own step: no decode rows
    assert out.e2e_s == pytest.approx(0.22 + 0.01 + 37e-6 + 0.01 + 38e-6)
    # a mixed step: the ride of 100-token a's row, and its context beyond 64 tokens
    b = simulate(trace((0.0, 100, 3), (0.05, 50, 2)), cost, Layout(0, 1), WORKER,
                 RouterConfig(policy="always_local")).outcomes[1]
    assert b.ttft_s == pytest.approx(0.22 + (0.02 + 0.1) + 0.5 * 0.01 + 37e-6 - 0.05)


def test_a_worker_steps_slower_while_the_other_pool_computes():
    """With decode steps 2x and prompts 1.5x as long while a worker of the other pool computes: a (100
    tokens, 3 out) is prefilled alone (0.11 s) and decodes from 0.12 s. b (100 tokens) arrives at 0.125, in
    a's first decode step; D reserves it at 0.13 and P computes it while D steps: 0.165 s, to 0.295. a's
    second decode step starts beside it: 20 ms, to 0.15. b's KV lands 0.005 + 0.005 s after its prefill,
    D idle by then: its first token at 0.305."""
    cost = replace(COST, decode_beside_prefill=2.0, prefill_beside_decode=1.5)
    result = simulate(trace((0.0, 100, 3), (0.125, 100, 2)), cost, Layout(1, 1), WORKER,
                      RouterConfig(policy="always_remote"))
    a, b = result.outcomes
    assert a.ttft_s == pytest.approx(0.12) and a.e2e_s == pytest.approx(0.15)
    assert result.beside == (1 / 2, 1 / 3)  # b's prompt of P's two; a's second decode step of D's three
    assert b.ttft_s == pytest.approx(0.305 - 0.125)
    alone = run(trace((0.0, 100, 3), (0.125, 100, 2)), Layout(1, 1), "always_remote").outcomes
    assert alone[0].e2e_s == pytest.approx(0.14) and alone[1].ttft_s == pytest.approx(0.25 - 0.125)
    # the serving factor in place of the cost model's: b's prompt beside D 1.5x again, its first token at 0.305
    served = simulate(trace((0.0, 100, 3), (0.125, 100, 2)), replace(cost, prefill_beside_decode=1.1), Layout(1, 1),
                      WORKER, RouterConfig(policy="always_remote"), factors=ServingFactors(prefill_beside=1.5))
    assert served.outcomes[1].ttft_s == pytest.approx(0.305 - 0.125)


def test_serving_factors_stretch_each_phase_of_the_hand_schedule():
    """Prompt tokens take `prefill` times their cost-model time, decode rows `decode` times; the KV
    transfer and the hops stay as calibrated."""
    f = ServingFactors(prefill=1.5, decode=2.0)
    local = run(trace((0.0, 100, 3)), Layout(1, 1), "always_local", factors=f).outcomes[0]
    assert local.ttft_s == pytest.approx(0.22 * 1.5)
    assert local.e2e_s == pytest.approx(0.22 * 1.5 + 2 * 0.01 * 2.0)
    remote = run(trace((0.0, 100, 3)), Layout(1, 1), "always_remote", factors=f).outcomes[0]
    # P: 0.11 * 1.5 = 0.165 s; the transfer's exposed part: max(0.005, 0.01 - 0.165 / 2) = 0.005; hops 0.005
    assert remote.ttft_s == pytest.approx(0.165 + 0.005 + 0.005)
    assert remote.tpot_s == pytest.approx(0.02)
    # a mixed step: the chunk at the prefill factor, the decode rows' ride at the decode factor
    b = run(trace((0.0, 100, 3), (0.05, 50, 2)), Layout(0, 1), "always_local", factors=f).outcomes[1]
    assert b.ttft_s == pytest.approx(0.33 + (0.02 + 0.1) * 1.5 + 0.5 * 0.01 * 2.0 - 0.05)
    # a time per step: each step with decode rows, mixed ones too, takes 4 ms more; prompt-only steps do not
    per_step = ServingFactors(decode_step_s=0.004)
    a, b = run(trace((0.0, 100, 3), (0.05, 50, 2)), Layout(0, 1), "always_local", factors=per_step).outcomes
    assert a.ttft_s == pytest.approx(0.22)  # its prompt alone
    assert b.ttft_s == pytest.approx(0.22 + 0.125 + 0.004 - 0.05)  # the mixed step (see the next tests)
    assert a.e2e_s == pytest.approx(0.357 + 2 * 0.004)  # then one decode step of both
    late = run(trace((0.0, 100, 3)), Layout(1, 1), "always_local", factors=ServingFactors(latency_s=0.07)).outcomes[0]
    assert (late.ttft_s, late.e2e_s) == pytest.approx((0.22 + 0.07, 0.24 + 0.07))  # every token 70 ms later
    assert late.tpot_s == pytest.approx(0.01)


def test_serving_factors_are_checked_and_read_from_overrides():
    assert AS_CALIBRATED.with_overrides("decode=1.25") == ServingFactors(1.0, 1.25)
    assert AS_CALIBRATED.with_overrides("decode_step_s=0.02").decode_step_s == 0.02
    assert AS_CALIBRATED.with_overrides("") == AS_CALIBRATED
    beside = AS_CALIBRATED.with_overrides("prefill_beside=1.3")
    assert beside.applied(COST).prefill_beside_decode == 1.3 and AS_CALIBRATED.applied(COST) is COST
    assert "prefill_beside=1.3" in beside.describe() and "prefill_beside" not in AS_CALIBRATED.describe()
    for bad, why in (("decode=0", "decode must be a finite number > 0"), ("speed=2", "NAME one of"),
                     ("prefill_beside=0.9", "prefill_beside must be 0 .the cost model's. or a finite number >= 1"),
                     ("latency_s=-1", "latency_s must be a finite number >= 0"),
                     ("decode_step_s=nan", "decode_step_s must be a finite number >= 0"),
                     ("prefill=x", "is not a number"), ("prefill", "use NAME=VALUE")):
        with pytest.raises(ValueError, match=why):
            AS_CALIBRATED.with_overrides(bad)


def test_two_overlapping_requests_share_steps():
    res = run(trace((0.0, 100, 3), (0.05, 50, 2)), Layout(0, 1), "always_local")
    a, b = res.outcomes
    # step 1 [0, 0.22]: a's prompt alone. Step 2 [0.22, 0.345]: a decodes beside b's 50-token chunk:
    # 0.02 + 0.1 + 0.5 * 0.01. Step 3 [0.345, 0.357]: both decode (batch 2: 0.012); both end.
    assert a.ttft_s == pytest.approx(0.22) and a.e2e_s == pytest.approx(0.357)
    assert b.ttft_s == pytest.approx(0.345 - 0.05) and b.e2e_s == pytest.approx(0.357 - 0.05)
    assert res.decode_steps == 3 and res.decode_rows == 0 + 1 + 2


def test_kv_exhaustion_makes_the_next_request_wait_at_the_router():
    tiny = WorkerSpec(num_blocks=10, block_size=16, prefill_chunk_tokens=256)  # 160 tokens
    res = run(trace((0.0, 100, 20), (0.01, 50, 10)), Layout(0, 1), "always_local", tiny)
    a, b = res.outcomes
    # a books ceil(120 / 16) = 8 blocks; b needs 4 and 2 are left: NoCapacity, it waits for a's release.
    assert a.ttft_s == pytest.approx(0.22) and a.e2e_s == pytest.approx(0.22 + 19 * 0.01)
    assert b.queue_s == pytest.approx(0.41 - 0.01)
    assert b.ttft_s == pytest.approx(0.41 + 0.12 - 0.01)  # then its 50 tokens alone: 0.02 + 0.1
    assert b.e2e_s == pytest.approx(0.53 + 9 * 0.01 - 0.01)
    assert res.preemptions == 0  # the router's booking keeps the engine from running out


def test_waiting_past_the_queue_timeout_is_refused():
    tiny = WorkerSpec(num_blocks=10, block_size=16)
    res = simulate(trace((0.0, 100, 20), (0.01, 50, 10)), COST, Layout(0, 1), tiny,
                   RouterConfig(policy="always_local", queue_timeout_s=0.1))
    assert res.outcomes[1].error == "overloaded" and res.outcomes[0].error is None


def test_a_request_larger_than_a_decode_worker_is_refused():
    res = run(trace((0.0, 100, 100)), Layout(0, 1), "always_local", WorkerSpec(num_blocks=10, block_size=16))
    assert res.outcomes[0].error == "invalid"


def test_a_long_prompt_prefills_in_chunks_beside_the_running_batch():
    res = run(trace((0.0, 10, 50), (0.03, 600, 2)), Layout(0, 1), "always_local")
    a, b = res.outcomes
    # step 1 [0, 0.04]: a alone. Steps 2-4: a decodes beside b's chunks of 256, 256, 88 tokens, each
    # 0.02 + 0.002 * n + 0.5 * 0.01: b's first token at 0.04 + 0.537 + 0.537 + 0.201 = 1.315.
    assert a.ttft_s == pytest.approx(0.04)
    assert b.ttft_s == pytest.approx(1.315 - 0.03)
    assert b.e2e_s == pytest.approx(1.315 + 0.012 - 0.03)  # one step at batch 2


def test_a_prompt_alone_goes_whole_even_past_the_chunk_size():
    out = run(trace((0.0, 600, 1)), Layout(0, 1), "always_local").outcomes[0]
    assert out.ttft_s == pytest.approx(0.02 + 600 * 0.002)  # one step, one fixed cost


class _Anywhere(Policy):
    """Local on decode worker 0 whatever its room (a policy may ignore the book: the engine then runs out)."""

    name = "anywhere"

    def place(self, request: RequestFeatures, state: PoolState) -> Placement:
        return Placement("local", None, 0, "test", 0.0, 0.0)


def test_a_decode_worker_out_of_blocks_preempts_and_recomputes():
    small = WorkerSpec(num_blocks=6, block_size=4, prefill_chunk_tokens=256, enable_prefix_caching=False)
    res = simulate(trace((0.0, 8, 10), (0.0, 8, 10)), COST, Layout(0, 1), small,
                   RouterConfig(policy="always_local"), policy=_Anywhere())
    a, b = res.outcomes
    # a's prompt runs alone (b arrives as its step starts), b's beside a's first decode step; each decode
    # token needs a slot, and the 6 blocks run out: the later one is preempted, recomputed after a ends.
    assert res.preemptions >= 1 and b.preemptions >= 1 and a.preemptions == 0
    assert a.output_tokens == b.output_tokens == 10 and a.error is None and b.error is None
    assert b.e2e_s > a.e2e_s
    assert a.ttft_s == pytest.approx(0.02 + 8 * 0.002)


class _Spy(AlwaysRemotePolicy):
    def __init__(self, cost: CostModel) -> None:
        super().__init__(cost)
        self.calls: list[tuple[RequestFeatures, PoolState]] = []

    def place(self, request: RequestFeatures, state: PoolState) -> Placement:
        self.calls.append((request, state))
        return super().place(request, state)


def test_the_simulator_places_with_the_policy_on_the_books_own_state(monkeypatch: pytest.MonkeyPatch):
    states: list[PoolState] = []
    real = PoolBook.state

    def recorded(self: PoolBook, unflipped: bool = False) -> PoolState:
        states.append(real(self, unflipped))
        return states[-1]
    monkeypatch.setattr(PoolBook, "state", recorded)
    spy = _Spy(COST)
    res = simulate(trace((0.0, 100, 3), (0.05, 40, 2)), COST, Layout(1, 1), WORKER, RouterConfig(), policy=spy)
    assert [o.path for o in res.outcomes] == ["remote", "remote"]
    assert len(spy.calls) == 2 and [s for _, s in spy.calls] == states[:2]
    assert all(state is book_state for (_, state), book_state in zip(spy.calls, states))
    first, second = spy.calls[1][1].prefill[0], spy.calls[1][1].decode[0]
    assert first.queued_tokens == 100  # the first prompt is still on P when the second arrives
    assert second.running == 1 and second.awaiting_kv == 1
    assert second.free_blocks == 1000 - 7  # ceil((100 + 3) / 16) booked
    assert spy.calls[0][0] == RequestFeatures(100, 3, 3)


def test_the_simulator_holds_no_copy_of_the_policy():
    import inspect

    import planner.sim

    source = inspect.getsource(planner.sim)
    for name in ("_remote", "_local", "_candidates", "_priced", "_crowding", "has_room"):
        assert name + "(" not in source, name


def test_prompts_with_the_same_hashes_share_a_prefix_and_hit_the_cache():
    block = 512
    ids_a = prompt_ids(TraceRequest(0.0, 1024, 1, hash_ids=(1, 2)), 0, block)
    ids_b = prompt_ids(TraceRequest(0.0, 1024, 1, hash_ids=(1, 3)), 1, block)
    assert ids_a[:block] == ids_b[:block] and ids_a[block:] != ids_b[block:]
    tr = Trace((TraceRequest(0.0, 1024, 2, hash_ids=(1, 2)), TraceRequest(5.0, 1024, 2, hash_ids=(1, 3))), "t", block)
    a, b = run(tr, Layout(0, 1), "always_local", WorkerSpec(num_blocks=1000, block_size=16)).outcomes
    assert a.ttft_s == pytest.approx(0.02 + 1024 * 0.002)
    assert b.ttft_s == pytest.approx(0.02 + 512 * 0.002)  # its first 512 tokens come from D's cache
    # computed over that cached prefix, each of its 512 new tokens pays 1 us per cached token it attends over
    over = replace(COST, prefill_context_s=1e-6)
    a, b = simulate(tr, over, Layout(0, 1), WorkerSpec(num_blocks=1000, block_size=16),
                    RouterConfig(policy="always_local")).outcomes
    assert a.ttft_s == pytest.approx(0.02 + 1024 * 0.002)  # nothing cached: as before
    assert b.ttft_s == pytest.approx(0.02 + 512 * 0.002 + 512 * 512 * 1e-6)


def test_the_ratio_policy_runs_a_loaded_trace_to_the_end():
    reqs = tuple(TraceRequest(i * 0.05, 50 + (i * 37) % 400, 5 + (i * 13) % 40) for i in range(200))
    res = simulate(Trace(reqs, "mix"), COST, Layout(1, 2), WORKER, RouterConfig())
    assert all(o.error is None for o in res.outcomes)
    assert 0 < res.remote < 200
    s = res.summary(2.0, 0.15)
    assert s.requests == s.ok == 200 and s.ttft_p50_s is not None and s.goodput_rps > 0


def test_flip_roles_is_refused():
    with pytest.raises(ValueError, match="flip_roles"):
        Simulator(trace((0.0, 10, 1)), COST, Layout(1, 1), WORKER, RouterConfig(flip_roles=True))


def test_layout_and_worker_fields_are_validated():
    with pytest.raises(ValueError, match="decode"):
        Layout(1, 0)
    with pytest.raises(ValueError, match="num_blocks"):
        WorkerSpec(num_blocks=0)
    assert WorkerSpec.from_memory(COST, 1.0).num_blocks == (1 << 30) // (16 * 100)


def test_the_planner_never_imports_ray_or_torch():
    code = ("import sys, planner.sim, planner.plan, planner.profiles, planner.traces, planner.validate, "
            "planner.watch, planner.cli; print(sorted(m for m in ('ray', 'torch') if m in sys.modules))")
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=False)
    assert res.returncode == 0, res.stderr
    assert res.stdout.strip() == "[]"
