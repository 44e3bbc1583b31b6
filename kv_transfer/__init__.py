"""KV transfer between workers: the connector interface and its backends (see `base`).

The names below load on first use, so that `kv_transfer.config` imports without torch (the CLI
builds its flags from it)."""
from __future__ import annotations

import importlib

_EXPORTS = {
    "KVConnector": "kv_transfer.base",
    "PeerInfo": "kv_transfer.base",
    "TransferError": "kv_transfer.base",
    "TransferState": "kv_transfer.base",
    "BACKENDS": "kv_transfer.config",
    "TransferConfig": "kv_transfer.config",
    "make_connector": "kv_transfer.factory",
}
__all__ = ["BACKENDS", "KVConnector", "PeerInfo", "TransferConfig", "TransferError", "TransferState",
           "make_connector"]
assert sorted(__all__) == sorted(_EXPORTS)


def __getattr__(name: str) -> object:
    if name not in _EXPORTS:
        raise AttributeError(f"module 'kv_transfer' has no attribute {name!r}")
    return getattr(importlib.import_module(_EXPORTS[name]), name)
