"""The role split over HTTP (`GET / POST / DELETE /pdserve/split`) and `pdserve plan --watch --apply`'s side
of it (`planner.watch`: `decide`, `send_split`, `apply_decision`), on a real aiohttp server whose router
holds a real `Placer` and book (no Ray, no workers)."""
from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
from fake_router import FakeRouter

from planner.sim import Layout
from planner.validate import ServerLayout
from planner.watch import (
    Advice,
    Decision,
    SplitRefused,
    Traffic,
    apply_decision,
    current_layout,
    decide,
    read_split,
    send_split,
)
from router.admission import ModelLimits
from router.config import RouterConfig
from router.metrics import Metrics
from router.placer import Placer
from router.policy import OutputLengthEstimator
from router.split import Mechanism, RoleSplit
from tests.unit.test_http_server import ServerThread
from tests.unit.test_placer import info
from tests.unit.test_policy import COST

KEY = "split-key-1"


class SplitRouter(FakeRouter):
    """The fake router, with a real placer's role split (2 prefill workers, 2 decode workers)."""

    def __init__(self, config: RouterConfig) -> None:
        super().__init__()
        p, d = [info("p0"), info("p1")], [info("d0"), info("d1")]
        self.placer = Placer(p, d, ModelLimits.from_infos(p, d), config, COST, Metrics(model_name="m"),
                             OutputLengthEstimator())

    def split(self) -> RoleSplit:
        return self.placer.split()

    def set_split(self, prefill: int | None) -> RoleSplit:
        return self.placer.pin_split(prefill)


@pytest.fixture
def flips():
    s = ServerThread(SplitRouter(RouterConfig(flip_roles=True)), api_keys=frozenset({KEY}))
    yield s
    s.stop()


def call(s: ServerThread, method: str, body: object = None, key: str | None = KEY) -> tuple[int, dict]:
    status, _, raw = s.request(method, "/pdserve/split", body, headers={"Authorization": f"Bearer {key}"} if key
                               else {})
    return status, json.loads(raw)


def advice(recommended: Layout | None, current: Layout) -> Advice:
    rec = None if recommended is None else SimpleNamespace(candidate=SimpleNamespace(layout=recommended, policy="ratio"))
    return Advice(current, Traffic(1.0, 100, 10), SimpleNamespace(recommended=rec), 0.5)  # type: ignore[arg-type]


def test_the_split_is_read_pinned_and_released_with_a_key_and_bad_input_names_its_field(flips) -> None:
    assert call(flips, "GET", key=None)[0] == 401
    assert call(flips, "POST", {"prefill": 1}, key=None)[0] == 401
    assert call(flips, "DELETE", key="wrong")[0] == 401
    status, body = call(flips, "GET")
    assert status == 200 and RoleSplit.from_json(body) == RoleSplit(2, 2, 2, None, Mechanism.FLIP_ROLES)
    for bad, field in (({"prefill": 3}, "prefill"), ({"prefill": -1}, "prefill"), ({"prefill": "1"}, "prefill"),
                       ({"prefill": 1, "decode": 2}, "decode"), ([1], "body"), ({}, "prefill")):
        status, body = call(flips, "POST", bad)
        assert status == 400 and body["error"]["param"] == field, (bad, body)
    assert "--prefill 3" in call(flips, "POST", {"prefill": 3})[1]["error"]["message"]
    assert flips.router.placer.split().pinned is None  # nothing refused changed anything
    status, body = call(flips, "POST", {"prefill": 1})
    assert status == 200 and (body["pinned"], body["prefill_role"]) == (1, 1)
    assert [f.accepting for f in flips.router.placer.book.flex].count(True) == 1
    assert read_split(f"http://127.0.0.1:{flips.port}", KEY).pinned == 1
    status, body = call(flips, "POST", {"prefill": None})
    assert status == 200 and body["pinned"] is None
    call(flips, "POST", {"prefill": 0})
    status, body = call(flips, "DELETE")
    assert status == 200 and body["pinned"] is None and body["prefill_role"] == 0  # the roles as they stood


def test_a_server_without_role_flips_answers_409_saying_how_to_start_it() -> None:
    s = ServerThread(SplitRouter(RouterConfig()))
    try:
        for method, body in (("POST", {"prefill": 1}), ("DELETE", None)):
            status, answer = call(s, method, body, key=None)
            assert status == 409 and answer["error"]["code"] == "split_unavailable", answer
            assert "--flip-roles" in answer["error"]["message"]
        base = f"http://127.0.0.1:{s.port}"
        split = read_split(base)
        assert split.mechanism is Mechanism.NONE and split.prefill_role == 2
        text = apply_decision(base, decide(advice(Layout(1, 3), Layout(2, 2)), split))
        assert text.startswith("cannot apply 1P:3D") and "--flip-roles" in text
    finally:
        s.stop()


