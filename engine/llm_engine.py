"""The engine: one step is schedule → run → postprocess.

Request lifecycle:
1. `add_request`: validate, tokenize (chat template for messages), queue as WAITING.
2. `step` (prefill): the scheduler admits it with blocks (reusing a cached prefix); the
   runner computes the uncached prompt tokens in chunks, one per step, next to the running
   batch's decode tokens; after the last chunk the sampler picks the first token (and, when
   the request asked, its log-probabilities: `RequestOutput.logprobs`).
3. `step` (decode): one token per step in the running batch, sequences joining and
   leaving between steps.
4. The stop check finishes it (EOS, stop token or string, max_tokens, context limit),
   or `abort` does; its blocks return to the pool in the same step.
"""
from __future__ import annotations

import dataclasses
import itertools
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from engine import fused_layers, packed_linear
from engine.allocator import keep_large_allocations
from engine.auto_dtype import load_for
from engine.block_manager import BlockManager
from engine.chat_template import use_chat_template
from engine.config import EngineConfig, KVLayout
from engine.detokenizer import StopChecker
from engine.errors import CapacityError, InvalidRequestError, SamplingError
from engine.grammar import Grammars
from engine.hardware import DtypeChoice
from engine.logprobs import TokenLogprob
from engine.model_loader import dtype_name, encode_prompt, eos_token_ids, max_context
from engine.model_runner import ModelRunner, kv_shape
from engine.sampler import Sampler
from engine.sampling_params import SamplingParams
from engine.scheduler import Batch, Scheduler
from engine.sequence import FinishReason, Sequence

Prompt = str | list[int] | list[dict]


@dataclass
class RequestOutput:
    """What a step produced for one request."""

    request_id: str
    new_token_ids: list[int]
    new_text: str
    finished: bool
    finish_reason: str | None
    num_prompt_tokens: int
    num_cached_tokens: int
    output_token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprob] = field(default_factory=list)  # one per new token, when the request asked
    error: str | None = None  # the request failed in this step (no token could be picked); it is aborted


@dataclass(frozen=True)
class Reservation:
    """Decode side of a remote prefill: `cached_blocks` leading blocks of the prompt are already here
    (prefix cache hits, held by the request, so never evicted under it); `blocks` are the rest, in
    order, for the prompt's KV to land in. The sender ships its blocks from `cached_blocks` on."""

    blocks: list[int]
    cached_blocks: int


@dataclass
class EngineStats:
    """Counters since start: phase time and tokens, for the phase split users come to see."""

    prefill_seconds: float = 0.0
    decode_seconds: float = 0.0
    prefill_tokens: int = 0  # prompt tokens computed (cached prefix tokens excluded)
    decode_tokens: int = 0  # in decode and mixed steps
    ride_tokens: int = 0  # decode tokens of mixed steps (they rode along a prompt chunk)
    prefill_steps: int = 0  # steps that computed prompt chunks
    decode_steps: int = 0  # steps of decode tokens only
    decode_context: int = 0  # tokens of context the decode-only steps' sequences held, summed over those steps
    mixed_steps: int = 0  # prefill steps that also decoded running sequences


