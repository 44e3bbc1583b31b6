"""`pdserve generate`, `pdserve model` and `pdserve serve`'s refusals as a user runs them."""
from __future__ import annotations

import subprocess
import sys

import pytest


def run_cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "pdserve", *args], capture_output=True, text=True, timeout=300)


@pytest.mark.model
def test_generate_streams_text_and_prints_phase_split():
    # fp32: the embedded model's first words here are near-ties that bf16 rounding may break either way
    res = run_cli("generate", "What is the capital of France?", "--max-tokens", "24", "--threads", "2",
                  "--dtype", "float32")
    assert res.returncode == 0, res.stderr
    assert "Paris" in res.stdout
    assert "prefill" in res.stderr and "decode" in res.stderr and "tok/s" in res.stderr


def test_unknown_model_path_is_a_clear_error(tmp_path):
    res = run_cli("generate", "hi", "--model", str(tmp_path / "nope"))
    assert res.returncode == 2
    assert "does not exist" in res.stderr or "not found" in res.stderr.lower()
    assert "--model" in res.stderr
    assert "Traceback" not in res.stderr


@pytest.mark.parametrize("flag,value,field", [("--max-tokens", "0", "max_tokens"),
                                              ("--temperature", "-1", "temperature"),
                                              ("--top-p", "1.5", "top_p"), ("--top-p", "0", "top_p")])
def test_bad_sampling_flags_name_the_field(flag, value, field):
    res = run_cli("generate", "hi", flag, value)
    assert res.returncode == 2
    assert field in res.stderr and "Traceback" not in res.stderr


def test_model_path_prints_cache_location(tmp_path):
    res = subprocess.run([sys.executable, "-m", "pdserve", "model", "path", "--check"], capture_output=True,
                         text=True, env={"PDSERVE_CACHE": str(tmp_path), "PATH": "/usr/bin:/bin"})
    assert res.returncode == 2
    assert "pdserve model fetch" in res.stderr


@pytest.mark.parametrize("content", [None, "{not json", '{"prefill": {"fixed_s": 0.1}}'])
def test_serve_refuses_a_cost_model_it_cannot_use_before_starting_anything(tmp_path, content):
    path = tmp_path / "cost.json"
    if content is not None:
        path.write_text(content)
    res = run_cli("serve", "--cost-model", str(path), "--http-port", "0", "--grpc-port", "0")
    assert res.returncode == 2, res.stderr[-2000:]
    assert f"cost_model: cannot read {path}" in res.stderr or f"cost_model: {path} holds no valid" in res.stderr
    assert "Traceback" not in res.stderr and "Started a local Ray" not in res.stderr  # refused before Ray started
