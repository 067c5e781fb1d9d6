"""The in-flight write fence through the actors: D loses a P worker while it writes D's blocks
(it said ``Writing``; its write waits at a gate of the fault-injecting data plane around the
real one), and the pull keeps D's blocks — not reported, not freed — until P confirms no write
is in flight, is found dead, or the fence timeout passes. The write that lands late is never
reported as D's KV. Every block comes back on every path.

With the in-memory side channel and data plane (only the bootstrap is real HTTP) under the
mock clock, the timings are exact; with P in a process of its own, real ZMQ and Mooncake over
TCP, P is stopped and resumed (SIGSTOP / SIGCONT) or killed for real.
"""

from __future__ import annotations

import signal
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import trio
import trio.testing

from pdactors import Liveness, PullFailedError, ReceiverConfig, SenderConfig
from pdactors.dataplane.base import DataPlane
from pdactors.testing import Cluster, FaultyDataPlane, open_cluster
from pdactors.testing.memory_dataplane import MemoryFabric
from pdactors.transport import MemoryTransport
from tests.conftest import settled, wait_until
from tests.test_liveness import p_process

SMALL = {"layers": 4, "num_blocks": 64, "block_bytes": 4096}  # as the P process's
FENCE = 30.0
QUIET = SenderConfig(engine_id="p", register_timeout=1e6, lease_interval=0)
#: D notices a stopped P within about a second.
QUICK = Liveness(heartbeat_interval=0.2, heartbeat_timeout=1.0, connect_timeout=1.0)


class Pull:
    """One pull of ``tid`` into fresh blocks of D worker 0, run in a task; its blocks are
    freed when it ends (as vLLM frees them when the pull is reported)."""

    def __init__(self, cluster: Cluster, tid: str, engine_id: str, n: int = 2) -> None:
        self.cluster, self.tid, self.engine_id = cluster, tid, engine_id
        self.d = cluster.decode[0]
        self.dst = self.d.pool.allocate(n)
        self.end: str | None = None  # "delivered", or why it failed
        self.at = 0.0  # when it ended
        self.ended = trio.Event()
        self.landed = False  # P's KV was in D's blocks when D gave them back

    async def run(self) -> None:
        try:
            await self.d.receiver.pull(
                self.tid,
                bootstrap_url=self.cluster.bootstrap_url,
                engine_id=self.engine_id,
                block_ids=self.dst,
            )
            self.end = "delivered"
        except PullFailedError as exc:
            self.end = exc.reason
        finally:
            self.landed = self.d.kv.verify(self.tid, self.dst, len(self.dst))
            self.d.pool.free(self.dst)
            self.at = trio.current_time()
            self.ended.set()

    def p_writes(self) -> bool:
        """P said it writes this pull's blocks now (``Writing``), and has not answered."""
        pull = self.d.receiver._table.get(self.tid)
        return pull is not None and bool(pull.writing)

    def fenced(self) -> bool:
        return self.tid in self.d.receiver._table.fenced_pulls()

    def holds_blocks(self) -> bool:
        """Not reported, and D's blocks still taken."""
        return self.end is None and self.d.pool.in_use == len(self.dst)


@asynccontextmanager
async def gated_cluster(
    memory: MemoryTransport, fence_timeout: float
) -> AsyncIterator[tuple[Cluster, trio.Event]]:
    """One P worker and one D worker on the memory side channel and data plane; P's writes
    wait at the gate it yields."""
    gate = trio.Event()

    def wrap(plane: DataPlane) -> DataPlane:
        faulty = FaultyDataPlane(plane)
        faulty.gate = gate
        return faulty

    receiver = ReceiverConfig(lookup_timeout=1e6, fence_timeout=fence_timeout)
    async with open_cluster(
        fabric=MemoryFabric(),
        transport=memory,
        sender=QUIET,
        receiver=receiver,
        wrap_prefill=wrap,
        **SMALL,
    ) as cluster:
        yield cluster, gate


def connected(memory: MemoryTransport, address: str) -> int:
    """How many dealers are connected to the router at ``address``."""
    return len(memory._routers[address].dealers)


def ready(cluster: Cluster, tid: str, n: int = 2) -> None:
    p = cluster.prefill[0]
    src = p.owned[tid] = p.pool.allocate(n)
    p.kv.fill(tid, src)
    p.sender.transfer_pending(tid)
    p.sender.transfer_ready(tid, src)


