"""The HTTP doors under abuse (issue 23): the bootstrap and the proxy, real hypercorn servers on
127.0.0.1, driven over raw sockets where a well-behaved client (httpx) cannot misbehave enough.

One test per finding: the bootstrap stays bounded (5), the proxy refuses bodies before they
cost (6), an early answer never wedges a keep-alive connection (7), and refusals reach the log
once per client, escaped (8). The property tests at the end throw hypothesis' bodies and
headers at the real bootstrap. The proxy's are in test_proxy.py, beside its stand-in engines.
"""

from __future__ import annotations

import json
import logging
import resource
import socket
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import httpx
import msgspec
import pytest
import trio
import trio.testing
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pdactors import PrefillBackend, ProxyConfig, serve_proxy
from pdactors.actors.bootstrap import (
    MAX_ADDR_CHARS,
    MAX_ENGINE_ID_CHARS,
    BootstrapRegistry,
    RegistryFull,
    serve_bootstrap,
)
from pdactors.config import BootstrapConfig
from pdactors.proxy._openai import MAX_JSON_DEPTH
from pdactors.web._refusals import RefusalLog
from pdactors.wire import RegisterWorker

TOKEN = "door-token"
TIMEOUT = 10.0
REGISTER = b'{"engine_id":"p","dp_rank":0,"tp_rank":0,"pp_rank":0,"addr":"tcp://127.0.0.1:5555"}'
COMPLETION = b'{"model":"tiny","prompt":"hi","max_tokens":2}'


def registration(engine_id: str = "p", tp: int = 0, addr: str = "tcp://127.0.0.1:5555") -> bytes:
    worker = {"engine_id": engine_id, "dp_rank": 0, "tp_rank": tp, "pp_rank": 0, "addr": addr}
    return json.dumps(worker).encode()


@asynccontextmanager
async def open_bootstrap(**config: Any) -> AsyncIterator[tuple[str, int]]:
    """A real bootstrap; yields its URL and port."""
    async with trio.open_nursery() as nursery:
        url: str = await nursery.start(serve_bootstrap, BootstrapConfig(**config))
        yield url, int(url.rsplit(":", 1)[1])
        nursery.cancel_scope.cancel()


@asynccontextmanager
async def open_proxy(**config: Any) -> AsyncIterator[tuple[str, int]]:
    """A real proxy in front of engines that are not there: every request below is refused
    before an engine would be picked (or answered 503)."""
    async with trio.open_nursery() as nursery:
        proxy_config = ProxyConfig(
            prefill=(PrefillBackend("http://127.0.0.1:1", "http://127.0.0.1:1"),),
            decode=("http://127.0.0.1:2",),
            health_interval=30.0,
            **config,
        )
        url: str = await nursery.start(serve_proxy, proxy_config)
        yield url, int(url.rsplit(":", 1)[1])
        nursery.cancel_scope.cancel()


def head(method: str, path: str, length: int | None, *extra: str) -> bytes:
    lines = [f"{method} {path} HTTP/1.1", "Host: door", *extra]
    if length is not None:
        lines.append(f"Content-Length: {length}")
    return ("\r\n".join(lines) + "\r\n\r\n").encode()


async def read_answer(stream: trio.SocketStream) -> tuple[int, dict[str, str], bytes] | None:
    """One HTTP/1.1 answer with a Content-Length, or None when the connection closed first."""
    data = b""
    while b"\r\n\r\n" not in data:
        try:
            more = await stream.receive_some(65536)
        except trio.BrokenResourceError:  # reset: closed
            return None
        if not more:
            return None
        data += more
    top, _, rest = data.partition(b"\r\n\r\n")
    status_line, *header_lines = top.decode("latin-1").split("\r\n")
    headers = {k.strip().lower(): v.strip() for k, _, v in (h.partition(":") for h in header_lines)}
    length = int(headers.get("content-length", "0"))
    while len(rest) < length:
        more = await stream.receive_some(65536)
        if not more:
            return None
        rest += more
    return int(status_line.split()[1]), headers, rest[:length]


# --------------------------------------------------------------------------- 7: the wedge

