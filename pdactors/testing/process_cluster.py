"""The harness with every worker in a process of its own: one P engine of ``p_tp`` workers and
one D engine of ``d_tp`` workers (:mod:`pdactors.testing.kv_worker`), a bootstrap here.

This process plays vLLM's schedulers: it owns each engine's :class:`BlockPool` (every worker of
an engine gets the same block ids), tells P's workers a prefill is done, tells D's workers to
pull, and frees P's blocks once every P worker released them. Mooncake's ``nvlink_intra`` needs
this split (CUDA opens no IPC handle in the process that made it), and it is the only way to
keep KV in GPU memory here: ``kv_device="cuda:N"`` runs the workers as
``python -m pdactors_vllm.device_kv`` (torch, in the adapter's package), ``"cpu"`` as
``python -m pdactors.testing.kv_worker`` (numpy).

A worker that dies fails what waits on it; on exit every worker's stdin is closed (it exits),
and one still alive after :data:`STOP_TIMEOUT` is killed: no process outlives the cluster.
"""

from __future__ import annotations

import math
import os
import subprocess
import sys
from collections import Counter
from collections.abc import AsyncIterator
from contextlib import AsyncExitStack, asynccontextmanager
from dataclasses import dataclass, field

import msgspec
import trio

from pdactors.actors.bootstrap import serve_bootstrap
from pdactors.config import BootstrapConfig, DataPlaneConfig
from pdactors.errors import PdError
from pdactors.testing.cluster import TransferOutcome
from pdactors.testing.kv import BlockPool, KVDeviceUnavailable
from pdactors.testing.worker_wire import (
    Command,
    Counts,
    Hello,
    Pull,
    Pulled,
    Readied,
    Ready,
    Released,
    Reply,
    Stats,
    WorkerSpec,
)

__all__ = ["STOP_TIMEOUT", "ProcessCluster", "open_process_cluster", "worker_module"]

#: Seconds a worker gets to exit once its stdin closed (its engine takes ~1 s to go).
STOP_TIMEOUT = 15.0
#: Seconds a transfer waits for P's blocks that its sender has not released yet.
RELEASE_TIMEOUT = 30.0
#: Seconds a worker gets to serve after it started (torch and CUDA come up in this time).
START_TIMEOUT = 120.0


def worker_module(kv_device: str) -> str:
    """The module a worker runs as: host memory here, a CUDA device in the adapter's package."""
    return "pdactors.testing.kv_worker" if kv_device == "cpu" else "pdactors_vllm.device_kv"


@dataclass
class _Worker:
    """One worker process and the answers it owes (by key: ``readied:TID``, ``pulled:TID``,
    ``counts``, ``hello``; the last filed before its output is read)."""

    name: str
    proc: trio.Process
    waiting: dict[str, trio.MemorySendChannel[Reply]] = field(default_factory=dict)
    gone: str = ""
    _lock: trio.Lock = field(default_factory=trio.Lock)

    def __post_init__(self) -> None:
        self.waiting["hello"], self._hello = trio.open_memory_channel[Reply](1)

    async def hello(self) -> None:
        """Wait until it serves. Raises :class:`KVDeviceUnavailable` when its device is not
        there, :class:`PdError` when it exits first. Checkpoint."""
        try:
            hello = await self._hello.receive()
        except trio.EndOfChannel:
            raise PdError(f"{self.name} exited before it served: {self.gone}") from None
        assert isinstance(hello, Hello)
        if hello.error:
            raise KVDeviceUnavailable(hello.error)

    async def ask(self, key: str, command: Command) -> Reply:
        """Send ``command`` and wait for the answer filed under ``key``. Raises
        :class:`PdError` if the worker is gone first. Checkpoint."""
        send, recv = trio.open_memory_channel[Reply](1)
        self.waiting[key] = send
        try:
            if self.gone:
                raise PdError(f"{self.name} is gone: {self.gone}")
            assert self.proc.stdin is not None
            async with self._lock:
                await self.proc.stdin.send_all(msgspec.json.encode(command) + b"\n")
            try:
                return await recv.receive()
            except trio.EndOfChannel:
                raise PdError(f"{self.name} is gone: {self.gone}") from None
        finally:
            self.waiting.pop(key, None)

    async def read(self, released: trio.MemorySendChannel[str]) -> None:
        """File each answer under its key; pass P's releases on. Ends when stdout closes."""
        assert self.proc.stdout is not None
        decode = msgspec.json.Decoder(Reply)
        buffer = b""
        async for chunk in self.proc.stdout:
            buffer += chunk
            *lines, buffer = buffer.split(b"\n")
            for line in lines:
                reply = decode.decode(line)
                if isinstance(reply, Released):
                    for tid in reply.transfer_ids:
                        released.send_nowait(tid)
                elif (send := self.waiting.pop(_key(reply), None)) is not None:
                    send.send_nowait(reply)
        self.gone = "its output ended (it exited or was killed; its stderr says why)"
        for send in list(self.waiting.values()):
            send.close()


