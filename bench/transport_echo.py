"""ROUTER/DEALER echo round trip: pdactors.transport vs zmq-anyio.

    python bench/transport_echo.py [--requests N] [--size BYTES] [--concurrency C ...]

A ROUTER echoes every message; one DEALER keeps ``concurrency`` requests in flight from as many
tasks, and one reader task hands each reply to the task waiting for it (how the control plane
uses a DEALER). Prints p50/p99 round-trip latency and round trips per second for each adapter
at each concurrency (default 1 and 64): first with both ends in one trio run, then with the echo
ROUTER (always ours) in a child process, as P and D are deployed. zmq-anyio's futures are
awaited directly.
"""

from __future__ import annotations

import argparse
import multiprocessing
import statistics
import sys
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any, cast

import trio
import zmq

# Runnable from a checkout, without installing the package.
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from pdactors.transport import RouterSocket, open_dealer, open_router

Send = Callable[[list[bytes]], Awaitable[Any]]
Receive = Callable[[], Awaitable[list[bytes]]]
Endpoint = tuple[Send, Receive]  # a ROUTER's frames include the peer's identity


@asynccontextmanager
async def ours(address: str | None) -> AsyncIterator[tuple[Endpoint | None, Endpoint]]:
    """Our DEALER connected to ``address``, or to our own ROUTER if ``address`` is None."""
    if address is not None:
        async with open_dealer(address) as dealer:
            yield None, (dealer.send, dealer.receive)
        return
    async with open_router("127.0.0.1") as router, open_dealer(router.address) as dealer:

        async def router_send(frames: list[bytes]) -> None:
            await router.send(frames[0], frames[1:])

        async def router_receive() -> list[bytes]:
            identity, frames = await router.receive()
            return [identity, *frames]

        yield (router_send, router_receive), (dealer.send, dealer.receive)


@asynccontextmanager
async def zmq_anyio(address: str | None) -> AsyncIterator[tuple[Endpoint | None, Endpoint]]:
    """zmq-anyio's DEALER connected to ``address``, or to its own ROUTER if it is None."""
    import zmq_anyio

    context: zmq.Context[zmq.Socket[bytes]] = zmq.Context.instance()
    raw_router = context.socket(zmq.ROUTER)
    raw_router.setsockopt(zmq.LINGER, 0)
    port = raw_router.bind_to_random_port("tcp://127.0.0.1")
    raw_dealer = context.socket(zmq.DEALER)
    raw_dealer.setsockopt(zmq.LINGER, 0)
    raw_dealer.connect(address or f"tcp://127.0.0.1:{port}")
    async with zmq_anyio.Socket(raw_router) as router, zmq_anyio.Socket(raw_dealer) as dealer:

        async def router_send(frames: list[bytes]) -> None:
            await router.asend_multipart(frames)

        async def router_receive() -> list[bytes]:
            return cast(list[bytes], await router.arecv_multipart())

        async def dealer_send(frames: list[bytes]) -> None:
            await dealer.asend_multipart(frames)

        async def dealer_receive() -> list[bytes]:
            return cast(list[bytes], await dealer.arecv_multipart())

        echo_end = None if address else (router_send, router_receive)
        yield echo_end, (dealer_send, dealer_receive)


async def echo(router: Endpoint) -> None:
    send, receive = router
    while True:
        await send(await receive())


async def measure(
    echo_end: Endpoint | None, dealer: Endpoint, concurrency: int, requests: int, size: int
) -> tuple[list[float], float]:
    """Warm up, then time ``requests`` round trips; return the latencies (s) and the wall time.

    One nursery for both phases: a zmq-anyio future abandoned by a cancelled task still takes
    the next message, so echo and dispatch must not be restarted on the same sockets.
    """
    send, receive = dealer
    payload = b"x" * size
    waiting: dict[int, trio.Event] = {}
    latencies: list[float] = []

    async def dispatch() -> None:
        while True:
            frames = await receive()
            waiting.pop(int.from_bytes(frames[0], "little")).set()

    async def client(first: int, count: int) -> None:
        for request in range(first, first + count):
            done = waiting[request] = trio.Event()
            start = time.perf_counter()
            await send([request.to_bytes(8, "little"), payload])
            await done.wait()
            latencies.append(time.perf_counter() - start)

    async def run_clients(first: int, total: int) -> float:
        per_task = total // concurrency
        start = time.perf_counter()
        async with trio.open_nursery() as clients:
            for task in range(concurrency):
                clients.start_soon(client, first + task * per_task, per_task)
        return time.perf_counter() - start

    async with trio.open_nursery() as nursery:
        if echo_end is not None:
            nursery.start_soon(echo, echo_end)
        nursery.start_soon(dispatch)
        warm_up = min(requests, 2_000)
        await run_clients(0, warm_up)
        latencies.clear()
        elapsed = await run_clients(warm_up, requests)
        nursery.cancel_scope.cancel()
    return latencies, elapsed


async def echo_ours(router: RouterSocket) -> None:
    while True:
        identity, frames = await router.receive()
        await router.send(identity, frames)


def serve_echo_process(connection: Connection) -> None:
    """Child process: our ROUTER echoing everything until the process is terminated."""

    async def serve() -> None:
        async with open_router("127.0.0.1") as router:
            connection.send(router.address)
            await echo_ours(router)

    trio.run(serve)


async def main(requests: int, size: int, concurrencies: list[int]) -> None:
    adapters = {"pdactors.transport": ours, "zmq-anyio 0.4.1": zmq_anyio}
    header = ("adapter", "echo", "conc", "p50 µs", "p99 µs", "round trips/s")
    print("{:<20} {:<9} {:>4} {:>7} {:>7} {:>13}".format(*header))
    spawn = multiprocessing.get_context("spawn")
    parent_end, child_end = spawn.Pipe()
    child = spawn.Process(target=serve_echo_process, args=(child_end,), daemon=True)
    child.start()
    try:
        child_address: str = await trio.to_thread.run_sync(parent_end.recv)
        for where, address in (("same run", None), ("process", child_address)):
            for concurrency in concurrencies:
                for name, adapter in adapters.items():
                    async with adapter(address) as (echo_end, dealer):
                        latencies, elapsed = await measure(
                            echo_end, dealer, concurrency, requests, size
                        )
                    cuts = statistics.quantiles(latencies, n=100)
                    print(
                        f"{name:<20} {where:<9} {concurrency:>4} {cuts[49] * 1e6:>7.0f}"
                        f" {cuts[98] * 1e6:>7.0f} {len(latencies) / elapsed:>13,.0f}"
                    )
    finally:
        child.terminate()
        child.join()


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=20_000)
    parser.add_argument("--size", type=int, default=200)
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 64])
    args = parser.parse_args()
    trio.run(main, args.requests, args.size, args.concurrency)
