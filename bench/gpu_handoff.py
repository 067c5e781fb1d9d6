"""KV hand-off after a simulated prefill: from the last layer's end to D knowing its KV landed.

P computes a request's KV layer by layer: per layer, a CUDA kernel of ``--layer-ms`` (a
calibrated ``torch.cuda._sleep``), then a small kernel that fills that layer's blocks, then a
CUDA event. D's pull is at P before the prefill starts (the common order). Modes, per request:

* **control**: D asks for no blocks; P says ready after the prefill (the control plane alone:
  the baseline the others are measured against).
* **whole**: P says ready one forward after the prefill (the old path: vLLM hands the KV over a
  step later; modelled as one more forward of ``--layers`` x ``--layer-ms``).
* **eager**: P says ready as soon as the forward is enqueued, with ``complete=`` the last
  layer's event wait: the write's own worker thread waits for the GPU, then calls the engine
  (what the connector does now).
* **eager_hop**: P waits for the last layer's event in a worker thread, then says ready (the
  connector before: one more thread hop and Trio wake-up before the write starts).
* **layerwise**: ``transfer_streaming`` before the prefill, then at once ``layer_ready`` for
  every layer with its event's wait as ``complete=``, and ``transfer_ready``: each layer's write
  thread waits for that layer's kernels and writes it while P computes the next ones.
* **layerwise_hop**: as layerwise, but ``layer_ready`` is called from Trio after each layer's
  event was waited for in a worker thread (the connector before).
* **eager_notice**, **layerwise_notice**: as eager and layerwise, with D's pull asking for P's
  landed notice (the fast completion path, issue 28: ``on_landed``; needs ``--checksums off``,
  since D verifies in Trio otherwise): D knows when its notices thread hears from P's write
  thread, not when P's ``PullDone`` reached D's Trio loop.
* **raw**: P writes the same bytes with one ``batch_transfer_sync_write`` of the coalesced
  descriptors once the prefill ended, in the thread that waited for the last layer's event
  (no D told, no thread hop: the data movement alone, after a prefill).

The tail is taken from the last layer's end (wall clock in P right after the last event's
``synchronize`` returns) to D knowing (wall clock in D when ``receiver.pull`` returns; raw: when
the engine call returns in P). Both processes are on one machine, so wall clocks compare.
Hidden = 1 - (tail - control tail) / raw write of the whole request (standalone), the
fraction of the transfer that did not show after the prefill. Bytes are verified on D for every
request (each request fills its blocks with a pattern of its own).

KV checksums (``--checksums on``, the default, as deployed): P hashes what it writes and D what
landed with ``pdactors_vllm.device_sums`` (torch ops on the KV's device; run with
``PYTHONPATH=.:integrations/vllm``, which also gives the KV tensors:
``pdactors_vllm.device_kv``); ``--checksums off`` for the tail without them.

P is a child process (``--role prefill``; CUDA will not open an IPC handle in the process that
made it, so ``nvlink_intra`` needs two processes); D is the parent. One GPU holds both with
``--p-device cuda:0 --d-device cuda:0``. A CPU smoke test: ``--device cpu --protocol tcp``.

    python bench/gpu_handoff.py --p-device cuda:0 --d-device cuda:0 --layer-ms 0.5
    python bench/gpu_handoff.py --device cpu --protocol tcp --layers 4 --blocks 4 --requests 5
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from functools import partial
from typing import Any

os.environ.setdefault("MC_LOG_LEVEL", "ERROR")

import numpy as np
import trio
from common import TimedPlane, busy_python

from pdactors import (
    BootstrapConfig,
    DataPlaneConfig,
    ReceiverConfig,
    SenderConfig,
    open_mooncake,
    serve_bootstrap,
    serve_receiver,
    serve_sender,
)
from pdactors.core.plan import packed_layout, plan_transfer
from pdactors.core.send_table import SendState

MODES = ("control", "whole", "eager", "eager_hop", "layerwise", "layerwise_hop", "raw",
         "eager_notice", "layerwise_notice")  # fmt: skip

now = time.time  # wall clock: compares across the two processes of one machine


def schedule(args: argparse.Namespace) -> list[tuple[int, str]]:
    """Rounds of every mode, the warm-up first; the same on both sides."""
    return [(i, m) for i in range(args.warmup + args.requests) for m in args.modes]


def salt(i: int, mode: str) -> int:
    """Each request's pattern differs from the one before it in D's blocks."""
    return (i * 31 + MODES.index(mode) * 7 + 1) % 256


def regions(args: argparse.Namespace) -> int:
    return args.layers * args.regions_per_layer


def kv_tensor(args: argparse.Namespace, device: str) -> Any:
    from pdactors_vllm.device_kv import kv_tensor as zeroed

    return zeroed((regions(args), args.pool, args.block_bytes), device)


def reference(args: argparse.Namespace, device: str) -> Any:
    """The request's KV before its salt: a byte ramp offset by (region, block)."""
    import torch

    r, n, bb = regions(args), args.blocks, args.block_bytes
    ramp = torch.arange(bb, device=device, dtype=torch.int64)
    idx = torch.arange(r * n, device=device, dtype=torch.int64).reshape(r, n, 1)
    return ((ramp + idx * 7) % 256).to(torch.uint8)


def kv_hasher(args: argparse.Namespace, kv: Any) -> Any:
    """The KV checksums' hasher of ``kv`` (torch ops on its device), or None when off."""
    if args.checksums == "off":
        return None
    from pdactors_vllm.device_sums import TorchRunHasher

    return TorchRunHasher([kv])


def sync(device: str) -> None:
    import torch

    if device.startswith("cuda"):
        torch.cuda.synchronize(device)


class Prefill:
    """The simulated prefill of one request: per layer, compute, then fill its blocks.

    ``launch`` enqueues a whole forward at once (as a model runner does) and returns one
    waiter per layer; a waiter blocks until its layer is done and returns the wall clock then.
    """

    def __init__(self, args: argparse.Namespace, kv: Any, ref: Any) -> None:
        self.args, self.kv, self.ref = args, kv, ref
        self.device: str = args.p_device
        self.gpu = self.device.startswith("cuda")
        self.cycles = 0
        self.stream: Any = None
        if self.gpu:
            import torch

            self.stream = (
                torch.cuda.default_stream(self.device)
                if args.stream == "default"
                else torch.cuda.Stream(self.device)
            )
            self.cycles = self._calibrate()

    def _calibrate(self) -> int:
        import torch

        probe = 20_000_000
        with torch.cuda.stream(self.stream):
            torch.cuda._sleep(1000)
            start = torch.cuda.Event(enable_timing=True)
            end = torch.cuda.Event(enable_timing=True)
            rates = []
            for _ in range(3):
                start.record(self.stream)
                torch.cuda._sleep(probe)
                end.record(self.stream)
                end.synchronize()
                rates.append(probe / start.elapsed_time(end))
        return int(statistics.median(rates) * self.args.layer_ms)

    def _fill(self, layer: int, s: int) -> None:
        import torch

        rpl, n = self.args.regions_per_layer, self.args.blocks
        rows = slice(layer * rpl, (layer + 1) * rpl)
        torch.add(self.ref[rows], s, out=self.kv[rows, :n])

    def launch(self, s: int) -> list[Callable[[], float]]:
        if not self.gpu:
            return self._launch_cpu(s)
        import torch

        waiters = []
        with torch.cuda.stream(self.stream):
            for layer in range(self.args.layers):
                torch.cuda._sleep(self.cycles)
                self._fill(layer, s)
                event = torch.cuda.Event()
                event.record(self.stream)
                waiters.append(_event_waiter(event))
        return waiters

    def forward(self) -> Callable[[], float]:
        """One more forward with no KV of this request (the old path's extra step)."""
        if not self.gpu:
            done = threading.Event()
            stamp: list[float] = []

            def run() -> None:
                time.sleep(self.args.layers * self.args.layer_ms / 1e3)
                stamp.append(now())
                done.set()

            threading.Thread(target=run, daemon=True).start()
            return lambda: (done.wait(), stamp[0])[1]
        import torch

        with torch.cuda.stream(self.stream):
            torch.cuda._sleep(self.cycles * self.args.layers)
            event = torch.cuda.Event()
            event.record(self.stream)
        return _event_waiter(event)

    def _launch_cpu(self, s: int) -> list[Callable[[], float]]:
        layers = self.args.layers
        done = [threading.Event() for _ in range(layers)]
        stamps = [0.0] * layers

        def run() -> None:
            for layer in range(layers):
                time.sleep(self.args.layer_ms / 1e3)
                self._fill(layer, s)
                stamps[layer] = now()
                done[layer].set()

        threading.Thread(target=run, daemon=True).start()

        def waiter(layer: int) -> Callable[[], float]:
            return lambda: (done[layer].wait(), stamps[layer])[1]

        return [waiter(layer) for layer in range(layers)]


