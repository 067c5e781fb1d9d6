"""Tests of the Mooncake data plane with two real engines (tcp on 127.0.0.1) in one process.

Engines take about a second to create and destroy, so the module shares two raw engines; each
test builds fresh data planes over them (cheap) and unregisters its memory when it ends.
"""

from __future__ import annotations

import threading
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass, field
from functools import partial
from typing import Any

import numpy as np
import numpy.typing as npt
import pytest
import trio
import trio.testing

from pdactors.config import DataPlaneConfig
from pdactors.core.plan import plan_transfer
from pdactors.dataplane import DataPlane, MooncakeDataPlane, open_mooncake
from pdactors.errors import DataPlaneError, TransferError
from pdactors.wire import BlockLayout, Layout

engine_module = pytest.importorskip("mooncake.engine")

KiB = 1024
MiB = 1024 * KiB
TIMEOUT = 30


class CountingEngine:
    """A thin wrapper around a real engine that records what the data plane asks of it."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.registered: list[tuple[int, int]] = []
        self.unregistered: list[int] = []
        self.call_sizes: list[int] = []
        self._lock = threading.Lock()
        self._in_flight = 0
        self.max_in_flight = 0
        self.finished = 0
        #: While set, engine calls wait until it is released (``gate.set()``).
        self.gate: threading.Event | None = None
        self.call_started = threading.Event()
        self.log: list[str] = []  # what the worker threads did, in order

    def register_memory(self, addr: int, length: int) -> int:
        self.registered.append((addr, length))
        return int(self.inner.register_memory(addr, length))

    def unregister_memory(self, addr: int) -> int:
        self.unregistered.append(addr)
        return int(self.inner.unregister_memory(addr))

    def batch_transfer_sync_write(
        self, target: str, src: list[int], dst: list[int], lengths: list[int]
    ) -> int:
        with self._lock:
            self.call_sizes.append(len(lengths))
            self._in_flight += 1
            self.max_in_flight = max(self.max_in_flight, self._in_flight)
            self.log.append(f"call {len(lengths)}")
        self.call_started.set()
        if self.gate is not None:
            self.gate.wait(TIMEOUT)
        try:
            return int(self.inner.batch_transfer_sync_write(target, src, dst, lengths))
        finally:
            with self._lock:
                self._in_flight -= 1
                self.finished += 1


@dataclass
class Pair:
    p: MooncakeDataPlane
    d: MooncakeDataPlane
    p_engine: CountingEngine
    d_engine: CountingEngine
    keep: list[npt.NDArray[np.uint8]] = field(default_factory=list)

    def buffers(self, size: int) -> tuple[npt.NDArray[np.uint8], npt.NDArray[np.uint8]]:
        """A random source buffer registered on P and a zeroed target registered on D."""
        src = np.random.default_rng(size).integers(0, 256, size, dtype=np.uint8)
        dst = np.zeros(size, dtype=np.uint8)
        self.p.register([(addr(src), size)])
        self.d.register([(addr(dst), size)])
        # Registered memory must outlive its registration (unregistered at teardown).
        self.keep += [src, dst]
        return src, dst


def addr(a: npt.NDArray[Any]) -> int:
    return int(a.ctypes.data)


def u64(values: Any) -> npt.NDArray[np.uint64]:
    return np.asarray(values, dtype=np.uint64)


@pytest.fixture(scope="module")
def engines() -> Iterator[tuple[Any, Any]]:
    made = []
    for _ in range(2):
        engine = engine_module.TransferEngine()
        assert engine.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "") == 0
        made.append(engine)
    yield made[0], made[1]
    made.clear()


def make_pair(engines: tuple[Any, Any], config: DataPlaneConfig) -> Pair:
    p_engine, d_engine = CountingEngine(engines[0]), CountingEngine(engines[1])
    p = MooncakeDataPlane(p_engine, config, f"127.0.0.1:{engines[0].get_rpc_port()}")
    d = MooncakeDataPlane(d_engine, config, f"127.0.0.1:{engines[1].get_rpc_port()}")
    return Pair(p, d, p_engine, d_engine)


@pytest.fixture
async def pair(engines: tuple[Any, Any]) -> AsyncIterator[Pair]:
    made = make_pair(engines, DataPlaneConfig())
    try:
        yield made
    finally:
        made.p.close()
        made.d.close()


async def test_mooncake_data_plane_is_a_data_plane(pair: Pair) -> None:
    plane: DataPlane = pair.p
    assert plane.session.startswith("127.0.0.1:")


async def test_planned_write_lands_byte_exact(pair: Pair) -> None:
    # Two regions of 16 blocks of 4 KiB padded to 5 KiB, back to back in one buffer.
    src_buf, dst_buf = pair.buffers(2 * 16 * 5 * KiB)

    def layout(buf: npt.NDArray[np.uint8]) -> Layout:
        return Layout(
            tuple(BlockLayout(addr(buf) + r * 80 * KiB, 16, 4 * KiB, 5 * KiB) for r in range(2))
        )

    src_ids, dst_ids = [3, 4, 5, 9, 0], [10, 11, 12, 13, 2]
    plan = plan_transfer(layout(src_buf), src_ids, layout(dst_buf), dst_ids)
    with trio.fail_after(TIMEOUT):
        await pair.p.write(pair.d.session, plan.src, plan.dst, plan.lengths)

    expected = np.zeros_like(dst_buf)
    for r in range(2):
        for s, d in zip(src_ids, dst_ids, strict=True):
            a, b = r * 80 * KiB + s * 5 * KiB, r * 80 * KiB + d * 5 * KiB
            expected[b : b + 4 * KiB] = src_buf[a : a + 4 * KiB]
    np.testing.assert_array_equal(dst_buf, expected)
    stats = pair.p.statistics()
    assert (stats.writes, stats.bytes, stats.descriptors, stats.failures) == (
        1,
        plan.nbytes,
        plan.descriptors,
        0,
    )


async def test_many_descriptors_are_chunked(pair: Pair) -> None:
    count, size = 3000, 4 * KiB
    src_buf, dst_buf = pair.buffers(count * size)
    offsets = np.arange(count, dtype=np.uint64) * size
    # Reversed destinations: nothing is contiguous, 3000 descriptors go out as they are.
    with trio.fail_after(TIMEOUT):
        await pair.p.write(
            pair.d.session,
            addr(src_buf) + offsets,
            addr(dst_buf) + offsets[::-1].copy(),
            np.full(count, size, dtype=np.uint64),
        )
    assert pair.p_engine.call_sizes == [1024, 1024, 952]
    assert pair.p.statistics().calls == 3
    expected = src_buf.reshape(count, size)[::-1].ravel()
    np.testing.assert_array_equal(dst_buf, expected)


async def test_empty_write_is_a_checkpoint_and_calls_nothing(pair: Pair) -> None:
    empty = u64([])
    with trio.testing.assert_checkpoints():
        await pair.p.write(pair.d.session, empty, empty, empty)
    assert pair.p_engine.call_sizes == []


async def test_mismatched_arrays_are_refused(pair: Pair) -> None:
    with pytest.raises(DataPlaneError, match="differ in length"):
        await pair.p.write(pair.d.session, u64([1, 2]), u64([1]), u64([1, 1]))


async def test_register_merges_and_registers_each_storage_once(pair: Pair) -> None:
    buf = np.zeros(1 * MiB, dtype=np.uint8)
    a = addr(buf)
    engine = pair.d_engine
    pair.d.register(
        [
            (a, 100),
            (a, 100),  # duplicate
            (a + 50, 200),  # overlapping
            (a + 250, 50),  # adjacent
            (a + 4096, 10),  # apart
            (a + 4000, 0),  # empty
        ]
    )
    assert engine.registered == [(a, 300), (a + 4096, 10)]

    pair.d.register([(a, 300), (a + 10, 20)])  # already covered
    assert len(engine.registered) == 2

    # Spanning both registrations and beyond: only the gaps and the tail are new.
    pair.d.register([(a + 100, 8192)])
    assert engine.registered[2:] == [(a + 300, 4096 - 300), (a + 4106, 100 + 8192 - 4106)]
    stats = pair.d.statistics()
    assert stats.registrations == 4
    assert stats.registered_bytes == 100 + 8192

    pair.d.close()
    assert sorted(engine.unregistered) == sorted(r for r, _ in engine.registered)
    with pytest.raises(DataPlaneError, match="closed"):
        pair.d.register([(a, 10)])


async def test_register_failure_raises(pair: Pair, engines: tuple[Any, Any]) -> None:
    buf = np.zeros(64 * KiB, dtype=np.uint8)
    pair.d.register([(addr(buf), buf.nbytes)])
    # A second data plane over the same engine does not know that memory is taken: Mooncake
    # refuses the overlapping registration.
    other = make_pair(engines, DataPlaneConfig()).d
    with pytest.raises(DataPlaneError, match="register_memory"):
        other.register([(addr(buf) + 16, 32)])
    with pytest.raises(DataPlaneError, match="cannot register"):
        other.register([(-1, 32)])


async def test_write_out_of_range_raises_transfer_error(pair: Pair) -> None:
    src_buf, dst_buf = pair.buffers(64 * KiB)
    with trio.fail_after(TIMEOUT), pytest.raises(TransferError) as info:
        await pair.p.write(
            pair.d.session,
            u64([addr(src_buf), addr(src_buf)]),
            u64([addr(dst_buf), addr(dst_buf) + 60 * KiB]),
            u64([1 * KiB, 8 * KiB]),
        )
    assert info.value.peer == pair.d.session
    assert info.value.nbytes == 9 * KiB
    assert info.value.code != 0
    assert pair.d.session in str(info.value)
    stats = pair.p.statistics()
    assert (stats.writes, stats.failures) == (0, 1)


async def test_concurrent_writes_all_land(engines: tuple[Any, Any]) -> None:
    config = DataPlaneConfig(workers=4, max_descriptors_per_call=8, max_calls_per_peer=2)
    pair = make_pair(engines, config)
    try:
        tasks, per_task, size = 24, 20, 1 * KiB
        src_buf, dst_buf = pair.buffers(tasks * per_task * size)

        async def one(task: int) -> None:
            # Every other block, so nothing merges and each write takes 3 calls.
            base = task * per_task * size
            offsets = base + np.arange(0, per_task, 2, dtype=np.uint64) * size
            await pair.p.write(
                pair.d.session,
                addr(src_buf) + offsets,
                addr(dst_buf) + offsets,
                np.full(len(offsets), size, dtype=np.uint64),
            )

        with trio.fail_after(TIMEOUT):
            async with trio.open_nursery() as nursery:
                for task in range(tasks):
                    nursery.start_soon(one, task)

        blocks_src = src_buf.reshape(-1, size)
        blocks_dst = dst_buf.reshape(-1, size)
        np.testing.assert_array_equal(blocks_dst[0::2], blocks_src[0::2])
        assert not blocks_dst[1::2].any()
        assert pair.p.statistics().writes == tasks
        assert pair.p_engine.max_in_flight <= config.max_calls_per_peer
        assert max(pair.p_engine.call_sizes) <= config.max_descriptors_per_call
    finally:
        pair.p.close()
        pair.d.close()


async def test_trio_keeps_running_during_a_large_write(pair: Pair) -> None:
    size = 128 * MiB
    src_buf, dst_buf = pair.buffers(size)
    count = 2048
    offsets = np.arange(count, dtype=np.uint64) * (size // count)
    ticks = 0
    done = trio.Event()

    async def ticker() -> None:
        nonlocal ticks
        while not done.is_set():
            ticks += 1
            await trio.sleep(0.001)

    with trio.fail_after(TIMEOUT):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(ticker)
            await trio.testing.wait_all_tasks_blocked()
            before = ticks
            start = trio.current_time()
            await pair.p.write(
                pair.d.session,
                addr(src_buf) + offsets,
                addr(dst_buf) + offsets,
                np.full(count, size // count, dtype=np.uint64),
            )
            took = trio.current_time() - start
            done.set()
    np.testing.assert_array_equal(dst_buf, src_buf)
    # ~64 ms of transfer at least; a blocked loop would not tick at all meanwhile.
    assert ticks - before >= 5, f"{ticks - before} ticks in {took:.3f} s"


async def test_cancelled_write_waits_for_the_call_in_flight(pair: Pair) -> None:
    size, count = 64 * MiB, 3072
    src_buf, dst_buf = pair.buffers(size)
    offsets = np.arange(count, dtype=np.uint64) * (size // count)
    with trio.fail_after(TIMEOUT):
        with trio.move_on_after(0.005) as scope:
            await pair.p.write(
                pair.d.session,
                addr(src_buf) + offsets,
                addr(dst_buf) + offsets,
                np.full(count, size // count, dtype=np.uint64),
            )
    assert scope.cancelled_caught
    engine = pair.p_engine
    # The write returned only once the engine call it had started was done, and it started
    # no further calls.
    assert engine.finished == len(engine.call_sizes) >= 1
    assert len(engine.call_sizes) < 3
    assert pair.p.statistics().writes == 0


async def test_open_mooncake_writes_then_closes(pair: Pair) -> None:
    target = np.zeros(4 * KiB, dtype=np.uint8)
    pair.d.register([(addr(target), target.nbytes)])
    source = np.arange(4 * KiB, dtype=np.uint32).astype(np.uint8)
    with trio.fail_after(TIMEOUT):
        async with open_mooncake(DataPlaneConfig()) as plane:
            assert plane.session.startswith("127.0.0.1:")
            plane.register([(addr(source), source.nbytes)])
            await plane.write(
                pair.d.session, u64([addr(source)]), u64([addr(target)]), u64([source.nbytes])
            )
    np.testing.assert_array_equal(target, source)
    # Destroying the engine takes ~1 s, and the binding holds the GIL meanwhile, so even from
    # a worker thread it stalls the loop; nothing to assert about the loop here.
    with pytest.raises(DataPlaneError, match="closed"):
        await plane.write(pair.d.session, u64([1]), u64([1]), u64([1]))


def one_block_writes(pair: Pair, count: int, size: int = 4 * KiB) -> tuple[Any, Any, Any]:
    """``count`` registered source and target blocks, and ``write(i)``: block i to block i."""
    src_buf, dst_buf = pair.buffers(count * size)

    async def write(i: int, before: Any = None, after: Any = None) -> None:
        at = np.uint64(i * size)
        await pair.p.write(
            pair.d.session,
            u64([addr(src_buf) + at]),
            u64([addr(dst_buf) + at]),
            u64([size]),
            before=before,
            after=after,
        )

    return src_buf.reshape(count, size), dst_buf.reshape(count, size), write


async def wait_for_call(engine: CountingEngine) -> None:
    with trio.fail_after(TIMEOUT):
        while not engine.call_started.is_set():
            await trio.sleep(0.001)


async def test_writes_queued_behind_a_call_share_the_next_one(pair: Pair) -> None:
    """One call per peer: while it is in flight, the others queue, and the next engine call
    carries all of them (one worker-thread hop for 63 writes)."""
    src, dst, write = one_block_writes(pair, 64)
    pair.p_engine.gate = gate = threading.Event()
    with trio.fail_after(TIMEOUT):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(write, 0)
            await wait_for_call(pair.p_engine)
            for i in range(1, 64):
                nursery.start_soon(write, i)
            await trio.testing.wait_all_tasks_blocked()
            gate.set()
    assert pair.p_engine.call_sizes == [1, 63]
    np.testing.assert_array_equal(dst, src)
    stats = pair.p.statistics()
    assert (stats.writes, stats.calls, stats.descriptors) == (64, 2, 64)


async def test_a_failed_shared_call_fails_each_write_it_carried(pair: Pair) -> None:
    src, dst, write = one_block_writes(pair, 4)
    pair.p_engine.gate = gate = threading.Event()
    bad = u64([addr(src) + 3 * 4 * KiB])  # beyond D's registered memory: the call fails

    async def bad_write() -> None:
        await pair.p.write(pair.d.session, u64([addr(src)]), bad + np.uint64(1 << 40), u64([8]))

    failures: list[str] = []

    async def expect_failure(fn: Any, *args: Any) -> None:
        with pytest.raises(TransferError) as info:
            await fn(*args)
        failures.append(str(info.value))

    with trio.fail_after(TIMEOUT):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(write, 0)
            await wait_for_call(pair.p_engine)
            nursery.start_soon(expect_failure, write, 1)
            nursery.start_soon(expect_failure, bad_write)
            await trio.testing.wait_all_tasks_blocked()
            gate.set()
        await write(2)  # the peer is still fine for the next call
    assert pair.p_engine.call_sizes == [1, 2, 1]
    assert len(failures) == 2 and all("carrying 1 other write failed" in f for f in failures)
    np.testing.assert_array_equal(dst[[0, 2]], src[[0, 2]])
    assert pair.p.statistics().failures == 2


async def test_a_cancelled_queued_write_is_never_sent(pair: Pair) -> None:
    src, dst, write = one_block_writes(pair, 3)
    pair.p_engine.gate = gate = threading.Event()
    cancelled = trio.CancelScope()
    ended = trio.Event()

    async def cancelled_write() -> None:
        with cancelled:
            await write(2)
        ended.set()

    with trio.fail_after(TIMEOUT):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(write, 0)
            await wait_for_call(pair.p_engine)
            nursery.start_soon(write, 1)
            nursery.start_soon(cancelled_write)
            await trio.testing.wait_all_tasks_blocked()
            cancelled.cancel()
            await ended.wait()  # returned at once: nothing of it was in flight
            gate.set()
    assert cancelled.cancelled_caught
    assert pair.p_engine.call_sizes == [1, 1]  # block 0, then block 1: block 2 never went
    np.testing.assert_array_equal(dst[:2], src[:2])
    assert not dst[2].any()


async def test_before_runs_in_the_worker_thread_right_before_the_engine_call(pair: Pair) -> None:
    src, dst, write = one_block_writes(pair, 1)
    trio_thread = threading.get_ident()
    seen: list[int] = []

    def before() -> None:
        seen.append(threading.get_ident())
        pair.p_engine.log.append("before")

    with trio.fail_after(TIMEOUT):
        await write(0, before)
    assert seen and seen[0] != trio_thread
    assert pair.p_engine.log == ["before", "call 1"]
    np.testing.assert_array_equal(dst, src)


async def test_a_before_that_raises_fails_only_its_write(pair: Pair) -> None:
    src, dst, write = one_block_writes(pair, 3)
    pair.p_engine.gate = gate = threading.Event()

    def broken() -> None:
        raise RuntimeError("CUDA error: an illegal memory access")

    async def failing() -> None:
        with pytest.raises(DataPlaneError, match="not complete: RuntimeError: CUDA error"):
            await write(1, broken)

    with trio.fail_after(TIMEOUT):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(write, 0)
            await wait_for_call(pair.p_engine)
            nursery.start_soon(failing)
            nursery.start_soon(write, 2)
            await trio.testing.wait_all_tasks_blocked()
            gate.set()
    assert pair.p_engine.call_sizes == [1, 1]  # block 1's write was left out of the call
    np.testing.assert_array_equal(dst[[0, 2]], src[[0, 2]])
    assert not dst[1].any()
    assert pair.p.statistics().failures == 1


async def test_an_engine_call_that_raises_fails_its_writes_with_a_transfer_error(
    pair: Pair,
) -> None:
    """A binding that raises instead of returning a code: each write the call carried gets a
    TransferError naming the exception (a sender catches it and keeps serving)."""
    src, dst, write = one_block_writes(pair, 2)
    real = pair.p_engine.inner

    class Raising:
        def batch_transfer_sync_write(self, *args: Any) -> int:
            raise RuntimeError("binding exploded")

    pair.p_engine.inner = Raising()
    with trio.fail_after(TIMEOUT), pytest.raises(TransferError, match="binding exploded"):
        await write(0)
    pair.p_engine.inner = real
    with trio.fail_after(TIMEOUT):
        await write(1)  # the data plane goes on
    np.testing.assert_array_equal(dst[1], src[1])


class _NullEngine:
    """An engine whose writes land at once, wherever they point (no bytes move)."""

    def register_memory(self, addr: int, length: int) -> int:
        return 0

    def unregister_memory(self, addr: int) -> int:
        return 0

    def batch_transfer_sync_write(
        self, target: str, src: list[int], dst: list[int], lengths: list[int]
    ) -> int:
        return 0


async def test_nothing_is_kept_per_peer_once_its_writes_end() -> None:
    """Every D restart is a new peer (a new session): what the data plane keeps per peer must
    go when the writes to it end, or it grows for as long as P lives."""
    config = DataPlaneConfig(max_descriptors_per_call=2, max_calls_per_peer=1)
    plane = MooncakeDataPlane(_NullEngine(), config, "p:1")
    one = u64([1, 2, 3])
    async with trio.open_nursery() as nursery:
        for n in range(20):  # several writes to each peer at once, sharing its queue
            for _ in range(3):
                nursery.start_soon(partial(plane.write, f"d:{n}", one, one, one))
    with trio.move_on_after(0):  # cancelled before its first call
        await plane.write("d:gone", one, one, one)
    assert plane.statistics().writes == 60
    assert plane._per_peer == {}


# ---------------------------------------------------------------------- after (issue 28)


@pytest.fixture
async def split_pair(engines: tuple[Any, Any]) -> AsyncIterator[Pair]:
    """Writes cut into pieces of 2 descriptors (one engine call each)."""
    config = DataPlaneConfig(max_descriptors_per_call=2)
    made = make_pair(engines, config)
    try:
        yield made
    finally:
        made.p.close()
        made.d.close()


def scattered(pair: Pair, count: int, size: int = 4 * KiB) -> tuple[Any, Any, Any, Any, Any]:
    """Registered buffers and ``count`` one-block descriptors, block i to block i."""
    src, dst = pair.buffers(count * size)
    offsets = np.arange(count, dtype=np.uint64) * np.uint64(size)
    return src, dst, addr(src) + offsets, addr(dst) + offsets, np.full(count, size, np.uint64)


async def test_after_runs_once_when_the_last_of_several_calls_landed(split_pair: Pair) -> None:
    src, dst, s, d, n = scattered(split_pair, 9)
    trio_thread = threading.get_ident()
    seen: list[tuple[int, bool]] = []

    def after() -> None:  # every byte is in D's memory by now
        seen.append((threading.get_ident(), bool(np.array_equal(dst, src))))

    with trio.fail_after(TIMEOUT):
        await split_pair.p.write(split_pair.d.session, s, d, n, after=after)
    assert split_pair.p_engine.call_sizes == [2, 2, 2, 2, 1]
    assert len(seen) == 1 and seen[0][0] != trio_thread and seen[0][1]


async def test_after_never_runs_when_a_piece_failed(split_pair: Pair) -> None:
    """The piece before it landed, the one after it is never sent: no ``after``."""
    src, dst, s, d, n = scattered(split_pair, 6)
    d[2] += np.uint64(1 << 40)  # beyond D's registered memory: that piece's call fails
    ran: list[str] = []
    with trio.fail_after(TIMEOUT), pytest.raises(TransferError):
        await split_pair.p.write(split_pair.d.session, s, d, n, after=lambda: ran.append("x"))
    with trio.fail_after(TIMEOUT):  # the rest of what went out has ended
        while split_pair.p_engine.finished < len(split_pair.p_engine.call_sizes):
            await trio.sleep(0.001)
    assert ran == [] and split_pair.p.statistics().failures == 1
    assert split_pair.p_engine.call_sizes == [2, 2]
    np.testing.assert_array_equal(dst[: 2 * 4 * KiB], src[: 2 * 4 * KiB])


async def test_after_never_runs_when_before_raised(pair: Pair) -> None:
    src, dst, write = one_block_writes(pair, 1)
    ran: list[str] = []

    def broken() -> None:
        raise RuntimeError("CUDA error")

    with trio.fail_after(TIMEOUT), pytest.raises(DataPlaneError, match="not complete"):
        await write(0, broken, lambda: ran.append("x"))
    assert ran == [] and pair.p_engine.call_sizes == [] and not dst.any() and src.any()


async def test_writes_sharing_a_call_each_run_their_after_once(pair: Pair) -> None:
    src, dst, write = one_block_writes(pair, 8)
    pair.p_engine.gate = gate = threading.Event()
    ran: list[int] = []
    with trio.fail_after(TIMEOUT):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(write, 0, None, partial(ran.append, 0))
            await wait_for_call(pair.p_engine)
            for i in range(1, 8):
                nursery.start_soon(write, i, None, partial(ran.append, i))
            await trio.testing.wait_all_tasks_blocked()
            gate.set()
    assert pair.p_engine.call_sizes == [1, 7]
    assert sorted(ran) == list(range(8))
    np.testing.assert_array_equal(dst, src)


async def test_a_cancelled_queued_write_runs_no_after(pair: Pair) -> None:
    src, dst, write = one_block_writes(pair, 2)
    pair.p_engine.gate = gate = threading.Event()
    ran: list[int] = []
    cancelled = trio.CancelScope()

    async def cancelled_write() -> None:
        with cancelled:
            await write(1, None, partial(ran.append, 1))

    with trio.fail_after(TIMEOUT):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(write, 0, None, partial(ran.append, 0))
            await wait_for_call(pair.p_engine)
            nursery.start_soon(cancelled_write)
            await trio.testing.wait_all_tasks_blocked()
            cancelled.cancel()
            await trio.testing.wait_all_tasks_blocked()
            gate.set()
    assert cancelled.cancelled_caught and ran == [0] and pair.p_engine.call_sizes == [1]
    np.testing.assert_array_equal(dst[0], src[0])
    assert not dst[1].any()


async def test_an_after_that_raises_is_logged_and_the_write_succeeds(
    pair: Pair, caplog: pytest.LogCaptureFixture
) -> None:
    src, dst, write = one_block_writes(pair, 1)

    def broken() -> None:
        raise RuntimeError("the notice's socket is gone")

    with trio.fail_after(TIMEOUT):
        await write(0, None, broken)
    np.testing.assert_array_equal(dst, src)
    assert "after-landing callback raised" in caplog.text and "socket is gone" in caplog.text
    assert pair.p.statistics().failures == 0


async def test_an_empty_write_runs_its_after_in_a_worker_thread(pair: Pair) -> None:
    empty = u64([])
    seen: list[int] = []
    with trio.fail_after(TIMEOUT):
        await pair.p.write(pair.d.session, empty, empty, empty, after=lambda: seen.append(1))
    assert seen == [1] and pair.p_engine.call_sizes == []


async def test_after_runs_once_per_write_under_concurrent_calls() -> None:
    """Pieces of one write land in calls that return at once in several threads: each write's
    ``after`` still runs exactly once."""
    config = DataPlaneConfig(workers=4, max_descriptors_per_call=1, max_calls_per_peer=4)
    plane = MooncakeDataPlane(_NullEngine(), config, "p:1")
    five = u64([1, 2, 3, 4, 5])
    ran: list[int] = []
    with trio.fail_after(TIMEOUT):
        async with trio.open_nursery() as nursery:
            for i in range(40):
                write = partial(plane.write, f"d:{i % 3}", five, five, five)
                nursery.start_soon(partial(write, after=partial(ran.append, i)))
    assert sorted(ran) == list(range(40))


# ---------------------------------------------------------- calls in the Trio thread (issue 28)


@pytest.fixture
async def inline_pair(engines: tuple[Any, Any]) -> AsyncIterator[Pair]:
    """Calls of at most 8 KiB whose writes wait for nothing are made in the Trio thread."""
    made = make_pair(engines, DataPlaneConfig(inline_max_bytes=8 * KiB))
    try:
        yield made
    finally:
        made.p.close()
        made.d.close()


def call_threads(pair: Pair) -> list[int]:
    """The threads P's engine calls are made in, from now on."""
    threads: list[int] = []
    engine = pair.p_engine
    call = engine.batch_transfer_sync_write

    def spy(target: str, src: list[int], dst: list[int], lengths: list[int]) -> int:
        threads.append(threading.get_ident())
        return call(target, src, dst, lengths)

    engine.batch_transfer_sync_write = spy  # type: ignore[method-assign]
    return threads


