"""KV transfer between workers: the connector interface and its backends (see `base`)."""
from kv_transfer.base import KVConnector, PeerInfo, TransferError, TransferState
from kv_transfer.config import BACKENDS, TransferConfig
from kv_transfer.factory import make_connector

__all__ = ["BACKENDS", "KVConnector", "PeerInfo", "TransferConfig", "TransferError", "TransferState",
           "make_connector"]
