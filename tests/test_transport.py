"""Tests of the trio ⇄ ZMQ transport, over real sockets on 127.0.0.1."""

from __future__ import annotations

import random
import re
import socket
import time
from collections import Counter

import pytest
import trio
import trio.testing
import zmq

from pdactors.config import Liveness
from pdactors.transport import DealerSocket, RouterSocket, open_dealer, open_router
from pdactors.transport.zmq import PeerUnreachable

MiB = 1024 * 1024


async def echo(router: RouterSocket) -> None:
    """Send every message back to its sender, until cancelled."""
    while True:
        identity, frames = await router.receive()
        await router.send(identity, frames)


def free_port() -> int:
    """A port nothing listens on, below Linux's ephemeral range (32768 up), so that a DEALER
    retrying a connection to it cannot end up connected to itself (TCP self-connect). Probed
    with a plain socket: ZMQ closes a listener in the background, too late for a re-bind."""
    for port in random.sample(range(20_000, 32_000), 50):
        with socket.socket() as probe:
            try:
                probe.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise RuntimeError("no free port found")


async def test_round_trip_keeps_empty_and_large_frames() -> None:
    message = [b"", b"a", b"", b"\x00" * 3, bytes(range(256)) * (4 * MiB // 256)]
    with trio.fail_after(10):
        async with open_router("127.0.0.1", port=0) as router, open_dealer(router.address) as d:
            assert re.fullmatch(r"tcp://127\.0\.0\.1:\d+", router.address)
            assert not router.address.endswith(":0")
            await d.send(message)
            identity, frames = await router.receive()
            assert frames == message
            await router.send(identity, [b"reply", *message])
            assert await d.receive() == [b"reply", *message]


async def test_many_tasks_share_one_dealer() -> None:
    requests = 256
    with trio.fail_after(10):
        async with (
            open_router("127.0.0.1") as router,
            open_dealer(router.address) as dealer,
            trio.open_nursery() as nursery,
        ):
            nursery.start_soon(echo, router)
            replies: dict[int, trio.Event] = {}

            async def dispatch() -> None:
                while replies:
                    frames = await dealer.receive()
                    (request,) = frames
                    replies.pop(int(request)).set()

            async def request(number: int) -> None:
                replies[number] = done = trio.Event()
                await dealer.send([str(number).encode()])
                await done.wait()

            async with trio.open_nursery() as clients:
                for number in range(requests):
                    clients.start_soon(request, number)
                await trio.testing.wait_all_tasks_blocked()
                clients.start_soon(dispatch)
            nursery.cancel_scope.cancel()


async def test_many_tasks_receive_on_one_dealer() -> None:
    requests = 256
    received: list[bytes] = []
    with trio.fail_after(10):
        async with (
            open_router("127.0.0.1") as router,
            open_dealer(router.address) as dealer,
            trio.open_nursery() as nursery,
        ):
            nursery.start_soon(echo, router)

            async def request(number: int) -> None:
                await dealer.send([b"%d" % number])
                received.extend(await dealer.receive())

            async with trio.open_nursery() as clients:
                for number in range(requests):
                    clients.start_soon(request, number)
            nursery.cancel_scope.cancel()
    assert sorted(received) == sorted(b"%d" % n for n in range(requests))


async def test_several_dealers_each_get_their_own_replies() -> None:
    dealers, per_dealer = 8, 64
    with trio.fail_after(10):
        async with open_router("127.0.0.1") as router, trio.open_nursery() as nursery:
            nursery.start_soon(echo, router)

            async def client(name: bytes) -> None:
                async with open_dealer(router.address) as dealer, trio.open_nursery() as sends:
                    for number in range(per_dealer):
                        sends.start_soon(dealer.send, [name, b"%d" % number])
                    replies = [await dealer.receive() for _ in range(per_dealer)]
                assert sorted(replies) == sorted([name, b"%d" % n] for n in range(per_dealer))

            async with trio.open_nursery() as clients:
                for index in range(dealers):
                    clients.start_soon(client, b"dealer-%d" % index)
            nursery.cancel_scope.cancel()


async def test_cancelled_receive_leaves_the_sockets_usable() -> None:
    with trio.fail_after(10):
        async with open_router("127.0.0.1") as router, open_dealer(router.address) as dealer:
            with trio.move_on_after(0.05) as waited:
                await dealer.receive()
            assert waited.cancelled_caught
            with trio.move_on_after(0.05) as waited:
                await router.receive()
            assert waited.cancelled_caught

            await dealer.send([b"ping"])
            identity, frames = await router.receive()
            assert frames == [b"ping"]
            await router.send(identity, [b"pong"])
            assert await dealer.receive() == [b"pong"]


async def test_cancelled_blocked_send_sends_nothing() -> None:
    port = free_port()
    with trio.fail_after(10):
        # Nothing listens yet: a DEALER queues up to its high water mark (1), then waits.
        async with open_dealer(f"tcp://127.0.0.1:{port}", hwm=1) as dealer:
            await dealer.send([b"first"])
            with trio.move_on_after(0.1) as waited:
                await dealer.send([b"cancelled"])
            assert waited.cancelled_caught

            async with open_router("127.0.0.1", port=port) as router:
                identity, frames = await router.receive()
                assert frames == [b"first"]
                await dealer.send([b"second"])
                identity, frames = await router.receive()
                assert frames == [b"second"]
                await router.send(identity, [b"reply"])
                assert await dealer.receive() == [b"reply"]


async def test_one_task_blocked_sending_another_receiving() -> None:
    port = free_port()
    with trio.fail_after(10):
        async with (
            open_dealer(f"tcp://127.0.0.1:{port}", hwm=1) as dealer,
            trio.open_nursery() as nursery,
        ):
            replies: list[list[bytes]] = []

            async def receive() -> None:
                replies.append(await dealer.receive())

            await dealer.send([b"1"])
            nursery.start_soon(dealer.send, [b"2"])
            nursery.start_soon(receive)
            await trio.testing.wait_all_tasks_blocked()

            async with open_router("127.0.0.1", port=port) as router:
                for expected in (b"1", b"2"):
                    identity, frames = await router.receive()
                    assert frames == [expected]
                await router.send(identity, [b"reply"])
                # Wait for the reply here: leaving the block closes the router.
                while not replies:
                    await trio.sleep(0.001)
    assert replies == [[b"reply"]]


async def test_a_send_that_consumes_the_fd_signal_wakes_the_receiver() -> None:
    # Rule 3 of the transport's docstring: ZMQ processes pending commands during a send, which
    # clears zmq.FD; a receiver asleep since before the reply arrived must still wake. The peer
    # is a plain pyzmq socket, so that no trio checkpoint lets the fd watcher see the reply first.
    peer: zmq.Socket[bytes] = zmq.Context.instance().socket(zmq.ROUTER)
    peer.setsockopt(zmq.LINGER, 0)
    port = peer.bind_to_random_port("tcp://127.0.0.1")
    try:
        with trio.fail_after(10):
            async with (
                open_dealer(f"tcp://127.0.0.1:{port}") as dealer,
                trio.open_nursery() as nursery,
            ):
                await dealer.send([b"hello"])
                assert peer.poll(5000)
                identity, _ = peer.recv_multipart()
                replies: list[list[bytes]] = []
                got_reply = trio.Event()

                async def receive() -> None:
                    replies.append(await dealer.receive())
                    got_reply.set()

                nursery.start_soon(receive)
                await trio.testing.wait_all_tasks_blocked()
                peer.send_multipart([identity, b"reply"])
                # Block the trio thread while the reply lands, then send (ZMQ throttles command
                # processing in send to about once a millisecond). The blocked thread is the
                # condition under test, not a wait: the reply's landing cannot be watched
                # without touching the socket, which would process the very commands at stake.
                time.sleep(0.2)  # noqa: ASYNC251
                await dealer.send([b"consumes the signal"])
                with trio.fail_after(2):
                    await got_reply.wait()
                assert replies == [[b"reply"]]
    finally:
        peer.close()


async def test_a_receive_that_consumes_the_fd_signal_wakes_the_sender() -> None:
    # Rule 2 of the transport's docstring: a failed receive processes pending commands too; a
    # sender asleep at the high water mark must still wake when its peer drains the queue.
    port = free_port()
    with trio.fail_after(10):
        async with (
            open_dealer(f"tcp://127.0.0.1:{port}", hwm=1) as dealer,
            trio.open_nursery() as nursery,
        ):
            await dealer.send([b"1"])
            sent = trio.Event()

            async def send() -> None:
                await dealer.send([b"2"])
                sent.set()

            nursery.start_soon(send)
            await trio.testing.wait_all_tasks_blocked()
            async with open_router("127.0.0.1", port=port) as router:
                # Let the DEALER connect and its queue drain while no trio task runs: the
                # blocked thread is the condition under test (watching the DEALER would process
                # its commands, the signal at stake), not a wait.
                time.sleep(0.5)  # noqa: ASYNC251
                with trio.move_on_after(0.05):
                    await dealer.receive()
                with trio.fail_after(2):
                    await sent.wait()
                for expected in (b"1", b"2"):
                    assert (await router.receive())[1] == [expected]


async def test_cancellation_under_load_loses_and_splits_nothing() -> None:
    senders, per_sender = 16, 200
    rng = random.Random(1)
    sent: list[tuple[bytes, bytes]] = []
    received: list[tuple[bytes, bytes]] = []

    def message(sender: int, number: int) -> list[bytes]:
        return [b"%d" % sender, b"%d" % number, bytes([sender]) * (number % 7 * 100)]

    def check(frames: list[bytes]) -> tuple[bytes, bytes]:
        sender, number, payload = frames  # a split message would not unpack
        assert payload == bytes([int(sender)]) * (int(number) % 7 * 100)
        return sender, number

    async def server(router: RouterSocket) -> None:
        while True:
            frames: list[bytes] = []
            with trio.move_on_after(rng.uniform(0, 300e-6)):
                identity, frames = await router.receive()
            while frames:  # a cancelled send sent nothing, so send again
                with trio.move_on_after(rng.uniform(0, 300e-6)):
                    await router.send(identity, frames)
                    frames = []

    async def send_all(dealer: DealerSocket, sender: int) -> None:
        for number in range(per_sender):
            with trio.move_on_after(rng.uniform(0, 300e-6)):
                await dealer.send(message(sender, number))
                sent.append((b"%d" % sender, b"%d" % number))

    async def receive_until(dealer: DealerSocket, last: bytes) -> None:
        while True:
            with trio.move_on_after(rng.uniform(0, 300e-6)):
                frames = await dealer.receive()
                if frames == [last]:
                    return
                received.append(check(frames))

    with trio.fail_after(10):
        # Small queues, so that sends block too and are cancelled while blocked.
        async with (
            open_router("127.0.0.1", hwm=4) as router,
            open_dealer(router.address, hwm=4) as dealer,
            trio.open_nursery() as nursery,
        ):
            nursery.start_soon(server, router)
            async with trio.open_nursery() as clients:
                clients.start_soon(receive_until, dealer, b"end")
                async with trio.open_nursery() as sending:
                    for sender in range(senders):
                        sending.start_soon(send_all, dealer, sender)
                # Replies come back in order, so once "end" is back every reply is in.
                await dealer.send([b"end"])
            nursery.cancel_scope.cancel()

    assert 0 < len(sent) < senders * per_sender  # some sends were cancelled, most were not
    assert Counter(received) == Counter(sent)


async def test_closed_socket_raises() -> None:
    with trio.fail_after(10):
        async with open_router("127.0.0.1") as router:
            async with open_dealer(router.address) as dealer:
                pass
            with pytest.raises(trio.ClosedResourceError):
                await dealer.send([b"x"])
            with pytest.raises(trio.ClosedResourceError):
                await dealer.receive()

            async def receive_until_closed() -> None:
                with pytest.raises(trio.ClosedResourceError):
                    await router.receive()

            async with trio.open_nursery() as nursery:
                # The first waits for a message, the second for its turn.
                nursery.start_soon(receive_until_closed)
                nursery.start_soon(receive_until_closed)
                await trio.testing.wait_all_tasks_blocked()
                router.close()
        with pytest.raises(trio.ClosedResourceError):
            await router.send(b"id", [b"x"])


async def test_send_to_unknown_or_gone_peer_raises() -> None:
    with trio.fail_after(10):
        async with open_router("127.0.0.1") as router:
            with pytest.raises(PeerUnreachable) as raised:
                await router.send(b"nobody", [b"x"])
            assert raised.value.identity == b"nobody"

            async with open_dealer(router.address) as dealer:
                await dealer.send([b"hello"])
                identity, _ = await router.receive()
                await router.send(identity, [b"still usable"])
                assert await dealer.receive() == [b"still usable"]
            # The disconnect reaches the ROUTER in the background.
            with pytest.raises(PeerUnreachable):
                while True:
                    await router.send(identity, [b"x"])
                    await trio.sleep(0.01)


async def test_bad_frames_are_refused_before_anything_is_sent() -> None:
    with trio.fail_after(10):
        async with open_router("127.0.0.1") as router, open_dealer(router.address) as dealer:
            with pytest.raises(ValueError):
                await dealer.send([])
            with pytest.raises(TypeError):
                await dealer.send([b"half", "a str"])  # type: ignore[list-item]
            await dealer.send([b"whole"])
            identity, frames = await router.receive()
            assert frames == [b"whole"]
            with pytest.raises(ValueError):
                await router.send(identity, [])


async def wait_readable(sock: RouterSocket | DealerSocket) -> None:
    """Until a whole message waits at ``sock`` (asked of ZMQ directly: no task waits on this
    socket now, so the question takes no one's wake-up)."""
    with trio.fail_after(5):
        while not sock._socket.poll(0, zmq.POLLIN):
            await trio.sleep(0.001)


async def test_send_and_receive_are_checkpoints() -> None:
    with trio.fail_after(10):
        async with open_router("127.0.0.1") as router, open_dealer(router.address) as dealer:
            with trio.testing.assert_checkpoints():
                await dealer.send([b"x"])
            await wait_readable(router)  # so that receive takes the fast path
            with trio.testing.assert_checkpoints():
                identity, _ = await router.receive()
            with trio.testing.assert_checkpoints():
                await router.send(identity, [b"y"])
            await wait_readable(dealer)
            with trio.testing.assert_checkpoints():
                await dealer.receive()

            with trio.CancelScope() as scope:
                scope.cancel()
                await dealer.send([b"not sent"])
            await dealer.send([b"sent"])
            assert (await router.receive())[1] == [b"sent"]


LIVE = Liveness(heartbeat_interval=0.1, heartbeat_timeout=0.5, connect_timeout=0.5)


async def test_a_dealer_finds_its_peer_dead_when_a_reconnect_is_refused() -> None:
    with trio.fail_after(10):
        async with open_dealer("tcp://127.0.0.1:1", liveness=LIVE) as dealer:
            assert "refuses connections" in await dealer.wait_dead()  # nothing listens
        async with trio.open_nursery() as nursery:
            router_closed = trio.Event()

            async def router_until_closed(task_status: trio.TaskStatus[str]) -> None:
                async with open_router("127.0.0.1", liveness=LIVE) as router:
                    task_status.started(router.address)
                    await router.receive()
                router_closed.set()

            address = await nursery.start(router_until_closed)
            async with open_dealer(address, liveness=LIVE) as dealer:
                await dealer.send([b"hi"])  # up, then the router's process "dies"
                await router_closed.wait()
                assert "lost" in await dealer.wait_lost(0.5)
                assert "refuses connections" in await dealer.wait_dead()


async def test_a_peer_that_accepts_and_never_answers_is_lost_but_not_dead() -> None:
    # a stopped process's socket: the kernel still accepts its connections
    with trio.fail_after(10):
        listeners = await trio.open_tcp_listeners(0, host="127.0.0.1")
        port = listeners[0].socket.getsockname()[1]
        async with open_dealer(f"tcp://127.0.0.1:{port}", liveness=LIVE) as dealer:
            assert "no connection" in await dealer.wait_lost(0.5)
            with trio.move_on_after(1.5) as waited:
                await dealer.wait_dead()
            assert waited.cancelled_caught
        for listener in listeners:
            await listener.aclose()
