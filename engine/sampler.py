"""Turns logits into tokens: greedy, or temperature / top-k / top-p with a per-request seed.

The draw for a request's i-th output token comes from a generator seeded with (request seed, i)
alone (`token_seed`), not from a generator that advances with each token: any worker that samples
token i of a request samples it the same way. So a seeded request gives the same tokens whether its
first token is sampled on a prefill worker and the rest on a decode worker, or all on one, and
after its stream moved to another worker mid-way (`SamplingParams.prior_output_tokens`).

`logprobs` gives the requests that asked (`SamplingParams.logprobs`) their token's log-probability
and the top k: the float32 log-softmax of the raw logits (before penalties and temperature; see
`engine.logprobs`), top-k taken on the tensor, so only k + 1 numbers per row reach Python. A batch
where no request asked costs nothing more.

Structured output (`SamplingParams.json_schema` / `structural_tag`): the grammar's mask is applied last
in `_adjust` (after penalties and `logit_bias`, before temperature / top-k / top-p), and the picked token goes to the
request's matcher at once, so the stop check sees a completed JSON in the same step (`engine.grammar`).

A row fails alone: extreme but valid settings (a repetition penalty near 0 divides logits by it) are
kept finite (NaN never wins, +inf becomes the largest float), and a row that still cannot give a token
(no finite logit, a grammar that refuses the pick) gets a `SamplingError` in its place, for the engine
to fail that request only.
"""
from __future__ import annotations

import hashlib
import logging
import random

import torch

from engine import kernels
from engine.errors import SamplingError
from engine.grammar import Grammars
from engine.logprobs import TokenLogprob
from engine.sequence import Sequence

log = logging.getLogger(__name__)


