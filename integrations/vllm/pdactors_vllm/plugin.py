"""vLLM general plugin: makes ``"kv_connector": "PdActorsConnector"`` resolvable.

Installed as the ``vllm.general_plugins`` entry point ``pdactors``; vLLM calls :func:`register`
in every process it starts.
"""

from __future__ import annotations

__all__ = ["register"]


def register() -> None:
    """Register PdActorsConnector with vLLM's connector factory (idempotent)."""
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

    if "PdActorsConnector" not in KVConnectorFactory._registry:
        KVConnectorFactory.register_connector(
            "PdActorsConnector", "pdactors_vllm.connector", "PdActorsConnector"
        )
