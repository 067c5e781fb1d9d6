"""The bootstrap registry: which engine, at which dp/tp/pp rank, listens where.

This module holds the upstream-compatible HTTP face of the bootstrap:

* :class:`BootstrapRegistry` — the registrations, pure bookkeeping (no IO, no clock).
* :func:`serve_bootstrap` — a quart-trio app served by hypercorn under Trio with upstream
  vLLM's Mooncake bootstrap routes: ``POST /register`` (a :class:`~pdactors.messages.RegisterWorker`
  body), ``GET /query`` (the :data:`~pdactors.messages.BootstrapAnswer` JSON) and
  ``GET /health``.

The ``pdactors bootstrap`` command runs it standalone with
``trio.run(serve_bootstrap, BootstrapConfig(host=..., port=...))``; an engine embeds it with
``await nursery.start(serve_bootstrap, config)``.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Literal

import msgspec
import trio
from quart import Response, request
from quart_trio import QuartTrio
from werkzeug.exceptions import HTTPException

from pdactors.actors._http import bind_listener, serve_http
from pdactors.config import BootstrapConfig
from pdactors.messages import BootstrapAnswer, BootstrapEntry, RegisterWorker

__all__ = ["BootstrapRegistry", "Registration", "serve_bootstrap"]

log = logging.getLogger("pdactors.bootstrap")
# Hypercorn's own messages go here rather than to "hypercorn.error", whose handlers hypercorn
# would otherwise replace process-wide with a stderr handler.
_http_log = logging.getLogger("pdactors.bootstrap.http")

#: Far above any real body (five short fields); bigger bodies are refused with 413.
_MAX_BODY_BYTES = 64 * 1024

#: What a registration changed, as :meth:`BootstrapRegistry.register` reports it.
Registration = Literal["added", "moved", "unchanged", "engine_replaced"]


# --------------------------------------------------------------------------- registry (pure)


@dataclass
class _DpRank:
    engine_id: str
    addrs: dict[tuple[int, int], str] = field(default_factory=dict)  # (tp, pp) -> addr


class BootstrapRegistry:
    """The registered workers, keyed by DP rank, then TP rank, then PP rank.

    Rules:

    * One engine id per DP rank. A different engine id registering on a DP rank that is
      already known replaces that rank's whole entry (the engine restarted with a new id;
      the old engine's workers are gone).
    * Registering a (dp, tp, pp) rank that is already known under the same engine id replaces
      its address (the worker restarted on a new port).

    No IO and no checkpoints; every method is synchronous.
    """

    def __init__(self) -> None:
        self._ranks: dict[int, _DpRank] = {}

    def register(self, worker: RegisterWorker) -> Registration:
        """Record ``worker``'s address and say what changed.

        Returns ``"added"`` for a new rank, ``"moved"`` for a known rank at a new address,
        ``"unchanged"`` for a repeat, ``"engine_replaced"`` when a new engine id took over
        the DP rank. ``worker`` is already validated by its own type; nothing is raised.
        """
        key = (worker.tp_rank, worker.pp_rank)
        rank = self._ranks.get(worker.dp_rank)
        if rank is None or rank.engine_id != worker.engine_id:
            self._ranks[worker.dp_rank] = _DpRank(worker.engine_id, {key: worker.addr})
            return "added" if rank is None else "engine_replaced"
        old = rank.addrs.get(key)
        rank.addrs[key] = worker.addr
        if old is None:
            return "added"
        return "unchanged" if old == worker.addr else "moved"

    def answer(self) -> BootstrapAnswer:
        """A fresh copy of the registry in upstream's ``GET /query`` shape, ranks in order."""
        answer: BootstrapAnswer = {}
        for dp in sorted(self._ranks):
            rank = self._ranks[dp]
            worker_addr: dict[int, dict[int, str]] = {}
            for tp, pp in sorted(rank.addrs):
                worker_addr.setdefault(tp, {})[pp] = rank.addrs[tp, pp]
            answer[dp] = BootstrapEntry(engine_id=rank.engine_id, worker_addr=worker_addr)
        return answer


# --------------------------------------------------------------------------- HTTP face


def _json(body: object, status: int = 200) -> Response:
    return Response(msgspec.json.encode(body), status=status, content_type="application/json")


def _make_app(registry: BootstrapRegistry) -> QuartTrio:
    # static_folder=None: no /static route; the app serves exactly three routes.
    app = QuartTrio(__name__, static_folder=None)
    app.config["MAX_CONTENT_LENGTH"] = _MAX_BODY_BYTES
    decoder = msgspec.json.Decoder(RegisterWorker)

    @app.post("/register")
    async def register() -> Response:
        body = await request.get_data(as_text=False)
        try:
            worker = decoder.decode(body)
        except msgspec.DecodeError as exc:  # ValidationError is a DecodeError too
            return _json({"error": f"invalid registration: {exc}"}, 400)
        change = registry.register(worker)
        log.info(
            "bootstrap: engine %s dp=%d tp=%d pp=%d at %s (%s)",
            worker.engine_id,
            worker.dp_rank,
            worker.tp_rank,
            worker.pp_rank,
            worker.addr,
            change,
        )
        return _json({"ok": True})

    @app.get("/query")
    async def query() -> Response:
        return _json(registry.answer())

    @app.get("/health")
    async def health() -> Response:
        return _json({"status": "ok"})

    @app.errorhandler(HTTPException)
    async def http_error(exc: HTTPException) -> Response:
        # 404, 405, 413, ...: the same JSON error shape as a bad registration.
        return _json({"error": exc.description or exc.name}, exc.code or 500)

    @app.errorhandler(Exception)
    async def internal_error(exc: Exception) -> Response:
        # Handled here so that Quart never builds its own logger (it would start a queue
        # listener thread); the bug is logged with its traceback and the server keeps going.
        log.error("bootstrap: internal error on %s %s", request.method, request.path, exc_info=exc)
        return _json({"error": f"internal error: {type(exc).__name__}"}, 500)

    return app


async def serve_bootstrap(
    config: BootstrapConfig,
    *,
    task_status: trio.TaskStatus[str] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Serve the bootstrap registry over HTTP until cancelled.

    Binds ``config.host:config.port`` (port 0: a free port), then reports the bound URL, e.g.
    ``"http://127.0.0.1:40123"``, through ``task_status.started`` (a wildcard host is
    reported as loopback, so the URL can be dialled). Every request is answered; bad input
    gets a 400 with ``{"error": ...}`` and never stops the server. Each registration is
    logged on ``"pdactors.bootstrap"``.

    Usage: ``url = await nursery.start(serve_bootstrap, BootstrapConfig())``, or
    ``trio.run(serve_bootstrap, config)`` to run it as a process's only job.

    Raises :class:`OSError` if the address cannot be bound (before ``started``). Never returns
    normally.
    """
    sock = await bind_listener(config.host, config.port, "the bootstrap registry")
    await serve_http(
        _make_app(BootstrapRegistry()),
        sock,
        errorlog=_http_log,
        announce=lambda url: log.info("bootstrap: listening on %s", url),
        task_status=task_status,
    )
