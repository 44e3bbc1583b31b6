"""`DecodeWorker`: one engine on one device; receives prompts' KV and decodes them in one batch.

Request lifecycle on a decode worker:
1. `reserve` (remote prefill): blocks reserved for the prompt (RECEIVING), the receive posted on
   the connector; refused with CapacityError when the worker is full (the caller picks another).
2. `start_remote`: the prefill worker's first token arrives (with its log-probabilities when the
   request asked; they lead the stream); once every layer has landed the sequence joins the
   running batch (RUNNING). A failed transfer ends the request with an error.
   `submit_local` instead queues the whole request; this worker runs its prefill itself.
3. The engine loop (its own thread) steps while there is work; each new token goes to the
   request's stream; `stream` yields them to the caller as they come. A request started with
   `feed=True` (the router's) goes instead to the worker's one feed: `drain` hands over every such
   request's items not yet acknowledged in one message, so a step's tokens cross in one batch.
4. FINISHED (EOS, stop, max_tokens) or ABORTED (`abort`, failed transfer): blocks return to the pool.
Only the engine loop thread touches the engine; actor methods hand it commands.
"""
from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Iterator

import torch

from engine import EngineConfig, RequestOutput, SamplingParams
from engine.command_loop import Round, Stopped
from engine.errors import SamplingError
from engine.logprobs import TokenLogprob
from engine.profiling import time_context_cost, time_decode_steps, time_mixed_step, time_prefill_over
from engine.sequence import Sequence
from kv_transfer import PeerInfo, TransferConfig, TransferState
from worker_core import WorkerBase
from worker_core.protocol import ErrorKind, FeedEntry, LoadReport, StreamItem

log = logging.getLogger(__name__)


