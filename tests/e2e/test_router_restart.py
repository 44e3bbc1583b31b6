"""A router that dies and comes back: `pdserve serve --deployment` on a Ray cluster of its own (a
`ray start` head), its process killed mid-stream, started again with the same name. The new router
adopts the running workers (no new ones, no calibration), their old requests are dropped with every
block back in the pool, and it serves output equal to transformers `generate`; `pdserve stop` ends
the workers."""
from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.e2e.conftest import chat_ids, cost_model_of, greedy_ids, start_server, stop_server, text_of
from tests.integration.ray_nodes import ENV, free_port, start_node, stop_group

pytestmark = [pytest.mark.model, pytest.mark.slow]
MESSAGES = [{"role": "user", "content": "Name three colors."}]


@pytest.fixture(scope="module")
def head():
    address = f"127.0.0.1:{free_port()}"
    tmp = Path(tempfile.mkdtemp(prefix="pdr-", dir="/tmp"))  # short: Ray's socket paths must fit 107 bytes
    node = start_node(["--head", f"--port={address.split(':')[1]}", f"--temp-dir={tmp / 'ray'}", "--num-cpus=2",
                       f"--resources={json.dumps({'prefill_pool': 1, 'decode_pool': 1})}",
                       "--include-dashboard=false"], tmp / "head.log")
    try:
        yield address
    finally:
        stop_group(node)
        shutil.rmtree(tmp, ignore_errors=True)


def free_blocks(server) -> list[tuple[float, float]]:
    """(free, total) KV blocks of every worker, from the router's metrics."""
    import urllib.request

    with urllib.request.urlopen(f"{server.http}/metrics", timeout=10) as r:
        families = {f.name: f for f in text_string_to_metric_families(r.read().decode())}
    used = {s.labels["worker"]: s.value for s in families["pdserve_kv_blocks_used"].samples}
    total = {s.labels["worker"]: s.value for s in families["pdserve_kv_blocks_total"].samples}
    return [(total[w] - used[w], total[w]) for w in sorted(total)]


def test_a_killed_router_comes_back_and_adopts_its_workers(head, oracle, cost_model_file):
    flags = ["--address", head, "--deployment", "restart-test", "--prefill", "1", "--decode", "1",
             "--no-lend-threads", "--no-compile"]
    first = start_server([*flags, "--cost-model", cost_model_file])  # a saved one: no calibration
    assert "(no calibration)" in "".join(first.log) and "calibrating" not in "".join(first.log)
    given = json.loads(Path(cost_model_file).read_text())
    assert cost_model_of(first) == given
    client = openai.OpenAI(base_url=f"{first.http}/v1", api_key="none", max_retries=0, timeout=60)
    chunks, failed = [], []

    def long_stream() -> None:
        try:
            for chunk in client.completions.create(model=first.model, prompt="Count to one thousand:",
                                                   max_tokens=2000, stream=True, extra_body={"ignore_eos": True}):
                chunks.append(chunk)  # noqa: PERF402  (one by one: the main thread watches them arrive)
        except Exception as e:  # noqa: BLE001  (the router dies under it: any client error)
            failed.append(e)
    reader = threading.Thread(target=long_stream)
    reader.start()
    while len(chunks) < 5 and reader.is_alive():
        time.sleep(0.05)
    os.killpg(first.proc.pid, signal.SIGKILL)  # the router and nothing else: the workers run under Ray
    first.proc.wait(30)
    reader.join(60)
    assert len(chunks) >= 5 and failed, "the stream should have broken off with the router"
    second = start_server(flags)
    try:
        log = "".join(second.log)
        assert "adopted deployment 'restart-test': 1 prefill + 1 decode workers running" in log, log[-3000:]
        assert "requests of the last router dropped" in log and "the deployment's cost model kept" in log
        assert "calibrating" not in log
        assert cost_model_of(second) == given  # the one the first router started from, kept with the workers
        prompt = chat_ids(oracle, MESSAGES)
        client = openai.OpenAI(base_url=f"{second.http}/v1", api_key="none", max_retries=0, timeout=120)
        out = client.chat.completions.create(model=second.model, messages=MESSAGES, max_tokens=24, temperature=0)
        assert out.choices[0].message.content == text_of(oracle, greedy_ids(oracle, prompt, 24))
        deadline = time.monotonic() + 30
        blocks = free_blocks(second)
        while any(free != total for free, total in blocks) and time.monotonic() < deadline:
            time.sleep(0.5)
            blocks = free_blocks(second)
        assert blocks and all(free == total for free, total in blocks), blocks  # nothing of the old router's
    finally:
        assert stop_server(second.proc, log=second.log) == 0
    assert "keep running" in "".join(second.log)
    def stop() -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "pdserve", "stop", "--address", head, "--deployment",
                               "restart-test"], check=False, capture_output=True, text=True, timeout=120, env=ENV)
    stopped = stop()
    assert stopped.returncode == 0 and "stopped 2 workers" in stopped.stderr, stopped.stderr[-2000:]
    again = stop()
    assert again.returncode == 1 and "has no workers" in again.stderr
