"""The OpenAI-compatible HTTP API of a real running pdserve, through the official `openai` SDK and raw
HTTP: completions and chat, streamed and not, equal to transformers greedy `generate`; metrics; errors."""
from __future__ import annotations

import json
import re
import time
import urllib.error
import urllib.request

import openai
import pytest
import torch
from prometheus_client.parser import text_string_to_metric_families

from tests.e2e.conftest import chat_ids, greedy_ids, text_of

pytestmark = pytest.mark.model
MESSAGES = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.http + "/v1", api_key="unused", max_retries=0, timeout=120)


def test_chat_matches_generate(client, server, oracle):
    want = text_of(oracle, greedy_ids(oracle, chat_ids(oracle, MESSAGES), 24))
    resp = client.chat.completions.create(model=server.model, messages=MESSAGES, max_tokens=24, temperature=0)
    assert resp.choices[0].message.content == want
    assert resp.choices[0].message.role == "assistant"
    assert resp.usage.prompt_tokens == len(chat_ids(oracle, MESSAGES))
    assert resp.usage.total_tokens == resp.usage.prompt_tokens + resp.usage.completion_tokens
    timings = resp.model_extra["usage"]["pdserve_timings"] if "usage" in (resp.model_extra or {}) else \
        resp.usage.model_extra["pdserve_timings"]
    assert timings["path"] in ("remote", "local") and timings["ttft_s"] > 0


def test_chat_stream_matches_generate(client, server, oracle):
    want = text_of(oracle, greedy_ids(oracle, chat_ids(oracle, MESSAGES), 24))
    stream = client.chat.completions.create(model=server.model, messages=MESSAGES, max_tokens=24, stream=True,
                                            temperature=0, stream_options={"include_usage": True})
    parts, reasons, usage = [], [], None
    for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage
        for choice in chunk.choices:
            parts.append(choice.delta.content or "")
            reasons.append(choice.finish_reason)
    assert "".join(parts) == want
    assert reasons[-1] in ("stop", "length") and all(r is None for r in reasons[:-1])
    assert usage is not None and usage.completion_tokens >= 1


def test_chat_without_max_tokens_runs_to_its_natural_end(client, server, oracle):
    messages = [{"role": "user", "content": "Write a haiku about the sea."}]
    want = greedy_ids(oracle, chat_ids(oracle, messages), 120)
    assert len(want) > 16 and len(want) < 120  # it ends on its own, past OpenAI's completions default
    resp = client.chat.completions.create(model=server.model, messages=messages, temperature=0)
    assert resp.choices[0].message.content == text_of(oracle, want)
    assert resp.choices[0].finish_reason == "stop"


def test_completion_matches_generate(client, server, oracle):
    prompt = "The three primary colours are"
    ids = oracle[1](prompt)["input_ids"]
    want_ids = greedy_ids(oracle, ids, 20)
    resp = client.completions.create(model=server.model, prompt=prompt, max_tokens=20, temperature=0)
    assert resp.choices[0].text == text_of(oracle, want_ids)
    assert resp.usage.completion_tokens == len(want_ids)
    stream = client.completions.create(model=server.model, prompt=prompt, max_tokens=20, stream=True, temperature=0)
    assert "".join(c.choices[0].text for c in stream if c.choices) == text_of(oracle, want_ids)


