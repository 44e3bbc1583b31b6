"""Structured output's mask in the sampler (engine.grammar) on a byte-level BPE tokenizer built in memory:
random logits under a schema still give JSON that matches it; EOS only where the JSON may end; a worker
that takes a request over rebuilds the same matcher from the output so far; bad schemas name
response_format."""
from __future__ import annotations

import json

import pytest
import torch
from tokenizers import Tokenizer, decoders, pre_tokenizers, trainers
from tokenizers import models as tok_models
from transformers import PreTrainedTokenizerFast

from engine.detokenizer import StopChecker
from engine.errors import InvalidRequestError, SamplingError
from engine.grammar import Grammars, check_json_schema, check_structural_tag, is_terminated
from engine.sampler import Sampler
from engine.sampling_params import SamplingParams
from engine.sequence import FinishReason, Sequence

EOS = 0
CORPUS = ['{"ok": true, "colour": "red", "n": 12}', '{"ok": false, "colour": "blue", "n": 7}',
          "the quick brown fox jumps over the lazy dog"] * 3
SCHEMA = json.dumps({"type": "object", "properties": {
    "ok": {"type": "boolean"}, "colour": {"enum": ["red", "green", "blue"]},
    "n": {"type": "integer", "minimum": 0, "maximum": 99}, "note": {"type": "string", "maxLength": 5}},
    "required": ["ok", "colour", "n"], "additionalProperties": False})


