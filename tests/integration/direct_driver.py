"""Test driver: runs one request on the workers it is told to use, either path, with plain blocking Ray
calls and no router (no placement, retries or booking). Tests of the worker protocol use it; the product
path is `router.request.RouterStream`.

Remote prefill (disaggregated):
1. decode worker D reserves blocks for the prompt (its prefix cache may hold the first ones) and posts
   the receive (refusal: CapacityError);
2. prefill worker P prefills (batched with other prompts), ships the KV D lacks layer by layer, returns
   the first token;
3. D starts the sequence once every layer landed; tokens stream back from D.
Local prefill: D runs the whole request.
"""
from __future__ import annotations

import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field

import ray

from engine import SamplingParams
from engine.logprobs import TokenLogprob
from router.pools import Pools
from worker_core.protocol import PrefillResult, StreamItem


class RequestFailed(RuntimeError):
    """A request ended with an error on a worker (e.g. a failed KV transfer)."""


@dataclass
class Result:
    request_id: str
    token_ids: list[int]
    finish_reason: str | None
    prefill_s: float | None  # remote path: time the prefill worker took to return the first token
    transfer_s: float | None  # remote path: KV still in flight after that, before decoding could start
    logprobs: list[TokenLogprob] = field(default_factory=list)  # one per token, when the request asked


class Orchestrator:
    """Args: pools: the live workers."""

    def __init__(self, pools: Pools) -> None:
        self.pools = pools

    def stream(self, prompt: list[int], sampling: SamplingParams, remote: bool = True, prefill: int = 0,
               decode: int = 0, request_id: str | None = None) -> Iterator[tuple[StreamItem, float | None]]:
        """Yield the decode worker's stream items, each with the prefill time (the remote path's
        first item only; None otherwise)."""
        rid = request_id or uuid.uuid4().hex
        d = self.pools.decode[decode]
        prefill_s = None
        if remote:
            p = self.pools.prefill[prefill]
            held = ray.get(d.reserve.remote(rid, prompt, sampling, self.pools.prefill_peers[prefill]))
            try:  # as the router does: the prefill worker ships only the blocks the decode worker lacks
                first: PrefillResult = ray.get(p.prefill.remote(rid, prompt, sampling, self.pools.decode_peers[decode],
                                                                skip_blocks=held))
            except Exception:
                ray.get(d.abort.remote(rid))
                raise
            prefill_s = first.prefill_s
            ray.get(d.start_remote.remote(rid, first.first_token, first.handoff, first.first_logprob))
        else:
            ray.get(d.submit_local.remote(rid, prompt, sampling))
        for ref in d.stream.options(num_returns="streaming").remote(rid):
            item: StreamItem = ray.get(ref)
            if item.error is not None:
                raise RequestFailed(f"request {rid}: {item.error.kind.value}: {item.error.message}")
            yield item, prefill_s
            prefill_s = None

    def generate(self, prompt: list[int], sampling: SamplingParams, **kw: object) -> Result:
        """Run a request to completion. Raises RequestFailed or the worker's own error."""
        tokens: list[int] = []
        logprobs: list[TokenLogprob] = []
        reason = prefill_s = transfer_s = None
        rid = kw.pop("request_id", None) or uuid.uuid4().hex
        for item, took in self.stream(prompt, sampling, request_id=rid, **kw):  # type: ignore[arg-type]
            tokens += item.token_ids
            logprobs += item.logprobs
            reason = item.finish_reason
            prefill_s = took if took is not None else prefill_s
            transfer_s = item.transfer_s if item.transfer_s is not None else transfer_s
        return Result(rid, tokens, reason, prefill_s, transfer_s, logprobs)
