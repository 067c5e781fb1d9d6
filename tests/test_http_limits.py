"""Every HTTP door's limits on one client's connections (issue 42, part 3): how many it may hold
open at once (``max_connections_per_client``), and how long a write of its answer may wait for
it to read (``write_timeout``). Real doors on 127.0.0.1 over raw sockets: the clients over the
limits come from 127.0.0.2 (a loopback address of their own), so that the tests' well-behaved
clients (httpx, from 127.0.0.1) are another client of the same door.
"""

from __future__ import annotations

import logging
import socket
import sys
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from subprocess import PIPE

import httpx
import msgspec
import pytest
import trio
from quart import Response, request
from quart_trio import QuartTrio

from pdactors.actors.bootstrap import MAX_ADDR_CHARS
from tests.test_http_doors import head, open_bootstrap, open_proxy, read_answer, registration
from tests.test_proxy import FakeEngine, completion_body, eventually, open_setup

TIMEOUT = 10.0
#: The clients over a limit: another address than the tests' own clients (127.0.0.1).
GREEDY = "127.0.0.2"
HEALTH = head("GET", "/health", None)
DOOR_LOGS = {"bootstrap": "pdactors.bootstrap.http", "proxy": "pdactors.proxy.http"}
DOORS = {"bootstrap": open_bootstrap, "proxy": open_proxy}


async def connect(port: int, source: str = GREEDY, rcvbuf: int | None = None) -> trio.SocketStream:
    """A raw connection to ``127.0.0.1:port`` from ``source``; ``rcvbuf``: its receive buffer
    (set before connecting, so the window it offers is that small)."""
    sock = trio.socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    if rcvbuf is not None:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)
    await sock.bind((source, 0))
    await sock.connect(("127.0.0.1", port))
    return trio.SocketStream(sock)


async def read_to_end(stream: trio.SocketStream) -> int:
    """Read until the door closes the connection (end of stream or reset); the bytes read."""
    got = 0
    while True:
        try:
            data = await stream.receive_some(1 << 20)
        except trio.BrokenResourceError:  # reset: the door closed with our bytes unread
            return got
        if not data:
            return got
        got += len(data)


async def answered(stream: trio.SocketStream) -> bool:
    """Whether a ``GET /health`` on ``stream`` is answered (bootstrap 200; the proxy here has
    no engines: 503) rather than the connection closed."""
    await stream.send_all(HEALTH)
    answer = await read_answer(stream)
    return answer is not None and answer[0] in (200, 503)


def closings(caplog: pytest.LogCaptureFixture, door: str, client: str) -> list[str]:
    """The door's log lines about connections it closed on ``client``."""
    return [
        r.getMessage()
        for r in caplog.records
        if r.name == DOOR_LOGS[door] and f"closed a connection of {client}:" in r.getMessage()
    ]


async def closed_count(url: str, why: str) -> float:
    """``pdactors_proxy_connections_closed_total{why}`` on the proxy at ``url``."""
    async with httpx.AsyncClient(trust_env=False) as http:
        text = (await http.get(f"{url}/metrics")).text
    prefix = f'pdactors_proxy_connections_closed_total{{why="{why}"}} '
    values = [
        float(line.removeprefix(prefix)) for line in text.splitlines() if line.startswith(prefix)
    ]
    return values[0] if values else 0.0


# --------------------------------------------------------------------------- connections


@asynccontextmanager
async def open_clients(port: int) -> AsyncIterator[Callable[..., Awaitable[trio.SocketStream]]]:
    """:func:`connect` to ``port``, every connection it made closed at the end."""
    streams: list[trio.SocketStream] = []

    async def dial(source: str = GREEDY) -> trio.SocketStream:
        streams.append(await connect(port, source))
        return streams[-1]

    try:
        yield dial
    finally:
        for stream in streams:
            await stream.aclose()


@pytest.mark.parametrize("door", ["bootstrap", "proxy"])
async def test_a_client_past_its_cap_has_its_new_connection_closed(
    door: str, caplog: pytest.LogCaptureFixture
) -> None:
    """With ``max_connections_per_client=2``, a client's third connection is closed as it comes,
    with one log line naming the client (a fourth: no second line within the interval); its
    two are still served, so is another client, and once it closed one a new one is let in."""
    caplog.set_level(logging.WARNING, logger=DOOR_LOGS[door])
    with trio.fail_after(TIMEOUT):
        async with (
            DOORS[door](max_connections_per_client=2) as (url, port),
            open_clients(port) as dial,
        ):
            held = [await dial(), await dial()]
            for stream in held:
                assert await answered(stream)
            for _ in range(2):
                extra = await dial()
                with trio.fail_after(2):
                    assert await read_to_end(extra) == 0  # closed, no answer
            lines = closings(caplog, door, GREEDY)
            assert len(lines) == 1 and "max_connections_per_client" in lines[0], lines
            for stream in held:
                assert await answered(stream)
            assert await answered(await dial("127.0.0.1"))  # another client
            if door == "proxy":
                assert await closed_count(url, "max_connections_per_client") == 2
            await held[0].aclose()
            with trio.fail_after(2):  # once the door saw it close
                while not await answered(await dial()):
                    await trio.sleep(0.01)


