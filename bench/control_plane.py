"""Control plane: 1-block transfers at several concurrencies, P and D in separate processes.

One P sender (this process) and one D receiver (a child process) with real Mooncake TCP
engines on loopback; each transfer is one block of one layer (``--block-bytes``, 4 KiB by
default) so the figures are dominated by the actors, the side channel and the worker-thread
hop, not by bytes. P marks every transfer ready before D pulls it; D pulls at each
concurrency and measures from pull sent to answer received. P's own CPU time over each level
gives *P CPU µs per transfer* and the rate one sender sustains on one core (1 / that).

    python bench/control_plane.py                       # P and D in two processes
    python bench/control_plane.py --one-process         # both in one Trio thread (older figures)
    python bench/control_plane.py --old-rev 46911a9     # the same run against an older library too
    python bench/control_plane.py --compare-curve       # without and with ZMQ CURVE, and the ratios
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from functools import partial

import numpy as np
import trio
from common import open_pair, worktree

from pdactors import DataPlaneConfig, ReceiverConfig, open_mooncake, serve_receiver
from pdactors.core.plan import packed_layout, plan_transfer
from pdactors.transport import ZMQ, Transport, ZmqTransport
from pdactors.transport.curve import curve_from_secret

HEADER = (
    "| concurrency | transfers | p50 ms | p99 ms | transfers/s | P CPU µs/transfer"
    " | P one-core transfers/s |\n|---|---|---|---|---|---|---|"
)


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


def dataplane_config(args: argparse.Namespace) -> DataPlaneConfig:
    return DataPlaneConfig(
        workers=args.workers,
        max_calls_per_peer=args.calls_per_peer,
        max_descriptors_per_call=2048 // args.calls_per_peer,
    )


def tid(level: int, index: int) -> str:
    return f"c{level}-{index}"


def level_total(args: argparse.Namespace, concurrency: int) -> int:
    total = max(args.transfers, concurrency * 8)
    return total - total % concurrency


async def pull_level(pull, concurrency: int, total: int, names) -> tuple[list[float], float]:  # type: ignore[no-untyped-def]
    """Run ``total`` pulls, ``concurrency`` at a time; (latencies, elapsed seconds)."""
    latencies: list[float] = []

    async def worker(slot: int) -> None:
        for i in range(slot, total, concurrency):
            start = time.perf_counter()
            await pull(names(i), slot)
            latencies.append(time.perf_counter() - start)

    start = time.perf_counter()
    async with trio.open_nursery() as nursery:
        for slot in range(concurrency):
            nursery.start_soon(worker, slot)
    return latencies, time.perf_counter() - start


# ---------------------------------------------------------------------------------- D (child)


async def d_main(args: argparse.Namespace) -> None:
    """The D process: pulls each level's transfers, prints one JSON line per level."""
    pool = max(args.concurrency_levels) * 2
    d = np.zeros((1, pool, args.block_bytes), np.uint8)
    async with open_mooncake(dataplane_config(args)) as plane:
        plane.register([(d.ctypes.data, d.nbytes)])
        layout = packed_layout(d.ctypes.data, 1, pool, args.block_bytes)
        async with trio.open_nursery() as nursery:
            receiver = await nursery.start(
                partial(serve_receiver, transport=transport(args)), ReceiverConfig(), plane, layout
            )

            async def pull(name: str, slot: int) -> None:
                await receiver.pull(name, bootstrap_url=args.url, engine_id="p", block_ids=[slot])

            for level, concurrency in enumerate(args.concurrency_levels):
                warm = concurrency * 2
                await pull_level(pull, concurrency, warm, lambda i, lv=level: tid(lv, i))
                print(json.dumps({"level": level, "phase": "start"}), flush=True)
                total = level_total(args, concurrency)
                latencies, elapsed = await pull_level(
                    pull, concurrency, total, lambda i, lv=level, w=warm: tid(lv, w + i)
                )
                print(
                    json.dumps({"level": level, "latencies": latencies, "elapsed": elapsed}),
                    flush=True,
                )
            nursery.cancel_scope.cancel()


# ---------------------------------------------------------------------------------- P (parent)