def test_a_conversation_resent_as_token_ids_reuses_the_kv_of_its_answer(client, server, oracle):
    """return_token_ids gives the prompt's and the answer's ids, equal to `generate`'s (streamed too). The
    next turn, sent as those ids and a new message, equals `generate`, and the server serves the answer's
    KV from its cache: more cached tokens than the first prompt held (the decode worker keeps the blocks
    its decode steps filled)."""
    ids = oracle[1]("A short story about a lighthouse keeper:")["input_ids"]
    want = greedy_ids(oracle, ids, 40)
    asked = {"return_token_ids": True, "ignore_eos": True}
    resp = client.completions.create(model=server.model, prompt=ids, max_tokens=40, temperature=0, extra_body=asked)
    choice = resp.choices[0].model_extra
    assert choice["prompt_token_ids"] == ids and choice["token_ids"] == want
    stream = client.completions.create(model=server.model, prompt=ids, max_tokens=40, temperature=0, stream=True,
                                       extra_body=asked)
    chunks = [c.choices[0].model_extra for c in stream if c.choices]
    assert [t for c in chunks for t in c["token_ids"]] == want and chunks[0]["prompt_token_ids"] == ids
    nxt = ids + want + oracle[1](" The end. Another story:")["input_ids"]
    two = client.completions.create(model=server.model, prompt=nxt, max_tokens=12, temperature=0)
    assert two.choices[0].text == text_of(oracle, greedy_ids(oracle, nxt, 12))
    assert two.usage.prompt_tokens_details.cached_tokens > len(ids)  # the answer's blocks too


def test_n_greedy_choices_all_equal_the_reference(client, server, oracle):
    """n=3, greedy: three requests at the router, three equal choices, each the greedy reference."""
    prompt = "The three primary colours are"
    ids = oracle[1](prompt)["input_ids"]
    want_ids = greedy_ids(oracle, ids, 20)
    resp = client.completions.create(model=server.model, prompt=prompt, max_tokens=20, temperature=0, n=3)
    assert [(c.index, c.text) for c in resp.choices] == [(i, text_of(oracle, want_ids)) for i in range(3)]
    assert resp.usage.prompt_tokens == len(ids)  # the prompt counted once
    assert resp.usage.completion_tokens == 3 * len(want_ids)


def test_n_seeded_sampling_is_reproducible_and_its_choices_differ(client, server):
    """Choice i samples with seed + i: the same request gives the same three choices, not all equal."""
    kw = {"model": server.model, "prompt": "Once upon a time, in a small village,", "max_tokens": 16,
          "temperature": 1.0, "seed": 1234, "n": 3}
    first = [c.text for c in client.completions.create(**kw).choices]
    again = [c.text for c in client.completions.create(**kw).choices]
    assert first == again
    assert len(set(first)) >= 2, first


def test_batched_prompts_times_n_come_in_openais_order(client, server, oracle):
    prompts = ["The capital of France is", "The three primary colours are"]
    ids = [oracle[1](p)["input_ids"] for p in prompts]
    want = [text_of(oracle, greedy_ids(oracle, i, 8)) for i in ids]
    resp = client.completions.create(model=server.model, prompt=prompts, max_tokens=8, temperature=0, n=2)
    assert [(c.index, c.text) for c in resp.choices] == [(0, want[0]), (1, want[0]), (2, want[1]), (3, want[1])]
    assert resp.usage.prompt_tokens == len(ids[0]) + len(ids[1])


def test_echo_returns_the_prompt_then_the_completion(client, server, oracle):
    prompt = "The capital of France is"
    ids = oracle[1](prompt)["input_ids"]
    want = text_of(oracle, greedy_ids(oracle, ids, 6))
    resp = client.completions.create(model=server.model, prompt=prompt, max_tokens=6, temperature=0, echo=True)
    assert resp.choices[0].text == prompt + want
    by_ids = client.completions.create(model=server.model, prompt=ids, max_tokens=6, temperature=0, echo=True)
    assert by_ids.choices[0].text == oracle[1].decode(ids) + want
    stream = client.completions.create(model=server.model, prompt=prompt, max_tokens=6, temperature=0, echo=True,
                                       stream=True)
    texts = [c.choices[0].text for c in stream if c.choices]
    assert texts[0].startswith(prompt) and "".join(texts) == prompt + want


