"""`PrefillWorker`: batches waiting prompts into one prefill and ships each layer's KV as it is done.

Request lifecycle on a prefill worker:
1. `prefill` queues the prompt (prefill-only) with the decode worker that reserved its blocks.
2. The engine loop (its own thread) runs every queued prompt in one prefill step; after each
   layer, that layer's blocks are queued on the connector for each request's decode worker,
   so layer i travels while layer i + 1 computes. While the step computes with a decode worker's
   threads too (a loan, `router.elastic`), its layers are held and go after its last one.
3. The first token is sampled and returned to the caller with its log-probabilities when the
   request asked (HELD: blocks kept while sending).
4. When the connector reports the transfer DONE or FAILED, the blocks return to the pool.
A prefill worker is a decode worker too (the class extends `DecodeWorker`): while its router has
flipped it to serve decode (`router.elastic.RoleFlipper`), it also runs whole requests
(`submit_local`), their tokens on its feed, in the same engine steps as its prompts' chunks. It
never receives KV. Only the engine loop thread touches the engine; actor methods hand it commands.
"""
from __future__ import annotations

import logging
import os
import time
from concurrent.futures import Future

from decode_worker import DecodeWorker
from engine import EngineConfig, RequestOutput, SamplingParams
from engine.command_loop import Round
from engine.sequence import Sequence
from kv_transfer import PeerInfo, TransferConfig, TransferState
from worker_core.protocol import ErrorKind, LoadReport, PrefillResult

log = logging.getLogger(__name__)
STALL_S = 8.0  # fault "stall": longer than the router's health-check timeout