def row(concurrency: int, latencies: list[float], elapsed: float, p_cpu: float | None) -> str:
    p50, p99 = np.percentile(latencies, [50, 99]) * 1e3
    rate = len(latencies) / elapsed
    cpu = "" if p_cpu is None else f"{p_cpu / len(latencies) * 1e6:.0f}"
    one_core = "" if p_cpu is None else f"{len(latencies) / p_cpu:.0f}"
    cells = [concurrency, len(latencies), f"{p50:.3f}", f"{p99:.3f}", f"{rate:.0f}", cpu, one_core]
    return "| " + " | ".join(map(str, cells)) + " |"


async def p_main(args: argparse.Namespace) -> None:
    print(f"# planning the reference request: {planning_time() * 1e6:.1f} µs p50")
    pool = max(args.concurrency_levels) * 2
    p = np.zeros((1, pool, args.block_bytes), np.uint8)
    d = np.zeros_like(p)
    async with open_pair(
        dataplane_config(args),
        p.ctypes.data,
        d.ctypes.data,
        p.nbytes,
        layers=1,
        pool=pool,
        block_bytes=args.block_bytes,
        transport=transport(args),
    ) as pair:
        sender = pair.sender
        where = "one process" if args.one_process else "P and D in two processes"
        curve = ", side channel with ZMQ CURVE" if args.curve else ""
        print(
            f"# control plane: 1-block transfers of {args.block_bytes} B, TCP loopback, {where};"
            f" {args.workers} workers, {args.calls_per_peer} engine calls per peer{curve}"
        )
        print(HEADER)
        async with trio.open_nursery() as nursery:

            async def drain_released() -> None:
                while True:
                    await sender.wait_finished()

            nursery.start_soon(drain_released)
            if args.one_process:
                await one_process(args, pair)
            else:
                await two_processes(args, pair)
            nursery.cancel_scope.cancel()