def _event_waiter(event: Any) -> Callable[[], float]:
    def wait() -> float:
        event.synchronize()
        return now()

    return wait


def plane_config(args: argparse.Namespace) -> DataPlaneConfig:
    return DataPlaneConfig(
        protocol=args.protocol, workers=args.workers, max_calls_per_peer=args.calls_per_peer
    )


async def prefill(args: argparse.Namespace) -> None:
    """Child: P's sender and the simulated prefill; raw writes into D's memory."""
    kv = kv_tensor(args, args.p_device)
    ref = reference(args, args.p_device)
    sync(args.p_device)
    src = list(range(args.blocks))
    dst = list(range(args.blocks))
    nreg, rpl = regions(args), args.regions_per_layer
    p_layout = packed_layout(kv.data_ptr(), nreg, args.pool, args.block_bytes)
    d_layout = packed_layout(args.d_ptr, nreg, args.pool, args.block_bytes)
    cfg = plane_config(args)
    async with open_mooncake(cfg) as plane, trio.open_nursery() as nursery:
        plane.register([(kv.data_ptr(), kv.numel())])
        engine = plane.engine
        config = SenderConfig(
            engine_id="p", bootstrap_url=args.bootstrap, unclaimed_ttl=3600,
            checksum_kv=args.checksums == "on",
        )  # fmt: skip
        timed = TimedPlane(plane, now)
        sender = await nursery.start(
            partial(serve_sender, hasher=kv_hasher(args, kv)), config, timed, p_layout
        )
        work = Prefill(args, kv, ref)
        k = cfg.max_descriptors_per_call

        def raw_call(plan: Any) -> Callable[[], None]:
            s, d, n = plan.src.tolist(), plan.dst.tolist(), plan.lengths.tolist()

            def call() -> None:
                for i in range(0, len(s), k):
                    rc = engine.batch_transfer_sync_write(
                        args.d_session, s[i : i + k], d[i : i + k], n[i : i + k]
                    )
                    assert rc == 0, rc

            return call

        whole_plan = plan_transfer(p_layout, src, d_layout, dst)
        raw_whole = raw_call(whole_plan)
        layer_plan = plan_transfer(p_layout, src, d_layout, dst, list(range(rpl)))
        raw_layer = raw_call(layer_plan)
        print("READY", flush=True)

        released: set[str] = set()
        records = []
        for i, mode in schedule(args):
            tid = f"{mode}-{i}"
            s = salt(i, mode)
            rec: dict[str, Any] = {"tid": tid, "mode": mode, "i": i}
            kind = mode.removesuffix("_notice")  # P does the same; D asks for the notice
            if mode != "raw":
                while sender.transfer_state(tid) is None:  # noqa: ASYNC110 (D's pull is not here yet)
                    await trio.sleep(0.0002)
                sender.transfer_pending(tid)
            first_write, first_call = len(timed.writes), len(timed.calls)
            if mode.startswith("layerwise"):
                sender.transfer_streaming(tid, src)
                rec["streamed"] = sender.transfer_state(tid) is SendState.SENDING
            rec["t_launch"] = now()
            waiters = work.launch(s)

            def ended(wait: Callable[[], float], rec: dict[str, Any] = rec) -> Callable[[], None]:
                """``wait``, noting the last layer's end (in the thread that waits)."""

                def complete() -> None:
                    rec["t_end"] = wait()

                return complete

            def layer(i: int) -> list[int]:
                return list(range(i * rpl, (i + 1) * rpl))

            if kind == "eager":
                sender.transfer_ready(tid, src, complete=ended(waiters[-1]))
            elif kind == "layerwise":
                for i, wait in enumerate(waiters):
                    last = i == len(waiters) - 1
                    sender.layer_ready(tid, layer(i), complete=ended(wait) if last else wait)
                # Not streamed (no pull yet): the whole send waits for the last layer itself.
                sender.transfer_ready(tid, src, complete=ended(waiters[-1]))
            elif mode == "layerwise_hop":
                for i, wait in enumerate(waiters):
                    rec["t_end"] = await trio.to_thread.run_sync(wait)
                    sender.layer_ready(tid, layer(i))
            elif mode == "raw":  # the thread that saw the last layer end makes the call

                def wait_and_write(rec: dict[str, Any] = rec, last: Any = waiters[-1]) -> None:
                    rec["t_end"] = last()
                    raw_whole()
                    rec["t_done"] = now()

                await trio.to_thread.run_sync(wait_and_write)
            else:
                rec["t_end"] = await trio.to_thread.run_sync(waiters[-1])
            if mode == "whole":
                await trio.to_thread.run_sync(work.forward())
            if mode == "raw":
                print(f"RAW {tid}", flush=True)
            elif kind in ("eager", "layerwise"):
                while tid not in released:
                    released |= await sender.wait_finished()
                rec["writes"] = timed.writes[first_write:]
                rec["calls"] = timed.calls[first_call:]
            else:
                rec["t_ready"] = now()
                sender.transfer_ready(tid, [] if mode == "control" else src)
                while tid not in released:
                    released |= await sender.wait_finished()
                rec["writes"] = timed.writes[first_write:]
                rec["calls"] = timed.calls[first_call:]
            records.append(rec)
            # The next request's bytes (a raw write asks D nothing) must not land in D's
            # blocks while D still checks this one's.
            line = await trio.to_thread.run_sync(sys.stdin.readline)
            assert line.split() == ["CHECKED", tid], line

        await trio.to_thread.run_sync(sys.stdin.readline)  # D has checked the last request

        def timed_call(call: Callable[[], None]) -> float:
            start = time.perf_counter()
            call()
            return time.perf_counter() - start

        for call in (raw_whole, raw_layer):
            for _ in range(3):
                call()
        standalone = {
            "raw_whole": [timed_call(raw_whole) for _ in range(args.requests)],
            "raw_layer": [timed_call(raw_layer) for _ in range(args.requests)],
            "whole_descriptors": whole_plan.descriptors,
            "layer_descriptors": layer_plan.descriptors,
            "nbytes": whole_plan.nbytes,
            "layer_nbytes": layer_plan.nbytes,
            "cycles_per_layer": work.cycles,
        }
        print(json.dumps({"records": records, **standalone}), flush=True)
        nursery.cancel_scope.cancel()


