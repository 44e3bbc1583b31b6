"""Structured output: the tokens a request may pick next, from a JSON Schema (`response_format`) or a
structural tag (tool_choice "auto": free text with tool calls in it).

Request lifecycle:
1. Admission: the router parses `response_format` into `SamplingParams.json_schema` (canonical JSON
   text of a JSON Schema; json_object is {"type": "object"}) and `check_json_schema` refuses a schema
   the grammar library cannot compile (InvalidRequestError naming response_format), so workers never
   see a bad one. An engine checks it again on `add_request` / `reserve` (its own compile, cached).
   tool_choice "auto" gives `SamplingParams.structural_tag` (`router.tool_calls`), checked by the router
   with `check_structural_tag`, and an engine compiles it on `add_request` / `reserve` as it does a
   schema (a tag that still cannot be compiled at a sample fails that request alone, a `SamplingError`).
2. Sampling (prefill worker for the first token of a remote request, decode worker for the rest, or a
   decode worker doing the whole request): `Grammars.mask` gives the sequence its matcher the first
   time it is sampled on this worker, by replaying the output it already has (earlier workers' part
   included: `SamplingParams.prior_output_tokens`). The matcher's state is a pure function of (grammar,
   output so far), so nothing but the grammar's text crosses a handoff or a migration. The mask is
   applied last, after penalties and `logit_bias`; tokens it forbids get -inf.
3. `Grammars.accept` feeds the picked token to the matcher. An end token (EOS) is allowed only where
   the grammar may end. A JSON Schema's output ends with its JSON: once it is complete only end tokens
   are allowed, and the stop check (`is_terminated`) finishes the request when its matcher has accepted
   one, with ignore_eos too. A structural tag's output is free text around its tags: EOS is allowed
   in the free text (not inside an open tag), nothing forces it, and the request ends as free text does
   (EOS, a stop, max_tokens); `is_terminated` holds for it only once it took an EOS (with ignore_eos:
   the grammar can take nothing after it, so that EOS ends the request as a JSON Schema's does).
4. Finish or abort: the scheduler drops the sequence's matcher (`Sequence.grammar = None`).

Library: xgrammar (CPU build from PyPI), chosen by measurement on the embedded model's 49152-token
vocabulary: a schema compiles in ~20 ms and a json_object grammar in ~10 ms, a token's mask takes ~8 ms;
llguidance stalled 3-9 s on a grammar's first mask, outlines-core took 1.7 s to compile a schema and
18 s for json_object. Whitespace is not free: JSON is written with xgrammar's fixed separators
(", " and ": "), so a small model cannot wander off into blank space (a structural tag bounds it with
its own `max_whitespace_cnt`). A schema means what it says: properties it leaves open (no
additionalProperties: false) stay open.

Boundary: imports xgrammar, torch and transformers; knows `Sequence` and `SamplingParams` only;
never imports Ray or router code.
"""
from __future__ import annotations

import functools
import re

import torch
import xgrammar
from transformers import PreTrainedTokenizerBase

from engine.errors import InvalidRequestError, SamplingError
from engine.sequence import Sequence

JSON_OBJECT_SCHEMA = '{"type":"object"}'  # response_format json_object: any JSON object
_COMPILE_OPTIONS = {"any_whitespace": False, "strict_mode": False}
# Bytes of compiled grammars an engine keeps (xgrammar's default is no bound): distinct schemas (each
# "required" tool list is one) would otherwise grow a worker's memory without end.
GRAMMAR_CACHE_BYTES = 64 << 20
_LOCATION = re.compile(r"^\[[0-9:]+\] \S+:\d+: ")  # xgrammar's "[time] file.cc:line: " before a message


def _refusal(error: Exception, field: str = "response_format", what: str = "the JSON schema") -> InvalidRequestError:
    lines = [line for line in str(error).splitlines() if line.strip()]
    detail = _LOCATION.sub("", lines[0]) if lines else type(error).__name__
    return InvalidRequestError(field, f"{what} is not supported: {detail}")


@functools.lru_cache(maxsize=256)
def check_json_schema(schema: str) -> None:
    """Raises InvalidRequestError naming response_format when `schema` (JSON text) cannot be compiled
    to a grammar. Needs no tokenizer: the router checks with it. Successes are cached by schema text."""
    try:
        xgrammar.Grammar.from_json_schema(schema, **_COMPILE_OPTIONS)
    except (RuntimeError, ValueError, TypeError) as e:
        raise _refusal(e) from None


@functools.lru_cache(maxsize=256)
def check_structural_tag(tag: str) -> None:
    """Raises InvalidRequestError naming structural_tag when `tag` (JSON text of an xgrammar structural
    tag) cannot be compiled to a grammar. Needs no tokenizer. Successes are cached by tag text."""
    try:
        xgrammar.Grammar.from_structural_tag(tag)
    except (RuntimeError, ValueError, TypeError) as e:
        raise _refusal(e, "structural_tag", "the structural tag") from None