async def _stop(workers: list[_Worker]) -> None:
    """Close every worker's stdin (each exits), wait for them together, kill any still alive
    after :data:`STOP_TIMEOUT`. Shielded."""
    with trio.CancelScope(shield=True):
        for worker in workers:
            if worker.proc.stdin is not None:
                await worker.proc.stdin.aclose()
        with trio.move_on_after(STOP_TIMEOUT):
            for worker in workers:
                await worker.proc.wait()
        for worker in workers:
            if worker.proc.returncode is None:
                worker.proc.kill()
                await worker.proc.wait()


def _key(reply: Reply) -> str:
    match reply:
        case Readied(tid) | Pulled(tid):
            return f"{type(reply).__name__.lower()}:{tid}"
        case Counts():
            return "counts"
        case _:
            return "hello"


@dataclass
class ProcessCluster:
    """The running cluster: what :func:`open_process_cluster` yields."""

    bootstrap_url: str
    prefill: list[_Worker]
    decode: list[_Worker]
    p_pool: BlockPool
    d_pool: BlockPool
    owned: dict[str, list[int]] = field(default_factory=dict)
    releases: Counter[str] = field(default_factory=Counter)

    def blocks_in_use(self) -> int:
        return self.p_pool.in_use + self.d_pool.in_use

    async def wait_settled(self) -> None:
        """Wait until every block is back in its pool. Checkpoint."""
        await self.p_pool.wait_empty()
        await self.d_pool.wait_empty()

    async def descriptors_sent(self) -> int:
        """Descriptors P's workers wrote so far, all together. Checkpoint."""
        total = 0
        for worker in self.prefill:
            counts = await worker.ask("counts", Stats())
            assert isinstance(counts, Counts)
            total += counts.descriptors_sent
        return total

    async def free_released(self, released: trio.MemoryReceiveChannel[str]) -> None:
        """Free P's blocks of a transfer once every P worker released them."""
        async for tid in released:
            if tid not in self.owned:  # a transfer that failed at P's start
                continue
            self.releases[tid] += 1
            if self.releases[tid] == len(self.prefill):
                del self.releases[tid]
                self.p_pool.free(self.owned.pop(tid))

    async def run_transfer(self, transfer_id: str, num_blocks: int) -> TransferOutcome:
        """One request: P's workers fill and hand over ``num_blocks`` blocks, then D's workers
        pull them into fresh blocks and check every byte (P's blocks come from its pool as the
        sender releases those of earlier transfers: ``TooSlowError`` past
        :data:`RELEASE_TIMEOUT`). ``seconds``: from the first D
        worker's pull to the last one's answer. D's blocks are freed when every pull ended.
        Checkpoint."""
        with trio.fail_after(RELEASE_TIMEOUT):  # P's last transfers may be releasing still
            src = await self.p_pool.take(num_blocks)
        self.owned[transfer_id] = src
        errors: list[str] = []
        async with trio.open_nursery() as nursery:
            for worker in self.prefill:
                nursery.start_soon(self._ready, worker, transfer_id, src, errors)
        if errors:  # P refused: nothing to pull; its blocks are not the sender's
            self.p_pool.free(self.owned.pop(transfer_id))
            return TransferOutcome(transfer_id, False, "; ".join(errors), 0, 0.0, False)
        dst = self.d_pool.allocate(num_blocks)
        pulled: list[tuple[int, Pulled]] = []
        try:
            async with trio.open_nursery() as nursery:
                for rank, worker in enumerate(self.decode):
                    nursery.start_soon(self._pull, worker, rank, transfer_id, dst, pulled)
        finally:
            self.d_pool.free(dst)
        seconds = max(p.end for _, p in pulled) - min(p.start for _, p in pulled)
        failed = [f"D rank {r}: {p.reason}" for r, p in sorted(pulled, key=_rank) if not p.ok]
        if failed:
            return TransferOutcome(transfer_id, False, "; ".join(failed), 0, seconds, False)
        verified = all(p.verified for _, p in pulled)
        nbytes = sum(p.nbytes for _, p in pulled)
        return TransferOutcome(transfer_id, True, "", nbytes, seconds, verified)

    async def _ready(self, worker: _Worker, tid: str, src: list[int], errors: list[str]) -> None:
        reply = await worker.ask(f"readied:{tid}", Ready(tid, src))
        assert isinstance(reply, Readied)
        if reply.error:
            errors.append(f"{worker.name}: {reply.error}")

    async def _pull(
        self, worker: _Worker, rank: int, tid: str, dst: list[int], out: list[tuple[int, Pulled]]
    ) -> None:
        reply = await worker.ask(f"pulled:{tid}", Pull(tid, "prefill-0", dst, len(dst)))
        assert isinstance(reply, Pulled)
        out.append((rank, reply))