@pytest.fixture(scope="module")
def tok() -> PreTrainedTokenizerFast:
    t = Tokenizer(tok_models.BPE())
    t.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    t.decoder = decoders.ByteLevel()
    t.train_from_iterator(CORPUS, trainers.BpeTrainer(
        vocab_size=320, special_tokens=["<eos>"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False))
    return PreTrainedTokenizerFast(tokenizer_object=t, eos_token="<eos>")


@pytest.fixture(scope="module")
def grammars(tok) -> Grammars:
    return Grammars(tok, len(tok), frozenset({EOS}))


# strict=False: xgrammar's JSON strings admit raw control characters (U+0000-U+001F, which JSON wants
# escaped); random logits pick them, a model rarely does (README, response_format).


def check(obj: dict) -> None:
    """The schema above, by hand."""
    assert set(obj) - {"note"} == {"ok", "colour", "n"} and set(obj) <= {"ok", "colour", "n", "note"}
    assert isinstance(obj["ok"], bool) and obj["colour"] in ("red", "green", "blue")
    assert isinstance(obj["n"], int) and not isinstance(obj["n"], bool) and 0 <= obj["n"] <= 99
    assert "note" not in obj or (isinstance(obj["note"], str) and len(obj["note"]) <= 5)


def allowed(grammars: Grammars, seq: Sequence, output: list[int]) -> torch.Tensor:
    """[V] bool: the tokens the sequence's grammar allows after `output` (its matcher moves up to it)."""
    row = torch.zeros(grammars.vocab_size)
    grammars.mask(row, seq, output)
    return ~torch.isinf(row)


def run(tok, grammars, sp: SamplingParams, seed: int, prompt: list[int] | None = None,
        boost_eos: bool = False, masks: list | None = None) -> Sequence:
    """The engine's loop on one sequence with random logits: sample, append, stop check; `masks` gets the
    allowed tokens before each step."""
    sampler, stops = Sampler(0, frozenset({EOS}), grammars), StopChecker(frozenset({EOS}), 10_000, tok)
    seq = Sequence("r", prompt or [5, 6, 7], sp)
    stops.start(seq)
    gen = torch.Generator().manual_seed(seed)
    while not seq.is_finished:
        logits = torch.randn(1, len(tok), generator=gen) * 5
        if boost_eos:
            logits[0, EOS] = 1e4  # the model wants to stop at once, every step
        if masks is not None:
            masks.append(allowed(grammars, seq, seq.output_token_ids))
        seq.token_ids.append(sampler.sample(logits, [seq])[0])
        reason = stops(seq)
        if reason is not None:
            seq.finish_reason = reason
            break
    return seq


@pytest.mark.parametrize("seed", range(8))
@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_random_logits_under_a_schema_give_json_that_matches_it(tok, grammars, seed, temperature) -> None:
    """Greedy and sampled, even a model that always wants EOS most: it ends only once the JSON is whole."""
    sp = SamplingParams(max_tokens=200, temperature=temperature, seed=seed, json_schema=SCHEMA)
    seq = run(tok, grammars, sp, seed, boost_eos=seed % 2 == 0)
    assert seq.finish_reason is FinishReason.STOP and seq.output_token_ids[-1] == EOS
    assert EOS not in seq.output_token_ids[:-1]
    check(json.loads(tok.decode(seq.output_token_ids[:-1]), strict=False))  # see loads()
    assert is_terminated(seq)


def test_a_complete_json_ends_the_request_with_ignore_eos_too(tok, grammars) -> None:
    seq = run(tok, grammars, SamplingParams(max_tokens=200, ignore_eos=True, json_schema=SCHEMA), 3)
    assert seq.finish_reason is FinishReason.STOP and seq.output_token_ids[-1] == EOS
    check(json.loads(tok.decode(seq.output_token_ids[:-1]), strict=False))


def test_json_object_gives_an_object(tok, grammars) -> None:
    sp = SamplingParams(max_tokens=400, json_schema='{"type": "object"}', logit_bias=((EOS, 50.0),))
    seq = run(tok, grammars, sp, 11)
    assert seq.finish_reason is FinishReason.STOP
    assert isinstance(json.loads(tok.decode(seq.output_token_ids[:-1]), strict=False), dict)


def test_a_worker_taking_over_rebuilds_the_same_mask_from_the_output(tok, grammars) -> None:
    """A request moved after k tokens (its output at the end of its prompt, prior_output_tokens = k) gets, on
    another worker's compiler, the same allowed tokens as the matcher that produced those k tokens step by step."""
    masks: list[torch.Tensor] = []
    whole = run(tok, grammars, SamplingParams(max_tokens=200, json_schema=SCHEMA), 5, masks=masks)
    out = whole.output_token_ids
    other = Grammars(tok, len(tok), frozenset({EOS}))
    for k in (0, 1, 4, len(out) // 2, len(out) - 1):
        moved = Sequence("b", [5, 6, 7] + out[:k], SamplingParams(max_tokens=200, json_schema=SCHEMA,
                                                                   prior_output_tokens=k))
        got = allowed(other, moved, out[:k])
        assert torch.equal(got, masks[k])
        assert got[out[k]] and not got.all()  # the token the request took next is allowed, not every token


def test_bad_schemas_name_response_format(tok, grammars) -> None:
    for schema in ('{"type": "foo"}', '{"type": "string", "pattern": "[a-"}'):
        with pytest.raises(InvalidRequestError, match="^response_format: the JSON schema is not supported: "):
            check_json_schema(schema)
        with pytest.raises(InvalidRequestError, match="^response_format: "):
            grammars.compile(schema)
    check_json_schema(SCHEMA)
    with pytest.raises(InvalidRequestError, match="^response_format: the JSON schema is not valid JSON"):
        SamplingParams(json_schema="{")
    with pytest.raises(InvalidRequestError, match="^response_format: the JSON schema must be an object"):
        SamplingParams(json_schema="[1]")
    with pytest.raises(InvalidRequestError, match="^min_tokens: "):
        SamplingParams(json_schema=SCHEMA, min_tokens=1)
    assert SamplingParams(json_schema='{ "type" : "object",\n "a": 1 }').json_schema == '{"type":"object","a":1}'


# ---------------------------------------------------------------- structural tags (tool_choice "auto")

TAG_PARAMS = {"type": "object", "properties": {"city": {"enum": ["Paris", "Oslo"]},
                                               "days": {"type": "integer", "minimum": 1, "maximum": 7}},
              "required": ["city", "days"], "additionalProperties": False}
OPEN, CLOSE = "<tool_call>", "</tool_call>"


def tag_of(parallel: bool = True) -> str:
    """The structural tag the router writes for "auto" with one tool, `forecast(TAG_PARAMS)`."""
    from router.tool_calls import ToolCalling, parse_tools
    tools = parse_tools([{"type": "function", "function": {"name": "forecast", "parameters": TAG_PARAMS}}])
    return ToolCalling(tools, "auto", None, parallel).structural_tag or ""


def check_call(text: str) -> None:
    obj = json.loads(text, strict=False)
    assert set(obj) == {"name", "arguments"} and obj["name"] == "forecast"
    assert set(obj["arguments"]) == {"city", "days"} and obj["arguments"]["city"] in ("Paris", "Oslo")
    days = obj["arguments"]["days"]
    assert isinstance(days, int) and not isinstance(days, bool) and 1 <= days <= 7


def in_call(tok, output: list[int]) -> bool:
    """Whether `output` ends inside an open <tool_call> block."""
    text = tok.decode(output)
    return text.rfind(OPEN) > text.rfind(CLOSE)


def test_a_structural_tag_lets_free_text_pass_and_end(tok, grammars) -> None:
    """Free text (no trigger) is all allowed, EOS too, and nothing forces the end: the request goes on to
    max_tokens as free text does."""
    text = tok.encode("the quick brown fox jumps over the lazy dog")
    seq = Sequence("r", [5, 6, 7], SamplingParams(max_tokens=50, structural_tag=tag_of()))
    for k in range(len(text)):
        got = allowed(grammars, seq, text[:k])
        assert got[text[k]] and got[EOS] and got.sum() > len(tok) // 2
    assert allowed(grammars, seq, text)[EOS]
    masks: list[torch.Tensor] = []
    ran = run(tok, grammars, SamplingParams(max_tokens=30, structural_tag=tag_of(), logit_bias=((EOS, -100.0),)),
              4, masks=masks)
    assert ran.finish_reason is FinishReason.LENGTH and not is_terminated(ran)


@pytest.mark.parametrize("seed", range(6))
def test_after_the_trigger_only_a_valid_call_may_come_and_no_eos_inside_it(tok, grammars, seed) -> None:
    """The output so far ends with "<tool_call>" (written by an earlier worker); random logits, with a
    model that wants EOS most, write a valid call (EOS masked all through it) and end right after its
    close tag; sampled without EOS pressure, free text follows the call."""
    before = tok.encode("I will look. " + OPEN)
    sp = SamplingParams(max_tokens=200, temperature=1.0, seed=seed, structural_tag=tag_of(),
                        prior_output_tokens=len(before))
    masks: list[torch.Tensor] = []
    seq = run(tok, grammars, sp, seed, prompt=[5, 6, 7] + before, boost_eos=True, masks=masks)
    out = before + seq.output_token_ids
    assert seq.finish_reason is FinishReason.STOP and out[-1] == EOS and EOS not in out[:-1]
    text = tok.decode(out[:-1])
    assert text.endswith(CLOSE)  # EOS came at the first place it was allowed
    check_call(text[text.index(OPEN) + len(OPEN):-len(CLOSE)].strip("\n"))
    for k, mask in enumerate(masks[1:], 1):  # masks[0]: `run` asks before the earlier output is replayed
        assert bool(mask[EOS]) == (not in_call(tok, out[:len(before) + k])) and mask[out[len(before) + k]]
    free = run(tok, grammars, replace_sp(sp, logit_bias=((EOS, -100.0),), max_tokens=120), seed,
               prompt=[5, 6, 7] + before)
    text = tok.decode(before + free.output_token_ids)
    assert free.finish_reason is FinishReason.LENGTH and CLOSE in text
    check_call(text[text.index(OPEN) + len(OPEN):text.index(CLOSE)].strip("\n"))


def replace_sp(sp: SamplingParams, **kw: object) -> SamplingParams:
    import dataclasses
    return dataclasses.replace(sp, **kw)


def test_without_parallel_calls_only_the_end_may_follow_a_call(tok, grammars) -> None:
    call = tok.encode('<tool_call>\n{"name": "forecast", "arguments": {"city": "Oslo", "days": 3}}\n</tool_call>')
    for parallel, free_after in ((True, True), (False, False)):
        seq = Sequence("r", [5], SamplingParams(max_tokens=200, structural_tag=tag_of(parallel)))
        got = allowed(grammars, seq, call)
        assert got[EOS] and bool(got.sum() > 1) == free_after
    bad = tok.encode('<tool_call>{"name": "other"')
    seq = Sequence("r", [5], SamplingParams(max_tokens=200, structural_tag=tag_of()))
    with pytest.raises(SamplingError, match="structural_tag"):
        allowed(grammars, seq, bad)


def test_a_worker_taking_over_rebuilds_the_same_structural_mask(tok, grammars) -> None:
    """As for a schema: replaying k tokens on another worker's compiler gives the step-by-step mask."""
    before = tok.encode("ok " + OPEN)
    sp = SamplingParams(max_tokens=80, temperature=1.0, seed=2, structural_tag=tag_of(),
                        prior_output_tokens=len(before))
    masks: list[torch.Tensor] = []
    whole = run(tok, grammars, sp, 2, prompt=[5, 6, 7] + before, masks=masks)
    out = before + whole.output_token_ids
    other = Grammars(tok, len(tok), frozenset({EOS}))
    for k in (1, 3, len(before) + 2, len(out) // 2, len(out) - 1):
        moved = Sequence("b", [5, 6, 7] + out[:k], replace_sp(sp, prior_output_tokens=k))
        got = allowed(other, moved, out[:k])
        if k > len(before):  # `run`'s first mask comes before the earlier output is replayed
            assert torch.equal(got, masks[k - len(before)])
        assert got[out[k]] and bool(got[EOS]) == (not in_call(tok, out[:k]))


def test_bad_structural_tags_name_structural_tag(grammars) -> None:
    bad = '{"type": "structural_tag", "format": {"type": "nope"}}'
    with pytest.raises(InvalidRequestError, match="^structural_tag: the structural tag is not supported: "):
        check_structural_tag(bad)
    with pytest.raises(InvalidRequestError, match="^structural_tag: "):
        grammars.compile_structural_tag(bad)
    check_structural_tag(tag_of())
    with pytest.raises(InvalidRequestError, match="^structural_tag: the structural tag is not valid JSON"):
        SamplingParams(structural_tag="{")
    with pytest.raises(InvalidRequestError, match="^structural_tag: cannot be combined with json_schema"):
        SamplingParams(structural_tag=tag_of(), json_schema=SCHEMA)
    sp = SamplingParams(structural_tag=json.dumps(json.loads(tag_of()), indent=2), min_tokens=1)
    assert sp.structural_tag == tag_of() and sp.constrained and sp.adjusts_logits  # stored compact
    with pytest.raises(SamplingError, match="grammar needs the engine's tokenizer"):
        Sampler()._adjust(torch.zeros(8), Sequence("r", [1], sp))


def test_an_unforeseen_sampling_failure_fails_its_row_alone_and_is_logged(caplog, monkeypatch) -> None:
    sampler = Sampler()
    seqs = [Sequence(rid, [1], SamplingParams(temperature=0.7, seed=1)) for rid in ("ok", "bad")]
    real = Sampler._sample_one

    def broken(self: Sampler, logits: torch.Tensor, seq: Sequence) -> int:
        if seq.request_id == "bad":
            raise ZeroDivisionError("boom")
        return real(self, logits, seq)
    monkeypatch.setattr(Sampler, "_sample_one", broken)
    with caplog.at_level("ERROR", logger="engine.sampler"):
        ok, bad = sampler.sample(torch.randn(2, 16), seqs)
    assert isinstance(ok, int) and 0 <= ok < 16
    assert isinstance(bad, SamplingError) and str(bad) == "ZeroDivisionError: boom"
    [record] = caplog.records
    assert "bad" in record.getMessage() and record.exc_info is not None  # the traceback is kept
