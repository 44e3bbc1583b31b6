"""Driver for test_two_node_cluster, run in a fresh process (a Ray driver connects once per process).

Usage: python two_node_driver.py ADDRESS MODEL_DIR → prints JSON: node ids per pool and tokens."""
from __future__ import annotations

import json
import sys

import ray

from engine import CacheConfig, EngineConfig, SamplingParams
from kv_transfer import TransferConfig
from router.pools import create_pools

from direct_driver import Orchestrator  # this folder: the script runs as a file


def main(address: str, model_dir: str, prompt: list[int], max_tokens: int) -> dict:
    ray.init(address=address, log_to_driver=False)
    cfg = EngineConfig(model=model_dir, dtype="float32", num_threads=1, cache=CacheConfig(memory_gib=0.02))
    pools = create_pools(2, 2, cfg, TransferConfig(backend="torch_dist", timeout_s=30, host="127.0.0.1"),
                         num_cpus=0)
    try:
        nodes = {("prefill" if n["Resources"].get("prefill_pool") else "decode"): n["NodeID"]
                 for n in ray.nodes() if n["Alive"]}
        got = Orchestrator(pools).generate(prompt, SamplingParams(max_tokens=max_tokens), remote=True, prefill=1,
                                           decode=1)
        return {"nodes": nodes, "prefill_nodes": sorted({ray.get(w.node_id.remote()) for w in pools.prefill}),
                "decode_nodes": sorted({ray.get(w.node_id.remote()) for w in pools.decode}),
                "token_ids": got.token_ids}
    finally:
        pools.shutdown()
        ray.shutdown()


if __name__ == "__main__":
    print(json.dumps(main(sys.argv[1], sys.argv[2], json.loads(sys.argv[3]), int(sys.argv[4]))))