# (door, method, path, body, extra headers, the early answer's status)
WEDGES = [
    ("bootstrap", "POST", "/register", REGISTER, (), 401),
    ("bootstrap", "POST", "/nothing", REGISTER, (f"Authorization: Bearer {TOKEN}",), 404),
    ("proxy", "POST", "/v1/completions", COMPLETION, (), 401),  # raw ASGI
    ("proxy", "POST", "/v1/models", COMPLETION, (), 401),  # Quart
    ("proxy", "PUT", "/v1/completions", COMPLETION, (f"Authorization: Bearer {TOKEN}",), 405),
]


@pytest.mark.parametrize(("door", "method", "path", "body", "extra", "status"), WEDGES)
async def test_an_early_answer_never_wedges_the_connection(
    door: str, method: str, path: str, body: bytes, extra: tuple[str, ...], status: int
) -> None:
    """Headers first, the body held back; the early answer; then the body and a second
    request on the same connection: the second is answered or the connection is closed."""
    opened = open_bootstrap(token=TOKEN) if door == "bootstrap" else open_proxy(api_key=TOKEN)
    with trio.fail_after(TIMEOUT):
        async with opened as (_, port):
            stream = await trio.open_tcp_stream("127.0.0.1", port)
            async with stream:
                await stream.send_all(head(method, path, len(body), *extra))
                first = await read_answer(stream)
                assert first is not None and first[0] == status, first
                # The server is done with the first exchange (sending the body at once raced
                # its end, and the old code sometimes got through).
                await trio.testing.wait_all_tasks_blocked()
                # /metrics: 200 on the proxy (whose /health is 503 here); the bootstrap's 404.
                second_request = head("GET", "/health" if door == "bootstrap" else "/metrics", None)
                try:
                    await stream.send_all(body + second_request)
                except trio.BrokenResourceError:
                    return  # closed: the client knows at once
                with trio.move_on_after(3) as hung:
                    second = await read_answer(stream)
                assert not hung.cancelled_caught, "the connection neither answered nor closed"
                assert second is None or second[0] == 200, second


async def test_refusals_before_the_body_say_connection_close() -> None:
    with trio.fail_after(TIMEOUT):
        async with open_proxy(api_key=TOKEN, max_body_bytes=1000) as (_, port):
            for request in (
                head("POST", "/v1/completions", 10),  # 401
                head("POST", "/v1/completions", 10**9, f"Authorization: Bearer {TOKEN}"),  # 413
            ):
                async with await trio.open_tcp_stream("127.0.0.1", port) as stream:
                    await stream.send_all(request)
                    answer = await read_answer(stream)
                    assert answer is not None and answer[1]["connection"] == "close", answer


@pytest.mark.parametrize("door", ["bootstrap", "proxy"])
async def test_stray_bytes_after_a_closing_request_never_stop_the_server(door: str) -> None:
    """A request that says ``Connection: close``, then more bytes than its ``Content-Length``:
    hypercorn's half-close raced its error answer to the stray bytes, and the
    ``BusyResourceError`` stopped the whole server (the old bootstrap and proxy died within
    300 such connections, every run; found by the fuzz below)."""
    path = "/register" if door == "bootstrap" else "/v1/models"  # Quart answers both
    request = head("POST", path, 5, "Connection: close") + b"y" * 2000
    opened = open_bootstrap(token=TOKEN) if door == "bootstrap" else open_proxy(api_key=TOKEN)
    with trio.fail_after(30):
        async with opened as (url, port):

            def hit() -> None:  # blocking sockets, in a thread: as the fuzz found it
                for _ in range(300):
                    with socket.create_connection(("127.0.0.1", port), timeout=1) as sock:
                        try:
                            sock.sendall(request)
                            while sock.recv(65536):
                                pass
                        except (TimeoutError, ConnectionError):
                            pass

            await trio.to_thread.run_sync(hit, abandon_on_cancel=True)
            async with httpx.AsyncClient(trust_env=False) as http:  # still serving
                assert (await http.get(f"{url}/health")).status_code in (200, 503)


# --------------------------------------------------------------------------- 6: proxy bodies


async def test_a_content_length_over_the_limit_is_refused_before_reading() -> None:
    with trio.fail_after(TIMEOUT):
        async with open_proxy() as (_, port):
            async with await trio.open_tcp_stream("127.0.0.1", port) as stream:
                await stream.send_all(head("POST", "/v1/completions", 100_000_000))  # no body
                with trio.fail_after(2):
                    answer = await read_answer(stream)
                assert answer is not None and answer[0] == 413, answer
                assert b"larger than" in answer[2]


