"""Incremental detokenization and stop conditions, checked after every new token."""
from __future__ import annotations

from transformers import PreTrainedTokenizerBase

from engine.grammar import is_terminated
from engine.sequence import FinishReason, Sequence

_CONTEXT = 5  # prompt tokens decoded ahead of the output so the first word keeps its leading space


class IncrementalDetokenizer:
    """Keeps a sequence's output text; hands out only text that can no longer change.

    Text that could still become a stop string is held back until it cannot.
    """

    def __init__(self, tokenizer: PreTrainedTokenizerBase, prompt_ids: list[int], stop: tuple[str, ...]) -> None:
        self.tokenizer = tokenizer
        self.ids = list(prompt_ids[-_CONTEXT:])
        self.prefix_offset = 0
        self.read_offset = len(self.ids)
        self.stop = stop
        self.holdback = max((len(s) for s in stop), default=1) - 1
        self.text = ""
        self.emitted = 0  # characters of `text` already handed out

    def append(self, token_id: int) -> bool:
        """Add one token. Returns True when the text now contains a stop string (text is cut before it)."""
        self.ids.append(token_id)
        decode = self.tokenizer.decode
        prefix = decode(self.ids[self.prefix_offset:self.read_offset], skip_special_tokens=True)
        full = decode(self.ids[self.prefix_offset:], skip_special_tokens=True)
        if len(full) <= len(prefix) or full.endswith("\ufffd"):
            return False  # an incomplete character: wait for more tokens
        delta = full[len(prefix):]
        self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)
        start = max(0, len(self.text) - self.holdback)
        self.text += delta
        hits = [i for i in (self.text.find(s, start) for s in self.stop) if i >= 0]
        if hits:
            self.text = self.text[:min(hits)]  # the earliest match, so no stop string is left in the text
            return True
        return False

    def take(self, final: bool) -> str:
        """Text not handed out yet; while unfinished, keeps back what may begin a stop string."""
        end = len(self.text) if final else max(self.emitted, len(self.text) - self.holdback)
        out = self.text[self.emitted:end]
        self.emitted = end
        return out


class StopChecker:
    """Decides whether a sequence ends after its newest token.

    Args:
        eos_ids: tokens that end generation unless a request sets ignore_eos.
        max_model_len: context limit.
        tokenizer: needed for stop strings and text output; None for token-only engines.
    """

    def __init__(self, eos_ids: frozenset[int], max_model_len: int,
                 tokenizer: PreTrainedTokenizerBase | None) -> None:
        self.eos_ids = eos_ids
        self.max_model_len = max_model_len
        self.tokenizer = tokenizer

    def start(self, seq: Sequence) -> None:
        if self.tokenizer is None:
            return
        sp = seq.sampling
        prior = min(sp.prior_output_tokens, seq.num_prompt_tokens)  # a continuation: its earlier output
        cut = seq.num_prompt_tokens - prior
        seq.detok = IncrementalDetokenizer(self.tokenizer, seq.prompt_token_ids[:cut], sp.stop)
        for token in seq.prompt_token_ids[cut:]:  # the same text, held back the same way, as before the move
            seq.detok.append(token)
        seq.detok.emitted = min(sp.prior_output_chars, len(seq.detok.text))

    def __call__(self, seq: Sequence) -> FinishReason | None:
        token, sp = seq.last_token_id, seq.sampling
        if seq.detok is not None and seq.detok.append(token):
            return FinishReason.STOP
        if (token in self.eos_ids and not sp.ignore_eos) or token in sp.stop_token_ids:
            return FinishReason.STOP
        if is_terminated(seq):  # the structured output is complete (its grammar took an end token)
            return FinishReason.STOP
        if seq.num_output_tokens >= sp.max_tokens or seq.num_tokens >= self.max_model_len:
            return FinishReason.LENGTH
        return None
