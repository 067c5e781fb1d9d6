"""The bootstrap registry: its bookkeeping, its HTTP face, and the client that talks to it."""

from __future__ import annotations

import itertools
import json
import logging
import socket
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import httpx
import msgspec
import pytest
import trio
import trio.testing
from hypothesis import given, settings
from hypothesis import strategies as st

from pdactors.actors.bootstrap import BootstrapRegistry, serve_bootstrap
from pdactors.bootstrap_client import BootstrapClient, open_bootstrap_client
from pdactors.config import BootstrapConfig
from pdactors.errors import BootstrapError
from pdactors.wire import BootstrapEntry, RegisterWorker

VALID: dict[str, Any] = {
    "engine_id": "prefill-0",
    "dp_rank": 0,
    "tp_rank": 0,
    "pp_rank": 0,
    "addr": "tcp://127.0.0.1:5555",
}


def worker(
    engine_id: str = "prefill-0", dp: int = 0, tp: int = 0, pp: int = 0, port: int = 5555
) -> RegisterWorker:
    return RegisterWorker(engine_id, dp, tp, pp, f"tcp://127.0.0.1:{port}")


@asynccontextmanager
async def running_bootstrap() -> AsyncIterator[str]:
    async with trio.open_nursery() as nursery:
        url: str = await nursery.start(serve_bootstrap, BootstrapConfig())
        yield url
        nursery.cancel_scope.cancel()


@asynccontextmanager
async def raw_http() -> AsyncIterator[httpx.AsyncClient]:
    async with httpx.AsyncClient(trust_env=False, timeout=5) as http:
        yield http


