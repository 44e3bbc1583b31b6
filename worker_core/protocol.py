"""What crosses the router↔worker boundary: typed, frozen, and the same on both sides.

Request lifecycle as seen on this boundary:
1. At start-up the router asks each worker for its `WorkerInfo` (KV geometry, limits, what runs
   the model), and later for a `LoadReport` every poll.
2. Remote path: the decode worker reserves blocks; the prefill worker returns a `PrefillResult`
   (first token and, when the request asked, its `TokenLogprob`; its prefill time; the connector's
   handoff), which the router passes on to the decode worker. Local path: the decode worker runs
   the prompt itself.
3. The decode worker streams `StreamItem`s: the tokens of one engine step each (with their
   log-probabilities when asked; the remote path's first token's from the prefill worker), the
   last one with its finish reason. A request that ends badly ends with an item carrying a `WorkerError`, whose
   `ErrorKind` (never its message text) tells the router what to do: start again (a transfer
   failed before the first token), migrate (the worker is stopping), or fail the request.

Workers build these, the router reads them. Boundary rule: plain Python only (no torch, no Ray),
so either side and the tests import it anywhere; Ray moves them by pickling.
"""
from __future__ import annotations

import enum
from dataclasses import dataclass, fields

from engine.logprobs import TokenLogprob  # plain Python too


class ErrorKind(enum.Enum):
    """Why a request ended with an error on a worker (or at the router on its behalf)."""

    TRANSFER_FAILED = "transfer_failed"  # its KV never fully landed on the decode worker
    PREFILL_FAILED = "prefill_failed"  # the prefill pass could not run (or its worker died)
    WORKER_STOPPING = "worker_stopping"  # the worker is shutting down; the request may move elsewhere
    DEADLINE = "deadline"  # the request's own timeout passed
    INVALID = "invalid"  # the worker refused the request as given
    ABORTED = "aborted"  # aborted on request (the client went away, or the router gave up on it)
    INTERNAL = "internal"  # anything else: the worker's engine failed


@dataclass(frozen=True)
class WorkerError:
    """kind: what the router acts on; message: safe to show a client, for people only."""

    kind: ErrorKind
    message: str


@dataclass(frozen=True)
class WorkerInfo:
    """Static facts the router plans with, and what runs the model (for logs, `/v1/models`, status)."""

    worker_id: str
    num_blocks: int
    block_size: int
    kv_bytes_per_token: int
    num_layers: int
    max_num_seqs: int
    max_model_len: int
    prefill_chunk_tokens: int  # most prompt tokens of a sequence per step
    vocab_size: int
    dtype: str  # the dtype the engine runs (never "auto")
    dtype_reason: str  # why that dtype: flags, a measurement, or the user's choice
    attention: str  # decode attention kernel: a CPU build name, "triton" or "torch"
    compiled: bool  # decode steps run as one compiled graph
    linear: str  # linear layers: "plain", "packed" (oneDNN, weights packed once) or the groups packed

    @classmethod
    def field_names(cls) -> tuple[str, ...]:
        return tuple(f.name for f in fields(cls))


@dataclass(frozen=True)
class ThreadSpeedup:
    """How much faster a worker's engine computes with more threads than with its own
    (`WorkerBase.profile_threads`), its decode steps and its prefills apart: a prefill gains more from
    another core than a decode step of a few rows does. Both >= 1 as the router keeps them (a noisy
    measurement never makes more threads look harmful)."""

    decode: float
    prefill: float


@dataclass(frozen=True)
class StepTotals:
    """A worker's engine steps since its engine started (`LoadReport.steps`): the phase split of its
    time that `pdserve_engine_*` shows, and what `pdserve plan --validate` sets beside the cost
    model.
    Decode-only steps: seconds, steps, rows, and the tokens of context their rows held. Steps that compute prompt chunks: seconds, steps, those of
    them that also decoded (`mixed_steps`) and the decode rows riding in them, prompt tokens computed.
    Step seconds are the model's pass and sampling (the cost model's calibration steps count too);
    `busy_seconds` is the engine loop's wall time while it had work: the served steps plus what runs
    between them (scheduling, outputs, the feed, commands)."""

    decode_seconds: float = 0.0
    decode_steps: int = 0
    decode_rows: int = 0
    prefill_seconds: float = 0.0
    prefill_steps: int = 0
    mixed_steps: int = 0
    ride_rows: int = 0
    prefill_tokens: int = 0
    busy_seconds: float = 0.0
    decode_context: int = 0


@dataclass(frozen=True)
class LoadReport:
    """A worker's load right now. Both roles: free and total KV blocks, the threads its engine
    computes with, the sequences its engine preempted since it started (for lack of KV blocks;
    they are recomputed) and its engine's `StepTotals`. Decode: sequences running (or waiting to
    run) and receiving KV. Prefill: prompt tokens queued and transfers still sending."""

    free_blocks: int
    num_blocks: int
    running: int = 0
    receiving: int = 0
    queued_tokens: int = 0
    sending: int = 0
    threads: int = 0
    preemptions: int = 0
    steps: StepTotals = StepTotals()


@dataclass(frozen=True)
class FeedEntry:
    """One item of a decode worker's feed (`DecodeWorker.drain`): its number in the feed (from 1,
    increasing), the request it belongs to, and the item."""

    seq: int
    request_id: str
    item: StreamItem


@dataclass(frozen=True)
class PrefillResult:
    """A prefill worker's answer: the first token, seconds from call to first token, the
    connector's handoff for the decode worker's `start_remote` (None where it needs none), and the
    first token's log-probabilities (None unless the request asked: `SamplingParams.logprobs`)."""

    first_token: int
    prefill_s: float
    handoff: object | None = None
    first_logprob: TokenLogprob | None = None


@dataclass(frozen=True)
class StreamItem:
    """One piece of a request's stream on a decode worker: the tokens of one engine step (with their
    text, stop strings applied). `finish_reason` is set on the last item only ("stop", "length",
    "abort"); an item with an `error` is always the last. `transfer_s`: on the first item of the
    remote path, how long the KV was still in flight after prefill. `cached_tokens`: prompt tokens
    served from the prefix cache, on items from engine steps. `logprobs`: one per token of
    `token_ids`, in order, when the request asked (`SamplingParams.logprobs`); else empty."""

    token_ids: tuple[int, ...] = ()
    text: str = ""
    finish_reason: str | None = None
    error: WorkerError | None = None
    transfer_s: float | None = None
    cached_tokens: int | None = None
    logprobs: tuple[TokenLogprob, ...] = ()

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    @classmethod
    def failed(cls, kind: ErrorKind, message: str) -> StreamItem:
        """The last item of a request that ends with an error."""
        return cls(finish_reason="abort", error=WorkerError(kind, message))
