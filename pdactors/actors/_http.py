"""Serving a quart-trio app with hypercorn under trio, as the bootstrap and the proxy do."""

from __future__ import annotations

import logging
from collections.abc import Callable
from functools import partial
from typing import Any

import hypercorn.logging
import hypercorn.trio
import trio
from hypercorn.config import Config as HypercornConfig

__all__ = ["bind_listener", "serve_http"]


class _QuietHypercornLogger(hypercorn.logging.Logger):  # type: ignore[misc]
    """Hypercorn's logger, with its INFO lines ("Running on ...") demoted to DEBUG."""

    async def info(self, message: str, *args: Any, **kwargs: Any) -> None:
        await self.debug(message, *args, **kwargs)


async def bind_listener(host: str, port: int, what: str) -> trio.socket.SocketType:
    """Bind ``host:port`` (0: any free port) before serving, so that a failure is a plain
    :class:`OSError` (with a note naming ``what``) rather than one inside a nursery."""
    family = trio.socket.AF_INET6 if ":" in host else trio.socket.AF_INET
    sock = trio.socket.socket(family, trio.socket.SOCK_STREAM)
    try:
        sock.setsockopt(trio.socket.SOL_SOCKET, trio.socket.SO_REUSEADDR, 1)
        sock.setsockopt(trio.socket.IPPROTO_TCP, trio.socket.TCP_NODELAY, 1)
        await sock.bind((host, port))
    except BaseException as exc:
        sock.close()
        if isinstance(exc, OSError):
            exc.add_note(f"binding {what} to {host}:{port}")
        raise
    return sock


def _reachable_url(bound: str) -> str:
    """``http://0.0.0.0:P`` → ``http://127.0.0.1:P`` (and ``[::]`` → ``[::1]``, and the same
    for ``https``): a URL to dial."""
    for scheme in ("http", "https"):
        for wildcard, loopback in (("0.0.0.0", "127.0.0.1"), ("[::]", "[::1]")):
            prefix = f"{scheme}://{wildcard}:"
            if bound.startswith(prefix):
                return f"{scheme}://{loopback}:{bound.removeprefix(prefix)}"
    return bound


async def serve_http(
    app: Any,
    sock: trio.socket.SocketType,
    *,
    errorlog: logging.Logger,
    announce: Callable[[str], None],
    certfile: str | None = None,
    keyfile: str | None = None,
    task_status: trio.TaskStatus[str] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Serve ``app`` on the socket from :func:`bind_listener` until cancelled; ``announce`` and
    ``task_status`` get the bound URL (a wildcard host is reported as loopback).

    With ``certfile`` and ``keyfile`` (PEM), it serves HTTPS (hypercorn's TLS) and the URL is
    ``https://``. Hypercorn's messages go to ``errorlog`` (its INFO lines as DEBUG); no access
    log.
    """
    hconfig = HypercornConfig()
    if (certfile is None) != (keyfile is None):
        raise ValueError("TLS needs both a certificate file and a key file")
    hconfig.certfile, hconfig.keyfile = certfile, keyfile
    hconfig.bind = [f"fd://{sock.detach()}"]  # hypercorn takes the bound socket over
    hconfig.accesslog = None
    hconfig.errorlog = errorlog
    hconfig.logger_class = _QuietHypercornLogger
    async with trio.open_nursery() as nursery:
        # shutdown_trigger never fires: the owner stops the server by cancelling us.
        binds: list[str] = await nursery.start(
            partial(hypercorn.trio.serve, app, hconfig, shutdown_trigger=trio.sleep_forever)
        )
        url = _reachable_url(binds[0])
        announce(url)
        task_status.started(url)
