"""The NCCL path: the same torch_dist connector code as gloo, with pools on two CUDA devices."""
from __future__ import annotations

import pytest
import torch

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA devices for an NCCL pair")]


def test_nccl_pair_moves_every_layer_exactly():
    import ray

    from kv_transfer import TransferConfig, TransferState, make_connector

    config = TransferConfig(backend="torch_dist", timeout_s=30, host="127.0.0.1")  # both sides: one secret

    @ray.remote(num_gpus=1)
    class Side:
        def __init__(self, name: str) -> None:
            self.pool = torch.zeros(4, 2, 2, 32, 16, 8, device="cuda")
            self.conn = make_connector(config, name)
            self.conn.register(self.pool)

        def info(self):
            return self.conn.local_info()

        def fill(self, blocks: list[int]) -> None:
            self.pool[:, :, :, blocks] = torch.randn_like(self.pool[:, :, :, blocks])

        def send(self, blocks: list[int], peer) -> None:
            for layer in range(self.pool.shape[0]):
                self.conn.send("t", layer, blocks, peer)

        def recv(self, blocks: list[int], peer) -> None:
            self.conn.recv("t", blocks, self.pool.shape[0], peer)

        def state(self) -> int:
            return int(self.conn.poll("t"))

        def blocks(self, blocks: list[int]):
            return self.pool[:, :, :, blocks].cpu()

    ray.init(num_gpus=2, include_dashboard=False)
    try:
        tx, rx = Side.remote("gpu-tx"), Side.remote("gpu-rx")
        ray.get(tx.fill.remote([1, 2, 3]))
        ray.get(rx.recv.remote([7, 8, 9], ray.get(tx.info.remote())))
        ray.get(tx.send.remote([1, 2, 3], ray.get(rx.info.remote())))
        import time

        deadline = time.monotonic() + 60
        while ray.get(rx.state.remote()) < TransferState.DONE and time.monotonic() < deadline:
            time.sleep(0.05)
        assert ray.get(rx.state.remote()) == TransferState.DONE
        assert torch.equal(ray.get(tx.blocks.remote([1, 2, 3])), ray.get(rx.blocks.remote([7, 8, 9])))
    finally:
        ray.shutdown()