def test_streamed_n_gives_both_choices_and_one_usage_chunk(client, server, oracle):
    want = text_of(oracle, greedy_ids(oracle, chat_ids(oracle, MESSAGES), 8))
    stream = client.chat.completions.create(model=server.model, messages=MESSAGES, max_tokens=8, temperature=0, n=2,
                                            stream=True, stream_options={"include_usage": True})
    parts: dict[int, list[str]] = {0: [], 1: []}
    finishes: dict[int, list[str]] = {0: [], 1: []}
    usages = []
    for chunk in stream:
        if chunk.usage is not None:
            usages.append(chunk.usage)
        for choice in chunk.choices:
            parts[choice.index].append(choice.delta.content or "")
            if choice.finish_reason is not None:
                finishes[choice.index].append(choice.finish_reason)
    assert {i: "".join(p) for i, p in parts.items()} == {0: want, 1: want}
    assert all(len(f) == 1 for f in finishes.values())
    assert len(usages) == 1 and usages[0].prompt_tokens == len(chat_ids(oracle, MESSAGES))
    assert usages[0].completion_tokens == 2 * len(greedy_ids(oracle, chat_ids(oracle, MESSAGES), 8))


def penalised_greedy_ids(oracle, prompt_ids: list[int], max_new_tokens: int, repetition: float, presence: float,
                         frequency: float, min_tokens: int) -> list[int]:
    """Greedy with the penalties and min_tokens, one full forward per token (fp32), stopping at EOS."""
    from engine.model_loader import eos_token_ids

    model, tokenizer = oracle
    eos = sorted(eos_token_ids(model, tokenizer))
    seq, out = list(prompt_ids), []
    with torch.no_grad():
        while len(out) < max_new_tokens:
            logits = model(torch.tensor([seq])).logits[0, -1].float()
            seen = torch.tensor(sorted(set(seq)))
            picked = logits[seen]
            logits[seen] = torch.where(picked > 0, picked / repetition, picked * repetition)
            counts = torch.bincount(torch.tensor(out, dtype=torch.long), minlength=logits.shape[-1]).float()
            logits -= frequency * counts + presence * (counts > 0).float()
            if len(out) < min_tokens:
                logits[torch.tensor(eos)] = float("-inf")
            out.append(int(logits.argmax()))
            seq.append(out[-1])
            if out[-1] in eos:
                break
    return out


def test_penalties_and_min_tokens_through_the_sdk_equal_the_reference(client, server, oracle):
    """OpenAI's presence / frequency penalties and the extensions repetition_penalty / min_tokens (through
    `extra_body`), greedy, streamed and not: the text of the penalised greedy reference."""
    prompt = "List the days of the week: Monday, Tuesday,"
    want = text_of(oracle, penalised_greedy_ids(oracle, oracle[1](prompt)["input_ids"], 20, 1.3, 0.4, 0.6, 5))
    kw = {"model": server.model, "prompt": prompt, "max_tokens": 20, "temperature": 0, "presence_penalty": 0.4,
          "frequency_penalty": 0.6, "extra_body": {"repetition_penalty": 1.3, "min_tokens": 5}}
    assert client.completions.create(**kw).choices[0].text == want
    assert "".join(c.choices[0].text for c in client.completions.create(stream=True, **kw) if c.choices) == want
    with pytest.raises(openai.BadRequestError, match="use_beam_search"):
        client.completions.create(model=server.model, prompt=prompt, max_tokens=4, extra_body={"use_beam_search": True})