class _Event:
    """A ``before`` with a ``ready`` probe, as a CUDA event's wait is given one."""

    def __init__(self, done: bool) -> None:
        self.done, self.waited = done, 0

    def __call__(self) -> None:
        self.waited += 1

    def ready(self) -> bool:
        return self.done


async def test_a_small_call_that_waits_for_nothing_is_made_in_the_trio_thread(
    inline_pair: Pair,
) -> None:
    src, dst, write = one_block_writes(inline_pair, 4)
    threads, trio_thread = call_threads(inline_pair), threading.get_ident()
    after: list[int] = []
    with trio.fail_after(TIMEOUT):
        await write(0, after=lambda: after.append(threading.get_ident()))
        await write(1, before=_Event(done=True))  # the KV is complete: nothing to wait for
    assert threads == [*after, trio_thread] == [trio_thread] * 2
    assert inline_pair.p.statistics().inline_calls == 2
    np.testing.assert_array_equal(dst[:2], src[:2])


async def test_a_call_that_may_wait_or_is_large_goes_to_a_worker_thread(
    inline_pair: Pair,
) -> None:
    src, dst, write = one_block_writes(inline_pair, 3, size=4 * KiB)
    threads, trio_thread = call_threads(inline_pair), threading.get_ident()
    pending = _Event(done=False)
    with trio.fail_after(TIMEOUT):
        await write(0, before=pending)  # the KV may not be complete yet: the thread waits
        await write(1, before=lambda: None)  # a wait with no probe
        big_src, big_dst = inline_pair.buffers(16 * KiB)  # over inline_max_bytes
        await inline_pair.p.write(
            inline_pair.d.session, u64([addr(big_src)]), u64([addr(big_dst)]), u64([16 * KiB])
        )
    assert len(threads) == 3 and trio_thread not in threads
    assert pending.waited == 1 and inline_pair.p.statistics().inline_calls == 0
    np.testing.assert_array_equal(dst[:2], src[:2])
    np.testing.assert_array_equal(big_dst, big_src)


