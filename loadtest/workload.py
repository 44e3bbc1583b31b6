"""What to send: request specs (prompt, expected prompt tokens, output tokens) from a named workload.

Workload names (`parse_workload_lengths` / `build_workload`):
  fixed:P:O      every request: P prompt tokens, O output tokens.
  prompt-heavy   fixed:2000:50.
  decode-heavy   fixed:200:1000.
  chat           lognormal prompt and output lengths (medians 300 / 200 tokens, sigmas 1.0 / 0.8), seeded,
                 prompts clipped to [16, max_context / 2], outputs to [8, 1024] and to what the context leaves.
  mixed[:F]      each request prompt-heavy with probability F (default 0.5), else decode-heavy; seeded.
  mix:P:O,P:O... the given shapes in turn (mix:128:256,1536:16 is half short chats, half long prompts).
  multi-turn[:T:S:U:O]
                 the requests as conversations of T turns (default 6:1000:64:64; the last conversation
                 may be shorter), all sharing one system prompt of S tokens. Turn t's prompt is the system
                 prompt, the conversation's history (every earlier user message, U tokens, each followed by
                 a stand-in of its reply, O seeded tokens, so every server gets the same prompts), and a
                 new user message of U tokens; O output tokens. A runner sends a conversation's turns in
                 order (`loadtest.runner.run_conversations`); with replies "answered" it puts each turn's
                 real answer where its stand-in was (`with_replies`), as a chat client does. Text prompts
                 also carry the turn as chat messages (RequestSpec.messages: the system prompt, then user /
                 assistant in turn), which the chat endpoint sends instead of one user message.
  prefix:K:P:S:O K shared prefixes of P tokens; request i is prefix i mod K followed by S tokens of its own;
                 O output tokens.
  PATH.jsonl | jsonl:PATH
                 one request per line: {"prompt": "...", "output_tokens": N} or
                 {"prompt_token_ids": [...], "output_tokens": N}; optional "prompt_tokens" (expected count
                 of a text prompt). Lines are used in order and repeated when more requests are asked for.

Prompts: with a vocabulary size, random token ids from `safe_token_range` (exact lengths); with a token
counter (a tokenizer), text calibrated to the exact length; with neither, text of common words (about one
token per word; lengths approximate).
"""
from __future__ import annotations

import itertools
import json
import math
import random
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from loadtest.records import RequestRecord

NAMED = {"prompt-heavy": (2000, 50), "decode-heavy": (200, 1000)}
MULTI_TURN_DEFAULTS = (6, 1000, 64, 64)  # turns, system prompt, user message, output tokens
CHAT_PROMPT_MEDIAN, CHAT_PROMPT_SIGMA = 300, 1.0
CHAT_OUTPUT_MEDIAN, CHAT_OUTPUT_SIGMA = 200, 0.8
CHAT_MIN_PROMPT, CHAT_MIN_OUTPUT, CHAT_MAX_OUTPUT = 16, 8, 1024
WORDS = (
    "the", "of", "and", "to", "in", "is", "that", "for", "it", "as", "was", "with", "be", "by", "on", "not",
    "he", "this", "are", "or", "his", "from", "at", "which", "but", "have", "an", "they", "you", "were",
    "her", "she", "there", "been", "one", "all", "we", "their", "has", "would", "when", "if", "so", "no",
    "what", "up", "out", "more", "time", "some", "can", "two", "other", "into", "could", "people", "year",
    "first", "may", "only", "new", "about", "very", "after", "over", "also", "most", "where", "many", "these",
    "then", "them", "well", "should", "water", "long", "little", "world", "house", "great", "state", "place",
    "city", "work", "number", "part", "light", "music", "river", "garden", "system", "model", "token",
    "cache", "memory", "server", "request", "market", "story", "paper",
)

TokenCounter = Callable[[str], int]


CHAT_ROLES = ("system", "user", "assistant")


class WorkloadError(ValueError):
    """A workload name, parameter or file is invalid; the message says what is allowed."""


@dataclass(frozen=True)
class ChatMessage:
    """One message of a chat prompt. role: one of CHAT_ROLES. content: its text."""

    role: str
    content: str

    def __post_init__(self) -> None:
        if self.role not in CHAT_ROLES:
            raise ValueError(f"chat message role must be one of {', '.join(CHAT_ROLES)}, got {self.role!r}")