def free_port() -> int:
    """A port nothing listens on (bound and released at once)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
    return port


# --------------------------------------------------------------------------- registry (sync)


def test_registry_starts_empty() -> None:
    assert BootstrapRegistry().answer() == {}


def test_registry_reports_what_changed() -> None:
    reg = BootstrapRegistry()
    assert reg.register(worker()) == "added"
    assert reg.register(worker()) == "unchanged"
    assert reg.register(worker(port=6000)) == "moved"
    assert reg.register(worker(tp=1)) == "added"
    assert reg.register(worker(engine_id="prefill-new")) == "engine_replaced"
    assert reg.answer() == {
        0: BootstrapEntry("prefill-new", {0: {0: "tcp://127.0.0.1:5555"}}),
    }


def test_registry_reregistration_replaces_address() -> None:
    reg = BootstrapRegistry()
    reg.register(worker(port=5555))
    reg.register(worker(port=5556))
    assert reg.answer() == {0: BootstrapEntry("prefill-0", {0: {0: "tcp://127.0.0.1:5556"}})}


def test_registry_nests_dp_tp_pp() -> None:
    reg = BootstrapRegistry()
    for dp in (1, 0):
        for tp in (1, 0):
            for pp in (1, 0):
                reg.register(worker(f"e{dp}", dp, tp, pp, port=5000 + 100 * dp + 10 * tp + pp))
    answer = reg.answer()
    assert list(answer) == [0, 1]  # ranks come out in order
    assert answer[1] == BootstrapEntry(
        "e1",
        {
            0: {0: "tcp://127.0.0.1:5100", 1: "tcp://127.0.0.1:5101"},
            1: {0: "tcp://127.0.0.1:5110", 1: "tcp://127.0.0.1:5111"},
        },
    )
    assert answer[0].engine_id == "e0"


def test_registry_same_engine_on_several_dp_ranks() -> None:
    reg = BootstrapRegistry()
    reg.register(worker("e", dp=0))
    reg.register(worker("e", dp=1, port=6000))
    assert reg.answer() == {
        0: BootstrapEntry("e", {0: {0: "tcp://127.0.0.1:5555"}}),
        1: BootstrapEntry("e", {0: {0: "tcp://127.0.0.1:6000"}}),
    }


def test_registry_new_engine_only_replaces_its_dp_rank() -> None:
    reg = BootstrapRegistry()
    reg.register(worker("a", dp=0, tp=0))
    reg.register(worker("a", dp=0, tp=1, port=5556))
    reg.register(worker("b", dp=1))
    reg.register(worker("a2", dp=0, tp=1, port=7000))
    assert reg.answer() == {
        0: BootstrapEntry("a2", {1: {0: "tcp://127.0.0.1:7000"}}),
        1: BootstrapEntry("b", {0: {0: "tcp://127.0.0.1:5555"}}),
    }


def test_registry_answer_is_a_copy() -> None:
    reg = BootstrapRegistry()
    reg.register(worker())
    answer = reg.answer()
    answer[0].worker_addr[0][0] = "tcp://evil:1"
    answer[5] = BootstrapEntry("x", {})
    assert reg.answer() == {0: BootstrapEntry("prefill-0", {0: {0: "tcp://127.0.0.1:5555"}})}


# --------------------------------------------------------------------------- server over HTTP


async def test_health() -> None:
    with trio.fail_after(10):
        async with running_bootstrap() as url, raw_http() as http:
            assert url.startswith("http://127.0.0.1:")
            resp = await http.get(f"{url}/health")
            assert resp.status_code == 200
            assert resp.json() == {"status": "ok"}


async def test_round_trip_with_client() -> None:
    with trio.fail_after(10):
        async with running_bootstrap() as url, open_bootstrap_client() as client:
            assert await client.query(url, timeout=5) == {}
            await client.register(url, worker(), timeout=5)
            await client.register(url, worker(tp=1, port=5556), timeout=5)
            assert await client.query(url + "/", timeout=5) == {
                0: BootstrapEntry(
                    "prefill-0", {0: {0: "tcp://127.0.0.1:5555"}, 1: {0: "tcp://127.0.0.1:5556"}}
                )
            }


async def test_round_trip_raw_json_shape() -> None:
    with trio.fail_after(10):
        async with running_bootstrap() as url, raw_http() as http:
            resp = await http.post(f"{url}/register", json=VALID)
            assert resp.status_code == 200
            assert resp.json() == {"ok": True}
            resp = await http.get(f"{url}/query")
            assert resp.status_code == 200
            assert resp.headers["content-type"] == "application/json"
            assert json.loads(resp.content) == {
                "0": {"engine_id": "prefill-0", "worker_addr": {"0": {"0": "tcp://127.0.0.1:5555"}}}
            }


async def test_reregistration_and_many_ranks_over_http() -> None:
    with trio.fail_after(10):
        async with running_bootstrap() as url, raw_http() as http:
            bodies = [
                {**VALID, "addr": "tcp://127.0.0.1:1"},
                {**VALID, "addr": "tcp://127.0.0.1:2"},  # same rank: replaces
                {**VALID, "tp_rank": 1, "addr": "tcp://127.0.0.1:3"},
                {**VALID, "pp_rank": 1, "addr": "tcp://127.0.0.1:4"},
                {**VALID, "dp_rank": 1, "engine_id": "other", "addr": "tcp://127.0.0.1:5"},
                {**VALID, "dp_rank": 2, "engine_id": "gone", "addr": "tcp://127.0.0.1:6"},
                {**VALID, "dp_rank": 2, "engine_id": "back", "addr": "tcp://127.0.0.1:7"},
            ]
            for body in bodies:
                assert (await http.post(f"{url}/register", json=body)).status_code == 200
            resp = await http.get(f"{url}/query")
            assert resp.json() == {
                "0": {
                    "engine_id": "prefill-0",
                    "worker_addr": {
                        "0": {"0": "tcp://127.0.0.1:2", "1": "tcp://127.0.0.1:4"},
                        "1": {"0": "tcp://127.0.0.1:3"},
                    },
                },
                "1": {"engine_id": "other", "worker_addr": {"0": {"0": "tcp://127.0.0.1:5"}}},
                "2": {"engine_id": "back", "worker_addr": {"0": {"0": "tcp://127.0.0.1:7"}}},
            }


def _without(key: str) -> dict[str, Any]:
    return {k: v for k, v in VALID.items() if k != key}


BAD_BODIES: list[tuple[str, bytes, str]] = [
    ("not json", b"engine_id=prefill-0", "malformed"),
    ("empty body", b"", "input data was truncated"),
    ("truncated json", json.dumps(VALID).encode()[:-3], ""),
    ("not utf-8", b'{"engine_id": "\xff\xfe"}', ""),
    ("json array", json.dumps(list(VALID.values())).encode(), "expected `object`"),
    ("json string", b'"hello"', "expected `object`"),
    ("missing field", json.dumps(_without("addr")).encode(), "missing required field `addr`"),
    ("unknown field", json.dumps({**VALID, "color": "red"}).encode(), "unknown field `color`"),
    ("rank as string", json.dumps({**VALID, "tp_rank": "0"}).encode(), "expected `int`"),
    ("rank as float", json.dumps({**VALID, "pp_rank": 0.5}).encode(), "expected `int`"),
    ("rank as bool", json.dumps({**VALID, "dp_rank": True}).encode(), "expected `int`"),
    ("engine_id as int", json.dumps({**VALID, "engine_id": 7}).encode(), "expected `str`"),
    ("addr null", json.dumps({**VALID, "addr": None}).encode(), "expected `str`"),
    ("negative rank", json.dumps({**VALID, "dp_rank": -1}).encode(), "ranks must be >= 0"),
    ("empty engine_id", json.dumps({**VALID, "engine_id": ""}).encode(), "must not be empty"),
    ("non-tcp addr", json.dumps({**VALID, "addr": "http://h:1"}).encode(), "tcp://"),
]


@pytest.mark.parametrize(
    ("body", "needle"), [(b, n) for _, b, n in BAD_BODIES], ids=[i for i, _, _ in BAD_BODIES]
)
async def test_bad_register_bodies_get_400(body: bytes, needle: str) -> None:
    with trio.fail_after(10):
        async with running_bootstrap() as url, raw_http() as http:
            resp = await http.post(
                f"{url}/register", content=body, headers={"content-type": "application/json"}
            )
            assert resp.status_code == 400
            error = resp.json()["error"]
            assert error.startswith("invalid registration: ")
            assert needle.lower() in error.lower()
            # Still serving, and nothing was registered.
            assert (await http.get(f"{url}/query")).json() == {}
            assert (await http.post(f"{url}/register", json=VALID)).status_code == 200


async def test_unknown_routes_and_methods_answer_json_errors() -> None:
    with trio.fail_after(10):
        async with running_bootstrap() as url, raw_http() as http:
            resp = await http.get(f"{url}/nowhere")
            assert resp.status_code == 404
            assert "error" in resp.json()
            resp = await http.get(f"{url}/register")
            assert resp.status_code == 405
            assert "error" in resp.json()
            # The server answers 413 before reading the whole body. httpx's async client then
            # leaves its body generator unfinished (a ResourceWarning when collected), so the
            # oversized post goes through the sync client in a thread.
            resp = await trio.to_thread.run_sync(
                lambda: httpx.post(f"{url}/register", content=b" " * (1 << 20), trust_env=False)
            )
            assert resp.status_code == 413
            assert "error" in resp.json()


async def test_registration_logs_one_line_and_hypercorn_is_quiet(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.INFO)
    with trio.fail_after(10):
        async with running_bootstrap() as url, open_bootstrap_client() as client:
            await client.register(url, worker(), timeout=5)
            await client.query(url, timeout=5)
    registrations = [r for r in caplog.records if "dp=0 tp=0 pp=0" in r.getMessage()]
    assert len(registrations) == 1
    assert registrations[0].name == "pdactors.bootstrap"
    assert "prefill-0" in registrations[0].getMessage()
    noisy = [r for r in caplog.records if r.levelno >= logging.INFO and "pdactors" not in r.name]
    noisy = [r for r in noisy if r.name != "httpx"]  # the client library's own request log
    assert noisy == []


async def test_bind_failure_is_an_oserror() -> None:
    with trio.fail_after(10):
        async with running_bootstrap() as url:
            port = int(url.rsplit(":", 1)[1])
            async with trio.open_nursery() as nursery:
                with pytest.raises(OSError, match="in use") as info:
                    await nursery.start(serve_bootstrap, BootstrapConfig(port=port))
            assert info.value.__notes__ == [f"binding the bootstrap registry to 127.0.0.1:{port}"]


async def test_reported_url_is_the_bound_one() -> None:
    port = free_port()
    with trio.fail_after(10):
        async with trio.open_nursery() as nursery:
            url = await nursery.start(serve_bootstrap, BootstrapConfig(host="0.0.0.0", port=port))
            assert url == f"http://127.0.0.1:{port}"
            async with open_bootstrap_client() as client:
                assert await client.query(url, timeout=5) == {}
            nursery.cancel_scope.cancel()


# --------------------------------------------------------------------------- garbage (hypothesis)

_json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner),
    max_leaves=12,
)
_bad_field_values: dict[str, st.SearchStrategy[Any]] = {
    "engine_id": st.one_of(
        st.none(), st.integers(), st.booleans(), st.just(""), st.lists(st.text())
    ),
    "addr": st.one_of(
        st.none(), st.integers(), st.text().filter(lambda s: not s.startswith("tcp://"))
    ),
    **{
        rank: st.one_of(
            st.none(),
            st.booleans(),
            st.text(),
            st.floats(),
            st.integers(max_value=-1),
            st.lists(st.integers()),
        )
        for rank in ("dp_rank", "tp_rank", "pp_rank")
    },
}
_wrong_field = st.sampled_from(sorted(VALID)).flatmap(
    lambda key: _bad_field_values[key].map(lambda bad: {**VALID, key: bad})
)
_missing_field = st.sampled_from(sorted(VALID)).map(_without)
_extra_field = st.tuples(st.text().filter(lambda k: k not in VALID), _json_values).map(
    lambda kv: {**VALID, kv[0]: kv[1]}
)
_garbage = st.one_of(
    st.binary(max_size=300),
    _json_values.map(lambda v: json.dumps(v).encode()),
    st.one_of(_wrong_field, _missing_field, _extra_field).map(lambda d: json.dumps(d).encode()),
    st.integers(0, len(json.dumps(VALID)) - 1).map(lambda n: json.dumps(VALID).encode()[:n]),
)


def _throw_garbage(url: str) -> list[int]:
    """Post hypothesis' garbage at ``url``/register from this (worker) thread; return statuses."""
    statuses: list[int] = []
    with httpx.Client(trust_env=False, timeout=5) as http:

        @settings(max_examples=60, deadline=None, database=None)
        @given(body=_garbage)
        def post_garbage(body: bytes) -> None:
            resp = http.post(f"{url}/register", content=body)
            statuses.append(resp.status_code)
            assert resp.status_code == 400, (body, resp.text)
            assert isinstance(resp.json()["error"], str)

        post_garbage()
    return statuses


