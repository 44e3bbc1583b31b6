"""The decode worker's engine round: a remote request's first token goes to the feed as soon as its KV
landed, before the round's decode step (which would otherwise hold it back for a whole step: ~30 ms of
TTFT per remote request on a 2-core CPU). The engine and the connector are stand-ins; the round, the
feed and its condition are the worker's own."""
from __future__ import annotations

import threading

from decode_worker.worker import DecodeWorker
from engine import RequestOutput
from engine.command_loop import Round
from kv_transfer import TransferState


class LandedConnector:
    def poll(self, request_id: str) -> TransferState:
        return TransferState.DONE

    def forget(self, request_id: str) -> None:
        pass


class OneStepEngine:
    """Activates the landed request; its step records what the feed had handed over by then."""

    def __init__(self, worker: DecodeWorker) -> None:
        self.worker, self.published_before_step = worker, None

    def activate(self, request_id: str, token: int, logprob: object) -> RequestOutput:
        return RequestOutput(request_id, [token], "first", False, None, 5, 0)

    def has_unfinished(self) -> bool:
        return True

    def step(self) -> list[RequestOutput]:
        self.published_before_step = list(self.worker.published)
        return [RequestOutput("r", [8], " second", False, None, 5, 0)]


def worker_with_a_landed_request() -> DecodeWorker:
    w = DecodeWorker.__new__(DecodeWorker)  # the round's state only: no engine thread, no transfers
    w.connector, w.engine = LandedConnector(), None
    w._landing, w._started = {"r": (7, None)}, {"r": 0.0}
    w._fed, w._feed, w._feed_seq, w._feed_ready = {"r"}, [], 0, threading.Condition()
    w._streams, w._reading = {}, set()
    w.published = []
    publish = w._publish

    def recording_publish() -> None:  # what a waiting `drain` would be woken with, each time
        w.published.append([e.item.token_ids for e in w._feed])
        publish()
    w._publish = recording_publish
    w.engine = OneStepEngine(w)
    return w


def test_a_landed_requests_first_token_is_handed_over_before_the_rounds_decode_step():
    w = worker_with_a_landed_request()
    assert w._work() == Round.BUSY
    assert w.engine.published_before_step == [[(7,)]]  # the first token alone, before the step ran
    assert [e.item.token_ids for e in w._feed] == [(7,), (8,)]  # the step's token follows, in order
    assert [e.seq for e in w._feed] == [1, 2]


def test_a_round_that_lands_nothing_publishes_only_after_its_step():
    w = worker_with_a_landed_request()
    w._landing = {}
    w._work()
    assert w.engine.published_before_step == [] and w.published == []  # `_after` hands the step's items over
