"""Unit tests for engine.model_store: pure, no network, no model loading."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from engine import model_store
from engine.model_store import ModelError, cache_root, default_model_dir, resolve_model, validate_model_dir


@pytest.fixture(autouse=True)
def _isolated_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    cache = tmp_path / "cache"
    monkeypatch.setenv("PDSERVE_CACHE", str(cache))
    return cache


def _tiny_model_dir(path: Path) -> Path:
    path.mkdir(parents=True)
    (path / "config.json").write_text(json.dumps({"model_type": "llama", "vocab_size": 8}))
    save_file({"embed.weight": torch.zeros(8, 4)}, str(path / "model.safetensors"))
    return path


def test_missing_path(tmp_path: Path) -> None:
    with pytest.raises(ModelError, match="does not exist") as e:
        validate_model_dir(tmp_path / "nope")
    assert "--model PATH" in str(e.value)


def test_file_not_dir(tmp_path: Path) -> None:
    f = tmp_path / "weights.safetensors"
    f.write_bytes(b"x")
    with pytest.raises(ModelError, match="is not a directory") as e:
        validate_model_dir(f)
    assert "config.json" in str(e.value)


def test_no_config(tmp_path: Path) -> None:
    with pytest.raises(ModelError, match="has no config.json"):
        validate_model_dir(tmp_path)


def test_bad_json(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(ModelError, match="not readable JSON"):
        validate_model_dir(tmp_path)


def test_config_not_object(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text("[1, 2]")
    with pytest.raises(ModelError, match="must hold a JSON object, got list"):
        validate_model_dir(tmp_path)


def test_no_weights(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(ModelError, match=r"no weight files \(\*\.safetensors or \*\.bin\)"):
        validate_model_dir(tmp_path)


def test_corrupt_safetensors(tmp_path: Path) -> None:
    d = _tiny_model_dir(tmp_path / "m")
    bad = d / "model-00002.safetensors"
    bad.write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00garbage-not-a-header")
    with pytest.raises(ModelError, match="is corrupt") as e:
        validate_model_dir(d)
    msg = str(e.value)
    assert str(bad) in msg and "pdserve model fetch --force" in msg and "re-download" in msg


def test_truncated_safetensors(tmp_path: Path) -> None:
    d = _tiny_model_dir(tmp_path / "m")
    f = d / "model.safetensors"
    f.write_bytes(f.read_bytes()[:20])
    with pytest.raises(ModelError, match="model.safetensors is corrupt"):
        validate_model_dir(d)


def test_valid_tiny_dir(tmp_path: Path) -> None:
    d = _tiny_model_dir(tmp_path / "m")
    validate_model_dir(d)
    assert resolve_model(str(d)) == d.resolve()


def test_resolve_given_path_invalid(tmp_path: Path) -> None:
    with pytest.raises(ModelError, match="does not exist"):
        resolve_model(tmp_path / "missing")


def test_resolve_none_empty_cache() -> None:
    with pytest.raises(ModelError) as e:
        resolve_model(None)
    msg = str(e.value)
    assert "not fetched yet" in msg and "run `pdserve model fetch`" in msg and "make run" in msg
    assert str(default_model_dir()) in msg


def test_resolve_none_with_cached_model() -> None:
    d = _tiny_model_dir(default_model_dir())
    assert resolve_model(None) == d.resolve()


def test_cache_root_honours_env(_isolated_cache: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    assert cache_root() == _isolated_cache
    assert default_model_dir() == _isolated_cache / "models" / "SmolLM2-135M-Instruct"
    monkeypatch.delenv("PDSERVE_CACHE")
    assert cache_root() == Path.home() / ".cache" / "pdserve"


def test_fetch_is_idempotent_without_network(monkeypatch: pytest.MonkeyPatch) -> None:
    d = _tiny_model_dir(default_model_dir())

    def boom(*_: object) -> None:
        raise AssertionError("must not download when the model is present")

    monkeypatch.setattr(model_store, "_download_gguf", boom)
    assert model_store.fetch_default_model(log=lambda _: None) == d


@pytest.mark.parametrize("absent", ["gguf", "accelerate"])
def test_fetch_without_the_fetch_extra_names_it(monkeypatch: pytest.MonkeyPatch, absent: str) -> None:
    monkeypatch.setitem(sys.modules, absent, None)  # import fails as if not installed

    def boom(*_: object) -> None:
        raise AssertionError("must not download without the packages to convert it")

    monkeypatch.setattr(model_store, "_download_gguf", boom)
    with pytest.raises(ModelError) as e:
        model_store.fetch_default_model(log=lambda _: None)
    assert absent in str(e.value) and "pip install 'pdserve[fetch]'" in str(e.value)


def test_a_fetched_model_needs_no_fetch_extra(monkeypatch: pytest.MonkeyPatch) -> None:
    d = _tiny_model_dir(default_model_dir())
    monkeypatch.setitem(sys.modules, "gguf", None)
    monkeypatch.setitem(sys.modules, "accelerate", None)
    assert model_store.fetch_default_model(log=lambda _: None) == d
