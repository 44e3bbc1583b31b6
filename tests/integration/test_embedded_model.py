"""The embedded SmolLM2 on chat prompts: greedy equals transformers `generate`, text and stops work."""
from __future__ import annotations

import copy

import pytest
import torch

from engine import CacheConfig, EngineConfig, LLMEngine, SamplingParams
from engine.model_loader import encode_prompt, load_model

pytestmark = pytest.mark.model

CHATS = ["What is the capital of France?", "Write a haiku about the sea.",
         "List three prime numbers and explain why each is prime."]


@pytest.fixture(scope="module")
def smol():
    model, tokenizer = load_model(None, "float32", "cpu")
    ref = copy.deepcopy(model)
    engine = LLMEngine(EngineConfig(dtype="float32", cache=CacheConfig(memory_gib=0.25)), model=model,
                       tokenizer=tokenizer)
    return ref, tokenizer, engine


def reference(ref, prompt_ids: list[int], n: int, eos: int) -> list[int]:
    with torch.no_grad():
        out = ref.generate(torch.tensor([prompt_ids]), max_new_tokens=n, do_sample=False)[0, len(prompt_ids):]
    ids = out.tolist()
    return ids[:ids.index(eos) + 1] if eos in ids else ids


def test_chat_prompts_match_generate_single_and_batched(smol):
    ref, tok, engine = smol
    prompts = [encode_prompt(tok, c, chat=True) for c in CHATS]
    expected = [reference(ref, p, 32, tok.eos_token_id) for p in prompts]
    assert engine.generate([CHATS[0]], SamplingParams(max_tokens=32), chat=True)[0].output_token_ids == expected[0]
    outs = engine.generate(CHATS, SamplingParams(max_tokens=32), chat=True)
    assert [o.output_token_ids for o in outs] == expected
    assert "Paris" in outs[0].new_text
    assert outs[0].finish_reason == "stop"  # ended on <|im_end|>, which is not in the text
    assert "<|im_end|>" not in outs[0].new_text
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks


def test_stop_string_cuts_text(smol):
    _, _, engine = smol
    full = engine.generate([CHATS[0]], SamplingParams(max_tokens=32), chat=True)[0].new_text
    assert "Paris" in full
    out = engine.generate([CHATS[0]], SamplingParams(max_tokens=32, stop=["Paris"]), chat=True)[0]
    assert out.finish_reason == "stop"
    assert out.new_text == full[:full.index("Paris")]


def test_messages_and_text_prompts(smol):
    _, tok, engine = smol
    msgs = [{"role": "user", "content": CHATS[0]}]
    assert engine.tokenize(msgs) == engine.tokenize(CHATS[0], chat=True)
    assert engine.tokenize("hello world") == tok("hello world")["input_ids"]
    with pytest.raises(ValueError, match="^prompt: "):
        engine.add_request(3.5)  # type: ignore[arg-type]


@pytest.mark.slow
def test_compiled_decode_is_kept_in_bfloat16():
    """In bfloat16 the compiled step rounds differently from the eager model; the start-up check
    tells that from a different model and keeps the compiled step (on an AMX-BF16 machine it once fell back
    to eager: 1.5x slower decode), and it serves what bf16 `generate` gives."""
    from engine import kernels

    if not kernels.supports(torch.bfloat16, torch.device("cpu"), 3):
        pytest.skip("compile mode needs the CPU kernel, which needs a C compiler")
    model, tokenizer = load_model(None, "bfloat16", "cpu")
    ref = copy.deepcopy(model)
    engine = LLMEngine(EngineConfig(dtype="bfloat16", linear="plain", compile=True,
                                    cache=CacheConfig(memory_gib=0.25)), model=model, tokenizer=tokenizer)
    assert engine.runner.compiled
    # prompts on SDPA, as `generate` computes them: the decode step is what this compares (the prefill kernel
    # rounds this model's near-ties its own way: the test below)
    engine.runner.prefill_kernel = engine.runner.prefill_kernel_whole = False
    prompts = [encode_prompt(tokenizer, c, chat=True) for c in CHATS]
    outs = engine.generate(prompts, SamplingParams(max_tokens=12))
    for out, prompt in zip(outs, prompts):
        got, want = out.output_token_ids[:6], reference(ref, prompt, 12, tokenizer.eos_token_id)[:6]
        if got == want:
            continue
        # bf16 logits of this size round in steps of 0.125: two tokens one step apart are a near-tie that either
        # summation order may break (seen on an AVX-512 CPU without BF16: 0.125 apart in `generate`, equal in
        # the engine). Tokens agree up to the first difference, and there the engine's token is such a near-tie
        # in `generate`'s own logits; a wrong step is off by far more.
        j = next((i for i, (a, b) in enumerate(zip(got, want)) if a != b), None)
        assert j is not None, (got, want)  # one ended (EOS) where the other went on
        with torch.no_grad():
            logits = ref(torch.tensor([prompt + want[:j]])).logits[0, -1].float()
        assert float(logits[want[j]] - logits[got[j]]) <= 0.13, (j, got, want)
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks


def test_prompts_on_the_prefill_kernel_are_as_close_to_float32_as_bfloat16_allows(monkeypatch):
    """bf16 on a machine with AVX-512 BF16: prompts that extend a cached system prompt are prefilled in
    chunks whose attention over the cached context runs on the prefill kernel (it is called, and never
    declines; without AMX tiles the system prompt's own first chunk runs there too). Their first tokens'
    log-probabilities are within bf16's precision of the fp32 model's (this model's chat openings are
    near-ties: 0.1 apart in fp32, which bf16 rounding may break either way, so tokens are not compared; bf16
    logits of this size round in steps of 0.06-0.125, and a wrong kernel is off by more than 1)."""
    from engine import attention, kernels

    if not kernels.supports_prefill(torch.bfloat16, torch.device("cpu"), 64):
        pytest.skip("the prefill kernel is in the builds with AVX-512 BF16: this CPU has none (or no C compiler)")
    model, tokenizer = load_model(None, "bfloat16", "cpu")
    ref = copy.deepcopy(model).float()
    engine = LLMEngine(EngineConfig(dtype="bfloat16", linear="plain", prefill_chunk_tokens=40,
                                    cache=CacheConfig(memory_gib=0.25)), model=model, tokenizer=tokenizer)
    assert engine.runner.prefill_kernel
    calls: list[bool] = []
    real = kernels.prefill_attention

    def counted(*args: object) -> torch.Tensor | None:
        out = real(*args)
        calls.append(out is not None)
        return out

    monkeypatch.setattr(attention.kernels, "prefill_attention", counted)
    system = encode_prompt(tokenizer, CHATS[2], chat=True)
    engine.generate([system], SamplingParams(max_tokens=1))  # its full blocks are cached now
    prompts = [system + encode_prompt(tokenizer, c, chat=True) for c in CHATS]
    outs = engine.generate(prompts, SamplingParams(max_tokens=10, logprobs=5))
    assert calls and all(calls)
    assert all(o.num_cached_tokens >= len(system) // 16 * 16 for o in outs)
    for out, prompt in zip(outs, prompts):
        with torch.no_grad():
            want = torch.log_softmax(ref(torch.tensor([prompt])).logits[0, -1], -1)
        got = out.logprobs[0]
        assert list(got.top_logprobs) == pytest.approx([float(want[i]) for i in got.top_ids], abs=0.25)
        assert out.finished and out.output_token_ids
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks
