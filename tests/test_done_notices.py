"""P's half of D's fast completion path (issue 28 item 1): the write thread that landed a pull's
last bytes sends the pull's ``done_token`` as one UDP datagram to its ``done_to``, before the
side channel's ``PullDone``, which still follows and stays the authority.

The :class:`DoneNotices` unit tests use a UDP socket bound on 127.0.0.1; the actor tests run a
real sender and receiver (real ZMQ, real Mooncake TCP) whose D side channel is wrapped to put
``done_to`` / ``done_token`` into each ``PullRequest`` it sends (D's own half is tested in
tests/test_landed_notices.py).
"""

from __future__ import annotations

import select
import socket
import threading
from collections.abc import AsyncIterator, Iterator, Sequence
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from typing import Any

import msgspec
import pytest
import trio

from pdactors import Liveness, PullFailedError
from pdactors.actors._done_notices import DoneNotices, NoticeAddress, notice_address
from pdactors.testing import Cluster, FaultyDataPlane, open_cluster, run_transfer
from pdactors.transport import ZMQ, Dealer, Router
from pdactors.wire import Msg, PullRequest, decode_frames, encode_frames
from tests.conftest import settled, wait_until

SMALL = {"layers": 4, "num_blocks": 64, "block_bytes": 4096}
TIMEOUT = 5.0


# ---------------------------------------------------------------------- D's UDP socket


class Inbox:
    """D's UDP socket, bound on 127.0.0.1 (``host``, ``family``: another loopback)."""

    def __init__(self, host: str = "127.0.0.1", family: socket.AddressFamily = socket.AF_INET):
        self.socket = socket.socket(family, socket.SOCK_DGRAM)
        try:
            self.socket.bind((host, 0))
        except OSError:
            self.socket.close()
            raise
        self.socket.setblocking(False)
        port = self.socket.getsockname()[1]
        self.address = (
            f"udp://{host}:{port}" if family == socket.AF_INET else f"udp://[{host}]:{port}"
        )
        self.target = notice_address(self.address)
        assert self.target is not None

    def tokens(self, within: float = TIMEOUT, *, count: int = 1) -> list[int]:
        """Up to ``count`` tokens, each waited for at most ``within`` seconds (blocking: for
        tests without actors)."""
        got: list[int] = []
        while len(got) < count and select.select([self.socket], [], [], within)[0]:
            got.append(self._token())
        return got

    async def wait_tokens(self, within: float = TIMEOUT, *, count: int = 1) -> list[int]:
        """Up to ``count`` tokens, waiting at most ``within`` seconds in all (checkpoints: the
        actors run meanwhile)."""
        got: list[int] = []
        with trio.move_on_after(within):
            while len(got) < count:
                if select.select([self.socket], [], [], 0)[0]:
                    got.append(self._token())
                else:
                    await trio.sleep(0.002)
        return got

    def _token(self) -> int:
        datagram = self.socket.recv(64)
        assert len(datagram) == 8
        return int.from_bytes(datagram, "little")

    def close(self) -> None:
        self.socket.close()


@pytest.fixture
def inbox() -> Iterator[Inbox]:
    made = Inbox()
    try:
        yield made
    finally:
        made.close()


def _pull(done_to: str, token: int = 7, tid: str = "t") -> PullRequest:
    return PullRequest(tid, "127.0.0.1:1", 0, 1, 0, 1, ((0,),), "l", done_to=done_to,
                       done_token=token)  # fmt: skip


def _closed_port() -> NoticeAddress:
    """A loopback UDP port nobody listens on (bound, then closed)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return NoticeAddress(socket.AF_INET, sock.getsockname())


# ---------------------------------------------------------------------- DoneNotices


@pytest.mark.parametrize(
    ("address", "ok"),
    [
        ("udp://127.0.0.1:5555", True),
        ("udp://10.1.2.3:65535", True),
        ("udp://[::1]:7", True),
        ("udp://nohost:1", False),  # names are never looked up (a worker thread sends)
        ("udp://d-worker.example:5", False),
        ("tcp://127.0.0.1:5555", False),
        ("udp://127.0.0.1:0", False),
        ("udp://127.0.0.1:65536", False),
        ("udp://*:5", False),
        ("udp://127.0.0.1:5555/x", False),
        ("udp://127.0.0.1:5555\n", False),
        (f"udp://{'1' * 600}:5555", False),
        ("udp://999.0.0.1:5", False),
        ("udp://::1:7", False),  # IPv6 only in brackets
        ("udp://[fe80::1%eth0]:7", False),  # no zone ids
        ("udp://:5555", False),
        ("ipc:///x", False),
    ],
)
def test_only_numeric_udp_addresses_get_a_notice(address: str, ok: bool) -> None:
    assert (notice_address(address) is not None) is ok
    notices = DoneNotices()
    try:
        assert (notices.after(_pull(address)) is not None) is ok
        assert notices.statistics().refused == (not ok)
        assert notices.statistics().sockets == 0  # made by the first send only
    finally:
        notices.close()


def test_a_pull_without_done_to_asks_for_nothing() -> None:
    notices = DoneNotices()
    assert notices.after(_pull("")) is None
    assert notices.statistics() == notices.statistics().__class__()
    notices.close()


def test_the_token_arrives_as_8_little_endian_bytes(inbox: Inbox) -> None:
    notices = DoneNotices()
    try:
        after = notices.after(_pull(inbox.address, 2**64 - 2))
        assert after is not None
        after()
        assert inbox.target is not None
        notices.send(inbox.target, 5)
        assert inbox.tokens(count=2) == [2**64 - 2, 5]
        assert notices.statistics().sent == 2 and notices.statistics().sockets == 1
    finally:
        notices.close()


def test_sends_from_many_threads_all_arrive(inbox: Inbox) -> None:
    notices = DoneNotices()
    target = inbox.target
    assert target is not None

    def sends(first: int) -> None:
        for token in range(first, first + 10):
            notices.send(target, token)

    try:
        threads = [threading.Thread(target=sends, args=(i * 10,)) for i in range(8)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(TIMEOUT)
        assert sorted(inbox.tokens(count=80)) == list(range(80))  # (loopback loses none)
        assert notices.statistics() == notices.statistics().__class__(sent=80, sockets=1)
    finally:
        notices.close()


def _ipv6_inbox() -> Inbox:
    if not socket.has_ipv6:
        pytest.skip("no IPv6 in this Python")
    try:
        return Inbox("::1", socket.AF_INET6)
    except OSError as exc:
        pytest.skip(f"cannot bind ::1: {exc}")


def test_each_family_gets_one_socket_and_a_closed_port_never_raises(inbox: Inbox) -> None:
    six = _ipv6_inbox()
    notices = DoneNotices()
    closed = _closed_port()
    try:
        assert inbox.target is not None and six.target is not None
        for token in (1, 2):
            notices.send(inbox.target, token)
            notices.send(six.target, token + 10)
        assert inbox.tokens(count=2) == [1, 2] and six.tokens(count=2) == [11, 12]
        assert set(notices._sockets) == {socket.AF_INET, socket.AF_INET6}
        # Nobody listens there: the kernel answers with ICMP port unreachable, which Linux
        # reports (ECONNREFUSED, on the next send) only to a connected UDP socket; ours is
        # not, so these count as sent there. Whatever comes back, nothing raises.
        for token in range(5):
            notices.send(closed, token)
        notices.send(inbox.target, 3)  # the same socket still works afterwards
        assert inbox.tokens(count=1) == [3]
        stats = notices.statistics()
        assert stats.sent + stats.dropped == 10 and stats.sent >= 5 and stats.sockets == 2
    finally:
        notices.close()
        six.close()


def test_a_failing_send_is_dropped_and_never_raises() -> None:
    notices = DoneNotices()
    try:
        # Not an address a socket of that family takes: the kernel refuses it.
        notices.send(NoticeAddress(socket.AF_INET, ("255.255.255.255", 9)), 1)  # EACCES
        notices.send(NoticeAddress(socket.AF_INET, ("127.0.0.1", 9)), 2**64)  # too big
        assert notices.statistics() == notices.statistics().__class__(dropped=2, sockets=1)
    finally:
        notices.close()


def test_close_closes_every_socket_and_later_sends_do_nothing(inbox: Inbox) -> None:
    notices = DoneNotices()
    assert inbox.target is not None
    notices.send(inbox.target, 1)
    sockets = list(notices._sockets.values())
    notices.close()
    assert all(sock.fileno() == -1 for sock in sockets) and notices.statistics().sockets == 0
    notices.send(inbox.target, 3)
    assert notices.statistics().sent == 1 and notices.statistics().sockets == 0
    assert inbox.tokens(within=0.2, count=2) == [1]
    notices.close()  # twice is fine


# ---------------------------------------------------------------------- through the actors


class HookedSide:
    """D's side channel over real ZMQ, with a hook on each message D's dealers send
    (:meth:`outgoing`, which may replace it) and receive (:meth:`incoming`, awaited before D
    gets it). P's routers are plain."""

    def outgoing(self, msg: Msg) -> Msg:
        return msg

    async def incoming(self, msg: Msg) -> None:
        await trio.lowlevel.checkpoint()

    def open_router(
        self, host: str, port: int = 0, *, liveness: Liveness | None = None
    ) -> AbstractAsyncContextManager[Router]:
        return ZMQ.open_router(host, port, liveness=liveness)

    def open_dealer(
        self, address: str, *, liveness: Liveness | None = None, server_key: str = ""
    ) -> AbstractAsyncContextManager[Dealer]:
        return self._dealer(address, liveness, server_key)

    @asynccontextmanager
    async def _dealer(
        self, address: str, liveness: Liveness | None, server_key: str
    ) -> AsyncIterator[Dealer]:
        async with ZMQ.open_dealer(address, liveness=liveness, server_key=server_key) as inner:
            yield _HookedDealer(inner, self)