@dataclass(frozen=True)
class RequestSpec:
    """One request to send.

    index: position in the workload. prompt_tokens: the prompt's length in tokens (exact for token ids
    and calibrated text; an estimate otherwise). output_tokens: tokens to ask for (max_tokens).
    Exactly one of prompt_text / prompt_token_ids is set. conversation / turn: in a multi-turn workload,
    the conversation (None: an independent request) and the turn in it (0: the first). messages: the same
    prompt as chat messages where the workload has them (a multi-turn text prompt: system, then user /
    assistant in turn, ending with the new user message); None: the chat endpoint sends prompt_text as
    one user message. reply_spans: in a multi-turn token-id prompt, where each earlier turn's stand-in
    reply lies in prompt_token_ids ((start, end), in turn order). keep_output: ask the server for the
    output's text and token ids and keep them on the record (a conversation's next turn resends them).
    """

    index: int
    prompt_tokens: int
    output_tokens: int
    prompt_text: str | None = None
    prompt_token_ids: tuple[int, ...] | None = None
    conversation: int | None = None
    turn: int = 0
    messages: tuple[ChatMessage, ...] | None = None
    reply_spans: tuple[tuple[int, int], ...] = ()
    keep_output: bool = False

    def __post_init__(self) -> None:
        assert (self.prompt_text is None) != (self.prompt_token_ids is None), "exactly one prompt form"
        assert self.output_tokens >= 1
        assert self.messages is None or (self.prompt_text is not None and len(self.messages) > 0), \
            "messages only with a text prompt"