class PrefillWorker(DecodeWorker):
    """Args: engine_config, transfer_config, worker_id (unique; names the worker in transfers)."""

    def __init__(self, engine_config: EngineConfig, transfer_config: TransferConfig, worker_id: str) -> None:
        self._peers: dict[str, PeerInfo] = {}  # request id -> its decode worker
        self._skip: dict[str, int] = {}  # request id -> leading blocks its decode worker holds (not sent)
        self._first: dict[str, Future] = {}  # request id -> first token, for the caller
        self._sending: set[str] = set()
        self._fault: str | None = None  # fault injection (tests): applies to the next request prefilled
        self._dropped: set[str] = set()  # requests whose KV was never sent (fault "drop")
        self._unshipped = 0  # the first layer of the step under way not shipped yet (held while borrowing)
        super().__init__(engine_config, transfer_config, worker_id)  # the engine loop runs from here on

    # -- actor API (any thread) --------------------------------------------------------------------
    def inject_fault(self, kind: str | None) -> None:
        """Fault injection for tests, applied to the next request prefilled: "drop" (its KV is never
        sent: the receiver waits until its timeout), "bad_header" (a layer arrives with the wrong
        block count), "die" (this process exits halfway through its layers), "stall" (once its last
        layer is sent, the engine thread is held for STALL_S, as by a very long prefill), "sample" (its
        first token cannot be picked, `DecodeWorker.inject_fault`). None clears it."""
        if kind not in (None, "drop", "bad_header", "die", "stall", "sample"):
            raise ValueError(f"kind must be drop, bad_header, die, stall, sample or None; got {kind!r}")

        def do() -> None:
            self._fault = None if kind == "sample" else kind
            self._arm_sampling_fault(kind == "sample")
        self._owner.call(do)

    def probe_transfer(self, request_id: str, prompt: list[int], decode_peer: PeerInfo, timeout_s: float = 30.0) -> float:
        """Send the KV blocks of a `prompt`-sized reservation to `decode_peer` (which reserved the same
        request id), every layer at once. Returns the seconds until the send side reports DONE.
        The block contents are whatever the pool holds: this measures the link, not a request."""
        def start() -> float:
            blocks = self.engine.reserve(prompt, SamplingParams(max_tokens=1), request_id).blocks
            t0 = time.perf_counter()
            for layer in range(self.engine.layout.num_layers):
                self.connector.send(request_id, layer, blocks, decode_peer)
            return t0
        t0 = self._owner.call(start)
        try:
            deadline = t0 + timeout_s
            while (state := self._owner.call(lambda: self.connector.poll(request_id))) < TransferState.DONE:
                if state == TransferState.FAILED or time.perf_counter() > deadline:
                    raise RuntimeError(f"transfer probe {request_id} to {decode_peer.worker_id} failed ({state.name})")
                time.sleep(0.0005)
            return time.perf_counter() - t0
        finally:
            self._owner.call(lambda: self.engine.abort(request_id))

    def prefill(self, request_id: str, prompt: list[int], sampling: SamplingParams,
                decode_peer: PeerInfo, skip_blocks: int = 0) -> PrefillResult:
        """Prefill `prompt`, stream its KV to `decode_peer`, all but the first `skip_blocks` blocks (which
        the decode worker holds: its `reserve` said so). Pass the result's handoff to the decode worker's
        `start_remote`. Raises RuntimeError when the prefill fails, is aborted or the worker stops."""
        t0 = time.perf_counter()
        first: Future = Future()

        def do() -> None:
            self.engine.add_request(prompt, sampling, request_id=request_id, prefill_only=True)
            self._peers[request_id] = decode_peer
            self._skip[request_id] = skip_blocks
            self._first[request_id] = first
        self._owner.call(do)
        token, handoff, logprob = first.result()
        return PrefillResult(token, time.perf_counter() - t0, handoff, logprob)

    def _load_now(self) -> LoadReport:
        bm, sched = self.engine.block_manager, self.engine.scheduler
        local = sum(1 for s in (*sched.waiting, *sched.running) if not s.prefill_only)
        return LoadReport(bm.num_free_blocks, bm.num_blocks, running=local,
                          queued_tokens=sched.prompt_tokens_left(), sending=len(self._sending))

    # -- engine loop thread ------------------------------------------------------------------------
    def _after_layer(self, layer: int, seqs: list[Sequence]) -> None:
        """After each layer of a prefill step: ship it, then take up a loan made or ended meanwhile.

        A layer computed with borrowed threads is held, and goes with the step's last layer (or the first
        one computed without them). The loan means every core of the pair's node computes this step, so
        a transfer thread woken per layer, here and on the decode worker, preempts a thread of the
        engine's team, and the whole team waits at the layer's end each time: a lone 1024-token bf16
        prompt with the loan prefilled in 0.83 s, layers streamed, and in 0.68 s (+ 0.03 s of transfer
        after it), held (2-core AVX-512 BF16 node). On its own threads the step streams: the cores that
        are not its own carry the transfer, and the time it would add after the step stays hidden."""
        if layer == 0:  # a new step
            self._unshipped = 0
        if not self._threads.borrowed or layer == self.engine.layout.num_layers - 1:
            for held in range(self._unshipped, layer + 1):
                self._ship_layer(held, seqs)
            self._unshipped = layer + 1
        super()._after_layer(layer, seqs)

    def _ship_layer(self, layer: int, seqs: list[Sequence]) -> None:
        stall = self._fault == "stall"
        for seq in seqs:
            peer = self._peers.get(seq.request_id)
            if peer is None:  # calibration prompts have no destination
                continue
            if self._fault is not None and not self._injected(seq, layer):
                continue
            self.connector.send(seq.request_id, layer, seq.block_table[self._skip[seq.request_id]:], peer)
            if stall and self._fault is None:  # its last layer is on its way
                log.warning("fault injection: holding the engine thread for %.0f s", STALL_S)
                time.sleep(STALL_S)

    def _injected(self, seq: Sequence, layer: int) -> bool:
        """Apply the injected fault to this layer of `seq`. Returns whether to send it normally."""
        fault, last = self._fault, layer == self.engine.layout.num_layers - 1
        if fault == "die" and layer == self.engine.layout.num_layers // 2:
            log.warning("fault injection: exiting in the middle of %s", seq.request_id)
            os._exit(1)
        if fault == "bad_header" and layer == 0:
            blocks = seq.block_table[self._skip[seq.request_id]:-1]
            self.connector.send(seq.request_id, layer, blocks, self._peers[seq.request_id])
            return False
        if fault == "drop":
            self._dropped.add(seq.request_id)
            return False
        if last:
            self._fault = None
        return True

    def _work(self) -> Round:
        """One round: an engine step (prompt chunks, and the decode batch of requests it runs whole),
        then free what has been sent. Sends under way are polled (WAITING)."""
        left = super()._work()
        self._release_sent()
        return max(left, Round.WAITING) if self._sending else left

    def _on_output(self, out: RequestOutput) -> None:
        """A prompt prefilled for a decode worker: its caller gets the first token (its logprobs too) and
        the connector's handoff; its blocks are held until the KV is sent. Any other request: a token of its stream."""
        if out.error is not None and out.request_id in self._first:  # its token could not be picked: it ends here
            self.connector.abort(out.request_id)  # layers already queued are not sent
            self._forget(out.request_id, error=RuntimeError(f"prefill failed on {self.worker_id}: {out.error}"))
            return
        fut = self._first.pop(out.request_id, None)
        if fut is None and out.request_id not in self._peers:
            super()._on_output(out)
            return
        if fut is not None:
            fut.set_result((out.new_token_ids[0], self.connector.handoff(out.request_id),
                            out.logprobs[0] if out.logprobs else None))
        if out.request_id in self._dropped:  # fault "drop": nothing in flight to wait for
            self._dropped.discard(out.request_id)
            self._fault = None
            self.engine.release(out.request_id)
            self._forget(out.request_id)
        else:
            self._sending.add(out.request_id)

    def _abort(self, request_id: str) -> bool:
        found = super()._abort(request_id)
        if found:
            self._forget(request_id, error=RuntimeError(f"{request_id} aborted"))
        return found

    def _fail_unfinished(self, kind: ErrorKind, why: str) -> None:
        """A step that cannot run: prompts being prefilled fail to their callers (who place them again),
        the requests run here whole end with an error."""
        for rid in list(self._first):
            self.engine.abort(rid)
            self.connector.abort(rid)  # layers already queued are not sent
            self._forget(rid, error=RuntimeError(f"prefill failed ({why})"))
        super()._fail_unfinished(kind, why)

    def _release_sent(self) -> None:
        for rid in list(self._sending):
            state = self.connector.poll(rid)
            if state in (TransferState.DONE, TransferState.FAILED):
                if state == TransferState.FAILED:
                    log.warning("KV transfer for %s failed; freeing its blocks", rid)
                self.engine.release(rid)
                self.connector.forget(rid)
                self._forget(rid)

    def _stopping(self) -> None:
        """Shutdown: prompts not yet prefilled fail (their callers place them elsewhere), then the
        requests run here whole end as on a decode worker (WORKER_STOPPING: they move)."""
        for rid in list(self._first):
            self.engine.abort(rid)
            self.connector.abort(rid)
            self._forget(rid, error=RuntimeError(f"prefill worker {self.worker_id} is shutting down"))
        super()._stopping()

    def _forget(self, request_id: str, error: BaseException | None = None) -> None:
        self._sending.discard(request_id)
        self._peers.pop(request_id, None)
        self._skip.pop(request_id, None)
        fut = self._first.pop(request_id, None)
        if fut is not None and error is not None:
            fut.set_exception(error)