class _HookedDealer:
    def __init__(self, inner: Dealer, hooks: HookedSide) -> None:
        self._inner, self._hooks = inner, hooks

    @property
    def address(self) -> str:
        return self._inner.address

    async def receive(self) -> list[bytes]:
        frames = await self._inner.receive()
        await self._hooks.incoming(decode_frames(list(frames)))
        return frames

    async def send(self, frames: Sequence[bytes]) -> None:
        msg = decode_frames(list(frames))
        if (replaced := self._hooks.outgoing(msg)) is not msg:
            frames = encode_frames(replaced)
        await self._inner.send(frames)

    async def wait_lost(self, connect_timeout: float) -> str:
        return await self._inner.wait_lost(connect_timeout)

    async def wait_dead(self) -> str:
        return await self._inner.wait_dead()


class _Asking(HookedSide):
    """D's side channel, with ``done_to`` / ``done_token`` put into each pull it sends:
    ``notices[transfer_id] = (done_to, done_token)``."""

    def __init__(self) -> None:
        self.notices: dict[str, tuple[str, int]] = {}

    def outgoing(self, msg: Msg) -> Msg:
        if isinstance(msg, PullRequest) and msg.transfer_id in self.notices:
            done_to, token = self.notices[msg.transfer_id]
            return msgspec.structs.replace(msg, done_to=done_to, done_token=token)
        return msg


@asynccontextmanager
async def asking_cluster(asking: _Asking, **kwargs: Any) -> AsyncIterator[Cluster]:
    def transport(role: str, engine: int) -> Any:
        return asking if role == "decode" else ZMQ

    async with open_cluster(transport=transport, **SMALL, **kwargs) as cluster:
        yield cluster


async def test_the_token_is_sent_before_pull_done_and_the_kv_is_right(inbox: Inbox) -> None:
    asking = _Asking()
    asking.notices["n1"] = (inbox.address, 0xDEADBEEF)
    with trio.fail_after(30):
        async with asking_cluster(asking) as cluster:
            p = cluster.prefill[0]
            outcome = await run_transfer(cluster, "n1", 8)
            # D's PullDone was processed; the write thread had sent the token before it.
            assert p.sender.side_channel_statistics().notices_sent == 1
            assert outcome.ok and outcome.verified, outcome
            assert await inbox.wait_tokens() == [0xDEADBEEF]
            plain = await run_transfer(cluster, "n2", 3)  # asks for no notice: none sent
            assert plain.ok and plain.verified
            assert p.sender.side_channel_statistics().notices_sent == 1
            assert await inbox.wait_tokens(within=0.1) == []
            await settled(cluster)


async def test_a_streamed_transfer_sends_its_token_once_after_the_last_layer(
    inbox: Inbox,
) -> None:
    asking = _Asking()
    asking.notices["s1"] = (inbox.address, 11)
    with trio.fail_after(30):
        async with asking_cluster(asking) as cluster, trio.open_nursery() as nursery:
            p, d = cluster.prefill[0], cluster.decode[0]
            src, dst = p.pool.allocate(4), d.pool.allocate(4)
            p.owned["s1"] = src
            p.sender.transfer_pending("s1")
            nursery.start_soon(partial_pull(cluster, "s1", dst))
            await wait_until(lambda: p.sender.pulls_waiting("s1") == 1)
            p.sender.transfer_streaming("s1", src)
            p.kv.fill("s1", src)
            for layer in range(3):
                p.sender.layer_ready("s1", [layer])
                await wait_until(lambda layer=layer: landed(cluster, layer, src, dst))  # type: ignore[misc]
                assert await inbox.wait_tokens(within=0.05) == []  # D's pull is not complete yet
            p.sender.layer_ready("s1", [3])  # every layer written: that write completes it
            assert await inbox.wait_tokens() == [11]
            p.sender.transfer_ready("s1", src)
            await wait_until(lambda: d.receiver.in_flight == 0)
            assert d.receiver.take_results().failed == {}
            assert d.kv.verify("s1", dst, 4)
            assert await inbox.wait_tokens(within=0.1) == []  # once
            d.pool.free(dst)
            await settled(cluster)


