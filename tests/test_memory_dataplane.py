"""The in-process data plane, and actor tests with no engine thread under the autojump clock."""

from __future__ import annotations

import numpy as np
import pytest
import trio
import trio.testing

from pdactors import Liveness, PullFailedError, ReceiverConfig, SenderConfig
from pdactors.errors import DataPlaneError, TransferError
from pdactors.testing import open_cluster, run_transfer
from pdactors.testing.memory_dataplane import MemoryDataPlane, MemoryFabric
from pdactors.transport import MemoryTransport

SMALL = {"layers": 4, "num_blocks": 32, "block_bytes": 1024}


def _addrs(*values: int) -> np.ndarray:
    return np.array(values, dtype=np.uint64)


async def test_a_write_moves_the_bytes_into_registered_memory_only() -> None:
    fabric = MemoryFabric()
    p, d = fabric.open(), fabric.open()
    src = np.arange(64, dtype=np.uint8)
    dst = np.zeros(64, dtype=np.uint8)
    p.register([(src.ctypes.data, 64)])
    d.register([(dst.ctypes.data, 32)])  # only the first half
    await p.write(d.session, _addrs(src.ctypes.data + 8), _addrs(dst.ctypes.data), _addrs(16))
    assert dst[:16].tolist() == list(range(8, 24)) and not dst[16:].any()
    with pytest.raises(TransferError, match=r"target .* not registered"):
        await p.write(d.session, _addrs(src.ctypes.data), _addrs(dst.ctypes.data + 24), _addrs(16))
    with pytest.raises(TransferError, match=r"source .* not registered"):
        await d.write(p.session, _addrs(dst.ctypes.data), _addrs(src.ctypes.data), _addrs(64))
    with pytest.raises(DataPlaneError, match="differ in length"):
        await p.write(d.session, _addrs(1, 2), _addrs(1), _addrs(1))
    d.close()
    with pytest.raises(TransferError, match="no such session"):
        await p.write(d.session, _addrs(src.ctypes.data), _addrs(dst.ctypes.data), _addrs(1))
    assert dst[16:].sum() == 0 and p.writes == 1 and p.bytes == 16


def _eight_bytes() -> tuple[MemoryDataPlane, MemoryDataPlane, np.ndarray, np.ndarray]:
    """P and D on one fabric, P's 8 bytes of ones and D's 8 zeroed bytes registered."""
    fabric = MemoryFabric()
    p, d = fabric.open(), fabric.open()
    src, dst = np.ones(8, dtype=np.uint8), np.zeros(8, dtype=np.uint8)
    p.register([(src.ctypes.data, 8)])
    d.register([(dst.ctypes.data, 8)])
    return p, d, src, dst


async def test_after_runs_once_the_bytes_moved_and_never_for_a_failed_write() -> None:
    p, d, src, dst = _eight_bytes()
    seen: list[int] = []
    s, t = _addrs(src.ctypes.data), _addrs(dst.ctypes.data)
    await p.write(d.session, s, t, _addrs(8), after=lambda: seen.append(int(dst.sum())))
    assert seen == [8]
    with pytest.raises(TransferError):
        await p.write(d.session, s, t + 4, _addrs(8), after=lambda: seen.append(-1))
    assert seen == [8]


async def test_a_cancelled_write_moves_nothing() -> None:
    p, d, src, dst = _eight_bytes()
    with trio.CancelScope() as scope:
        scope.cancel()
        await p.write(d.session, _addrs(src.ctypes.data), _addrs(dst.ctypes.data), _addrs(8))
    assert not dst.any() and p.writes == 0


@pytest.mark.parametrize(("p_tp", "d_tp"), [(1, 1), (2, 1), (1, 2)])
async def test_transfers_through_the_actors_land_the_right_bytes(p_tp: int, d_tp: int) -> None:
    async with open_cluster(
        fabric=MemoryFabric(),
        transport=MemoryTransport(),
        p_tp=p_tp,
        d_tp=d_tp,
        kv_heads=4,
        **SMALL,
    ) as cluster:
        outcomes = [await run_transfer(cluster, f"t{i}", 5) for i in range(3)]
        assert all(o.ok and o.verified for o in outcomes), outcomes
        with trio.fail_after(5):
            await cluster.wait_settled()
        assert cluster.blocks_in_use() == 0


async def test_the_ready_timeout_is_exact_under_the_autojump_clock(
    mock_clock: trio.testing.MockClock,
) -> None:
    """No engine thread and no socket on the side channel: the clock jumps straight to the
    deadline and the pull fails exactly then. (The bootstrap's HTTP is real IO, hence the
    clock that jumps only after 10 ms of real idleness: one that jumps at once can fire an
    HTTP client's timeout while its request is on the wire.)"""
    # Registered once (no lease to renew): under a jumping clock a renewal is always in flight,
    # and one cancelled mid-request at the end leaves httpx's body iterator to the GC.
    sender = SenderConfig(engine_id="p", ready_timeout=5, register_timeout=1e6, lease_interval=0)
    receiver = ReceiverConfig(
        pull_timeout=1000, lookup_timeout=1e6, liveness=Liveness(connect_timeout=1e6)
    )
    async with open_cluster(
        fabric=MemoryFabric(),
        transport=MemoryTransport(),
        sender=sender,
        receiver=receiver,
        **SMALL,
    ) as cluster:
        p, d = cluster.prefill[0], cluster.decode[0]
        dst = d.pool.allocate(2)
        start = trio.current_time()
        with pytest.raises(PullFailedError, match="not ready within 5 s"):
            await d.receiver.pull(
                "late", bootstrap_url=cluster.bootstrap_url, engine_id=p.engine_id, block_ids=dst
            )
        assert 5 <= trio.current_time() - start < 5.5
        d.pool.free(dst)