async def test_a_lost_writer_keeps_d_blocks_until_it_confirms_and_its_late_write_is_no_kv(
    mock_clock: trio.testing.MockClock,
) -> None:
    memory = MemoryTransport()
    async with gated_cluster(memory, FENCE) as (cluster, gate):
        p = cluster.prefill[0]
        ready(cluster, "t")
        pull = Pull(cluster, "t", p.engine_id)
        async with trio.open_nursery() as nursery:
            nursery.start_soon(pull.run)
            await wait_until(pull.p_writes)  # its write waits at the gate
            assert memory.cut(p.sender.address) == 1  # D loses P, as to heartbeats
            lost = trio.current_time()
            await wait_until(pull.fenced)
            await trio.sleep(FENCE - 1)  # the clock jumps: the fence holds that long
            assert pull.holds_blocks()
            gate.set()  # the write lands now, after the loss; then P answers the fence
            await wait_until(lambda: pull.end is not None)
        assert pull.end is not None and "confirmed no write is in flight" in pull.end
        assert "P gone" in pull.end
        assert pull.at - lost < FENCE
        await wait_until(lambda: not connected(memory, p.sender.address))  # the fence closed
        # the late write landed before D gave its blocks back, and was reported as a failure
        assert pull.landed
        await settled(cluster)


async def test_a_writer_that_never_answers_is_ended_by_the_fence_timeout_which_names_the_risk(
    mock_clock: trio.testing.MockClock,
) -> None:
    memory = MemoryTransport()
    async with gated_cluster(memory, FENCE) as (cluster, gate):
        p = cluster.prefill[0]
        ready(cluster, "t")
        pull = Pull(cluster, "t", p.engine_id)
        async with trio.open_nursery() as nursery:
            nursery.start_soon(pull.run)
            await wait_until(pull.p_writes)
            memory.cut(p.sender.address)
            lost = trio.current_time()
            await wait_until(pull.fenced)
            with trio.fail_after(FENCE + 5):
                await pull.ended.wait()
        assert pull.end is not None and "late write may still land" in pull.end
        assert FENCE <= pull.at - lost <= FENCE + 0.5
        await wait_until(lambda: not connected(memory, p.sender.address))  # the fence closed
        gate.set()  # P's write goes ahead (into blocks D gave back: the risk named)
        await settled(cluster)


async def test_a_stopped_writer_keeps_d_blocks_until_it_resumes_and_confirms() -> None:
    receiver = ReceiverConfig(liveness=QUICK, fence_timeout=FENCE)
    with trio.fail_after(60):
        async with open_cluster(prefill=0, receiver=receiver, **SMALL) as cluster:
            async with p_process(cluster.bootstrap_url) as p:
                await p.command("holdwrites")
                await p.command("ready t 2")
                pull = Pull(cluster, "t", p.engine_id)
                async with trio.open_nursery() as nursery:
                    nursery.start_soon(pull.run)
                    await wait_until(pull.p_writes, within=20)
                    p.signal(signal.SIGSTOP)  # mid-write, for D: it said Writing
                    await wait_until(pull.fenced, within=10)  # lost by heartbeat
                    assert pull.holds_blocks()
                    p.signal(signal.SIGCONT)
                    # P is back, its write still waits: the fence waits with it
                    assert pull.holds_blocks()
                    await p.command("releasewrites")
                    await wait_until(lambda: pull.end is not None, within=20)
                assert pull.end is not None and "confirmed no write is in flight" in pull.end
                assert pull.landed  # it landed, late, before D gave its blocks back: failed
                with trio.fail_after(10):
                    while await p.blocks_in_use():
                        await trio.sleep(0.05)  # P frees its blocks once the write ended
            assert cluster.blocks_in_use() == 0


async def test_a_writer_killed_mid_write_is_found_dead_long_before_the_fence_timeout() -> None:
    receiver = ReceiverConfig(liveness=QUICK, fence_timeout=FENCE)
    with trio.fail_after(60):
        async with open_cluster(prefill=0, receiver=receiver, **SMALL) as cluster:
            async with p_process(cluster.bootstrap_url) as p:
                await p.command("holdwrites")
                await p.command("ready t 2")
                pull = Pull(cluster, "t", p.engine_id)
                async with trio.open_nursery() as nursery:
                    nursery.start_soon(pull.run)
                    await wait_until(pull.p_writes, within=20)
                    killed = trio.current_time()
                    p.signal(signal.SIGKILL)
                    await wait_until(lambda: pull.end is not None, within=FENCE)
                assert pull.end is not None and "is dead" in pull.end, pull.end
                assert "refuses connections" in pull.end
                assert pull.at - killed < 5
            assert cluster.blocks_in_use() == 0