@asynccontextmanager
async def open_process_cluster(
    *,
    layers: int,
    num_blocks: int,
    block_bytes: int,
    dataplane: DataPlaneConfig,
    p_tp: int = 1,
    d_tp: int = 1,
    kv_heads: int = 0,
    checksums: bool = True,
    secret: str = "",
    kv_device: str = "cpu",
    module: str | None = None,
) -> AsyncIterator[ProcessCluster]:
    """Start a bootstrap here and ``p_tp`` P and ``d_tp`` D worker processes, each with its own
    Mooncake engine and KV on ``kv_device`` (``"cpu"``, ``"cuda:N"``); stop them all on exit.

    ``block_bytes`` is one layer's block of the whole model (``kv_heads`` heads, split over each
    engine's workers; 0 when the TP sizes are equal). ``secret``: the side channel runs CURVE
    with keys derived from it. ``module``: what the workers run (default
    :func:`worker_module` of ``kv_device``; ``pdactors_vllm.device_kv`` with ``"cpu"`` runs
    the GPU workers' torch code on host tensors). Raises :class:`KVDeviceUnavailable` when a
    worker finds no such device, :class:`PdError` when a worker exits before it serves.
    """
    if not kv_heads and p_tp != d_tp:
        raise ValueError("P and D of different TP sizes need kv_heads")
    env = {**dataplane.mooncake_environment(), **os.environ}  # defaults: the caller's win
    args = [sys.executable, "-m", module or worker_module(kv_device)]
    try:
        async with AsyncExitStack() as stack, trio.open_nursery() as nursery:
            url = await nursery.start(serve_bootstrap, BootstrapConfig())
            released_send, released = trio.open_memory_channel[str](math.inf)
            shapes = [("prefill", p_tp), ("decode", d_tp)]
            workers: dict[str, list[_Worker]] = {"prefill": [], "decode": []}
            every: list[_Worker] = []
            stack.push_async_callback(_stop, every)
            for role, tp in shapes:
                for rank in range(tp):
                    spec = WorkerSpec(
                        role=role,  # type: ignore[arg-type]
                        engine_id=f"{role}-0",
                        tp_rank=rank,
                        tp_size=tp,
                        kv_heads=kv_heads,
                        layers=layers,
                        num_blocks=num_blocks,
                        block_bytes=block_bytes,
                        bootstrap_url=url,
                        dataplane=dataplane,
                        checksums=checksums,
                        secret=secret,
                        kv_device=kv_device,
                    )
                    proc = await trio.lowlevel.open_process(
                        args, stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=env
                    )
                    worker = _Worker(f"{role} worker {rank} (pid {proc.pid})", proc)
                    assert proc.stdin is not None
                    await proc.stdin.send_all(msgspec.json.encode(spec) + b"\n")
                    nursery.start_soon(worker.read, released_send.clone())
                    workers[role].append(worker)
                    every.append(worker)
            released_send.close()  # the readers hold clones
            with trio.fail_after(START_TIMEOUT):
                async with trio.open_nursery() as starting:  # torch and CUDA start in parallel
                    for worker in every:
                        starting.start_soon(worker.hello)
            cluster = ProcessCluster(
                url, workers["prefill"], workers["decode"], BlockPool(num_blocks),
                BlockPool(num_blocks),
            )  # fmt: skip
            nursery.start_soon(cluster.free_released, released)
            try:
                yield cluster
            finally:
                nursery.cancel_scope.cancel()
    except BaseExceptionGroup as group:
        missing, _ = group.split(KVDeviceUnavailable)
        if missing is None:
            raise
        raise KVDeviceUnavailable(_first_message(missing)) from group


def _rank(pulled: tuple[int, Pulled]) -> int:
    return pulled[0]


def _first_message(group: BaseExceptionGroup[KVDeviceUnavailable]) -> str:
    exc: BaseException = group
    while isinstance(exc, BaseExceptionGroup):
        exc = exc.exceptions[0]
    return str(exc)
