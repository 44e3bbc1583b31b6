"""`--chat-template`: a file or the template itself, as vLLM's flag; chat prompts (`/tokenize` with
messages included) become exactly the tokens `apply_chat_template(..., chat_template=T)` gives; a
template that cannot be read or rendered is refused at start-up, naming the flag, before any worker."""
from __future__ import annotations

import pytest
from tokenizers import Tokenizer, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

from engine.chat_template import load_chat_template, use_chat_template
from engine.config import EngineConfig
from router.admission import Admission, ModelLimits
from router.policy import OutputLengthEstimator
from router.types import GenerateRequest
from worker_core.protocol import WorkerInfo

OWN = "{% for m in messages %}<|{{ m.role }}|>{{ m.content }}\n{% endfor %}{% if add_generation_prompt %}<|a|>{% endif %}"
CUSTOM = "{% for m in messages %}[{{ m.role | upper }}] {{ m.content }} [END]{% endfor %}{{ '>>' }}"
MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is a KV cache?"}]


@pytest.fixture
def tok() -> PreTrainedTokenizerFast:
    t = Tokenizer(models.BPE(unk_token="<unk>"))
    t.pre_tokenizer = pre_tokenizers.Whitespace()
    t.train_from_iterator(["[SYSTEM] [USER] <|user|> <|a|> Be brief. What is a KV cache? [END] >> Hello!"] * 4,
                          trainers.BpeTrainer(vocab_size=120, special_tokens=["<unk>", "<eos>"], show_progress=False))
    tok = PreTrainedTokenizerFast(tokenizer_object=t, eos_token="<eos>", unk_token="<unk>")
    tok.chat_template = OWN
    return tok


def hf(tok, messages: list[dict], **kw) -> list[int]:
    """transformers' own rendering and tokenization of `messages`."""
    out = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, **kw)
    return list(out["input_ids"] if hasattr(out, "keys") else out)


def admission(tok) -> Admission:
    info = WorkerInfo(worker_id="d0", num_blocks=64, block_size=16, kv_bytes_per_token=64, num_layers=2,
                      max_num_seqs=8, max_model_len=512, prefill_chunk_tokens=64, vocab_size=len(tok), dtype="float32",
                      dtype_reason="test", attention="torch", compiled=False, linear="plain")
    return Admission(tok, "m", ModelLimits.from_infos([], [info]), 16, OutputLengthEstimator())


def test_a_file_or_the_template_itself(tmp_path):
    f = tmp_path / "t.jinja"
    f.write_text(CUSTOM)
    assert load_chat_template(str(f)) == CUSTOM
    assert load_chat_template(CUSTOM) == CUSTOM  # no such file, and it reads as a template
    assert load_chat_template("{{ 'a' }}\\n{{ 'b' }} café") == "{{ 'a' }}\n{{ 'b' }} café"  # one line: escapes decoded
    assert load_chat_template("{{ 'a' }}\n\\n") == "{{ 'a' }}\n\\n"  # given whole (it has newlines): as it is


@pytest.mark.parametrize("value,why", [
    ("/nonexistent/chat.jinja", "cannot be read: No such file or directory"),
    ("template.jinja", "is read as a file"),
])
def test_a_path_that_cannot_be_read_names_the_flag(value, why):
    with pytest.raises(ValueError, match="--chat-template") as e:
        load_chat_template(value)
    assert why in str(e.value)


def test_a_directory_or_an_empty_file_is_refused(tmp_path):
    with pytest.raises(ValueError, match="--chat-template.*cannot be read"):
        load_chat_template(str(tmp_path))
    (tmp_path / "empty.jinja").write_text("  \n")
    with pytest.raises(ValueError, match="--chat-template: the template .* is empty"):
        load_chat_template(str(tmp_path / "empty.jinja"))


def test_the_template_changes_the_prompt_tokens_exactly_as_transformers_does(tok, tmp_path):
    own = admission(tok).tokenize(GenerateRequest(messages=MESSAGES))
    assert own == hf(tok, MESSAGES)
    f = tmp_path / "custom.jinja"
    f.write_text(CUSTOM)
    assert use_chat_template(tok, str(f)) == CUSTOM
    custom = admission(tok).tokenize(GenerateRequest(messages=MESSAGES))  # what POST /tokenize answers
    assert custom == hf(tok, MESSAGES, chat_template=CUSTOM) and custom != own
    assert admission(tok).tokenize(GenerateRequest(prompt="Be brief.")) == tok("Be brief.")["input_ids"]  # text: none


@pytest.mark.parametrize("template,why", [
    ("{% if %}broken", "TemplateSyntaxError"),
    ("{{ raise_exception('this template wants a system message first') }}", "wants a system message first"),
    ("{% if false %}{{ messages }}{% endif %}\n", "no tokens at all"),
])
def test_a_template_that_does_not_render_one_message_is_refused(tok, template, why):
    with pytest.raises(ValueError, match="--chat-template") as e:
        use_chat_template(tok, template)
    assert why in str(e.value)
    assert tok.chat_template == OWN  # left as it was


def test_a_model_without_a_tokenizer_takes_no_template():
    with pytest.raises(ValueError, match="--chat-template: this model has no tokenizer"):
        use_chat_template(None, CUSTOM)


def test_the_flag_sets_the_engine_configs_field():
    from pdserve import flags
    from pdserve.cli import build_parser
    from pdserve.serve import ServeConfig

    for argv in (["serve", "--chat-template", "t.jinja"], ["generate", "hi", "--chat-template", "t.jinja"]):
        args = build_parser().parse_args(argv)
        paths = flags.SERVE + flags.ENGINE if argv[0] == "serve" else flags.ENGINE
        assert flags.build(ServeConfig(), args, paths).engine.chat_template == "t.jinja"
    assert build_parser().parse_args(["serve"]).chat_template is None
    with pytest.raises(ValueError, match="chat_template"):
        EngineConfig(chat_template=" ")


@pytest.mark.model
def test_serve_refuses_a_bad_template_before_any_worker_starts(tmp_path, capsys, monkeypatch):
    from pdserve import cli, serve

    connected: list[object] = []
    monkeypatch.setattr(serve, "_connect", connected.append)  # Ray, then the workers: never reached

    bad = tmp_path / "bad.jinja"
    bad.write_text("{% for m in messages %}{{ m.content }")
    assert cli.main(["serve", "--chat-template", str(bad)]) == 2
    err = capsys.readouterr().err
    assert "--chat-template: the template could not render a one-message conversation" in err
    assert cli.main(["serve", "--chat-template", str(tmp_path / "missing.jinja")]) == 2
    assert "--chat-template" in capsys.readouterr().err
    assert connected == []