class DecodeWorker(WorkerBase):
    """Args: engine_config, transfer_config, worker_id (unique; names the worker in transfers)."""

    def __init__(self, engine_config: EngineConfig, transfer_config: TransferConfig, worker_id: str) -> None:
        super().__init__(engine_config, transfer_config, worker_id)
        self._streams: dict[str, queue.Queue] = {}
        # reserved request -> its first token and that token's logprobs (None: not come yet)
        self._landing: dict[str, tuple[int, TokenLogprob | None] | None] = {}
        self._started: dict[str, float] = {}  # request id -> when its first token arrived
        self._reading: set[str] = set()  # requests whose stream a caller is reading
        self._fed: set[str] = set()  # requests whose items go to the feed (engine thread only)
        self._feed: list[FeedEntry] = []  # their items not acknowledged yet, in order
        self._feed_seq = 0  # the last entry's number
        self._feed_ready = threading.Condition()  # guards `_feed` and `_feed_seq`; notified on new entries
        self._start_loop()

    # -- actor API (any thread) --------------------------------------------------------------------
    def reserve(self, request_id: str, prompt: list[int], sampling: SamplingParams, prefill_peer: PeerInfo,
                feed: bool = False, reuse: bool = True) -> int:
        """Reserve blocks and post the receive. Returns how many leading blocks of the prompt this worker
        holds already (its prefix cache; none without `reuse`): the prefill worker ships the rest. Raises
        CapacityError when full. `feed`: its items go to `drain`, not to a stream of its own."""
        def do() -> int:
            reservation = self.engine.reserve(prompt, sampling, request_id, reuse)
            self._open(request_id, feed)
            self.connector.recv(request_id, reservation.blocks, self.engine.layout.num_layers, prefill_peer)
            self._landing[request_id] = None  # watched from now: a transfer that never comes times out
            return reservation.cached_blocks
        return self._owner.call(do)

    def start_remote(self, request_id: str, first_token: int, handoff: object | None = None,
                     first_logprob: TokenLogprob | None = None) -> None:
        """The prefill worker's first token (its connector's handoff, and the token's logprobs when the
        request asked: `PrefillResult.first_logprob`): start once the KV landed."""
        def do() -> None:
            if request_id not in self._landing:
                raise ValueError(f"{request_id!r} has no reservation here (expired or aborted)")
            self.connector.accept(request_id, handoff)
            self._landing[request_id] = (first_token, first_logprob)
            self._started[request_id] = time.perf_counter()
        self._owner.call(do)

    def submit_local(self, request_id: str, prompt: list[int], sampling: SamplingParams, feed: bool = False) -> None:
        """Queue the whole request (this worker prefills it). `feed`: as for `reserve`."""
        def do() -> None:
            self.engine.add_request(prompt, sampling, request_id=request_id)
            self._open(request_id, feed)
        self._owner.call(do)

    def drain(self, acked: int, wait_s: float = 1.0) -> list[FeedEntry]:
        """The fed requests' items numbered after `acked`, in the order they came, in one message;
        waits up to `wait_s` for one. Entries up to `acked` (the caller has them) are dropped. A call
        whose answer never reaches its caller loses nothing: the next call acknowledges less."""
        with self._feed_ready:
            self._feed = [e for e in self._feed if e.seq > acked]
            if not self._feed:
                self._feed_ready.wait(wait_s)
            return [e for e in self._feed if e.seq > acked]

    def stream(self, request_id: str) -> Iterator[StreamItem]:
        """Yield the request's `StreamItem`s as its tokens are produced; the last one is finished."""
        def start() -> queue.Queue:
            self._reading.add(request_id)
            return self._streams[request_id]
        q = self._owner.call(start)
        while True:
            item = q.get()
            if item.finished:
                self._release_stream(request_id)
            yield item
            if item.finished:
                return

    def next_items(self, request_id: str, wait_s: float = 1.0) -> list[StreamItem]:
        """The pull form of `stream` (for callers that cannot take streamed results, e.g. Ray Client
        drivers): the items produced since the last call, waiting up to `wait_s` for the first one.
        A request unknown here (expired, aborted, or this worker restarted) gives one ABORTED item."""
        def start() -> queue.Queue | None:
            q = self._streams.get(request_id)
            if q is not None:
                self._reading.add(request_id)
            return q
        q = self._owner.call(start)
        if q is None:
            return [StreamItem.failed(ErrorKind.ABORTED, f"{request_id} is not known on this decode worker")]
        items = []
        try:
            items.append(q.get(timeout=wait_s))
            while not items[-1].finished:
                items.append(q.get_nowait())
        except queue.Empty:
            pass
        if items and items[-1].finished:
            self._release_stream(request_id)
        return items

    def inject_fault(self, kind: str | None) -> None:
        """Fault injection for tests: "sample" (the next request to arrive here gets a token that cannot be
        picked: it fails alone, as one whose logits hold no finite value would; requests already here sample
        as they should). None clears it."""
        if kind not in (None, "sample"):
            raise ValueError(f"kind must be sample or None; got {kind!r}")
        self._owner.call(lambda: self._arm_sampling_fault(kind == "sample"))

    def abort(self, request_id: str) -> bool:
        """Drop the request wherever it is here; its blocks return to the pool. Returns whether it was found."""
        return self._owner.call(lambda: self._abort(request_id))

    def abort_all(self) -> int:
        n = super().abort_all()
        with self._feed_ready:  # what the last router left unread: nobody reads it now
            self._feed.clear()
        return n

    def transfer_state(self, request_id: str) -> TransferState:
        """The receive side's `TransferState` of a request (calibration probes)."""
        return self._owner.call(lambda: self.connector.poll(request_id))

    def profile_decode(self, batches: list[int], context: int, steps: int = 4, repeat: bool = False) -> list[float]:
        """Seconds of one decode step at each batch size, sequences of about `context` tokens (call while idle;
        `repeat`: the same prompts as the last such call, which the prefix cache holds, `time_decode_steps`)."""
        return self._owner.call(lambda: time_decode_steps(self.engine, batches, context, steps, repeat=repeat))

    def profile_context(self, batch: int, short: int, long: int) -> float:
        """Seconds a decode step of `batch` sequences adds per token of context a sequence holds, between `short`
        and `long` tokens (call while idle)."""
        return self._owner.call(lambda: time_context_cost(self.engine, batch, short, long))

    def profile_prefill_over(self, prefix: int, chunk: int) -> float | None:
        """Seconds a prompt token adds per token of cached prefix it attends over, `chunk` tokens over `prefix`
        (call while idle; None without a prefix cache, `time_prefill_over`)."""
        return self._owner.call(lambda: time_prefill_over(self.engine, prefix, chunk))

    def profile_mixed(self, batch: int, context: int, chunk: int) -> tuple[float, int]:
        """Seconds of one step that prefills a prompt chunk of at most `chunk` tokens beside a decode
        batch, and the chunk's tokens (call while idle)."""
        return self._owner.call(lambda: time_mixed_step(self.engine, batch, context, chunk))

    def _load_now(self) -> LoadReport:
        """Free KV blocks, total blocks, running and reserved sequences."""
        bm, sched = self.engine.block_manager, self.engine.scheduler
        return LoadReport(bm.num_free_blocks, bm.num_blocks, running=len(sched.running) + len(sched.waiting),
                          receiving=len(sched.receiving))

    # -- engine loop thread ------------------------------------------------------------------------
    def _work(self) -> Round:
        """One round: start requests whose KV landed (their first tokens go to the feed at once, not
        after this round's step: a decode step would hold each remote request's first token back), then
        one engine step. Returns BUSY while requests run, WAITING while only transfers are under way
        (they are polled; prompts may wait for the KV they bring), else IDLE."""
        if self._land():
            self._publish()
        if not self.engine.has_unfinished():
            return Round.WAITING if self._landing else Round.IDLE
        try:
            outs = self.engine.step()
        except Exception as e:  # a step that cannot run fails its requests, not the worker
            log.exception("engine step failed on %s", self.worker_id)
            why = f"worker {self.worker_id}: its engine failed ({type(e).__name__})"
            self._fail_unfinished(ErrorKind.INTERNAL, why)
            return Round.WAITING if self._landing else Round.IDLE
        for out in outs:
            self._on_output(out)
        if outs or self.engine.scheduler.running:
            return Round.BUSY
        return Round.WAITING if self._landing or self.engine.scheduler.waiting else Round.IDLE

    def _arm_sampling_fault(self, armed: bool) -> None:
        """The engine's sampler fails the row of the first request that arrives after now (`armed`): its
        first token sampled here; a request already here (any leftover) cannot take the fault instead. Not
        armed: it samples as it should."""
        sampler, sched = self.engine.sampler, self.engine.scheduler
        sampler.__dict__.pop("sample", None)  # the class's own method again
        if not armed:
            return
        real = sampler.sample
        here = {s.request_id for s in (*sched.waiting, *sched.running, *sched.receiving.values())}

        def once(logits: torch.Tensor, seqs: list[Sequence]) -> list[int | SamplingError]:
            tokens = real(logits, seqs)
            row = next((i for i, seq in enumerate(seqs) if seq.request_id not in here), None)
            if row is not None:
                del sampler.sample
                tokens[row] = SamplingError("injected fault: no token could be picked")
            return tokens
        sampler.sample = once

    def _on_output(self, out: RequestOutput) -> None:
        """A step's output for one request: its stream's next item (an error where its token could not be picked)."""
        if out.error is not None:
            self._fail(out.request_id, ErrorKind.INTERNAL, f"worker {self.worker_id}: {out.error}")
            return
        self._emit(out.request_id, StreamItem(tuple(out.new_token_ids), out.new_text, out.finish_reason,
                                              cached_tokens=out.num_cached_tokens, logprobs=tuple(out.logprobs)))

    def _abort(self, request_id: str) -> bool:
        self._landing.pop(request_id, None)
        self._started.pop(request_id, None)
        found = self.engine.abort(request_id)
        if found:
            self.connector.abort(request_id)
            self.connector.forget(request_id)
            self._fail(request_id, ErrorKind.ABORTED, "aborted")
        if request_id not in self._reading:
            self._streams.pop(request_id, None)  # nobody will read it
        return found

    def _fail_unfinished(self, kind: ErrorKind, why: str) -> None:
        """End every request that is waiting or running (not those still receiving KV) with an error."""
        sched = self.engine.scheduler
        for seq in list(sched.waiting) + list(sched.running):
            self.engine.abort(seq.request_id)
            self._fail(seq.request_id, kind, why)

    def _stopping(self) -> None:
        """Shutdown: every request here ends with WORKER_STOPPING (the router moves those it can)."""
        why = f"decode worker {self.worker_id} is shutting down"
        for rid in list(self._landing):
            del self._landing[rid]
            self._started.pop(rid, None)
            self.engine.abort(rid)
            self.connector.abort(rid)
            self.connector.forget(rid)
            self._fail(rid, ErrorKind.WORKER_STOPPING, why)
        self._fail_unfinished(ErrorKind.WORKER_STOPPING, why)

    def _land(self) -> bool:
        """Start the reserved requests whose KV landed; end those whose transfer failed. Returns whether
        any item was emitted."""
        emitted = False
        for rid, first in list(self._landing.items()):
            state = self.connector.poll(rid)
            if state == TransferState.DONE and first is not None:
                del self._landing[rid]
                # KV still in flight after the prefill worker returned: the transfer time TTFT pays
                transfer_s = time.perf_counter() - self._started.pop(rid)
                out = self.engine.activate(rid, *first)
                self.connector.forget(rid)
                self._emit(rid, StreamItem(tuple(out.new_token_ids), out.new_text, out.finish_reason,
                                           transfer_s=transfer_s, logprobs=tuple(out.logprobs)))
                emitted = True
            elif state == TransferState.FAILED:
                del self._landing[rid]
                self._started.pop(rid, None)
                self.engine.abort(rid)
                self.connector.forget(rid)
                self._fail(rid, ErrorKind.TRANSFER_FAILED, f"KV transfer for {rid} failed")
                emitted = True
        return emitted

    def _release_stream(self, request_id: str) -> None:
        """A reader got a stream's last item (any thread): the stream is forgotten."""
        try:
            self._owner.call(lambda: self._forget_stream(request_id))
        except Stopped:  # the worker has stopped: its streams went with it
            pass

    def _forget_stream(self, request_id: str) -> None:
        self._streams.pop(request_id, None)
        self._reading.discard(request_id)

    def _after(self) -> None:
        """After every command and round: the load, then the feed's waiting `drain` wakes with the whole
        round's items (one message per engine step, not one per item)."""
        super()._after()
        self._publish()

    def _publish(self) -> None:
        """Wake the feed's waiting `drain` with the items not handed over yet (engine thread)."""
        with self._feed_ready:
            if self._feed:
                self._feed_ready.notify_all()

    def _open(self, request_id: str, feed: bool) -> None:
        """Where a new request's items go: the feed, or a stream of its own."""
        if feed:
            self._fed.add(request_id)
        else:
            self._streams[request_id] = queue.Queue()

    def _emit(self, request_id: str, item: StreamItem) -> None:
        fed = request_id in self._fed
        q = self._streams.get(request_id)
        if not fed and q is None:
            return
        if item.finished:
            self._fed.discard(request_id)
            self._publish_load()  # its blocks are back in the pool before its caller hears that it ended
        if not fed:
            q.put(item)
            return
        with self._feed_ready:  # `drain` is woken after the round (`_after`); first tokens at once (`_work`)
            self._feed_seq += 1
            self._feed.append(FeedEntry(self._feed_seq, request_id, item))

    def _fail(self, request_id: str, kind: ErrorKind, message: str) -> None:
        self._emit(request_id, StreamItem.failed(kind, message))

