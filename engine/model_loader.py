"""Loads a local Hugging Face causal-LM directory (or the embedded default) for the engine."""
from __future__ import annotations

from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedModel, PreTrainedTokenizerBase

from engine.model_store import ModelError, resolve_model

TORCH_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def dtype_name(model: PreTrainedModel) -> str:
    """The dtype name (a TORCH_DTYPES key) of a loaded model's weights."""
    dtype = next(model.parameters()).dtype
    return next(name for name, t in TORCH_DTYPES.items() if t == dtype)


def load_model(model: str | Path | None, dtype: str,
               device: str) -> tuple[PreTrainedModel, PreTrainedTokenizerBase | None]:
    """Load weights and tokenizer from a local directory.

    Args:
        model: model directory; None means the embedded default (fetched by `pdserve model fetch`).
        dtype: one of float32, bfloat16, float16.
        device: torch device string.
    Returns:
        (model in eval mode on `device`, tokenizer or None when the directory has no tokenizer files).
    Raises:
        ModelError: the directory is missing, incomplete, corrupt or not a causal LM.
    """
    path = resolve_model(model)
    try:
        hf_model = AutoModelForCausalLM.from_pretrained(path, dtype=TORCH_DTYPES[dtype])
    except (OSError, ValueError, KeyError, RuntimeError) as e:
        raise ModelError(f"could not load a causal LM from {path}: {e}. Pass --model PATH to a Hugging Face "
                         "causal-LM directory (config.json + *.safetensors), or re-fetch the default with "
                         "`pdserve model fetch --force`") from e
    return hf_model.to(device).eval(), load_tokenizer(path)


def load_tokenizer(model: str | Path | None) -> PreTrainedTokenizerBase | None:
    """The tokenizer of a local model directory; None when it has no tokenizer files (token ids only).

    Raises:
        ModelError: the directory is missing, or its tokenizer files do not load.
    """
    path = resolve_model(model)
    if not any((path / f).exists() for f in ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")):
        return None
    try:
        return AutoTokenizer.from_pretrained(path)
    except (OSError, ValueError, KeyError) as e:
        raise ModelError(f"could not load the tokenizer from {path}: {e}. The model directory needs its "
                         "tokenizer files (tokenizer.json / tokenizer_config.json)") from e


def eos_token_ids(model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase | None) -> frozenset[int]:
    """Every token id that ends generation by default (generation config, model config, tokenizer)."""
    ids: set[int] = set()
    sources = [getattr(model, "generation_config", None), model.config.get_text_config()]
    for src in sources:
        value = getattr(src, "eos_token_id", None) if src is not None else None
        if isinstance(value, int):
            ids.add(value)
        elif isinstance(value, (list, tuple)):
            ids.update(int(v) for v in value)
    if tokenizer is not None and tokenizer.eos_token_id is not None:
        ids.add(int(tokenizer.eos_token_id))
    return frozenset(ids)


def max_context(model: PreTrainedModel) -> int:
    cfg = model.config.get_text_config()
    return int(getattr(cfg, "max_position_embeddings", None) or 2048)


def encode_prompt(tokenizer: PreTrainedTokenizerBase, prompt: str | list[dict], chat: bool,
                  tools: list[dict] | None = None) -> list[int]:
    """Token ids of a text prompt, or of chat messages through the model's chat template (`tools`:
    function specs in transformers' format, handed to the template)."""
    if isinstance(prompt, list):
        if not tokenizer.chat_template:
            raise ModelError("this model has no chat template; send a plain text prompt instead of messages")
        ids = tokenizer.apply_chat_template(prompt, tools=tools, add_generation_prompt=True, tokenize=True)
        return list(ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids)
    if chat and tokenizer.chat_template:
        return encode_prompt(tokenizer, [{"role": "user", "content": prompt}], chat=True)
    return list(tokenizer(prompt)["input_ids"])
