"""Per-request sampling and stop settings, validated on construction."""
from __future__ import annotations

import json
import math
from dataclasses import dataclass

from engine.errors import InvalidRequestError
from engine.logprobs import MAX_LOGPROBS

# Below this temperature sampling is greedy: logits / temperature would overflow float32 (a temperature
# of 1e-300 even rounds to 0.0 there), and the softmax of inf is NaN.
GREEDY_BELOW_TEMPERATURE = 1e-5
MAX_LOGIT_BIAS = 300  # tokens one request may bias (OpenAI's limit)


@dataclass(frozen=True)
class SamplingParams:
    """How to pick tokens and when to stop.

    Args:
        max_tokens: most tokens to generate, >= 1.
        temperature: 0 (or anything below 1e-5) means greedy; otherwise it scales the logits; at most 100.
        top_k: keep the k most likely tokens; 0 disables.
        top_p: keep the smallest set whose probability reaches top_p, in (0, 1].
        seed: per-request seed; the same seed and prompt give the same tokens.
        stop: strings that end generation; the text is cut before the match.
        stop_token_ids: token ids that end generation (kept in the output, like EOS).
        ignore_eos: keep generating past EOS (benchmarks with fixed output lengths).
        prior_output_tokens: the request continues its own earlier generation: the last this many
            prompt tokens are output it already produced (a stream moved to another worker). Its
            sampling draws go on from that position, and its text and stop strings from that output.
        prior_output_chars: characters of that earlier output's text already handed out; the rest
            of it (held back while it could begin a stop string or an unfinished character) comes
            out first.
        min_p: sampling keeps only tokens at least this fraction as likely as the likeliest, in [0, 1].
        min_tokens: no EOS or stop token id before this many output tokens (they are masked out).
        presence_penalty: subtracted from the logit of every token the output holds, in [-2, 2].
        frequency_penalty: subtracted from a token's logit once per time the output holds it, in [-2, 2].
        repetition_penalty: a token in the prompt or output has its logit divided by this (multiplied
            when negative), > 0; 1 disables. Penalties apply to greedy requests too.
        logprobs: None: no log-probabilities; k in [0, 20]: each output token comes with its
            log-probability and the k likeliest tokens' (`engine.logprobs`: the model's raw
            log-softmax, before penalties and temperature).
        logit_bias: (token id, bias) pairs, added to those tokens' logits before the token is picked
            (after the penalties, before temperature), greedy requests too; bias in [-100, 100] (-100
            all but bans a token, 100 all but forces it), at most `MAX_LOGIT_BIAS` pairs, one per token
            id (stored sorted; ids beyond the model's vocabulary are refused by the engine).
        json_schema: structured output (`response_format`): JSON text of a JSON Schema the output must
            match (json_object is {"type": "object"}), stored compact with its keys in their order; the
            sampler masks every token that would break it and the request stops when the JSON is complete
            (`engine.grammar`, which also refuses a schema it cannot compile). Not with `min_tokens`.
        structural_tag: structured output with free text around it (tool_choice "auto"): JSON text of an
            xgrammar structural tag ({"type": "structural_tag", "format": ...}), stored compact; the
            sampler masks every token that would break it (free text until a trigger, then the tag's
            content and its end, then free text again), and the request ends as free text does (EOS
            where the grammar allows it, a stop, max_tokens). Not with `json_schema`.
    """

    max_tokens: int = 16
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    prior_output_tokens: int = 0
    prior_output_chars: int = 0
    min_p: float = 0.0
    min_tokens: int = 0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logprobs: int | None = None
    logit_bias: tuple[tuple[int, float], ...] = ()
    json_schema: str | None = None
    structural_tag: str | None = None

    def __post_init__(self) -> None:
        if isinstance(self.max_tokens, bool) or not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            raise InvalidRequestError("max_tokens", f"must be an integer >= 1, got {self.max_tokens!r}")
        if not isinstance(self.temperature, (int, float)) or not self.temperature >= 0 or self.temperature > 100:
            raise InvalidRequestError("temperature", f"must be in [0, 100], got {self.temperature!r}")
        if isinstance(self.top_k, bool) or not isinstance(self.top_k, int) or self.top_k < 0:
            raise InvalidRequestError("top_k", f"must be an integer >= 0 (0 disables), got {self.top_k!r}")
        if not isinstance(self.top_p, (int, float)) or not 0 < self.top_p <= 1:
            raise InvalidRequestError("top_p", f"must be in (0, 1], got {self.top_p!r}")
        if self.seed is not None and (isinstance(self.seed, bool) or not isinstance(self.seed, int)
                                      or not 0 <= self.seed < 2**63):
            raise InvalidRequestError("seed", f"must be an integer in [0, 2**63), got {self.seed!r}")
        for name in ("prior_output_tokens", "prior_output_chars"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise InvalidRequestError(name, f"must be an integer >= 0, got {value!r}")
        if not _number(self.min_p) or not 0 <= self.min_p <= 1:
            raise InvalidRequestError("min_p", f"must be in [0, 1], got {self.min_p!r}")
        if isinstance(self.min_tokens, bool) or not isinstance(self.min_tokens, int) or \
                not 0 <= self.min_tokens <= self.max_tokens:
            raise InvalidRequestError("min_tokens", f"must be an integer in [0, max_tokens], got {self.min_tokens!r}")
        for name in ("presence_penalty", "frequency_penalty"):
            if not _number(getattr(self, name)) or not -2 <= getattr(self, name) <= 2:
                raise InvalidRequestError(name, f"must be in [-2, 2], got {getattr(self, name)!r}")
        if not _number(self.repetition_penalty) or not 0 < self.repetition_penalty <= 100:
            raise InvalidRequestError("repetition_penalty", f"must be in (0, 100], got {self.repetition_penalty!r}")
        if self.logprobs is not None and (isinstance(self.logprobs, bool) or not isinstance(self.logprobs, int)
                                          or not 0 <= self.logprobs <= MAX_LOGPROBS):
            raise InvalidRequestError("logprobs", f"must be null or an integer in [0, {MAX_LOGPROBS}], "
                                                  f"got {self.logprobs!r}")
        object.__setattr__(self, "logit_bias", _logit_bias(self.logit_bias))
        if self.json_schema is not None:
            object.__setattr__(self, "json_schema", _json_object("response_format", "the JSON schema",
                                                                 self.json_schema))
            if self.min_tokens:
                raise InvalidRequestError("min_tokens", "cannot be combined with response_format (the JSON decides "
                                                        "where the output ends)")
        if self.structural_tag is not None:
            if self.json_schema is not None:
                raise InvalidRequestError("structural_tag", "cannot be combined with json_schema (one grammar "
                                                            "a request)")
            object.__setattr__(self, "structural_tag", _json_object("structural_tag", "the structural tag",
                                                                    self.structural_tag))
        object.__setattr__(self, "stop", _as_tuple(self.stop, str, "stop"))
        object.__setattr__(self, "stop_token_ids", _as_tuple(self.stop_token_ids, int, "stop_token_ids"))
        if any(s == "" for s in self.stop):
            raise InvalidRequestError("stop", "stop strings must be non-empty")

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_BELOW_TEMPERATURE or self.top_k == 1

    @property
    def adjusts_logits(self) -> bool:
        """Whether the logits change before the token is picked (penalties, min_tokens, a grammar)."""
        return bool(self.min_tokens or self.presence_penalty or self.frequency_penalty
                    or self.repetition_penalty != 1.0 or self.logit_bias or self.constrained)

    @property
    def constrained(self) -> bool:
        """Whether a grammar constrains the output (`json_schema` or `structural_tag`)."""
        return self.json_schema is not None or self.structural_tag is not None


def _json_object(field: str, what: str, value: object) -> str:
    """A grammar's JSON text (`json_schema`, `structural_tag`) as compact JSON text (keys keep their
    order: it is the order the output writes them). Refusals name `field`."""
    if not isinstance(value, str):
        raise InvalidRequestError(field, f"{what} must be JSON text, got {type(value).__name__}")
    try:
        obj = json.loads(value)
    except ValueError as e:
        raise InvalidRequestError(field, f"{what} is not valid JSON: {e}") from None
    if not isinstance(obj, dict):
        raise InvalidRequestError(field, f"{what} must be an object")
    return json.dumps(obj, separators=(",", ":"), ensure_ascii=False)


def _logit_bias(value: object) -> tuple[tuple[int, float], ...]:
    """`logit_bias` checked and sorted by token id: pairs of (id >= 0, bias in [-100, 100])."""
    try:
        pairs = [tuple(p) for p in value]  # type: ignore[union-attr]
    except TypeError:
        raise InvalidRequestError("logit_bias", f"must be a list of (token id, bias) pairs, got {value!r}") from None
    if len(pairs) > MAX_LOGIT_BIAS:
        raise InvalidRequestError("logit_bias", f"holds {len(pairs)} tokens; at most {MAX_LOGIT_BIAS}")
    for pair in pairs:
        if len(pair) != 2 or isinstance(pair[0], bool) or not isinstance(pair[0], int) or pair[0] < 0:
            raise InvalidRequestError("logit_bias", f"must map token ids (integers >= 0) to biases, got {pair!r}")
        if not _number(pair[1]) or not -100 <= pair[1] <= 100:
            raise InvalidRequestError("logit_bias", f"bias of token {pair[0]} must be in [-100, 100], got {pair[1]!r}")
    ids = [t for t, _ in pairs]
    if len(set(ids)) != len(ids):
        raise InvalidRequestError("logit_bias", "names a token id twice")
    return tuple(sorted((t, float(b)) for t, b in pairs))


def _number(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and not math.isnan(value)


def _as_tuple(value: object, kind: type, name: str) -> tuple:
    if isinstance(value, kind):
        value = (value,)
    try:
        items = tuple(value)  # type: ignore[arg-type]
    except TypeError:
        raise InvalidRequestError(name, f"must be a list of {kind.__name__}, got {value!r}") from None
    for item in items:
        if isinstance(item, bool) or not isinstance(item, kind) or (kind is int and item < 0):
            raise InvalidRequestError(name, f"must be a list of {'non-negative ' if kind is int else ''}"
                                            f"{kind.__name__}, got item {item!r}")
    return items
