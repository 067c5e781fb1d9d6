"""GPU data-plane efficiency: P on ``--p-device`` (cuda:0) and D on ``--d-device`` (cuda:1), in
two processes, over NVLink (or both on one GPU: ``--d-device cuda:0``).

CUDA refuses to open an IPC handle in the process that made it, so Mooncake's
``nvlink_intra`` transport needs P and D in different processes (as in a real deployment).
This script is D (parent: bootstrap, receiver, timings); it starts P as a child process
(``--role prefill``: sender, and the raw-engine comparison).

* **ours**: D's receiver pulls a transfer P has marked ready; timed on D from pull sent to
  answer received (planning, the side channel, the worker thread and the write included).
* **raw**: P calls ``TransferEngine.batch_transfer_sync_write`` once with the same coalesced
  descriptors, back to back.

Run on a machine with two NVLink-linked GPUs and ``mooncake-transfer-engine-cuda13``, with
``PYTHONPATH=.:integrations/vllm`` (the KV tensors come from ``pdactors_vllm.device_kv``):

    python bench/gpu_dataplane.py --scenario whole
    python bench/gpu_dataplane.py --scenario per-layer
    python bench/gpu_dataplane.py --scenario scattered
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from typing import Any

import numpy as np
import trio
from common import TimedPlane

from pdactors import (
    BootstrapConfig,
    DataPlaneConfig,
    ReceiverConfig,
    SenderConfig,
    open_mooncake,
    serve_bootstrap,
    serve_receiver,
    serve_sender,
    timeline,
)
from pdactors.core.plan import packed_layout, plan_transfer

SCENARIOS = {"whole": (63, False), "per-layer": (128, False), "scattered": (128, True)}


def block_ids(args: argparse.Namespace, pool: int, scattered: bool, side: int) -> list[int]:
    if not scattered:
        return list(range(args.blocks))
    return np.random.default_rng(side).permutation(pool)[: args.blocks].tolist()


def tensor(args: argparse.Namespace, pool: int, device: str) -> Any:
    from pdactors_vllm.device_kv import kv_tensor

    return kv_tensor((args.layers, pool, args.block_bytes), device)


def sync(device: str) -> None:
    """Wait for ``device``'s queued work (nothing to wait for on a CPU: the bench runs there
    too, over ``--protocol tcp``, to try it out)."""
    import torch

    if device.startswith("cuda"):
        torch.cuda.synchronize(device)


def pattern(t: Any) -> None:
    """Every (layer, block) gets a byte ramp offset by its index: checkable on D."""
    import torch

    layers, pool, block_bytes = t.shape
    ramp = torch.arange(block_bytes, device=t.device, dtype=torch.int64)
    idx = torch.arange(layers * pool, device=t.device, dtype=torch.int64).reshape(layers, pool, 1)
    t.copy_(((ramp + idx * 7) % 256).to(torch.uint8))


async def prefill(args: argparse.Namespace) -> None:
    """Child: P's sender over ``--p-device``, then raw writes into D's memory when asked."""

    pool, scattered = SCENARIOS[args.scenario]
    p_t = tensor(args, pool, args.p_device)
    pattern(p_t)
    sync(args.p_device)
    src = block_ids(args, pool, scattered, 1)
    dst = block_ids(args, pool, scattered, 2)
    p_layout = packed_layout(p_t.data_ptr(), args.layers, pool, args.block_bytes)
    d_layout = packed_layout(args.d_ptr, args.layers, pool, args.block_bytes)
    cfg = DataPlaneConfig(
        protocol=args.protocol, workers=args.workers, max_calls_per_peer=args.calls_per_peer,
        inline_max_bytes=args.inline_max_bytes,
    )  # fmt: skip
    async with open_mooncake(cfg) as plane, trio.open_nursery() as nursery:
        plane.register([(p_t.data_ptr(), p_t.numel())])
        config = SenderConfig(  # no checksums: the data plane alone (and P's default hasher
            # reads host memory: on GPU KV it would read device pointers, and crash)
            engine_id="p",
            bootstrap_url=args.bootstrap,
            unclaimed_ttl=3600,
            checksum_kv=False,
        )
        timed = TimedPlane(plane, time.perf_counter)
        sender = await nursery.start(serve_sender, config, timed, p_layout)
        for i in range(args.iters + args.requests + 1):
            sender.transfer_ready(f"w-{i}", src)
        for i in range(args.iters):
            sender.transfer_ready(f"e-{i}", src)
        print("READY", flush=True)
        await trio.to_thread.run_sync(sys.stdin.readline)  # D finished its pulls
        plan = plan_transfer(p_layout, src, d_layout, dst)
        s, d, n = plan.src.tolist(), plan.dst.tolist(), plan.lengths.tolist()
        k = cfg.max_descriptors_per_call
        engine = plane.engine

        def raw() -> float:
            start = time.perf_counter()
            for i in range(0, len(s), k):
                rc = engine.batch_transfer_sync_write(
                    args.d_session, s[i : i + k], d[i : i + k], n[i : i + k]
                )
                assert rc == 0, rc
            return time.perf_counter() - start

        for _ in range(2):
            raw()
        times = [raw() for _ in range(args.iters)]
        threaded = [await trio.to_thread.run_sync(raw) for _ in range(args.iters)]
        start = time.perf_counter()
        for _ in range(args.requests):
            raw()
        total = time.perf_counter() - start
        print(
            json.dumps(
                {
                    "raw": times,
                    "raw_total": total,
                    "descriptors": plan.descriptors,
                    "raw_in_thread": threaded,
                    "ours_write": [e - s for s, e, _ in timed.writes[1 : 1 + args.iters]],
                    "ours_engine": [e - s for s, e in timed.calls[1 : 1 + args.iters]],
                    "stages": timed.stages(1, args.iters),
                }
            ),
            flush=True,
        )
        nursery.cancel_scope.cancel()


async def decode(args: argparse.Namespace) -> None:
    """Parent: bootstrap and D's receiver over ``--d-device``; times our path, then asks P for
    raw."""
    import torch

    pool, scattered = SCENARIOS[args.scenario]
    d_t = tensor(args, pool, args.d_device)
    d_t.zero_()
    sync(args.d_device)
    dst = block_ids(args, pool, scattered, 2)
    src = block_ids(args, pool, scattered, 1)
    d_layout = packed_layout(d_t.data_ptr(), args.layers, pool, args.block_bytes)
    cfg = DataPlaneConfig(
        protocol=args.protocol, workers=args.workers, max_calls_per_peer=args.calls_per_peer,
        inline_max_bytes=args.inline_max_bytes,
    )  # fmt: skip
    async with open_mooncake(cfg) as plane, trio.open_nursery() as nursery:
        plane.register([(d_t.data_ptr(), d_t.numel())])
        url = await nursery.start(serve_bootstrap, BootstrapConfig())
        d_config = ReceiverConfig(verify_kv="off") if args.notice else ReceiverConfig()
        receiver = await nursery.start(serve_receiver, d_config, plane, d_layout)
        noticed: list[float] = []  # --notice: pull sent to P's landed notice heard, per pull
        child = subprocess.Popen(  # noqa: ASYNC220 (starting it does not block; reads go to threads)
            [sys.executable, __file__, *sys.argv[1:], "--role", "prefill", "--bootstrap", url,
             "--d-session", plane.session, "--d-ptr", str(d_t.data_ptr())],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
        )  # fmt: skip
        try:
            line = await trio.to_thread.run_sync(child.stdout.readline)  # type: ignore[union-attr]
            assert line.strip() == "READY", line

            async def pull(i: int) -> float:
                heard: list[float] = []
                landed = (lambda: heard.append(time.perf_counter())) if args.notice else None
                start = time.perf_counter()
                await receiver.pull(
                    f"w-{i}", bootstrap_url=url, engine_id="p", block_ids=dst, on_landed=landed
                )
                end = time.perf_counter()
                noticed.extend(t - start for t in heard)
                return end - start

            await pull(0)
            expected = torch.empty_like(d_t)
            pattern(expected)
            sync(args.d_device)
            ok = bool(torch.equal(d_t[:, dst, :], expected[:, src, :]))
            noticed.clear()
            ours = [await pull(1 + i) for i in range(args.iters)]
            ours_noticed = list(noticed)
            todo = iter(range(1 + args.iters, 1 + args.iters + args.requests))
            start = time.perf_counter()

            async def worker() -> None:
                for i in todo:
                    await pull(i)

            async with trio.open_nursery() as inner:
                for _ in range(args.concurrency):
                    inner.start_soon(worker)
            ours_total = time.perf_counter() - start
            empty = []
            for i in range(args.iters):  # D asks for no blocks: the control plane alone
                start = time.perf_counter()
                await receiver.pull(f"e-{i}", bootstrap_url=url, engine_id="p", block_ids=[])
                empty.append(time.perf_counter() - start)
            child.stdin.write("go\n")  # type: ignore[union-attr]
            child.stdin.flush()  # type: ignore[union-attr]
            result = json.loads(await trio.to_thread.run_sync(child.stdout.readline))  # type: ignore[union-attr]
        finally:
            child.stdin.close()  # type: ignore[union-attr]
            await trio.to_thread.run_sync(child.wait)
        # torch's own peer copy of the same bytes, for reference
        a = torch.empty(
            args.layers * args.blocks * args.block_bytes, dtype=torch.uint8, device=args.p_device
        )
        b = torch.empty_like(a, device=args.d_device)
        for _ in range(3):
            b.copy_(a)
        sync(args.p_device)
        sync(args.d_device)
        t0 = time.perf_counter()
        for _ in range(20):
            b.copy_(a)
        sync(args.p_device)
        sync(args.d_device)
        peer = (time.perf_counter() - t0) / 20
        nursery.cancel_scope.cancel()
    nbytes = args.layers * args.blocks * args.block_bytes
    o, r = statistics.median(ours), statistics.median(result["raw"])
    w, t = statistics.median(result["ours_write"]), statistics.median(result["raw_in_thread"])
    e, c = statistics.median(result["ours_engine"]), statistics.median(empty)
    print(
        f"# {args.scenario} (inline_max_bytes {args.inline_max_bytes}): inside our sender:"
        f" write p50 {w * 1e3:.3f} ms, of which the engine"
        f" call {e * 1e3:.3f} ms; raw call in a worker thread p50 {t * 1e3:.3f} ms;"
        f" empty pull (control plane only) p50 {c * 1e3:.3f} ms",
        file=sys.stderr,
    )
    stages = ", ".join(
        f"{name} {statistics.median(values) * 1e3:.3f}"
        for name, values in result["stages"].items()
        if values
    )
    print(f"# {args.scenario}: the write inside the sender in stages, p50 ms: {stages}",
          file=sys.stderr)  # fmt: skip
    if args.timeline:
        print_segments(args)
    if args.notice:
        n = statistics.median(ours_noticed) if ours_noticed else float("nan")
        print(
            f"# {args.scenario}, the same pulls: D knows from P's landed notice p50"
            f" {n * 1e3:.3f} ms ({len(ours_noticed)} of {len(ours)} heard), from P's PullDone"
            f" {o * 1e3:.3f} ms; notice / raw {n / r:.2f}, PullDone / raw {o / r:.2f}",
            file=sys.stderr,
        )
    print(
        f"| {args.scenario} | {result['descriptors']} | {ok} | {o * 1e3:.3f} | {r * 1e3:.3f}"
        f" | {nbytes / o / 1e9:.1f} | {nbytes / r / 1e9:.1f} | {r / o:.3f}"
        f" | {args.requests * nbytes / ours_total / 1e9:.1f}"
        f" | {args.requests * nbytes / result['raw_total'] / 1e9:.1f}"
        f" | {result['raw_total'] / ours_total:.3f} | {nbytes / peer / 1e9:.1f} |",
        flush=True,
    )


#: The timeline's segments of one pull (``--timeline``): a pull with blocks, an empty one.
SEGMENTS = {
    "w": [("pull_sent", "pull_at_p"), ("pull_at_p", "write_start"),
          ("write_start", "write_end"), ("write_end", "landed")],
    "e": [("pull_sent", "pull_at_p"), ("pull_at_p", "landed")],
}  # fmt: skip


def print_segments(args: argparse.Namespace) -> None:
    """Where a pull's time goes, p50 of the timed pulls, from both processes' marks."""
    marks = timeline.read_timelines(args.timeline)
    for kind, segments in SEGMENTS.items():
        cut = []
        for a, b in segments:
            spans = [
                m[b] - m[a]
                for i in range(1, args.iters)
                if a in (m := marks.get(f"{kind}-{i}", {})) and b in m
            ]
            if spans:
                cut.append(f"{a} -> {b} {statistics.median(spans) * 1e3:.3f}")
        what = "pull" if kind == "w" else "empty pull"
        print(f"# {args.scenario}: a {what} on the timeline, p50 ms: {', '.join(cut)}",
              file=sys.stderr)  # fmt: skip


HEADER = (
    "| scenario | desc | bytes ok | ours p50 ms | raw p50 ms | ours GB/s | raw GB/s | latency ratio"
    " | tput ours GB/s | tput raw GB/s | tput ratio | torch peer copy GB/s |"
)


def parse() -> argparse.Namespace:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--role", choices=["decode", "prefill"], default="decode")
    ap.add_argument("--scenario", choices=sorted(SCENARIOS), default="whole")
    ap.add_argument(
        "--inline-max-bytes", type=int, default=None,
        help="DataPlaneConfig.inline_max_bytes: calls up to this size made in the Trio thread"
        " (default: the protocol's, 256 MiB for nvlink_intra, else 0)",
    )  # fmt: skip
    ap.add_argument(
        "--notice", action="store_true",
        help="D asks for P's landed notice (verify_kv off) and says when it came",
    )  # fmt: skip
    ap.add_argument(
        "--timeline", default="",
        help="a file for both processes' timeline marks: print where a pull's time goes",
    )  # fmt: skip
    ap.add_argument(
        "--profile", default="",
        help="a directory: each process runs under cProfile and leaves ROLE.prof there",
    )  # fmt: skip
    ap.add_argument("--protocol", default="nvlink_intra")
    ap.add_argument("--p-device", default="cuda:0", help="P's GPU")
    ap.add_argument("--d-device", default="cuda:1", help="D's GPU (may be P's: two processes)")
    ap.add_argument("--layers", type=int, default=36)
    ap.add_argument("--blocks", type=int, default=63)
    ap.add_argument("--block-bytes", type=int, default=64 * 1024)
    ap.add_argument("--iters", type=int, default=30)
    ap.add_argument("--requests", type=int, default=64)
    ap.add_argument("--concurrency", type=int, default=2)
    ap.add_argument("--workers", type=int, default=2, help="DataPlaneConfig.workers")
    ap.add_argument("--calls-per-peer", type=int, default=1, help="max_calls_per_peer")
    ap.add_argument("--header", action="store_true", help="print the table header first")
    ap.add_argument("--bootstrap", default="")
    ap.add_argument("--d-session", default="")
    ap.add_argument("--d-ptr", type=int, default=0)
    return ap.parse_args()


if __name__ == "__main__":
    ns = parse()
    if ns.timeline:
        timeline.enable(ns.timeline)
    for name, value in DataPlaneConfig(protocol=ns.protocol).mooncake_environment().items():
        os.environ.setdefault(name, value)  # nvlink_intra: the intra-node NVLink transport
    if ns.header and ns.role == "decode":
        print(HEADER + "\n|" + "---|" * 12, flush=True)
    main = prefill if ns.role == "prefill" else decode
    if ns.profile:
        import cProfile

        cProfile.run("trio.run(main, ns)", os.path.join(ns.profile, f"{ns.role}.prof"))
    else:
        trio.run(main, ns)
