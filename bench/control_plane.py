"""Control plane: 1-block transfers at concurrency 1, 64 and 256.

One P sender and one D receiver with real Mooncake TCP engines on loopback; each transfer is
one block of one layer (``--block-bytes``, 4 KiB by default) so the figures are dominated by
the actors, the side channel and the worker-thread hop, not by bytes. Latency is measured
on D from pull sent to answer received; P marks each transfer ready just before D pulls it.

    python bench/control_plane.py
"""

from __future__ import annotations

import argparse
import time

import numpy as np
import trio
from common import open_pair

from pdactors import DataPlaneConfig
from pdactors.core.plan import packed_layout, plan_transfer


def planning_time() -> float:
    """p50 seconds of planning the reference request (36 regions x 63 scattered blocks)."""
    rng = np.random.default_rng(0)
    src = packed_layout(1 << 32, 36, 2000, 64 * 1024)
    dst = packed_layout(1 << 40, 36, 2000, 64 * 1024)
    s_ids = rng.choice(2000, 63, replace=False).tolist()
    d_ids = rng.choice(2000, 63, replace=False).tolist()
    times = []
    for _ in range(2000):
        start = time.perf_counter()
        plan_transfer(src, s_ids, dst, d_ids)
        times.append(time.perf_counter() - start)
    return float(np.percentile(times, 50))


async def run(args: argparse.Namespace) -> None:
    print(f"# planning the reference request: {planning_time() * 1e6:.1f} µs p50")
    pool = max(args.concurrency_levels) * 2
    p = np.zeros((1, pool, args.block_bytes), np.uint8)
    d = np.zeros_like(p)
    cfg = DataPlaneConfig(
        workers=args.workers,
        max_calls_per_peer=args.calls_per_peer,
        max_descriptors_per_call=2048 // args.calls_per_peer,
    )
    async with open_pair(
        cfg,
        p.ctypes.data,
        d.ctypes.data,
        p.nbytes,
        layers=1,
        pool=pool,
        block_bytes=args.block_bytes,
    ) as pair:
        sender, receiver, url = pair.sender, pair.receiver, pair.url
        counter = 0

        async def drain_released() -> None:
            while True:
                await sender.wait_finished()

        async with trio.open_nursery() as nursery:
            nursery.start_soon(drain_released)
            print(
                f"# control plane: 1-block transfers of {args.block_bytes} B, TCP loopback;"
                f" {args.workers} workers, {args.calls_per_peer} engine calls per peer"
            )
            print("| concurrency | transfers | p50 ms | p99 ms | transfers/s |")
            print("|---|---|---|---|---|")
            for concurrency in args.concurrency_levels:
                latencies: list[float] = []
                total = max(args.transfers, concurrency * 8)

                async def worker(slot: int, n: int, latencies: list[float] = latencies) -> None:
                    nonlocal counter
                    for _ in range(n):
                        counter += 1
                        tid = f"t{counter}"
                        sender.transfer_pending(tid)
                        sender.transfer_ready(tid, [slot])
                        start = time.perf_counter()
                        await receiver.pull(
                            tid, bootstrap_url=url, engine_id="p", block_ids=[pool // 2 + slot]
                        )
                        latencies.append(time.perf_counter() - start)

                # warm-up: connections, threads
                async with trio.open_nursery() as warm:
                    for slot in range(concurrency):
                        warm.start_soon(worker, slot, 2)
                latencies.clear()
                start = time.perf_counter()
                async with trio.open_nursery() as inner:
                    for slot in range(concurrency):
                        inner.start_soon(worker, slot, total // concurrency)
                elapsed = time.perf_counter() - start
                p50, p99 = np.percentile(latencies, [50, 99]) * 1e3
                rate = len(latencies) / elapsed
                print(f"| {concurrency} | {len(latencies)} | {p50:.3f} | {p99:.3f} | {rate:.0f} |")
            nursery.cancel_scope.cancel()


def parse() -> argparse.Namespace:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--block-bytes", type=int, default=4096)
    ap.add_argument("--workers", type=int, default=2, help="DataPlaneConfig.workers")
    ap.add_argument("--calls-per-peer", type=int, default=1, help="max_calls_per_peer")
    ap.add_argument("--transfers", type=int, default=2000)
    ap.add_argument("--concurrency-levels", type=int, nargs="+", default=[1, 64, 256])
    return ap.parse_args()


if __name__ == "__main__":
    trio.run(run, parse())
