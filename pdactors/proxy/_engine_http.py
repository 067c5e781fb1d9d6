"""The proxy's HTTP/1.1 client for engine calls: h11 over trio TCP streams, one small pool of
idle connections per engine.

Why not httpx here (it still serves the proxy's health probes): httpcore's connection pool
scans every connection on each request and each response close, so under 32 concurrent
requests the proxy spent ~8 ms of CPU per request, and that CPU is taken from the engines it
fronts (measured in ``bench/proxy_overhead.py``, see docs/benchmarks.md). Here a request pops
the newest idle connection (a stack, O(1)) or dials a new one, and a response read to its end
puts its connection back; one that was not (cancelled, failed, a client that went away) is
closed, which is how vLLM learns the request was abandoned.

``https://`` engines (vLLM's ``--ssl-certfile``) are spoken to over ``trio.SSLStream``, the
server's certificate verified against the proxy's CA bundle (or the system's CAs).

Plain ``http://`` connections are read and written without a trip through trio's scheduler
when the kernel takes or gives the bytes at once (:class:`_PlainStream`): trio's
``SocketStream`` yields on every call, and each yield is a scheduler batch (an ``epoll_wait``
and the other ready tasks) — at several calls per leg, a large part of the proxy's CPU per
request (bench/proxy_overhead.py, docs/benchmarks.md).
"""

from __future__ import annotations

import select
import socket
import ssl
import urllib.parse
from collections.abc import AsyncGenerator
from typing import Final

import h11
import trio

from pdactors.errors import PdError, describe

__all__ = ["ConnectFailed", "EngineClient", "EngineError", "EngineResponse"]

_READ_SIZE: Final = 65536


class EngineError(PdError):
    """The engine could not be reached, or broke the HTTP exchange."""


class ConnectFailed(EngineError):
    """No connection to the engine (refused, unreachable, or not within the connect timeout)."""


class _PlainStream:
    """A connected non-blocking TCP socket. Its calls wait (and so yield to trio) only when
    the kernel cannot take or give bytes at once; they are not checkpoints otherwise."""

    __slots__ = ("socket",)

    def __init__(self, sock: socket.socket) -> None:
        self.socket = sock

    async def send_all(self, data: bytes) -> None:
        view = memoryview(data)
        while view:
            try:
                sent = self.socket.send(view)
            except BlockingIOError:
                await trio.lowlevel.wait_writable(self.socket)
            else:
                view = view[sent:]

    async def receive_some(self, max_bytes: int) -> bytes:
        while True:
            try:
                return self.socket.recv(max_bytes)
            except BlockingIOError:
                await trio.lowlevel.wait_readable(self.socket)


class _Connection:
    __slots__ = ("h11", "open", "socket", "stream")

    def __init__(
        self,
        stream: _PlainStream | trio.SSLStream[trio.SocketStream],
        open_set: set[_Connection],
    ) -> None:
        self.stream = stream
        self.open = open_set  # the client's open connections: this one until it is closed
        open_set.add(self)
        self.socket: socket.socket | trio.socket.SocketType
        if isinstance(stream, trio.SSLStream):
            tcp = stream.transport_stream
            assert isinstance(tcp, trio.SocketStream)
            self.socket = tcp.socket
        else:
            self.socket = stream.socket
        self.h11 = h11.Connection(our_role=h11.CLIENT)

    def stale(self) -> bool:
        """An idle connection with something to read is closed or broken (the server gave up
        on it, e.g. its keep-alive timeout): never reuse it. (Over TLS the server's session
        tickets come before its first answer, which was read to its end: nothing is left.)"""
        poll = select.poll()
        poll.register(self.socket, select.POLLIN)
        return bool(poll.poll(0))

    async def next_event(self) -> object:
        """The next h11 event (an ``h11.Event``, or ``h11.PAUSED``)."""
        while True:
            event = self.h11.next_event()
            if event is not h11.NEED_DATA:
                return event
            data = await self.stream.receive_some(_READ_SIZE)
            # b"": the server closed (h11 reports it as an event)
            self.h11.receive_data(data if isinstance(data, bytes) else bytes(data))


