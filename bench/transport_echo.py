"""ROUTER/DEALER echo round trip: pdactors.transport vs zmq-anyio, both ends in one trio run.

    python bench/transport_echo.py [--requests N] [--size BYTES]

A ROUTER echoes every message; one DEALER keeps ``concurrency`` requests in flight from as many
tasks, and one reader task hands each reply to the task waiting for it (how the control plane
uses a DEALER). Prints p50/p99 round-trip latency and round trips per second for each
adapter at concurrency 1 and 64. zmq-anyio's futures are awaited directly.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import trio
import zmq

# Runnable from a checkout, without installing the package.
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from pdactors.transport import open_dealer, open_router

Send = Callable[[list[bytes]], Awaitable[Any]]
Receive = Callable[[], Awaitable[list[bytes]]]


@dataclass(frozen=True)
class Pair:
    """One connected ROUTER/DEALER pair, seen through one adapter."""

    router_send: Send  # frames include the identity
    router_receive: Receive
    dealer_send: Send
    dealer_receive: Receive


@asynccontextmanager
async def ours() -> AsyncIterator[Pair]:
    async with open_router("127.0.0.1") as router, open_dealer(router.address) as dealer:

        async def router_send(frames: list[bytes]) -> None:
            await router.send(frames[0], frames[1:])

        async def router_receive() -> list[bytes]:
            identity, frames = await router.receive()
            return [identity, *frames]

        yield Pair(router_send, router_receive, dealer.send, dealer.receive)


@asynccontextmanager
async def anyio_adapter() -> AsyncIterator[Pair]:
    import zmq_anyio

    context = zmq.Context.instance()
    raw_router = context.socket(zmq.ROUTER)
    raw_router.setsockopt(zmq.LINGER, 0)
    port = raw_router.bind_to_random_port("tcp://127.0.0.1")
    raw_dealer = context.socket(zmq.DEALER)
    raw_dealer.setsockopt(zmq.LINGER, 0)
    raw_dealer.connect(f"tcp://127.0.0.1:{port}")
    async with zmq_anyio.Socket(raw_router) as router, zmq_anyio.Socket(raw_dealer) as dealer:

        async def router_send(frames: list[bytes]) -> None:
            await router.asend_multipart(frames)

        async def router_receive() -> list[bytes]:
            return await router.arecv_multipart()  # type: ignore[no-any-return]

        async def dealer_send(frames: list[bytes]) -> None:
            await dealer.asend_multipart(frames)

        async def dealer_receive() -> list[bytes]:
            return await dealer.arecv_multipart()  # type: ignore[no-any-return]

        yield Pair(router_send, router_receive, dealer_send, dealer_receive)


async def echo(pair: Pair) -> None:
    while True:
        await pair.router_send(await pair.router_receive())


async def measure(
    pair: Pair, concurrency: int, requests: int, size: int
) -> tuple[list[float], float]:
    """Warm up, then time ``requests`` round trips; return the latencies (s) and the wall time.

    One nursery for both phases: a zmq-anyio future abandoned by a cancelled task still takes
    the next message, so echo and dispatch must not be restarted on the same sockets.
    """
    payload = b"x" * size
    waiting: dict[int, trio.Event] = {}
    latencies: list[float] = []

    async def dispatch() -> None:
        while True:
            frames = await pair.dealer_receive()
            waiting.pop(int.from_bytes(frames[0], "little")).set()

    async def client(first: int, count: int) -> None:
        for request in range(first, first + count):
            done = waiting[request] = trio.Event()
            start = time.perf_counter()
            await pair.dealer_send([request.to_bytes(8, "little"), payload])
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
        nursery.start_soon(echo, pair)
        nursery.start_soon(dispatch)
        warm_up = min(requests, 2_000)
        await run_clients(0, warm_up)
        latencies.clear()
        elapsed = await run_clients(warm_up, requests)
        nursery.cancel_scope.cancel()
    return latencies, elapsed


async def main(requests: int, size: int) -> None:
    adapters = {"pdactors.transport": ours, "zmq-anyio 0.4.1": anyio_adapter}
    print(f"{'adapter':<20} {'conc':>4} {'p50 µs':>8} {'p99 µs':>8} {'round trips/s':>14}")
    for concurrency in (1, 64):
        for name, adapter in adapters.items():
            async with adapter() as pair:
                latencies, elapsed = await measure(pair, concurrency, requests, size)
            cuts = statistics.quantiles(latencies, n=100)
            print(
                f"{name:<20} {concurrency:>4} {cuts[49] * 1e6:>8.0f} {cuts[98] * 1e6:>8.0f}"
                f" {len(latencies) / elapsed:>14,.0f}"
            )


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=20_000)
    parser.add_argument("--size", type=int, default=200)
    args = parser.parse_args()
    trio.run(main, args.requests, args.size)