def safe_token_range(vocab_size: int) -> tuple[int, int]:
    """Token ids [lo, hi) unlikely to be special tokens: skips the lowest 256 ids (where most tokenizers put
    BOS/EOS/pad and chat markers) and the top 1% or 512 ids (Llama 3 / Qwen specials, padding rows).

    Args: vocab_size: the model's vocabulary size (>= 16). Returns: (lo, hi), hi > lo."""
    if vocab_size < 16:
        raise WorkloadError(f"vocab size must be >= 16, got {vocab_size}")
    lo = min(256, vocab_size // 4)
    hi = vocab_size - max(min(512, vocab_size // 4), vocab_size // 100)
    return lo, hi


def parse_workload_lengths(name: str, num_requests: int, seed: int, max_context: int) -> list[tuple[int, int]]:
    """Args: a workload name (not a file), how many requests, the seed, the most tokens (prompt + output)
    one request may hold. Returns: (prompt_tokens, output_tokens) per request. Raises: WorkloadError."""
    if num_requests < 1:
        raise WorkloadError(f"number of requests must be >= 1, got {num_requests}")
    rng = random.Random(seed)
    if name.startswith("fixed:"):
        lengths = [_fixed(name)] * num_requests
    elif name in NAMED:
        lengths = [NAMED[name]] * num_requests
    elif name == "chat":
        lengths = [_chat_lengths(rng, max_context) for _ in range(num_requests)]
    elif name == "mixed" or name.startswith("mixed:"):
        frac = _mixed_fraction(name)
        lengths = [NAMED["prompt-heavy"] if rng.random() < frac else NAMED["decode-heavy"]
                   for _ in range(num_requests)]
    elif name.startswith("mix:"):
        shapes = [_fixed(f"fixed:{part}") for part in name[len("mix:"):].split(",")]
        lengths = [shapes[i % len(shapes)] for i in range(num_requests)]
    else:
        raise WorkloadError(f"unknown workload {name!r}; allowed: fixed:P:O, prompt-heavy, decode-heavy, chat, "
                            "mixed[:F], mix:P:O,P:O..., multi-turn[:T:S:U:O], prefix:K:P:S:O, PATH.jsonl or "
                            "jsonl:PATH")
    for p, o in set(lengths):
        if p + o > max_context:
            raise WorkloadError(f"workload {name!r}: {p} prompt + {o} output tokens exceed the max context "
                                f"{max_context}; raise --max-context or pick shorter lengths")
    return lengths


def _fixed(name: str) -> tuple[int, int]:
    parts = name.split(":")
    try:
        p, o = int(parts[1]), int(parts[2])
        assert len(parts) == 3
    except (ValueError, IndexError, AssertionError):
        raise WorkloadError(f"bad fixed workload {name!r}; use fixed:PROMPT_TOKENS:OUTPUT_TOKENS, "
                            "e.g. fixed:200:1000") from None
    if p < 1 or o < 1:
        raise WorkloadError(f"fixed workload {name!r}: prompt and output tokens must be >= 1")
    return p, o


def _mixed_fraction(name: str) -> float:
    if name == "mixed":
        return 0.5
    try:
        frac = float(name.split(":", 1)[1])
    except ValueError:
        frac = -1.0
    if not 0.0 <= frac <= 1.0:
        raise WorkloadError(f"bad mixed workload {name!r}; use mixed or mixed:F with F (the prompt-heavy "
                            "fraction) in [0, 1]")
    return frac


def _chat_lengths(rng: random.Random, max_context: int) -> tuple[int, int]:
    max_prompt = max(CHAT_MIN_PROMPT, max_context // 2)
    p = round(rng.lognormvariate(math.log(CHAT_PROMPT_MEDIAN), CHAT_PROMPT_SIGMA))
    p = min(max(p, CHAT_MIN_PROMPT), max_prompt)
    o = round(rng.lognormvariate(math.log(CHAT_OUTPUT_MEDIAN), CHAT_OUTPUT_SIGMA))
    o = min(max(o, CHAT_MIN_OUTPUT), CHAT_MAX_OUTPUT, max_context - p)
    if o < 1:
        raise WorkloadError(f"max context {max_context} is too small for the chat workload")
    return p, o


def is_file_workload(name: str) -> bool:
    return name.startswith("jsonl:") or name.endswith(".jsonl")


def load_jsonl(path: str | Path) -> list[RequestSpec]:
    """Args: a JSONL file, one request per non-blank line. Returns: its specs, in order.
    Raises: WorkloadError naming the file, the line and what is wrong."""
    path = Path(path)
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except OSError as e:
        raise WorkloadError(f"cannot read workload file {path}: {e.strerror or e}") from None
    specs: list[RequestSpec] = []
    for lineno, line in enumerate(lines, 1):
        if line.strip():
            specs.append(_jsonl_spec(line, len(specs), f"{path}:{lineno}"))
    if not specs:
        raise WorkloadError(f"workload file {path} has no requests")
    return specs


def _jsonl_spec(line: str, index: int, where: str) -> RequestSpec:
    try:
        obj = json.loads(line)
    except json.JSONDecodeError as e:
        raise WorkloadError(f"{where}: not valid JSON ({e.msg})") from None
    if not isinstance(obj, dict):
        raise WorkloadError(f"{where}: expected an object with prompt or prompt_token_ids and output_tokens")
    out = obj.get("output_tokens")
    if not _is_int(out) or out < 1:
        raise WorkloadError(f"{where}: output_tokens must be an integer >= 1, got {out!r}")
    if ("prompt" in obj) == ("prompt_token_ids" in obj):
        raise WorkloadError(f"{where}: give exactly one of prompt (text) and prompt_token_ids (list of ints)")
    if "prompt" in obj:
        text = obj["prompt"]
        if not isinstance(text, str) or not text:
            raise WorkloadError(f"{where}: prompt must be a non-empty string")
        expected = obj.get("prompt_tokens", len(text.split()))
        if not _is_int(expected) or expected < 1:
            raise WorkloadError(f"{where}: prompt_tokens must be an integer >= 1, got {expected!r}")
        return RequestSpec(index, expected, out, prompt_text=text)
    ids = obj["prompt_token_ids"]
    if not isinstance(ids, list) or not ids or not all(_is_int(t) and t >= 0 for t in ids):
        raise WorkloadError(f"{where}: prompt_token_ids must be a non-empty list of integers >= 0")
    return RequestSpec(index, len(ids), out, prompt_token_ids=tuple(ids))


def _is_int(v: object) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def run_seed(seed: int, run: int) -> int:
    """The seed of a sweep's `run`-th run (0 = `seed`): every run draws its own prompts and arrivals, so a
    prefix-caching server never serves a later run from an earlier one's cache."""
    return seed + 100 * run


def warmup_seed(seed: int) -> int:
    """The seed of the warm-up requests sent before a run or sweep seeded `seed`: none of its runs' seeds
    (`run_seed(seed, i)`, i >= 0), so a prefix-caching server holds none of the measured prompts."""
    return run_seed(seed, -1)


def build_workload(name: str, num_requests: int, seed: int = 0, max_context: int = 8192,
                   vocab_size: int | None = None, token_range: tuple[int, int] | None = None,
                   count_tokens: TokenCounter | None = None) -> list[RequestSpec]:
    """The requests of a workload.

    Args:
        name: a workload name (see the module docstring) or a JSONL file.
        num_requests: how many requests (file workloads cycle through their lines).
        seed: seeds lengths and prompts; the same arguments give the same requests.
        max_context: most tokens (prompt + output) per request.
        vocab_size: prompts as random token ids in `safe_token_range(vocab_size)` (or `token_range`).
        token_range: explicit [lo, hi) for token ids; needs no vocab_size.
        count_tokens: a tokenizer's token counter; prompts as text calibrated to the exact length.
    Returns: num_requests specs. Raises: WorkloadError.
    """
    if is_file_workload(name):
        base = load_jsonl(name.removeprefix("jsonl:"))
        return [_reindex(base[i % len(base)], i) for i in range(num_requests)]
    if token_range is None and vocab_size is not None:
        token_range = safe_token_range(vocab_size)
    if token_range is not None and not 0 <= token_range[0] < token_range[1]:
        raise WorkloadError(f"token range [{token_range[0]}, {token_range[1]}) is empty or negative")
    if name == "multi-turn" or name.startswith(("multi-turn:", "prefix:")):
        if num_requests < 1:
            raise WorkloadError(f"number of requests must be >= 1, got {num_requests}")
        pieces = _Pieces(random.Random(f"{seed}:prompts"), token_range, count_tokens)
        build = _multi_turn if name.startswith("multi-turn") else _prefixed
        return build(name, num_requests, max_context, pieces)
    lengths = parse_workload_lengths(name, num_requests, seed, max_context)
    rng = random.Random(f"{seed}:prompts")
    if token_range is not None:
        lo, hi = token_range
        return [RequestSpec(i, p, o, prompt_token_ids=tuple(rng.randrange(lo, hi) for _ in range(p)))
                for i, (p, o) in enumerate(lengths)]
    specs = []
    for i, (p, o) in enumerate(lengths):
        if count_tokens is not None:
            text, actual = calibrated_text(p, count_tokens, rng)
        else:
            text, actual = " ".join(rng.choice(WORDS) for _ in range(p)), p
        specs.append(RequestSpec(i, actual, o, prompt_text=text))
    return specs


class _Pieces:
    """Prompt pieces of a given token length, as token ids (a range given) or text, and their joining."""

    def __init__(self, rng: random.Random, token_range: tuple[int, int] | None,
                 count_tokens: TokenCounter | None) -> None:
        self.rng, self.token_range, self.count_tokens = rng, token_range, count_tokens

    def piece(self, n: int) -> tuple[int, ...] | str:
        if self.token_range is not None:
            return tuple(self.rng.randrange(*self.token_range) for _ in range(n))
        if self.count_tokens is not None:
            return calibrated_text(n, self.count_tokens, self.rng)[0]
        return " ".join(self.rng.choice(WORDS) for _ in range(n))

    def spec(self, index: int, parts: list, output_tokens: int, conversation: int | None = None,
             turn: int = 0, roles: tuple[str, ...] | None = None) -> RequestSpec:
        """roles: the chat role of each part (text prompts then carry them as messages); None: no messages."""
        if self.token_range is not None:
            ids = tuple(t for part in parts for t in part)
            ends = list(itertools.accumulate(len(part) for part in parts))
            replies = tuple((ends[i - 1], ends[i]) for i, role in enumerate(roles or ()) if role == "assistant")
            return RequestSpec(index, len(ids), output_tokens, prompt_token_ids=ids, conversation=conversation,
                               turn=turn, reply_spans=replies)
        messages = None if roles is None else tuple(ChatMessage(r, p) for r, p in zip(roles, parts, strict=True))
        text = " ".join(parts)
        count = self.count_tokens(text) if self.count_tokens is not None else len(text.split())
        return RequestSpec(index, count, output_tokens, prompt_text=text, conversation=conversation, turn=turn,
                           messages=messages)


def _ints(name: str, form: str, defaults: tuple[int, ...] | int) -> tuple[int, ...]:
    """The integers after a workload name's first colon, each >= 1: as many as `defaults` has (none given:
    the defaults), or exactly `defaults` of them when it is a count."""
    head, _, rest = name.partition(":")
    count = defaults if isinstance(defaults, int) else len(defaults)
    try:
        values = tuple(int(x) for x in rest.split(":")) if rest or isinstance(defaults, int) else defaults
        assert len(values) == count and min(values) >= 1
    except (ValueError, AssertionError):
        raise WorkloadError(f"bad workload {name!r}; use {head}:{form} with integers >= 1") from None
    return values


def _multi_turn(name: str, n: int, max_context: int, pieces: _Pieces) -> list[RequestSpec]:
    turns, system, user, out = _ints(name, "TURNS:SYSTEM:USER:OUTPUT", MULTI_TURN_DEFAULTS)
    longest = system + turns * user + (turns - 1) * out
    if longest + out > max_context:
        raise WorkloadError(f"workload {name!r}: the last turn holds {longest} prompt + {out} output tokens, more "
                            f"than the max context {max_context}; use fewer or shorter turns")
    shared = pieces.piece(system)
    specs: list[RequestSpec] = []
    for conversation in range((n + turns - 1) // turns):
        history = [shared]
        for turn in range(min(turns, n - len(specs))):
            history.append(pieces.piece(user))
            roles = ("system",) + ("user", "assistant") * turn + ("user",)
            specs.append(pieces.spec(len(specs), history, out, conversation, turn, roles))
            history.append(pieces.piece(out))  # the reply's stand-in
    return specs


def with_replies(spec: RequestSpec, replies: list[RequestRecord | None]) -> tuple[RequestSpec, int]:
    """A multi-turn spec with its history's stand-in replies replaced by the answers the server gave
    (`replies[i]`: the record of the conversation's turn i; None, a failed turn, or a record without the
    output kept: that stand-in stays). A token-id prompt takes the answer's token ids, a text prompt its
    text (its messages too; prompt_tokens then moves by the answer's token count against the stand-in's,
    an estimate). Returns: the spec, and how many of its stand-ins stayed."""
    if spec.prompt_token_ids is not None:
        ids, cut, kept = list(spec.prompt_token_ids), 0, 0
        for (start, end), rec in zip(spec.reply_spans, replies):
            if rec is None or not rec.ok or rec.output_token_ids is None:
                kept += 1
                continue
            ids[start + cut:end + cut] = rec.output_token_ids
            cut += len(rec.output_token_ids) - (end - start)
        return replace(spec, prompt_token_ids=tuple(ids), prompt_tokens=len(ids)), kept
    if spec.messages is None:
        return spec, 0
    messages, answers, moved, kept = list(spec.messages), iter(replies), 0, 0
    for i, m in enumerate(messages):
        if m.role != "assistant":
            continue
        rec = next(answers, None)
        if rec is None or not rec.ok or rec.output_text is None:
            kept += 1
            continue
        messages[i] = ChatMessage("assistant", rec.output_text)
        moved += rec.output_tokens - spec.output_tokens
    return replace(spec, messages=tuple(messages), prompt_text=" ".join(m.content for m in messages),
                   prompt_tokens=max(1, spec.prompt_tokens + moved)), kept


def _prefixed(name: str, n: int, max_context: int, pieces: _Pieces) -> list[RequestSpec]:
    k, prefix, suffix, out = _ints(name, "PREFIXES:PREFIX:SUFFIX:OUTPUT", 4)
    if prefix + suffix + out > max_context:
        raise WorkloadError(f"workload {name!r}: {prefix + suffix} prompt + {out} output tokens exceed the max "
                            f"context {max_context}")
    prefixes = [pieces.piece(prefix) for _ in range(k)]
    return [pieces.spec(i, [prefixes[i % k], pieces.piece(suffix)], out) for i in range(n)]


def _reindex(spec: RequestSpec, index: int) -> RequestSpec:
    return replace(spec, index=index)


def calibrated_text(n_tokens: int, count_tokens: TokenCounter, rng: random.Random) -> tuple[str, int]:
    """Random words whose token count is n_tokens (or, when a tokenizer merges the padding, the closest
    count found). Returns: (text, its token count)."""
    words = [rng.choice(WORDS) for _ in range(n_tokens)]  # >= 1 token each, so n words are enough
    lo, hi = 1, n_tokens  # largest k with count(first k words) <= n_tokens
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if count_tokens(" ".join(words[:mid])) <= n_tokens:
            lo = mid
        else:
            hi = mid - 1
    text = " ".join(words[:lo])
    count = count_tokens(text)
    while count < n_tokens:
        longer = text + " a"
        longer_count = count_tokens(longer)
        if longer_count <= count or longer_count > n_tokens:
            break
        text, count = longer, longer_count
    return text, count


def load_token_counter(path: str) -> TokenCounter:
    """Args: a tokenizer.json, or a model directory holding one. Returns: text → token count (no special
    tokens added). Raises: WorkloadError when there is none."""
    p = Path(path)
    file = p / "tokenizer.json" if p.is_dir() else p
    if not file.is_file():
        raise WorkloadError(f"no tokenizer at {path}; give a tokenizer.json or a directory holding one")
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(file))
    return lambda text: len(tok.encode(text, add_special_tokens=False).ids)