class Sampler:
    """Args: seed: engine seed; requests without their own seed draw one from it. eos_ids: the
    model's end tokens, masked out with the stop token ids until a request's `min_tokens`. grammars:
    the engine's grammar compiler, for requests with a `json_schema` or `structural_tag` (None: the
    engine has no tokenizer; it refuses a json_schema, and a structural_tag's row fails)."""

    def __init__(self, seed: int = 0, eos_ids: frozenset[int] = frozenset(), grammars: Grammars | None = None) -> None:
        self._seeds = random.Random(seed)
        self._eos_ids = eos_ids
        self._grammars = grammars

    def sample(self, logits: torch.Tensor, seqs: list[Sequence]) -> list[int | SamplingError]:
        """One token per row of `logits` [B, V], or the `SamplingError` of a row that has none."""
        tokens: list[int | SamplingError] = kernels.argmax(logits).tolist()  # first maximum, like argmax
        for i, seq in enumerate(seqs):
            sp = seq.sampling
            if sp.greedy and not sp.adjusts_logits:
                continue
            try:
                tokens[i] = self._pick(logits[i].float().cpu(), seq)
            except SamplingError as e:  # this request's row only: the rest of the step goes on
                tokens[i] = e
            except Exception as e:  # unforeseen: the same, with its traceback in the log
                log.exception("sampling request %s failed", seq.request_id)
                tokens[i] = SamplingError(f"{type(e).__name__}: {e}")
        return tokens

    def _pick(self, row: torch.Tensor, seq: Sequence) -> int:
        sp = seq.sampling
        if sp.adjusts_logits:
            row = _finite(self._adjust(row, seq))
        token = int(row.argmax()) if sp.greedy else self._sample_one(row, seq)
        if sp.constrained and self._grammars is not None:
            self._grammars.accept(seq, token)
        return token

    @staticmethod
    def logprobs(logits: torch.Tensor, seqs: list[Sequence], tokens: list[int]) -> list[TokenLogprob | None]:
        """Per row of `logits` [B, V]: the log-probability of `tokens[i]` and the top
        `seqs[i].sampling.logprobs`, or None where the request did not ask (all None: nothing computed)."""
        rows = [i for i, seq in enumerate(seqs) if seq.sampling.logprobs is not None]
        out: list[TokenLogprob | None] = [None] * len(seqs)
        if not rows:
            return out
        index = torch.tensor(rows, dtype=torch.long, device=logits.device)
        lp = torch.log_softmax(logits.index_select(0, index).float(), dim=-1)
        chosen_ids = torch.tensor([tokens[i] for i in rows], dtype=torch.long, device=logits.device)
        chosen = lp.gather(1, chosen_ids[:, None])[:, 0].tolist()
        k = max(seqs[i].sampling.logprobs for i in rows)
        top_lp, top_ids = [[]] * len(rows), [[]] * len(rows)
        if k:
            values, ids = lp.topk(min(k, lp.shape[-1]), dim=-1)
            top_lp, top_ids = values.tolist(), ids.tolist()
        for j, i in enumerate(rows):
            n = seqs[i].sampling.logprobs
            out[i] = TokenLogprob(tokens[i], chosen[j], tuple(top_ids[j][:n]), tuple(top_lp[j][:n]))
        return out

    def _adjust(self, logits: torch.Tensor, seq: Sequence) -> torch.Tensor:
        """Penalties, `logit_bias`, `min_tokens` and the grammar's mask on one row of fp32 logits. The
        output is what the request generated, earlier workers' part included (`prior_output_tokens`)."""
        sp = seq.sampling
        generated = seq.num_output_tokens + sp.prior_output_tokens
        output = torch.tensor(seq.token_ids[len(seq.token_ids) - generated:], dtype=torch.long)
        logits = logits.clone()
        if sp.repetition_penalty != 1.0:
            seen = torch.tensor(sorted(set(seq.token_ids)), dtype=torch.long)
            picked = logits[seen]
            logits[seen] = torch.where(picked > 0, picked / sp.repetition_penalty, picked * sp.repetition_penalty)
        if (sp.presence_penalty or sp.frequency_penalty) and len(output):
            counts = torch.bincount(output, minlength=logits.shape[-1])[:logits.shape[-1]].to(logits.dtype)
            logits -= sp.frequency_penalty * counts + sp.presence_penalty * (counts > 0).to(logits.dtype)
        if sp.logit_bias:
            ids, biases = zip(*sp.logit_bias)
            logits[torch.tensor(ids, dtype=torch.long)] += torch.tensor(biases, dtype=logits.dtype)
        if generated < sp.min_tokens:
            ends = set(sp.stop_token_ids) | (set() if sp.ignore_eos else set(self._eos_ids))
            ends = [t for t in ends if t < logits.shape[-1]]
            if ends:
                logits[torch.tensor(ends, dtype=torch.long)] = float("-inf")
        if sp.constrained:
            if self._grammars is None:
                raise SamplingError("the request's grammar needs the engine's tokenizer, and it has none")
            self._grammars.mask(logits, seq, output.tolist())
        return logits

    def _sample_one(self, logits: torch.Tensor, seq: Sequence) -> int:
        sp = seq.sampling
        if seq.sample_seed is None:  # a request without a seed of its own draws one from the engine's
            seq.sample_seed = sp.seed if sp.seed is not None else self._seeds.getrandbits(63)
        generator = torch.Generator().manual_seed(token_seed(seq.sample_seed,
                                                             sp.prior_output_tokens + seq.num_output_tokens))
        logits = _finite(logits / sp.temperature)
        if 0 < sp.top_k < logits.shape[-1]:
            kth = torch.topk(logits, sp.top_k).values[-1]
            logits = logits.masked_fill(logits < kth, float("-inf"))
        if sp.top_p < 1.0:
            sorted_logits, order = torch.sort(logits, descending=True)
            probs = sorted_logits.softmax(-1)
            drop = probs.cumsum(-1) - probs > sp.top_p  # keep the first token always
            logits = logits.scatter(0, order[drop], float("-inf"))
        probs = logits.softmax(-1)
        if sp.min_p > 0:
            probs = probs.masked_fill(probs < sp.min_p * probs.max(), 0.0)  # the likeliest always stays
        return int(torch.multinomial(probs, 1, generator=generator))


def _finite(logits: torch.Tensor) -> torch.Tensor:
    """`logits` with NaN as -inf and +inf as the largest float. Raises SamplingError: no finite value left."""
    logits = torch.nan_to_num(logits, nan=float("-inf"), posinf=torch.finfo(logits.dtype).max)
    if not bool(torch.isfinite(logits).any()):
        raise SamplingError("no token can be picked: every logit is -inf or NaN after the request's adjustments")
    return logits


def token_seed(seed: int, index: int) -> int:
    """The seed of the draw for output token `index` of a request seeded with `seed` (63 bits)."""
    digest = hashlib.blake2b(f"{seed}:{index}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1
