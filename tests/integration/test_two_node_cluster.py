"""A real 2-node Ray cluster on this machine, started the way a deployment does it: the head
advertises `prefill_pool`, a second node `decode_pool`. Prefill actors land only on the first,
decode actors only on the second, and a request completes across them over gloo."""
from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import greedy_reference, random_prompt, tiny_model

pytestmark = pytest.mark.slow  # note: teardown runs `ray stop --force`, which stops every Ray on the machine
RAY = str(Path(sys.executable).with_name("ray"))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def ray_cli(*args: str) -> None:
    # Token auth is Ray's default for local clusters; this driver (and a cluster on loopback) runs
    # without it, so the nodes are started the same way.
    env = {**os.environ, "RAY_AUTH_MODE": "disabled"}
    res = subprocess.run([RAY, *args], capture_output=True, text=True, timeout=180, env=env)
    assert res.returncode == 0, res.stdout + res.stderr


@pytest.fixture(scope="module")
def two_nodes():
    address = f"127.0.0.1:{free_port()}"
    ray_cli("start", "--head", f"--port={address.split(':')[1]}", "--node-ip-address=127.0.0.1", "--num-cpus=1",
            f"--resources={json.dumps({'prefill_pool': 2})}", "--include-dashboard=false", "--disable-usage-stats")
    try:
        ray_cli("start", f"--address={address}", "--node-ip-address=127.0.0.1", "--num-cpus=1",
                f"--resources={json.dumps({'decode_pool': 2})}", "--disable-usage-stats")
        yield address
    finally:
        ray_cli("stop", "--force")


def test_pools_land_on_their_nodes_and_serve_across_them(two_nodes, tmp_path):
    ref = tiny_model("llama", seed=4)
    ref.save_pretrained(tmp_path)
    prompt = random_prompt(70, 8)
    driver = Path(__file__).with_name("two_node_driver.py")
    res = subprocess.run([sys.executable, str(driver), two_nodes, str(tmp_path), json.dumps(prompt), "16"],
                         capture_output=True, text=True, timeout=300, cwd=Path(__file__).parents[2],
                         env={**os.environ, "RAY_AUTH_MODE": "disabled"})
    assert res.returncode == 0, res.stderr[-3000:]
    out = json.loads(res.stdout.strip().splitlines()[-1])
    assert out["prefill_nodes"] == [out["nodes"]["prefill"]]
    assert out["decode_nodes"] == [out["nodes"]["decode"]]
    assert out["nodes"]["prefill"] != out["nodes"]["decode"]
    assert out["token_ids"] == greedy_reference(ref, prompt, 16)
