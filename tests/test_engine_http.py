"""The proxy's engine client (h11 over trio) against small real HTTP servers on loopback."""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from functools import partial

import h11
import pytest
import trio
import trio.testing

from pdactors.proxy._engine_http import ConnectFailed, EngineClient, EngineError

Handler = Callable[[trio.SocketStream, h11.Connection, h11.Request], Awaitable[bool]]


@asynccontextmanager
async def serve(handler: Handler) -> AsyncIterator[tuple[str, list[int]]]:
    """A raw HTTP/1.1 server; ``handler`` answers one request and says whether to keep the
    connection. Yields its URL and a list that counts accepted connections."""
    accepted: list[int] = []

    async def connection(stream: trio.SocketStream) -> None:
        accepted.append(1)
        conn = h11.Connection(our_role=h11.SERVER)
        try:
            while True:
                event = conn.next_event()
                if event is h11.NEED_DATA:
                    data = await stream.receive_some(65536)
                    if not data:
                        return
                    conn.receive_data(data)
                    continue
                if isinstance(event, h11.Request):
                    while not isinstance(body := conn.next_event(), h11.EndOfMessage):
                        if body is h11.NEED_DATA:
                            conn.receive_data(await stream.receive_some(65536))
                    if not await handler(stream, conn, event):
                        return
                    conn.start_next_cycle()
        except (trio.BrokenResourceError, h11.ProtocolError):
            return
        finally:
            await stream.aclose()

    async with trio.open_nursery() as nursery:
        listeners = await nursery.start(partial(trio.serve_tcp, connection, 0, host="127.0.0.1"))
        port = listeners[0].socket.getsockname()[1]
        yield f"http://127.0.0.1:{port}", accepted
        nursery.cancel_scope.cancel()


def answer(body: bytes, *, chunks: int = 1) -> Handler:
    async def handler(stream: trio.SocketStream, conn: h11.Connection, req: h11.Request) -> bool:
        head = h11.Response(status_code=200, headers=[(b"transfer-encoding", b"chunked")])
        await stream.send_all(conn.send(head) or b"")
        for i in range(chunks):
            await stream.send_all(conn.send(h11.Data(data=body + str(i).encode())) or b"")
        await stream.send_all(conn.send(h11.EndOfMessage()) or b"")
        return True

    return handler


def client(url: str, slots: int = 8) -> EngineClient:
    return EngineClient(url, connect_timeout=2.0, slots=trio.Semaphore(slots))


async def test_sequential_requests_reuse_one_connection() -> None:
    with trio.fail_after(10):
        async with serve(answer(b"hi", chunks=3)) as (url, accepted):
            engine = client(url)
            for _ in range(5):
                resp = await engine.request("POST", "/v1/completions", b"{}", [])
                assert resp.status == 200
                assert await resp.read() == b"hi0hi1hi2"
            assert len(accepted) == 1
            engine.close()


async def test_chunks_come_as_the_engine_sends_them() -> None:
    release = trio.Event()

    async def handler(stream: trio.SocketStream, conn: h11.Connection, req: h11.Request) -> bool:
        head = h11.Response(status_code=200, headers=[(b"transfer-encoding", b"chunked")])
        await stream.send_all((conn.send(head) or b"") + (conn.send(h11.Data(data=b"a")) or b""))
        await release.wait()
        tail = (conn.send(h11.Data(data=b"b")) or b"") + (conn.send(h11.EndOfMessage()) or b"")
        await stream.send_all(tail)
        return True

    with trio.fail_after(10):
        async with serve(handler) as (url, _):
            engine = client(url)
            resp = await engine.request("POST", "/", b"", [])
            chunks = resp.chunks()
            assert await anext(chunks) == b"a"  # before the engine sends the rest
            release.set()
            assert await anext(chunks) == b"b"
            with pytest.raises(StopAsyncIteration):
                await anext(chunks)
            await resp.aclose()
            engine.close()


async def test_a_connection_the_engine_closed_is_not_reused() -> None:
    async def once(stream: trio.SocketStream, conn: h11.Connection, req: h11.Request) -> bool:
        await answer(b"x")(stream, conn, req)
        return False  # the server closes after each answer (as after a keep-alive timeout)

    with trio.fail_after(10):
        async with serve(once) as (url, accepted):
            engine = client(url)
            for _ in range(3):
                resp = await engine.request("POST", "/", b"", [])
                assert await resp.read() == b"x0"
                await trio.testing.wait_all_tasks_blocked()  # the server has closed it
                # (a reused closed one would also be dialled anew: ask the pool itself)
                assert engine._idle_connection() is None
            assert len(accepted) == 3
            engine.close()


