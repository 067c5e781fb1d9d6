"""httpx clients that leave no socket to the garbage collector.

httpcore (1.0.9) closes the TCP stream when a TLS handshake fails, but not when it is cancelled
(its ``start_tls`` catches ``Exception`` only, and trio's ``Cancelled`` is not one): a request
to an ``https://`` engine or bootstrap cancelled mid-handshake (a probe's timeout, the proxy
stopping) left the connected socket for the garbage collector, whose ``ResourceWarning`` then
failed whichever test happened to run at that moment. :func:`async_client` gives httpx a
network backend that closes the stream however the handshake ends.
"""

# ruff: noqa: ASYNC109  (httpcore's network interface takes its timeouts as arguments)

from __future__ import annotations

import ssl
from collections.abc import Iterable
from typing import Any

import httpcore
import httpx
import trio

__all__ = ["async_client"]

#: httpx's own defaults (what ``httpx.AsyncClient()`` uses)
_DEFAULT_LIMITS = httpx.Limits(max_connections=100, max_keepalive_connections=20)


def async_client(
    *,
    verify: ssl.SSLContext | str | bool = True,
    limits: httpx.Limits | None = None,
    **kwargs: Any,
) -> httpx.AsyncClient:
    """An ``httpx.AsyncClient`` (proxy settings in the environment ignored) whose connections
    are closed when a TLS handshake is cancelled. ``kwargs`` go to the client (timeout,
    headers); ``limits``: httpx's defaults unless given."""
    transport = httpx.AsyncHTTPTransport(
        verify=verify, limits=limits or _DEFAULT_LIMITS, trust_env=False
    )
    pool = transport._pool  # httpx builds the pool itself; only its backend is replaced
    pool._network_backend = _ClosingBackend(pool._network_backend)
    return httpx.AsyncClient(transport=transport, trust_env=False, **kwargs)


class _ClosingBackend(httpcore.AsyncNetworkBackend):
    def __init__(self, inner: httpcore.AsyncNetworkBackend) -> None:
        self._inner = inner

    async def connect_tcp(
        self,
        host: str,
        port: int,
        timeout: float | None = None,
        local_address: str | None = None,
        socket_options: Iterable[Any] | None = None,
    ) -> httpcore.AsyncNetworkStream:
        stream = await self._inner.connect_tcp(host, port, timeout, local_address, socket_options)
        return _ClosingStream(stream)

    async def connect_unix_socket(
        self, path: str, timeout: float | None = None, socket_options: Iterable[Any] | None = None
    ) -> httpcore.AsyncNetworkStream:
        return _ClosingStream(await self._inner.connect_unix_socket(path, timeout, socket_options))

    async def sleep(self, seconds: float) -> None:
        await self._inner.sleep(seconds)


class _ClosingStream(httpcore.AsyncNetworkStream):
    def __init__(self, inner: httpcore.AsyncNetworkStream) -> None:
        self._inner = inner

    async def read(self, max_bytes: int, timeout: float | None = None) -> bytes:
        return await self._inner.read(max_bytes, timeout)

    async def write(self, buffer: bytes, timeout: float | None = None) -> None:
        await self._inner.write(buffer, timeout)

    async def aclose(self) -> None:
        await self._inner.aclose()

    async def start_tls(
        self,
        ssl_context: ssl.SSLContext,
        server_hostname: str | None = None,
        timeout: float | None = None,
    ) -> httpcore.AsyncNetworkStream:
        try:
            return await self._inner.start_tls(ssl_context, server_hostname, timeout)
        except BaseException:  # cancelled included: the socket is closed here, not by the GC
            with trio.CancelScope(shield=True):
                await self._inner.aclose()
            raise

    def get_extra_info(self, info: str) -> Any:
        return self._inner.get_extra_info(info)
