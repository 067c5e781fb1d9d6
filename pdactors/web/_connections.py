"""What every HTTP door allows one client's connections: how many at once, and how long a write
of an answer may wait for the client to read it.

* **Connections per client** (:class:`ClientSlots`), counted by peer address (the IP: every
  client behind one NAT counts as one, hence a generous default). A connection past the cap is
  closed as it is accepted, before a byte of it is read: an HTTP answer would need the TLS
  handshake and the request read first, the work the cap is there to refuse. The client sees
  its connection closed (reset, if it had sent its request).
* **The write timeout** (:class:`Connection`): each piece of an answer (at most
  :data:`WRITE_PIECE` bytes) must be taken by the client within the timeout. A client that
  stopped reading (its receive window full) would otherwise hold the answer, and whatever
  produces it (the proxy's engine legs), for ever: hypercorn writes shielded from
  cancellation. The connection is closed instead, and hypercorn tells the app its client is
  gone (``http.disconnect``), which cancels the request.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from typing import Any, Final

import trio
from hypercorn.events import Closed, Event, RawData
from hypercorn.trio.tcp_server import TCPServer

from pdactors.config import MAX_CONNECTIONS_PER_CLIENT, WRITE_TIMEOUT
from pdactors.web._refusals import RefusalLog

__all__ = [
    "WRITE_PIECE",
    "ClientSlots",
    "Connection",
    "ConnectionLimits",
    "Doorman",
    "peer_host",
]

#: The most bytes one bounded write sends: a client must take this much of its answer within
#: the write timeout (a client reading slower, 2 KiB/s at the default, is cut off too).
WRITE_PIECE: Final = 64 * 1024


@dataclass(frozen=True)
class ConnectionLimits:
    """A door's limits on its clients' connections (0: none)."""

    max_per_client: int = MAX_CONNECTIONS_PER_CLIENT
    write_timeout: float = WRITE_TIMEOUT


class ClientSlots:
    """Connections open per client host, at most ``cap`` each (0: any number). Holds an entry
    only for a host with a connection open."""

    def __init__(self, cap: int) -> None:
        self.cap = cap
        self._open: dict[str, int] = {}

    def take(self, host: str) -> bool:
        """One more connection for ``host``, unless it holds ``cap`` already (False)."""
        held = self._open.get(host, 0)
        if self.cap and held >= self.cap:
            return False
        self._open[host] = held + 1
        return True

    def give_back(self, host: str) -> None:
        """A connection :meth:`take` counted is closed."""
        held = self._open.pop(host) - 1
        if held:
            self._open[host] = held


def peer_host(stream: trio.abc.Stream) -> str | None:
    """The address of the client at the other end of an accepted stream (plain or TLS), or
    None when it is already gone (or not a socket's)."""
    transport = stream.transport_stream if isinstance(stream, trio.SSLStream) else stream
    if not isinstance(transport, trio.SocketStream):
        return None
    try:
        peer = transport.socket.getpeername()
    except OSError:
        return None
    host: str = peer[0]
    return host.removeprefix("::ffff:")  # an IPv4 client of a dual-stack listener


class Connection(TCPServer):  # type: ignore[misc]
    """Hypercorn's connection handler, its writes bounded by ``write_timeout`` (0: unbounded,
    as hypercorn's own) and its close without a half-close first.

    A piece of an answer not taken within the timeout closes the connection: ``stalled()`` is
    called (to log and count it), then the connection goes as if the client had gone. A
    connection ends as soon as its client is gone and its app is done (hypercorn's waits out
    its keep-alive timer first).

    Hypercorn half-closes (``send_eof``) outside its send lock, so when another task of the
    connection was sending at that moment (an error answer to bytes that came after a request
    that said ``Connection: close``), trio raised ``BusyResourceError`` out of the handler and
    the whole server stopped: one crafted request took the bootstrap down (found by
    tests/test_http_doors.py's fuzzing). Closing the socket sends the same FIN; a sender in
    another task then gets ``ClosedResourceError``, which hypercorn handles.
    """

    def __init__(
        self, *args: Any, write_timeout: float, stalled: Callable[[], None], **kwargs: Any
    ) -> None:
        super().__init__(*args, **kwargs)
        self._write_timeout = write_timeout
        self._stalled = stalled

    async def protocol_send(self, event: Event) -> None:
        if not isinstance(event, RawData) or not self._write_timeout:
            await super().protocol_send(event)
            return
        async with self.send_lock:
            try:
                if await self._send_within_timeout(event.data):
                    return
                self._stalled()
                # A cut write leaves the stream broken: closed at once (trio closes the socket
                # before its checkpoint; the read loop's receive gets ClosedResourceError).
                await self.stream.aclose()
            except (trio.BrokenResourceError, trio.ClosedResourceError):
                pass  # the client is gone
            await self.protocol.handle(Closed())

    async def _send_within_timeout(self, data: bytes) -> bool:
        """Send ``data``, each :data:`WRITE_PIECE` of it within the timeout; False when one was
        not. Shielded as hypercorn's writes are: a cancelled app must not cut a frame short."""
        view = memoryview(data)
        for start in range(0, len(view), WRITE_PIECE):
            with trio.move_on_after(self._write_timeout, shield=True) as bound:
                await self.stream.send_all(view[start : start + WRITE_PIECE])
            if bound.cancelled_caught:
                return False
        return True

    async def _read_data(self) -> None:
        await super()._read_data()
        # The client is gone: hypercorn would wait out its keep-alive timer (5 s) before the
        # connection's end, holding the socket and the client's slot (:class:`ClientSlots`).
        await self.idle_task.stop()

    async def _close(self) -> None:
        await self.stream.aclose()


class Doorman:
    """Lets each accepted connection of a door in (:meth:`serve`, a handler for
    :func:`trio.serve_listeners`) unless its client holds its most already, and logs the
    connections closed on a client on ``refusals`` and passes them to ``closed`` (why:
    ``"max_connections_per_client"`` or ``"write_timeout"``)."""

    def __init__(
        self,
        connection: Callable[..., Connection],
        limits: ConnectionLimits,
        refusals: RefusalLog,
        closed: Callable[[str], None],
    ) -> None:
        self._connection = connection
        self._limits = limits
        self._refusals = refusals
        self._closed = closed
        self._slots = ClientSlots(limits.max_per_client)

    async def serve(self, stream: trio.abc.Stream) -> None:
        """Serve one accepted connection until it closes, or close it at once."""
        host = peer_host(stream)
        if host is None or not self._slots.take(host):
            if host is not None:
                cap = self._limits.max_per_client
                why = f"it holds {cap} connections, its most (max_connections_per_client)"
                self._refusals.closed(host, why)
                self._closed("max_connections_per_client")
            await stream.aclose()  # (TLS: no handshake yet; the socket just closes)
            return
        try:
            await self._connection(
                stream,
                write_timeout=self._limits.write_timeout,
                stalled=partial(self._stalled, host),
            )
        finally:
            self._slots.give_back(host)

    def _stalled(self, host: str) -> None:
        timeout = self._limits.write_timeout
        why = (
            f"it stopped reading its answer: a piece not taken within {timeout:g} s (write_timeout)"
        )
        self._refusals.closed(host, why)
        self._closed("write_timeout")
