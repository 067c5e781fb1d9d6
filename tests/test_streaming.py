"""Layer-wise streaming: P's sender writes each layer into D while P still computes the rest.

Real sender and receiver actors, real ZMQ and Mooncake TCP on loopback. "Computing" a layer is
filling P's blocks of that region with the expected bytes, then ``layer_ready``; every test ends
with every block back in its pool.
"""

from __future__ import annotations

import threading

import numpy as np
import trio
import trio.testing

from pdactors import PullFailedError, ReceiverConfig, SenderConfig
from pdactors.core.send_table import SendState
from pdactors.testing import Cluster, FaultyDataPlane, open_cluster
from tests.conftest import PATIENT, wait_until

LAYERS, N = 4, 6
SMALL = {"layers": LAYERS, "num_blocks": 64, "block_bytes": 4096}


class Streamed:
    """One transfer: P's blocks (allocated, not yet computed), D's blocks, D's pull."""

    def __init__(self, cluster: Cluster, tid: str) -> None:
        self.cluster, self.tid = cluster, tid
        self.p, self.d = cluster.prefill[0], cluster.decode[0]
        self.src = self.p.pool.allocate(N)
        self.p.owned[tid] = self.src
        self.dst = self.d.pool.allocate(N)
        self.want = self.p.kv.expected(tid, N)
        self.result: BaseException | None = None
        self.ended = trio.Event()

    async def pull(self) -> None:
        try:
            await self.d.receiver.pull(
                self.tid,
                bootstrap_url=self.cluster.bootstrap_url,
                engine_id=self.p.engine_id,
                block_ids=self.dst,
            )
        except PullFailedError as exc:
            self.result = exc
        finally:
            self.ended.set()

    def compute(self, layer: int) -> None:
        self.p.kv.data[layer, self.src, :] = self.want[layer]

    async def delivered(self) -> None:
        """D's pull ended with every byte in place; then every block is back."""
        with trio.fail_after(5):
            await self.ended.wait()
        assert self.result is None and self.d.kv.verify(self.tid, self.dst, N)
        self.d.pool.free(self.dst)
        await self.cluster.wait_settled()

    def landed(self, layer: int) -> bool:
        return bool(np.array_equal(self.d.kv.data[layer, self.dst, :], self.want[layer]))


def giving_up(t: Streamed) -> SendState | None:
    """Who gave the transfer up, as P's record of it says (None: nobody)."""
    return t.p.sender._table._entries[t.tid].giving_up


class Kernel:
    """A ``complete`` callback (a GPU event's wait): says when a write waits on it
    (``waited``), returns once ``done`` is set."""

    def __init__(self) -> None:
        self.waited, self.done = threading.Event(), threading.Event()

    def wait(self) -> None:
        self.waited.set()
        self.done.wait(10)


async def pull_waiting(t: Streamed, nursery: trio.Nursery) -> None:
    t.p.sender.transfer_pending(t.tid)
    nursery.start_soon(t.pull)
    await wait_until(lambda: t.p.sender.pulls_waiting(t.tid) == 1)  # the pull reached P


async def test_each_layer_lands_on_d_before_the_prefill_ends() -> None:
    with trio.fail_after(30):
        async with open_cluster(**SMALL) as cluster, trio.open_nursery() as nursery:
            t = Streamed(cluster, "s1")
            await pull_waiting(t, nursery)
            t.p.sender.transfer_streaming(t.tid, t.src)
            assert t.p.sender.transfer_state(t.tid) is SendState.SENDING
            for layer in range(LAYERS - 1):  # the last layer goes out with "ready"
                t.compute(layer)
                t.p.sender.layer_ready(t.tid, [layer])
                await wait_until(lambda layer=layer: t.landed(layer))  # type: ignore[misc]
                assert not t.landed(layer + 1) and not t.ended.is_set()  # D is not told yet
            t.compute(LAYERS - 1)
            t.p.sender.transfer_ready(t.tid, t.src)
            await t.delivered()
            assert t.p.sender.bytes_sent == LAYERS * N * 4096  # each layer written once


async def test_a_layer_reported_twice_is_written_once() -> None:
    with trio.fail_after(30):
        async with open_cluster(**SMALL) as cluster, trio.open_nursery() as nursery:
            t = Streamed(cluster, "s2")
            await pull_waiting(t, nursery)
            t.p.sender.transfer_streaming(t.tid, t.src)
            for layer in range(LAYERS):
                t.compute(layer)
            t.p.sender.layer_ready(t.tid, [0, 1])
            t.p.sender.layer_ready(t.tid, [1, 2])
            t.p.sender.transfer_ready(t.tid, t.src)
            await t.delivered()
            assert t.p.sender.bytes_sent == LAYERS * N * 4096


async def test_streaming_before_the_pull_falls_back_to_the_whole_send() -> None:
    with trio.fail_after(30):
        async with open_cluster(**SMALL) as cluster, trio.open_nursery() as nursery:
            t = Streamed(cluster, "s3")
            t.p.sender.transfer_pending(t.tid)
            t.p.sender.transfer_streaming(t.tid, t.src)  # no pull yet: nothing to stream to
            assert t.p.sender.transfer_state(t.tid) is SendState.PENDING
            for layer in range(LAYERS):
                t.compute(layer)
                t.p.sender.layer_ready(t.tid, [layer])  # ignored
            t.p.sender.transfer_ready(t.tid, t.src)
            assert t.p.sender.transfer_state(t.tid) is SendState.READY
            nursery.start_soon(t.pull)
            await t.delivered()


