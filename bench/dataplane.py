"""Data-plane efficiency: the reference request through our sender path vs raw Mooncake.

Both are measured in the same run, alternating, on the same two engines and buffers:

* **ours**: D's receiver pulls, P's sender plans the descriptors (coalesced runs), writes them
  with ``batch_transfer_sync_write`` in a worker thread, and answers D. Timed on D from pull
  sent to answer received.
* **raw**: one ``TransferEngine.batch_transfer_sync_write`` call with the same coalesced
  descriptors, called directly.

Scenarios (36 layers x 63 blocks x 64 KiB = 141.75 MiB by default):

* ``whole``: each engine's pool is exactly the request's 63 blocks, so the whole KV is one
  contiguous run on both sides (1 descriptor);
* ``per-layer``: pools of 128 blocks, contiguous ids: one run per layer (36 descriptors);
* ``scattered``: pools of 128 blocks, random ids: no runs (2268 descriptors).

Also a throughput figure: ``--requests`` transfers at ``--concurrency`` through our path vs
the same number of raw calls back to back.

CPU (TCP):  python bench/dataplane.py
GPU (two GPUs, NVLink): python bench/dataplane.py --device cuda --protocol nvlink_intra
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from dataclasses import dataclass
from typing import Any

os.environ.setdefault("MC_LOG_LEVEL", "ERROR")

import numpy as np
import trio
from common import open_pair

from pdactors import DataPlaneConfig
from pdactors.core.plan import plan_transfer


@dataclass
class Buffers:
    p_ptr: int
    d_ptr: int
    nbytes: int
    check: Any  # () -> bool: D holds P's bytes for the request's blocks
    clear: Any  # () -> None: zero D


def cuda_tensor(shape: tuple[int, ...], gpu: int) -> Any:
    """A uint8 tensor from PyTorch's plain cudaMalloc allocator (``nvlink_intra`` shares it
    through cudaIpc handles; expandable segments have none)."""
    import torch

    return torch.empty(shape, dtype=torch.uint8, device=f"cuda:{gpu}")


def make_buffers(device: str, layers: int, pool: int, block_bytes: int) -> Buffers:
    shape = (layers, pool, block_bytes)
    if device == "cpu":
        p = np.random.default_rng(0).integers(0, 256, shape, dtype=np.uint8)
        d = np.zeros(shape, np.uint8)
        return Buffers(
            p.ctypes.data,
            d.ctypes.data,
            p.nbytes,
            lambda ids_p, ids_d: np.array_equal(p[:, ids_p, :], d[:, ids_d, :]),
            lambda: d.fill(0),
        )
    import torch

    p_t = cuda_tensor(shape, 0)
    d_t = cuda_tensor(shape, 1)
    p_t.random_(0, 256)
    d_t.zero_()
    torch.cuda.synchronize()

    def check(ids_p: list[int], ids_d: list[int]) -> bool:
        torch.cuda.synchronize()
        return bool(torch.equal(p_t[:, ids_p, :].cpu(), d_t[:, ids_d, :].cpu()))

    def clear() -> None:
        d_t.zero_()
        torch.cuda.synchronize()

    bufs = Buffers(p_t.data_ptr(), d_t.data_ptr(), p_t.numel(), check, clear)
    bufs._keep = (p_t, d_t)  # type: ignore[attr-defined]
    return bufs


def select_gpu(gpu: int) -> None:
    import torch

    torch.cuda.set_device(gpu)


def pct(xs: list[float], q: float) -> float:
    return float(np.percentile(xs, q))


async def scenario(
    args: argparse.Namespace, name: str, pool: int, scattered: bool
) -> dict[str, Any]:
    cfg = DataPlaneConfig(protocol=args.protocol, device_name=args.device_name)
    bufs = make_buffers(args.device, args.layers, pool, args.block_bytes)
    rng = np.random.default_rng(1)
    async with open_pair(
        cfg,
        bufs.p_ptr,
        bufs.d_ptr,
        bufs.nbytes,
        layers=args.layers,
        pool=pool,
        block_bytes=args.block_bytes,
        select_gpu=select_gpu if args.device == "cuda" else None,
    ) as pair:
        sender, receiver, url = pair.sender, pair.receiver, pair.url
        p_plane, d_plane, p_layout, d_layout = (
            pair.p_plane,
            pair.d_plane,
            pair.p_layout,
            pair.d_layout,
        )

        def ids() -> tuple[list[int], list[int]]:
            if not scattered:
                return list(range(args.blocks)), list(range(args.blocks))
            return (
                rng.permutation(pool)[: args.blocks].tolist(),
                rng.permutation(pool)[: args.blocks].tolist(),
            )

        counter = 0

        async def ours(src: list[int], dst: list[int]) -> float:
            nonlocal counter
            counter += 1
            tid = f"{name}-{counter}"
            sender.transfer_pending(tid)
            sender.transfer_ready(tid, src)
            start = time.perf_counter()
            await receiver.pull(tid, bootstrap_url=url, engine_id="p", block_ids=dst)
            return time.perf_counter() - start

        def raw(src: list[int], dst: list[int]) -> float:
            plan = plan_transfer(p_layout, src, d_layout, dst)
            s, d, n = plan.src.tolist(), plan.dst.tolist(), plan.lengths.tolist()
            # Mooncake's TCP transport fails past 2048 descriptors in flight to one peer:
            # above the chunk size, raw calls are split exactly as ours are.
            k = cfg.max_descriptors_per_call
            start = time.perf_counter()
            for i in range(0, len(s), k):
                rc = p_plane.engine.batch_transfer_sync_write(
                    d_plane.session, s[i : i + k], d[i : i + k], n[i : i + k]
                )
                assert rc == 0, rc
            return time.perf_counter() - start

        # correctness first, then warm-up
        src, dst = ids()
        bufs.clear()
        await ours(src, dst)
        assert bufs.check(src, dst), "our path delivered wrong bytes"
        descriptors = plan_transfer(p_layout, src, d_layout, dst).descriptors
        for _ in range(args.warmup):
            await ours(*ids())
            raw(*ids())
        t_ours: list[float] = []
        t_raw: list[float] = []
        for _ in range(args.iters):
            src, dst = ids()
            t_ours.append(await ours(src, dst))
            t_raw.append(raw(src, dst))

        # throughput: N transfers at concurrency C, ours vs raw back to back
        async def ours_many() -> float:
            start = time.perf_counter()
            todo = iter(range(args.requests))

            async def worker() -> None:
                for _ in todo:
                    await ours(*ids())

            async with trio.open_nursery() as inner:
                for _ in range(args.concurrency):
                    inner.start_soon(worker)
            return time.perf_counter() - start

        tp_ours = await ours_many()
        start = time.perf_counter()
        for _ in range(args.requests):
            raw(*ids())
        tp_raw = time.perf_counter() - start
    request_bytes = args.layers * args.blocks * args.block_bytes
    med_o, med_r = statistics.median(t_ours), statistics.median(t_raw)
    return {
        "scenario": name,
        "descriptors": descriptors,
        "ours_ms_p50": med_o * 1e3,
        "ours_ms_p90": pct(t_ours, 90) * 1e3,
        "raw_ms_p50": med_r * 1e3,
        "raw_ms_p90": pct(t_raw, 90) * 1e3,
        "ours_GBps": request_bytes / med_o / 1e9,
        "raw_GBps": request_bytes / med_r / 1e9,
        "latency_ratio": med_r / med_o,
        "throughput_ratio": tp_raw / tp_ours,
        "tp_ours_GBps": args.requests * request_bytes / tp_ours / 1e9,
        "tp_raw_GBps": args.requests * request_bytes / tp_raw / 1e9,
    }


async def main(args: argparse.Namespace) -> None:
    rows = []
    wanted = args.scenarios.split(",")
    plans = {
        "whole": (args.blocks, False),
        "per-layer": (args.pool, False),
        "scattered": (args.pool, True),
    }
    for name in wanted:
        pool, scattered = plans[name]
        rows.append(await scenario(args, name, pool, scattered))
    mib = args.layers * args.blocks * args.block_bytes / 2**20
    print(
        f"# data plane: {args.layers} layers x {args.blocks} blocks x {args.block_bytes} B"
        f" = {mib:.2f} MiB per request; device={args.device} protocol={args.protocol};"
        f" {args.iters} alternating iterations; throughput: {args.requests} requests at"
        f" concurrency {args.concurrency}"
    )
    head = (
        "scenario",
        "desc",
        "ours p50 ms",
        "raw p50 ms",
        "ours GB/s",
        "raw GB/s",
        "latency ratio",
        "tput ours GB/s",
        "tput raw GB/s",
        "tput ratio",
    )
    print("| " + " | ".join(head) + " |")
    print("|" + "---|" * len(head))
    cols = ("ours_ms_p50", "raw_ms_p50", "ours_GBps", "raw_GBps", "latency_ratio")
    cols += ("tp_ours_GBps", "tp_raw_GBps", "throughput_ratio")
    for r in rows:
        cells = [r["scenario"], str(r["descriptors"]), *(f"{r[c]:.3f}" for c in cols)]
        print("| " + " | ".join(cells) + " |")
    sys.stdout.flush()


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    ap.add_argument("--protocol", default="tcp")
    ap.add_argument("--device-name", default="")
    ap.add_argument("--layers", type=int, default=36)
    ap.add_argument("--blocks", type=int, default=63)
    ap.add_argument("--pool", type=int, default=128)
    ap.add_argument("--block-bytes", type=int, default=64 * 1024)
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--requests", type=int, default=16)
    ap.add_argument("--concurrency", type=int, default=2)
    ap.add_argument("--scenarios", default="whole,per-layer,scattered")
    return ap.parse_args(argv)


if __name__ == "__main__":
    trio.run(main, parse())