async def test_a_body_in_two_byte_chunks_is_refused_at_once() -> None:
    """16 MB in 2-byte chunks took the proxy to 1.2 GB and 239 s of work before its 400."""
    chunked = head("POST", "/v1/completions", None, "Transfer-Encoding: chunked")
    piece = b"2\r\nxx\r\n" * 4096  # 8 KiB of body
    with trio.fail_after(TIMEOUT):
        async with open_proxy() as (_, port):
            async with await trio.open_tcp_stream("127.0.0.1", port) as stream:
                await stream.send_all(chunked)
                start = trio.current_time()

                async def send_16_mb() -> None:
                    try:
                        for _ in range(2048):
                            await stream.send_all(piece)
                    except trio.BrokenResourceError:
                        pass  # refused and closed

                async with trio.open_nursery() as nursery:
                    nursery.start_soon(send_16_mb)
                    answer = await read_answer(stream)
                    nursery.cancel_scope.cancel()
                assert answer is not None and answer[0] == 400, answer
                assert b"pieces" in answer[2]
                assert trio.current_time() - start < 3


async def test_a_slow_body_gets_408_and_the_connection_closes() -> None:
    with trio.fail_after(TIMEOUT):
        async with open_proxy(body_timeout=0.5) as (_, port):
            async with await trio.open_tcp_stream("127.0.0.1", port) as stream:
                await stream.send_all(head("POST", "/v1/completions", len(COMPLETION)))
                await stream.send_all(COMPLETION[:1])  # then nothing: a slowloris
                start = trio.current_time()
                answer = await read_answer(stream)
                assert answer is not None and answer[0] == 408, answer
                assert 0.4 < trio.current_time() - start < 3
                assert answer[1]["connection"] == "close"
                assert await stream.receive_some(10) == b""  # closed by the proxy


def nested(depth: int) -> bytes:
    inner = "[" * (depth - 1) + "]" * (depth - 1)
    return b'{"model":"tiny","prompt":"hi","extra":' + inner.encode() + b"}"


async def test_deep_json_is_a_400_and_shallow_json_with_brackets_is_not() -> None:
    with trio.fail_after(TIMEOUT):
        async with open_proxy() as (url, _), httpx.AsyncClient(trust_env=False) as http:
            for depth in (MAX_JSON_DEPTH + 1, 1000, 100_000):
                resp = await http.post(f"{url}/v1/completions", content=nested(depth))
                assert resp.status_code == 400, (depth, resp.text)
                assert "nests deeper" in resp.json()["error"]["message"]
            # At the limit, and brackets inside strings: valid (503: no engine is up).
            for body in (nested(MAX_JSON_DEPTH), b'{"model":"m","prompt":"' + b"[{" * 500 + b'"}'):
                resp = await http.post(f"{url}/v1/completions", content=body)
                assert resp.status_code == 503, resp.text


# --------------------------------------------------------------------------- 5: the bootstrap


def test_the_registry_holds_at_most_max_workers() -> None:
    reg = BootstrapRegistry(max_workers=3)
    for tp in range(3):  # (no lease: a live lease would refuse the move below, 409)
        reg.register(RegisterWorker("p", 0, tp, 0, "tcp://127.0.0.1:5555"))
    with pytest.raises(RegistryFull):
        reg.register(RegisterWorker("p", 0, 3, 0, "tcp://127.0.0.1:5555"))
    with pytest.raises(RegistryFull):
        reg.register(RegisterWorker("q", 1, 0, 0, "tcp://127.0.0.1:5555"))
    assert len(reg) == 3
    # A renewal, a move and a new engine on the same DP rank take no room.
    assert reg.register(RegisterWorker("p", 0, 0, 0, "tcp://127.0.0.1:5555")) == "unchanged"
    assert reg.register(RegisterWorker("p", 0, 1, 0, "tcp://127.0.0.1:6666")) == "moved"
    assert reg.register(RegisterWorker("p2", 0, 0, 0, "tcp://127.0.0.1:7")) == "engine_replaced"
    assert len(reg) == 1
    reg.register(RegisterWorker("p2", 0, 1, 0, "tcp://127.0.0.1:7"), now=0.0, lease=1.0)
    reg.register(RegisterWorker("p2", 0, 2, 0, "tcp://127.0.0.1:7"), now=0.0, lease=1.0)
    assert len(reg) == 3
    reg.expire(now=2.0)  # two leases lapse: room again
    assert len(reg) == 1
    reg.register(RegisterWorker("q", 1, 0, 0, "tcp://127.0.0.1:5555"), now=2.0)
    assert len(reg) == 2