def test_logit_bias_through_the_sdk_bans_and_forces_tokens(client, server, oracle):
    """OpenAI's logit_bias (token ids as strings), greedy, on chat and completions: -100 bans the plain
    greedy first token, +100 forces a token every step; a key that is no token id, or an id beyond the
    vocabulary, is a 400 naming it."""
    prompt = "The capital of France is"
    plain = client.completions.create(model=server.model, prompt=prompt, max_tokens=4, temperature=0)
    first = oracle[1](plain.choices[0].text)["input_ids"][0]
    banned = client.completions.create(model=server.model, prompt=prompt, max_tokens=4, temperature=0,
                                       logit_bias={str(first): -100})
    assert oracle[1](banned.choices[0].text)["input_ids"][0] != first
    forced = oracle[1](" Paris")["input_ids"][0]
    chat = client.chat.completions.create(model=server.model, messages=[{"role": "user", "content": "hi"}],
                                          max_tokens=3, temperature=0, logit_bias={str(forced): 100})
    assert oracle[1](chat.choices[0].message.content)["input_ids"] == [forced] * 3
    for bad in ({"x": 1}, {str(oracle[0].config.vocab_size): 1}):  # no token id; beyond the vocabulary
        with pytest.raises(openai.BadRequestError, match="logit_bias"):
            client.completions.create(model=server.model, prompt=prompt, max_tokens=2, logit_bias=bad)


def reference_logprobs(oracle, prompt_ids: list[int], out_ids: list[int]) -> torch.Tensor:
    """[len(out_ids), V]: the fp32 log-softmax of the model's logits before each output token."""
    with torch.no_grad():
        logits = oracle[0](torch.tensor([prompt_ids + out_ids[:-1]])).logits[0, len(prompt_ids) - 1:].float()
    return torch.log_softmax(logits, dim=-1)


@pytest.mark.parametrize("stream", [False, True])
def test_completion_logprobs_through_the_sdk(client, server, oracle, stream):
    """logprobs=2, greedy: the tokens' texts and logprobs are the model's (the first token's included,
    whichever path served it), the top 2 (and the chosen one) by text, offsets over the tokens' texts."""
    tokenizer = oracle[1]
    ids = tokenizer("The capital of France is")["input_ids"]
    want = greedy_ids(oracle, ids, 6)
    ref = reference_logprobs(oracle, ids, want)
    resp = client.completions.create(model=server.model, prompt="The capital of France is", max_tokens=6,
                                     temperature=0, logprobs=2, stream=stream)
    parts = [c.choices[0].logprobs for c in resp if c.choices and c.choices[0].logprobs] if stream else \
        [resp.choices[0].logprobs]
    tokens = [t for p in parts for t in p.tokens]
    assert tokens == [tokenizer.decode([t]) for t in want]
    got = [lp for p in parts for lp in p.token_logprobs]
    assert max(abs(g - float(ref[i, t])) for i, (g, t) in enumerate(zip(got, want, strict=True))) < 1e-3
    for token, lp, top in zip(tokens, got, (t for p in parts for t in p.top_logprobs)):
        assert len(top) == 2 and max(top.values()) == top[token] == lp  # greedy: the chosen one is the likeliest
    offsets = [o for p in parts for o in p.text_offset]
    assert offsets == [sum(len(t) for t in tokens[:i]) for i in range(len(tokens))]


@pytest.mark.parametrize("stream", [False, True])
def test_chat_logprobs_through_the_sdk(client, server, oracle, stream):
    """logprobs=True, top_logprobs=3: each token's text, bytes, logprob and its top 3, the greedy token first."""
    ids = chat_ids(oracle, MESSAGES)
    want = greedy_ids(oracle, ids, 6)
    ref = reference_logprobs(oracle, ids, want)
    resp = client.chat.completions.create(model=server.model, messages=MESSAGES, max_tokens=6, temperature=0,
                                          logprobs=True, top_logprobs=3, stream=stream)
    content = [t for c in resp if c.choices and c.choices[0].logprobs for t in c.choices[0].logprobs.content] \
        if stream else resp.choices[0].logprobs.content
    assert [t.token for t in content] == [oracle[1].decode([t]) for t in want]
    for i, (entry, token_id) in enumerate(zip(content, want, strict=True)):
        assert abs(entry.logprob - float(ref[i, token_id])) < 1e-3 and entry.bytes == list(entry.token.encode())
        assert len(entry.top_logprobs) == 3 and entry.top_logprobs[0].token == entry.token
        assert [a.logprob for a in entry.top_logprobs] == sorted((a.logprob for a in entry.top_logprobs), reverse=True)
        assert abs(entry.top_logprobs[1].logprob - float(ref[i].topk(2).values[1])) < 1e-3