class GrammarState:
    """One sequence's matcher on this worker and how many of its output tokens it has accepted."""

    def __init__(self, matcher: xgrammar.GrammarMatcher) -> None:
        self.matcher = matcher
        self.accepted = 0

    @property
    def terminated(self) -> bool:
        return self.matcher.is_terminated()


def is_terminated(seq: Sequence) -> bool:
    """Whether the sequence's grammar has accepted an end token: it can take nothing more. A JSON
    Schema's matcher forces that end once its JSON is complete; a structural tag's never does (it
    takes EOS only when the model picks it, which ends the request anyway unless ignore_eos)."""
    return isinstance(seq.grammar, GrammarState) and seq.grammar.terminated


class Grammars:
    """An engine's grammar compiler: compiled grammars cached by schema / structural tag text (at most
    `GRAMMAR_CACHE_BYTES`, the least recently used dropped first), the tokenizer's
    vocabulary prepared on the first structured request (about a second for 49152 tokens).

    Args: tokenizer: the engine's; vocab_size: the model's logits width (may exceed the tokenizer's);
    end_ids: the model's end tokens, the only ones allowed once a JSON Schema's JSON is complete."""

    def __init__(self, tokenizer: PreTrainedTokenizerBase, vocab_size: int, end_ids: frozenset[int]) -> None:
        self._tokenizer = tokenizer
        self.vocab_size = vocab_size
        self._end_ids = sorted(end_ids)
        self._compiler: xgrammar.GrammarCompiler | None = None

    def compile(self, schema: str) -> xgrammar.CompiledGrammar:
        """The compiled grammar of `schema` (cached). Raises InvalidRequestError naming response_format."""
        try:
            return self._get_compiler().compile_json_schema(schema, **_COMPILE_OPTIONS)
        except (RuntimeError, ValueError, TypeError) as e:
            raise _refusal(e) from None

    def compile_structural_tag(self, tag: str) -> xgrammar.CompiledGrammar:
        """The compiled grammar of structural tag `tag` (cached). Raises InvalidRequestError naming
        structural_tag."""
        try:
            return self._get_compiler().compile_structural_tag(tag)
        except (RuntimeError, ValueError, TypeError) as e:
            raise _refusal(e, "structural_tag", "the structural tag") from None

    def _get_compiler(self) -> xgrammar.GrammarCompiler:
        if self._compiler is None:
            info = xgrammar.TokenizerInfo.from_huggingface(self._tokenizer, vocab_size=self.vocab_size,
                                                           stop_token_ids=self._end_ids)
            self._compiler = xgrammar.GrammarCompiler(info, max_threads=1, cache_limit_bytes=GRAMMAR_CACHE_BYTES)
        return self._compiler

    def _compiled(self, seq: Sequence) -> xgrammar.CompiledGrammar:
        """The sequence's grammar: its JSON Schema's, or its structural tag's."""
        sp = seq.sampling
        if sp.json_schema is not None:
            return self.compile(sp.json_schema)
        if sp.structural_tag is None:
            raise SamplingError(f"request {seq.request_id!r} has no grammar to mask with")
        try:
            return self.compile_structural_tag(sp.structural_tag)
        except InvalidRequestError as e:  # the router checks tags; one it let through fails this request only
            raise SamplingError(f"request {seq.request_id!r}: {e.message}") from None

    def mask(self, logits: torch.Tensor, seq: Sequence, output: list[int]) -> None:
        """Set to -inf, in place on the fp32 row `logits` [V], every token the grammar forbids after
        `output` (the sequence's output so far, earlier workers' part included)."""
        state = seq.grammar
        if not isinstance(state, GrammarState):
            state = seq.grammar = GrammarState(xgrammar.GrammarMatcher(self._compiled(seq)))
        for token in output[state.accepted:]:  # replay: output this matcher has not seen (a handoff, a move)
            self._accept(state, token, seq)
        bitmask = xgrammar.allocate_token_bitmask(1, self.vocab_size)
        state.matcher.fill_next_token_bitmask(bitmask)
        xgrammar.apply_token_bitmask_inplace(logits, bitmask, vocab_size=self.vocab_size)

    def accept(self, seq: Sequence, token: int) -> None:
        """The token picked after `mask`: the matcher moves past it."""
        if isinstance(seq.grammar, GrammarState):
            self._accept(seq.grammar, token, seq)

    @staticmethod
    def _accept(state: GrammarState, token: int, seq: Sequence) -> None:
        if not state.matcher.accept_token(token):
            kind = "response_format" if seq.sampling.json_schema is not None else "structural_tag"
            raise SamplingError(f"request {seq.request_id!r}: token {token} breaks its {kind} grammar")
        state.accepted += 1
