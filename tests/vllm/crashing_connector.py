"""PdActorsConnector with one injected fault, for tests: when a step hands the worker a pull
whose transfer id starts with ``crash-``, a task that raises is started in the worker's Trio
thread after the pull, so the thread dies with the pull in flight. Everything else is the real
connector. Loaded by module path (``kv_connector_module_path``)."""

from __future__ import annotations

from typing import Any

from pdactors_vllm.connector import PdActorsConnector
from pdactors_vllm.scheduler_side import PdActorsMetadata

__all__ = ["CrashingConnector"]


class CrashingConnector(PdActorsConnector):
    _crashed: set[str] = set()  # transfer ids that already killed a thread (once each)

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        super().start_load_kv(forward_context, **kwargs)
        meta = self._get_connector_metadata()
        assert isinstance(meta, PdActorsMetadata)
        worker = self.worker_side
        host = worker.host if worker is not None else None  # read once: it may be restarting
        if worker is None or host is None or not host.alive:
            return
        doomed = {p.transfer_id for p in meta.pulls.values() if p.transfer_id.startswith("crash-")}
        if doomed - self._crashed:
            self._crashed |= doomed

            async def crash() -> None:
                raise RuntimeError("injected by the test: the connector's Trio thread dies")

            host.post(host.nursery.start_soon, crash)
