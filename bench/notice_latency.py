"""One-way latency of D's fast completion notice, thread to thread across two processes:
ZMQ PUSH/PULL (what the notice used first) against one UDP datagram (what it uses now).

    python bench/notice_latency.py [--count N] [--interval-ms MS] [--rounds R]

For each kind, a child process plays D: a thread of its own blocks in ``poll`` on the receiving
socket (a ZMQ PULL socket through ``zmq.Poller``, or a UDP socket through ``select.poll``) and
reads each 8-byte message as soon as it wakes. This process plays P: a worker thread sends
``count`` messages, ``interval`` apart, each carrying ``time.monotonic_ns()`` (one clock for
every process of a Linux host), with ZMQ's ``NOBLOCK`` or ``sendto(MSG_DONTWAIT)``; the child
subtracts it from its own clock on arrival. ZMQ's path is P's thread → P's ZMQ I/O thread →
D's ZMQ I/O thread → D's thread; UDP's is P's thread → the kernel → D's thread. The kinds
alternate for ``rounds`` rounds so that both see the same machine; the first messages of each
round (the connection forming, caches warming) are not counted. Prints a markdown table of
p10/p50/p90 in µs and the ratio of ZMQ's to UDP's. Needs no GPU, no Mooncake, no pdactors.
"""

from __future__ import annotations

import argparse
import os
import select
import socket
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Callable

import zmq

KINDS = ("zmq", "udp")
#: Messages per round sent first and not counted.
WARMUP = 20
#: How long D waits for a message before it gives up on the rest (a lost datagram).
RECEIVE_TIMEOUT_S = 2.0


# ---------------------------------------------------------------------- D: the child


def receive_zmq(count: int, ready: Callable[[int], None]) -> list[int]:
    context = zmq.Context(io_threads=1)
    sock = context.socket(zmq.PULL)
    sock.setsockopt(zmq.LINGER, 0)
    try:
        ready(sock.bind_to_random_port("tcp://127.0.0.1"))
        poller = zmq.Poller()
        poller.register(sock, zmq.POLLIN)
        latencies: list[int] = []
        while len(latencies) < count and poller.poll(int(RECEIVE_TIMEOUT_S * 1000)):
            message = sock.recv(zmq.NOBLOCK)
            latencies.append(time.monotonic_ns() - int.from_bytes(message, "little"))
        return latencies
    finally:
        sock.close()
        context.term()


def receive_udp(count: int, ready: Callable[[int], None]) -> list[int]:
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        sock.bind(("127.0.0.1", 0))
        ready(sock.getsockname()[1])
        poller = select.poll()
        poller.register(sock, select.POLLIN)
        latencies: list[int] = []
        while len(latencies) < count and poller.poll(int(RECEIVE_TIMEOUT_S * 1000)):
            message = sock.recv(64, socket.MSG_DONTWAIT)
            latencies.append(time.monotonic_ns() - int.from_bytes(message, "little"))
        return latencies


def child(kind: str, count: int) -> None:
    """D: print the port, receive on a thread of its own, print the latencies (ns)."""

    def ready(port: int) -> None:
        print(port, flush=True)

    receive = receive_zmq if kind == "zmq" else receive_udp
    got: list[int] = []
    thread = threading.Thread(target=lambda: got.extend(receive(count, ready)), name="d-notices")
    thread.start()
    thread.join()
    print(" ".join(map(str, got)), flush=True)


# ---------------------------------------------------------------------- P: this process


def sender(kind: str, port: int) -> tuple[Callable[[bytes], None], Callable[[], None]]:
    """P's send (non-blocking, as P's write thread does) and how to close it."""
    if kind == "zmq":
        context = zmq.Context(io_threads=1)
        push = context.socket(zmq.PUSH)
        push.setsockopt(zmq.LINGER, 0)
        push.connect(f"tcp://127.0.0.1:{port}")

        def close_zmq() -> None:
            push.close()
            context.term()

        return (lambda message: push.send(message, zmq.NOBLOCK)), close_zmq
    udp = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    udp.setblocking(False)
    target = ("127.0.0.1", port)
    return (lambda message: udp.sendto(message, socket.MSG_DONTWAIT, target)), udp.close


def one_round(kind: str, count: int, interval_s: float) -> list[int]:
    """One child for ``kind``; the latencies (ns) of the ``count`` messages after warm-up."""
    total = WARMUP + count
    with subprocess.Popen(
        [sys.executable, __file__, "--child", kind, "--count", str(total)],
        stdout=subprocess.PIPE,
        text=True,
    ) as proc:
        assert proc.stdout is not None
        port = int(proc.stdout.readline())
        send, close = sender(kind, port)

        def sends() -> None:
            for _ in range(total):
                time.sleep(interval_s)
                try:
                    send(time.monotonic_ns().to_bytes(8, "little"))
                except (zmq.ZMQError, OSError):
                    pass  # lost, as a notice may be; the child counts what came

        thread = threading.Thread(target=sends, name="p-writer")
        try:
            thread.start()
            thread.join()
            latencies = [int(x) for x in proc.stdout.readline().split()]
        finally:
            close()
        proc.wait()
    return latencies[WARMUP:]


def percentile(values: list[int], fraction: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(fraction * len(ordered)))] / 1000


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--count", type=int, default=300, help="messages counted per kind and round")
    ap.add_argument("--interval-ms", type=float, default=2.0, help="between two messages")
    ap.add_argument("--rounds", type=int, default=2, help="rounds of every kind, alternating")
    ap.add_argument("--child", choices=KINDS, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        child(args.child, args.count)
        return
    got: dict[str, list[int]] = {kind: [] for kind in KINDS}
    for _ in range(args.rounds):
        for kind in KINDS:
            got[kind] += one_round(kind, args.count, args.interval_ms / 1000)
    expected = args.count * args.rounds
    print(f"One-way latency, thread to thread across two processes on 127.0.0.1 "
          f"({os.cpu_count()} CPUs, pyzmq {zmq.__version__}, libzmq {zmq.zmq_version()}; "
          f"{expected} messages per kind, {args.interval_ms:g} ms apart)\n")  # fmt: skip
    print("| path | received | p10 µs | p50 µs | p90 µs |")
    print("|---|---:|---:|---:|---:|")
    for kind, label in (("zmq", "ZMQ PUSH/PULL"), ("udp", "UDP datagram")):
        lat = got[kind]
        if not lat:
            print(f"| {label} | 0/{expected} | – | – | – |")
            continue
        print(f"| {label} | {len(lat)}/{expected} | {percentile(lat, 0.1):.1f} | "
              f"{statistics.median(lat) / 1000:.1f} | {percentile(lat, 0.9):.1f} |")  # fmt: skip
    if got["zmq"] and got["udp"]:
        ratio = statistics.median(got["zmq"]) / statistics.median(got["udp"])
        print(f"\np50 ratio ZMQ / UDP: {ratio:.1f}×")


if __name__ == "__main__":
    main()