class EngineResponse:
    """An engine's answer: status and headers now, the body as it comes. Close it (or read it
    to its end); a connection is reused only after a complete body."""

    def __init__(self, client: EngineClient, conn: _Connection, head: h11.Response) -> None:
        self._client, self._conn = client, conn
        self.status: int = head.status_code
        self.headers: list[tuple[bytes, bytes]] = list(head.headers)
        self._done = False
        self._closed = False

    async def chunks(self) -> AsyncGenerator[bytes]:
        """The body, piece by piece as the engine sends it. Raises :class:`EngineError` if the
        engine closes the connection before the body's end."""
        while not self._done:
            try:
                event = await self._conn.next_event()
            except (h11.ProtocolError, trio.BrokenResourceError, OSError, ssl.SSLError) as exc:
                raise EngineError(f"reading the answer failed: {describe(exc)}") from exc
            if isinstance(event, h11.Data):
                yield bytes(event.data)
            elif isinstance(event, h11.EndOfMessage):
                self._done = True
            elif isinstance(event, h11.ConnectionClosed):
                raise EngineError("the engine closed the connection before the answer's end")

    async def read(self) -> bytes:
        """The whole body (what is left of it); puts the connection back. However it ends —
        the body read, the engine failing, or the caller cancelled (the proxy cancels P's
        leg once D is done) — the answer is closed (a connection cut short is dropped)."""
        try:
            parts = [chunk async for chunk in self.chunks()]
        finally:
            await self.aclose()  # no checkpoint: it also runs in cancelled code
        return b"".join(parts)

    async def aclose(self) -> None:
        """Done with the answer: its connection goes back to the pool when the body was read to
        its end, else it is closed (the engine sees the request abandoned). Never raises."""
        if self._closed:
            return
        self._closed = True
        self._client._finish(self._conn, reusable=self._done)


