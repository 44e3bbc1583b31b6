"""`--chat-template`: a Jinja chat template used instead of the model's own, as vLLM's flag takes it.

The flag's value is the path of a template file, or the template itself: a value that names no
readable file and holds Jinja's `{`, `}` or a newline is the template, its backslash escapes (`\\n`
typed on one command line) decoded; any other value is a path, and one that cannot be read is an
error. The template is checked at start-up by rendering a one-message conversation, so that a
broken one fails there, naming the flag, rather than on the first chat request. No torch.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

FLAG = "--chat-template"
_TEMPLATE_CHARS = ("{", "}", "\n")
PROBE_MESSAGES = [{"role": "user", "content": "Hello!"}]  # a one-message conversation that any template renders


def load_chat_template(value: str) -> str:
    """The template text `value` stands for: the file it names, or `value` itself (see the module).

    Raises:
        ValueError: naming the flag: a path that cannot be read, or an empty template.
    """
    try:
        with open(value, encoding="utf-8") as f:
            text = f.read()
    except (OSError, UnicodeDecodeError) as e:
        if not any(c in value for c in _TEMPLATE_CHARS):
            why = e.strerror if isinstance(e, OSError) and e.strerror else str(e)
            raise ValueError(f"{FLAG}: {value!r} is no template (it has no '{{', '}}' or newline), so it is read as "
                             f"a file, which cannot be read: {why}") from None
        if "\n" in value:  # a template given whole, newlines and all: as it is
            text = value
        else:  # one line: its escapes are decoded (non-Latin-1 characters survive as \\u escapes do)
            text = value.encode("latin-1", "backslashreplace").decode("unicode_escape")
    if not text.strip():
        raise ValueError(f"{FLAG}: the template {value!r} is empty")
    return text


def use_chat_template(tokenizer: PreTrainedTokenizerBase | None, value: str) -> str:
    """Make the template `value` stands for `tokenizer`'s chat template, once it renders a one-message
    conversation. Returns the template text.

    Raises:
        ValueError: naming the flag: the file cannot be read, the model has no tokenizer, or the
            template does not render.
    """
    text = load_chat_template(value)
    if tokenizer is None:
        raise ValueError(f"{FLAG}: this model has no tokenizer, so no chat template applies (prompts are token ids)")
    try:
        ids = tokenizer.apply_chat_template(PROBE_MESSAGES, chat_template=text, add_generation_prompt=True, tokenize=True)
    except Exception as e:  # noqa: BLE001 - Jinja's and the tokenizer's errors alike: the template is at fault
        raise ValueError(f"{FLAG}: the template could not render a one-message conversation: "
                         f"{type(e).__name__}: {e}") from None
    if not len(ids["input_ids"] if hasattr(ids, "keys") else ids):
        raise ValueError(f"{FLAG}: the template renders a one-message conversation as no tokens at all")
    tokenizer.chat_template = text
    return text
