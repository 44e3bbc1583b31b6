"""Admission: what the router checks and works out for a request before it is placed.

Request lifecycle here (the first steps of `Router.submit`):
1. Check the model name.
2. Tokenize: the chat template for chat messages (with the request's tools and tool messages as
   `router.tool_calls.chat_prompt` hands them over), text as is, token ids as given; long texts in
   a thread, so streams keep flowing meanwhile.
3. A request without max_tokens gets the router's default, cut to the room left in the context;
   then prompt and max_tokens are checked against the context, the vocabulary and a decode
   worker's KV budget. Every error names the field.
4. The features the policy places by: prompt tokens and expected output tokens (max_tokens,
   tightened by a running estimate of real output lengths).
Nothing here touches the workers or the book.
"""
from __future__ import annotations

import asyncio
import time
from collections.abc import Sequence
from dataclasses import dataclass, replace

from transformers import PreTrainedTokenizerBase

from engine.errors import InvalidRequestError
from engine.model_loader import encode_prompt
from engine.model_store import ModelError
from engine.sampling_params import SamplingParams
from router.policy import OutputLengthEstimator, RequestFeatures
from router.tool_calls import chat_prompt
from router.types import GenerateRequest, ModelNotFoundError
from worker_core.protocol import WorkerInfo

_THREAD_TOKENIZE_CHARS = 4096  # texts at least this long are tokenized off the event loop


