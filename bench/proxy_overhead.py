"""Proxy overhead: a completion straight to an engine vs through ``serve_proxy`` (which also asks
a P engine first, as it always does). The engines are the tests' stand-ins (quart-trio apps
that answer at once), so the difference is the proxy's own cost. Everything runs in one
process (engines, proxy, client), so the figures are an upper bound on that cost.

    python bench/proxy_overhead.py [--requests 2000] [--concurrency 1 32]
"""

from __future__ import annotations

import argparse
import logging
import sys
import time
from pathlib import Path

import httpx
import numpy as np
import trio

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from tests.test_proxy import open_setup


async def measure(url: str, n: int, concurrency: int, direct: bool) -> tuple[float, float, float]:
    body: dict[str, object] = {"model": "m", "prompt": "hi", "max_tokens": 4}
    if direct:  # what the proxy would send D
        body["kv_transfer_params"] = {"do_remote_prefill": True, "transfer_id": "t"}
    latencies: list[float] = []
    todo = iter(range(n))
    limits = httpx.Limits(max_connections=concurrency * 2)
    async with httpx.AsyncClient(trust_env=False, timeout=30, limits=limits) as client:

        async def worker() -> None:
            for _ in todo:
                start = time.perf_counter()
                resp = await client.post(f"{url}/v1/completions", json=body)
                resp.raise_for_status()
                latencies.append(time.perf_counter() - start)

        start = time.perf_counter()
        async with trio.open_nursery() as nursery:
            for _ in range(concurrency):
                nursery.start_soon(worker)
        elapsed = time.perf_counter() - start
    p50, p99 = np.percentile(latencies, [50, 99]) * 1e3
    return float(p50), float(p99), n / elapsed


async def main(args: argparse.Namespace) -> None:
    logging.disable(logging.INFO)
    async with open_setup() as setup:
        direct = setup.d[0].url
        print("# proxy overhead: stand-in engines, one process; non-streaming completions")
        print("| concurrency | path | p50 ms | p99 ms | requests/s |")
        print("|---|---|---|---|---|")
        for concurrency in args.concurrency:
            for name, url in (("direct to D", direct), ("through proxy", setup.url)):
                is_direct = url == direct
                await measure(url, 50, concurrency, is_direct)  # warm-up
                p50, p99, rate = await measure(url, args.requests, concurrency, is_direct)
                print(f"| {concurrency} | {name} | {p50:.3f} | {p99:.3f} | {rate:.0f} |")


if __name__ == "__main__":
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--requests", type=int, default=2000)
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 32])
    trio.run(main, ap.parse_args())