async def test_garbage_never_hurts_the_server() -> None:
    with trio.fail_after(10):
        async with running_bootstrap() as url, open_bootstrap_client() as client:
            # The hypothesis engine is synchronous: run it in a thread while the server runs here.
            statuses = await trio.to_thread.run_sync(_throw_garbage, url, abandon_on_cancel=True)
            assert statuses
            assert set(statuses) == {400}
            assert await client.query(url, timeout=5) == {}
            await client.register(url, worker(), timeout=5)
            assert await client.query(url, timeout=5) == {
                0: BootstrapEntry("prefill-0", {0: {0: "tcp://127.0.0.1:5555"}})
            }


# --------------------------------------------------------------------------- client


async def test_register_with_nothing_listening_raises_within_timeout() -> None:
    url = f"http://127.0.0.1:{free_port()}"
    with trio.fail_after(10):
        async with open_bootstrap_client() as client:
            start = trio.current_time()
            with pytest.raises(BootstrapError) as info:
                await client.register(url, worker(), timeout=0.5)
            elapsed = trio.current_time() - start
    assert 0.5 <= elapsed < 1.5
    assert url in str(info.value)
    assert "ConnectError" in str(info.value)


async def test_query_with_nothing_listening_raises_within_timeout() -> None:
    url = f"http://127.0.0.1:{free_port()}"
    with trio.fail_after(10):
        async with open_bootstrap_client() as client:
            with pytest.raises(BootstrapError, match=url):
                await client.query(url, timeout=0.3)