async def test_the_bootstrap_is_bounded_in_workers_and_field_sizes() -> None:
    """3,000 registrations with 60 KB ids took the bootstrap to +175 MB and a 180 MB /query."""
    with trio.fail_after(TIMEOUT):
        async with (
            open_bootstrap(max_workers=4) as (url, _),
            httpx.AsyncClient(trust_env=False) as http,
        ):

            async def register(body: bytes) -> httpx.Response:
                return await http.post(f"{url}/register", content=body)

            resp = await register(registration("x" * 60_000))  # the finding's 60 KB id
            assert resp.status_code == 413, resp.text  # from its Content-Length
            resp = await register(registration("x" * (MAX_ENGINE_ID_CHARS + 1)))
            assert resp.status_code == 400 and "engine_id is longer" in resp.json()["error"]
            long_addr = "tcp://" + "h" * MAX_ADDR_CHARS + ":1"
            assert (await register(registration(addr=long_addr))).status_code == 400
            big_rank = registration().replace(b'"tp_rank": 0', b'"tp_rank": 100000')
            assert b"100000" in big_rank
            assert (await register(big_rank)).status_code == 400
            assert (await register(b" " * 20_000 + REGISTER)).status_code == 413
            for tp in range(4):
                resp = await register(registration("x" * MAX_ENGINE_ID_CHARS, tp))
                assert resp.status_code == 200, resp.text
            resp = await register(registration("x" * MAX_ENGINE_ID_CHARS, 4))
            assert resp.status_code == 429 and "maximum of 4 workers" in resp.json()["error"]
            resp = await register(registration("x" * MAX_ENGINE_ID_CHARS, 0))  # a renewal
            assert resp.status_code == 200
            answer = (await http.get(f"{url}/query")).json()
            assert len(answer["0"]["worker_addr"]) == 4


# --------------------------------------------------------------------------- 8: the logs


async def test_peer_text_is_escaped_and_refusals_are_logged_once(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.INFO, "pdactors.bootstrap")
    forged = "p\n2026-12-02 CRITICAL pdactors: forged"
    with trio.fail_after(TIMEOUT):
        async with open_bootstrap() as (url, _), httpx.AsyncClient(trust_env=False) as http:
            resp = await http.post(f"{url}/register", content=registration(forged))
            assert resp.status_code == 200
            for i in range(30):  # bad bodies, too-large ones, unknown routes: one line
                await http.post(f"{url}/register", content=b"{" + f"\n{i}".encode())
                await http.post(f"{url}/register", content=b"x" * 20_000)
                await http.get(f"{url}/nothing%0ACRITICAL")
    lines = [r.getMessage() for r in caplog.records]
    assert all("\n" not in line for line in lines), lines
    assert any(repr(forged) in line for line in lines)
    assert len([line for line in lines if "refused" in line]) == 1, lines


def test_a_refusal_log_writes_once_per_client_per_interval() -> None:
    now = [0.0]
    log = logging.getLogger("tests.refusals")
    records: list[str] = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            records.append(record.getMessage())

    handler = Keep()
    log.addHandler(handler)
    try:
        refusals = RefusalLog(log, "the door", interval=60.0, max_clients=2, clock=lambda: now[0])
        for _ in range(100):
            refusals.refused("a", 401, "no\ntoken")
            refusals.refused("b", 400, "bad")
        assert len(records) == 2 and "'no\\ntoken'" in records[0]
        now[0] = 61.0
        refusals.refused("a", 401, "no token")
        assert len(records) == 3 and "+99 since its last line" in records[2]
        refusals.refused("c", 400, "bad")  # a third client: the oldest are forgotten
        assert len(records) == 4
    finally:
        log.removeHandler(handler)


# --------------------------------------------------------------------------- fuzz: bootstrap

