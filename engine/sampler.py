"""Turns logits into tokens: greedy, or temperature / top-k / top-p with a per-request RNG."""
from __future__ import annotations

import random

import torch

from engine.sequence import Sequence


class Sampler:
    """Args: seed: engine seed; requests without their own seed draw one from it."""

    def __init__(self, seed: int = 0) -> None:
        self._seeds = random.Random(seed)

    def sample(self, logits: torch.Tensor, seqs: list[Sequence]) -> list[int]:
        """One token per row of `logits` [B, V]."""
        tokens = logits.max(dim=-1).indices.tolist()  # first maximum, like argmax; faster on bf16 CPU
        for i, seq in enumerate(seqs):
            if not seq.sampling.greedy:
                tokens[i] = self._sample_one(logits[i].float().cpu(), seq)
        return tokens

    def _sample_one(self, logits: torch.Tensor, seq: Sequence) -> int:
        sp = seq.sampling
        if seq.generator is None:
            seed = sp.seed if sp.seed is not None else self._seeds.getrandbits(63)
            seq.generator = torch.Generator().manual_seed(seed)
        logits = logits / sp.temperature
        if 0 < sp.top_k < logits.shape[-1]:
            kth = torch.topk(logits, sp.top_k).values[-1]
            logits = logits.masked_fill(logits < kth, float("-inf"))
        if sp.top_p < 1.0:
            sorted_logits, order = torch.sort(logits, descending=True)
            probs = sorted_logits.softmax(-1)
            drop = probs.cumsum(-1) - probs > sp.top_p  # keep the first token always
            logits = logits.scatter(0, order[drop], float("-inf"))
        probs = logits.softmax(-1)
        return int(torch.multinomial(probs, 1, generator=seq.generator))