def landed(cluster: Cluster, layer: int, src: list[int], dst: list[int]) -> bool:
    p, d = cluster.prefill[0], cluster.decode[0]
    return bool((d.kv.data[layer, dst, :] == p.kv.data[layer, src, :]).all())


def partial_pull(cluster: Cluster, tid: str, dst: list[int]) -> Any:
    d, p = cluster.decode[0], cluster.prefill[0]

    async def pull() -> None:
        await d.receiver.pull(
            tid, bootstrap_url=cluster.bootstrap_url, engine_id=p.engine_id, block_ids=dst
        )

    return pull


async def test_a_failed_write_sends_no_token_but_pull_failed(inbox: Inbox) -> None:
    asking = _Asking()
    asking.notices |= {"f1": (inbox.address, 1), "f2": (inbox.address, 2)}

    def faulty(plane: object) -> FaultyDataPlane:
        return FaultyDataPlane(plane, fail_writes=1)  # type: ignore[arg-type]

    with trio.fail_after(30):
        async with asking_cluster(asking, wrap_prefill=faulty) as cluster:
            p = cluster.prefill[0]
            bad = await run_transfer(cluster, "f1", 4)
            assert not bad.ok and "injected fault" in bad.reason
            assert await inbox.wait_tokens(within=0.2) == []
            good = await run_transfer(cluster, "f2", 4)  # the next one still gets its token
            assert good.ok and good.verified
            assert await inbox.wait_tokens() == [2]
            assert p.sender.side_channel_statistics().notices_sent == 1
            await settled(cluster)


async def test_a_pull_whose_kv_never_completes_sends_no_token(inbox: Inbox) -> None:
    def broken() -> None:
        raise RuntimeError("CUDA error")

    asking = _Asking()
    asking.notices["k1"] = (inbox.address, 1)
    with trio.fail_after(30):
        async with asking_cluster(asking) as cluster:
            p, d = cluster.prefill[0], cluster.decode[0]
            src, dst = p.pool.allocate(2), d.pool.allocate(2)
            p.owned["k1"] = src
            p.sender.transfer_ready("k1", src, complete=broken)
            with pytest.raises(PullFailedError, match="not complete"):
                await partial_pull(cluster, "k1", dst)()
            assert await inbox.wait_tokens(within=0.2) == []
            d.pool.free(dst)
            await settled(cluster)


@pytest.mark.parametrize(
    "done_to",
    ["udp://nohost:1", "ipc:///x", "udp://127.0.0.1:1", "udp://localhost:1", "x" * 500],
)
async def test_a_garbage_done_to_does_not_disturb_the_sender(done_to: str) -> None:
    asking = _Asking()
    asking.notices |= {"g1": (done_to, 1), "g2": (done_to, 2)}
    with trio.fail_after(30):
        async with asking_cluster(asking) as cluster:
            for tid in ("g1", "g2"):
                outcome = await run_transfer(cluster, tid, 4)
                assert outcome.ok and outcome.verified, outcome
            stats = cluster.prefill[0].sender.side_channel_statistics()
            if notice_address(done_to):  # sent to nobody: lost, as a notice may be
                assert stats.notices_sent + stats.notices_dropped == 2
            else:
                assert (stats.notices_sent, stats.notices_refused) == (0, 2)
            await settled(cluster)


async def test_no_notice_socket_is_left_open_once_the_sender_ended(inbox: Inbox) -> None:
    asking = _Asking()
    asking.notices |= {"c1": (inbox.address, 1), "c2": ("udp://127.0.0.1:1", 2)}
    with trio.fail_after(30):
        async with asking_cluster(asking) as cluster:
            assert (await run_transfer(cluster, "c1", 2)).ok
            assert await inbox.wait_tokens() == [1]
            assert (await run_transfer(cluster, "c2", 2)).ok
            notices = cluster.prefill[0].sender._writer.notices  # (the sender's own)
            assert notices is not None
            sockets = list(notices._sockets.values())
            assert len(sockets) == 1 and sockets[0].fileno() != -1  # one for IPv4: both
            await settled(cluster)
    assert all(s.fileno() == -1 for s in sockets) and notices.statistics().sockets == 0
