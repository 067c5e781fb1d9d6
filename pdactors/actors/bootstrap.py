"""The bootstrap registry's HTTP face: which engine, at which dp/tp/pp rank, listens where.

:func:`serve_bootstrap` serves, with quart-trio under hypercorn, upstream vLLM's Mooncake
bootstrap routes over a :class:`~pdactors.core.registry.BootstrapRegistry` (the pure
bookkeeping, re-exported here): ``POST /register`` (a
:class:`~pdactors.wire.RegisterWorker` body), ``GET /query`` (the
:data:`~pdactors.wire.BootstrapAnswer` JSON) and ``GET /health``.

The registry is bounded: at most ``BootstrapConfig.max_workers`` registrations (4,096 by
default; one more is refused with 429 until some lapse or are replaced), and each field within
:data:`MAX_ENGINE_ID_CHARS`, :data:`MAX_ADDR_CHARS` and :data:`MAX_RANK` (400 beyond), so its
memory and its ``/query`` answer stay within a few MB whatever clients send. A registration
that would move a rank whose holder's lease is live elsewhere is refused with 409
(:class:`~pdactors.errors.RankHeld`, the registry's rules).

Registrations are leases when they say so: ``POST /register?lease=SECONDS`` (our senders renew
every second or so) lapses unless renewed within ``SECONDS``, so a dead P leaves ``/query`` by
itself. A registration without ``lease`` (upstream's tools register once) never lapses. A
lapsed lease is logged when it lapses: the expiry task sleeps until the registry's next expiry
(re-armed when a registration brings an earlier one), never on a fixed tick.

The ``pdactors bootstrap`` command runs it standalone with
``trio.run(serve_bootstrap, BootstrapConfig(host=..., port=...))``; an engine embeds it with
``await nursery.start(serve_bootstrap, config)``.
"""

from __future__ import annotations

import logging
import math
from typing import Final

import msgspec
import trio
from quart import Response, request
from quart_trio import QuartTrio
from werkzeug.exceptions import HTTPException

from pdactors.config import BootstrapConfig
from pdactors.core.registry import (
    MAX_ADDR_CHARS,
    MAX_ENGINE_ID_CHARS,
    MAX_RANK,
    BootstrapRegistry,
    RankHeld,
    Registration,
    RegistryFull,
)
from pdactors.web._app import client_address, guard, json_response
from pdactors.web._auth import BearerCheck
from pdactors.web._connections import ConnectionLimits
from pdactors.web._refusals import RefusalLog
from pdactors.web._server import bind_listener, serve_http
from pdactors.wire import RegisterWorker

__all__ = [
    "MAX_ADDR_CHARS",
    "MAX_ENGINE_ID_CHARS",
    "MAX_RANK",
    "BootstrapRegistry",
    "Registration",
    "RegistryFull",
    "serve_bootstrap",
]

log = logging.getLogger("pdactors.bootstrap")
# Hypercorn's own messages go here rather than to "hypercorn.error", whose handlers hypercorn
# would otherwise replace process-wide with a stderr handler.
_http_log = logging.getLogger("pdactors.bootstrap.http")

#: Far above any real body (six short fields); bigger bodies are refused with 413 (from their
#: Content-Length when they give one, before a byte of them is read).
_MAX_BODY_BYTES: Final = 16 * 1024
#: The longest a client may take to send a body (seconds); then 408 and the connection closes.
_BODY_TIMEOUT: Final = 10.0
#: The longest lease a registration may ask for (seconds).
_MAX_LEASE: Final = 3600.0


# --------------------------------------------------------------------------- HTTP face


