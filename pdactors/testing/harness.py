"""``pdactors harness``: many requests through a 1P1D cluster (of any TP shapes), every byte
verified on D; the workers in this process (:mod:`pdactors.testing.cluster`) or each in a
process of its own, KV in host or GPU memory (:mod:`pdactors.testing.process_cluster`)."""

from __future__ import annotations

import contextlib
import secrets
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass
from typing import Protocol

import numpy as np
import trio
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from pdactors.config import DataPlaneConfig, ReceiverConfig, SenderConfig
from pdactors.dataplane.base import DataPlane
from pdactors.errors import ConfigError
from pdactors.testing.cluster import Cluster, TransferOutcome, open_cluster, run_transfer
from pdactors.testing.corruption import CORRUPTIONS, CorruptingDataPlane
from pdactors.testing.process_cluster import open_process_cluster
from pdactors.transport import ZMQ, ZmqTransport
from pdactors.transport.curve import curve_from_secret

__all__ = ["HarnessReport", "run_harness"]


@dataclass(frozen=True, slots=True)
class HarnessReport:
    """What a harness run measured. Latency is from D's pull to P's answer, in seconds."""

    requests: int
    ok: int
    verified: int
    failed: dict[str, str]
    bytes_per_request: int
    seconds: float
    latencies: tuple[float, ...]
    blocks_leaked: int
    #: Descriptors P's workers wrote per request, all together (after coalescing).
    descriptors_per_request: float = 0.0
    #: Corruptions injected in flight, and transfers that failed naming a checksum mismatch.
    corrupted: int = 0
    caught: int = 0

    @property
    def slipped(self) -> int:
        """Transfers delivered with wrong bytes (what a check must never let through)."""
        return self.ok - self.verified

    @property
    def gbps(self) -> float:
        """Verified payload moved per second of wall time, in GB/s (10^9 bytes)."""
        return self.verified * self.bytes_per_request / self.seconds / 1e9 if self.seconds else 0.0

    def percentile(self, q: float) -> float:
        return float(np.percentile(self.latencies, q)) if self.latencies else float("nan")

    @property
    def passed(self) -> bool:
        clean = self.blocks_leaked == 0 and self.slipped == 0
        if self.corrupted:  # each corruption caught, every other transfer verified
            caught = self.caught == self.corrupted
            return clean and caught and self.verified + self.caught == self.requests
        return clean and self.verified == self.requests

    def summary(self) -> str:
        mib = self.bytes_per_request / 2**20
        lines = [
            f"requests   {self.requests} x {mib:.2f} MiB: {self.ok} ok, {self.verified} verified,"
            f" {len(self.failed)} failed, {self.blocks_leaked} blocks leaked",
            f"throughput {self.gbps:.3f} GB/s ({self.seconds:.3f} s wall)",
            "latency    p50 {:.2f} ms  p90 {:.2f} ms  p99 {:.2f} ms  max {:.2f} ms".format(
                *(1e3 * self.percentile(q) for q in (50, 90, 99, 100))
            ),
        ]
        if self.corrupted:
            lines.append(f"corruption {self.corrupted} injected in flight, {self.caught} caught "
                         f"by the KV checksums, {self.slipped} delivered wrong")  # fmt: skip
        lines += [f"failed     {tid}: {reason}" for tid, reason in list(self.failed.items())[:5]]
        return "\n".join(lines)