def test_long_prompt_through_the_server_matches_generate(client, server, oracle):
    prompt = " ".join(f"Item {i} is a {['red', 'green', 'blue'][i % 3]} box." for i in range(60)) + " Item 60 is"
    ids = oracle[1](prompt)["input_ids"]
    assert len(ids) > 400
    resp = client.completions.create(model=server.model, prompt=prompt, max_tokens=8, temperature=0)
    assert resp.choices[0].text == text_of(oracle, greedy_ids(oracle, ids, 8))


def test_models_and_health(client, server):
    """The served model, and how it runs: the server's defaults (a compiled decode step, the best
    attention kernel build for this CPU) with the dtype the e2e server sets (float32, the oracle's)."""
    from engine import hardware

    cards = client.models.list().data
    assert [m.id for m in cards] == [server.model]
    runtime = cards[0].model_extra["pdserve_runtime"]
    assert runtime["dtype"] == "float32" and runtime["dtype_reason"] == "set explicitly"
    best = hardware.choose_kernel(hardware.this_cpu(), hardware.forced_kernel()).build
    assert runtime["attention"] == (best.name if best else "torch")
    assert runtime["compiled"] is (best is not None)
    ways = runtime["linear"].split("; ")  # auto: measured per group, e.g. "packed lm_head 49152x576; kernel ..."
    assert runtime["linear"] == "plain" or all(w.startswith(tuple(f"{way} " for way in hardware.LINEAR_WAYS))
                                               for w in ways), runtime
    with urllib.request.urlopen(server.http + "/health", timeout=10) as r:
        assert r.status == 200


def test_metrics_scrape_has_ttft_samples(client, server):
    client.completions.create(model=server.model, prompt="Hello", max_tokens=4)
    with urllib.request.urlopen(server.http + "/metrics", timeout=10) as r:
        text = r.read().decode()
    families = {f.name: f for f in text_string_to_metric_families(text)}
    ttft = families["pdserve_time_to_first_token_seconds"]
    counts = [s.value for s in ttft.samples if s.name.endswith("_count")]
    assert counts and sum(counts) >= 1
    for name in ("pdserve_inter_token_latency_seconds", "pdserve_e2e_request_latency_seconds",
                 "pdserve_requests", "pdserve_placement_decisions", "pdserve_kv_blocks_used",
                 "pdserve_running_sequences", "pdserve_request_prefill_seconds"):
        assert name in families, name
    decisions = [s for s in families["pdserve_placement_decisions"].samples if s.name.endswith("_total")]
    assert decisions and all(s.labels["reason"] for s in decisions)
    feed = [s.value for s in families["pdserve_decode_feed_items"].samples if s.name.endswith("_sum")]
    assert feed and feed[0] >= 4  # the 4 tokens came through the decode worker's feed
    cpu = families["pdserve_router_process_cpu_seconds"].samples
    assert cpu and cpu[0].value > 0  # the router's own CPU time
    # every request-level series carries the served model's name; per-worker ones do not
    for name in ("pdserve_time_to_first_token_seconds", "pdserve_requests", "pdserve_placement_decisions",
                 "pdserve_prompt_tokens", "pdserve_generation_tokens", "pdserve_request_prompt_tokens",
                 "pdserve_request_generation_tokens"):
        assert families[name].samples and all(s.labels["model_name"] == server.model
                                               for s in families[name].samples), name
    prompt_lengths = [s.value for s in families["pdserve_request_prompt_tokens"].samples if s.name.endswith("_sum")]
    output_lengths = [s.value for s in families["pdserve_request_generation_tokens"].samples
                      if s.name.endswith("_count")]
    assert prompt_lengths[0] >= 1 and output_lengths[0] >= 1
    usage = families["pdserve_kv_cache_usage_ratio"].samples
    assert usage and all(0 <= s.value <= 1 and {"pool", "worker"} <= set(s.labels) for s in usage)
    preemptions = [s for s in families["pdserve_preemptions"].samples if s.name.endswith("_total")]
    assert {s.labels["worker"] for s in preemptions} == {s.labels["worker"] for s in usage}


