"""How long a thread woken by I/O waits for the GIL while another thread runs Python, at
several switch intervals (the connector's ``gil_switch_ms``, :mod:`pdactors_vllm.gil`).

A reader thread waits on a UDP socket; the main thread sends it a datagram every 2 ms carrying
the send time; the reader notes how late it runs Python after the send. With ``busy``, a third
thread runs Python all along (the vLLM worker's forward, the engine core's loop). One process,
no vLLM. Two readers (``--readers``): ``recv`` blocks in ``recv`` (one system call per
datagram, so one wait for the GIL), ``poll`` blocks in ``poll`` and then reads without blocking
until ``EAGAIN`` (two calls before the datagram is in hand, so two waits: each call gives the
GIL up and must take it back).

    python bench/gil_wakeup.py [--datagrams 400] [--intervals-ms 5 1 0.5] [--readers recv poll]
"""

from __future__ import annotations

import argparse
import select
import socket
import sys
import threading
import time

from common import busy_python


def wakeups(datagrams: int, busy: bool, kind: str = "recv") -> list[float]:
    """Seconds from each send to the reader (``kind``) running Python with its datagram."""
    rx = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    rx.bind(("127.0.0.1", 0))
    tx = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    late: list[float] = []

    def blocking_reader() -> None:
        while len(late) < datagrams:
            sent = float(rx.recv(64))
            late.append(time.perf_counter() - sent)

    def polling_reader() -> None:
        poller = select.poll()
        poller.register(rx, select.POLLIN)
        while len(late) < datagrams:
            poller.poll()
            while True:
                try:
                    sent = float(rx.recv(64, socket.MSG_DONTWAIT))
                except BlockingIOError:
                    break
                late.append(time.perf_counter() - sent)

    thread = threading.Thread(target=blocking_reader if kind == "recv" else polling_reader)
    thread.start()
    stop = busy_python() if busy else threading.Event()
    for _ in range(datagrams):
        time.sleep(0.002)
        tx.sendto(repr(time.perf_counter()).encode(), rx.getsockname())
    thread.join()
    stop.set()
    rx.close()
    tx.close()
    return sorted(late)


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--datagrams", type=int, default=400)
    ap.add_argument("--intervals-ms", type=float, nargs="+", default=[5, 1, 0.5, 0.2, 0.1])
    ap.add_argument("--readers", nargs="+", choices=["recv", "poll"], default=["recv"])
    args = ap.parse_args()
    default = sys.getswitchinterval()
    print("| another thread runs Python | switch interval ms | reader | p50 µs | p90 µs | p99 µs |")
    print("|---|---|---|---|---|---|")
    for busy in (False, True):
        for ms in args.intervals_ms:
            sys.setswitchinterval(ms / 1000)
            for kind in args.readers:
                late = wakeups(args.datagrams, busy, kind)
                n = len(late)
                p50, p90, p99 = (late[int(n * q)] * 1e6 for q in (0.5, 0.9, 0.99))
                row = f"| {'yes' if busy else 'no'} | {ms:g} | {kind} | {p50:.0f} | {p90:.0f}"
                print(f"{row} | {p99:.0f} |", flush=True)
    sys.setswitchinterval(default)


if __name__ == "__main__":
    main()