async def test_a_failed_call_in_the_trio_thread_fails_its_write_as_in_a_thread(
    inline_pair: Pair,
) -> None:
    src, _ = inline_pair.buffers(4 * KiB)
    with trio.fail_after(TIMEOUT), pytest.raises(TransferError) as info:
        await inline_pair.p.write(
            inline_pair.d.session, u64([addr(src)]), u64([1 << 40]), u64([4 * KiB])
        )
    assert info.value.nbytes == 4 * KiB and inline_pair.p.statistics().inline_calls == 1
    assert inline_pair.p.statistics().failures == 1


async def test_a_small_write_behind_a_call_in_flight_queues_for_the_peers_call(
    inline_pair: Pair,
) -> None:
    """A write that could be made at once in the Trio thread still keeps the per-peer limit:
    with the peer's one call in a worker thread, it queues and goes in the next call."""
    src, dst, write = one_block_writes(inline_pair, 2)
    threads, trio_thread = call_threads(inline_pair), threading.get_ident()
    inline_pair.p_engine.gate = gate = threading.Event()
    with trio.fail_after(TIMEOUT):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(partial(write, 0, before=_Event(done=False)))  # to a thread
            await wait_for_call(inline_pair.p_engine)
            nursery.start_soon(write, 1)
            await trio.testing.wait_all_tasks_blocked()
            assert inline_pair.p_engine.call_sizes == [1]  # write 1 waits for the free call
            gate.set()
    assert inline_pair.p_engine.call_sizes == [1, 1] and threads[1] == trio_thread
    assert inline_pair.p_engine.max_in_flight == 1
    np.testing.assert_array_equal(dst, src)