async def decode(args: argparse.Namespace) -> None:
    """Parent: bootstrap and D's receiver; pulls each request before P's prefill starts."""
    d_t = kv_tensor(args, args.d_device)
    ref = reference(args, args.d_device)
    sync(args.d_device)
    dst = list(range(args.blocks))
    n = args.blocks
    d_layout = packed_layout(d_t.data_ptr(), regions(args), args.pool, args.block_bytes)
    known: dict[str, float] = {}
    early: dict[str, float] = {}  # when D's notices thread heard P's landed notice
    ok: dict[str, list[bool]] = {m: [] for m in args.modes}

    def check(i: int, mode: str) -> None:
        import torch

        want = torch.add(ref, salt(i, mode))
        ok[mode].append(bool(torch.equal(d_t[:, :n], want)))

    async with open_mooncake(plane_config(args)) as plane, trio.open_nursery() as nursery:
        plane.register([(d_t.data_ptr(), d_t.numel())])
        url = await nursery.start(serve_bootstrap, BootstrapConfig())
        receiver = await nursery.start(
            partial(serve_receiver, hasher=kv_hasher(args, d_t)),
            ReceiverConfig(verify_kv=args.checksums),
            plane,
            d_layout,
        )
        child = subprocess.Popen(  # noqa: ASYNC220 (starting it does not block; reads go to threads)
            [sys.executable, __file__, *sys.argv[1:], "--role", "prefill", "--bootstrap", url,
             "--d-session", plane.session, "--d-ptr", str(d_t.data_ptr())],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
        )  # fmt: skip
        assert child.stdin is not None and child.stdout is not None
        readline = child.stdout.readline
        try:
            line = await trio.to_thread.run_sync(readline)
            assert line.strip() == "READY", line
            for i, mode in schedule(args):
                tid = f"{mode}-{i}"
                if mode == "raw":
                    line = await trio.to_thread.run_sync(readline)
                    assert line.split() == ["RAW", tid], line
                else:
                    blocks = [] if mode == "control" else dst
                    landed = None
                    if mode.endswith("_notice"):
                        landed = partial(_note, early, tid)
                    await receiver.pull(
                        tid, bootstrap_url=url, engine_id="p", block_ids=blocks, on_landed=landed
                    )
                    known[tid] = early.get(tid, now())
                if mode != "control":
                    sync(args.d_device)
                    check(i, mode)
                child.stdin.write(f"CHECKED {tid}\n")
                child.stdin.flush()
            child.stdin.write("go\n")
            child.stdin.flush()
            result = json.loads(await trio.to_thread.run_sync(readline))
        finally:
            child.stdin.close()
            await trio.to_thread.run_sync(child.wait)
        nursery.cancel_scope.cancel()
    report(args, result, known, ok)


