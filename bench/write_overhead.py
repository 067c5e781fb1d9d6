"""The data plane's own cost per write, with an engine call that returns at once: what a write
inside the sender costs beyond its engine call (issue 28 item 2), its calls made in a worker
thread (the default) and in the Trio thread (``DataPlaneConfig.inline_max_bytes``), side by
side in one run. No Mooncake, no GPU: a stub engine stands in for the call.

    python bench/write_overhead.py --writes 3000 --descriptors 36
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np
import trio

from pdactors import DataPlaneConfig
from pdactors.dataplane.mooncake import MooncakeDataPlane


class InstantEngine:
    """An engine whose call lands nothing and returns 0 at once."""

    def batch_transfer_sync_write(
        self, target: str, src: list[int], dst: list[int], lengths: list[int]
    ) -> int:
        return 0


async def per_write(inline_max_bytes: int, args: argparse.Namespace) -> list[float]:
    config = DataPlaneConfig(inline_max_bytes=inline_max_bytes)
    plane = MooncakeDataPlane(InstantEngine(), config, "bench:1")  # type: ignore[arg-type]
    src = np.arange(args.descriptors, dtype=np.uint64) * np.uint64(1 << 20)
    dst = src + np.uint64(1 << 40)
    lengths = np.full(args.descriptors, 64 * 1024, dtype=np.uint64)
    times = []
    for _ in range(args.warmup + args.writes):
        start = time.perf_counter()
        await plane.write("peer:1", src, dst, lengths)
        times.append(time.perf_counter() - start)
    return times[args.warmup :]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--writes", type=int, default=3000)
    ap.add_argument("--warmup", type=int, default=500)
    ap.add_argument("--descriptors", type=int, default=36)
    args = ap.parse_args()
    print(
        f"{args.writes} writes of {args.descriptors} descriptors, an engine call returning at once"
    )
    print("| calls made in | p10 µs | p50 µs | p90 µs |\n|---|---:|---:|---:|")
    for name, limit in (("a worker thread", 0), ("the Trio thread", 1 << 62)):
        times = sorted(trio.run(per_write, limit, args))
        p10, p90 = times[len(times) // 10], times[len(times) * 9 // 10]
        p50 = statistics.median(times)
        print(f"| {name} | {p10 * 1e6:.1f} | {p50 * 1e6:.1f} | {p90 * 1e6:.1f} |")


if __name__ == "__main__":
    main()
