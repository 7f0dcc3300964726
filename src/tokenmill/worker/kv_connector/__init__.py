"""The KV connector's worker side: executes the copies its scheduler side decided (core/kv_connector.py)."""

from tokenmill.worker.kv_connector.base import KVConnectorWorker
from tokenmill.worker.kv_connector.factory import make_kv_connector_worker

__all__ = ["KVConnectorWorker", "make_kv_connector_worker"]