async def one_process(args: argparse.Namespace, pair) -> None:  # type: ignore[no-untyped-def]
    sender, receiver, url = pair.sender, pair.receiver, pair.url
    pool = max(args.concurrency_levels) * 2

    async def pull(name: str, slot: int) -> None:
        sender.transfer_pending(name)
        sender.transfer_ready(name, [slot])
        await receiver.pull(name, bootstrap_url=url, engine_id="p", block_ids=[pool // 2 + slot])

    for level, concurrency in enumerate(args.concurrency_levels):
        await pull_level(pull, concurrency, concurrency * 2, lambda i, lv=level: f"w{lv}-{i}")
        latencies, elapsed = await pull_level(
            pull, concurrency, level_total(args, concurrency), lambda i, lv=level: tid(lv, i)
        )
        print(row(concurrency, latencies, elapsed, None))


async def two_processes(args: argparse.Namespace, pair) -> None:  # type: ignore[no-untyped-def]
    sender = pair.sender
    for level, concurrency in enumerate(args.concurrency_levels):
        for i in range(concurrency * 2 + level_total(args, concurrency)):
            sender.transfer_ready(tid(level, i), [i % concurrency])
    cmd = [sys.executable, __file__, "--d-child", "--url", pair.url, *sys.argv[1:]]
    child = await trio.lowlevel.open_process(cmd, stdout=subprocess.PIPE)
    try:
        assert child.stdout is not None
        buffered = b""
        cpu_at_start = 0.0
        done = 0
        while done < len(args.concurrency_levels):
            chunk = await child.stdout.receive_some()
            if not chunk:
                raise RuntimeError(f"the D process ended early (code {await child.wait()})")
            buffered += chunk
            *lines, buffered = buffered.split(b"\n")
            for line in lines:
                msg = json.loads(line)
                if msg.get("phase") == "start":
                    cpu_at_start, threads_at_start = time.thread_time(), thread_cpu()
                    continue
                p_cpu = time.thread_time() - cpu_at_start
                if args.threads:
                    print(threads_delta(threads_at_start, thread_cpu()))
                concurrency = args.concurrency_levels[msg["level"]]
                print(row(concurrency, msg["latencies"], msg["elapsed"], p_cpu))
                done += 1
    finally:
        with trio.move_on_after(10, shield=True):
            await child.wait()
        child.kill()


def thread_cpu() -> dict[str, float]:
    """CPU seconds of each thread of this process, by name (``/proc``; Linux)."""
    import os

    ticks = os.sysconf("SC_CLK_TCK")
    out: dict[str, float] = {}
    for task in os.listdir("/proc/self/task"):
        with open(f"/proc/self/task/{task}/stat") as f:
            stat = f.read()
        name = stat[stat.index("(") + 1 : stat.rindex(")")]
        fields = stat[stat.rindex(")") + 2 :].split()
        out[f"{name}/{task}"] = (int(fields[11]) + int(fields[12])) / ticks
    return out


def threads_delta(before: dict[str, float], after: dict[str, float]) -> str:
    busy = {k: v - before.get(k, 0.0) for k, v in after.items()}
    top = sorted(busy.items(), key=lambda kv: -kv[1])[:8]
    return "# P threads' CPU s: " + ", ".join(f"{k} {v:.2f}" for k, v in top if v > 0)


def parse() -> argparse.Namespace:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--block-bytes", type=int, default=4096)
    ap.add_argument("--workers", type=int, default=2, help="DataPlaneConfig.workers")
    ap.add_argument("--calls-per-peer", type=int, default=1, help="max_calls_per_peer")
    ap.add_argument("--transfers", type=int, default=4000)
    ap.add_argument("--concurrency-levels", type=int, nargs="+", default=[1, 64, 256])
    ap.add_argument("--one-process", action="store_true", help="P and D in one Trio thread")
    ap.add_argument("--threads", action="store_true", help="print P's busiest threads per level")
    ap.add_argument(
        "--old-rev", help="first run the same benchmark against the library at this git revision"
    )
    ap.add_argument("--curve", action="store_true", help="ZMQ CURVE on the side channel")
    ap.add_argument(
        "--compare-curve", action="store_true", help="run without and with --curve, print ratios"
    )
    ap.add_argument("--d-child", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--url", help=argparse.SUPPRESS)
    return ap.parse_args()


#: Both processes derive the same CURVE keys from it (a benchmark, not a secret).
BENCH_SECRET = "pdactors control-plane benchmark"


def transport(args: argparse.Namespace) -> Transport:
    return ZmqTransport(*curve_from_secret(BENCH_SECRET)) if args.curve else ZMQ


def compare_curve() -> None:
    """This benchmark without and with CURVE, one after the other, then the ratios per level."""
    argv = [a for a in sys.argv[1:] if a != "--compare-curve"]
    rows: list[dict[str, list[str]]] = []
    for extra in ([], ["--curve"]):
        out = subprocess.run(
            [sys.executable, __file__, *argv, *extra], check=True, capture_output=True, text=True
        ).stdout
        print(out, end="", flush=True)
        table = [line.split("|")[1:-1] for line in out.splitlines() if line.startswith("| ")]
        rows.append({cells[0].strip(): [c.strip() for c in cells] for cells in table[1:]})
    print(
        "\n| concurrency | transfers/s with / without CURVE | p50 with / without"
        " | p99 with / without |\n|---|---|---|---|"
    )
    off, on = rows
    for level, plain in off.items():
        if level not in on or not level.isdigit():
            continue
        cur = on[level]
        ratio = [float(cur[i]) / float(plain[i]) for i in (4, 2, 3)]
        print(f"| {level} | {ratio[0]:.2f} | {ratio[1]:.2f} | {ratio[2]:.2f} |")


def run_old(rev: str) -> None:
    """This benchmark, run against the ``pdactors`` of revision ``rev`` (P and D alike)."""
    argv = [a for a in sys.argv[1:] if a not in ("--old-rev", rev)]
    with worktree(rev) as tree:
        env = {**os.environ, "PYTHONPATH": str(tree)}
        print(f"## pdactors at {rev}", flush=True)
        subprocess.run([sys.executable, __file__, *argv], env=env, check=True)
    print("## pdactors now", flush=True)


if __name__ == "__main__":
    parsed = parse()
    if parsed.compare_curve:
        compare_curve()
        sys.exit(0)
    if parsed.old_rev and not parsed.d_child:
        run_old(parsed.old_rev)
    trio.run(d_main if parsed.d_child else p_main, parsed)