def test_metrics_show_each_workers_engine_steps_from_its_load_reports(client, server):
    """The decode worker's decode-only steps (with their rows and seconds) and the prefill worker's prompt
    steps reach `pdserve_engine_*` through the load polls that follow a request."""
    client.completions.create(model=server.model, prompt="Tell me about the sea", max_tokens=8)

    def totals() -> dict[tuple[str, str, str], float]:
        with urllib.request.urlopen(server.http + "/metrics", timeout=10) as r:
            text = r.read().decode()
        return {(s.name, s.labels["pool"], s.labels.get("kind", "")): s.value
                for f in text_string_to_metric_families(text) if f.name.startswith("pdserve_engine_")
                for s in f.samples}

    deadline = time.monotonic() + 30
    while (t := totals()).get(("pdserve_engine_steps_total", "decode", "decode"), 0) == 0:
        assert time.monotonic() < deadline, t
        time.sleep(0.5)
    steps = t[("pdserve_engine_steps_total", "decode", "decode")]
    assert t[("pdserve_engine_step_tokens_total", "decode", "decode")] >= steps  # a row or more a step
    assert t[("pdserve_engine_step_seconds_total", "decode", "decode")] > 0
    assert t[("pdserve_engine_busy_seconds_total", "decode", "")] > 0  # the request's rounds
    assert t[("pdserve_engine_step_tokens_total", "prefill", "prompt")] > 0  # calibration's and requests' prompts


def test_start_up_shows_its_progress(server):
    """Calibration's steps, and the decode worker's own lines (its decode step compiled, then checked batch by batch)
    in the server's log, at its default level."""
    log = "".join(server.log)
    assert re.search(r"calibrating \[1/9\] .*\(0 s so far\)", log), log[-3000:]
    assert re.search(r"calibrating \[2/9\] prompts of \d+ tokens over a cached prefix of \d+", log)
    assert re.search(r"calibrating \[\d/9\] decode steps at 64 and at \d+ tokens of context \(3 pairs\)", log)
    assert "calibrating [8/9] KV transfer" in log
    assert re.search(r"calibrating \[9/9\] decode steps at \d+ tokens of context during prompts", log)
    assert re.search(r"decode step graph \(any batch, \d+ threads\) compiled and checked at batch 2 in", log), log[-3000:]
    assert re.search(r"decode step graph \(any batch, \d+ threads\) checked at batch 1 in", log), log[-3000:]
    # only the decode worker compiles one: the prefill worker runs prompt passes only (no role flips)
    compiled_by = set(re.findall(r"\((\w+Worker) pid=\d+\)\S*\s+INFO engine\.model_runner: decode step graph", log))
    assert compiled_by == {"DecodeWorker"}, log[-3000:]