def _note(times: dict[str, float], tid: str) -> None:
    """``on_landed``, in D's notices thread: the wall clock when D heard P's notice."""
    times[tid] = now()


def ms(x: float) -> str:
    return f"{x * 1e3:.3f}"


def report(
    args: argparse.Namespace,
    result: dict[str, Any],
    known: dict[str, float],
    ok: dict[str, list[bool]],
) -> None:
    recs = [r for r in result["records"] if r["i"] >= args.warmup]
    nbytes = result["nbytes"]
    raw_whole = statistics.median(result["raw_whole"])
    raw_layer = statistics.median(result["raw_layer"])
    prefill_s = [r["t_end"] - r["t_launch"] for r in recs]
    rows: dict[str, dict[str, float]] = {}
    for mode in args.modes:
        mine = [r for r in recs if r["mode"] == mode]
        tails, last_write, reply, before, to_call, in_call, after_call = [], [], [], [], [], [], []
        for r in mine:
            done = r["t_done"] if mode == "raw" else known[r["tid"]]
            tails.append(done - r["t_end"])
            writes = r.get("writes") or []
            if writes:
                last_write.append(writes[-1][1] - r["t_end"])
                reply.append(done - writes[-1][1])
            if calls := r.get("calls"):  # the engine call that ended last, in its thread
                start, end = max(calls, key=lambda c: c[1])
                to_call.append(start - r["t_end"])
                in_call.append(end - start)
                after_call.append(done - end)
            if mode != "control":
                landed = sum(b for _, end, b in writes if end <= r["t_end"])
                before.append(landed / nbytes)
        rows[mode] = {
            "n": len(mine),
            "tail50": statistics.median(tails),
            "tail90": float(np.percentile(tails, 90)),
            "write50": statistics.median(last_write) if last_write else float("nan"),
            "reply50": statistics.median(reply) if reply else float("nan"),
            "before": statistics.median(before) if before else float("nan"),
            "writes": statistics.median(len(r.get("writes") or []) for r in mine),
            "streamed": sum(bool(r.get("streamed")) for r in mine),
            "to_call": statistics.median(to_call) if to_call else float("nan"),
            "in_call": statistics.median(in_call) if in_call else float("nan"),
            "after_call": statistics.median(after_call) if after_call else float("nan"),
        }
    base = rows["control"]["tail50"] if "control" in rows else 0.0
    eager = rows["eager"]["tail50"] if "eager" in rows else float("nan")
    print(
        f"# {args.protocol} P {args.p_device} D {args.d_device}, {args.stream} stream,"
        f" checksums {args.checksums}:"
        f" {args.layers} layers x {args.regions_per_layer} regions, {args.blocks} blocks of"
        f" {args.block_bytes} B ({nbytes / 2**20:.2f} MiB; {result['whole_descriptors']}"
        f" descriptors, {result['layer_descriptors']} per layer), layer {args.layer_ms} ms"
        f" ({result['cycles_per_layer']} cycles), prefill p50 {ms(statistics.median(prefill_s))}"
        f" ms; {args.requests} requests after {args.warmup} warm-up"
    )
    print(
        f"# standalone raw write p50: whole {ms(raw_whole)} ms"
        f" ({nbytes / raw_whole / 1e9:.1f} GB/s), one layer {ms(raw_layer)} ms;"
        f" control-plane baseline (control tail p50) {ms(base)} ms"
    )
    print(
        "| mode | n | bytes ok | tail p50 ms | tail p90 ms | last write end - layer end p50 ms"
        " | D told after last write p50 ms | writes | streamed | landed before prefill end"
        " | hidden vs raw | tail / raw write | hidden vs eager |"
    )
    print("|" + "---|" * 13)
    for mode, row in rows.items():
        good = ok.get(mode, [])
        checked = f"{sum(good)}/{len(good)}" if mode != "control" else "-"
        hidden = vs_eager = "-"  # the control plane's own path: no transfer to hide
        if mode not in ("control", "raw"):
            hidden = f"{1 - (row['tail50'] - base) / raw_whole:.2f}"
            vs_eager = f"{1 - (row['tail50'] - base) / (eager - base):.2f}"
        print(
            f"| {mode} | {row['n']} | {checked} | {ms(row['tail50'])} | {ms(row['tail90'])}"
            f" | {ms(row['write50'])} | {ms(row['reply50'])} | {row['writes']:g}"
            f" | {row['streamed']} | {row['before']:.2f} | {hidden}"
            f" | {row['tail50'] / raw_whole:.2f} | {vs_eager} |"
        )
    print("# where the tail goes (p50 ms, in P's worker thread and D): last layer's end ->")
    print("| mode | the last engine call starts | that call | its end -> D knows |")
    print("|---|---|---|---|")
    for mode, row in rows.items():
        if row["in_call"] == row["in_call"]:  # (not NaN: the mode made engine calls)
            print(
                f"| {mode} | {ms(row['to_call'])} | {ms(row['in_call'])}"
                f" | {ms(row['after_call'])} |"
            )
    for mode in ("eager", "eager_notice"):
        if mode in rows:
            tail, target = rows[mode]["tail50"], 1e-4 + raw_whole
            print(
                f"# issue 28 (D knows <= raw write + 0.1 ms = {ms(target)} ms after the last"
                f" layer): {mode} tail p50 {ms(tail)} ms -> {'met' if tail <= target else 'missed'}"
            )
            if "raw" in rows:  # the same call made after the prefill, nothing else on the path
                flow = rows["raw"]["tail50"] + 1e-4
                print(
                    f"# against the raw call after the prefill + 0.1 ms = {ms(flow)} ms: {mode}"
                    f" tail p50 {ms(tail)} ms -> {'met' if tail <= flow else 'missed'}"
                )
    for mode in ("layerwise", "layerwise_notice"):
        if mode not in rows:
            continue
        tail = rows[mode]["tail50"]
        target = 1e-4 + raw_layer
        hidden = 1 - (tail - base) / raw_whole
        verdict = "met" if tail <= target else "missed"
        print(
            f"# target 1 (D knows <= 0.1 ms + one layer's raw write = {ms(target)} ms after the"
            f" last layer): {mode} tail p50 {ms(tail)} ms -> {verdict}"
        )
        print(
            f"# target 2 (>= 80 % of the transfer hidden): {mode} hidden vs raw {hidden:.2f}"
            f" -> {'met' if hidden >= 0.8 else 'missed'}"
        )
    sys.stdout.flush()


