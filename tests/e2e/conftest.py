"""A real `pdserve serve` (separate process, local Ray, embedded model, fp32) for the e2e tests,
and transformers' greedy `generate` on the same model as the oracle."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from dataclasses import dataclass

import pytest
import torch

# A cold start (nothing in torch's compile cache yet) on a 2-core AVX2 machine compiles two decode
# graphs (one and two threads, the second from the first's kernels) and calibrates: up to ~4 min; below
# pytest's 600 s limit for the fixture.
STARTUP_S = 540


@dataclass
class Server:
    http: str  # base URL ("" until the server printed READY)
    grpc: str  # host:port ("" until then)
    model: str
    proc: subprocess.Popen
    log: list[str]


def spawn_server(extra: list[str], until: str = "READY ") -> Server:
    """`pdserve serve` with `extra` flags, once a line of its output starts with `until`.

    The server picks its own free ports (0) and names them on its READY line: a port picked here and bound
    there later can be taken in between (an outgoing connection of its Ray workers took one)."""
    cmd = [sys.executable, "-m", "pdserve", "serve", "--dtype", "float32", "--kv-memory-gib", "0.25",
           "--http-port", "0", "--grpc-port", "0", "--served-model-name", "smollm2", *extra]
    env = {**os.environ, "RAY_AUTH_MODE": "disabled", "PYTHONUNBUFFERED": "1"}
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
                            start_new_session=True)
    log: list[str] = []
    ports: dict[str, str] = {}
    reached = threading.Event()

    def pump() -> None:
        for line in proc.stdout:
            log.append(line)
            if line.startswith("READY "):
                ports.update(kv.split("=", 1) for kv in line.split()[1:])
            if line.startswith(until):
                reached.set()
    threading.Thread(target=pump, daemon=True).start()
    deadline = time.monotonic() + STARTUP_S
    while not reached.wait(0.5):
        if proc.poll() is not None or time.monotonic() > deadline:
            stop_server(proc)
            raise RuntimeError(f"pdserve serve never printed {until!r}:\n" + "".join(log[-60:]))
    if not ports:
        return Server("", "", "smollm2", proc, log)
    return Server(f"http://127.0.0.1:{ports['http']}", f"127.0.0.1:{ports['grpc']}", "smollm2", proc, log)


def start_server(extra: list[str]) -> Server:
    return spawn_server(extra)


def stop_server(proc: subprocess.Popen, timeout_s: float = 60, log: list[str] | None = None) -> int:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            raise AssertionError(f"pdserve serve did not exit within {timeout_s:.0f} s of SIGTERM; its log ends:\n"
                                 + "".join((log or [])[-60:])) from None
    return proc.returncode


@pytest.fixture(scope="session")
def server():
    srv = start_server(["--prefill", "1", "--decode", "1"])
    yield srv
    code = stop_server(srv.proc, log=srv.log)
    assert code == 0, "".join(srv.log[-40:])


def cost_model_of(server: Server) -> dict:
    """What a server's `GET /pdserve/cost_model` answers: the cost model it places requests with."""
    with urllib.request.urlopen(f"{server.http}/pdserve/cost_model", timeout=10) as r:
        return json.loads(r.read())


@pytest.fixture(scope="session")
def cost_model_file(server, tmp_path_factory) -> str:
    """The session server's calibrated cost model saved to a file: `--cost-model` starts a server of the same
    model and dtype without calibrating, for tests about other things."""
    path = tmp_path_factory.mktemp("cost") / "cost_model.json"
    path.write_text(json.dumps(cost_model_of(server)))
    return str(path)


@pytest.fixture(scope="session")
def oracle():
    """(model, tokenizer) of the embedded model in fp32, for greedy references."""
    from engine.model_loader import load_model

    torch.set_num_threads(1)
    model, tokenizer = load_model(None, "float32", "cpu")
    return model, tokenizer


def greedy_ids(oracle, prompt_ids: list[int], max_new_tokens: int) -> list[int]:
    model, tokenizer = oracle
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt_ids]), max_new_tokens=max_new_tokens, do_sample=False,
                             pad_token_id=tokenizer.eos_token_id)
    return out[0, len(prompt_ids):].tolist()


def chat_ids(oracle, messages: list[dict]) -> list[int]:
    from engine.model_loader import encode_prompt

    return encode_prompt(oracle[1], messages, chat=True)


def text_of(oracle, ids: list[int]) -> str:
    return oracle[1].decode(ids, skip_special_tokens=True)