async def test_register_retries_until_the_server_comes_up(
    mock_clock: trio.testing.MockClock,
) -> None:
    """On the autojump clock (tests/conftest.py): the client's back-offs pass at once."""
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    with trio.fail_after(10):
        async with open_bootstrap_client() as client, trio.open_nursery() as nursery:
            registered = trio.Event()

            async def register() -> None:
                await client.register(url, worker(), timeout=5)
                registered.set()

            nursery.start_soon(register)
            await trio.sleep(1)  # the test's clock: a few tries refused, each backed off
            assert not registered.is_set()
            await nursery.start(serve_bootstrap, BootstrapConfig(port=port))
            await registered.wait()
            assert list(await client.query(url, timeout=5)) == [0]
            nursery.cancel_scope.cancel()


def _mock_client(handler: Any) -> BootstrapClient:
    return BootstrapClient(httpx.AsyncClient(transport=httpx.MockTransport(handler)))


async def test_register_backs_off_exponentially_then_gives_up(autojump_clock: Any) -> None:
    calls: list[float] = []

    def unavailable(request: httpx.Request) -> httpx.Response:
        calls.append(trio.current_time())
        return httpx.Response(503, text="starting")

    with trio.fail_after(10):
        start = trio.current_time()
        with pytest.raises(BootstrapError, match="HTTP 503: starting") as info:
            await _mock_client(unavailable).register("http://boot", worker(), timeout=3.0)
        assert trio.current_time() - start == pytest.approx(3.0)
    gaps = [round(b - a, 6) for a, b in itertools.pairwise(calls)]
    assert gaps == [0.05, 0.1, 0.2, 0.4, 0.8, 1.0]
    assert "http://boot" in str(info.value)


