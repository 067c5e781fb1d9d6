"""Tensor-parallel shapes side by side: the harness (real Mooncake TCP engines on loopback,
every head verified) moving the same model KV per request through P TP x -> D TP y.

For each shape: descriptors P writes per request (all workers), D's pull time (pull sent to
the last P worker's answer, p50/p99) and throughput, with ratios against 1 -> 1 measured in the
same run. On this 2-core machine a TP shape runs more engines (processes' worth of work) than
there are cores, so the ratios are about the per-head descriptors and the extra engines, not
about NIC or NVLink bandwidth.

    python bench/tp_shapes.py                       # the reference request, 8 KV heads
    python bench/tp_shapes.py --requests 32 --concurrency 4
"""

from __future__ import annotations

import argparse

import trio

from pdactors.testing.harness import HarnessReport, run_harness

SHAPES = [(1, 1), (2, 2), (2, 1), (1, 2), (4, 1), (1, 4)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=16)
    parser.add_argument("--concurrency", type=int, default=1)
    parser.add_argument("--blocks", type=int, default=63)
    parser.add_argument("--layers", type=int, default=36)
    parser.add_argument("--block-bytes", type=int, default=64 * 1024)
    parser.add_argument("--kv-heads", type=int, default=8)
    args = parser.parse_args()
    reports: dict[tuple[int, int], HarnessReport] = {}
    for p_tp, d_tp in SHAPES:
        reports[p_tp, d_tp] = trio.run(
            lambda p=p_tp, d=d_tp: run_harness(
                requests=args.requests,
                blocks=args.blocks,
                layers=args.layers,
                block_bytes=args.block_bytes,
                concurrency=args.concurrency,
                p_tp=p,
                d_tp=d,
                kv_heads=args.kv_heads,
            )
        )
    base = reports[1, 1]
    mib = base.bytes_per_request / 2**20
    print(
        f"{args.requests} requests of {mib:.2f} MiB (model KV), {args.kv_heads} KV heads, "
        f"concurrency {args.concurrency}\n"
    )
    print(
        "| P TP -> D TP | verified | descriptors/request | pull p50 ms | pull p99 ms | GB/s"
        " | GB/s vs 1->1 | pull p50 vs 1->1 |\n|---|---|---|---|---|---|---|---|"
    )
    for (p_tp, d_tp), r in reports.items():
        print(
            f"| {p_tp} -> {d_tp} | {r.verified}/{r.requests} | {r.descriptors_per_request:.0f}"
            f" | {1e3 * r.percentile(50):.1f} | {1e3 * r.percentile(99):.1f} | {r.gbps:.3f}"
            f" | {r.gbps / base.gbps:.2f} | {r.percentile(50) / base.percentile(50):.2f} |"
        )
        assert r.passed, f"{p_tp} -> {d_tp}: {r.summary()}"


if __name__ == "__main__":
    main()
