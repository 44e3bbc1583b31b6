"""`Router`: the facade the API servers call; each step of a request is done by its own module.

Request lifecycle in `Router.submit`:
1. Admission (`router/admission.py`): mint the request id, check the model name, tokenize,
   validate (errors name the field), work out the policy's features.
2. Placement and booking (`router/placer.py`): the policy places the request; with no decode
   worker that has room it waits in the wait queue (`router/wait_queue.py`), bounded, or gets
   "overloaded". The worst-case KV blocks are booked on the decode worker.
3. The request driver (`router/request.py`) runs it on the workers and streams its chunks; it
   hands the booking back to the placer when the request ends.
Alongside: health polling and worker replacement (`router/health.py`), and the role split an
operator pins (`split`, `set_split`: `router/split.py`, applied by the placer).
"""
from __future__ import annotations

import time
import uuid
from collections.abc import Callable
from pathlib import Path

from transformers import PreTrainedTokenizerBase

from engine.errors import InvalidRequestError
from router.admission import Admission, ModelLimits
from router.book import PoolBook
from router.config import RouterConfig
from router.cost_model import CostModel
from router.elastic import Elastic
from router.feed import Feeds
from router.health import HealthMonitor
from router.metrics import Metrics
from router.placer import Placer
from router.policy import OutputLengthEstimator
from router.pools import Pools
from router.request import RouterStream
from router.split import RoleSplit
from router.types import DeadlineExceeded, GenerateRequest, ModelCard, ModelNotFoundError, OverloadedError, Runtime
from worker_core.protocol import WorkerInfo

# Counted in pdserve_request_errors_total by the label on the right when `submit` refuses a request.
_REFUSALS: tuple[tuple[type[Exception], str], ...] = (
    (ModelNotFoundError, "model_not_found"), (InvalidRequestError, "invalid_request"),
    (OverloadedError, "overloaded"), (DeadlineExceeded, "deadline"))


class Router:
    """Implements `router.types.RouterAPI` over live pools. Create and use it inside one event loop.

    Args:
        pools: the workers; prefill_infos / decode_infos: each worker's `info()`, index-aligned with
        the pools; tokenizer: the model's tokenizer (None: token-id prompts only); model_dir: the
        served model; config: router settings; cost: the calibrated cost model; metrics: where to count;
        respawn: `respawn(pool, index)` replaces a dead worker and returns its `info()` (blocking;
            run in a thread); None: dead workers stay out of rotation.
        lender: lends idle prefill workers' threads to the decode workers on their nodes; None: no lending
            (`config.flip_roles` flips idle prefill workers to decode instead).
    """

    def __init__(self, pools: Pools, prefill_infos: list[WorkerInfo], decode_infos: list[WorkerInfo],
                 tokenizer: PreTrainedTokenizerBase | None, model_dir: Path, config: RouterConfig,
                 cost: CostModel, metrics: Metrics | None = None,
                 respawn: Callable[[str, int], WorkerInfo] | None = None, lender: Elastic | None = None) -> None:
        limits = ModelLimits.from_infos(prefill_infos, decode_infos)
        self.pools, self.config, self.cost = pools, config, cost
        self.model_name = config.served_model_name or Path(model_dir).name
        self.metrics = metrics or Metrics(model_name=self.model_name)
        self.max_model_len = limits.max_model_len
        chooser = [*prefill_infos, *decode_infos][0]  # the first worker started chose the dtype
        self.runtime = Runtime.from_info(decode_infos[0], chooser.dtype_reason)
        estimator = OutputLengthEstimator()
        self.admission = Admission(tokenizer, self.model_name, limits, config.default_max_tokens, estimator)
        self.placer = Placer(prefill_infos, decode_infos, limits, config, cost, self.metrics, estimator, lender)
        self.health = HealthMonitor(pools, self.placer, config, self.metrics, respawn)
        self.feeds = Feeds(observe=self.metrics.feed_items.observe)
        self.metrics.observe_split(self.placer.split())
        self._created = int(time.time())

    @property
    def book(self) -> PoolBook:
        """The placer's book (read it, never change it: the placer owns it)."""
        return self.placer.book

    # -- RouterAPI ---------------------------------------------------------------------------------
    async def submit(self, request: GenerateRequest) -> RouterStream:
        arrival = time.perf_counter()
        try:
            admitted = await self.admission.admit(request)
            booking = await self.placer.place(admitted.features, admitted.deadline, admitted.prompt)
        except tuple(cls for cls, _ in _REFUSALS) as e:
            self.metrics.errors.labels(next(label for cls, label in _REFUSALS if isinstance(e, cls))).inc()
            raise
        rid = f"{request.request_id or 'req'}-{uuid.uuid4().hex[:12]}"
        return RouterStream(rid, self.pools, self.feeds, booking, admitted.prompt, admitted.sampling, arrival,
                            self.metrics, self.placer, admitted.deadline)

    def models(self) -> list[ModelCard]:
        return [ModelCard(self.model_name, self._created, "pdserve", self.max_model_len, self.runtime)]

    def tokenize(self, request: GenerateRequest) -> list[int]:
        self.admission.check_model(request.model)
        return self.admission.tokenize(request)

    def detokenize(self, token_ids: list[int], model: str | None) -> str:
        self.admission.check_model(model)
        return self.admission.detokenize(token_ids)

    def cost_model(self) -> dict:
        return self.cost.to_dict()

    def healthy(self) -> bool:
        return self.placer.healthy()

    def metrics_text(self) -> tuple[bytes, str]:
        return self.metrics.exposition()

    def split(self) -> RoleSplit:
        return self.placer.split()

    def set_split(self, prefill: int | None) -> RoleSplit:
        return self.placer.pin_split(prefill)

    # -- worker health -----------------------------------------------------------------------------
    def start_polling(self) -> None:
        """Refresh per-worker gauges and health every `load_poll_s` (call inside the serving loop)."""
        self.health.start()

    async def stop_polling(self) -> None:
        """Stop the health polling and the token feeds."""
        await self.health.stop()
        await self.feeds.close()

    async def poll_once(self) -> None:
        await self.health.poll_once()