@contextlib.contextmanager
def _progress(total: int, enabled: bool) -> Iterator[Progress | None]:
    if not enabled:
        yield None
        return
    columns = (
        TextColumn("transfers"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
    )
    with Progress(*columns, transient=True) as progress:
        yield progress


class _Driven(Protocol):
    """What the harness drives: an in-process :class:`Cluster` or a :class:`ProcessCluster`."""

    async def run_transfer(self, transfer_id: str, num_blocks: int) -> TransferOutcome: ...

    async def wait_settled(self) -> None: ...

    def blocks_in_use(self) -> int: ...

    async def descriptors_sent(self) -> int: ...


@dataclass(frozen=True, slots=True)
class _InProcess:
    cluster: Cluster

    async def run_transfer(self, transfer_id: str, num_blocks: int) -> TransferOutcome:
        return await run_transfer(self.cluster, transfer_id, num_blocks)

    async def wait_settled(self) -> None:
        await self.cluster.wait_settled()

    def blocks_in_use(self) -> int:
        return self.cluster.blocks_in_use()

    async def descriptors_sent(self) -> int:
        await trio.lowlevel.checkpoint()
        return sum(n.sender.descriptors_sent for n in self.cluster.prefill)


async def run_harness(
    *,
    requests: int = 8,
    blocks: int = 63,
    layers: int = 36,
    block_bytes: int = 64 * 1024,
    concurrency: int = 1,
    dataplane: DataPlaneConfig | None = None,
    progress: bool = False,
    p_tp: int = 1,
    d_tp: int = 1,
    kv_heads: int = 0,
    secure: bool = False,
    checksums: bool = True,
    corrupt_every: int = 0,
    processes: bool = False,
    kv_device: str = "cpu",
    on_report: Callable[[HarnessReport], None] | None = None,
) -> HarnessReport:
    """Run ``requests`` transfers of ``blocks`` × ``layers`` × ``block_bytes`` bytes, at most
    ``concurrency`` at once, through a bootstrap, one P engine of ``p_tp`` senders and one D
    engine of ``d_tp`` receivers with real Mooncake engines, and verify every byte of every
    head on D. ``kv_heads``: the model's KV heads (needed when the TP sizes differ), which
    split ``block_bytes`` as vLLM splits heads over TP ranks. ``secure``: the side channel runs
    ZMQ CURVE with keys derived from a fresh secret. ``on_report`` is called with the report
    as soon as it is known, before the engines are torn down (Mooncake takes ~1 s to destroy
    each). ``checksums``: P sends KV checksums and D verifies them (``checksum_kv`` /
    ``verify_kv``). ``corrupt_every``: every that many requests, one write is corrupted in
    flight (a flipped byte, a short run, a run one byte off, in turn:
    :mod:`pdactors.testing.corruption`); the run passes when each is caught (in-process only).
    ``processes``: every worker in a process of its own
    (:mod:`pdactors.testing.process_cluster`); ``kv_device``: where the workers' KV lives,
    ``"cpu"`` or ``"cuda:N"`` (implies ``processes``). Raises :class:`KVDeviceUnavailable`
    when that device is not there. Checkpoint.
    """
    planes: list[CorruptingDataPlane] = []

    def corrupting(inner: DataPlane) -> DataPlane:
        planes.append(CorruptingDataPlane(inner, seed=len(planes)))
        return planes[-1]

    secret = secrets.token_urlsafe(32) if secure else ""
    pool_blocks = blocks * concurrency
    cluster: contextlib.AbstractAsyncContextManager[_Driven]
    if processes or kv_device != "cpu":
        if corrupt_every:
            raise ConfigError("corrupt_every needs the in-process harness (processes=False)")
        cluster = open_process_cluster(
            layers=layers,
            num_blocks=pool_blocks,
            block_bytes=block_bytes,
            dataplane=dataplane or DataPlaneConfig(),
            p_tp=p_tp,
            d_tp=d_tp,
            kv_heads=kv_heads,
            checksums=checksums,
            secret=secret,
            kv_device=kv_device,
        )
    else:
        cluster = _in_process(
            open_cluster(
                layers=layers,
                num_blocks=pool_blocks,
                block_bytes=block_bytes,
                dataplane=dataplane,
                p_tp=p_tp,
                d_tp=d_tp,
                kv_heads=kv_heads,
                sender=SenderConfig(engine_id="prefill", checksum_kv=checksums),
                receiver=ReceiverConfig(verify_kv="on" if checksums else "off"),
                wrap_prefill=corrupting if corrupt_every else None,
                transport=ZmqTransport(*curve_from_secret(secret)) if secure else ZMQ,
            )
        )
    async with cluster as driven:
        report = await _drive(driven, requests, blocks, layers * blocks * block_bytes,
                              concurrency, progress, corrupt_every, planes)  # fmt: skip
        if on_report is not None:
            on_report(report)
    return report


@contextlib.asynccontextmanager
async def _in_process(
    opened: contextlib.AbstractAsyncContextManager[Cluster],
) -> AsyncIterator[_Driven]:
    async with opened as cluster:
        yield _InProcess(cluster)


async def _drive(
    cluster: _Driven,
    requests: int,
    blocks: int,
    model_bytes: int,
    concurrency: int,
    progress: bool,
    corrupt_every: int,
    planes: list[CorruptingDataPlane],
) -> HarnessReport:
    latencies: list[float] = []
    outcomes: list[TransferOutcome] = []
    # One warm-up transfer opens the connections; it is not counted.
    warmup = await cluster.run_transfer("warmup", blocks)
    next_id = iter(range(requests))
    with _progress(requests, progress and requests >= 16) as bar:
        task = bar.add_task("transfers", total=requests) if bar else None

        async def worker() -> None:
            for i in next_id:
                if corrupt_every and i % corrupt_every == corrupt_every - 1:
                    planes[i % len(planes)].arm(CORRUPTIONS[i // corrupt_every % 3])
                outcome = await cluster.run_transfer(f"req-{i}", blocks)
                outcomes.append(outcome)
                latencies.append(outcome.seconds)
                if bar is not None and task is not None:
                    bar.advance(task)

        start = trio.current_time()
        async with trio.open_nursery() as nursery:
            for _ in range(concurrency):
                nursery.start_soon(worker)
        seconds = trio.current_time() - start
    # P frees its blocks when the sender releases them; give that a moment to land.
    with trio.move_on_after(5):
        await cluster.wait_settled()
    leaked = cluster.blocks_in_use()
    descriptors = await cluster.descriptors_sent()
    return HarnessReport(
        requests=requests,
        ok=sum(o.ok for o in outcomes),
        verified=sum(o.verified for o in outcomes),
        failed={o.transfer_id: o.reason for o in outcomes if not o.ok},
        # What lands on D: the model's KV once, more where D's workers replicate heads.
        bytes_per_request=warmup.nbytes or model_bytes,
        seconds=seconds,
        latencies=tuple(latencies),
        blocks_leaked=leaked,
        descriptors_per_request=descriptors / (requests + 1),  # with the warm-up
        corrupted=sum(len(p.injected) for p in planes),
        caught=sum("KV checksum mismatch" in o.reason for o in outcomes),
    )