_json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=30),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner),
    max_leaves=20,
)
_fields = st.fixed_dictionaries(
    {
        "engine_id": st.text(max_size=300),
        "dp_rank": st.integers(-5, 2**70),
        "tp_rank": st.integers(-5, 100),
        "pp_rank": st.integers(-5, 100),
        "addr": st.text(max_size=40).map(lambda t: "tcp://" + t),
    },
    optional={"curve_key": st.text(max_size=45)},
)
_bodies = st.one_of(
    st.binary(max_size=2000),
    _json_values.map(lambda v: json.dumps(v).encode()),
    _fields.map(lambda d: json.dumps(d).encode()),
    st.integers(1, 5000).map(lambda n: b"[" * n),
)
_header_names = st.sampled_from(
    ["Content-Length", "Transfer-Encoding", "Authorization", "Content-Type", "Expect", "X-Junk"]
)
_header_values = st.one_of(
    st.sampled_from(["0", "5", "100000000", "-1", "chunked", "gzip", "100-continue", "Bearer x"]),
    st.text(st.characters(min_codepoint=32, max_codepoint=126), max_size=60),
)
_requests = st.tuples(
    st.sampled_from(["POST", "GET", "PUT", "DELETE", "HEAD", "OPTIONS", "BREW"]),
    st.sampled_from(["/register", "/query", "/health", "/register?lease=1", "/x", "//", "/%00"]),
    st.lists(st.tuples(_header_names, _header_values), max_size=4),
    _bodies,
)


def raw_exchange(port: int, request: bytes) -> bytes:
    """Send ``request`` (with ``Connection: close``) on a fresh connection and read what comes
    until the server closes it or is quiet for 0.25 s (a blocking socket: this runs in
    hypothesis' thread). A request whose body never comes whole is the server's to time out;
    the test only asserts on what did come."""
    data = b""
    with socket.create_connection(("127.0.0.1", port), timeout=0.25) as sock:
        try:
            sock.sendall(request)
            while chunk := sock.recv(65536):
                data += chunk
        except (TimeoutError, ConnectionError):
            pass
    return data


def statuses(data: bytes) -> list[int]:
    return [int(line.split()[1]) for line in data.split(b"\r\n") if line.startswith(b"HTTP/1.1 ")]


def fuzz_http(port: int, requests: st.SearchStrategy[Any], examples: int) -> list[int]:
    """Throw hypothesis' requests at ``port`` from this (worker) thread; no answer may be 5xx."""
    seen: list[int] = []

    @settings(
        max_examples=examples,
        deadline=None,
        database=None,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
    )
    @given(request=requests)
    def throw(request: tuple[str, str, list[tuple[str, str]], bytes]) -> None:
        method, path, headers, body = request
        lines = [f"{method} {path} HTTP/1.1", "Host: fuzz", "Connection: close"]
        lines += [f"{k}: {v}" for k, v in headers]
        if not any(k == "Content-Length" for k, _ in headers):
            lines.append(f"Content-Length: {len(body)}")
        answer = raw_exchange(port, ("\r\n".join(lines) + "\r\n\r\n").encode() + body)
        got = statuses(answer)
        seen.extend(got)
        # h11 answers a transfer coding it does not know (anything but one "chunked") with
        # 501, as RFC 9112 says to.
        codings = [v.strip().lower() for k, v in headers if k == "Transfer-Encoding"]
        unknown_coding = bool(codings) and codings != ["chunked"]
        assert all(s < 500 or (s == 501 and unknown_coding) for s in got), (request, answer[:500])

    throw()
    return seen


def max_rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


async def test_fuzzed_requests_never_hurt_the_bootstrap() -> None:
    """Hypothesis' methods, paths, headers and bodies: no 5xx, no more than the bounded
    registry's growth in memory, and a real client registers and queries throughout."""
    with trio.fail_after(60):
        async with (
            open_bootstrap(token=TOKEN) as (url, port),
            open_bootstrap(max_workers=16) as (open_url, open_port),
            httpx.AsyncClient(trust_env=False, timeout=5) as http,
        ):
            before = max_rss_mb()
            good = {"authorization": f"Bearer {TOKEN}"}
            for door, examples in ((port, 100), (open_port, 100)):
                seen = await trio.to_thread.run_sync(
                    fuzz_http, door, _requests, examples, abandon_on_cancel=True
                )
                assert seen
            resp = await http.post(f"{url}/register", content=REGISTER, headers=good)
            assert resp.status_code == 200
            assert (await http.get(f"{url}/query", headers=good)).json()["0"]["engine_id"] == "p"
            # Fuzzed registrations that passed went to the open one: at most 16 of them.
            answer = msgspec.json.decode((await http.get(f"{open_url}/query")).content)
            assert sum(len(pps) for e in answer.values() for pps in e["worker_addr"].values()) <= 16
            assert max_rss_mb() - before < 100
