"""The bootstrap registry: which engine, at which dp/tp/pp rank, listens where.

This module holds the upstream-compatible HTTP face of the bootstrap:

* :class:`BootstrapRegistry` — the registrations, pure bookkeeping (no IO, no clock).
* :func:`serve_bootstrap` — a quart-trio app served by hypercorn under Trio with upstream
  vLLM's Mooncake bootstrap routes: ``POST /register`` (a :class:`~pdactors.messages.RegisterWorker`
  body), ``GET /query`` (the :data:`~pdactors.messages.BootstrapAnswer` JSON) and
  ``GET /health``.

The registry is bounded: at most ``BootstrapConfig.max_workers`` registrations (4,096 by
default; one more is refused with 429 until some lapse or are replaced), and each field within
:data:`MAX_ENGINE_ID_CHARS`, :data:`MAX_ADDR_CHARS` and :data:`MAX_RANK` (400 beyond), so its
memory and its ``/query`` answer stay within a few MB whatever clients send.

Registrations are leases when they say so: ``POST /register?lease=SECONDS`` (our senders renew
every second or so) lapses unless renewed within ``SECONDS``, so a dead P leaves ``/query`` by
itself. A registration without ``lease`` (upstream's tools register once) never lapses.

The ``pdactors bootstrap`` command runs it standalone with
``trio.run(serve_bootstrap, BootstrapConfig(host=..., port=...))``; an engine embeds it with
``await nursery.start(serve_bootstrap, config)``.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Final, Literal

import msgspec
import trio
from quart import Response, request
from quart_trio import QuartTrio
from werkzeug.exceptions import HTTPException

from pdactors.actors._auth import BearerCheck
from pdactors.actors._http import bind_listener, serve_http
from pdactors.actors._refusals import RefusalLog
from pdactors.config import BootstrapConfig
from pdactors.messages import BootstrapAnswer, BootstrapEntry, RegisterWorker

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

# Limits on one registration, far above real values (a field beyond them: 400). With the
# number of registrations (BootstrapConfig.max_workers) they bound the registry's memory and
# its /query answer (4,096 workers: under 4 MB).
#: The longest engine id, in characters (vLLM's are UUIDs, 36).
MAX_ENGINE_ID_CHARS: Final = 256
#: The longest side-channel address, in characters (``tcp://`` and a DNS name and port fit).
MAX_ADDR_CHARS: Final = 512
#: The highest DP, TP or PP rank.
MAX_RANK: Final = 65535
#: Far above any real body (six short fields); bigger bodies are refused with 413 (from their
#: Content-Length when they give one, before a byte of them is read).
_MAX_BODY_BYTES: Final = 16 * 1024
#: The longest a client may take to send a body (seconds); then 408 and the connection closes.
_BODY_TIMEOUT: Final = 10.0
#: The longest lease a registration may ask for (seconds).
_MAX_LEASE: Final = 3600.0

#: What a registration changed, as :meth:`BootstrapRegistry.register` reports it.
Registration = Literal["added", "moved", "unchanged", "engine_replaced"]


# --------------------------------------------------------------------------- registry (pure)


class RegistryFull(Exception):
    """The registry holds its maximum number of workers; a new one must wait for a lease to
    lapse (answered 429)."""


def _check_fields(worker: RegisterWorker) -> None:
    """Raises :class:`ValueError` naming the first field beyond its limit."""
    if len(worker.engine_id) > MAX_ENGINE_ID_CHARS:
        raise ValueError(f"engine_id is longer than {MAX_ENGINE_ID_CHARS} characters")
    if len(worker.addr) > MAX_ADDR_CHARS:
        raise ValueError(f"addr is longer than {MAX_ADDR_CHARS} characters")
    if max(worker.dp_rank, worker.tp_rank, worker.pp_rank) > MAX_RANK:
        raise ValueError(f"ranks must be at most {MAX_RANK}")


@dataclass
class _DpRank:
    engine_id: str
    addrs: dict[tuple[int, int], str] = field(default_factory=dict)  # (tp, pp) -> addr
    expires: dict[tuple[int, int], float] = field(default_factory=dict)  # (tp, pp) -> when
    keys: dict[tuple[int, int], str] = field(default_factory=dict)  # (tp, pp) -> CURVE key


class BootstrapRegistry:
    """The registered workers, keyed by DP rank, then TP rank, then PP rank.

    Rules:

    * One engine id per DP rank. A different engine id registering on a DP rank that is
      already known replaces that rank's whole entry (the engine restarted with a new id;
      the old engine's workers are gone).
    * Registering a (dp, tp, pp) rank that is already known under the same engine id replaces
      its address and CURVE key (the worker restarted on a new port, or with a new key).
    * A registration with a ``lease`` lapses ``lease`` seconds after it was last renewed; one
      without never lapses. A DP rank whose every worker lapsed is gone.
    * At most ``max_workers`` workers, each with fields within the module's limits.

    No IO and no checkpoints; every method is synchronous and takes the time from its caller.
    """

    def __init__(self, max_workers: int = 4096) -> None:
        self._ranks: dict[int, _DpRank] = {}
        self._max_workers = max_workers
        self._workers = 0  # registrations held, in all ranks

    def __len__(self) -> int:
        """The number of workers registered (lapsed leases included until expired)."""
        return self._workers

    def register(
        self, worker: RegisterWorker, now: float = 0.0, lease: float | None = None
    ) -> Registration:
        """Record ``worker``'s address (until ``now + lease``, or for good) and say what changed.

        Returns ``"added"`` for a new rank, ``"moved"`` for a known rank at a new address (or
        with a new key),
        ``"unchanged"`` for a repeat (a renewal), ``"engine_replaced"`` when a new engine id
        took over the DP rank.

        Raises :class:`ValueError` for a field beyond its limit and :class:`RegistryFull` when
        the worker is new and the registry holds ``max_workers`` (a registration that replaces
        a DP rank's engine frees that rank's workers first); nothing changes then.
        """
        _check_fields(worker)
        self.expire(now)
        key = (worker.tp_rank, worker.pp_rank)
        expires = float("inf") if lease is None else now + lease
        rank = self._ranks.get(worker.dp_rank)
        replaced = rank is not None and rank.engine_id != worker.engine_id
        freed = len(rank.addrs) if rank is not None and replaced else 0
        new_worker = rank is None or replaced or key not in rank.addrs
        if new_worker and self._workers - freed >= self._max_workers:
            raise RegistryFull(
                f"the registry holds its maximum of {self._max_workers} workers; "
                "a new one is taken once a lease lapses"
            )
        if rank is None or replaced:
            new = _DpRank(worker.engine_id)
            self._ranks[worker.dp_rank] = new
            _record(new, key, worker, expires)
            self._workers += 1 - freed
            return "added" if rank is None else "engine_replaced"
        old = (rank.addrs.get(key), rank.keys.get(key, ""))
        _record(rank, key, worker, expires)
        if old[0] is None:
            self._workers += 1
            return "added"
        return "unchanged" if old == (worker.addr, worker.curve_key) else "moved"

    def expire(self, now: float) -> list[str]:
        """Forget the workers whose lease lapsed by ``now``; returns them, described."""
        gone: list[str] = []
        for dp, rank in list(self._ranks.items()):
            for tp, pp in [k for k, t in rank.expires.items() if now >= t]:
                addr = rank.addrs.pop((tp, pp))
                del rank.expires[tp, pp]
                rank.keys.pop((tp, pp), None)
                self._workers -= 1
                gone.append(f"{rank.engine_id!r} dp={dp} tp={tp} pp={pp} at {addr!r}")
            if not rank.addrs:
                del self._ranks[dp]
        return gone

    def answer(self, now: float = 0.0) -> BootstrapAnswer:
        """A fresh copy of the live registrations in upstream's ``GET /query`` shape, ranks in
        order."""
        self.expire(now)
        answer: BootstrapAnswer = {}
        for dp in sorted(self._ranks):
            rank = self._ranks[dp]
            worker_addr: dict[int, dict[int, str]] = {}
            curve_keys: dict[int, dict[int, str]] = {}
            for tp, pp in sorted(rank.addrs):
                worker_addr.setdefault(tp, {})[pp] = rank.addrs[tp, pp]
                if key := rank.keys.get((tp, pp)):
                    curve_keys.setdefault(tp, {})[pp] = key
            answer[dp] = BootstrapEntry(rank.engine_id, worker_addr, curve_keys)
        return answer


def _record(rank: _DpRank, key: tuple[int, int], worker: RegisterWorker, expires: float) -> None:
    rank.addrs[key] = worker.addr
    rank.expires[key] = expires
    if worker.curve_key:
        rank.keys[key] = worker.curve_key
    else:
        rank.keys.pop(key, None)


# --------------------------------------------------------------------------- HTTP face


def _json(body: object, status: int = 200, headers: dict[str, str] | None = None) -> Response:
    return Response(
        msgspec.json.encode(body), status=status, content_type="application/json", headers=headers
    )


def _make_app(registry: BootstrapRegistry, token: str | None = None) -> QuartTrio:
    # static_folder=None: no /static route; the app serves exactly three routes.
    app = QuartTrio(__name__, static_folder=None)
    app.config["MAX_CONTENT_LENGTH"] = _MAX_BODY_BYTES
    app.config["BODY_TIMEOUT"] = _BODY_TIMEOUT
    decoder = msgspec.json.Decoder(RegisterWorker)
    refusals = RefusalLog(log, "the bootstrap registry")
    check = BearerCheck(token, "the bootstrap registry", refusals)

    def refuse(status: int, message: str) -> Response:
        refusals.refused(request.remote_addr or "unknown client", status, message)
        return _json({"error": message}, status)

    @app.before_request
    async def authenticate() -> Response | None:
        if request.path == "/health":
            return None  # open: load balancers and the proxy's health loop
        client = request.remote_addr or "unknown client"
        reason = check.refusal(request.headers.get("authorization"), client)
        if reason is None:
            return None
        return _json({"error": reason}, 401, {"WWW-Authenticate": 'Bearer realm="pdactors"'})

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
        try:
            change = registry.register(worker, trio.current_time(), lease)
        except ValueError as exc:
            return refuse(400, f"invalid registration: {exc}")
        except RegistryFull as exc:
            return refuse(429, str(exc))
        if change == "unchanged":
            return _json({"ok": True})  # a renewal: not worth a log line each second
        log.info(
            "bootstrap: engine %r dp=%d tp=%d pp=%d at %r%s (%s)",
            worker.engine_id,
            worker.dp_rank,
            worker.tp_rank,
            worker.pp_rank,
            worker.addr,
            f" with CURVE key {worker.curve_key}" if worker.curve_key else "",  # public
            change,
        )
        return _json({"ok": True})

    @app.get("/query")
    async def query() -> Response:
        return _json(registry.answer(trio.current_time()))

    @app.get("/health")
    async def health() -> Response:
        return _json({"status": "ok"})

    @app.errorhandler(HTTPException)
    async def http_error(exc: HTTPException) -> Response:
        # 404, 405, 408, 413, ...: the same JSON error shape as a bad registration.
        return refuse(exc.code or 500, exc.description or exc.name)

    @app.errorhandler(Exception)
    async def internal_error(exc: Exception) -> Response:
        # Handled here so that Quart never builds its own logger (it would start a queue
        # listener thread); the bug is logged with its traceback and the server keeps going.
        log.error("bootstrap: internal error on %s %r", request.method, request.path, exc_info=exc)
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
    gets a 400 with ``{"error": ...}`` and never stops the server; past
    ``config.max_workers`` registrations a new worker gets a 429. With ``config.token``,
    ``/register`` and ``/query`` without that bearer token get a 401. Each registration is
    logged on ``"pdactors.bootstrap"``, each refused client once a minute at most.

    Usage: ``url = await nursery.start(serve_bootstrap, BootstrapConfig())``, or
    ``trio.run(serve_bootstrap, config)`` to run it as a process's only job.

    Raises :class:`OSError` if the address cannot be bound (before ``started``). Never returns
    normally.
    """
    sock = await bind_listener(config.host, config.port, "the bootstrap registry")
    registry = BootstrapRegistry(config.max_workers)
    async with trio.open_nursery() as nursery:
        nursery.start_soon(_expire_loop, registry)
        await serve_http(
            _make_app(registry, config.token),
            sock,
            errorlog=_http_log,
            announce=lambda url: log.info("bootstrap: listening on %s", url),
            certfile=config.certfile,
            keyfile=config.keyfile,
            task_status=task_status,
        )


async def _expire_loop(registry: BootstrapRegistry) -> None:
    """Log lapsed leases when they lapse (``/query`` never shows them either way)."""
    while True:
        await trio.sleep(0.5)
        for gone in registry.expire(trio.current_time()):
            log.warning("bootstrap: lease lapsed, %s is gone", gone)