def post(server, path: str, body: bytes | dict) -> tuple[int, dict]:
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    req = urllib.request.Request(server.http + path, data=data, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


@pytest.mark.parametrize("path,body,status,param", [
    ("/v1/completions", b"{not json", 400, None),
    ("/v1/completions", {"model": "smollm2"}, 400, "prompt"),
    ("/v1/completions", {"model": "smollm2", "prompt": ""}, 400, "prompt"),
    ("/v1/completions", {"model": "smollm2", "prompt": "hi " * 9000}, 400, "prompt"),
    ("/v1/completions", {"model": "smollm2", "prompt": "hi", "max_tokens": 0}, 400, "max_tokens"),
    ("/v1/completions", {"model": "smollm2", "prompt": "hi", "max_tokens": 10**9}, 400, "max_tokens"),
    ("/v1/completions", {"model": "smollm2", "prompt": "hi", "max_tokens": "ten"}, 400, "max_tokens"),
    ("/v1/completions", {"model": "smollm2", "prompt": "hi", "n": 17}, 400, "n"),
    ("/v1/completions", {"model": "smollm2", "prompt": "hi", "best_of": 2, "stream": True}, 400, "best_of"),
    ("/v1/completions", {"model": "smollm2", "prompt": "hi", "echo": True, "logprobs": 0}, 400, "echo"),
    ("/v1/completions", {"model": "smollm2", "prompt": "hi", "logprobs": 21}, 400, "logprobs"),
    ("/v1/chat/completions", {"model": "smollm2", "messages": MESSAGES, "logprobs": True, "top_logprobs": 30}, 400,
     "top_logprobs"),
    ("/v1/completions", {"model": "smollm2", "prompt": "hi", "temperature": -1}, 400, "temperature"),
    ("/v1/completions", {"model": "nope", "prompt": "hi"}, 404, "model"),
    ("/v1/chat/completions", {"model": "smollm2", "messages": []}, 400, "messages"),
    ("/v1/chat/completions", {"model": "smollm2", "messages": "hi"}, 400, "messages"),
    ("/v1/chat/completions", {"model": "smollm2", "messages": MESSAGES, "top_p": 2}, 400, "top_p"),
])
def test_bad_input_gets_a_clear_error(server, path, body, status, param):
    code, payload = post(server, path, body)
    assert code == status, payload
    err = payload["error"]
    assert set(err) >= {"message", "type", "param", "code"} and err["message"]
    if param is not None:
        assert err["param"] == param, err
    assert "Traceback" not in json.dumps(payload)


def test_request_timeout_is_408_and_aborts_the_request(server):
    code, payload = post(server, "/v1/completions", {"model": "smollm2", "prompt": "Tell me a long story.",
                                                      "max_tokens": 2000, "ignore_eos": True, "timeout": 0.5})
    assert code == 408, payload
    assert payload["error"]["param"] == "timeout" and payload["error"]["type"] == "timeout_error"
    with urllib.request.urlopen(server.http + "/metrics", timeout=10) as r:
        text = r.read().decode()
    families = {f.name: f for f in text_string_to_metric_families(text)}
    deadline = [s for s in families["pdserve_requests"].samples
                if s.name.endswith("_total") and s.labels["outcome"] == "deadline"]
    assert deadline and sum(s.value for s in deadline) >= 1


def test_still_serving_after_errors(client, server):
    post(server, "/v1/completions", b"[1, 2")
    resp = client.completions.create(model=server.model, prompt="Hello", max_tokens=2)
    assert resp.choices[0].finish_reason in ("stop", "length")


def test_tokenize_is_the_models_tokenizer_and_its_chat_template(server, oracle):
    tokenizer = oracle[1]
    text = "Disaggregated serving: prefill here, decode there. Ünïcödé too."
    status, body = post(server, "/tokenize", {"model": server.model, "prompt": text})
    assert status == 200 and body["tokens"] == tokenizer(text)["input_ids"] and body["count"] == len(body["tokens"])
    status, body = post(server, "/tokenize", {"messages": MESSAGES})
    hf = tokenizer.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=True)
    assert status == 200 and body["tokens"] == list(hf["input_ids"] if hasattr(hf, "keys") else hf)
    status, back = post(server, "/detokenize", {"tokens": tokenizer(text)["input_ids"]})
    assert status == 200 and back["prompt"] == tokenizer.decode(tokenizer(text)["input_ids"])
    status, body = post(server, "/detokenize", {"tokens": [10**6]})
    assert status == 400 and body["error"]["param"] == "tokens"
    with urllib.request.urlopen(server.http + "/version", timeout=30) as resp:
        assert json.loads(resp.read())["version"]