async def test_dropped_mid_stream_fails_the_pull_and_frees_both_sides() -> None:
    with trio.fail_after(30):
        async with open_cluster(**SMALL) as cluster, trio.open_nursery() as nursery:
            t = Streamed(cluster, "s4")
            await pull_waiting(t, nursery)
            t.p.sender.transfer_streaming(t.tid, t.src)
            t.compute(0)
            t.p.sender.layer_ready(t.tid, [0])
            await wait_until(lambda: t.landed(0))
            t.p.sender.transfer_dropped(t.tid, "request aborted")  # P's request went away
            with trio.fail_after(5):
                await t.ended.wait()
            assert isinstance(t.result, PullFailedError) and "aborted" in str(t.result)
            assert t.p.sender.transfer_state(t.tid) is SendState.FAILED
            t.d.pool.free(t.dst)
            await cluster.wait_settled()


async def test_d_abort_mid_stream_is_confirmed_only_once_the_writes_ended() -> None:
    with trio.fail_after(30):
        async with open_cluster(**SMALL) as cluster:
            t = Streamed(cluster, "s5")
            t.p.sender.transfer_pending(t.tid)
            t.d.receiver.start_pull(
                t.tid,
                bootstrap_url=cluster.bootstrap_url,
                engine_id=t.p.engine_id,
                block_ids=t.dst,
            )
            await wait_until(lambda: t.p.sender.pulls_waiting(t.tid) == 1)  # the pull reached P
            t.p.sender.transfer_streaming(t.tid, t.src)
            t.compute(0)
            t.p.sender.layer_ready(t.tid, [0])
            t.d.receiver.abort(t.tid, "client went away")
            await wait_until(lambda: giving_up(t) is SendState.CANCELLED)  # the abort reached P
            # P may still write into D's blocks: it has not answered, so D must not reuse them
            assert t.p.sender.transfer_state(t.tid) is SendState.SENDING
            assert t.p.sender.pulls_waiting(t.tid) == 1 and t.d.receiver.in_flight == 1
            t.p.sender.transfer_ready(t.tid, t.src)  # P's step ends; the rest is written
            await wait_until(lambda: t.d.receiver.in_flight == 0)
            t.d.pool.free(t.dst)
            await cluster.wait_settled()


async def test_a_stream_p_never_finishes_ends_at_ready_timeout(
    mock_clock: trio.testing.MockClock,
) -> None:
    """The last resort: P's step never ends. D hears at ready_timeout, P's blocks are released
    (a step that hung that long means a dead engine)."""
    sender = SenderConfig(engine_id="p", ready_timeout=5, tick_interval=0.5, register_timeout=1e6)
    receiver = ReceiverConfig(pull_timeout=1000, lookup_timeout=1e6, liveness=PATIENT)
    async with (
        open_cluster(sender=sender, receiver=receiver, **SMALL) as cluster,
        trio.open_nursery() as nursery,
    ):
        t = Streamed(cluster, "s6")
        await pull_waiting(t, nursery)
        start = trio.current_time()
        t.p.sender.transfer_streaming(t.tid, t.src)
        with trio.fail_after(100):
            await t.ended.wait()
        assert isinstance(t.result, PullFailedError) and "did not finish" in str(t.result)
        assert 5 <= trio.current_time() - start < 7
        t.d.pool.free(t.dst)
        t.p.sender.transfer_ready(t.tid, t.src)  # a late word from P changes nothing
        with trio.fail_after(5):
            await cluster.wait_settled()


async def test_a_failed_layer_write_is_reported_once_p_is_done() -> None:
    planes: list[FaultyDataPlane] = []

    def faulty(plane: object) -> FaultyDataPlane:
        planes.append(FaultyDataPlane(plane, fail_writes=1))  # type: ignore[arg-type]
        return planes[-1]

    with trio.fail_after(30):
        async with (
            open_cluster(wrap_prefill=faulty, **SMALL) as cluster,
            trio.open_nursery() as nursery,
        ):
            t = Streamed(cluster, "s7")
            await pull_waiting(t, nursery)
            t.p.sender.transfer_streaming(t.tid, t.src)
            t.compute(0)
            t.p.sender.layer_ready(t.tid, [0])  # this write fails
            await wait_until(lambda: planes[0].fail_writes == 0)  # it failed
            # P may still compute into its blocks: D is not answered until P is done
            assert t.p.sender.transfer_state(t.tid) is SendState.SENDING
            assert t.p.sender.pulls_waiting(t.tid) == 1 and not t.ended.is_set()
            t.p.sender.layer_ready(t.tid, [1])  # not written any more
            t.p.sender.transfer_ready(t.tid, t.src)
            with trio.fail_after(5):
                await t.ended.wait()
            assert isinstance(t.result, PullFailedError)
            t.d.pool.free(t.dst)
            await cluster.wait_settled()


async def test_a_layer_still_being_computed_is_written_once_complete() -> None:
    """``complete`` (a GPU event's wait): the layer's write waits for it in the engine's
    thread, and so does the rest's at ``transfer_ready``."""
    with trio.fail_after(30):
        async with open_cluster(**SMALL) as cluster, trio.open_nursery() as nursery:
            t = Streamed(cluster, "s9")
            await pull_waiting(t, nursery)
            t.p.sender.transfer_streaming(t.tid, t.src)
            layer0, rest = Kernel(), Kernel()
            t.p.sender.layer_ready(t.tid, [0], complete=layer0.wait)
            await wait_until(layer0.waited.is_set)  # the write waits for the "kernel"
            assert not t.landed(0)
            t.compute(0)
            layer0.done.set()
            await wait_until(lambda: t.landed(0))
            t.p.sender.transfer_ready(t.tid, t.src, complete=rest.wait)
            await wait_until(rest.waited.is_set)
            assert not t.ended.is_set()
            for layer in range(1, LAYERS):
                t.compute(layer)
            rest.done.set()
            await t.delivered()
