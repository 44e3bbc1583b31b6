"""A real 2-node Ray cluster on this machine, started the way a deployment does it: the head
advertises `prefill_pool`, a second node `decode_pool`. Prefill actors land only on the first,
decode actors only on the second, and a request completes across them over gloo."""
from __future__ import annotations

import json
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from tests.conftest import greedy_reference, random_prompt, tiny_model
from tests.integration.ray_nodes import ENV, free_port, start_node, stop_group

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def two_nodes():
    address = f"127.0.0.1:{free_port()}"
    tmp = Path(tempfile.mkdtemp(prefix="pd2-", dir="/tmp"))  # short: Ray's socket paths must fit 107 bytes
    nodes = []
    try:
        nodes.append(start_node(["--head", f"--port={address.split(':')[1]}", f"--temp-dir={tmp / 'ray'}",
                                 "--num-cpus=1", f"--resources={json.dumps({'prefill_pool': 2})}",
                                 "--include-dashboard=false"], tmp / "head.log"))
        nodes.append(start_node([f"--address={address}", "--num-cpus=1",
                                 f"--resources={json.dumps({'decode_pool': 2})}"], tmp / "decode.log"))
        yield address
    finally:
        for proc in reversed(nodes):
            stop_group(proc)
        shutil.rmtree(tmp, ignore_errors=True)


def test_pools_land_on_their_nodes_and_serve_across_them(two_nodes, tmp_path):
    ref = tiny_model("llama", seed=4)
    ref.save_pretrained(tmp_path)
    prompt = random_prompt(70, 8)
    driver = Path(__file__).with_name("two_node_driver.py")
    res = subprocess.run([sys.executable, str(driver), two_nodes, str(tmp_path), json.dumps(prompt), "16"],
                         capture_output=True, text=True, timeout=300, cwd=Path(__file__).parents[2],
                         env=ENV)
    assert res.returncode == 0, res.stderr[-3000:]
    out = json.loads(res.stdout.strip().splitlines()[-1])
    assert out["prefill_nodes"] == [out["nodes"]["prefill"]]
    assert out["decode_nodes"] == [out["nodes"]["decode"]]
    assert out["nodes"]["prefill"] != out["nodes"]["decode"]
    assert out["token_ids"] == greedy_reference(ref, prompt, 16)