class EngineClient:
    """HTTP/1.1 to one engine at ``base_url`` (``http://host:port`` or ``https://``; TLS
    verifies the engine's certificate with ``tls``, default the system's CAs)."""

    def __init__(
        self,
        base_url: str,
        *,
        connect_timeout: float,
        slots: trio.Semaphore,
        max_idle: int = 64,
        tls: ssl.SSLContext | None = None,
    ) -> None:
        url = urllib.parse.urlsplit(base_url)
        if url.scheme not in ("http", "https") or url.hostname is None:
            raise ValueError(f"engine URL must be http(s)://host[:port], not {base_url!r}")
        self.host = url.hostname
        self.port = url.port or (443 if url.scheme == "https" else 80)
        self.tls = (tls or ssl.create_default_context()) if url.scheme == "https" else None
        self._host_header = url.netloc.encode()
        self.connect_timeout = connect_timeout
        self.slots = slots  # open answers, shared by the proxy's clients (max_connections)
        self.max_idle = max_idle
        self._idle: list[_Connection] = []  # a stack: the newest is the likeliest alive
        # Every connection not yet closed, idle or in use: close() closes them all, so none is
        # left to the garbage collector (an answer dropped unclosed, a leg cut short).
        self._open: set[_Connection] = set()

    async def request(
        self, method: str, path: str, body: bytes, headers: list[tuple[bytes, bytes]]
    ) -> EngineResponse:
        """Send a request and wait for the answer's status and headers (not its body).

        Waits for one of ``slots`` (held until the answer is closed). Raises
        :class:`ConnectFailed` when no connection can be made, :class:`EngineError` when the
        exchange breaks. On cancellation the connection is closed.
        """
        await trio.lowlevel.checkpoint_if_cancelled()
        try:  # a free slot is taken without a trip through the scheduler
            self.slots.acquire_nowait()
        except trio.WouldBlock:
            await self.slots.acquire()
        try:
            return await self._request(method, path, body, headers)
        except BaseException:
            self.slots.release()
            raise

    async def _request(
        self, method: str, path: str, body: bytes, headers: list[tuple[bytes, bytes]]
    ) -> EngineResponse:
        all_headers = [
            (b"host", self._host_header),
            (b"content-length", str(len(body)).encode()),
            *headers,
        ]
        req = h11.Request(method=method, target=path, headers=all_headers)
        for reused in (True, False):
            conn = self._idle_connection() if reused else await self._connect()
            if conn is None:
                continue
            try:
                answer = await self._exchange(conn, req, body)
            except BaseException as exc:
                _close(conn)
                if reused and isinstance(exc, EngineError) and not isinstance(exc, _Answered):
                    continue  # a kept-alive connection the engine had closed: dial anew
                raise
            return EngineResponse(self, conn, answer)
        raise AssertionError("unreachable")  # pragma: no cover

    async def _exchange(self, conn: _Connection, req: h11.Request, body: bytes) -> h11.Response:
        try:
            data = conn.h11.send(req) or b""
            data += conn.h11.send(h11.Data(data=body)) or b""
            data += conn.h11.send(h11.EndOfMessage()) or b""
            await conn.stream.send_all(data)
            event = await conn.next_event()
            while isinstance(event, h11.InformationalResponse):
                event = await conn.next_event()
        except (h11.ProtocolError, trio.BrokenResourceError, OSError, ssl.SSLError) as exc:
            raise EngineError(f"{req.method.decode()} failed: {describe(exc)}") from exc
        if isinstance(event, h11.ConnectionClosed):
            raise EngineError("the engine closed the connection without answering")
        if not isinstance(event, h11.Response):  # pragma: no cover - h11 allows no other
            raise _Answered(f"unexpected {type(event).__name__} from the engine")
        return event

    def _idle_connection(self) -> _Connection | None:
        while self._idle:
            conn = self._idle.pop()
            if not conn.stale():
                return conn
            _close(conn)
        return None

    async def _connect(self) -> _Connection:
        """A new connection (TLS handshake included, within the connect timeout)."""
        with trio.move_on_after(self.connect_timeout):
            tcp = None
            try:
                tcp = await trio.open_tcp_stream(self.host, self.port)  # TCP_NODELAY set
                if self.tls is None:
                    sock = socket.socket(fileno=tcp.socket.detach())
                    sock.setblocking(False)
                    return _Connection(_PlainStream(sock), self._open)
                secure = trio.SSLStream(
                    tcp, self.tls, server_hostname=self.host, https_compatible=True
                )
                await secure.do_handshake()
                return _Connection(secure, self._open)
            except (OSError, ssl.SSLError, trio.BrokenResourceError) as exc:
                if tcp is not None:
                    tcp.socket.close()
                raise ConnectFailed(f"connect to {self.host}:{self.port}: {describe(exc)}") from exc
            except BaseException:
                if tcp is not None:
                    tcp.socket.close()
                raise
        raise ConnectFailed(
            f"connect to {self.host}:{self.port}: no answer in {self.connect_timeout:g} s"
        )

    def _finish(self, conn: _Connection, *, reusable: bool) -> None:
        self.slots.release()
        if (
            reusable
            and conn.h11.our_state is h11.DONE
            and conn.h11.their_state is h11.DONE
            and len(self._idle) < self.max_idle
        ):
            conn.h11.start_next_cycle()
            self._idle.append(conn)
        else:
            _close(conn)

    def close(self) -> None:
        """Close every connection: the idle ones, and any an answer still holds (its reads
        then fail)."""
        self._idle.clear()
        for conn in list(self._open):
            _close(conn)


class _Answered(EngineError):
    """The engine answered something unusable: not worth a retry on a new connection."""


def _close(conn: _Connection) -> None:
    # A plain socket close (no TLS goodbye): no checkpoint, so it also runs in cancelled code.
    conn.open.discard(conn)
    if conn.socket.fileno() == -1:
        return  # closed already
    if isinstance(conn.socket, socket.socket):
        trio.lowlevel.notify_closing(conn.socket)  # (trio's own sockets do this themselves)
    conn.socket.close()
