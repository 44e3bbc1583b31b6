"""Unit tests for engine.detokenizer with a byte-level BPE tokenizer built in memory (no download)."""
from __future__ import annotations

import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

from engine.detokenizer import IncrementalDetokenizer, StopChecker
from engine.sampling_params import SamplingParams
from engine.sequence import FinishReason, Sequence

CORPUS = ["the quick brown fox jumps over the lazy dog", "hello world, this is a test of the stop strings",
          "naïve café 😀 déjà vu"] * 3


@pytest.fixture(scope="module")
def tok() -> PreTrainedTokenizerFast:
    """Byte-level BPE with a small vocabulary, so words split into several tokens and
    multi-byte characters into byte tokens."""
    t = Tokenizer(models.BPE())
    t.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    t.decoder = decoders.ByteLevel()
    t.train_from_iterator(CORPUS, trainers.BpeTrainer(
        vocab_size=300, special_tokens=["<eos>"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False))
    return PreTrainedTokenizerFast(tokenizer_object=t, eos_token="<eos>")


def enc(tok: PreTrainedTokenizerFast, text: str) -> list[int]:
    return tok.encode(text, add_special_tokens=False)


def stream(tok: PreTrainedTokenizerFast, text: str, stop: tuple[str, ...] = (),
           prompt: str = "say: ") -> tuple[list[str], str, int | None]:
    """Feed `text` token by token. Returns (deltas while running, final delta, index of the stopping token)."""
    d = IncrementalDetokenizer(tok, enc(tok, prompt), stop)
    deltas, stopped_at = [], None
    for i, t in enumerate(enc(tok, text)):
        if d.append(t):
            stopped_at = i
            break
        deltas.append(d.take(final=False))
    return deltas, d.take(final=True), stopped_at


@pytest.mark.parametrize("text", ["the quick brown fox", "hello world, this is a test", "naïve café 😀 déjà vu",
                                  " leading space and  two spaces", "😀😀 x"])
def test_deltas_concatenate_to_full_decode(tok: PreTrainedTokenizerFast, text: str) -> None:
    ids = enc(tok, text)
    assert len(ids) > 3
    deltas, last, stopped = stream(tok, text)
    assert stopped is None
    assert "".join(deltas) + last == tok.decode(ids) == text
    assert all("\ufffd" not in d for d in deltas)
    assert last == ""  # no stop strings: nothing is held back


def test_incomplete_character_waits_for_its_last_byte(tok: PreTrainedTokenizerFast) -> None:
    ids = enc(tok, "😀")
    assert len(ids) > 1, "the emoji must span several byte tokens for this test"
    d = IncrementalDetokenizer(tok, enc(tok, "a "), ())
    for t in ids[:-1]:
        assert d.append(t) is False
        assert d.take(final=False) == ""
    d.append(ids[-1])
    assert d.take(final=False) == "😀"


def test_first_token_keeps_its_leading_space(tok: PreTrainedTokenizerFast) -> None:
    d = IncrementalDetokenizer(tok, enc(tok, "hello"), ())
    for t in enc(tok, " world"):
        d.append(t)
    assert d.take(final=True) == " world"


def test_stop_string_cuts_text_before_it(tok: PreTrainedTokenizerFast) -> None:
    text = "the quick brown fox jumps"
    deltas, last, stopped = stream(tok, text, stop=("brown",))
    assert stopped is not None
    streamed = "".join(deltas) + last
    assert streamed == "the quick "
    # the stop string completes exactly at the token that finishes it
    ids = enc(tok, text)
    assert "brown" in tok.decode(ids[:stopped + 1]) and "brown" not in tok.decode(ids[:stopped])
    assert all("b" not in d for d in deltas), "no part of a possible stop string may be streamed early"


def test_stop_string_split_across_tokens(tok: PreTrainedTokenizerFast) -> None:
    text = "hello world, END here"
    ids = enc(tok, text)
    assert all("END" not in tok.decode([i]) for i in ids), "END must span tokens for this test"
    deltas, last, stopped = stream(tok, text, stop=("END",))
    assert stopped is not None and "".join(deltas) + last == "hello world, "


def test_stop_string_ending_inside_a_token(tok: PreTrainedTokenizerFast) -> None:
    deltas, last, stopped = stream(tok, "the quick brown fox", stop=("k b",))
    assert stopped is not None and "".join(deltas) + last == "the quic"


def test_earliest_stop_string_wins(tok: PreTrainedTokenizerFast) -> None:
    """Two stop strings completed by one token: the text is cut before the first one, so it contains neither."""
    deltas, last, _ = stream(tok, "the quick brown", stop=("k", "i"))
    out = "".join(deltas) + last
    assert out == "the qu"
    assert "k" not in out and "i" not in out


def test_stop_string_in_prompt_is_ignored(tok: PreTrainedTokenizerFast) -> None:
    deltas, last, stopped = stream(tok, " and the dog", stop=("fox",), prompt="the quick brown fox")
    assert stopped is None and "".join(deltas) + last == " and the dog"


def test_held_back_text_is_released_at_the_end(tok: PreTrainedTokenizerFast) -> None:
    text = "hello world, this is a test"
    deltas, last, stopped = stream(tok, text, stop=("zzz", "xy"))
    assert stopped is None
    assert "".join(deltas) == text[:-2]  # up to len("zzz") - 1 characters could start a stop string
    assert last == text[-2:]


# -- StopChecker -----------------------------------------------------------------------------------

def run(checker: StopChecker, prompt: list[int], outputs: list[int], **sampling: object) -> tuple[int, FinishReason | None]:
    """Append outputs one by one; returns (outputs appended, reason) at the first stop."""
    seq = Sequence("r", prompt, SamplingParams(**sampling))
    checker.start(seq)
    for n, t in enumerate(outputs, 1):
        seq.token_ids.append(t)
        reason = checker(seq)
        if reason is not None:
            return n, reason
    return len(outputs), None


EOS = 0


def test_eos_stops_unless_ignored() -> None:
    c = StopChecker(frozenset({EOS, 99}), max_model_len=100, tokenizer=None)
    assert run(c, [5, 6], [7, 8, EOS, 9], max_tokens=10) == (3, FinishReason.STOP)
    assert run(c, [5, 6], [7, 99, 9], max_tokens=10) == (2, FinishReason.STOP)
    assert run(c, [5, 6], [7, 8, EOS, 9], max_tokens=10, ignore_eos=True) == (4, None)


def test_stop_token_ids_stop_even_with_ignore_eos() -> None:
    c = StopChecker(frozenset({EOS}), max_model_len=100, tokenizer=None)
    assert run(c, [5], [7, 42, 8], max_tokens=10, stop_token_ids=[42]) == (2, FinishReason.STOP)
    assert run(c, [5], [7, 42, 8], max_tokens=10, stop_token_ids=[42], ignore_eos=True) == (2, FinishReason.STOP)


def test_max_tokens_gives_length() -> None:
    c = StopChecker(frozenset({EOS}), max_model_len=100, tokenizer=None)
    assert run(c, [5, 6, 7], [1] * 10, max_tokens=4) == (4, FinishReason.LENGTH)
    assert run(c, [5], [1, 1, EOS], max_tokens=3) == (3, FinishReason.STOP)  # EOS on the last one is a stop


def test_context_limit_gives_length() -> None:
    c = StopChecker(frozenset({EOS}), max_model_len=6, tokenizer=None)
    assert run(c, [5, 6, 7, 8], [1] * 10, max_tokens=10) == (2, FinishReason.LENGTH)


def test_stop_string_through_checker(tok: PreTrainedTokenizerFast) -> None:
    c = StopChecker(frozenset({tok.eos_token_id}), max_model_len=1000, tokenizer=tok)
    out = enc(tok, "hello world, END here")
    n, reason = run(c, enc(tok, "say: "), out, max_tokens=50, stop=["END"])
    assert reason is FinishReason.STOP and n < len(out)
    seq = Sequence("r", [1], SamplingParams())
    StopChecker(frozenset(), 10, None).start(seq)
    assert seq.detok is None


def test_eos_text_is_not_in_output(tok: PreTrainedTokenizerFast) -> None:
    c = StopChecker(frozenset({tok.eos_token_id}), max_model_len=1000, tokenizer=tok)
    seq = Sequence("r", enc(tok, "say: "), SamplingParams(max_tokens=50))
    c.start(seq)
    for t in enc(tok, "the dog") + [tok.eos_token_id]:
        seq.token_ids.append(t)
        reason = c(seq)
    assert reason is FinishReason.STOP
    assert seq.detok.take(final=True) == "the dog"


def run_moved(tok: PreTrainedTokenizerFast, prompt: list[int], output: list[int], cut: int,
              stop: tuple[str, ...]) -> tuple[str, bool]:
    """A stream cut after `cut` output tokens and continued by a fresh worker, as the router resumes it
    (the tokens already out become prompt tokens marked as earlier output, with the characters
    already handed out). Returns (the client's text, whether a stop string ended it)."""
    checker = StopChecker(frozenset(), 10_000, tok)
    first = Sequence("a", prompt, SamplingParams(max_tokens=100, stop=stop))
    checker.start(first)
    text = ""
    for t in output[:cut]:
        first.token_ids.append(t)
        if checker(first) is FinishReason.STOP:
            return text + first.detok.take(final=True), True
        text += first.detok.take(final=False)
    moved = Sequence("a.1", prompt + output[:cut], SamplingParams(
        max_tokens=100, stop=stop, prior_output_tokens=cut, prior_output_chars=len(text)))
    checker.start(moved)
    for t in output[cut:]:
        moved.token_ids.append(t)
        if checker(moved) is FinishReason.STOP:
            return text + moved.detok.take(final=True), True
        text += moved.detok.take(final=False)
    return text + moved.detok.take(final=True), False


@pytest.mark.parametrize("stop", [(), ("jumps over",), ("é 😀 d",)])
def test_a_moved_stream_continues_its_text_byte_exact_at_every_cut(tok: PreTrainedTokenizerFast,
                                                                   stop: tuple[str, ...]) -> None:
    """Cut anywhere (inside a multi-byte character, inside a held-back possible stop string, across
    the stop string itself): the text the client gets, and whether it stopped, equal the unbroken run."""
    prompt, output = enc(tok, "say: "), enc(tok, "the quick brown fox jumps over naïve café 😀 déjà vu")
    unbroken = run_moved(tok, prompt, output, len(output), stop)
    assert unbroken[1] == bool(stop)
    for cut in range(1, len(output)):
        assert run_moved(tok, prompt, output, cut, stop) == unbroken, cut
