"""One sampled token's log-probability and the likeliest alternatives, as a request asked for them.

Which log-probabilities: the log-softmax, in float32, of the model's raw logits for that position,
before the request's penalties, `min_tokens` masking, temperature, top-k / top-p / min-p (what vLLM
reports by default, its `raw_logprobs` mode). So they describe the model, the same for a greedy and a
sampled request, and the chosen token need not be the likeliest when penalties moved it.

A request gets them when its `SamplingParams.logprobs` is set (0: the chosen token only; k: also the
k likeliest tokens). The engine's step computes them for those requests only; they travel with the
tokens (`RequestOutput`, the workers' `PrefillResult` and `StreamItem`, the router's `Chunk`), one per
token, in the same order. Plain Python (no torch), so every process can import it.
"""
from __future__ import annotations

from dataclasses import dataclass

MAX_LOGPROBS = 20  # most alternatives a request may ask for (OpenAI's top_logprobs limit)


@dataclass(frozen=True)
class TokenLogprob:
    """token_id: the sampled token; logprob: its log-probability; top_ids / top_logprobs: the k
    likeliest tokens and theirs, likeliest first (empty when the request asked for 0)."""

    token_id: int
    logprob: float
    top_ids: tuple[int, ...] = ()
    top_logprobs: tuple[float, ...] = ()

    def __post_init__(self) -> None:
        if len(self.top_ids) != len(self.top_logprobs):
            raise ValueError(f"top_ids ({len(self.top_ids)}) and top_logprobs ({len(self.top_logprobs)}) "
                             "must have the same length")