async def test_register_refused_fails_at_once(autojump_clock: Any) -> None:
    calls = 0

    def refuse(request: httpx.Request) -> httpx.Response:
        nonlocal calls
        calls += 1
        assert msgspec.json.decode(request.content, type=RegisterWorker) == worker()
        return httpx.Response(400, json={"error": "nope"})

    with trio.fail_after(10):
        with pytest.raises(BootstrapError, match="HTTP 400"):
            await _mock_client(refuse).register("http://boot", worker(), timeout=30)
    assert calls == 1


@pytest.mark.parametrize(
    "response",
    [
        httpx.Response(500, text="boom"),
        httpx.Response(404, text="no such route"),
        httpx.Response(200, content=b"not json"),
        httpx.Response(200, json=[1, 2]),
        httpx.Response(200, json={"0": {"engine_id": "e"}}),
        httpx.Response(200, json={"zero": {"engine_id": "e", "worker_addr": {}}}),
    ],
    ids=["500", "404", "not-json", "array", "missing-field", "non-int-key"],
)
async def test_query_bad_answers_raise(response: httpx.Response) -> None:
    with trio.fail_after(10):
        with pytest.raises(BootstrapError, match="http://boot"):
            await _mock_client(lambda request: response).query("http://boot", timeout=5)


# --------------------------------------------------------------------------- leases


def test_a_lease_lapses_unless_renewed_and_an_unleased_entry_stays() -> None:
    reg = BootstrapRegistry()
    assert reg.register(worker("leased", dp=0), now=0.0, lease=5.0) == "added"
    assert reg.register(worker("forever", dp=1, port=6000), now=0.0) == "added"
    assert reg.register(worker("leased", dp=0), now=4.0, lease=5.0) == "unchanged"  # renewal
    assert set(reg.answer(now=8.9)) == {0, 1}
    assert set(reg.answer(now=9.0)) == {1}  # 5 s after the last renewal: gone
    assert reg.expire(now=1e9) == []  # already gone; the unleased entry never lapses
    assert reg.answer(now=1e9) == {1: BootstrapEntry("forever", {0: {0: "tcp://127.0.0.1:6000"}})}


def test_expire_says_who_went() -> None:
    reg = BootstrapRegistry()
    reg.register(worker("p", tp=0), now=0.0, lease=1.0)
    reg.register(worker("p", tp=1, port=5556), now=0.5, lease=1.0)
    assert reg.expire(now=1.0) == ["'p' dp=0 tp=0 pp=0 at 'tcp://127.0.0.1:5555'"]
    assert reg.answer(now=1.0) == {0: BootstrapEntry("p", {1: {0: "tcp://127.0.0.1:5556"}})}


@pytest.mark.parametrize("lease", ["0", "-1", "abc", "1e9", "nan"])
async def test_a_bad_lease_gets_400_and_registers_nothing(lease: str) -> None:
    with trio.fail_after(10):
        async with running_bootstrap() as url, raw_http() as http:
            resp = await http.post(f"{url}/register", params={"lease": lease}, json=VALID)
            assert resp.status_code == 400 and "lease" in resp.json()["error"]
            assert (await http.get(f"{url}/query")).json() == {}