def _make_app(
    registry: BootstrapRegistry, token: str | None = None, expiry: _Expiry | None = None
) -> QuartTrio:
    # static_folder=None: no /static route; the app serves exactly three routes.
    app = QuartTrio(__name__, static_folder=None)
    app.config["MAX_CONTENT_LENGTH"] = _MAX_BODY_BYTES
    app.config["BODY_TIMEOUT"] = _BODY_TIMEOUT
    decoder = msgspec.json.Decoder(RegisterWorker)
    refusals = RefusalLog(log, "the bootstrap registry")
    check = BearerCheck(token, "the bootstrap registry", refusals)

    def refuse(status: int, message: str) -> Response:
        refusals.refused(client_address(), status, message)
        return json_response({"error": message}, status)

    def unauthorized(client: str, reason: str) -> Response:  # (logged by ``check``)
        headers = {"WWW-Authenticate": 'Bearer realm="pdactors"'}
        return json_response({"error": reason}, 401, headers)

    def http_error(exc: HTTPException, client: str) -> Response:
        # 404, 405, 408, 413, ...: the same JSON error shape as a bad registration.
        return refuse(exc.code or 500, exc.description or exc.name)

    guard(
        app,
        check=check,
        open_paths=("/health",),  # load balancers and the proxy's health loop
        unauthorized=unauthorized,
        http_error=http_error,
        internal_error=lambda message: json_response({"error": message}, 500),
        log=log,
        who="bootstrap",
    )

    @app.post("/register")
    async def register() -> Response:
        body = await request.get_data(as_text=False)
        try:
            worker = decoder.decode(body)
        except msgspec.DecodeError as exc:  # ValidationError is a DecodeError too
            return refuse(400, f"invalid registration: {exc}")
        lease_arg = request.args.get("lease")
        lease: float | None = None
        if lease_arg is not None:
            try:
                lease = float(lease_arg)
            except ValueError:
                lease = -1.0
            if not 0 < lease <= _MAX_LEASE:
                return refuse(400, f"lease must be a number of seconds in (0, {_MAX_LEASE:g}]")
        now = trio.current_time()
        try:
            change = registry.register(worker, now, lease)
        except ValueError as exc:  # BadRegistration
            return refuse(400, f"invalid registration: {exc}")
        except RankHeld as exc:  # before ValueError: a live lease is its holder's
            return refuse(409, str(exc))
        except RegistryFull as exc:
            return refuse(429, str(exc))
        if lease is not None and expiry is not None:
            expiry.leased_until(now + lease)
        if change == "unchanged":
            return json_response({"ok": True})  # a renewal: not worth a log line each second
        log.info(
            "bootstrap: engine %r dp=%d tp=%d pp=%d at %r%s (%s)",
            worker.engine_id,
            worker.dp_rank,
            worker.tp_rank,
            worker.pp_rank,
            worker.addr,
            f" with CURVE key {worker.curve_key}" if worker.curve_key else "",  # public
            change if not worker.epoch else f"{change}, epoch {worker.epoch}",
        )
        return json_response({"ok": True})

    @app.get("/query")
    async def query() -> Response:
        return json_response(registry.answer(trio.current_time()))

    @app.get("/health")
    async def health() -> Response:
        return json_response({"status": "ok"})

    return app


class _Expiry:
    """Logs lapsed leases when they lapse (``/query`` never shows them either way), sleeping
    until the registry's next expiry: no wake-up while no lease is due."""

    def __init__(self, registry: BootstrapRegistry) -> None:
        self._registry = registry
        self._sleep = trio.CancelScope()  # the current sleep; its deadline is the alarm

    def leased_until(self, expires: float) -> None:
        """A registration holds a lease until ``expires``: wake then if that is earlier than
        the alarm set. Not a checkpoint."""
        self._sleep.deadline = min(self._sleep.deadline, expires)

    async def serve(self) -> None:
        """Expire leases as they lapse, until cancelled."""
        while True:
            deadline = self._registry.next_expiry()
            with trio.CancelScope(deadline=math.inf if deadline is None else deadline) as sleep:
                self._sleep = sleep
                await trio.sleep_forever()
            for gone in self._registry.expire(trio.current_time()):
                log.warning("bootstrap: lease lapsed, %s is gone", gone)


async def serve_bootstrap(
    config: BootstrapConfig,
    *,
    task_status: trio.TaskStatus[str] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Serve the bootstrap registry over HTTP until cancelled.

    Binds ``config.host:config.port`` (port 0: a free port), then reports the bound URL, e.g.
    ``"http://127.0.0.1:40123"``, through ``task_status.started`` (a wildcard host is
    reported as loopback, so the URL can be dialled). Every request is answered; bad input
    gets a 400 with ``{"error": ...}`` and never stops the server; past
    ``config.max_workers`` registrations a new worker gets a 429. With ``config.token``,
    ``/register`` and ``/query`` without that bearer token get a 401. A client holding
    ``config.max_connections_per_client`` connections has its next closed at once; one that
    stops reading its answer has its connection closed after ``config.write_timeout``. Each
    registration is logged on ``"pdactors.bootstrap"``, each refused client once a minute at
    most.

    Usage: ``url = await nursery.start(serve_bootstrap, BootstrapConfig())``, or
    ``trio.run(serve_bootstrap, config)`` to run it as a process's only job.

    Raises :class:`OSError` if the address cannot be bound (before ``started``). Never returns
    normally.
    """
    sock = await bind_listener(config.host, config.port, "the bootstrap registry")
    registry = BootstrapRegistry(config.max_workers)
    expiry = _Expiry(registry)
    async with trio.open_nursery() as nursery:
        nursery.start_soon(expiry.serve)
        await serve_http(
            _make_app(registry, config.token, expiry),
            sock,
            errorlog=_http_log,
            announce=lambda url: log.info("bootstrap: listening on %s", url),
            certfile=config.certfile,
            keyfile=config.keyfile,
            door="the bootstrap registry",
            limits=ConnectionLimits(config.max_connections_per_client, config.write_timeout),
            task_status=task_status,
        )