async def test_no_cap_lets_a_client_hold_any_number() -> None:
    """``max_connections_per_client=0``: no cap."""
    with trio.fail_after(TIMEOUT):
        async with (
            open_bootstrap(max_connections_per_client=0) as (_, port),
            open_clients(port) as dial,
        ):
            held = [await dial() for _ in range(8)]
            for stream in held:
                assert await answered(stream)


# --------------------------------------------------------------------------- write timeout

#: The client's receive buffer: the kernel's least (it doubles it), so that a few KiB fill it.
SMALL_RCVBUF = 4096


async def test_the_bootstrap_closes_a_connection_whose_client_stopped_reading(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A client that asks for ``/query`` again and again (pipelined) and reads none of the
    answers: its connection is closed once a write waited ``write_timeout``, logged naming it;
    a client that reads gets every answer meanwhile."""
    caplog.set_level(logging.WARNING, logger=DOOR_LOGS["bootstrap"])
    write_timeout = 0.3
    with trio.fail_after(TIMEOUT):
        async with (
            open_bootstrap(write_timeout=write_timeout) as (url, port),
            httpx.AsyncClient(base_url=url, trust_env=False) as http,
        ):
            addr = "tcp://" + "h" * (MAX_ADDR_CHARS - 8) + ":1"
            for tp in range(128):  # a /query answer of ~64 KiB
                resp = await http.post("/register", content=registration("p", tp, addr))
                assert resp.status_code == 200, resp.text
            query = head("GET", "/query", None)
            async with await connect(port, rcvbuf=SMALL_RCVBUF) as stalled:
                sent = trio.current_time()
                await stalled.send_all(query * 128)  # ~8 MiB of answers: more than any buffer
                await eventually(lambda: bool(closings(caplog, "bootstrap", GREEDY)))
                assert trio.current_time() - sent >= write_timeout
                [line] = closings(caplog, "bootstrap", GREEDY)
                assert "write_timeout" in line
                with trio.fail_after(2):
                    got = await read_to_end(stalled)  # what was in the buffers, then closed
                assert got < 128 * 64 * 1024
            for _ in range(3):  # a client that reads is served as before
                assert len((await http.get("/query")).json()["0"]["worker_addr"]) == 128


@asynccontextmanager
async def stalled_stream(port: int) -> AsyncIterator[float]:
    """A streamed completion asked for on a raw connection with a small receive buffer, whose
    answer is never read; yields when it was sent."""
    stream = await connect(port, rcvbuf=SMALL_RCVBUF)
    body = msgspec.json.encode(completion_body(stream=True, max_tokens=100_000))
    sent = trio.current_time()
    await stream.send_all(
        head("POST", "/v1/completions", len(body), "Content-Type: application/json") + body
    )
    try:
        yield sent
        with trio.fail_after(2):
            await read_to_end(stream)  # closed by the door
    finally:
        await stream.aclose()  # (else a door without the timeout would write to it for ever)


#: Each chunk of :func:`endless_streams`' answers.
BIG_CHUNK = b"data: " + msgspec.json.encode({"choices": [{"index": 0, "text": "x" * 16_384}]})


def endless_streams(endless: list[bool]) -> Callable[[QuartTrio, FakeEngine], None]:
    """Routes for :func:`open_setup`: once ``endless`` holds True, a stand-in answers a streamed
    completion without end, 16 KiB a chunk (a few MiB fill any socket buffer at once), and
    notes its request in ``cancelled`` when its stream is cut, wherever the stream was (the
    stand-ins' own streams note it only while they wait for a step); until then, as ever
    (the proxy's calibration)."""

    def install(app: QuartTrio, engine: FakeEngine) -> None:
        usual = app.view_functions["completions"]

        async def completions() -> Response:
            if not endless[0] or not (await request.get_json()).get("stream"):
                return await usual()  # type: ignore[misc,no-any-return]
            rid = request.headers.get("x-request-id", "")
            engine.request_ids.append(rid)

            async def chunks() -> AsyncIterator[bytes]:
                try:
                    while True:
                        yield BIG_CHUNK + b"\n\n"
                except (trio.Cancelled, GeneratorExit):
                    engine.cancelled.append(rid)
                    raise

            return Response(chunks(), content_type="text/event-stream")

        app.view_functions["completions"] = completions

    return install


async def test_the_proxy_closes_a_stalled_client_and_cancels_its_engine_leg(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A client that asked for a long stream and reads none of it: after ``write_timeout`` its
    connection is closed, logged naming it, counted, and the engine leg serving it is
    cancelled (the stand-in saw its stream cut)."""
    caplog.set_level(logging.WARNING, logger=DOOR_LOGS["proxy"])
    write_timeout = 0.3
    endless = [False]
    with trio.fail_after(TIMEOUT):
        async with open_setup(write_timeout=write_timeout, routes=endless_streams(endless)) as s:
            endless[0] = True
            port = int(s.url.rsplit(":", 1)[1])
            engines = [*s.p, *s.d]

            def cancelled() -> list[str]:
                return [rid for e in engines for rid in e.cancelled]

            async with stalled_stream(port) as sent:
                await eventually(lambda: bool(cancelled()))
                assert trio.current_time() - sent >= write_timeout
                [line] = closings(caplog, "proxy", GREEDY)
                assert "write_timeout" in line
            asked = [rid for e in engines for rid in e.request_ids]
            assert cancelled() == asked and len(asked) == 1
            assert await closed_count(s.url, "write_timeout") == 1


async def test_a_client_that_reads_gets_its_whole_long_stream() -> None:
    """A ``write_timeout`` far shorter than the stream takes: a client that reads (httpx)
    gets a stream far larger than the socket buffers, for as long as it reads (the timeout
    bounds each piece, not the answer)."""
    endless = [False]
    write_timeout = 0.3
    with trio.fail_after(TIMEOUT):
        async with open_setup(write_timeout=write_timeout, routes=endless_streams(endless)) as s:
            endless[0] = True
            got = 0
            body = completion_body(stream=True, max_tokens=100_000)
            began = trio.current_time()
            async with s.client.stream("POST", "/v1/completions", json=body) as resp:
                assert resp.status_code == 200
                async for piece in resp.aiter_bytes():
                    got += len(piece)
                    # ~6.5 MiB, and for longer than the timeout several times over (a fast
                    # machine reads the 6.5 MiB well within it)
                    long_enough = trio.current_time() - began > 3 * write_timeout
                    if got > 400 * len(BIG_CHUNK) and long_enough:
                        break
            assert got > 400 * len(BIG_CHUNK)
            assert await closed_count(s.url, "write_timeout") == 0


COMMANDS = {
    "bootstrap": ["bootstrap"],
    "proxy": ["proxy", "--prefill", "http://127.0.0.1:1", "--decode", "http://127.0.0.1:2"],
}


@pytest.mark.parametrize("door", ["bootstrap", "proxy"])
async def test_the_commands_take_the_limits(door: str) -> None:
    """``pdactors bootstrap|proxy --max-connections-per-client 1 --write-timeout S``: a
    client's second connection is closed, and the command's log names it."""
    limits = ["--max-connections-per-client", "1", "--write-timeout", "5", "--quiet"]
    argv = [sys.executable, "-m", "pdactors.cli", *COMMANDS[door], "--port", "0", *limits]
    with trio.fail_after(30):
        proc = await trio.lowlevel.open_process(argv, stdout=PIPE, stderr=PIPE)
        try:
            assert proc.stdout is not None and proc.stderr is not None
            out = b""
            while b"serving on " not in out or not out.endswith(b"\n"):
                out += await proc.stdout.receive_some()
            port = int(out.decode().rsplit(":", 1)[1])
            async with open_clients(port) as dial:
                assert await answered(await dial())
                with trio.fail_after(2):
                    assert await read_to_end(await dial()) == 0
        finally:
            proc.kill()
            await proc.wait()
        err = b""
        while more := await proc.stderr.receive_some():
            err += more
        assert b"closed a connection of 127.0.0.2" in err, err.decode()


def test_limits_below_zero_are_refused() -> None:
    from pdactors.config import BootstrapConfig
    from pdactors.errors import ConfigError

    with pytest.raises(ConfigError, match="max_connections_per_client"):
        BootstrapConfig(max_connections_per_client=-1)
    with pytest.raises(ConfigError, match="write_timeout"):
        BootstrapConfig(write_timeout=-1.0)
