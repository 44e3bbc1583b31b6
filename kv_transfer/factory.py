"""The one place that turns a `TransferConfig` into a connector."""
from __future__ import annotations

from collections.abc import Callable

from kv_transfer.base import KVConnector
from kv_transfer.config import BACKENDS, TransferConfig


def _torch_dist(config: TransferConfig, worker_id: str) -> KVConnector:
    from kv_transfer.torch_dist import TorchDistConnector
    return TorchDistConnector(config, worker_id)


def _object_store(config: TransferConfig, worker_id: str) -> KVConnector:
    from kv_transfer.object_store import ObjectStoreConnector  # imports ray
    return ObjectStoreConnector(config, worker_id)


def _local(config: TransferConfig, worker_id: str) -> KVConnector:
    from kv_transfer.local import LocalConnector
    return LocalConnector(config, worker_id)


_MAKERS: dict[str, Callable[[TransferConfig, str], KVConnector]] = {
    "torch_dist": _torch_dist, "object_store": _object_store, "local": _local}
assert set(_MAKERS) == set(BACKENDS)


def make_connector(config: TransferConfig, worker_id: str) -> KVConnector:
    """Build the connector `config.backend` names.

    Args:
        config: validated transfer settings.
        worker_id: this worker's unique id.

    Returns:
        a new, unregistered connector.
    """
    if not worker_id:
        raise ValueError("worker_id must be a non-empty string")
    return _MAKERS[config.backend](config, worker_id)