def parse() -> argparse.Namespace:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--role", choices=["decode", "prefill"], default="decode")
    ap.add_argument("--protocol", default="nvlink_intra")
    ap.add_argument("--device", default=None, help="both P's and D's device (e.g. cpu)")
    ap.add_argument("--p-device", default="cuda:0")
    ap.add_argument("--d-device", default="cuda:1")
    ap.add_argument("--layers", type=int, default=36)
    ap.add_argument("--regions-per-layer", type=int, default=1, help="2: K and V apart")
    ap.add_argument("--blocks", type=int, default=63, help="blocks of the request")
    ap.add_argument("--pool", type=int, default=128, help="blocks per region")
    ap.add_argument("--block-bytes", type=int, default=64 * 1024)
    ap.add_argument("--layer-ms", type=float, default=0.5, help="simulated compute per layer")
    ap.add_argument("--stream", choices=["side", "default"], default="side",
                    help="prefill on its own stream or on the legacy default stream")  # fmt: skip
    ap.add_argument("--checksums", choices=["on", "off"], default="on",
                    help="KV checksums (torch ops on the KV's device), as deployed")  # fmt: skip
    ap.add_argument("--modes", type=lambda s: s.split(","), default=list(MODES))
    ap.add_argument("--requests", type=int, default=30, help="per mode, after the warm-up")
    ap.add_argument("--warmup", type=int, default=3, help="rounds not counted")
    ap.add_argument("--workers", type=int, default=2, help="DataPlaneConfig.workers")
    ap.add_argument("--calls-per-peer", type=int, default=1, help="max_calls_per_peer")
    ap.add_argument(
        "--busy-python", action="store_true",
        help="a thread in P and in D runs Python all along, as a vLLM forward holds the GIL",
    )  # fmt: skip
    ap.add_argument(
        "--gil-switch-ms", type=float, default=0,
        help="the GIL switch interval in P and D (the connector's gil_switch_ms; 0: Python's)",
    )  # fmt: skip
    ap.add_argument("--bootstrap", default="")
    ap.add_argument("--d-session", default="")
    ap.add_argument("--d-ptr", type=int, default=0)
    args = ap.parse_args()
    if args.device is not None:
        args.p_device = args.d_device = args.device
    bad = [m for m in args.modes if m not in MODES]
    if bad:
        ap.error(f"unknown modes {bad}; choose from {','.join(MODES)}")
    if args.blocks > args.pool:
        ap.error("--blocks must not exceed --pool")
    return args


if __name__ == "__main__":
    ns = parse()
    for name, value in plane_config(ns).mooncake_environment().items():
        os.environ.setdefault(name, value)  # nvlink_intra: the intra-node NVLink transport
    if ns.gil_switch_ms:
        sys.setswitchinterval(ns.gil_switch_ms / 1000)
    if ns.busy_python:
        busy_python()
    trio.run(prefill if ns.role == "prefill" else decode, ns)
