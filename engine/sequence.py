"""A request inside the engine: its tokens, its KV blocks and its state.

Lifecycle (only the scheduler changes `status`):
1. WAITING: added, or preempted (its blocks freed; it is recomputed on re-admission).
   RECEIVING (decode side of a remote prefill): blocks reserved, the prompt's KV arriving.
2. RUNNING: blocks allocated; prefilled in chunks of steps (a token is sampled once the whole
   prompt's KV is computed), then one token per step.
   HELD (prefill side of a remote prefill): prefilled, first token sampled, blocks kept
   until the KV has been sent and the owner releases it.
3. FINISHED: stopped by EOS, a stop token or string, max_tokens, the context limit, or an abort.
"""
from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any

from engine.sampling_params import SamplingParams


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RECEIVING = "receiving"
    RUNNING = "running"
    HELD = "held"
    FINISHED = "finished"


class FinishReason(str, enum.Enum):
    STOP = "stop"
    LENGTH = "length"
    ABORT = "abort"


@dataclass(eq=False)
class Sequence:
    """One request's tokens (prompt then output) and its place in the KV pool."""

    request_id: str
    prompt_token_ids: list[int]
    sampling: SamplingParams
    arrival_time: float = 0.0
    token_ids: list[int] = field(default_factory=list)
    status: SequenceStatus = SequenceStatus.WAITING
    finish_reason: FinishReason | None = None
    block_table: list[int] = field(default_factory=list)
    num_cached_tokens: int = 0  # prompt tokens whose KV came from the prefix cache
    num_computed_tokens: int = 0  # leading tokens whose KV sits in the pool (cached ones included)
    num_preemptions: int = 0
    prefill_only: bool = False  # remote prefill: hold the blocks after the first token
    sample_seed: int | None = None  # the sampler's per-request seed; opaque to the scheduler
    detok: Any = None  # incremental detokenizer state; opaque to the scheduler
    grammar: Any = None  # structured output's matcher on this worker (engine.grammar); dropped when it ends

    def __post_init__(self) -> None:
        if not self.token_ids:
            self.token_ids = list(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens:]

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - len(self.prompt_token_ids)

    @property
    def num_uncomputed(self) -> int:
        """Tokens whose KV is still to compute: 1 while decoding (the newest token), more while prefilling."""
        return len(self.token_ids) - self.num_computed_tokens

    @property
    def last_token_id(self) -> int:
        return self.token_ids[-1]

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED
