"""D's fast completion path (issue 28 item 1, "C"): P's notice that a pull's KV landed, read
by a thread of D's, reports the pull once, only while its latch is open, and never makes the
pull's later end in Trio a second report.

First :class:`LandedNotices` alone, fed by a real UDP socket on 127.0.0.1; then the receiver,
with P played by the test on the in-memory side channel and the notice sent for real.
"""

from __future__ import annotations

import socket
import threading
from collections.abc import AsyncIterator, Callable, Iterator
from contextlib import asynccontextmanager, contextmanager
from types import SimpleNamespace
from typing import Any, cast

import pytest
import trio

from pdactors import Liveness, PullResults, ReceiverConfig
from pdactors.actors._done_notices import notice_address
from pdactors.actors._landed_notices import (
    LandedNotices,
    open_latches,
    session_host,
)
from pdactors.actors.receiver import Receiver
from pdactors.bootstrap_client import BootstrapClient
from pdactors.dataplane import DataPlane
from pdactors.transport import ZMQ, MemoryTransport
from pdactors.transport.base import Router
from pdactors.wire import (
    CancelPull,
    Msg,
    PullDone,
    PullFailed,
    PullRequest,
    decode_frames,
    encode_frames,
)
from tests.test_done_notices import HookedSide
from tests.test_receiver import LAYOUT, _Bootstrap

WAIT = 5.0  # seconds: every wait for the other thread or socket is bounded by it


def token_bytes(token: int) -> bytes:
    return token.to_bytes(8, "little")


class Pusher:
    """P's side of the notice: a UDP socket sending datagrams to one ``udp://ip:port``."""

    def __init__(self, address: str) -> None:
        target = notice_address(address)
        assert target is not None, address
        self.target = target
        self.socket = socket.socket(target.family, socket.SOCK_DGRAM)

    def send(self, datagram: bytes) -> None:
        assert self.socket.sendto(datagram, self.target.sockaddr) == len(datagram)


@contextmanager
def pusher(address: str) -> Iterator[Pusher]:
    made = Pusher(address)
    try:
        yield made
    finally:
        made.socket.close()


class Calls:
    """An ``on_landed`` that counts its calls and can be waited for."""

    def __init__(self) -> None:
        self.count = 0
        self.event = threading.Event()

    def __call__(self) -> None:
        self.count += 1
        self.event.set()

    def wait(self) -> None:
        assert self.event.wait(WAIT), "on_landed was not called in time"


def sentinel(notices: LandedNotices, push: Pusher) -> None:
    """Send a notice for a fresh latch and wait for it: every notice sent before it from
    ``push`` has been read (on loopback, one socket's datagrams to another arrive in order)."""
    last = Calls()
    token = notices.open_latch(last)
    push.send(token_bytes(token))
    last.wait()
    assert notices.close_latch(token)


@pytest.fixture
def notices() -> Iterator[LandedNotices]:
    with LandedNotices("127.0.0.1") as notices:
        yield notices


def test_a_token_completes_its_latch_once(notices: LandedNotices) -> None:
    assert notices.address.startswith("udp://127.0.0.1:")
    calls = Calls()
    token = notices.open_latch(calls)
    assert token != 0
    with pusher(notices.address) as push:
        push.send(token_bytes(token))
        push.send(token_bytes(token))  # repeated
        sentinel(notices, push)
    assert calls.count == 1
    assert notices.close_latch(token)  # the thread had completed it
    assert not notices.close_latch(token)  # ... and this closed it for good
    stats = notices.statistics()
    assert (stats.landed_early, stats.ignored, stats.malformed, stats.open) == (2, 1, 0, 0)


def test_an_ipv6_host_gets_a_bracketed_address() -> None:
    try:
        notices = LandedNotices("::1")
    except OSError as exc:
        pytest.skip(f"cannot bind ::1: {exc}")
    with notices:
        assert notices.address.startswith("udp://[::1]:")
        calls = Calls()
        token = notices.open_latch(calls)
        with pusher(notices.address) as push:
            push.send(token_bytes(token))
            calls.wait()
        assert notices.close_latch(token)


def test_forged_and_malformed_notices_change_nothing_but_counters(
    notices: LandedNotices,
) -> None:
    calls = Calls()
    token = notices.open_latch(calls)
    forged = token ^ 1
    with pusher(notices.address) as push, pusher(notices.address) as big:
        big.send(token_bytes(token) + b"x" * 992)  # 1,000 bytes: read cut short, malformed
        sentinel(notices, big)  # ... and the thread lives on
        push.send(token_bytes(forged))
        push.send(token_bytes(0))
        push.send(b"short")
        push.send(b"")
        push.send(b"nine bytes")
        push.send(token_bytes(token) * 2)  # two tokens in one datagram
        sentinel(notices, push)
    assert calls.count == 0
    stats = notices.statistics()
    assert (stats.landed_early, stats.ignored, stats.malformed, stats.open) == (2, 2, 5, 1)
    assert not notices.close_latch(token)  # still open: nothing completed it


def test_a_latch_closed_first_never_calls_on_landed(notices: LandedNotices) -> None:
    calls = Calls()
    token = notices.open_latch(calls)
    assert not notices.close_latch(token)
    with pusher(notices.address) as push:
        push.send(token_bytes(token))  # late: the pull ended, was aborted, or P was lost
        sentinel(notices, push)
    assert calls.count == 0
    assert notices.statistics().ignored == 1


def test_the_thread_decides_once_it_took_the_latch(notices: LandedNotices) -> None:
    """The notice and the close race: the thread took the latch first, so the close says so
    even while ``on_landed`` is still running, and nothing is reported twice."""
    entered, release = threading.Event(), threading.Event()

    def on_landed() -> None:
        entered.set()
        assert release.wait(WAIT)

    token = notices.open_latch(on_landed)
    with pusher(notices.address) as push:
        push.send(token_bytes(token))
        assert entered.wait(WAIT)
        assert notices.close_latch(token)  # the pull was reported: Trio only cleans up
        release.set()
        sentinel(notices, push)


def test_a_failing_on_landed_is_logged_and_the_thread_goes_on(
    notices: LandedNotices, caplog: pytest.LogCaptureFixture
) -> None:
    def on_landed() -> None:
        raise RuntimeError("the engine's bug")

    token = notices.open_latch(on_landed)
    with pusher(notices.address) as push:
        push.send(token_bytes(token))
        sentinel(notices, push)  # read after the failing one: the thread lives
    assert notices.close_latch(token)
    assert "the engine's bug" in caplog.text


def test_close_stops_the_thread_and_frees_the_port() -> None:
    notices = LandedNotices("127.0.0.1")
    thread = notices._thread
    notices.close()
    assert not thread.is_alive()
    notices.close()  # again: nothing
    target = notice_address(notices.address)
    assert target is not None
    with socket.socket(target.family, socket.SOCK_DGRAM) as sock:
        sock.bind(target.sockaddr)  # the port was closed with the thread's socket


def test_close_stops_the_thread_behind_a_full_receive_buffer() -> None:
    """The wake-up datagram of ``close`` is lost when the socket's buffer is full (here: a
    flood while ``on_landed`` holds the thread); the thread still stops, at the first datagram
    it takes after ``close`` began, and ``close`` returns once it has."""
    entered, release = threading.Event(), threading.Event()

    def on_landed() -> None:
        entered.set()
        assert release.wait(WAIT)

    notices = LandedNotices("127.0.0.1")
    thread = notices._thread
    token = notices.open_latch(on_landed)
    with pusher(notices.address) as push:
        push.send(token_bytes(token))
        assert entered.wait(WAIT)
        for _ in range(5000):  # far beyond a default receive buffer of small datagrams
            push.send(b"flooding")
    closer = threading.Thread(target=notices.close)
    closer.start()
    release.set()
    closer.join(WAIT)
    assert not closer.is_alive() and not thread.is_alive()
    assert notices.statistics().malformed < 5000  # it stopped reading the flood


def test_sessions_name_their_host() -> None:
    assert session_host("127.0.0.1:15000") == "127.0.0.1"
    assert session_host("[::1]:15000") == "::1"
    assert session_host("node-3.cluster:15000") == "node-3.cluster"


def test_no_notices_without_the_fast_path_or_an_address_to_bind(
    caplog: pytest.LogCaptureFixture,
) -> None:
    with open_latches(ReceiverConfig(verify_kv="on"), "127.0.0.1:1") as latches:
        assert latches.notices is None  # P's sums are checked in Trio first
    with open_latches(ReceiverConfig(verify_kv="off", fast_done=False), "127.0.0.1:1") as latches:
        assert latches.notices is None
    with open_latches(ReceiverConfig(verify_kv="off"), "192.0.2.1:1") as latches:
        assert latches.notices is None  # not an address of this machine
    assert "no fast completion path" in caplog.text
    with open_latches(ReceiverConfig(verify_kv="off"), "127.0.0.1:1") as latches:
        assert latches.notices is not None
        thread = latches.notices._thread
    assert not thread.is_alive()


# ---------------------------------------------------------------------- through the receiver

FAST = ReceiverConfig(verify_kv="off", liveness=Liveness(connect_timeout=1e6))


@asynccontextmanager
async def open_receiver(
    memory: MemoryTransport, config: ReceiverConfig = FAST
) -> AsyncIterator[Receiver]:
    """A receiver whose P (``p1``, at ``tcp://p:1`` of ``memory``) the test plays."""
    plane = cast(DataPlane, SimpleNamespace(session="127.0.0.1:1"))
    client = cast(BootstrapClient, _Bootstrap())
    with open_latches(config, plane.session) as latches:
        async with trio.open_nursery() as nursery:
            receiver = Receiver(config, plane, LAYOUT, client, nursery, memory, None, latches)
            nursery.start_soon(receiver._serve_deadlines)
            yield receiver
            nursery.cancel_scope.cancel()


class Landed:
    """The engine's ``on_landed`` for one pull, awaitable from Trio."""

    def __init__(self) -> None:
        self.calls = Calls()

    async def wait(self) -> None:
        assert await trio.to_thread.run_sync(self.calls.event.wait, WAIT)


async def pull_at_p(
    receiver: Receiver, router: Router, tid: str, on_landed: Callable[[], None] | None
) -> tuple[bytes, PullRequest]:
    """Start ``tid``; the request as P receives it, and from whom."""
    receiver.start_pull(
        tid, bootstrap_url="http://b1", engine_id="p1", block_ids=[0, 1], on_landed=on_landed
    )
    with trio.fail_after(WAIT):
        identity, frames = await router.receive()
    request = decode_frames(frames)
    assert isinstance(request, PullRequest)
    return identity, request


async def notify(request: PullRequest, token: int | None = None) -> None:
    """P's write thread: the pull landed whole."""

    def send() -> None:
        with pusher(request.done_to) as push:
            push.send(token_bytes(request.done_token if token is None else token))

    await trio.to_thread.run_sync(send)


async def results(receiver: Receiver) -> tuple[set[str], dict[str, str], set[str]]:
    with trio.fail_after(WAIT):
        r = await receiver.wait_results()
    return set(r.finished), r.failed, set(r.early)


async def wait_read(receiver: Receiver, what: str, n: int) -> None:
    """Until the notices thread counted ``n`` of ``what`` (ignored, malformed...)."""
    with trio.fail_after(WAIT):
        while getattr(receiver.landed_notice_statistics(), what) < n:
            await trio.sleep(0.005)


async def test_a_notice_before_p_answers_reports_the_pull_once() -> None:
    memory = MemoryTransport()
    async with memory.open_router("p", 1) as router, open_receiver(memory) as receiver:
        landed = Landed()
        identity, request = await pull_at_p(receiver, router, "t", landed.calls)
        assert request.done_to.startswith("udp://127.0.0.1:") and request.done_token
        await notify(request)
        await landed.wait()
        assert receiver.in_flight == 1  # Trio has not heard of it yet
        await router.send(identity, encode_frames(PullDone("t", nbytes=8)))
        assert await results(receiver) == (set(), {}, {"t"})  # no second delivery
        assert landed.calls.count == 1
        assert receiver.pull_statistics().count == 1
        stats = receiver.landed_notice_statistics()
        assert stats is not None and (stats.landed_early, stats.open) == (1, 0)


async def test_pulls_that_verify_or_have_no_callback_ask_for_no_notice() -> None:
    memory = MemoryTransport()
    checked = ReceiverConfig(verify_kv="on", liveness=Liveness(connect_timeout=1e6))
    async with memory.open_router("p", 1) as router, open_receiver(memory, checked) as receiver:
        _, request = await pull_at_p(receiver, router, "t", Landed().calls)
        assert (request.done_to, request.done_token) == ("", 0)
        assert receiver.landed_notice_statistics() is None
    async with memory.open_router("p", 1) as router, open_receiver(memory) as receiver:
        _, request = await pull_at_p(receiver, router, "t", None)
        assert (request.done_to, request.done_token) == ("", 0)


async def test_an_abort_after_the_notice_reports_no_failure_and_keeps_the_blocks() -> None:
    memory = MemoryTransport()
    async with memory.open_router("p", 1) as router, open_receiver(memory) as receiver:
        landed = Landed()
        identity, request = await pull_at_p(receiver, router, "t", landed.calls)
        await notify(request)
        await landed.wait()
        receiver.abort("t", "the request was aborted on D")
        with trio.fail_after(WAIT):
            _, frames = await router.receive()
        assert isinstance(decode_frames(frames), CancelPull)  # P is told, as for any abort
        assert receiver.in_flight == 1  # D's blocks wait for P's word, as the table says
        await router.send(identity, encode_frames(PullDone("t")))
        with trio.fail_after(WAIT):
            await receiver.wait_ended("t")
        assert await results(receiver) == (set(), {}, {"t"})
        assert landed.calls.count == 1


async def test_an_abort_before_the_notice_fails_the_pull_and_the_notice_is_ignored() -> None:
    memory = MemoryTransport()
    async with memory.open_router("p", 1) as router, open_receiver(memory) as receiver:
        landed = Landed()
        identity, request = await pull_at_p(receiver, router, "t", landed.calls)
        receiver.abort("t", "the request was aborted on D")
        await notify(request)  # P's write ended after D gave up: too late to count
        await wait_read(receiver, "ignored", 1)
        await router.send(identity, encode_frames(PullFailed("t", "cancelled by D")))
        finished, failed, early = await results(receiver)
        assert (finished, early) == (set(), set())
        assert "aborted on D" in failed["t"]
        assert landed.calls.count == 0


async def test_p_lost_after_the_notice_is_no_failure() -> None:
    memory = MemoryTransport()
    async with open_receiver(memory) as receiver:
        landed = Landed()
        async with memory.open_router("p", 1) as router:
            _, request = await pull_at_p(receiver, router, "t", landed.calls)
            await notify(request)
            await landed.wait()
        # P's side channel closed before its PullDone: the KV is there all the same.
        assert await results(receiver) == (set(), {}, {"t"})


async def test_without_a_notice_p_answer_delivers_as_before() -> None:
    memory = MemoryTransport()
    async with memory.open_router("p", 1) as router, open_receiver(memory) as receiver:
        landed = Landed()
        identity, request = await pull_at_p(receiver, router, "t", landed.calls)
        await router.send(identity, encode_frames(PullDone("t")))  # an older P: no notice
        assert await results(receiver) == ({"t"}, {}, set())
        await notify(request)  # a late notice after the pull ended: nothing
        await wait_read(receiver, "ignored", 1)
        assert landed.calls.count == 0
        assert receiver.take_results() == PullResults(frozenset(), {})


async def test_a_forged_token_changes_nothing() -> None:
    memory = MemoryTransport()
    async with memory.open_router("p", 1) as router, open_receiver(memory) as receiver:
        landed = Landed()
        identity, request = await pull_at_p(receiver, router, "t", landed.calls)
        await notify(request, token=request.done_token ^ (1 << 63))
        await wait_read(receiver, "ignored", 1)
        assert landed.calls.count == 0 and receiver.in_flight == 1
        await router.send(identity, encode_frames(PullDone("t")))
        assert await results(receiver) == ({"t"}, {}, set())


# ------------------------------------------------- both halves: a real P, a real D


class _HeldDone(HookedSide):
    """D's side channel (real ZMQ), holding P's ``PullDone`` for the transfers in ``hold``
    until their notice was heard (``heard``, set by ``on_landed`` in D's notices thread): the
    notice and the side channel race, and the test needs the notice to come first."""

    def __init__(self) -> None:
        self.hold: dict[str, threading.Event] = {}

    async def incoming(self, msg: Msg) -> None:
        if isinstance(msg, PullDone) and (heard := self.hold.get(msg.transfer_id)) is not None:
            assert await trio.to_thread.run_sync(heard.wait, WAIT), "no notice came"


async def test_a_real_p_and_d_report_the_kv_landed_from_ps_write_thread() -> None:
    """P's half and D's together, through real Mooncake TCP, real ZMQ and real UDP: a pull with
    a callback (``verify_kv`` off) is reported landed by D's notices thread, once, with every
    byte of it in D's blocks already, and comes back in ``early`` only; a pull without one goes
    as before. (P's ``PullDone`` is held at D until the notice was heard: they race.)"""
    from pdactors.testing import open_cluster

    reported: list[tuple[str, int, bool]] = []
    side = _HeldDone()

    def transport(role: str, engine: int) -> Any:
        return side if role == "decode" else ZMQ

    async with open_cluster(
        layers=4, num_blocks=64, block_bytes=4096, receiver=ReceiverConfig(verify_kv="off"),
        transport=transport,
    ) as cluster:  # fmt: skip
        p, d = cluster.prefill[0], cluster.decode[0]

        async def pull(tid: str, *, callback: bool) -> PullResults:
            src = p.owned[tid] = p.pool.allocate(8)  # freed once P's sender released it
            p.kv.fill(tid, src)
            p.sender.transfer_pending(tid)
            p.sender.transfer_ready(tid, src)
            dst = d.pool.allocate(8)
            heard = threading.Event()

            def landed() -> None:  # in D's notices thread: P's write has returned
                reported.append((tid, threading.get_ident(), d.kv.verify(tid, dst, 8)))
                heard.set()

            if callback:
                side.hold[tid] = heard
            d.receiver.start_pull(
                tid, bootstrap_url=cluster.bootstrap_url, engine_id=p.engine_id, block_ids=dst,
                on_landed=landed if callback else None,
            )  # fmt: skip
            with trio.fail_after(10):
                results = await d.receiver.wait_results()
            assert d.kv.verify(tid, dst, 8)
            d.pool.free(dst)
            return results

        fast = await pull("fast", callback=True)
        assert fast == PullResults(frozenset(), {}, early=frozenset({"fast"}))
        assert [(tid, ok) for tid, _, ok in reported] == [("fast", True)]
        assert reported[0][1] != threading.get_ident()
        stats = d.receiver.landed_notice_statistics()
        assert stats is not None and stats.landed_early == 1
        assert p.sender.side_channel_statistics().notices_sent == 1

        plain = await pull("plain", callback=False)
        assert plain == PullResults(frozenset({"plain"}), {})
        assert len(reported) == 1
        assert p.sender.side_channel_statistics().notices_sent == 1
        await cluster.wait_settled()