class LLMEngine:
    """Runs requests to completion with continuous batching over a paged KV cache.

    Args:
        config: engine configuration.
        model: an already loaded model (tests); None loads `config.model`.
        tokenizer: its tokenizer; None with a given model means token-id prompts only.
    """

    def __init__(self, config: EngineConfig, model: PreTrainedModel | None = None,
                 tokenizer: PreTrainedTokenizerBase | None = None) -> None:
        self.config = config
        if config.device == "cpu":
            keep_large_allocations()
            if config.num_threads:
                torch.set_num_threads(config.num_threads)
        if model is None:
            model, tokenizer, self.dtype_choice = load_for(config.dtype, config.model, config.device)
        else:
            self.dtype_choice = DtypeChoice(dtype_name(model), "the given model's")
        self.config = config = dataclasses.replace(config, dtype=self.dtype_choice.dtype)
        if config.chat_template is not None:  # checked and in place before the first chat prompt
            use_chat_template(tokenizer, config.chat_template)
        self.tokenizer = tokenizer
        self.vocab_size = model.get_output_embeddings().out_features
        self.max_model_len = min(config.max_model_len or max_context(model), max_context(model))
        layers, kv_heads, head_dim = kv_shape(model)
        dtype_bytes = next(model.parameters()).element_size()
        self.layout = KVLayout.from_budget(layers, kv_heads, head_dim, dtype_bytes, config.cache)
        self.block_manager = BlockManager(self.layout.num_blocks, self.layout.block_size,
                                          config.cache.enable_prefix_caching)
        eos_ids = eos_token_ids(model, tokenizer)
        self.stop_checker = StopChecker(eos_ids, self.max_model_len, tokenizer)
        self.scheduler = Scheduler(self.block_manager, config.max_num_seqs, config.max_num_batched_tokens,
                                   self.stop_checker, config.prefill_chunk_tokens)
        self.linear_choice = packed_linear.apply(model, config.linear, config.device)
        fused_layers.fuse(model)
        self.runner = ModelRunner(model, self.layout, compile=config.compile)
        self.grammars = Grammars(tokenizer, self.vocab_size, eos_ids) if tokenizer is not None else None
        self.sampler = Sampler(config.seed, eos_ids, self.grammars)
        self.stats = EngineStats()
        self._ids = itertools.count()
        self._batch_seqs: list[Sequence] = []  # the step's prompts that finish, for the prefill layer hook

    # -- requests ----------------------------------------------------------------------------
    def tokenize(self, prompt: Prompt, chat: bool = False) -> list[int]:
        """Token ids for a prompt given as text, chat messages, or token ids."""
        if isinstance(prompt, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
            return list(prompt)
        if self.tokenizer is None:
            raise InvalidRequestError("prompt", "this engine has no tokenizer; give a list of token ids")
        if isinstance(prompt, str) or (isinstance(prompt, list) and all(isinstance(m, dict) for m in prompt)):
            return encode_prompt(self.tokenizer, prompt, chat)
        raise InvalidRequestError("prompt", "must be a string, a list of token ids, or a list of chat messages")

    def add_request(self, prompt: Prompt, sampling: SamplingParams | None = None, request_id: str | None = None,
                    chat: bool = False, prefill_only: bool = False) -> str:
        """Queue a request. Returns its id. Raises InvalidRequestError naming the bad field.

        `prefill_only` (prefill worker): stop after the first token and hold the prompt's blocks
        until `release`, so their KV can be sent."""
        seq = self._new_sequence(prompt, sampling, request_id, chat)
        seq.prefill_only = prefill_only
        self.scheduler.add(seq)
        return seq.request_id

    def reserve(self, prompt: list[int], sampling: SamplingParams, request_id: str,
                reuse: bool = True) -> Reservation:
        """Decode side of a remote prefill: reserve blocks for the prompt's KV, which arrives from
        elsewhere, reusing the prompt's cached prefix (not without `reuse`: all of it arrives). Returns
        the reservation (the blocks to receive into). Raises CapacityError when full."""
        seq = self._new_sequence(prompt, sampling, request_id, chat=False)
        if not self.scheduler.reserve(seq, reuse):
            need = self.block_manager.blocks_needed(seq.num_tokens)
            raise CapacityError(f"no room for {request_id!r}: it needs {need} KV blocks and a sequence slot, "
                                f"{self.block_manager.num_free_blocks} blocks free; try another worker or later")
        cached = seq.num_cached_tokens // self.block_manager.block_size
        return Reservation(list(seq.block_table[cached:]), cached)

    def activate(self, request_id: str, first_token: int, logprob: TokenLogprob | None = None) -> RequestOutput:
        """The reserved request's KV has landed: it joins the decode batch after `first_token` (with its
        `logprob` from the prefill worker, when the request asked)."""
        return self._output(self.scheduler.activate(request_id, first_token), [first_token], logprob)

    def held_blocks(self, request_id: str) -> list[int]:
        """Prefill side: the blocks holding a prefill-only request's prompt KV."""
        return list(self.scheduler.held[request_id].block_table)

    def release(self, request_id: str) -> None:
        """Prefill side: the KV has been sent; free the request's blocks."""
        self.scheduler.release(request_id)

    def set_prefill_layer_hook(self, hook: Callable[[int, list[Sequence]], None]) -> None:
        """Call `hook(layer, seqs)` after each layer of every step that computes prompt chunks, with the
        sequences whose prompt that step completes (see ModelRunner.set_layer_hook)."""
        self.runner.set_layer_hook(lambda layer: hook(layer, self._batch_seqs))

    def _new_sequence(self, prompt: Prompt, sampling: SamplingParams | None, request_id: str | None,
                      chat: bool) -> Sequence:
        sampling = sampling or SamplingParams()
        ids = self.tokenize(prompt, chat)
        self._validate(ids, sampling)
        request_id = request_id if request_id is not None else f"req-{next(self._ids)}"
        if self.scheduler.find(request_id) is not None:
            raise InvalidRequestError("request_id", f"{request_id!r} is already running; ids must be unique")
        seq = Sequence(request_id, ids, sampling, arrival_time=time.monotonic())
        self.stop_checker.start(seq)
        return seq

    def _validate(self, ids: list[int], sampling: SamplingParams) -> None:
        if not ids:
            raise InvalidRequestError("prompt", "must not be empty")
        if len(ids) >= self.max_model_len:
            raise InvalidRequestError("prompt", f"has {len(ids)} tokens; the context allows at most "
                                                f"{self.max_model_len - 1} (max_model_len={self.max_model_len})")
        bad = next((t for t in ids if not 0 <= t < self.vocab_size), None)
        if bad is not None:
            raise InvalidRequestError("prompt", f"token id {bad} is outside [0, {self.vocab_size})")
        bad = next((t for t, _ in sampling.logit_bias if t >= self.vocab_size), None)
        if bad is not None:
            raise InvalidRequestError("logit_bias", f"token id {bad} is outside [0, {self.vocab_size})")
        if sampling.stop and self.tokenizer is None:
            raise InvalidRequestError("stop", "stop strings need a tokenizer; use stop_token_ids")
        if sampling.json_schema is not None:
            if self.grammars is None:
                raise InvalidRequestError("response_format", "structured output needs a tokenizer")
            self.grammars.compile(sampling.json_schema)  # refused here, not in a step; compiled once per schema
        if sampling.structural_tag is not None:
            if self.grammars is None:
                raise InvalidRequestError("structural_tag", "a structural tag needs a tokenizer")
            self.grammars.compile_structural_tag(sampling.structural_tag)  # likewise
        worst = min(len(ids) + sampling.max_tokens, self.max_model_len)
        need, have = self.block_manager.blocks_needed(worst), self.block_manager.num_blocks
        if need > have:
            raise InvalidRequestError(
                "max_tokens", f"prompt ({len(ids)} tokens) + max_tokens ({sampling.max_tokens}) needs {need} KV "
                f"blocks; the KV budget holds {have} blocks of {self.layout.block_size} tokens "
                f"({have * self.layout.block_size} tokens). Shorten the request or raise the KV memory budget")

    def abort(self, request_id: str) -> bool:
        """Stop a request wherever it is; its blocks are freed now. Returns whether it was found."""
        return self.scheduler.abort(request_id) is not None

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    def describe(self) -> dict:
        """Static facts a router plans with: KV geometry, limits, vocabulary size; and what runs them
        (dtype and why, decode attention kernel, compiled or eager), for logs and status."""
        layout = self.layout
        return {"num_blocks": layout.num_blocks, "block_size": layout.block_size,
                "kv_bytes_per_token": layout.bytes_per_block // layout.block_size, "num_layers": layout.num_layers,
                "max_num_seqs": self.config.max_num_seqs, "max_model_len": self.max_model_len,
                "prefill_chunk_tokens": self.scheduler.prefill_chunk_tokens,
                "vocab_size": self.vocab_size, "dtype": self.config.dtype, "dtype_reason": self.dtype_choice.reason,
                "attention": self.runner.attention_kernel, "compiled": self.runner.compiled,
                "linear": self.linear_choice.summary()}

    # -- the step ------------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """Schedule → run → postprocess. Returns one output per sequence that got a token (decoding
        ones and prompts whose last chunk ran; a step of only partial chunks returns none)."""
        batch = self.scheduler.schedule()
        if batch is None:
            return []
        t0 = time.perf_counter()
        sampled = batch.sampled
        self._batch_seqs = [c.seq for c in batch.prefill if c.final]
        logits = self.runner.run(batch.decode, batch.prefill)
        picked = self.sampler.sample(logits, sampled) if sampled else []
        failed = {seq.request_id: str(p) for seq, p in zip(sampled, picked) if isinstance(p, SamplingError)}
        for rid in failed:  # that request alone ends: aborted before `update`, which then skips it
            self.scheduler.abort(rid)
        tokens = [p if isinstance(p, int) else 0 for p in picked]
        logprobs = self.sampler.logprobs(logits, sampled, tokens) if sampled else []
        self._account(batch, time.perf_counter() - t0)
        self.scheduler.update(batch, tokens)
        return [self._output(seq, [tok], lp) if seq.request_id not in failed else
                self._failed(seq, failed[seq.request_id]) for seq, tok, lp in zip(sampled, tokens, logprobs)]

    def _account(self, batch: Batch, seconds: float) -> None:
        """A step with prompt chunks counts as prefill time (its decode tokens ride along), one
        without as decode time."""
        s = self.stats
        s.decode_tokens += len(batch.decode)
        s.prefill_tokens += batch.num_prefill_tokens
        if batch.is_prefill:
            s.prefill_seconds += seconds
            s.prefill_steps += 1
            s.mixed_steps += bool(batch.decode)
            s.ride_tokens += len(batch.decode)
        else:
            s.decode_seconds += seconds
            s.decode_steps += 1
            s.decode_context += sum(seq.num_tokens for seq in batch.decode)

    def _output(self, seq: Sequence, new_ids: list[int], logprob: TokenLogprob | None = None) -> RequestOutput:
        text = seq.detok.take(final=seq.is_finished) if seq.detok is not None else ""
        reason = seq.finish_reason.value if seq.finish_reason is not None else None
        return RequestOutput(seq.request_id, new_ids, text, seq.is_finished, reason, seq.num_prompt_tokens,
                             seq.num_cached_tokens, seq.output_token_ids if seq.is_finished else [],
                             [logprob] if logprob is not None else [])

    @staticmethod
    def _failed(seq: Sequence, error: str) -> RequestOutput:
        return RequestOutput(seq.request_id, [], "", True, FinishReason.ABORT.value, seq.num_prompt_tokens,
                             seq.num_cached_tokens, error=error)

    def generate(self, prompts: list[Prompt], sampling: SamplingParams | list[SamplingParams] | None = None,
                 chat: bool = False) -> list[RequestOutput]:
        """Run prompts to completion together. Returns one final output per prompt, in order,
        whose `new_text` holds the whole text and `logprobs` those of every output token."""
        params = sampling if isinstance(sampling, list) else [sampling or SamplingParams()] * len(prompts)
        ids = [self.add_request(p, sp, chat=chat) for p, sp in zip(prompts, params)]
        texts: dict[str, list[str]] = {i: [] for i in ids}
        logprobs: dict[str, list[TokenLogprob]] = {i: [] for i in ids}
        final: dict[str, RequestOutput] = {}
        while self.has_unfinished():
            for out in self.step():
                if out.error is not None:
                    raise SamplingError(f"request {out.request_id}: {out.error}")
                texts[out.request_id].append(out.new_text)
                logprobs[out.request_id] += out.logprobs
                if out.finished:
                    final[out.request_id] = out
        for rid, out in final.items():
            out.new_text = "".join(texts[rid])
            out.logprobs = logprobs[rid]
        return [final[i] for i in ids]


__all__ = ["EngineStats", "FinishReason", "LLMEngine", "RequestOutput"]
