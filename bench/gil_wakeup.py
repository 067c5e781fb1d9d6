"""How long a thread woken by I/O waits for the GIL while another thread runs Python, at
several switch intervals (the connector's ``gil_switch_ms``, :mod:`pdactors_vllm.gil`).

A reader thread blocks in ``recv`` on a UDP socket, as D's landed notices thread does; the
main thread sends it a datagram every 2 ms carrying the send time; the reader notes how late it
runs Python after the send. With ``busy``, a third thread runs Python all along (the vLLM
worker's forward, the engine core's loop). One process, no vLLM.

    python bench/gil_wakeup.py [--datagrams 400] [--intervals-ms 5 1 0.5 0.2 0.1]
"""

from __future__ import annotations

import argparse
import socket
import sys
import threading
import time

from common import busy_python


def wakeups(datagrams: int, busy: bool) -> list[float]:
    """Seconds from each send to the reader running Python with its datagram."""
    rx = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    rx.bind(("127.0.0.1", 0))
    tx = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    late: list[float] = []

    def reader() -> None:
        for _ in range(datagrams):
            sent = float(rx.recv(64))
            late.append(time.perf_counter() - sent)

    thread = threading.Thread(target=reader)
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
    args = ap.parse_args()
    default = sys.getswitchinterval()
    print("| another thread runs Python | switch interval ms | p50 µs | p90 µs | p99 µs |")
    print("|---|---|---|---|---|")
    for busy in (False, True):
        for ms in args.intervals_ms:
            sys.setswitchinterval(ms / 1000)
            late = wakeups(args.datagrams, busy)
            n = len(late)
            p50, p90, p99 = (late[int(n * q)] * 1e6 for q in (0.5, 0.9, 0.99))
            print(f"| {'yes' if busy else 'no'} | {ms:g} | {p50:.0f} | {p90:.0f} | {p99:.0f} |",
                  flush=True)  # fmt: skip
    sys.setswitchinterval(default)


if __name__ == "__main__":
    main()