@dataclass(frozen=True)
class ModelLimits:
    """What every request must fit, from the workers' `WorkerInfo`: the context, the vocabulary, and
    the KV blocks of the smallest decode (and prefill) worker."""

    max_model_len: int
    vocab_size: int
    block_size: int
    decode_blocks: int
    prefill_blocks: int | None  # None: no prefill workers

    @classmethod
    def from_infos(cls, prefill: Sequence[WorkerInfo], decode: Sequence[WorkerInfo]) -> ModelLimits:
        if not decode:
            raise ValueError("the router needs at least one decode worker")
        return cls(max_model_len=min(i.max_model_len for i in [*prefill, *decode]), vocab_size=decode[0].vocab_size,
                   block_size=decode[0].block_size, decode_blocks=min(i.num_blocks for i in decode),
                   prefill_blocks=min((i.num_blocks for i in prefill), default=None))

    def blocks(self, tokens: int) -> int:
        return -(-tokens // self.block_size)


@dataclass(frozen=True)
class Admitted:
    """A request that passed admission: its token ids, final sampling params, the policy's features,
    and its deadline (time.monotonic(), or None)."""

    prompt: list[int]
    sampling: SamplingParams
    features: RequestFeatures
    deadline: float | None


class Admission:
    """Args: tokenizer (None: token-id prompts only); model_name: the served model's id; limits;
    default_max_tokens: for requests that give none; estimator: real output lengths so far."""

    def __init__(self, tokenizer: PreTrainedTokenizerBase | None, model_name: str, limits: ModelLimits,
                 default_max_tokens: int, estimator: OutputLengthEstimator) -> None:
        self.tokenizer, self.model_name, self.limits = tokenizer, model_name, limits
        self._default_max_tokens, self._estimator = default_max_tokens, estimator

    async def admit(self, request: GenerateRequest) -> Admitted:
        """Raises ModelNotFoundError or InvalidRequestError (naming the field)."""
        deadline = None if request.timeout_s is None else time.monotonic() + request.timeout_s
        self.check_model(request.model)
        prompt = await self._tokenize_async(request)
        sp = request.sampling
        if request.max_tokens_default:
            room = min(self.limits.max_model_len, self.limits.decode_blocks * self.limits.block_size) - len(prompt)
            sp = replace(sp, max_tokens=max(1, min(self._default_max_tokens, room)))
        self.validate(prompt, sp.max_tokens, "messages" if request.messages is not None else "prompt")
        bad = next((t for t, _ in sp.logit_bias if t >= self.limits.vocab_size), None)
        if bad is not None:  # refused here, not by a worker in the middle of the request's placement
            raise InvalidRequestError("logit_bias", f"token id {bad} is outside [0, {self.limits.vocab_size})")
        features = RequestFeatures(len(prompt), self._estimator.expected(sp.max_tokens, sp.ignore_eos), sp.max_tokens)
        return Admitted(prompt, sp, features, deadline)

    def check_model(self, model: str | None) -> None:
        if model is not None and model != self.model_name:
            raise ModelNotFoundError(model, self.model_name)

    def detokenize(self, token_ids: list[int]) -> str:
        """The text of `token_ids`. Raises InvalidRequestError for ids outside the vocabulary."""
        if self.tokenizer is None:
            raise InvalidRequestError("tokens", "this model has no tokenizer")
        bad = next((t for t in token_ids if not 0 <= t < self.limits.vocab_size), None)
        if bad is not None:
            raise InvalidRequestError("tokens", f"token id {bad} is outside [0, {self.limits.vocab_size})")
        return self.tokenizer.decode(token_ids)

    async def _tokenize_async(self, request: GenerateRequest) -> list[int]:
        size = len(request.prompt) if isinstance(request.prompt, str) else \
            sum(len(str(m.get("content", ""))) for m in request.messages or [])
        if size < _THREAD_TOKENIZE_CHARS:
            return self.tokenize(request)
        return await asyncio.get_running_loop().run_in_executor(None, self.tokenize, request)

    def tokenize(self, request: GenerateRequest) -> list[int]:
        if (request.prompt is None) == (request.messages is None):
            raise InvalidRequestError("prompt", "give exactly one of prompt (text or token ids) or messages")
        if isinstance(request.prompt, list):
            return list(request.prompt)
        if self.tokenizer is None:
            field = "prompt" if request.messages is None else "messages"
            raise InvalidRequestError(field, "this model has no tokenizer; send the prompt as token ids")
        try:
            if request.messages is not None:
                messages, tools = chat_prompt(self.tokenizer, request.messages, request.tools)
                return encode_prompt(self.tokenizer, messages, chat=True, tools=tools)
            return encode_prompt(self.tokenizer, request.prompt, chat=False)
        except ModelError as e:  # no chat template
            raise InvalidRequestError("messages", str(e)) from None
        except Exception as e:  # the template rejected the messages, or the tokenizer the text
            if request.messages is not None:
                raise InvalidRequestError("messages", f"the chat template could not render them: {e}") from None
            raise InvalidRequestError("prompt", "the tokenizer could not encode it; send valid UTF-8 text") from None

    def validate(self, prompt: list[int], max_tokens: int, field: str) -> None:
        """Prompt and max_tokens against the context, vocabulary and KV budget; `field` names the prompt."""
        n, lim = len(prompt), self.limits
        if not n:
            raise InvalidRequestError(field, "must not be empty")
        bad = next((t for t in prompt if not 0 <= t < lim.vocab_size), None)
        if bad is not None:
            raise InvalidRequestError(field, f"token id {bad} is outside [0, {lim.vocab_size})")
        if n >= lim.max_model_len:
            raise InvalidRequestError(field, f"has {n} tokens; this model's context allows at most "
                                             f"{lim.max_model_len - 1} prompt tokens (max_model_len={lim.max_model_len})")
        if n + max_tokens > lim.max_model_len:
            raise InvalidRequestError("max_tokens", f"must be <= {lim.max_model_len - n} for this {n}-token prompt: "
                                                    f"prompt + max_tokens must fit the context of {lim.max_model_len} "
                                                    "tokens")
        need = lim.blocks(n + max_tokens)
        if need > lim.decode_blocks:
            raise InvalidRequestError("max_tokens", f"prompt ({n} tokens) + max_tokens ({max_tokens}) needs "
                                                    f"{need} KV blocks; a decode worker holds {lim.decode_blocks}")