async def test_a_ready_write_whose_wait_raises_fails_without_a_call_in_the_trio_thread(
    inline_pair: Pair,
) -> None:
    class Broken(_Event):
        def __call__(self) -> None:
            raise RuntimeError("the stream died")

    _, _, write = one_block_writes(inline_pair, 1)
    after: list[int] = []
    with trio.fail_after(TIMEOUT), pytest.raises(DataPlaneError, match="the stream died"):
        await write(0, before=Broken(done=True), after=lambda: after.append(1))
    stats = inline_pair.p.statistics()
    assert inline_pair.p_engine.call_sizes == [] and after == []
    assert (stats.failures, stats.writes, stats.inline_calls) == (1, 0, 1)
    await write(0)  # the data plane goes on
    assert inline_pair.p.statistics().writes == 1


async def test_an_engine_call_that_raises_in_the_trio_thread_fails_only_its_write(
    inline_pair: Pair,
) -> None:
    src, dst, write = one_block_writes(inline_pair, 2)
    engine = inline_pair.p_engine
    call = engine.batch_transfer_sync_write

    def broken(*args: Any) -> int:
        raise RuntimeError("binding blew up")

    engine.batch_transfer_sync_write = broken  # type: ignore[method-assign]
    after: list[int] = []
    with trio.fail_after(TIMEOUT), pytest.raises(TransferError, match="binding blew up"):
        await write(0, after=lambda: after.append(0))
    engine.batch_transfer_sync_write = call  # type: ignore[method-assign]
    with trio.fail_after(TIMEOUT):
        await write(1, after=lambda: after.append(1))
    assert after == [1]
    np.testing.assert_array_equal(dst[1], src[1])
    stats = inline_pair.p.statistics()
    assert (stats.failures, stats.writes, stats.inline_calls) == (1, 1, 2)


async def test_the_actors_move_every_byte_with_calls_in_the_trio_thread() -> None:
    """The actors' transfers through a data plane making every call in the Trio thread (the
    KV is complete, no checksums): every byte lands, every block comes back."""
    from pdactors import ReceiverConfig, SenderConfig
    from pdactors.testing import open_cluster, run_transfer

    plane = DataPlaneConfig(inline_max_bytes=1 << 30)
    async with open_cluster(
        dataplane=plane, sender=SenderConfig(engine_id="p", checksum_kv=False),
        receiver=ReceiverConfig(verify_kv="off"),
    ) as cluster:  # fmt: skip
        outcomes = [await run_transfer(cluster, f"t{i}", 4 + i) for i in range(4)]
        assert all(o.ok and o.verified for o in outcomes), outcomes
        stats = cluster.prefill[0].dataplane.statistics()
        assert stats.inline_calls == stats.calls >= 4
        await cluster.wait_settled()