async def test_a_foreign_registration_cannot_take_a_renewing_senders_rank() -> None:
    """Before leases were their holder's, a bogus registration took P's rank until P's next
    renewal put it back; now it is refused (409) and P's entry never leaves."""
    from pdactors.actors.sender import serve_sender
    from pdactors.config import DataPlaneConfig, SenderConfig
    from pdactors.dataplane import open_mooncake
    from pdactors.errors import RankHeld
    from pdactors.testing import KVBuffer

    with trio.fail_after(30):
        async with running_bootstrap() as url, open_bootstrap_client() as client:
            config = SenderConfig(engine_id="real-p", bootstrap_url=url, lease_interval=0.2)
            async with open_mooncake(DataPlaneConfig()) as plane, trio.open_nursery() as nursery:
                kv = KVBuffer(1, 4, 64)
                plane.register(kv.regions)
                sender = await nursery.start(serve_sender, config, plane, kv.layout)
                # someone registers another engine on P's DP rank (as upstream tools do)
                bogus = RegisterWorker("bogus", 0, 0, 0, "tcp://x:1")
                with pytest.raises(RankHeld, match=r"dp=0 tp=0 pp=0 .* held by 'tcp://"):
                    await client.register(url, bogus, timeout=5)
                entry = (await client.query(url, timeout=5))[0]
                assert entry.engine_id == "real-p"
                assert entry.worker_addr == {0: {0: sender.address}}
                assert entry.epochs == {0: {0: sender.epoch}}
                nursery.cancel_scope.cancel()
            # P is gone: its lease lapses (5 s) and it leaves /query by itself
            while await client.query(url, timeout=5):
                await trio.sleep(0.2)


def test_next_expiry_skips_renewed_and_replaced_leases() -> None:
    reg = BootstrapRegistry()
    assert reg.next_expiry() is None
    reg.register(worker("forever", dp=1, port=6000), now=0.0)
    assert reg.next_expiry() is None  # an unleased entry never lapses
    p0 = msgspec.structs.replace(worker("p", tp=0), epoch=1)
    reg.register(p0, now=0.0, lease=5.0)
    reg.register(worker("p", tp=1, port=5556), now=1.0, lease=5.0)
    assert reg.next_expiry() == 5.0
    reg.register(p0, now=3.0, lease=5.0)  # renewed: its old time is stale
    assert reg.next_expiry() == 6.0
    reg.register(worker("p", tp=1, port=5556), now=4.0)  # its lease given up: stale too
    # a new engine on dp 0, displacing p's one leased worker by its epoch: p's are gone
    q = msgspec.structs.replace(worker("q", tp=0), epoch=2, replaces=1)
    assert reg.register(q, now=4.0, lease=1.0) == "engine_replaced"
    assert reg.next_expiry() == 5.0
    assert reg.expire(now=5.0) == ["'q' dp=0 tp=0 pp=0 at 'tcp://127.0.0.1:5555'"]
    assert reg.next_expiry() is None


class _Lapses(logging.Handler):
    """Each "lease lapsed" line, with the trio time it was logged at."""

    def __init__(self) -> None:
        super().__init__()
        self.seen: list[tuple[float, str]] = []
        self.changed = trio.Event()

    def emit(self, record: logging.LogRecord) -> None:
        if "lease lapsed" in record.getMessage():
            self.seen.append((trio.current_time(), record.getMessage()))
            self.changed.set()
            self.changed = trio.Event()


async def test_the_expiry_task_sleeps_until_the_next_lease_lapses(autojump_clock: Any) -> None:
    from pdactors.actors.bootstrap import _Expiry

    reg = BootstrapRegistry()
    expiry = _Expiry(reg)
    wakes = 0
    expire = reg.expire

    def counted(now: float) -> list[str]:
        nonlocal wakes
        wakes += 1
        return expire(now)

    reg.expire = counted  # type: ignore[method-assign]
    lapses = _Lapses()
    logger = logging.getLogger("pdactors.bootstrap")
    logger.addHandler(lapses)
    try:
        async with trio.open_nursery() as nursery:
            start = trio.current_time()
            reg.register(worker("late", dp=0), now=start, lease=100.0)
            nursery.start_soon(expiry.serve)
            await trio.testing.wait_all_tasks_blocked()
            # A registration with an earlier expiry re-arms the sleeping task.
            reg.register(worker("early", dp=1, port=6000), now=start, lease=1.0)
            expiry.leased_until(start + 1.0)
            wakes = 0  # (each registration expires what lapsed too)
            await lapses.changed.wait()
            await lapses.changed.wait()
            nursery.cancel_scope.cancel()
    finally:
        logger.removeHandler(lapses)
    lapsed = [(t - start, m.split("'")[1]) for t, m in lapses.seen]
    assert lapsed == [(1.0, "early"), (100.0, "late")]
    # Woken for each lapse only: a fixed tick would have woken hundreds of times in 100 s.
    assert wakes == 2