async def test_an_answer_cut_short_raises_and_its_connection_is_dropped() -> None:
    async def cut(stream: trio.SocketStream, conn: h11.Connection, req: h11.Request) -> bool:
        head = h11.Response(status_code=200, headers=[(b"content-length", b"100")])
        await stream.send_all((conn.send(head) or b"") + (conn.send(h11.Data(data=b"12")) or b""))
        return False  # the engine dies mid-body

    with trio.fail_after(10):
        async with serve(cut) as (url, _):
            engine = client(url)
            resp = await engine.request("POST", "/", b"", [])
            with pytest.raises(EngineError, match="peer closed connection"):
                await resp.read()
            await resp.aclose()
            assert engine._idle == []


async def test_closing_an_unread_answer_closes_the_connection() -> None:
    closed = trio.Event()

    async def slow(stream: trio.SocketStream, conn: h11.Connection, req: h11.Request) -> bool:
        head = h11.Response(status_code=200, headers=[(b"transfer-encoding", b"chunked")])
        await stream.send_all(conn.send(head) or b"")
        if await stream.receive_some(10) == b"":  # the client hung up: vLLM aborts here
            closed.set()
        return False

    with trio.fail_after(10):
        async with serve(slow) as (url, _):
            engine = client(url)
            resp = await engine.request("POST", "/", b"", [])
            await resp.aclose()
            await closed.wait()
            assert engine._idle == []


async def test_a_read_cut_short_by_its_caller_closes_the_connection() -> None:
    """The proxy cancels P's leg once D is done: the answer being read is closed with it (its
    slot freed, the engine sees the hang-up), not left for the garbage collector."""
    closed = trio.Event()

    async def stalls(stream: trio.SocketStream, conn: h11.Connection, req: h11.Request) -> bool:
        head = h11.Response(status_code=200, headers=[(b"transfer-encoding", b"chunked")])
        await stream.send_all((conn.send(head) or b"") + (conn.send(h11.Data(data=b"a")) or b""))
        if await stream.receive_some(10) == b"":
            closed.set()
        return False

    with trio.fail_after(10):
        async with serve(stalls) as (url, _):
            engine = client(url, slots=2)
            resp = await engine.request("POST", "/", b"", [])
            with trio.move_on_after(0.2) as scope:
                await resp.read()
            assert scope.cancelled_caught
            assert engine.slots.value == 2 and engine._idle == []
            assert resp._conn.socket.fileno() == -1  # closed, not left to the collector
            await closed.wait()


async def test_refused_connection_is_connect_failed_and_frees_its_slot() -> None:
    with trio.fail_after(10):
        async with serve(answer(b"")) as (url, _):
            pass  # the server is gone: its port refuses
        slots = trio.Semaphore(1)
        engine = EngineClient(url, connect_timeout=2.0, slots=slots)
        for _ in range(2):
            with pytest.raises(ConnectFailed):
                await engine.request("POST", "/", b"", [])
        assert slots.value == 1


async def test_slots_bound_the_open_answers() -> None:
    with trio.fail_after(10):
        async with serve(answer(b"z")) as (url, _):
            slots = trio.Semaphore(1)
            engine = EngineClient(url, connect_timeout=2.0, slots=slots)
            first = await engine.request("POST", "/", b"", [])
            with trio.move_on_after(0.2) as waited:
                await engine.request("POST", "/", b"", [])
            assert waited.cancelled_caught  # the one slot is held by the open answer
            await first.read()
            second = await engine.request("POST", "/", b"", [])
            assert await second.read() == b"z0"
            engine.close()


def test_only_http_and_https_engine_urls() -> None:
    for bad in ("ftp://example", "example:8000", "http://"):
        with pytest.raises(ValueError, match=r"http\(s\)://host"):
            EngineClient(bad, connect_timeout=1, slots=trio.Semaphore(1))
    secure = EngineClient("https://example", connect_timeout=1, slots=trio.Semaphore(1))
    assert secure.port == 443 and secure.tls is not None
    plain = EngineClient("http://example:8100", connect_timeout=1, slots=trio.Semaphore(1))
    assert plain.port == 8100 and plain.tls is None


async def test_close_closes_even_the_connection_of_an_answer_left_open() -> None:
    """An answer nobody closes (a bug elsewhere) still has its connection closed when the
    client closes, not left to the garbage collector (a ResourceWarning, fatal in the tests)."""
    with trio.fail_after(10):
        async with serve(answer(b"hi")) as (url, _):
            engine = client(url)
            kept = await (await engine.request("POST", "/", b"", [])).read()
            assert kept == b"hi0" and len(engine._idle) == 1
            dropped = await engine.request("POST", "/", b"", [])  # never read, never closed
            assert dropped.status == 200 and engine._idle == []
            sockets = [c.socket for c in engine._open]
            assert len(sockets) == 1
            engine.close()
            assert engine._open == set() and all(s.fileno() == -1 for s in sockets)
            engine.close()  # twice is harmless