def test_watch_apply_pins_a_differing_appliable_recommendation_and_says_why_not_otherwise(flips) -> None:
    base = f"http://127.0.0.1:{flips.port}"
    split = read_split(base, KEY)
    server = ServerLayout(Layout(2, 2), 1000, 1000, "ratio")
    assert current_layout(server, split) == Layout(2, 2)
    assert decide(advice(Layout(2, 2), Layout(2, 2)), split).prefill is None  # the split now: nothing to send
    assert decide(advice(None, Layout(2, 2)), split).prefill is None
    too_many = decide(advice(Layout(3, 1), Layout(2, 2)), split)
    assert too_many.prefill is None and "cannot apply 3P:1D" in too_many.reason and "--prefill 3" in too_many.reason
    assert apply_decision(base, too_many, KEY) == too_many.reason
    assert flips.router.placer.split().pinned is None  # nothing was sent
    fewer = decide(advice(Layout(1, 3), Layout(2, 2)), split)
    assert fewer == Decision(1, fewer.reason)
    text = apply_decision(base, fewer, KEY)
    assert text.startswith("applied: pin 1P:3D") and "(pinned)" in text
    split = read_split(base, KEY)
    assert split.pinned == 1 and current_layout(server, split) == Layout(1, 3)
    assert decide(advice(Layout(1, 3), current_layout(server, split)), split).prefill is None
    assert "the server refused it: HTTP 401" in apply_decision(base, Decision(0, "pin 0P:4D"), None)
    with pytest.raises(SplitRefused, match="HTTP 400: prefill: this server has 2 prefill workers"):
        send_split(base, 5, KEY)
    assert send_split(base, None, KEY).pinned is None


def test_pdserve_status_shows_the_routers_split(flips) -> None:
    from pdserve.status import format_status, router_split

    base = f"http://127.0.0.1:{flips.port}"
    call(flips, "POST", {"prefill": 1})
    status = {"address": "127.0.0.1:6379", "workers": [], "nodes": [], "healthy": False,
              "pools": {"prefill": {"alive": 0, "healthy": 0}, "decode": {"alive": 0, "healthy": 0}},
              "router": router_split(base, KEY)}
    assert status["router"]["split"]["pinned"] == 1
    assert (f"router {base}: role split: 1 of 2 prefill workers prefill, 1 flipped to decode, beside 2 decode "
            "workers (pinned)") in format_status(status)
    unread = router_split(base, None)
    assert unread["split"] is None and unread["text"].startswith("unknown (") and "401" in unread["text"]


class TrafficRouter(SplitRouter):
    """Its /metrics shows 2 prefill and 2 decode workers, and at every scrape `ended` more requests ended
    (`prompt` and `output` tokens each); its cost model is the policy tests' one."""

    def __init__(self, config: RouterConfig, ended: int, prompt: int, output: int) -> None:
        super().__init__(config)
        from worker_core.protocol import LoadReport

        self.ended, self.prompt, self.output = ended, prompt, output
        self.metrics = Metrics(model_name="m")
        for pool in ("prefill", "decode"):
            for i in range(2):
                self.metrics.observe_worker(pool, f"{pool}-{i}", LoadReport(free_blocks=1000, num_blocks=1000))

    def metrics_text(self) -> tuple[bytes, str]:
        m = self.metrics
        m.requests.labels("local", "length").inc(self.ended)
        m.prompt_tokens.inc(self.ended * self.prompt)
        m.output_tokens.inc(self.ended * self.output)
        return m.exposition()

    def cost_model(self) -> dict:
        return COST.to_dict()


TOO_MANY = "cannot apply 3P:1D: prefill: this server has 2 prefill workers"


@pytest.mark.parametrize("traffic,applied", [((20, 200, 20), TOO_MANY), ((1, 20, 200), "applied: pin ")])
def test_watch_with_apply_prints_the_advice_and_what_it_applied_or_why_not(traffic, applied) -> None:
    """Prompt-heavy traffic wants a third prefill worker, which no flip gives; decode-heavy traffic wants
    fewer, which one pins."""
    from planner.plan import Slo
    from planner.watch import watch

    s = ServerThread(TrafficRouter(RouterConfig(flip_roles=True), *traffic), api_keys=frozenset({KEY}))
    try:
        lines: list[str] = []
        watch(f"http://127.0.0.1:{s.port}", Slo(2.0, 0.2), ("always_local", "always_remote"), 8, interval_s=0.2,
              rounds=1, out=lines.append, pin=True, api_key=KEY)
        assert lines[0].startswith("traffic: ") and "now 2P:2D" in lines[0] and "recommend " in lines[0], lines
        assert lines[1].startswith("  " + applied), lines
        pinned = s.router.placer.split().pinned
        if applied.startswith("applied"):
            label = lines[0].split("recommend ")[1].split()[0]
            assert pinned == int(label.split("P:")[0]) < 2 and f"pin {label}" in lines[1]
        else:
            assert pinned is None
    finally:
        s.stop()
